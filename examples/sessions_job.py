"""Per-user running statistics with the per-key API and map/list state.

    raystream run examples/sessions_job.py
"""

import pyarrow as pa

import raystream as rs

flow = rs.Dataflow("sessions", num_key_groups=64)


@rs.map
def to_click(record):
    """Turn a generated event into a click of a user on a page."""
    return {"user": f"u{record['key'] % 1000}", "page": record["seq"] % 7}


@rs.keyed(state={"clicks": rs.ValueState(int, default=0), "pages": rs.MapState(), "recent": rs.ListState()})
def user_stats(user, records, state):
    """One user's clicks of a batch: totals, clicks per page, the last five pages."""
    pages = records.column("page").to_pylist()
    state.clicks.value += len(pages)
    for p in pages:
        state.pages[p] = state.pages.get(p, 0) + 1
    state.recent.extend(pages)
    if len(state.recent) > 5:
        keep = state.recent.get()[-5:]
        state.recent.clear()
        state.recent.extend(keep)
    yield {"user": user, "clicks": state.clicks.value, "distinct_pages": len(state.pages)}


source = rs.sources.generator(events=200_000, keys=5_000, zipf=1.0, seed=3)
flow.source(source).apply(to_click).key_by("user").apply(user_stats).sink(rs.sinks.collect(), name="stats")
_ = pa  # pyarrow is what records are made of
