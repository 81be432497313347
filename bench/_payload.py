"""Large keyed state for the key-count benchmark: a payload per key, and state written up front.

``count_with_payload(value_bytes)`` is the key-count operator whose state per key is an 8-byte
little-endian count followed by ``value_bytes`` of payload; every batch rewrites the payload of
each key it touches (XOR with the new count's low byte), so the whole value is written back.
The count alone goes downstream, so the final exactness check of the key-count is unchanged.

``prefill_state`` writes the state of every key of the generator (count 0) into each count
instance's RocksDB before the job starts, in the instance's key-group layout: keys sorted in
RocksDB order, cut into SST files (``SstFileWriter``) of ``sst_rows`` keys and ingested with
``move_files`` (no write path, no compaction: the files land in the bottom level).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from rocksdict import IngestExternalFileOptions, SstFileWriter

import raystream as rs
from raystream.keys import RoutingTable
from raystream.state.layout import encode_keys
from raystream.state.rocks import RocksStateBackend, state_db_options

__all__ = ["COUNT_BYTES", "count_with_payload", "initial_values", "prefill_state"]

COUNT_BYTES = 8  # the count in front of the payload (little-endian int64)
STATE_ID = 1  # a keyed step with one state (state=rs.ValueState(...)) stores it under id 1


def initial_values(n: int, value_bytes: int, rng: np.random.Generator) -> np.ndarray:
    """(n, 8 + value_bytes) uint8 rows: count 0, then random payload bytes (incompressible, so
    the state on disk is as large as it says)."""
    rows = np.zeros((n, COUNT_BYTES + value_bytes), np.uint8)
    rows[:, COUNT_BYTES:] = np.frombuffer(rng.bytes(n * value_bytes), np.uint8).reshape(n, -1)
    return rows


def count_with_payload(value_bytes: int, name: str = "count") -> Any:
    """The key-count step with ``value_bytes`` of payload per key (see the module doc)."""
    width = COUNT_BYTES + value_bytes
    rng = np.random.default_rng()

    @rs.keyed_batches(name=name, state=rs.ValueState(bytes))
    def count_payload(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
        old = state.get(batch.keys)
        missing = [i for i, v in enumerate(old) if v is None]
        if missing:
            fresh = initial_values(len(missing), value_bytes, rng)
            for j, i in enumerate(missing):
                old[i] = fresh[j].tobytes()
        rows = np.frombuffer(bytearray(b"".join(old)), np.uint8).reshape(-1, width)
        counts = rows[:, :COUNT_BYTES].copy().view("<i8").ravel() + batch.counts
        rows[:, :COUNT_BYTES] = counts.astype("<i8").view(np.uint8).reshape(-1, COUNT_BYTES)
        rows[:, COUNT_BYTES:] ^= (counts & 0xFF).astype(np.uint8)[:, None]
        state.put(batch.keys, rows.view(f"V{width}").ravel().tolist())
        return batch.output({"count": counts})

    return count_payload


def _all_keys(keys: int, key_type: str) -> pa.Array:
    ids = pa.array(np.arange(keys, dtype=np.int64))
    if key_type == "int":
        return ids
    import pyarrow.compute as pc

    return pc.binary_join_element_wise("k", ids.cast(pa.string()), "")


def prefill_state(
    state_dir: str | Path,
    flow: rs.Dataflow,
    step: str,
    parallelism: int,
    keys: int,
    key_type: str,
    value_bytes: int | None,
    *,
    sst_rows: int = 65_536,
    instances: list[int] | None = None,
) -> dict[str, Any]:
    """Write count 0 (and the first payload) for key ids ``0 .. keys-1`` into the RocksDB of
    each instance of ``step`` under ``state_dir`` (where ``rs.start(state_dir=...)`` opens it),
    each instance getting the keys of the key groups the uniform routing gives it
    (``instances``: only these instances' DBs, e.g. ``[0]``; default all). Returns what was
    written (rows, bytes, seconds)."""
    t0 = time.perf_counter()
    spec = flow.steps[step].state
    state_spec = spec[""] if isinstance(spec, dict) else spec
    codec = state_spec.codec
    ks = flow.key_space
    all_keys = _all_keys(keys, key_type)
    kg, sg = ks.locate(all_keys)
    owners = RoutingTable.uniform(ks.num_key_groups, parallelism).owners[kg]
    rng = np.random.default_rng(0x9A710AD)
    total_rows = total_bytes = 0
    for index in range(parallelism) if instances is None else instances:
        mine = np.flatnonzero(owners == index)
        enc = encode_keys(kg[mine], sg[mine], STATE_ID, all_keys.take(pa.array(mine)))
        order = sorted(range(len(enc)), key=enc.__getitem__)  # RocksDB (bytewise) order
        path = Path(state_dir) / step / str(index)
        backend = RocksStateBackend(path, cache_entries=0)
        staging = Path(f"{path}-prefill")
        staging.mkdir(parents=True, exist_ok=True)
        files: list[str] = []
        try:
            for start in range(0, len(order), sst_rows):
                part = np.asarray(order[start : start + sst_rows], np.int64)
                rows = mine[part]
                if value_bytes is None:
                    values = codec.encode_many(np.zeros(len(rows), np.int64))
                else:
                    init = initial_values(len(rows), value_bytes, rng)
                    width = COUNT_BYTES + value_bytes
                    values = codec.encode_many(init.view(f"V{width}").ravel().tolist())
                writer = SstFileWriter(state_db_options())  # the DB's block size
                file = str(staging / f"prefill-{start // sst_rows:05d}.sst")
                writer.open(file)
                for i, v in zip(part.tolist(), values, strict=True):
                    writer[enc[i]] = v
                    total_bytes += len(enc[i]) + len(v)
                writer.finish()
                files.append(file)
                total_rows += len(rows)
            opts = IngestExternalFileOptions()
            opts.set_move_files(True)
            if files:
                backend._db.ingest_external_file(files, opts)  # noqa: SLF001 - bulk load
        finally:
            backend.close()
            for f in staging.glob("*"):
                f.unlink()
            staging.rmdir()
    return {
        "rows": total_rows,
        "bytes": total_bytes,
        "seconds": round(time.perf_counter() - t0, 3),
    }
