"""A job file: key-count over a generated, rate-limited stream.

    raystream run examples/keycount_job.py --parallelism count=2
    # in another terminal, while it runs:
    raystream status keycount
    raystream rescale keycount count 4 --strategy meces
"""

import raystream as rs

flow = rs.Dataflow("keycount", num_key_groups=128)


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def count(batch, state):
    """Vectorised key-count: one multi-get and one write per batch."""
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


source = rs.sources.generator(events=3_000_000, keys=100_000, zipf=1.1, seed=1, rate_eps=100_000)
flow.source(source).key_by("key").apply(count).sink(rs.sinks.null(), name="out")

if __name__ == "__main__":  # also runnable as `python keycount_job.py` or under `ray job submit`
    print(rs.run(flow, parallelism={"count": 2}).elapsed_s)
