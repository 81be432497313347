"""A job file: key-count over a generated, rate-limited stream.

    raystream run examples/keycount_job.py --parallelism count=2
    # in another terminal, while it runs:
    raystream status keycount
    raystream rescale keycount count 4 --strategy meces
    raystream stop keycount
    # or on a running cluster (see the README, "Running jobs on a Ray cluster"):
    raystream submit examples/keycount_job.py -p count=2 --address http://127.0.0.1:8265

Environment variables (all optional):

- ``RAYSTREAM_OUT``: a directory; the counts go there as Parquet (one file per sink instance,
  columns ``key``, ``count``: the running count of each key after each batch, so the last and
  largest count of a key is its total) instead of being dropped.
- ``RAYSTREAM_EVENTS``: how many events to generate (default 3,000,000: 30 s at 100,000 events/s).
- ``RAYSTREAM_RATE_EPS``: events per second (default 100,000; 0 = as fast as possible).

The input is ``source.generate_all()`` (deterministic), so a test can count it with numpy.
"""

import os

import raystream as rs

flow = rs.Dataflow("keycount", num_key_groups=128)


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def count(batch, state):
    """Vectorised key-count: one multi-get and one write per batch."""
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


source = rs.sources.generator(
    events=int(os.environ.get("RAYSTREAM_EVENTS", "3000000")),
    keys=100_000,
    zipf=1.1,
    seed=1,
    rate_eps=float(os.environ.get("RAYSTREAM_RATE_EPS", "100000")),
)
out_dir = os.environ.get("RAYSTREAM_OUT")
sink = rs.sinks.parquet(out_dir) if out_dir else rs.sinks.null()
flow.source(source).key_by("key").apply(count).sink(sink, name="out")

if __name__ == "__main__":  # also runnable as `python keycount_job.py` or under `ray job submit`
    print(rs.run(flow, parallelism={"count": 2}).elapsed_s)
