"""How many records of a large batch a keyed instance takes at once (a *slice*), from the cost
of the batches it processed: a rescale barrier or a fetch of moved state waits one slice at most.

A batch's cost is learnt as a fixed part per call plus a part per record, by least squares over
the recent batches (exponentially weighted). The fixed part matters: a step that sleeps or calls
a service once per batch costs the same for 100 rows as for 2,000, and a per-record estimate
would make it slice, learn a higher cost per record from the smaller slices and slice ever finer.
When the batches had nearly the same size the two parts cannot be told apart: the fixed part
found last stays (none yet: the whole cost counts per record, so a barrier never waits longer than
planned) and the rest of the mean cost goes on the records; slices of other sizes settle it.

A slice is processed in *calls* (:meth:`BatchCost.call_rows`): a rescale's control call that comes
while a slice runs ends it after the call in progress. A call is large enough that the fixed part
is small beside its work: a vectorised step whose cost per call is high keeps a slice in one call.
Until the fixed part is known it is taken as none, as for slices: the calls, of other sizes than
the batches, then reveal it.
"""

from __future__ import annotations

import math

__all__ = ["BatchCost"]

DECAY = 0.8  # weight of the earlier batches per new one (about the last five count)
MIN_SPREAD = 0.1  # batch sizes' standard deviation, relative to their mean, to fit two parts


class BatchCost:
    """Learnt cost of a keyed step's batches: ``fixed_s + rows * per_row_s``."""

    def __init__(self) -> None:
        self._w = 0.0  # decayed sums: weight, rows, seconds, rows^2, rows * seconds
        self._x = 0.0
        self._y = 0.0
        self._xx = 0.0
        self._xy = 0.0
        self._skipped_first = False
        self._fixed = 0.0  # the learnt parts
        self._per_row = 0.0

    def learn(self, elapsed_s: float, rows: int) -> None:
        """Record a batch of ``rows`` records that took ``elapsed_s``. An instance's first batch
        is not learnt: it carries one-time costs (imports, the first state reads)."""
        if rows <= 0:
            return
        if not self._skipped_first:
            self._skipped_first = True
            return
        d = DECAY
        self._w = d * self._w + 1.0
        self._x = d * self._x + rows
        self._y = d * self._y + elapsed_s
        self._xx = d * self._xx + rows * rows
        self._xy = d * self._xy + rows * elapsed_s
        self._fit()

    @property
    def measured(self) -> bool:
        return self._w > 0

    @property
    def mean_row_s(self) -> float:
        """Seconds per record over the recent batches, weighted by their records (0 unmeasured):
        what a backlog of records of the usual batch sizes costs."""
        return self._y / self._x if self._x > 0 else 0.0

    def parts(self) -> tuple[float, float]:
        """``(fixed_s, per_row_s)``, both >= 0."""
        return self._fixed, self._per_row

    def _fit(self) -> None:
        mx = self._x / self._w
        my = self._y / self._w
        var = max(self._xx / self._w - mx * mx, 0.0)
        if var <= (MIN_SPREAD * mx) ** 2:
            # sizes too alike to tell the parts apart: keep the fixed part found last (none
            # yet: all per record) and put the rest of the mean cost on the records
            self._fixed = min(self._fixed, my)
            self._per_row = (my - self._fixed) / mx
            return
        per_row = (self._xy / self._w - mx * my) / var
        if per_row <= 0:
            self._fixed, self._per_row = my, 0.0
        elif my - per_row * mx < 0:
            self._fixed, self._per_row = 0.0, my / mx
        else:
            self._fixed, self._per_row = my - per_row * mx, per_row

    def slice_rows(self, target_s: float, min_rows: int, unmeasured_rows: int) -> int:
        """Rows whose work is about ``target_s`` (at least ``min_rows``); ``unmeasured_rows``
        before any batch was learnt. A step whose fixed cost per call alone reaches the target
        is not sliced (``sys.maxsize``-like large value): smaller calls would each cost as much."""
        if not self.measured:
            return unmeasured_rows
        fixed, per_row = self.parts()
        room = target_s - fixed
        if per_row <= 0 or room <= 0:
            return _UNSLICED
        return max(min_rows, int(room / per_row)) if math.isfinite(room / per_row) else _UNSLICED

    def call_rows(self, target_s: float, max_overhead: float, min_rows: int) -> int:
        """Rows of one call inside a slice: about ``target_s`` of work, or more, so that the fixed
        part per call is at most ``max_overhead`` of a call's time (a vectorised count pays a few
        ms per call for its batch's distinct keys: its calls stay whole batches). One call per
        slice (a large value) while unmeasured."""
        fixed, _ = self.parts()
        return self.slice_rows(max(target_s, fixed / max_overhead), min_rows, _UNSLICED)


_UNSLICED = 1 << 62
