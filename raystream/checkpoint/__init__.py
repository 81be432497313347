"""Durable checkpoints: incremental RocksDB state, blobs and manifests in a ``pyarrow.fs``."""

from __future__ import annotations

from raystream.checkpoint.storage import (
    CheckpointReader,
    CheckpointStorage,
    check_compatible,
    open_savepoint,
)

__all__ = ["CheckpointReader", "CheckpointStorage", "check_compatible", "open_savepoint"]
