"""The refill of warm standbys after a scale-out waits for the catch-up (no Ray)."""

from __future__ import annotations

import asyncio
from typing import Any

from raystream.autoscaling import next_tick_wait
from raystream.standby_pacing import caught_up, wait_caught_up


class FakeTime:
    def __init__(self) -> None:
        self.t = 0.0

    def clock(self) -> float:
        return self.t

    async def sleep(self, s: float) -> None:
        self.t += s


def backlog(work_s: float | None, rows: int = 0, lag: int = 0) -> dict[str, Any]:
    return {"total_work_s": work_s, "queued_rows": rows, "source_lag_rows": lag}


def test_caught_up_by_work_or_by_rows_when_the_cost_is_unknown() -> None:
    assert caught_up(backlog(0.05, rows=40_000))  # the work decides when it is known
    assert not caught_up(backlog(0.5, rows=10))
    assert caught_up(backlog(None, rows=1_500, lag=400))
    assert not caught_up(backlog(None, rows=1_500, lag=600))


def test_waits_for_two_readings_in_a_row_below_the_bound() -> None:
    ft = FakeTime()
    # a backlog worked off over 1.5 s, with one reading that dips early
    works = iter([1.2, 0.9, 0.05, 0.6, 0.3, 0.08, 0.02, 0.01])

    async def read() -> dict[str, Any]:
        return backlog(next(works))

    got = asyncio.run(wait_caught_up(read, poll_s=0.25, clock=ft.clock, sleep=ft.sleep))
    assert got["caught_up"] is True
    assert got["waited_s"] == 1.5  # the 7th reading (0.02) follows 0.08: 6 polls of 0.25 s
    assert got["last"]["total_work_s"] == 0.02


def test_gives_up_after_max_wait_and_stops_when_the_step_is_gone() -> None:
    ft = FakeTime()
    calls = 0

    async def never() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        return backlog(3.0)

    got = asyncio.run(
        wait_caught_up(never, max_wait_s=2.0, poll_s=0.25, clock=ft.clock, sleep=ft.sleep)
    )
    assert (
        got["caught_up"] is False and got["waited_s"] == 2.0 and calls == 9
    )  # at 0, 0.25, .., 2.0

    async def gone() -> None:
        return None

    got = asyncio.run(wait_caught_up(gone, clock=ft.clock, sleep=ft.sleep))
    assert got == {"waited_s": 0.0, "caught_up": False, "last": None}


def test_ticks_keep_their_interval_whatever_a_tick_took() -> None:
    assert next_tick_wait(5.0, 5.0, 0.25) == 0.25
    assert next_tick_wait(5.0, 5.1, 0.25) == 0.15
    assert next_tick_wait(5.0, 6.5, 0.25) == 0.025  # a rescale ran: a short pause, no burst
