"""The refill of warm standbys after a scale-out waits for the catch-up (no Ray)."""

from __future__ import annotations

import asyncio
from typing import Any

from raystream.autoscaling import next_tick_wait
from raystream.standby_pacing import busy_fraction, caught_up, wait_caught_up


class FakeTime:
    def __init__(self) -> None:
        self.t = 0.0

    def clock(self) -> float:
        return self.t

    async def sleep(self, s: float) -> None:
        self.t += s


def reading(work_s: float | None, busy_s: float, rows: int = 0, lag: int = 0) -> dict[str, Any]:
    return {
        "total_work_s": work_s,
        "queued_rows": rows,
        "source_lag_rows": lag,
        "busy_s": busy_s,
        "instances": 2,
    }


def test_caught_up_needs_little_work_waiting_and_spare_time_between_two_readings() -> None:
    prev = reading(0.5, 10.0)
    # 2 instances, 0.5 s apart: 0.6 busy seconds = 60 %
    assert caught_up(prev, reading(0.05, 10.6, rows=40_000), 0.5)  # work decides, if known
    assert not caught_up(prev, reading(0.05, 10.9), 0.5)  # 90 % busy: still catching up
    assert not caught_up(prev, reading(0.5, 10.2, rows=10), 0.5)  # too much work waiting
    assert caught_up(prev, reading(None, 10.6, rows=1_500, lag=400), 0.5)  # cost unknown: rows
    assert not caught_up(prev, reading(None, 10.6, rows=1_500, lag=600), 0.5)
    assert not caught_up(None, reading(0.0, 10.6), 0.5)  # the first reading has nothing before
    assert busy_fraction(prev, reading(0.0, 9.0), 0.5) is None  # a counter went back
    assert not caught_up(prev, reading(0.0, 9.0), 0.5)


def test_waits_for_two_readings_in_a_row_that_caught_up() -> None:
    ft = FakeTime()
    # (work, busy seconds so far) every 0.25 s on 2 instances: saturated (0.5 s busy per
    # reading) while the work goes down, one reading with spare time too early, then 40 %
    steps = iter(
        [(1.2, 0.0), (0.9, 0.5), (0.05, 1.0), (0.04, 1.2), (0.3, 1.7), (0.08, 1.9), (0.02, 2.1)]
    )

    async def read() -> dict[str, Any]:
        work, busy = next(steps)
        return reading(work, busy)

    got = asyncio.run(wait_caught_up(read, poll_s=0.25, clock=ft.clock, sleep=ft.sleep))
    assert got["caught_up"] is True
    assert got["waited_s"] == 1.5  # the 7th reading, after 6 polls of 0.25 s
    assert got["last"]["total_work_s"] == 0.02


def test_gives_up_after_max_wait_and_stops_when_the_step_is_gone() -> None:
    ft = FakeTime()
    calls = 0

    async def never() -> dict[str, Any]:  # work waits, the instances are half busy
        nonlocal calls
        calls += 1
        return reading(3.0, 0.25 * calls)

    got = asyncio.run(
        wait_caught_up(never, max_wait_s=2.0, poll_s=0.25, clock=ft.clock, sleep=ft.sleep)
    )
    assert got["caught_up"] is False
    assert got["waited_s"] == 2.0 and calls == 9  # at 0, 0.25, .., 2.0

    async def gone() -> None:
        return None

    got = asyncio.run(wait_caught_up(gone, clock=ft.clock, sleep=ft.sleep))
    assert got == {"waited_s": 0.0, "caught_up": False, "not_draining": False, "last": None}


def test_a_step_that_does_not_keep_up_gets_its_standbys_after_drain_s() -> None:
    # saturated after the scale-out and the backlog stays (another scale-out will come): the
    # refill starts 1 s after it, not after max_wait_s
    ft = FakeTime()
    calls = 0

    async def stuck() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        return reading(0.5 + 0.01 * calls, 0.5 * calls)  # 100 % busy, work creeping up

    got = asyncio.run(wait_caught_up(stuck, poll_s=0.25, clock=ft.clock, sleep=ft.sleep))
    assert got["not_draining"] is True and got["caught_up"] is False
    assert got["waited_s"] == 1.0

    # saturated but the backlog goes down fast enough: it keeps waiting for the catch-up
    ft = FakeTime()
    works = iter([0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.08, 0.05, 0.03])
    busy = iter([0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 3.7, 3.9])

    async def draining() -> dict[str, Any]:
        return reading(next(works), next(busy))

    got = asyncio.run(wait_caught_up(draining, poll_s=0.25, clock=ft.clock, sleep=ft.sleep))
    assert got["caught_up"] is True and got["not_draining"] is False
    assert got["waited_s"] == 2.25  # 0.05 (40 %) then 0.03 (40 %)


def test_ticks_keep_their_interval_whatever_a_tick_took() -> None:
    assert next_tick_wait(5.0, 5.0, 0.25) == 0.25
    assert next_tick_wait(5.0, 5.1, 0.25) == 0.15
    assert next_tick_wait(5.0, 6.5, 0.25) == 0.025  # a rescale ran: a short pause, no burst
