"""Processing-time window logic over numpy arrays: which window a batch's records join, which
windows a processing-time timer fires, what is left at the end of the input. No Ray and no
state backend here; :mod:`raystream.operators.proctime` feeds it a batch (with the processing
time at which it runs), its keys' stored windows and the fired timers.

Windows are the event-time windows' :class:`~raystream.operators.window_logic.WindowTable`
(``[start, end)``, int64 ms, epoch-aligned) stored the same way, one bytes value per key; only
the time a record is assigned by differs: the processing time ``now_ms`` of its batch instead of
its event time. So there are no late records and no watermark: a window is *due* once the
processing clock reaches its ``end`` (its timer is at ``end``).

Example::

    >>> import numpy as np
    >>> from raystream.operators.aggregations import Rows, count
    >>> import pyarrow as pa
    >>> logic = ProcessingTimeWindows.of(count(), size=10_000, slide=10_000)
    >>> batch = pa.RecordBatch.from_pydict({"x": [1, 2, 3]})
    >>> res = logic.on_batch(np.array([0, 0, 1]), 12_345, Rows(batch), [None, None])
    >>> res.timer_key.tolist(), res.timer_ts.tolist()     # one timer per new window, at its end
    ([0, 1], [20000, 20000])
    >>> fired, left = logic.on_timer(res.state, np.array([20_000, 20_000]))
    >>> fired.start.tolist(), logic.agg.result(fired.parts)["count"].tolist(), left
    ([10000, 10000], [2, 1], [None, None])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from raystream.operators.aggregations import Aggregation, Rows
from raystream.operators.window_logic import NO_WATERMARK, FixedWindows, WindowTable

__all__ = ["END_OF_INPUT", "ProcBatch", "ProcessingTimeWindows"]

# The event-time timer every key with open windows holds: the watermark reaches it only at the
# end of the input (raystream.runtime.watermarks.WATERMARK_MAX), when every open window fires.
END_OF_INPUT = 2**63 - 1


@dataclass
class ProcBatch:
    """What one batch did: ``state`` per distinct key its stored windows (None: none);
    ``timer_key``/``timer_ts``: processing-time timers of the windows it opened (key index, the
    window's end); ``first``: the keys that had no window before (they need the end-of-input
    timer)."""

    state: list[Any]
    timer_key: np.ndarray
    timer_ts: np.ndarray
    first: np.ndarray


@dataclass(frozen=True)
class ProcessingTimeWindows:
    """Tumbling (``slide == size``) or sliding windows of ``size`` ms every ``slide`` ms over
    processing time, aggregated with ``windows.agg`` (the event-time logic without lateness)."""

    windows: FixedWindows

    @staticmethod
    def of(agg: Aggregation, *, size: int, slide: int, offset: int = 0) -> ProcessingTimeWindows:
        return ProcessingTimeWindows(FixedWindows(agg, 0, size, slide, offset))

    @property
    def agg(self) -> Aggregation:
        return self.windows.agg

    def on_batch(
        self, key_index: np.ndarray, now_ms: int, rows: Rows, state: list[Any]
    ) -> ProcBatch:
        """Add a batch run at processing time ``now_ms``: ``key_index[i]`` is the distinct key
        of record ``i`` (into ``state``, the keys' stored windows). Every record joins the
        window(s) containing ``now_ms``."""
        w = self.windows
        stored = WindowTable.from_state(state)
        times = np.full(len(key_index), int(now_ms), np.int64)
        new, _, _, _ = w.partials(np.asarray(key_index, np.int64), times, rows, NO_WATERMARK)
        changed, opened = w._merge(stored, new)
        table = WindowTable.concat([w._untouched(stored, changed), changed])
        fresh = changed if opened is None else changed.take(opened)
        had = np.zeros(len(state), bool)
        had[stored.key] = True
        first = np.flatnonzero(~had)
        first = first[np.isin(first, new.key)]
        return ProcBatch(table.to_state(len(state)), fresh.key, fresh.end, first)

    def on_timer(self, state: list[Any], until_ms: np.ndarray) -> tuple[WindowTable, list[Any]]:
        """Processing-time timers fired: per key ``i`` (of ``state``) every window with
        ``end <= until_ms[i]``. Returns (the fired windows, the keys' new state)."""
        table = WindowTable.from_state(state)
        due = table.end <= np.asarray(until_ms, np.int64)[table.key]
        return table.take(np.flatnonzero(due)), table.take(np.flatnonzero(~due)).to_state(
            len(state)
        )

    def at_end(self, state: list[Any]) -> WindowTable:
        """The input ended: every stored window fires (its end may not have come)."""
        return WindowTable.from_state(state)
