"""When to start new warm standbys after a scale-out: once the rescaled step caught up.

A scale-out takes its new instances from the warm standbys; refilling them starts as many new
processes (Python start-up and imports: about a second of CPU each). Right after a scale-out the
job works off the backlog that built up before the new capacity came, and on a small machine
those processes take the CPU the catch-up needs. So the refill waits until the step caught up:
between two readings of its backlog, its instances were busy at most ``max_busy`` of the time
(an instance working off a backlog is busy all the time) and the work still queued at them plus
the rows its sources are behind their schedule is at most ``max_work_s`` seconds -- on
``readings`` such pairs in a row, or at most ``max_wait_s``. But if ``drain_s`` after the
scale-out the step is still saturated and its backlog has not gone down (by at least
``min_drain`` of the first reading), the new capacity does not keep up: another scale-out is
coming, and it should find warm processes, so the refill starts then. No Ray here: the backlog reader,
the clock and the sleep are injected.

The wait has a deadline, too, if the policy says what its next scale-out will be (threshold
doubles; ds2 sizes from rates and does not scale out again because the step is catching up): it
can ask for it once the rescaled operator's cooldown and a full signal window have passed
(``next_scale_out_s`` after the rescale), and the refill should be done by then. It starts its processes in waves
(:func:`refill_waves`: the first alone, so that the job keeps most of the CPU while the catch-up
ends, the rest side by side, so that they take the longest start-up, not the sum);
:func:`refill_deadline_s` is the longest the wait may last so that the waves, at the measured
start-up time of a process (:func:`start_estimate_s`), end by the next possible scale-out.

A reading is what ``Controller._backlog`` gives: ``total_work_s`` (None when the cost per row is
not known: then ``queued_rows + source_lag_rows`` count, against ``max_rows``), ``busy_s`` (the
step's instances' busy seconds so far, summed) and ``instances``.

Example::

    >>> prev = {"total_work_s": 0.02, "busy_s": 10.0, "instances": 3}
    >>> caught_up(prev, {"total_work_s": 0.02, "busy_s": 10.5, "instances": 3}, 0.25)  # 67 %
    True
    >>> caught_up(prev, {"total_work_s": 0.02, "busy_s": 10.75, "instances": 3}, 0.25)  # 100 %
    False
    >>> caught_up(prev, {"total_work_s": 0.8, "busy_s": 10.5, "instances": 3}, 0.25)
    False
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

__all__ = [
    "MAX_BUSY",
    "MAX_DEFER_S",
    "MAX_WAIT_S",
    "MAX_WORK_S",
    "busy_fraction",
    "caught_up",
    "not_draining",
    "refill_deadline_s",
    "refill_time_s",
    "refill_waves",
    "start_estimate_s",
    "unloaded_busy",
    "wait_caught_up",
]

MAX_BUSY = 0.85  # busier than this between two readings: still working off a backlog
MAX_WORK_S = 0.1  # backlog left, in seconds of work per instance, that counts as caught up
MAX_ROWS = 2_000  # ... in rows, when the step's cost per row is not known
MAX_WAIT_S = 10.0  # the refill starts after this long in any case
MAX_DEFER_S = 60.0  # ... or this long, for a policy that does not plan its next scale-out
DRAIN_S = 1.0  # ... or this long after the scale-out if the backlog is not going down
MIN_DRAIN = 0.1  # going down: by this fraction of the first reading's at least
POLL_S = 0.25  # how often the backlog is read meanwhile
START_S = 1.0  # seconds a standby process takes to start, until one was measured


def refill_waves(missing: int) -> list[int]:
    """Processes per wave of a refill after a scale-out: the first alone, the rest side by side.

    >>> refill_waves(0), refill_waves(1), refill_waves(2), refill_waves(4)
    ([], [1], [1, 1], [1, 3])
    """
    if missing <= 0:
        return []
    return [1] if missing == 1 else [1, missing - 1]


def refill_time_s(waves: list[int], start_s: float, cpus: float) -> float:
    """Seconds the ``waves`` take if a process alone starts in ``start_s`` and processes side
    by side share ``cpus`` cores (more of them than cores take proportionally longer).

    >>> refill_time_s([1, 3], 1.0, 2)
    2.5
    """
    cores = max(float(cpus), 1.0)
    return sum(start_s * max(1.0, n / cores) for n in waves)


def start_estimate_s(
    starts: list[tuple[int, float]], cpus: float, default: float = START_S
) -> float:
    """Seconds one process takes to start, from past waves ``(processes, seconds)``: the
    median of their times scaled to one process (:func:`refill_time_s` backwards); ``default``
    before any was measured.

    >>> start_estimate_s([(1, 0.8), (3, 1.8), (1, 1.4)], 2)
    1.2
    """
    cores = max(float(cpus), 1.0)
    per = sorted(s / max(1.0, n / cores) for n, s in starts if n > 0 and s > 0)
    if not per:
        return default
    mid = len(per) // 2
    return per[mid] if len(per) % 2 else (per[mid - 1] + per[mid]) / 2


def refill_deadline_s(
    next_scale_out_s: float | None,
    missing: int,
    start_s: float,
    cpus: float,
    max_wait_s: float = MAX_WAIT_S,
) -> float:
    """The longest a refill of ``missing`` processes may wait for the catch-up so that its
    waves are done ``next_scale_out_s`` after the scale-out (when the policy can next ask for
    one; None: no autoscaler, only ``max_wait_s``).

    >>> refill_deadline_s(3.0, 4, 1.0, 2)  # waves [1, 3]: 2.5 s
    0.5
    >>> refill_deadline_s(3.0, 6, 1.0, 2), refill_deadline_s(None, 6, 1.0, 2)
    (0.0, 10.0)
    """
    if next_scale_out_s is None:
        return max_wait_s
    need = refill_time_s(refill_waves(missing), start_s, cpus)
    return min(max_wait_s, max(0.0, next_scale_out_s - need))


def unloaded_busy(before: int, after: int, max_busy: float = MAX_BUSY) -> float:
    """The busy fraction of a step scaled out from ``before`` to ``after`` instances under which
    its load is one the ``before`` instances would carry at ``max_busy``: the load the scale-out
    came for is gone. A policy that sizes from rates (ds2) does not scale out again while the
    step keeps up, so its refill may wait for that instead of starting processes beside a loaded
    job (on a small machine their start-up took the CPU and added a latency hump).

    >>> unloaded_busy(1, 4), unloaded_busy(2, 3, 0.9), unloaded_busy(3, 2)
    (0.2125, 0.6, 0.85)
    """
    if after <= before:
        return max_busy
    return round(max_busy * max(before, 1) / after, 9)


def busy_fraction(
    prev: Mapping[str, Any], cur: Mapping[str, Any], elapsed_s: float
) -> float | None:
    """Mean busy fraction of the step's instances between two readings ``elapsed_s`` apart
    (None: not known -- no busy time, or a counter went back, e.g. an instance replaced)."""
    if elapsed_s <= 0 or prev.get("busy_s") is None or cur.get("busy_s") is None:
        return None
    busy = float(cur["busy_s"]) - float(prev["busy_s"])
    if busy < 0:
        return None
    return busy / (elapsed_s * max(int(cur.get("instances") or 1), 1))


def _amount(reading: Mapping[str, Any]) -> float:
    """The backlog of a reading: seconds of work, or rows when the cost is not known."""
    work = reading.get("total_work_s")
    if work is not None:
        return float(work)
    return float(int(reading.get("queued_rows") or 0) + int(reading.get("source_lag_rows") or 0))


def not_draining(
    first: Mapping[str, Any],
    prev: Mapping[str, Any] | None,
    cur: Mapping[str, Any],
    elapsed_s: float,
    *,
    max_busy: float = MAX_BUSY,
    min_drain: float = MIN_DRAIN,
) -> bool:
    """True if the step was saturated between ``prev`` and ``cur`` and its backlog is not
    below ``(1 - min_drain)`` x the ``first`` reading's (it does not keep up).

    >>> first = {"total_work_s": 0.4, "busy_s": 0.0, "instances": 2}
    >>> prev = {"total_work_s": 0.5, "busy_s": 1.0, "instances": 2}
    >>> not_draining(first, prev, {"total_work_s": 0.45, "busy_s": 1.5, "instances": 2}, 0.25)
    True
    >>> not_draining(first, prev, {"total_work_s": 0.2, "busy_s": 1.5, "instances": 2}, 0.25)
    False
    """
    if prev is None:
        return False
    busy = busy_fraction(prev, cur, elapsed_s)
    if busy is None or busy <= max_busy:
        return False
    return _amount(cur) >= (1 - min_drain) * _amount(first)


def caught_up(
    prev: Mapping[str, Any] | None,
    cur: Mapping[str, Any],
    elapsed_s: float,
    *,
    max_busy: float = MAX_BUSY,
    max_work_s: float = MAX_WORK_S,
    max_rows: int = MAX_ROWS,
) -> bool:
    """True if the step, between readings ``prev`` and ``cur``, was not saturated and has
    little work waiting (see the module)."""
    work = cur.get("total_work_s")
    if work is not None:
        small = float(work) <= max_work_s
    else:
        small = int(cur.get("queued_rows") or 0) + int(cur.get("source_lag_rows") or 0) <= max_rows
    if not small or prev is None:
        return False
    busy = busy_fraction(prev, cur, elapsed_s)
    return busy is not None and busy <= max_busy


async def wait_caught_up(
    read_backlog: Callable[[], Awaitable[Mapping[str, Any] | None]],
    *,
    max_wait_s: float = MAX_WAIT_S,
    drain_s: float = DRAIN_S,
    poll_s: float = POLL_S,
    readings: int = 2,
    max_busy: float | Callable[[Mapping[str, Any]], float] = MAX_BUSY,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> dict[str, Any]:
    """Wait until ``readings`` readings in a row are :func:`caught_up` against the one before
    (busy at most ``max_busy``; a reading of None -- the step is gone, the job ended -- ends the
    wait at once), or
    ``max_wait_s`` (at the last reading before it; 0: one reading), or until the step is found
    :func:`not_draining` ``drain_s`` or later after the start. ``max_busy`` may be a function
    of the reading (the step rescaled meanwhile: its limit for that many ``instances``); two
    readings of different widths never count as caught up. Returns ``{"waited_s",
    "caught_up", "not_draining", "max_wait", "last": the last reading}``."""
    start = clock()
    in_row = 0
    first: Mapping[str, Any] | None = None
    prev: Mapping[str, Any] | None = None
    prev_at = start

    def out(
        done: bool, stuck: bool, last: Mapping[str, Any] | None, *, timed_out: bool = False
    ) -> dict[str, Any]:
        return {
            "waited_s": clock() - start,
            "caught_up": done,
            "not_draining": stuck,
            "max_wait": timed_out,
            "last": None if last is None else dict(last),
        }

    while True:
        cur = await read_backlog()
        now = clock()
        if cur is None:
            return out(False, False, None)
        first = cur if first is None else first
        limit = max_busy(cur) if callable(max_busy) else max_busy
        same_width = prev is None or prev.get("instances") == cur.get("instances")
        done = same_width and caught_up(prev, cur, now - prev_at, max_busy=limit)
        in_row = in_row + 1 if done else 0
        if in_row >= readings:
            return out(True, False, cur)
        if now - start >= drain_s and not_draining(first, prev, cur, now - prev_at):
            return out(False, True, cur)
        if now - start + poll_s > max_wait_s:
            return out(False, False, cur, timed_out=True)
        prev, prev_at = cur, now
        await sleep(poll_s)
