"""Per-user running statistics with the per-key API and map/list state.

    raystream run examples/sessions_job.py -p user_stats=2

Each generated event becomes a click of user ``u{key % 1000}`` on page ``seq % 7``; per user the
job keeps the number of clicks, the clicks per page (map state) and the last five pages (list
state), and emits ``user``, ``clicks``, ``distinct_pages`` after each batch of that user.

Environment variables (optional):

- ``RAYSTREAM_OUT``: a directory; the statistics go there as Parquet (one file per sink instance)
  instead of back to the driver. The largest ``clicks`` of a user is their total clicks.
- ``RAYSTREAM_EVENTS``: how many events to generate (default 200,000).
"""

import os

import raystream as rs

flow = rs.Dataflow("sessions", num_key_groups=64)


@rs.map
def to_click(record):
    """Turn a generated event into a click of a user on a page."""
    return {"user": f"u{record['key'] % 1000}", "page": record["seq"] % 7}


@rs.keyed(
    state={
        "clicks": rs.ValueState(int, default=0),
        "pages": rs.MapState(),
        "recent": rs.ListState(),
    }
)
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


source = rs.sources.generator(
    events=int(os.environ.get("RAYSTREAM_EVENTS", "200000")), keys=5_000, zipf=1.0, seed=3
)
out_dir = os.environ.get("RAYSTREAM_OUT")
sink = rs.sinks.parquet(out_dir) if out_dir else rs.sinks.collect()
flow.source(source).apply(to_click).key_by("user").apply(user_stats).sink(sink, name="stats")
