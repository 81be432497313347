"""The refill of warm standbys after a scale-out waits for the catch-up (no Ray)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from raystream.autoscaling import next_tick_wait
from raystream.standby_pacing import (
    busy_fraction,
    caught_up,
    refill_deadline_s,
    refill_time_s,
    refill_waves,
    start_estimate_s,
    unloaded_busy,
    wait_caught_up,
)


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
    assert got["caught_up"] is False and got["max_wait"] is True
    assert got["waited_s"] == 2.0 and calls == 9  # at 0, 0.25, .., 2.0

    async def gone() -> None:
        return None

    got = asyncio.run(wait_caught_up(gone, clock=ft.clock, sleep=ft.sleep))
    assert got == {
        "waited_s": 0.0,
        "caught_up": False,
        "not_draining": False,
        "max_wait": False,
        "last": None,
    }


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


def test_a_refill_starts_its_first_process_alone_and_the_rest_side_by_side() -> None:
    assert refill_waves(0) == [] and refill_waves(-1) == []
    assert refill_waves(1) == [1]
    assert refill_waves(2) == [1, 1]  # ds2's two standbys: one at a time, as before
    assert refill_waves(4) == [1, 3]  # threshold after 2 -> 4: the rest together
    # processes side by side share the cores: 3 on 2 cores take 1.5x one alone
    assert refill_time_s([1, 3], 0.8, 2) == 0.8 + 1.2
    assert refill_time_s([1, 1], 0.8, 2) == 1.6
    assert refill_time_s([2], 0.8, 0) == 1.6  # an unknown core count counts as one
    assert refill_time_s([], 0.8, 2) == 0.0


def test_the_start_up_estimate_is_the_median_of_past_waves_scaled_to_one_process() -> None:
    assert start_estimate_s([], 2) == 1.0  # nothing measured yet: the default
    assert start_estimate_s([], 2, default=0.7) == 0.7
    assert start_estimate_s([(2, 1.1)], 2) == 1.1  # 2 on 2 cores: as one alone
    assert start_estimate_s([(4, 3.0)], 2) == 1.5  # 4 on 2 cores: twice one alone
    assert start_estimate_s([(1, 0.9), (1, 1.3), (4, 2.2), (0, 5.0), (1, -1.0)], 2) == 1.1


def test_the_wait_for_the_catch_up_ends_in_time_for_the_next_possible_scale_out() -> None:
    # threshold after 2 -> 4: it may ask for 4 -> 8 three seconds after the move (cooldown and
    # a full window); 4 processes in waves [1, 3] at 1 s each on 2 cores take 2.5 s
    assert refill_deadline_s(3.0, 4, 1.0, 2) == 0.5
    assert refill_deadline_s(3.0, 4, 1.4, 2) == 0.0  # slower start-ups: at once
    assert refill_deadline_s(3.0, 2, 1.0, 2) == 1.0  # ds2's 2 standbys, one after the other
    assert refill_deadline_s(30.0, 2, 1.0, 2) == 10.0  # far away: max_wait_s
    assert refill_deadline_s(30.0, 2, 1.0, 2, max_wait_s=4.0) == 4.0
    assert refill_deadline_s(None, 8, 1.0, 2) == 10.0  # no autoscaler: only max_wait_s
    assert refill_deadline_s(3.0, 0, 1.0, 2) == 3.0  # nothing to start

    # the deadline ends a wait whose step has not caught up yet, at the last reading before it
    ft = FakeTime()
    calls = 0

    async def catching_up() -> dict[str, Any]:  # saturated, backlog going down
        nonlocal calls
        calls += 1
        return reading(1.0 / calls, 0.5 * calls)

    got = asyncio.run(
        wait_caught_up(catching_up, max_wait_s=0.5, poll_s=0.25, clock=ft.clock, sleep=ft.sleep)
    )
    assert got["max_wait"] is True and got["caught_up"] is False
    assert got["waited_s"] == 0.5 and calls == 3
    ft = FakeTime()
    got = asyncio.run(
        wait_caught_up(catching_up, max_wait_s=0.0, poll_s=0.25, clock=ft.clock, sleep=ft.sleep)
    )
    assert got["max_wait"] is True and got["waited_s"] == 0.0  # one reading, then at once


def test_a_refill_for_a_rate_sizing_policy_waits_until_the_load_it_scaled_out_for_is_gone() -> None:
    # 1 -> 3 at 20k/s: the three instances are 70 % busy with nothing queued (caught up at the
    # usual 85 %), and only when the input falls back to 5k/s (18 % busy) is the load one the
    # single instance before would carry (at most 85 % / 3)
    assert unloaded_busy(1, 3) == pytest.approx(0.85 / 3) and unloaded_busy(4, 2) == 0.85
    ft = FakeTime()
    busy_s = 0.0

    async def loaded_then_back_down() -> dict[str, Any]:
        nonlocal busy_s
        busy_s += 3 * 0.25 * (0.7 if ft.t < 5.0 else 0.18)
        return {"total_work_s": 0.01, "busy_s": busy_s, "instances": 3}

    got = asyncio.run(
        wait_caught_up(
            loaded_then_back_down,
            max_busy=unloaded_busy(1, 3),
            max_wait_s=60.0,
            poll_s=0.25,
            clock=ft.clock,
            sleep=ft.sleep,
        )
    )
    assert got["caught_up"] is True and got["max_wait"] is False
    assert got["waited_s"] == 5.25, got  # two readings in a row at 18 %: t=5.0 and 5.25
    ft, busy_s = FakeTime(), 0.0  # at the usual 85 %: the first two readings at 70 %
    got = asyncio.run(
        wait_caught_up(loaded_then_back_down, poll_s=0.25, clock=ft.clock, sleep=ft.sleep)
    )
    assert got["caught_up"] is True and got["waited_s"] == 0.5


def test_a_deferred_refill_keeps_waiting_across_a_scale_in_at_the_limit_for_the_new_width() -> None:
    # 1 -> 4 (catch-up), then 4 -> 3 at t=2 while the input is still high (3 instances 70 %
    # busy): the limit is now 85 % / 3 for three instances, and the reading across the scale-in
    # (4 then 3 instances: busy seconds of different instances) does not count; at t=5 the
    # input falls back (18 % of three)
    ft = FakeTime()
    busy_s = 0.0
    widths: list[int] = []

    async def scaled_in_then_unloaded() -> dict[str, Any]:
        nonlocal busy_s
        width = 4 if ft.t < 2.0 else 3
        if widths and widths[-1] != width:
            busy_s = 0.0  # the retired instance's busy seconds are gone from the sum
        widths.append(width)
        busy_s += width * 0.25 * (0.5 if width == 4 else 0.7 if ft.t < 5.0 else 0.18)
        return {"total_work_s": 0.01, "busy_s": busy_s, "instances": width}

    got = asyncio.run(
        wait_caught_up(
            scaled_in_then_unloaded,
            max_busy=lambda r: unloaded_busy(1, int(r["instances"])),
            max_wait_s=60.0,
            poll_s=0.25,
            clock=ft.clock,
            sleep=ft.sleep,
        )
    )
    # at 4 instances 50 % busy is above 85 % / 4; at 3 instances 70 % is above 85 % / 3
    assert got["caught_up"] is True and got["max_wait"] is False
    assert got["waited_s"] == 5.25, got
    assert got["last"]["instances"] == 3
