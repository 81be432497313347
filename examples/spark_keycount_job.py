"""A job file fed by Spark: a Spark DataFrame (read from Parquet) is pushed by Spark's own tasks
into the job's source actors, then counted per key in RocksDB state.

    raystream run examples/spark_keycount_job.py --parallelism count=2

Environment variables (all optional):

- ``RAYSTREAM_INPUT``: a Parquet file or directory with a ``key`` column. Without it, the job
  writes ``RAYSTREAM_EVENTS`` generated events (default 500,000) to a temporary Parquet file first.
- ``RAYSTREAM_OUT``: a directory; the counts go there as Parquet (columns ``key``, ``count``: the
  running count of each key after each batch, so the largest count of a key is its total).

Needs Java 17+ (Spark); ``rs.spark.session()`` says how to get it if it is missing.
"""

import os
import tempfile

import raystream as rs

flow = rs.Dataflow("spark-keycount", num_key_groups=128)


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def count(batch, state):
    """Vectorised key-count: one multi-get and one write per batch."""
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


input_path = os.environ.get("RAYSTREAM_INPUT")
if not input_path:
    events = int(os.environ.get("RAYSTREAM_EVENTS", "500000"))
    generated = rs.sources.generator(events=events, keys=50_000, zipf=1.1, seed=7)
    input_path = generated.to_parquet(os.path.join(tempfile.mkdtemp(), "events.parquet"))

spark = rs.spark.session("spark-keycount")
events_df = spark.read.parquet(input_path)
out_dir = os.environ.get("RAYSTREAM_OUT")
sink = rs.sinks.parquet(out_dir) if out_dir else rs.sinks.null()
flow.source(rs.sources.spark(events_df)).key_by("key").apply(count).sink(sink, name="out")

if __name__ == "__main__":  # also runnable as `python spark_keycount_job.py`
    print(rs.run(flow, parallelism={"count": 2}).elapsed_s)
