"""raystream.operators: built-in windows, aggregations, joins and keyed helpers.

Every operator here is built from the public API (``rs.keyed_batches`` with keyed state and
event-time timers); use them like your own::

    import raystream as rs
    from raystream.operators import windows, count, mean

    (flow.source(src, event_time="ts", max_out_of_orderness_ms=5_000)
         .key_by("user")
         .apply(windows.tumbling(60_000, [count(), mean("amount")]))
         .sink(rs.sinks.collect()))
"""

from raystream.operators.aggregations import aggregate, count, max, mean, min, sum, top_k

__all__ = ["aggregate", "count", "max", "mean", "min", "sum", "top_k"]
