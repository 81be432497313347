"""RocksStateBackend on a real RocksDB (rocksdict) in tmp_path, against a python dict oracle."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from raystream.errors import StateError
from raystream.state.layout import encode_one, split_prefix
from raystream.state.rocks import STATE_CHUNK_SCHEMA, RocksStateBackend


@pytest.fixture
def backend(tmp_path: Path):
    b = RocksStateBackend(tmp_path / "db" / "a")
    yield b
    b.close()


def make_rows(n: int, seed: int, kgs=(0, 1, 5, 127), sgs=(0, 1, 15), sids=(0, 1, 2)) -> dict[bytes, bytes]:
    """Random state rows spread over a few key groups, sub-groups and state ids."""
    rng = np.random.default_rng(seed)
    rows: dict[bytes, bytes] = {}
    for _ in range(n):
        kg = int(rng.choice(kgs))
        sg = int(rng.choice(sgs))
        sid = int(rng.choice(sids))
        key: object = int(rng.integers(-(10**12), 10**12)) if rng.random() < 0.5 else f"k{rng.integers(10**6)}"
        rows[encode_one(kg, sg, sid, key)] = rng.bytes(int(rng.integers(0, 64)))
    return rows


def put_all(b: RocksStateBackend, rows: dict[bytes, bytes]) -> None:
    items = list(rows.items())
    b.write([k for k, _ in items], [v for _, v in items])


def all_rows(b: RocksStateBackend) -> dict[bytes, bytes]:
    return dict(b.scan(b"", b"\xff" * 8))


def chunk_rows(chunks) -> list[tuple[bytes, bytes]]:
    out = []
    for c in chunks:
        assert c.schema == STATE_CHUNK_SCHEMA
        out += list(zip(c.column("key").to_pylist(), c.column("value").to_pylist()))
    return out


def test_write_get_multi_get_delete(backend: RocksStateBackend) -> None:
    rows = make_rows(500, 1)
    put_all(backend, rows)
    keys = list(rows)
    missing = [encode_one(3, 3, 3, 99), encode_one(0, 0, 0, "nope")]
    assert backend.multi_get(keys + missing) == [rows[k] for k in keys] + [None, None]
    assert backend.multi_get([]) == []
    assert backend.get(keys[0]) == rows[keys[0]]
    # puts and deletes in one batch
    dels = keys[:50]
    backend.write([keys[60]], [b"new"], deletes=dels)
    for k in dels:
        rows.pop(k)
    rows[keys[60]] = b"new"
    assert all_rows(backend) == rows
    backend.write([], [])  # empty batch is a no-op
    assert backend.count_rows() == len(rows)
    with pytest.raises(ValueError):
        backend.write([b"a"], [])  # keys and values must pair up


def test_scan_is_ordered_and_respects_bounds(backend: RocksStateBackend) -> None:
    rows = make_rows(400, 2)
    put_all(backend, rows)
    ordered = sorted(rows)
    lo, hi = ordered[100], ordered[300]
    got = list(backend.scan(lo, hi))
    assert [k for k, _ in got] == ordered[100:300]
    assert all(v == rows[k] for k, v in got)
    prefix = ordered[0][:2]
    assert [k for k, _ in backend.scan_prefix(prefix)] == [k for k in ordered if k.startswith(prefix)]


def test_export_sub_group_returns_exactly_its_rows(backend: RocksStateBackend) -> None:
    rows = make_rows(1500, 3)
    put_all(backend, rows)
    for kg in (0, 1, 5, 127, 77):
        for sg in (0, 1, 15, 2):
            chunk = backend.export_sub_group(kg, sg)
            assert isinstance(chunk, pa.RecordBatch) and chunk.schema == STATE_CHUNK_SCHEMA
            got = dict(chunk_rows([chunk]))
            expected = {k: v for k, v in rows.items() if split_prefix(k)[:2] == (kg, sg)}
            assert got == expected
            assert chunk.num_rows == len(expected)


def test_export_key_groups_in_bounded_chunks(backend: RocksStateBackend) -> None:
    rows = make_rows(3000, 4)
    put_all(backend, rows)
    chosen = [1, 127, 0]
    chunk_bytes = 1024
    chunks = list(backend.export_key_groups(chosen, chunk_bytes=chunk_bytes))
    max_row = max(len(k) + len(v) for k, v in rows.items())
    assert len(chunks) > 5
    for c in chunks:
        size = sum(len(k) + len(v) for k, v in chunk_rows([c]))
        assert 0 < size < chunk_bytes + max_row
    got = chunk_rows(chunks)
    expected = {k: v for k, v in rows.items() if split_prefix(k)[0] in chosen}
    assert len(got) == len(expected)  # no duplicates
    assert dict(got) == expected
    assert list(backend.export_key_groups([99])) == []


def test_import_chunk_into_another_backend(tmp_path: Path, backend: RocksStateBackend) -> None:
    rows = make_rows(1000, 5)
    put_all(backend, rows)
    other = RocksStateBackend(tmp_path / "b")
    try:
        n = sum(other.import_chunk(c) for c in backend.export_key_groups([5, 1], chunk_bytes=500))
        expected = {k: v for k, v in rows.items() if split_prefix(k)[0] in (5, 1)}
        assert n == len(expected)
        assert all_rows(other) == expected
        # a Table works too; wrong columns are refused
        other.import_chunk(pa.Table.from_batches([backend.export_sub_group(0, 0)]))
        expected.update({k: v for k, v in rows.items() if split_prefix(k)[:2] == (0, 0)})
        assert all_rows(other) == expected
        with pytest.raises(StateError, match=r"\['key', 'value'\].*\['k', 'v'\]"):
            other.import_chunk(pa.record_batch({"k": [b"x"], "v": [b"y"]}))
    finally:
        other.close()


def test_drop_sub_group_removes_exactly_that_range(backend: RocksStateBackend) -> None:
    rows = make_rows(2000, 6)
    put_all(backend, rows)
    backend.drop_sub_group(1, 1)
    backend.drop_sub_group(127, 15)
    expected = {k: v for k, v in rows.items() if split_prefix(k)[:2] not in {(1, 1), (127, 15)}}
    assert len(expected) < len(rows)
    assert all_rows(backend) == expected
    assert backend.export_sub_group(1, 1).num_rows == 0


def test_drop_key_group_removes_exactly_that_range(backend: RocksStateBackend) -> None:
    rows = make_rows(2000, 7)
    put_all(backend, rows)
    backend.drop_key_group(1)
    expected = {k: v for k, v in rows.items() if split_prefix(k)[0] != 1}
    assert len(expected) < len(rows)
    assert all_rows(backend) == expected


def test_edge_key_groups_and_sub_groups(backend: RocksStateBackend) -> None:
    rows = make_rows(1000, 8, kgs=(32766, 32767), sgs=(0, 254, 255), sids=(0, 255))
    put_all(backend, rows)
    assert dict(chunk_rows([backend.export_sub_group(32767, 255)])) == {
        k: v for k, v in rows.items() if split_prefix(k)[:2] == (32767, 255)
    }
    backend.drop_key_group(32767)
    assert all_rows(backend) == {k: v for k, v in rows.items() if split_prefix(k)[0] == 32766}


def test_snapshot_and_restore_key_groups(tmp_path: Path, backend: RocksStateBackend) -> None:
    rows = make_rows(2000, 9)
    put_all(backend, rows)
    snap = backend.snapshot(tmp_path / "snaps" / "s1")
    assert (snap / "CURRENT").exists()
    # writes after the snapshot are not in it
    backend.write([encode_one(5, 0, 1, 1)], [b"late"])
    backend.drop_key_group(127)
    target = RocksStateBackend(tmp_path / "restored")
    try:
        target.write([encode_one(1, 0, 1, "pre")], [b"kept"])
        n = target.restore_key_groups(snap, [127, 5])
        expected = {k: v for k, v in rows.items() if split_prefix(k)[0] in (127, 5)}
        assert n == len(expected)
        expected[encode_one(1, 0, 1, "pre")] = b"kept"
        assert all_rows(target) == expected
    finally:
        target.close()
    # the snapshot can be restored from again (it was opened read-only)
    again = RocksStateBackend(tmp_path / "again")
    try:
        again.restore_key_groups(snap, [0])
        assert all_rows(again) == {k: v for k, v in rows.items() if split_prefix(k)[0] == 0}
    finally:
        again.close()


def test_snapshot_into_existing_dir_fails(tmp_path: Path, backend: RocksStateBackend) -> None:
    d = tmp_path / "exists"
    d.mkdir()
    with pytest.raises(StateError, match="already exists"):
        backend.snapshot(d)


def test_restore_from_non_snapshot_dir_fails(tmp_path: Path, backend: RocksStateBackend) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    with pytest.raises(StateError, match="not a raystream state snapshot"):
        backend.restore_key_groups(d, [0])
    with pytest.raises(StateError):
        backend.restore_key_groups(tmp_path / "missing", [0])


def test_destroy_removes_folder(tmp_path: Path) -> None:
    b = RocksStateBackend(tmp_path / "gone")
    b.write([b"\x00\x00\x00\x01k"], [b"v"])
    b.destroy()
    assert not (tmp_path / "gone").exists()
    b.close()  # idempotent


def test_rows_survive_close_and_reopen(tmp_path: Path) -> None:
    rows = make_rows(300, 10)
    b = RocksStateBackend(tmp_path / "persist")
    put_all(b, rows)
    b.close()
    b2 = RocksStateBackend(tmp_path / "persist")
    try:
        assert all_rows(b2) == rows
    finally:
        b2.close()


def _snapshot_rows(snap: Path) -> dict[bytes, bytes]:
    from raystream.state.rocks import snapshot_chunks

    out: dict[bytes, bytes] = {}
    for c in snapshot_chunks(snap, (0, 1, 5, 7, 127)):  # every key group the test writes
        out.update(zip(c.column(0).to_pylist(), c.column(1).to_pylist(), strict=True))
    return out


def test_snapshot_async_holds_the_state_it_was_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writes (cached, direct, range) made while the checkpoint is taken in a thread are not in
    it, and every read sees them; the cache survives the snapshot."""
    import threading

    from raystream.state import rocks

    release = threading.Event()

    real = rocks.Checkpoint

    class HeldCheckpoint:  # the real one, held until the test lets it go
        def __init__(self, db: object) -> None:
            self._real = real(db)

        def create_checkpoint(self, path: str) -> None:
            assert release.wait(10)
            self._real.create_checkpoint(path)

    monkeypatch.setattr(rocks, "Checkpoint", HeldCheckpoint)
    b = RocksStateBackend(tmp_path / "db", cache_entries=50_000, max_dirty=64)
    try:
        rows = make_rows(4_000, 4)
        put_all(b, rows)
        few = make_rows(10, 6)
        put_all(b, few)
        rows.update(few)
        assert b._dirty  # noqa: SLF001 - some writes are still only in the cache
        expected = dict(rows)
        taken = b.snapshot_async(tmp_path / "snap")
        later = make_rows(1_000, 5)  # more than max_dirty: held in the cache meanwhile
        put_all(b, later)
        assert b.multi_get(list(later)) == list(later.values())
        assert not taken.done() and len(b._dirty) >= 64  # noqa: SLF001 - still held
        release.set()
        direct = {encode_one(7, 3, 253, 1): b"timer"}
        b.write_direct(list(direct), list(direct.values()))  # waits for the checkpoint first
        assert taken.result() == tmp_path / "snap"
        assert _snapshot_rows(tmp_path / "snap") == expected
        assert b._cache  # noqa: SLF001 - kept: nothing changed below it
        assert all_rows(b) == {**rows, **later, **direct}
        # a second snapshot after a drop (a range operation waits for nothing pending)
        b.drop_key_group(127)
        b.snapshot(tmp_path / "snap2")
        now = {k: v for k, v in {**rows, **later, **direct}.items() if split_prefix(k)[0] != 127}
        assert _snapshot_rows(tmp_path / "snap2") == now
    finally:
        b.close()


def test_snapshot_async_writes_the_barriers_dirty_entries_off_the_callers_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller only copies the dirty values out: keys overwritten after the barrier keep their
    barrier-time value in the checkpoint and their new one in reads; a cache that overflows
    meanwhile evicts only after the checkpoint thread wrote what it holds; if that thread fails,
    its entries are dirty again and reach RocksDB later."""
    import threading

    from raystream.state import rocks

    release = threading.Event()
    real = rocks.Checkpoint

    class HeldCheckpoint:  # the real one, held until the test lets it go
        def __init__(self, db: object) -> None:
            self._real = real(db)

        def create_checkpoint(self, path: str) -> None:
            assert release.wait(10)
            self._real.create_checkpoint(path)

    monkeypatch.setattr(rocks, "Checkpoint", HeldCheckpoint)
    b = RocksStateBackend(tmp_path / "db", cache_entries=3_000, max_dirty=1_000_000)
    try:
        before = make_rows(2_000, 11)
        put_all(b, before)
        assert len(b._dirty) == len(before)  # noqa: SLF001 - nothing in RocksDB yet
        taken = b.snapshot_async(tmp_path / "snap")
        assert not b._dirty  # noqa: SLF001 - handed to the checkpoint thread
        newer = {k: v + b"+" for k, v in before.items()}
        put_all(b, newer)  # the same keys, after the barrier
        assert b.multi_get(list(newer)) == list(newer.values())
        threading.Timer(0.2, release.set).start()
        more = make_rows(3_000, 12)  # overflows the cache and its slack: evicts after the thread
        put_all(b, more)
        assert taken.done()
        assert _snapshot_rows(tmp_path / "snap") == before
        assert all_rows(b) == {**newer, **more}

        def failing(*_: object) -> None:
            raise OSError("disk full")

        again = make_rows(500, 13)
        put_all(b, again)
        monkeypatch.setattr(b, "_write_through_now", failing)
        failed = b.snapshot_async(tmp_path / "snap2")
        with pytest.raises(OSError, match="disk full"):
            failed.result()
        monkeypatch.undo()
        b.wait_snapshot()
        assert set(again) <= b._dirty.keys()  # noqa: SLF001 - dirty again
        b.flush_cache()
        assert all_rows(b) == {**newer, **more, **again}
    finally:
        b.close()


def test_a_full_write_back_cache_writes_small_slices_of_its_oldest_dirty_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once max_dirty entries are dirty, each write sends at most what it made dirty beyond the
    bound plus max_dirty / DIRTY_SLICE_FRACTION of the oldest to RocksDB (no stall of an eighth of
    the cache at once); every value read back, and scanned from RocksDB, is the last written."""
    from raystream.state import rocks

    written: list[int] = []
    real = RocksStateBackend._write_through_now

    def counted(self, keys, values, deletes=()):  # noqa: ANN001, ANN202
        keys = list(keys)
        written.append(len(keys))
        return real(self, keys, values, deletes)

    monkeypatch.setattr(RocksStateBackend, "_write_through_now", counted)
    max_dirty = 1024
    b = RocksStateBackend(tmp_path / "db", cache_entries=100_000, max_dirty=max_dirty)
    try:
        expected: dict[bytes, bytes] = {}
        for seed in range(60):  # 60 writes of 50 rows each, some keys written again
            rows = make_rows(50, seed % 40)
            put_all(b, rows)
            expected.update(rows)
            assert len(b._dirty) < max_dirty  # noqa: SLF001 - bounded after every write
        slice_ = max_dirty // rocks.DIRTY_SLICE_FRACTION
        assert written, "expected the full cache to write some of its dirty entries"
        assert max(written) <= 50 + slice_, f"one write sent {max(written)} entries at once"
        assert b.multi_get(list(expected)) == list(expected.values())
        b.flush_cache()
        assert all_rows(b) == expected
    finally:
        b.close()


def test_a_reopened_db_keeps_its_table_options(tmp_path: Path) -> None:
    """A DB opened again (prefilled, restored, moved) gets the block cache and bloom filters of
    a new one, not the defaults rocksdict would load from the DB's OPTIONS file (8 MB cache)."""
    from raystream.state.rocks import BLOCK_CACHE_BYTES

    path = tmp_path / "db" / "r"
    first = RocksStateBackend(path, cache_entries=0)
    assert first._db.property_int_value("rocksdb.block-cache-capacity") == BLOCK_CACHE_BYTES
    first.write([b"k"], [b"v"])
    first.close()
    again = RocksStateBackend(path, cache_entries=0)
    try:
        assert again._db.property_int_value("rocksdb.block-cache-capacity") == BLOCK_CACHE_BYTES
        assert again.get(b"k") == b"v"
    finally:
        again.close()
