"""The slice size of a keyed instance from the learnt cost of its batches (fixed + per record)."""

from __future__ import annotations

import numpy as np
import pytest

from raystream.runtime.slicing import BatchCost

TARGET_S = 0.1
MIN_ROWS = 64
UNMEASURED = 4096


def _run(cost: BatchCost, fixed_s: float, per_row_s: float, batch_rows: int, batches: int,
         noise: float = 0.0, seed: int = 0) -> list[int]:
    """Feed ``batches`` batches of ``batch_rows`` through the slicing loop of an instance (a
    batch above the slice size goes in slices, each one a call); return every call's rows."""
    rng = np.random.default_rng(seed)
    calls: list[int] = []
    for _ in range(batches):
        start = 0
        while start < batch_rows:
            n = min(cost.slice_rows(TARGET_S, MIN_ROWS, UNMEASURED), batch_rows - start)
            took = (fixed_s + per_row_s * n) * (1 + noise * rng.standard_normal())
            cost.learn(max(took, 0.0), n)
            calls.append(n)
            start += n
    return calls


def test_unmeasured_then_the_first_batch_is_not_learnt() -> None:
    cost = BatchCost()
    assert cost.slice_rows(TARGET_S, MIN_ROWS, UNMEASURED) == UNMEASURED
    cost.learn(5.0, 100)  # the first batch: imports, cold state; would mean 50 ms per record
    assert not cost.measured
    assert cost.slice_rows(TARGET_S, MIN_ROWS, UNMEASURED) == UNMEASURED
    cost.learn(0.01, 1000)
    assert cost.measured
    assert cost.mean_row_s == pytest.approx(1e-5)
    assert cost.slice_rows(TARGET_S, MIN_ROWS, UNMEASURED) == 10_000


def test_a_cost_per_call_does_not_slice_ever_finer() -> None:
    # a step that sleeps 50 ms per call whatever its rows; one slow call (a loaded machine)
    # made the old per-record estimate slice, learn more per record and slice down to 64 rows
    cost = BatchCost()
    cost.learn(0.2, 2000)  # first batch, not learnt
    cost.learn(0.12, 2000)  # slow once: 60 us per record would slice 2,000 rows at 1,666
    calls = _run(cost, fixed_s=0.05, per_row_s=0.0, batch_rows=2000, batches=40)
    assert len(calls) <= 42, f"{len(calls)} calls for 40 batches"
    assert calls[-20:] == [2000] * 20
    fixed, per_row = cost.parts()
    assert fixed == pytest.approx(0.05, rel=0.05)
    assert per_row * 2000 < 0.005


def test_a_cost_per_record_slices_at_the_target() -> None:
    cost = BatchCost()
    cost.learn(1.0, 100)  # first batch
    calls = _run(cost, fixed_s=0.0005, per_row_s=2e-5, batch_rows=20_000, batches=10, noise=0.05)
    # 2,000 records take 40 ms: the slice is ~ (100 ms - 0.5 ms) / 20 us = 4,975 records
    assert 4000 <= np.median(calls[-12:]) <= 6000
    assert cost.mean_row_s == pytest.approx(2e-5, rel=0.2)


def test_same_sized_batches_count_their_whole_cost_per_record() -> None:
    cost = BatchCost()
    cost.learn(1.0, 10)
    for _ in range(5):
        cost.learn(0.04, 1000)
    assert cost.parts() == (0.0, pytest.approx(4e-5))
    assert cost.slice_rows(TARGET_S, MIN_ROWS, UNMEASURED) in (2499, 2500)  # float rounding


def test_a_fixed_cost_above_the_target_is_not_sliced() -> None:
    cost = BatchCost()
    cost.learn(1.0, 10)
    for rows in (100, 400, 1600, 100, 800):
        cost.learn(0.3 + 1e-6 * rows, rows)
    fixed, _ = cost.parts()
    assert fixed == pytest.approx(0.3, rel=0.01)
    assert cost.slice_rows(TARGET_S, MIN_ROWS, UNMEASURED) > 10**9


def test_slices_never_go_below_the_minimum() -> None:
    cost = BatchCost()
    cost.learn(1.0, 10)
    for rows in (1000, 3000, 1000, 3000):
        cost.learn(0.1 * rows, rows)  # 100 ms per record
    assert cost.slice_rows(TARGET_S, MIN_ROWS, UNMEASURED) == MIN_ROWS


def test_empty_batches_are_ignored() -> None:
    cost = BatchCost()
    cost.learn(1.0, 0)
    cost.learn(1.0, 0)
    assert cost.slice_rows(TARGET_S, MIN_ROWS, UNMEASURED) == UNMEASURED


def test_a_fixed_cost_found_once_is_kept_while_batches_are_alike() -> None:
    # 150 ms per call: the first learnt batches look like 75 us per record and get sliced; the
    # slices reveal the fixed part, and same-sized batches afterwards do not forget it
    cost = BatchCost()
    cost.learn(0.15, 2000)
    calls = _run(cost, fixed_s=0.15, per_row_s=0.0, batch_rows=2000, batches=60)
    assert len(calls) <= 62, f"{len(calls)} calls for 60 batches"
    assert calls[-50:] == [2000] * 50


CALL_S = 0.02
MAX_OVERHEAD = 0.05


def _run_calls(cost: BatchCost, fixed_s: float, per_row_s: float, batch_rows: int,
               batches: int) -> list[list[int]]:
    """As :func:`_run`, each slice in calls of :meth:`BatchCost.call_rows`; returns each batch's
    calls."""
    out = []
    for _ in range(batches):
        calls = []
        start = 0
        while start < batch_rows:
            end = min(start + cost.slice_rows(TARGET_S, MIN_ROWS, UNMEASURED), batch_rows)
            while start < end:
                n = min(cost.call_rows(CALL_S, MAX_OVERHEAD, MIN_ROWS), end - start)
                cost.learn(fixed_s + per_row_s * n, n)
                calls.append(n)
                start += n
        out.append(calls)
    return out


def test_unmeasured_a_slice_is_one_call() -> None:
    assert BatchCost().call_rows(CALL_S, MAX_OVERHEAD, MIN_ROWS) > 10**9


def test_calls_reveal_a_fixed_part_and_a_vectorised_step_keeps_whole_batches() -> None:
    # a vectorised count: 3 ms per call and 0.3 us per record, every batch 100,000 records
    # (33 ms: one slice). Alike batches hide the fixed part; the first calls, of 20 ms, reveal
    # it, and calls then take whole batches (a call of 20 ms would cost 15 % more than its
    # records; the limit is 5 %)
    cost = BatchCost()
    cost.learn(1.0, 10)
    for _ in range(5):
        cost.learn(0.033, 100_000)
    assert cost.call_rows(CALL_S, MAX_OVERHEAD, MIN_ROWS) < 100_000  # fixed part taken as none
    calls = _run_calls(cost, 0.003, 3e-7, 100_000, 30)
    assert sum(len(c) > 1 for c in calls) <= 3, calls[:5]
    assert calls[-20:] == [[100_000]] * 20


def test_calls_of_a_cost_per_record_take_the_call_target() -> None:
    cost = BatchCost()
    cost.learn(1.0, 10)
    for rows in (500, 1000, 500, 1000):
        cost.learn(0.0001 + 1e-4 * rows, rows)  # 0.1 ms per call, 100 us per record
    # (20 ms - 0.1 ms) / 100 us
    assert cost.call_rows(CALL_S, MAX_OVERHEAD, MIN_ROWS) == 199


def test_a_fixed_part_per_call_makes_calls_larger() -> None:
    # a vectorised count: ~3 ms per call, 0.3 us per record; calls of 20 ms would cost 15 % more;
    # at most 5 %: calls of 60 ms, i.e. (60 - 3) ms / 0.3 us = 190,000 records
    cost = BatchCost()
    cost.learn(1.0, 10)
    for rows in (20_000, 100_000, 50_000, 100_000, 20_000):
        cost.learn(0.003 + 3e-7 * rows, rows)
    assert cost.call_rows(CALL_S, MAX_OVERHEAD, MIN_ROWS) == pytest.approx(190_000, rel=0.01)
