"""Files in, files out: a hive-partitioned Parquet folder read recursively, totals per key kept
in RocksDB state, written by a Parquet sink that rolls part files by size.

    raystream run examples/files_job.py -p totals=2
    duckdb -c "select key, max(total) from read_parquet('out/*.parquet') group by key"

Environment variables (all optional):

- ``RAYSTREAM_INPUT``: a Parquet path, folder, glob or URI (``s3://bucket/events/``) with columns
  ``key`` and ``amount``; folders named ``day=N`` add a ``day`` column. Without it, the job first
  writes ``RAYSTREAM_EVENTS`` generated events (default 200,000) into a temporary folder, split
  over ``day=1`` .. ``day=3``.
- ``RAYSTREAM_OUT``: the output folder (default: a temporary one). Columns ``key``, ``total``
  (the running total of ``amount`` after each batch: a key's largest ``total`` is its sum) and
  ``day`` (the latest day among the key's records in that batch).
- ``RAYSTREAM_MAX_FILE_BYTES``: roll output part files at this size (default 256 KiB).

The same source reads CSV (``rs.sources.csv``) and JSON lines (``rs.sources.json``).
"""

import os
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import raystream as rs


def write_example_input(root: str, events: int) -> str:
    """``events`` rows of (key, amount) in ``root/day=1..3/part-*.parquet``."""
    rng = np.random.default_rng(7)
    for day in (1, 2, 3):
        os.makedirs(f"{root}/day={day}", exist_ok=True)
        for part in range(2):
            n = events // 6
            table = pa.table({"key": rng.integers(0, 1000, n), "amount": rng.integers(1, 100, n)})
            pq.write_table(table, f"{root}/day={day}/part-{part}.parquet", row_group_size=10_000)
    return root


flow = rs.Dataflow("files", num_key_groups=64)


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def totals(batch, state):
    """Running total of ``amount`` per key, and the latest ``day`` of the key's records."""
    new = state.get(batch.keys) + batch.reduce("amount", "sum")
    state.put(batch.keys, new)
    return batch.output({"total": new, "day": batch.reduce("day", "max")})


source_path = os.environ.get("RAYSTREAM_INPUT") or write_example_input(
    tempfile.mkdtemp(prefix="raystream-files-in-"),
    int(os.environ.get("RAYSTREAM_EVENTS", "200000")),
)
source = rs.sources.parquet(source_path)  # a folder: every *.parquet below it, day=N as a column
out_dir = os.environ.get("RAYSTREAM_OUT") or tempfile.mkdtemp(prefix="raystream-files-out-")
# roll part files at ~256 KiB (published by the checkpoint after them, or at the end)
sink = rs.sinks.parquet(
    out_dir, max_file_bytes=int(os.environ.get("RAYSTREAM_MAX_FILE_BYTES", 256 << 10))
)
flow.source(source).key_by("key").apply(totals).sink(sink, name="out")

if __name__ == "__main__":
    rs.run(flow, parallelism={"totals": 2})
    print(f"read {source.describe()}; wrote {out_dir}")
