"""A state DB checkpointed every second for hours keeps a bounded folder: RocksDB's info LOG
(~7.5 KB a checkpoint: the flush, compaction and checkpoint lines) rolls and its old files go,
and the MANIFEST is rewritten past its cap. Without, each instance's folder grew ~27 MB an hour
(bench.soak, a checkpoint a second). Oracle: the folder's size on disk and the DB's contents."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from raystream.state.rocks import INFO_LOG_BYTES, INFO_LOG_FILES, RocksStateBackend

SNAPSHOTS = 1_000  # the old options grew the folder by ~7.5 MB over these


def _folder_bytes(path: Path) -> int:
    return sum(os.path.getsize(path / f) for f in os.listdir(path))


def test_a_thousand_checkpoints_leave_a_bounded_folder(tmp_path: Path) -> None:
    db = RocksStateBackend(tmp_path / "db")
    keys = [f"k{i}".encode() for i in range(2_000)]
    for i in range(1, SNAPSHOTS + 1):
        db.write(keys, [str(i).encode()] * len(keys))
        shutil.rmtree(db.snapshot(tmp_path / f"snapshot-{i}"))
    assert db.multi_get([keys[0], keys[-1]]) == [str(SNAPSHOTS).encode()] * 2
    db.close()  # measured closed: a background compaction deletes files while it is listed
    logs = [f for f in os.listdir(tmp_path / "db") if f.startswith("LOG")]
    assert len(logs) <= INFO_LOG_FILES
    bound = INFO_LOG_FILES * INFO_LOG_BYTES + (1 << 20)  # the logs, the data and the rest
    assert _folder_bytes(tmp_path / "db") < bound, sorted(
        (f, os.path.getsize(tmp_path / "db" / f)) for f in os.listdir(tmp_path / "db")
    )
