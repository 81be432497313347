"""raystream.operators: built-in windows, aggregations, joins and keyed helpers.

Every operator here is built from the public API (``rs.keyed_batches`` with keyed state and
event-time timers) and used like your own::

    import raystream as rs
    from raystream.operators import count, mean, windows

    counted = (
        flow.source(src, event_time="ts", max_out_of_orderness_ms=5_000)
        .key_by("user")
        .apply(windows.tumbling(60_000, [count(), mean("amount")]))
    )
    counted.sink(rs.sinks.collect())
    counted.side_output("late").sink(rs.sinks.collect(), name="late")

Modules: :mod:`~raystream.operators.windows` (tumbling, sliding, session),
:mod:`~raystream.operators.proctime` (processing-time tumbling and sliding windows),
:mod:`~raystream.operators.joins` (interval_join, window_join, join),
:mod:`~raystream.operators.keyed` (dedupe, top_n), :mod:`~raystream.operators.aggregations`,
:mod:`~raystream.operators.stateless` (select, drop, rename, where, with_column).
"""

from raystream.operators import aggregations, joins, keyed, proctime, stateless, windows
from raystream.operators.aggregations import aggregate, count, max, mean, min, sum, top_k
from raystream.operators.joins import interval_join, join, window_join
from raystream.operators.keyed import dedupe, top_n
from raystream.operators.windows import session, sliding, tumbling

__all__ = [
    "aggregate",
    "aggregations",
    "count",
    "dedupe",
    "interval_join",
    "join",
    "joins",
    "keyed",
    "max",
    "mean",
    "min",
    "proctime",
    "session",
    "stateless",
    "sliding",
    "sum",
    "top_k",
    "top_n",
    "tumbling",
    "window_join",
    "windows",
]
