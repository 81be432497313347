"""Checkpoint storage: incremental RocksDB uploads, manifests, retention, savepoints, against a
plain dict of every key (the oracle) and the files on disk."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from raystream.checkpoint import CheckpointStorage, check_compatible, open_savepoint
from raystream.errors import CheckpointError, RaystreamError
from raystream.state.layout import encode_keys
from raystream.state.rocks import RocksStateBackend, read_snapshot_key_groups

NUM_KEY_GROUPS = 64


def encode(keys: np.ndarray) -> list[bytes]:
    kgs = (keys % NUM_KEY_GROUPS).astype(np.uint16)
    return encode_keys(kgs, np.zeros(len(keys), np.uint8), 0, pa.array(keys, pa.int64()))


def write_keys(
    db: RocksStateBackend, oracle: dict[bytes, bytes], keys: np.ndarray, rng: np.random.Generator
) -> None:
    raw = encode(keys)
    values = [rng.bytes(100) for _ in range(len(raw))]
    db.write(raw, values)
    oracle.update(zip(raw, values, strict=True))


def restored_rows(storage_reader, state: dict, tmp: Path) -> dict[bytes, bytes]:
    local = storage_reader.materialize_state(state, tmp)
    chunks = read_snapshot_key_groups(local, range(NUM_KEY_GROUPS))
    out: dict[bytes, bytes] = {}
    for c in chunks:
        out.update(zip(c.column(0).to_pylist(), c.column(1).to_pylist(), strict=True))
    return out


def small_db(path: Path, seed: int, n: int = 500) -> tuple[RocksStateBackend, dict]:
    rng = np.random.default_rng(seed)
    db = RocksStateBackend(path)
    oracle: dict[bytes, bytes] = {}
    write_keys(db, oracle, np.arange(n, dtype=np.int64), rng)
    return db, oracle


def checkpoint(storage: CheckpointStorage, cid: int, db: RocksStateBackend, tmp: Path) -> dict:
    snap = db.snapshot(tmp / f"snap-{cid}")
    state = storage.upload_state(cid, "count/0", str(snap), db.uid)
    blob = storage.put_blob(cid, "sink/0", "rows", f"blob of {cid}".encode())
    storage.complete(
        cid,
        {
            "job": "j",
            "checkpoint_id": cid,
            "instances": {"count/0": state},
            "blob": blob,
            "steps": {"src": "source", "count": "keyed", "sink": "sink"},
            "num_key_groups": NUM_KEY_GROUPS,
            "sub_groups": 4,
        },
    )
    return state


# ------------------------------------------------------------------------------------------
# incremental uploads


def test_incremental_checkpoint_uploads_only_new_ssts(tmp_path: Path) -> None:
    """~200k keys of 100 bytes in two flushed SST files; then 1% of the keys change. The second
    upload copies only the new SST and the small metadata files; both restore to the oracle."""
    rng = np.random.default_rng(7)
    db = RocksStateBackend(tmp_path / "db", cache_entries=0)
    oracle: dict[bytes, bytes] = {}
    n = 200_000
    for part in np.array_split(rng.permutation(n).astype(np.int64), 2):
        write_keys(db, oracle, part, rng)
        db.flush()
    storage = CheckpointStorage(tmp_path / "chk", "job")
    first = storage.upload_state(1, "count/0", str(db.snapshot(tmp_path / "s1")), db.uid)
    ssts = [f for f in first["files"] if f["name"].endswith(".sst")]
    assert len(ssts) >= 2
    local_total = sum(os.path.getsize(tmp_path / "s1" / f["name"]) for f in first["files"])
    assert first["uploaded_bytes"] == local_total and first["referenced_bytes"] == 0
    first_rows = dict(oracle)
    storage.complete(1, {"job": "job", "state": first})

    write_keys(db, oracle, rng.choice(n, n // 100, replace=False).astype(np.int64), rng)
    db.flush()
    second = storage.upload_state(2, "count/0", str(db.snapshot(tmp_path / "s2")), db.uid)
    storage.complete(2, {"job": "job", "state": second})
    print(
        f"\nfirst checkpoint uploaded {first['uploaded_bytes']} bytes; after 1% of keys "
        f"changed: uploaded {second['uploaded_bytes']}, referenced {second['referenced_bytes']}"
    )
    assert second["uploaded_bytes"] < 0.05 * first["uploaded_bytes"]
    assert second["referenced_bytes"] >= sum(f["size"] for f in ssts) * 0.99
    # Unchanged SSTs are one object in shared/, listed by both checkpoints.
    assert {f["path"] for f in ssts} <= {f["path"] for f in second["files"]}

    m1, m2 = storage.load(1), storage.load(2)
    assert restored_rows(storage, m1["state"], tmp_path / "r1") == first_rows
    assert restored_rows(storage, m2["state"], tmp_path / "r2") == oracle
    # Restoring into a fresh backend through its public API gives the same rows.
    target = RocksStateBackend(tmp_path / "target")
    copied = target.restore_key_groups(tmp_path / "r2", range(NUM_KEY_GROUPS))
    assert copied == len(oracle) == target.count_rows()
    db.close()
    target.close()


def test_db_uid_is_stable_across_reopen(tmp_path: Path) -> None:
    db = RocksStateBackend(tmp_path / "db")
    uid = db.uid
    db.close()
    again = RocksStateBackend(tmp_path / "db")
    assert again.uid == uid and len(uid) == 32
    again.destroy()
    fresh = RocksStateBackend(tmp_path / "db")
    assert fresh.uid != uid
    fresh.close()


def test_upload_from_worker_threads(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    # As the instances get it: pickled (a Ray actor argument), through a file:// URI.
    storage = pickle.loads(pickle.dumps(CheckpointStorage(f"file://{tmp_path}/chk", "job")))
    dbs = [small_db(tmp_path / f"db{i}", seed=i) for i in range(4)]
    snaps = [db.snapshot(tmp_path / f"snap{i}") for i, (db, _) in enumerate(dbs)]
    with ThreadPoolExecutor(4) as pool:
        states = list(
            pool.map(
                lambda i: storage.upload_state(1, f"count/{i}", str(snaps[i]), dbs[i][0].uid),
                range(4),
            )
        )
    storage.complete(1, {"job": "job", "states": states})
    manifest = storage.load(1)
    for i, (_, oracle) in enumerate(dbs):
        assert restored_rows(storage, manifest["states"][i], tmp_path / f"r{i}") == oracle


# ------------------------------------------------------------------------------------------
# manifests, verification, retention


def test_latest_skips_incomplete_and_damaged_checkpoints(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = CheckpointStorage(tmp_path / "chk", "j", retain=5)
    assert storage.latest() is None and storage.checkpoints() == []
    db, oracle = small_db(tmp_path / "db", seed=1)
    state1 = checkpoint(storage, 1, db, tmp_path)
    checkpoint(storage, 2, db, tmp_path)
    root = tmp_path / "chk" / "j"
    # 3: uploaded but never completed
    storage.upload_state(3, "count/0", str(db.snapshot(tmp_path / "s3")), db.uid)
    # 2: a file it references lost bytes
    victim = next(p for p in (root / "chk-2").rglob("MANIFEST-*"))
    victim.write_bytes(victim.read_bytes()[:-1])
    with caplog.at_level(logging.WARNING, logger="raystream.checkpoint"):
        latest = storage.latest()
    assert latest is not None and latest["checkpoint_id"] == 1 and latest["version"] == 1
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "checkpoint 3" in warned and "no _MANIFEST.json" in warned
    assert "checkpoint 2" in warned and "bytes, the manifest recorded" in warned
    assert storage.checkpoints() == [1]
    assert storage.get_blob(latest["blob"]) == b"blob of 1"
    assert restored_rows(storage, latest["instances"]["count/0"], tmp_path / "r") == oracle
    assert latest["instances"]["count/0"] == state1
    with pytest.raises(CheckpointError, match="checkpoint 2 .* cannot be used: file"):
        storage.load(2)
    # 1: unparsable manifest
    (root / "chk-1" / "_MANIFEST.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="raystream.checkpoint"):
        assert storage.latest() is None
    assert "not valid JSON" in caplog.text
    db.close()


def test_complete_refuses_missing_files_and_non_json(tmp_path: Path) -> None:
    storage = CheckpointStorage(tmp_path / "chk", "j")
    with pytest.raises(CheckpointError, match="cannot complete: file 'shared/x/1.sst'"):
        storage.complete(
            1, {"state": {"files": [{"name": "1.sst", "path": "shared/x/1.sst", "size": 3}]}}
        )
    with pytest.raises(CheckpointError, match="must be JSON-able"):
        storage.complete(1, {"offsets": {1, 2}})
    assert storage.latest() is None


def test_retention_keeps_newest_and_deletes_unreferenced_shared_files(tmp_path: Path) -> None:
    storage = CheckpointStorage(tmp_path / "chk", "j", retain=2)
    rng = np.random.default_rng(3)
    db = RocksStateBackend(tmp_path / "db", cache_entries=0)
    oracle: dict[bytes, bytes] = {}
    root = tmp_path / "chk" / "j"
    states = {}
    for cid in range(1, 6):
        write_keys(db, oracle, rng.integers(0, 5000, 300).astype(np.int64), rng)
        db.flush()
        states[cid] = checkpoint(storage, cid, db, tmp_path)
    # an abandoned older checkpoint and a newer one in progress
    assert storage.checkpoints() == [4, 5]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("chk-")) == ["chk-4", "chk-5"]
    manifests = [storage.load(c) for c in (4, 5)]
    needed = {rel for m in manifests for rel in m["storage_files"] if rel.startswith("shared/")}
    stored = {str(p.relative_to(root)) for p in (root / "shared").rglob("*") if p.is_file()}
    assert stored == needed
    assert restored_rows(storage, manifests[1]["instances"]["count/0"], tmp_path / "r") == oracle

    # A checkpoint in progress (uploaded, not complete) keeps its new shared files when an
    # older one completes; an abandoned one below the newest complete one is deleted.
    write_keys(db, oracle, rng.integers(0, 5000, 300).astype(np.int64), rng)
    db.flush()
    in_progress = storage.upload_state(7, "count/0", str(db.snapshot(tmp_path / "s7")), db.uid)
    storage.upload_state(6, "count/0", str(db.snapshot(tmp_path / "s6")), db.uid)
    storage.complete(5, storage.load(5))  # re-completing triggers retention again
    assert storage.checkpoints() == [4, 5] and (root / "chk-6").is_dir()  # 6 may still finish
    for f in in_progress["files"]:
        assert (root / f["path"]).is_file()
    storage.complete(7, {"job": "j", "instances": {"count/0": in_progress}})
    assert storage.checkpoints() == [5, 7]
    assert not (root / "chk-6").exists()
    assert (
        restored_rows(storage, storage.load(7)["instances"]["count/0"], tmp_path / "r7") == oracle
    )
    db.close()


# ------------------------------------------------------------------------------------------
# savepoints and compatibility


def test_savepoint_is_self_contained(tmp_path: Path) -> None:
    storage = CheckpointStorage(tmp_path / "chk", "j", retain=1)
    db, oracle = small_db(tmp_path / "db", seed=5)
    checkpoint(storage, 1, db, tmp_path)
    oracle_at_1 = dict(oracle)
    path = storage.savepoint(1, str(tmp_path / "sp"))
    assert path == str(tmp_path / "sp" / "_MANIFEST.json")
    # Retention and the loss of the whole checkpoint folder do not touch the savepoint.
    write_keys(db, oracle, np.arange(10, dtype=np.int64), np.random.default_rng(1))
    checkpoint(storage, 2, db, tmp_path)
    assert storage.checkpoints() == [2]
    assert (
        restored_rows(storage, storage.latest()["instances"]["count/0"], tmp_path / "r2") == oracle
    )
    with pytest.raises(CheckpointError, match="already holds a savepoint"):
        storage.savepoint(2, str(tmp_path / "sp"))
    shutil.rmtree(tmp_path / "chk")
    reader, manifest = open_savepoint(f"file://{tmp_path / 'sp'}")
    assert manifest["savepoint"]["checkpoint_id"] == 1 and manifest["checkpoint_id"] == 1
    assert reader.get_blob(manifest["blob"]) == b"blob of 1"
    rows = restored_rows(reader, manifest["instances"]["count/0"], tmp_path / "r")
    assert rows == oracle_at_1
    with pytest.raises(CheckpointError, match="not a usable savepoint: it has no _MANIFEST"):
        open_savepoint(str(tmp_path / "nowhere"))
    db.close()


def test_check_compatible_names_every_difference(tmp_path: Path) -> None:
    manifest = {
        "job": "j",
        "checkpoint_id": 4,
        "num_key_groups": 64,
        "sub_groups": 4,
        "steps": {"src": "source", "count": "keyed", "sink": "sink"},
    }
    check_compatible(manifest, "j", dict(manifest["steps"]), 64, 4)  # no error
    with pytest.raises(CheckpointError) as err:
        check_compatible(manifest, "k", {"src": "source", "count": "map", "out": "sink"}, 128, 8)
    text = str(err.value)
    for fragment in (
        "job name is 'j', this job is 'k'",
        "steps ['sink'] of the checkpoint",
        "steps ['out'] of this job",
        "step 'count' was a 'keyed', is now a 'map'",
        "num_key_groups was 64, is now 128",
        "sub_groups was 4, is now 8",
    ):
        assert fragment in text


# ------------------------------------------------------------------------------------------
# bad input


def test_storage_path_that_is_a_file_or_not_writable(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CheckpointError, match="is a file; pass a directory"):
        CheckpointStorage(f, "j")
    with pytest.raises(CheckpointError, match="is a file; pass a directory"):
        CheckpointStorage(tmp_path, "file")
    with pytest.raises(CheckpointError, match="is a file; pass a directory"):
        CheckpointStorage(f / "below", "j")  # a path below a file
    with pytest.raises(CheckpointError, match="/sys/raystream-chk/j' .* is not writable"):
        CheckpointStorage("/sys/raystream-chk", "j")  # sysfs refuses new folders, even to root
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if not os.access(ro, os.W_OK):  # (root ignores the mode; /sys above covers that case)
            with pytest.raises(CheckpointError, match="is not writable .* pass a directory"):
                CheckpointStorage(ro, "j")
    finally:
        ro.chmod(0o700)
    assert issubclass(CheckpointError, RaystreamError)


def test_bad_arguments(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path / "rel"), "j")
    with pytest.raises(CheckpointError, match="'<step>/<index>'"):
        storage.put_blob(1, "count", "x", b"")
    with pytest.raises(CheckpointError, match="no CURRENT file"):
        storage.upload_state(1, "count/0", str(tmp_path), "uid")
    with pytest.raises(CheckpointError, match="retain must be an int >= 1"):
        CheckpointStorage(tmp_path, "j", retain=0)
    with pytest.raises(CheckpointError, match="relative to the storage root"):
        storage.get_blob("../../etc/passwd")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(CheckpointError, match="new or empty local folder"):
        storage.materialize_state({"files": []}, tmp_path / "full")
    assert json.loads(json.dumps(storage.checkpoints())) == []


def test_shared_blobs_live_while_a_retained_checkpoint_references_them(tmp_path: Path) -> None:
    """A sink's blobs accumulate: checkpoint N references the blobs of 1..N. Stored shared, they
    outlive the checkpoint that wrote them (retention keeps 2 here), and go once unreferenced."""
    storage = CheckpointStorage(str(tmp_path / "chk"), "job", retain=2)
    blobs: list[dict] = []
    for cid in range(1, 6):
        data = f"rows of {cid}".encode()
        ref = storage.put_blob(cid, "sink/0", "rows.arrow", data, shared=True)
        blobs.append({"path": ref, "size": len(data)})
        storage.complete(cid, {"job": "job", "sink": {"blobs": list(blobs)}})
    assert storage.checkpoints() == [4, 5]
    latest = storage.latest()
    assert latest is not None
    got = [storage.get_blob(b["path"]) for b in latest["sink"]["blobs"]]
    assert got == [f"rows of {c}".encode() for c in range(1, 6)]
    # a blob no retained checkpoint references (its checkpoint never completed) is deleted
    orphan = storage.put_blob(6, "sink/0", "rows.arrow", b"lost", shared=True)
    storage.complete(7, {"job": "job", "sink": {"blobs": list(blobs)}})
    with pytest.raises(CheckpointError):
        storage.get_blob(orphan)
    assert storage.get_blob(blobs[0]["path"]) == b"rows of 1"


def test_local_storage_links_sst_files_and_they_outlive_the_db(tmp_path: Path) -> None:
    """On a local filesystem SST files are hard-linked into storage and back out on restore
    (no copy); the checkpoint still restores after the DB compacted them away and closed."""
    db, oracle = small_db(tmp_path / "db", seed=11, n=2000)
    storage = CheckpointStorage(str(tmp_path / "chk"), "j", retain=2)
    snap = db.snapshot(tmp_path / "snap")
    state = storage.upload_state(1, "count/0", str(snap), db.uid)
    storage.complete(1, {"job": "j", "state": state})
    ssts = [f for f in state["files"] if f["name"].endswith(".sst")]
    assert ssts
    for f in ssts:
        stored = tmp_path / "chk" / "j" / f["path"]
        assert stored.stat().st_ino == (snap / f["name"]).stat().st_ino
    rng = np.random.default_rng(12)
    write_keys(db, {}, np.arange(2000, 4000, dtype=np.int64), rng)
    db._db.compact_range(None, None)  # noqa: SLF001 - rewrites (and deletes) every SST
    db.destroy()
    shutil.rmtree(snap)
    local = Path(storage.materialize_state(state, tmp_path / "restored"))
    for f in ssts:
        assert (local / f["name"]).stat().st_ino == (
            tmp_path / "chk" / "j" / f["path"]
        ).stat().st_ino
    assert restored_rows(storage, state, tmp_path / "again") == oracle


def test_retention_takes_files_already_deleted_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint folder or shared file that another retention of the same storage deleted
    first (an object store shows it in a listing a moment longer) does not fail the complete."""
    storage = CheckpointStorage(tmp_path / "chk", "j", retain=1)
    db, oracle = small_db(tmp_path / "db", seed=9)
    checkpoint(storage, 1, db, tmp_path)
    class GoneFirst:  # the filesystem, but each folder it deletes was deleted just before
        def __init__(self, fs: object) -> None:
            self._fs = fs

        def __getattr__(self, name: str) -> object:
            return getattr(self._fs, name)

        def delete_dir(self, path: str) -> None:
            self._fs.delete_dir(path)
            raise FileNotFoundError(path)  # as the second of two deletes would

    monkeypatch.setattr(storage, "fs", GoneFirst(storage.fs))
    write_keys(db, oracle, np.arange(500, 700, dtype=np.int64), np.random.default_rng(2))
    db.flush()
    checkpoint(storage, 2, db, tmp_path)
    assert storage.checkpoints() == [2]
    manifest = storage.load(2)
    assert restored_rows(storage, manifest["instances"]["count/0"], tmp_path / "r") == oracle
    db.close()
