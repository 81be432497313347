"""Checkpoint storage on an object store: ``s3://`` through ``pyarrow.fs``, against a local
S3 server (moto's ThreadedMotoServer on 127.0.0.1). The endpoint, scheme and credentials go in
the URI (``s3://KEY:SECRET@bucket/path?endpoint_override=HOST:PORT&scheme=http``), as pyarrow
reads them; the oracle is a dict of every RocksDB key written."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from raystream.checkpoint import CheckpointStorage, open_savepoint
from raystream.state.rocks import RocksStateBackend
from tests._s3 import local_s3_bucket

from .test_checkpoint_storage import checkpoint, restored_rows, write_keys

moto_server = pytest.importorskip("moto.server")


@pytest.fixture(scope="module")
def s3_uri() -> Iterator[str]:
    """A bucket on a local S3 server; yields the URI prefix of a folder in it."""
    with local_s3_bucket("checkpoints") as endpoint:
        yield (
            "s3://test:test@checkpoints/{}"
            f"?endpoint_override={endpoint}&scheme=http&region=us-east-1"
        )


def test_incremental_checkpoints_retention_and_restore_on_s3(s3_uri: str, tmp_path: Path) -> None:
    """Three checkpoints of a changing RocksDB, two retained: the retained ones restore to the
    oracle, shared SST files no retained checkpoint lists are gone from the bucket, a later
    checkpoint references unchanged SSTs instead of uploading them, and a savepoint on S3 is
    self-contained."""
    storage = CheckpointStorage(s3_uri.format("jobs"), "j", retain=2)
    rng = np.random.default_rng(5)
    db = RocksStateBackend(tmp_path / "db", cache_entries=0)
    oracle: dict[bytes, bytes] = {}
    at: dict[int, dict[bytes, bytes]] = {}
    states = {}
    for cid in range(1, 4):
        write_keys(db, oracle, rng.integers(0, 4000, 400).astype(np.int64), rng)
        db.flush()
        states[cid] = checkpoint(storage, cid, db, tmp_path)
        at[cid] = dict(oracle)
    assert storage.checkpoints() == [2, 3]
    # later checkpoints reference the SSTs earlier ones stored
    assert all(states[c]["referenced_bytes"] > 0 for c in (2, 3))
    for cid in (2, 3):
        m = storage.load(cid)
        assert restored_rows(storage, m["instances"]["count/0"], tmp_path / f"r{cid}") == at[cid]
        assert storage.get_blob(m["blob"]) == f"blob of {cid}".encode()
    assert storage.latest()["checkpoint_id"] == 3
    fs, root = storage.fs, storage.root
    from pyarrow import fs as pafs

    stored = {
        i.path[len(root) + 1 :]
        for i in fs.get_file_info(pafs.FileSelector(f"{root}/shared", recursive=True))
        if i.type == pafs.FileType.File
    }
    needed = {
        rel
        for cid in (2, 3)
        for rel in storage.load(cid)["storage_files"]
        if rel.startswith("shared/")
    }
    assert stored == needed

    target = s3_uri.format("savepoints/sp1")
    assert storage.savepoint(3, target).endswith("savepoints/sp1/_MANIFEST.json")
    reader, manifest = open_savepoint(target)
    assert restored_rows(reader, manifest["instances"]["count/0"], tmp_path / "sp") == at[3]
    db.close()
