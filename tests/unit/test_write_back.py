"""The write-back cache of RocksStateBackend under a key-count workload, and the state-key order of
a batch's distinct keys, each against an independent computation (a Counter over the input,
Python's sort of the encoded keys, numpy's lexsort)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from raystream.keys import KeySpace
from raystream.runtime.processors import _state_key_order, group_by_key
from raystream.state.layout import encode_keys, encode_one
from raystream.state import rocks
from raystream.state.rocks import RocksStateBackend


def _count_batches(seed: int, batches: int, rows: int, keys: int) -> list[np.ndarray]:
    """Batches of int keys, Zipf-skewed with a long tail (many keys seen once)."""
    rng = np.random.default_rng(seed)
    return [rng.zipf(1.3, rows).astype(np.int64) % keys - keys // 2 for _ in range(batches)]


def _encode(ks: KeySpace, keys: np.ndarray) -> list[bytes]:
    arr = pa.array(keys, pa.int64())
    kg, sg = ks.locate(arr)
    return encode_keys(kg, sg, 1, arr)


def _count_through(b: RocksStateBackend, encoded: list[bytes]) -> None:
    """One batch of a key-count: read every key (unsorted, repeated), add, write once per key."""
    seen = b.multi_get(encoded)
    per_key: dict[bytes, int] = {}
    for k, v in zip(encoded, seen, strict=True):
        if k not in per_key:
            per_key[k] = int.from_bytes(v, "little") if v is not None else 0
        per_key[k] += 1
    b.write(list(per_key), [n.to_bytes(8, "little") for n in per_key.values()])


def _rocks_rows(b: RocksStateBackend) -> dict[bytes, int]:
    """What RocksDB itself holds (past the cache)."""
    return {k: int.from_bytes(v, "little") for k, v in b._db.items()}  # noqa: SLF001


@pytest.mark.parametrize(
    ("cache_entries", "max_dirty", "cache_bytes"),
    [
        (500_000, None, 64 << 20),
        (3_000, None, 64 << 20),
        (3_000, 64, 64 << 20),
        (500_000, None, 60_000),
        (0, None, 64 << 20),
    ],
    ids=["everything-cached", "evicting", "small-dirty-bound", "bytes-bound", "cache-off"],
)
def test_key_count_through_the_write_back_cache_matches_a_counter(
    tmp_path: Path, cache_entries: int, max_dirty: int | None, cache_bytes: int
) -> None:
    """Counts read and written through the cache equal a Counter over the input: in reads, in a
    snapshot taken midway (the Counter at that moment), and in RocksDB after a flush."""
    ks = KeySpace(16, 4)
    b = RocksStateBackend(
        tmp_path / "db", cache_entries=cache_entries, max_dirty=max_dirty, cache_bytes=cache_bytes
    )
    oracle: Counter[bytes] = Counter()
    try:
        batches = _count_batches(7, 24, 4_000, 20_000)
        for i, keys in enumerate(batches):
            encoded = _encode(ks, keys)
            _count_through(b, encoded)
            oracle.update(encoded)
            if i == 11:
                b.snapshot(tmp_path / "snap")
                at_snapshot = dict(oracle)
        if cache_entries:
            assert len(b._cache) <= cache_entries  # noqa: SLF001 - bounded
            assert len(b._dirty) <= b.max_dirty  # noqa: SLF001
            assert b.cached_bytes() <= cache_bytes
        everything = list(oracle)
        got = b.multi_get(everything)
        assert [int.from_bytes(v, "little") for v in got] == [oracle[k] for k in everything]
        snap = RocksStateBackend(tmp_path / "snap", cache_entries=0)
        try:
            assert _rocks_rows(snap) == at_snapshot
        finally:
            snap.close()
        b.flush_cache()
        assert _rocks_rows(b) == dict(oracle)
    finally:
        b.close()


def test_dirty_entries_stay_in_the_cache_until_they_leave_it(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """By default (max_dirty = cache_entries) writes reach RocksDB only when their entries are
    evicted: a full cache drops its oldest entries down to a small slice under the bound, writes
    exactly the dirty ones among them (sorted), and the dirty entries that stay are neither
    written nor cleaned."""
    written: list[list[bytes]] = []
    real = RocksStateBackend._write_through_now

    def recorded(self, keys, values, deletes=()):  # noqa: ANN001, ANN202
        keys = list(keys)
        written.append(keys)
        return real(self, keys, values, deletes)

    monkeypatch.setattr(RocksStateBackend, "_write_through_now", recorded)
    b = RocksStateBackend(tmp_path / "db", cache_entries=1_000)
    try:
        first = [encode_one(1, 0, 1, i) for i in range(600)]
        b.write(first, [b"a"] * 600)
        clean = [encode_one(2, 0, 1, i) for i in range(300)]
        assert b.multi_get(clean) == [None] * 300  # cached misses: not dirty
        assert written == []  # 900 entries, under the bound: nothing written yet
        later = [encode_one(3, 0, 1, i) for i in range(200)]
        b.write(later, [b"b"] * 200)  # 1,100 > 1,000: the oldest leave, to a slice under it
        gone = 1_100 - 1_000 + 1_000 // rocks.DIRTY_SLICE_FRACTION  # 115, all of first
        assert len(written) == 1
        assert written[0] == sorted(first[:gone])
        assert set(b._dirty) == set(first[gone:]) | set(later)  # noqa: SLF001
        assert len(b._cache) == 1_100 - gone  # noqa: SLF001
        assert _rocks_rows(b).keys() == set(first[:gone])
        assert b.multi_get(first + later) == [b"a"] * 600 + [b"b"] * 200
    finally:
        b.close()


def test_multi_get_keeps_the_callers_order_for_unsorted_and_repeated_keys(tmp_path: Path) -> None:
    """Hits, misses, keys not in RocksDB and repeated keys, in any order: each position gets its
    key's value (a dict over what was written is the oracle)."""
    rng = np.random.default_rng(3)
    b = RocksStateBackend(tmp_path / "db", cache_entries=500)
    try:
        stored = {encode_one(int(g), 0, 1, i): rng.bytes(9) for i, g in enumerate(rng.integers(0, 8, 800))}
        b.write(list(stored), list(stored.values()))
        b.flush_cache()
        some = list(stored)[:200]
        b.multi_get(some)  # these are hits now, the rest misses
        absent = [encode_one(9, 1, 1, i) for i in range(50)]
        asked = [*stored, *absent, *some[:30]]
        order = rng.permutation(len(asked))
        asked = [asked[i] for i in order]
        assert b.multi_get(asked) == [stored.get(k) for k in asked]
        assert b.multi_get(sorted(asked)) == [stored.get(k) for k in sorted(asked)]
    finally:
        b.close()


@pytest.mark.parametrize("groups", [2048, 1 << 20])
def test_state_key_order_is_lexsorts(groups: int) -> None:
    """Distinct int64 keys (negative, extreme) by (sub-group, key): the order np.lexsort gives,
    with sub-group numbers under and over 16 bits."""
    rng = np.random.default_rng(groups)
    keys = np.unique(
        np.concatenate(
            [
                rng.integers(-(2**63), 2**63 - 1, 20_000, dtype=np.int64),
                np.array([-(2**63), -1, 0, 1, 2**63 - 1], np.int64),
            ]
        )
    )
    rng.shuffle(keys)
    gsg = rng.integers(0, groups, len(keys)).astype(np.int64)
    assert np.array_equal(_state_key_order(keys, gsg), np.lexsort((keys, gsg)))
    assert len(_state_key_order(keys[:0], gsg[:0])) == 0


def test_group_by_key_gives_distinct_keys_in_encoded_state_key_order() -> None:
    """The distinct keys of a batch that is not grouped yet come in the byte order of their RocksDB
    keys (Python's sort of the encoded keys is the oracle), each with its records in arrival
    order."""
    ks = KeySpace(128, 16)
    rng = np.random.default_rng(5)
    keys = rng.integers(-(10**15), 10**15, 1_500)[rng.integers(0, 1_500, 5_000)]  # repeats
    batch = pa.record_batch({"key": pa.array(keys, pa.int64()), "seq": np.arange(len(keys))})
    kb = group_by_key(batch, batch.column("key"), ks, "key")
    encoded = kb.keys.encoded(1)
    assert encoded == sorted(encoded)
    assert len(set(encoded)) == len(encoded) == len(set(keys.tolist()))
    for i in range(len(kb.keys)):
        rec = kb.records_of(i)
        assert set(rec.column("key").to_pylist()) == {kb.keys.keys[i].as_py()}
        seq = rec.column("seq").to_numpy()
        assert (np.diff(seq) > 0).all()
    assert Counter(kb.records.column("key").to_pylist()) == Counter(keys.tolist())


def test_a_pending_checkpoint_lets_the_cache_overshoot_before_a_write_waits(tmp_path: Path) -> None:
    """While a checkpoint thread writes the dirty entries it took, writes go on into the cache up
    to its bound plus the slack without waiting; past that a write waits for the checkpoint; once
    it is done the cache is back under its bound, and the checkpoint holds only what was written
    before it was asked for (every key then counted once) while RocksDB and the cache hold all."""
    import threading
    from concurrent.futures import Future

    b = RocksStateBackend(tmp_path / "db", cache_entries=100)
    first = [encode_one(0, 0, 1, i.to_bytes(8, "big")) for i in range(80)]
    b.write(first, [(1).to_bytes(8, "little")] * len(first))
    b.snapshot(tmp_path / "ck0")  # every entry clean and in RocksDB
    gate: Future[None] = Future()
    real = b.snapshot_async(tmp_path / "ck1")
    held = Future()  # the checkpoint as the instance sees it: pending until the gate opens

    def finish() -> None:
        gate.result()
        held.set_result(real.result())

    threading.Thread(target=finish, daemon=True).start()
    b._pending = held
    allowed = int(100 * (1 + rocks.PENDING_SNAPSHOT_SLACK))
    assert allowed >= 120, "the slack lets a cache of 100 entries hold at least 120"
    more = [encode_one(0, 0, 1, i.to_bytes(8, "big")) for i in range(80, 120)]
    opens = threading.Timer(1.0, gate.set_result, (None,))
    opens.start()  # (so that a write that waits does not wait for ever)
    t0 = time.perf_counter()
    b.write(more, [(1).to_bytes(8, "little")] * len(more))  # under bound + slack: no wait
    assert time.perf_counter() - t0 < 0.5
    assert len(b._cache) == 120
    assert not held.done()
    past = [encode_one(0, 0, 1, i.to_bytes(8, "big")) for i in range(120, allowed + 20)]
    b.write(past, [(1).to_bytes(8, "little")] * len(past))  # over: waits for the checkpoint
    assert held.done()
    opens.join()
    assert len(b._cache) <= 100
    everything = first + more + past
    assert [int.from_bytes(v, "little") for v in b.multi_get(everything)] == [1] * len(everything)
    b.flush_cache()
    b.close()
    ck = RocksStateBackend(tmp_path / "ck1")
    got = ck.multi_get(everything)
    assert got[: len(first)] == [(1).to_bytes(8, "little")] * len(first)
    assert got[len(first) :] == [None] * (len(everything) - len(first))
    ck.close()


@pytest.mark.parametrize("touch", ["read", "write"])
def test_a_full_cache_evicts_the_least_recently_used(tmp_path: Path, touch: str) -> None:
    """The cache's order is recency: keys read (hits) or written move to the end, so a hot key
    read or rewritten every batch stays cached when the cache fills, and the keys evicted are
    the ones untouched longest; only they are read from RocksDB again (``db_reads``)."""
    b = RocksStateBackend(tmp_path / "db", cache_entries=1_000)
    try:
        old = [encode_one(1, 0, 1, i) for i in range(600)]
        b.write(old, [b"o"] * 600)
        hot = old[:50]  # the first written: a FIFO cache would evict them first
        if touch == "read":
            assert b.multi_get(hot) == [b"o"] * 50
        else:
            b.write(hot, [b"h"] * 50)
        new = [encode_one(2, 0, 1, i) for i in range(500)]
        b.write(new, [b"n"] * 500)  # 1,100 > 1,000: 115 leave
        gone = 1_100 - 1_000 + 1_000 // rocks.DIRTY_SLICE_FRACTION
        reads = b.db_reads
        want = b"o" if touch == "read" else b"h"
        assert b.multi_get(hot) == [want] * 50
        assert b.multi_get(new) == [b"n"] * 500
        assert b.multi_get(old[50 + gone :]) == [b"o"] * (550 - gone)
        assert b.db_reads == reads  # all still cached
        assert b.multi_get(old[50 : 50 + gone]) == [b"o"] * gone
        assert b.db_reads == reads + gone  # the least recently used left, written first
    finally:
        b.close()
