"""When to start new warm standbys after a scale-out: once the rescaled step caught up.

A scale-out takes its new instances from the warm standbys; refilling them starts as many new
processes (Python start-up and imports: about a second of CPU each). Right after a scale-out the
job works off the backlog that built up before the new capacity came, and on a small machine
those processes take the CPU the catch-up needs. So the refill waits until the step's backlog
(queued rows at its instances plus the rows its sources are behind their schedule) is down to
``max_work_s`` seconds of work on two readings in a row, or at most ``max_wait_s``. No Ray here:
the backlog reader, the clock and the sleep are injected.

Example::

    >>> caught_up({"total_work_s": 0.02, "queued_rows": 300, "source_lag_rows": 0})
    True
    >>> caught_up({"total_work_s": 0.8, "queued_rows": 9000, "source_lag_rows": 2000})
    False
    >>> caught_up({"total_work_s": None, "queued_rows": 300, "source_lag_rows": 0})  # no cost
    True
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

__all__ = ["MAX_WAIT_S", "MAX_WORK_S", "caught_up", "wait_caught_up"]

MAX_WORK_S = 0.1  # backlog left, in seconds of work per instance, that counts as caught up
MAX_ROWS = 2_000  # ... in rows, when the step's cost per row is not known
MAX_WAIT_S = 10.0  # the refill starts after this long in any case
POLL_S = 0.25  # how often the backlog is read meanwhile


def caught_up(
    backlog: Mapping[str, Any], *, max_work_s: float = MAX_WORK_S, max_rows: int = MAX_ROWS
) -> bool:
    """True if ``backlog`` (as ``Controller._backlog`` gives it: ``total_work_s``, or
    ``queued_rows`` and ``source_lag_rows`` when the cost per row is unknown) is small."""
    work = backlog.get("total_work_s")
    if work is not None:
        return float(work) <= max_work_s
    rows = int(backlog.get("queued_rows") or 0) + int(backlog.get("source_lag_rows") or 0)
    return rows <= max_rows


async def wait_caught_up(
    read_backlog: Callable[[], Awaitable[Mapping[str, Any] | None]],
    *,
    max_wait_s: float = MAX_WAIT_S,
    poll_s: float = POLL_S,
    readings: int = 2,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> dict[str, Any]:
    """Wait until ``readings`` backlog readings in a row are :func:`caught_up` (a reading of
    None -- the step is gone, the job ended -- ends the wait at once), or ``max_wait_s``.
    Returns ``{"waited_s", "caught_up", "last": the last reading}``."""
    start = clock()
    in_row = 0
    last: Mapping[str, Any] | None = None
    while True:
        last = await read_backlog()
        if last is None:
            return {"waited_s": clock() - start, "caught_up": False, "last": None}
        in_row = in_row + 1 if caught_up(last) else 0
        if in_row >= readings:
            return {"waited_s": clock() - start, "caught_up": True, "last": dict(last)}
        if clock() - start + poll_s > max_wait_s:
            return {"waited_s": clock() - start, "caught_up": False, "last": dict(last)}
        await sleep(poll_s)
