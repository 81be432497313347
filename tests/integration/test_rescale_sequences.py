"""Seeded random rescale sequences: scale out and in, up to 4 rescales in a row, every strategy,
int and string keys, uniform and skewed, some requested just before the input ends.

Each job is the key-count of ``_rescale_helpers`` over a rate-limited generator that runs until
the test opens its gate (then ``RATE_EPS / 4`` more events, about 0.25 s, and the end). Rescales
are requested one after another, seeded pauses apart, once the stream flows. In half the jobs the
last request is sent and, a seeded 0-150 ms later, the gate opens: the end of the input races
that rescale. Otherwise the gate opens once every rescale returned.

Checked per job: it finishes; the counts are exact (``collections.Counter`` over the events the
generator sent, and the operator fails the job if a key's records come out of order or twice);
every requested rescale either happened (its stats say from where to where, by which strategy) or
was answered with a RescaleError that says the input ended first; once one is refused for that,
every later one is too; every rescale requested before the gate opened happened.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import raystream as rs
from tests.integration._rescale_helpers import (
    STEP,
    assert_exact,
    generator,
    live_job,
    prefix_counts,
    step_metrics,
)

SEED = 20261122
STRATEGIES = ["meces", "all_at_once", "fluid", "batched", "lazy", "stop_restart"]
STRATEGY_ARGS = {"lazy": {"max_lazy_s": 0.5}}
# why a requested rescale did not happen: the end of the input came first (before it could
# start, while it ran, or the job had already ended when it was requested)
WHY_NOT = (
    "reached the end of its input before the rescale",
    "reached the end of its input while rescaling",
    "a job that ended cannot be rescaled",
    "only a running job can be rescaled",
)


@dataclass(frozen=True)
class Case:
    strategy: str
    key_type: str
    skewed: bool
    start: int
    targets: tuple[int, ...]
    pauses_s: tuple[float, ...]  # before each request
    race_end_s: float | None  # the gate opens this long after the last request was sent
    seed: int


def _cases() -> list[Case]:
    """6 jobs, one per strategy; int/str keys and uniform/skewed alternate; 2-4 requests each,
    out and in; in 3 jobs the last request races the end of the input."""
    rng = np.random.default_rng(SEED)
    cases = []
    for j, strategy in enumerate(STRATEGIES):
        start = int(rng.integers(1, 4))
        n = int(rng.integers(2, 5))
        targets: list[int] = []
        p = start
        for _ in range(n):
            # at most 2 more at once: the 2 warm standby actors, no process to start
            p = int(rng.choice([t for t in range(1, 6) if t != p and abs(t - p) <= 2]))
            targets.append(p)
        cases.append(
            Case(
                strategy,
                "str" if j % 2 else "int",
                bool(j % 4 >= 2),
                start,
                tuple(targets),
                tuple(round(float(x), 2) for x in rng.uniform(0.0, 0.4, n)),
                round(float(rng.uniform(0.0, 0.15)), 3) if j % 2 else None,
                int(rng.integers(0, 2**31)),
            )
        )
    return cases


CASES = _cases()


def test_the_cases_cover_every_strategy_direction_and_key_kind() -> None:
    assert [c.strategy for c in CASES] == STRATEGIES
    assert {(c.key_type, c.skewed) for c in CASES} == {
        ("int", False),
        ("int", True),
        ("str", False),
        ("str", True),
    }
    outs = ins = 0
    for c in CASES:
        widths = [c.start, *c.targets]
        outs += sum(b > a for a, b in zip(widths, widths[1:], strict=False))
        ins += sum(b < a for a, b in zip(widths, widths[1:], strict=False))
        assert 2 <= len(c.targets) <= 4 and len(c.pauses_s) == len(c.targets)
    assert outs and ins and max(len(c.targets) for c in CASES) == 4
    assert sum(c.race_end_s is not None for c in CASES) == 3


def _request(job: rs.Job, case: Case, target: int) -> Any:
    """The stats of the rescale, or the RescaleError that answered it."""
    try:
        return job.rescale(STEP, target, case.strategy, **STRATEGY_ARGS.get(case.strategy, {}))
    except rs.RescaleError as e:
        return e


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=[f"{c.strategy}-{c.key_type}-{'hot' if c.skewed else 'uniform'}" for c in CASES],
)
def test_random_rescale_sequence_is_exact_and_every_request_is_answered(case: Case) -> None:
    gen = generator(case.key_type, case.skewed, seed=case.seed, hot_key_fraction=0.3)
    outcomes: list[Any] = []
    with live_job(f"rescale-seq-{case.strategy}", gen, case.start) as live:
        live.wait_flowing()
        last = len(case.targets) - 1
        racer = None
        for i, (target, pause) in enumerate(zip(case.targets, case.pauses_s, strict=True)):
            time.sleep(pause)
            if i == last and case.race_end_s is not None:
                racer = threading.Thread(
                    target=lambda t=target: outcomes.append(_request(live.job, case, t))
                )
                racer.start()
                time.sleep(case.race_end_s)
            else:
                outcomes.append(_request(live.job, case, target))
        result, events = live.finish()
        if racer is not None:
            racer.join(timeout=60)
            assert not racer.is_alive(), "the last rescale request was never answered"
    assert result.state == "finished", result.state
    assert len(outcomes) == len(case.targets)

    happened = []
    width = case.start
    refused = False
    for i, (target, out) in enumerate(zip(case.targets, outcomes, strict=True)):
        if isinstance(out, BaseException):
            text = str(out)
            assert any(w in text for w in WHY_NOT), f"a refused rescale must say why: {text}"
            assert i == last and case.race_end_s is not None, (
                f"rescale {i} to {target} was requested while the input still flowed: {text}"
            )
            refused = True
            continue
        assert not refused, "a rescale happened after an earlier one was refused for the end"
        assert (out["from"], out["to"], out["strategy"]) == (width, target, case.strategy), out
        assert out["start_s"] <= out["end_s"]
        width = target
        happened.append(out)
    assert result.rescales[: len(happened)] == happened
    assert_exact(result.table("out"), prefix_counts(gen, events), events)
    count_in = sum(m["records_in"] for m in step_metrics(result.metrics))
    assert count_in == events, "records into count: lost or duplicated"
