"""Autoscaler policies, guard rails, signals and the loop: hand-built contexts and a fake clock,
no Ray. The loop tests drive a small simulated pipeline (a rate-limited source feeding one keyed
operator whose instances each process ``CAPACITY_EPS`` records per busy second)."""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import types
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from raystream.autoscaler import (
    DS2,
    AutoscalerConfig,
    Fixed,
    Guard,
    OperatorSignals,
    ScalingContext,
    ScalingDecision,
    Schedule,
    SignalWindow,
    Threshold,
)

from raystream.autoscaling import Autoscaler, resolve_policy
from raystream.errors import ConfigError, PluginNotFoundError
from raystream.plugins import AUTOSCALER_POLICIES, known, load
from raystream.sources import RateSchedule, generator

CAPACITY_EPS = 10_000.0  # one simulated instance's true rate


def sig(name: str = "count", p: int = 1, **kw: Any) -> OperatorSignals:
    return OperatorSignals(name, kw.pop("kind", "keyed"), parallelism=p, **kw)


def ctx(
    ops: dict[str, OperatorSignals], *, elapsed_s: float = 10.0, upstream: Any = None
) -> ScalingContext:
    upstream = upstream or {"src": (), "count": ("src",), "out": ("count",)}
    return ScalingContext(
        now_s=100.0 + elapsed_s,
        elapsed_s=elapsed_s,
        operators=ops,
        upstream=upstream,
        rescalable=frozenset(n for n, s in ops.items() if s.kind == "keyed"),
    )


def pipeline(
    target_eps: float, p: int, true_rate: float | None, *, out_eps: float | None = None
) -> ScalingContext:
    processed = min(target_eps, p * (true_rate or 0))
    return ctx(
        {
            "src": sig(
                "src", 1, kind="source", output_rate_eps=processed, target_rate_eps=target_eps
            ),
            "count": sig(
                "count",
                p,
                input_rate_eps=processed,
                output_rate_eps=processed if out_eps is None else out_eps,
                true_rate_eps=true_rate,
                busy_fraction=processed / (p * true_rate) if true_rate else 0.0,
            ),
            "out": sig("out", 1, kind="sink", input_rate_eps=processed),
        }
    )


# ---- DS2 -------------------------------------------------------------------------------------


def test_ds2_sizes_from_the_source_target_not_the_throttled_observed_rate() -> None:
    # 40k asked, 10k per instance, 1 instance saturated (observes only 10k): DS2 jumps to 5
    # (40k / (10k * 0.9) = 4.44 -> 5), in one decision
    d = DS2().decide(pipeline(40_000, 1, CAPACITY_EPS))
    assert dict(d.parallelism) == {"count": 5}
    assert "40,000" in d.reason("count") and "10,000" in d.reason("count")
    # at full utilization exactly 4 are enough
    assert DS2(target_utilization=1.0).decide(pipeline(40_000, 1, CAPACITY_EPS)).parallelism == {
        "count": 4
    }


def test_ds2_scales_in_when_the_rate_drops_and_skips_unmeasured_operators() -> None:
    assert DS2().decide(pipeline(8_000, 4, CAPACITY_EPS)).parallelism == {"count": 1}
    assert DS2().decide(pipeline(8_000, 4, None)).parallelism == {}


def test_ds2_propagates_targets_through_selectivity_to_a_second_operator() -> None:
    up = {"src": (), "explode": ("src",), "count": ("explode",)}
    ops = {
        "src": sig("src", 1, kind="source", output_rate_eps=1_000, target_rate_eps=2_000),
        # a keyed step emitting 3 records per input: its target output is 6k
        "explode": sig(
            "explode", 1, input_rate_eps=1_000, output_rate_eps=3_000, true_rate_eps=1_500
        ),
        "count": sig("count", 2, input_rate_eps=3_000, output_rate_eps=3_000, true_rate_eps=2_000),
    }
    d = DS2(target_utilization=1.0).decide(ctx(ops, upstream=up))
    assert dict(d.parallelism) == {"explode": 2, "count": 3}  # 2000/1500 -> 2; 6000/2000 -> 3


def test_ds2_uses_the_observed_rate_of_an_unthrottled_source() -> None:
    ops = {
        "src": sig("src", 1, kind="source", output_rate_eps=25_000),
        "count": sig(
            "count", 1, input_rate_eps=25_000, output_rate_eps=25_000, true_rate_eps=10_000
        ),
    }
    d = DS2(target_utilization=1.0).decide(ctx(ops, upstream={"src": (), "count": ("src",)}))
    assert d.parallelism == {"count": 3}


def test_ds2_catch_up_sizes_for_the_backlog_the_rescale_leaves_and_only_when_scaling_out() -> None:
    # 20k asked, 1 instance of 10k: 10k/s short; over rescale_s=0.5 that is 5,000 rows, plus
    # the source's 1,000 rows of lag = 6,000 rows to work off in catch_up_s=0.5 -> +12k eps:
    # (20k + 12k) / (10k * 0.9) = 3.56 -> 4 (DS2 alone: 20k / 9k = 2.2 -> 3)
    base = pipeline(20_000, 1, CAPACITY_EPS)
    ops = dict(base.operators)
    ops["src"] = replace(ops["src"], lag_rows=1_000)
    lagging = ctx(ops)
    assert DS2().decide(lagging).parallelism == {"count": 3}
    d = DS2(catch_up_s=0.5).decide(lagging)
    assert d.parallelism == {"count": 4}
    assert "backlog 6,000 rows / catch-up 0.5 s" in d.reason("count")
    # a longer catch-up asks for less: (20k + 6k) / 9k = 2.9 -> 3
    assert DS2(catch_up_s=1.0).decide(lagging).parallelism == {"count": 3}
    # no scale-out needed (enough instances for the demand): the backlog changes nothing,
    # and a scale-in is sized for the demand alone
    assert DS2(catch_up_s=0.5).decide(pipeline(20_000, 3, CAPACITY_EPS)).parallelism == {
        "count": 3
    }
    assert DS2(catch_up_s=0.5).decide(pipeline(8_000, 4, CAPACITY_EPS)).parallelism == {
        "count": 1
    }


@pytest.mark.parametrize("bad", [{"catch_up_s": 0}, {"catch_up_s": -1}, {"rescale_s": -0.1}])
def test_ds2_rejects_a_bad_catch_up(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match=next(iter(bad))):
        DS2(**bad)


def test_ds2_rejects_a_bad_utilization() -> None:
    with pytest.raises(ConfigError, match="target_utilization"):
        DS2(target_utilization=0)


# ---- threshold, schedule, fixed ------------------------------------------------------------


def test_threshold_high_and_low_water_marks() -> None:
    t = Threshold(busy_high=0.8, busy_low=0.3)
    assert t.decide(ctx({"count": sig(p=2, busy_fraction=0.95)})).parallelism == {"count": 4}
    assert t.decide(
        ctx({"count": sig(p=2, busy_fraction=0.5, backlog_batches=10)})
    ).parallelism == {"count": 4}
    assert t.decide(ctx({"count": sig(p=3, busy_fraction=0.1)})).parallelism == {"count": 2}
    assert t.decide(ctx({"count": sig(p=3, busy_fraction=0.5)})).parallelism == {}
    # quiet but its backlog grows: no scale-in wish
    assert (
        t.decide(ctx({"count": sig(p=3, busy_fraction=0.1, backlog_growth_batches=2)})).parallelism
        == {}
    )
    assert t.decide(ctx({"count": sig(p=1, busy_fraction=0.0)})).parallelism == {}
    with pytest.raises(ConfigError, match="busy_low must be below busy_high"):
        Threshold(busy_high=0.3, busy_low=0.5)


def test_schedule_follows_elapsed_time() -> None:
    s = Schedule(steps=[(5, 2), (20, {"count": 4})])
    ops = {"count": sig(p=1)}
    assert s.decide(ctx(ops, elapsed_s=1)).parallelism == {}
    assert s.decide(ctx(ops, elapsed_s=5)).parallelism == {"count": 2}
    assert s.decide(ctx(ops, elapsed_s=25)).parallelism == {"count": 4}
    with pytest.raises(ConfigError, match="time order"):
        Schedule(steps=[(10, 2), (5, 3)])
    with pytest.raises(ConfigError, match="int >= 1"):
        Schedule(steps=[(0, 0)])


def test_fixed() -> None:
    assert Fixed(3).decide(ctx({"count": sig(p=1)})).parallelism == {"count": 3}
    assert Fixed().decide(ctx({"count": sig(p=1)})).parallelism == {}


# ---- loading ---------------------------------------------------------------------------------


def test_builtins_are_registered_as_entry_points_and_load_by_name() -> None:
    from importlib.metadata import entry_points

    eps = {ep.name for ep in entry_points(group=AUTOSCALER_POLICIES)}
    assert eps >= {"ds2", "threshold", "schedule", "fixed"}
    assert isinstance(load(AUTOSCALER_POLICIES, "ds2"), DS2)
    assert load(AUTOSCALER_POLICIES, "threshold", busy_high=0.7).busy_high == 0.7


def test_unknown_policy_lists_the_known_ones() -> None:
    with pytest.raises(PluginNotFoundError) as e:
        resolve_policy("ds3", AutoscalerConfig())
    for name in known(AUTOSCALER_POLICIES):
        assert name in str(e.value)


def test_policy_by_import_path_and_plain_function() -> None:
    mod = types.ModuleType("rs_test_user_policies")

    def always_two(c: ScalingContext) -> dict[str, int]:
        return {n: 2 for n in c.rescalable}

    mod.always_two = always_two  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    try:
        policy, label = resolve_policy("rs_test_user_policies:always_two", AutoscalerConfig())
        assert policy is always_two and label == "rs_test_user_policies:always_two"
        with pytest.raises(ConfigError, match="not a class"):
            resolve_policy(
                "rs_test_user_policies:always_two", AutoscalerConfig(policy_args={"x": 1})
            )
    finally:
        del sys.modules[mod.__name__]
    with pytest.raises(ConfigError, match="decide"):
        resolve_policy(42, AutoscalerConfig())


# ---- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_parallelism": 5, "max_parallelism": 2}, "above its max_parallelism"),
        ({"min_parallelism": {"count": 9}, "max_parallelism": {"count": 3}}, "'count' is 9"),
        ({"cooldown_s": -1}, "cooldown_s must be a number >= 0"),
        ({"interval_s": 0}, "interval_s must be a number > 0"),
        ({"max_scale_down_factor": 0.5}, "max_scale_down_factor"),
        ({"window_s": 1, "interval_s": 2}, "window_s"),
        ({"max_parallelism": 0}, "int >= 1"),
    ],
)
def test_bad_configuration_is_a_clear_error(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        AutoscalerConfig(**kwargs)


def test_config_from_dict_rejects_unknown_options_and_unknown_operators() -> None:
    with pytest.raises(ConfigError, match="unknown option"):
        AutoscalerConfig.of({"cooldown": 3})
    with pytest.raises(ConfigError, match="not rescalable"):
        AutoscalerConfig.of({"max_parallelism": {"nope": 3}}).check_operators({"count": "keyed"})


# ---- guard rails -----------------------------------------------------------------------------


def guard(**kw: Any) -> Guard:
    kw = {"cooldown_s": 0, "stabilization_s": 0, **kw}
    return Guard(
        AutoscalerConfig(**kw), {"count": "keyed"}, operators={"src": "source", "count": "keyed"}
    )


def one(g: Guard, want: Any, s: OperatorSignals, now: float) -> Any:
    (c,) = g.apply(ScalingDecision({"count": want}), {"count": s}, now)
    return c


def test_guard_clamps_to_bounds_with_a_warning() -> None:
    g = guard(min_parallelism=2, max_parallelism=6)
    c = one(g, 50, sig(p=3), 0)
    assert (c.target, c.action) == (6, "scale_out") and "clamped to 6" in c.warnings[0]
    c = one(g, -4, sig(p=3, busy_fraction=0.1), 1)
    assert (c.target, c.action) == (2, "scale_in") and "outside [2, 6]" in c.warnings[0]


def test_guard_caps_at_the_number_of_key_groups() -> None:
    g = Guard(
        AutoscalerConfig(max_parallelism=1000, cooldown_s=0), {"count": "keyed"}, max_allowed=128
    )
    assert one(g, 500, sig(p=2), 0).target == 128


def test_guard_ignores_unknown_and_non_rescalable_operators_and_non_numbers() -> None:
    g = guard()
    changes = g.apply(
        ScalingDecision({"ghost": 3, "src": 2, "count": "many"}),
        {"count": sig(p=1)},
        0,
    )
    by_op = {c.operator: c for c in changes}
    assert all(c.action == "ignored" for c in changes)
    assert "unknown operator" in by_op["ghost"].warnings[0]
    assert "cannot be rescaled" in by_op["src"].warnings[0]
    assert "expected an int" in by_op["count"].warnings[0]
    c = one(g, 2.5, sig(p=1), 0)
    assert (c.target, c.action) == (3, "scale_out") and "rounded up" in c.warnings[0]


def test_guard_cooldown_uses_the_clock() -> None:
    g = guard(cooldown_s=10)
    g.rescaled("count", 100.0)
    c = one(g, 4, sig(p=2), 105.0)
    assert c.action == "hold" and "cooldown: 5.0 s left" in c.notes[0]
    assert one(g, 4, sig(p=2), 110.0).action == "scale_out"


def test_guard_never_scales_in_a_fully_busy_operator_or_a_growing_backlog() -> None:
    g = guard()
    c = one(g, 1, sig(p=4, busy_fraction=0.5, max_busy_fraction=0.97), 0)
    assert c.action == "hold" and "97% busy" in c.notes[0]
    c = one(g, 1, sig(p=4, busy_fraction=0.2, backlog_growth_batches=3), 1)
    assert c.action == "hold" and "backlog grew" in c.notes[0]
    # scale-out is never held back by these
    assert (
        one(g, 8, sig(p=4, max_busy_fraction=1.0, backlog_growth_batches=3), 2).action
        == "scale_out"
    )


def test_guard_limits_the_scale_down_factor() -> None:
    c = one(guard(max_scale_down_factor=2), 1, sig(p=8, busy_fraction=0.1), 0)
    assert (c.target, c.action) == (4, "scale_in") and "max_scale_down_factor" in c.notes[0]
    c = one(guard(max_scale_down_factor=3), 1, sig(p=8, busy_fraction=0.1), 0)
    assert c.target == 3


def test_guard_stabilisation_waits_for_a_steady_low_wish_and_takes_the_highest() -> None:
    g = guard(stabilization_s=10, max_scale_down_factor=100)
    quiet = sig(p=6, busy_fraction=0.1)
    assert one(g, 6, quiet, 0).action == "hold"  # wish 6 at t=0
    c = one(g, 2, quiet, 4)
    assert c.action == "hold" and "cover less" in c.notes[0]
    c = one(g, 3, quiet, 8)
    assert c.action == "hold"
    c = one(g, 2, quiet, 11)  # the window (1..11] holds wishes 6 (in force at its start), 2, 3, 2
    assert c.action == "hold" and "6 was asked" in c.notes[0]
    c = one(g, 2, quiet, 15)  # window (5..15]: 2 (in force at 5), 3, 2, 2 -> 3
    assert (c.target, c.action) == (3, "scale_in") and "stabilised to 3" in c.notes[0]


# ---- signals ---------------------------------------------------------------------------------


def snap(step: str, i: int, rin: float, rout: float, busy: float, **kw: Any) -> dict[str, Any]:
    return {"step": step, "index": i, "records_in": rin, "records_out": rout, "busy_s": busy, **kw}


def test_signal_window_rates_busy_true_rate_and_backlog_growth() -> None:
    w = SignalWindow(window_s=4.0)
    w.add(0.0, [snap("count", 0, 0, 0, 0, backlog=1), snap("count", 1, 0, 0, 0)])
    w.add(
        2.0, [snap("count", 0, 10_000, 5_000, 1.0, backlog=2), snap("count", 1, 6_000, 3_000, 2.0)]
    )
    w.add(
        4.0,
        [snap("count", 0, 20_000, 10_000, 2.0, backlog=3), snap("count", 1, 12_000, 6_000, 4.0)],
    )
    assert w.ready()
    s = w.signals({"count": "keyed"}, {"count": 2})["count"]
    assert s.input_rate_eps == pytest.approx(32_000 / 4)
    assert s.output_rate_eps == pytest.approx(16_000 / 4)
    assert s.busy_fraction == pytest.approx(6.0 / (4 * 2))
    assert s.max_busy_fraction == pytest.approx(1.0)
    assert s.true_rate_eps == pytest.approx(32_000 / 6.0)
    assert s.selectivity == pytest.approx(0.5)
    assert (s.backlog_batches, s.backlog_growth_batches) == (3, 2)


def test_signal_window_slides_and_survives_a_reused_instance_id() -> None:
    w = SignalWindow(window_s=2.0)
    for t in range(6):  # 1000 records/s in
        w.add(float(t), [snap("count", 0, 1000 * t, 0, 0.1 * t)])
    assert w.span_s == pytest.approx(2.0)
    # a new actor under the same id: its counters start over at 500 (not -4500)
    w.add(6.0, [snap("count", 0, 500, 0, 0.05), snap("count", 0, 5000, 0, 0.5, finished=True)])
    s = w.signals({"count": "keyed"}, {"count": 1})["count"]
    assert s.input_rate_eps == pytest.approx((1000 + 500) / 2.0)


def test_source_signals_carry_target_rate_and_lag() -> None:
    w = SignalWindow(window_s=1.0)
    w.add(0.0, [snap("src", 0, 0, 0, 0, target_rate_eps=5_000, lag_rows=0)])
    w.add(1.0, [snap("src", 0, 0, 4_000, 0.2, target_rate_eps=5_000, lag_rows=1_000)])
    s = w.signals({"src": "source"}, {"src": 1})["src"]
    assert (s.output_rate_eps, s.target_rate_eps, s.lag_rows) == (4_000, 5_000, 1_000)
    assert s.true_rate_eps == pytest.approx(20_000)


# ---- the rate schedule of the generator ------------------------------------------------------


def test_rate_schedule_pace_and_checks() -> None:
    g = generator(events=10, keys=2, rate_eps=100, rate_schedule=[(10, 400), (20, 100)])
    pace = RateSchedule.of(g, parallelism=2)
    assert pace is not None and pace.rates_eps == (50.0, 200.0, 50.0)
    # rows due by t: 50/s for 10 s, then 200/s
    assert pace.rows_by(10) == 500 and pace.rows_by(15) == 1500 and pace.rows_by(25) == 2750
    n = np.array([0, 500, 1500, 2500, 2750])
    assert pace.time_of_row(n).tolist() == [0.0, 10.0, 15.0, 20.0, 25.0]
    assert pace.rate_at(12) == 200.0
    with pytest.raises(ConfigError, match="must increase"):
        generator(events=10, keys=2, rate_schedule=[(0, 10), (0, 20)])
    with pytest.raises(ConfigError, match="set rate_eps"):
        generator(events=10, keys=2, rate_schedule=[(5, 10)])


# ---- the loop, over a simulated pipeline ----------------------------------------------------


class SimPipeline:
    """src -> count -> out on a fake clock. Each count instance processes CAPACITY_EPS records
    per busy second; the source is open loop (unserved demand becomes lag)."""

    def __init__(self, schedule: list[tuple[float, float]], p: int = 1) -> None:
        self.schedule = schedule
        self.p = p
        self.t = 0.0
        self.lag = 0.0
        self.total_in = 0.0
        self.busy: list[float] = [0.0] * p
        self.rescales: list[tuple[float, int]] = []

    def rate(self) -> float:
        return [r for t, r in self.schedule if t <= self.t][-1]

    def advance(self, dt: float) -> None:
        demand = self.rate() * dt + self.lag
        served = min(demand, self.p * CAPACITY_EPS * dt)
        self.lag = demand - served
        self.total_in += served
        per = served / self.p / CAPACITY_EPS
        self.busy = [b + per for b in self.busy]
        self.t += dt

    async def metrics(self) -> dict[str, Any]:
        n = self.total_in
        inst = [
            snap("src", 0, 0, n, n / 1e6, target_rate_eps=self.rate(), lag_rows=int(self.lag)),
            *(snap("count", i, n / self.p, n / self.p, self.busy[i]) for i in range(self.p)),
            snap("out", 0, n, 0, n / 1e6),
        ]
        return {"instances": inst}

    async def rescale(self, step: str, p: int) -> dict[str, Any]:
        assert step == "count"
        self.advance(0.5)  # a rescale takes time
        self.p = p
        self.busy = [0.0] * p  # fresh counters (new actors, reset ones are fine too)
        self.total_in = 0.0
        self.rescales.append((self.t, p))
        return {"strategy": "meces", "duration_s": 0.5, "moved_key_groups": 7}


def make_loop(sim: SimPipeline, policy: Any, **cfg: Any) -> Autoscaler:
    config = AutoscalerConfig(
        **{"interval_s": 1.0, "window_s": 3.0, "cooldown_s": 5.0, "stabilization_s": 6.0, **cfg}
    )
    return Autoscaler(
        policy,
        config,
        kinds={"src": "source", "count": "keyed", "out": "sink"},
        upstream={"src": (), "count": ("src",), "out": ("count",)},
        rescalable={"count": "keyed"},
        parallelism=lambda: {"src": 1, "count": sim.p, "out": 1},
        metrics=sim.metrics,
        rescale=sim.rescale,
        clock=lambda: sim.t,
        label=type(policy).__name__,
    )


async def drive(sim: SimPipeline, loop: Autoscaler, until_s: float) -> None:
    while sim.t < until_s:
        await loop.tick()
        sim.advance(loop.config.interval_s)


def test_loop_ds2_follows_a_4x_step_up_and_back_down_in_few_decisions() -> None:
    # 8k eps (1 instance at 80%), 4x -> 32k at t=20 (needs 4 at 0.9 utilisation), back at t=45
    sim = SimPipeline([(0, 8_000), (20, 32_000), (45, 8_000)])
    loop = make_loop(sim, DS2())
    asyncio.run(drive(sim, loop, 80))
    ups = [p for t, p in sim.rescales if 20 <= t < 45]
    downs = [p for t, p in sim.rescales if t >= 45]
    assert ups == [4], sim.rescales  # one decision: 32k / (10k * 0.9) -> 4
    assert downs and downs[-1] == 1 and len(downs) <= 2, sim.rescales  # 4 -> 2 -> 1 (factor 2)
    assert sim.rescales[0][0] < 20 + 3 + 1 + 1  # within window + interval after the step
    done = [e for e in loop.history if e["action"] in ("scale_out", "scale_in")]
    assert all(e["result"] == "done" and e["reason"].startswith("ds2:") for e in done)
    assert loop.decisions == len(sim.rescales)


def test_loop_threshold_reaches_enough_instances_and_holds_in_cooldown() -> None:
    sim = SimPipeline([(0, 8_000), (10, 32_000)])
    loop = make_loop(sim, Threshold(), cooldown_s=5.0)
    asyncio.run(drive(sim, loop, 40))
    assert [p for _, p in sim.rescales][:2] == [2, 4]
    assert sim.rescales[1][0] - sim.rescales[0][0] >= 5.0  # the cooldown between them
    assert sim.p * CAPACITY_EPS >= 32_000


def test_standbys_for_the_next_scale_out_follow_the_policy_within_its_bounds() -> None:
    """Warm standbys the controller keeps: as many instances as the policy's next scale-out
    adds (threshold doubles: p more), capped by the maximum parallelism; none asked by a policy
    that cannot say (ds2 sizes from rates)."""
    sim = SimPipeline([(0, 8_000)])
    loop = make_loop(sim, Threshold(), max_parallelism=6)
    wanted = {}
    for p in (1, 2, 3, 4, 6):
        sim.p = p
        wanted[p] = loop.next_scale_out_instances()
    assert wanted == {1: 1, 2: 2, 3: 3, 4: 2, 6: 0}
    sim.p = 2
    assert make_loop(sim, Threshold(scale_up_factor=1.5)).next_scale_out_instances() == 1
    assert make_loop(sim, DS2()).next_scale_out_instances() == 0


def test_the_next_rescale_can_come_after_the_cooldown_and_a_full_window() -> None:
    """The standby refill after a scale-out is done by then (``standby_pacing``); the loop
    itself decides no sooner: after a rescale the window starts over."""
    sim = SimPipeline([(0, 8_000), (5, 32_000)])
    assert make_loop(sim, Threshold(), cooldown_s=5.0).next_rescale_after_s() == 5.0
    loop = make_loop(sim, Threshold(), cooldown_s=1.0, window_s=4.0, interval_s=0.25)
    assert loop.next_rescale_after_s() == 4.0 * 0.95  # the window counts as full at 95 %
    asyncio.run(drive(sim, loop, 30))
    assert len(sim.rescales) >= 2, sim.rescales
    ends = [t for t, _ in sim.rescales]
    for a, b in zip(ends, ends[1:], strict=False):
        # the rescale at b was asked at b - 0.5 (the sim's rescale takes 0.5 s)
        assert (b - 0.5) - a >= loop.next_rescale_after_s() - 1e-9, sim.rescales


def test_loop_keeps_running_when_the_policy_misbehaves(caplog: pytest.LogCaptureFixture) -> None:
    calls = {"n": 0}

    def bad(c: ScalingContext) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        if calls["n"] == 2:
            return {"count": 99, "ghost": 2}
        return {"count": math.inf}

    sim = SimPipeline([(0, 8_000)])
    loop = make_loop(sim, bad, max_parallelism=3, cooldown_s=100)
    with caplog.at_level(logging.INFO, logger="raystream.autoscaler"):
        asyncio.run(drive(sim, loop, 10))
    assert calls["n"] >= 3
    actions = [(e["action"], e.get("operator")) for e in loop.history]
    assert ("error", None) in actions
    assert ("ignored", "ghost") in actions
    assert ("scale_out", "count") in actions and sim.p == 3  # 99 clamped to the max, 3
    assert any("clamped to 3" in r.getMessage() for r in caplog.records)
    assert any("policy raised RuntimeError" in r.getMessage() for r in caplog.records)
    assert any("count 1 -> 3" in r.getMessage() for r in caplog.records)


def test_loop_waits_for_a_full_window_after_every_rescale() -> None:
    sim = SimPipeline([(0, 8_000)])
    loop = make_loop(sim, Fixed(2), window_s=3.0, cooldown_s=0)
    asyncio.run(drive(sim, loop, 2.5))
    assert sim.rescales == []  # the window is not full yet
    asyncio.run(drive(sim, loop, 5))
    assert [p for _, p in sim.rescales] == [2]


# ---- rs.start checks the autoscaler in the caller's process, before Ray -------------------


def test_rs_start_rejects_bad_autoscaler_settings_before_starting_anything() -> None:
    import ray

    import raystream as rs

    flow = rs.Dataflow("as-bad-config")

    @rs.keyed(state=rs.ValueState(int, default=0))
    def count(key: Any, records: Any, state: Any) -> Any:
        yield key, 1

    flow.source(generator(events=10, keys=2)).key_by("key").apply(count, name="count").sink(
        rs.sinks.collect(), name="out"
    )
    was_up = ray.is_initialized()
    with pytest.raises(PluginNotFoundError, match=r"unknown autoscaler policy 'ds3'; known: .*ds2"):
        rs.start(flow, autoscaler="ds3")
    with pytest.raises(ConfigError, match="above its max_parallelism"):
        rs.start(flow, autoscaler="ds2", autoscaler_config={"min_parallelism": 5, "max_parallelism": 2})
    with pytest.raises(ConfigError, match="cooldown_s must be a number >= 0"):
        rs.start(flow, autoscaler="ds2", autoscaler_config={"cooldown_s": -5})
    with pytest.raises(ConfigError, match=r"names \['out'\], which are not rescalable"):
        rs.start(flow, autoscaler="ds2", autoscaler_config={"max_parallelism": {"out": 2}})
    with pytest.raises(ConfigError, match="without autoscaler="):
        rs.start(flow, autoscaler_config={"cooldown_s": 1})
    with pytest.raises(ConfigError, match="bad options"):
        rs.start(flow, autoscaler="ds2", autoscaler_config={"policy_args": {"nope": 1}})
    with pytest.raises(ConfigError, match="an autoscaler needs migration_support=True"):
        rs.start(flow, autoscaler="ds2", migration_support=False)
    assert ray.is_initialized() == was_up  # nothing was started


def test_submit_passes_strategy_and_autoscaler_to_the_cluster_side_run(tmp_path: Any) -> None:
    from raystream.submit import Submission

    job = tmp_path / "my job.py"
    sub = Submission(job, {"count": 2}, {}, "lazy", "my_policies:Calm")
    assert sub.entrypoint() == (
        "python -m raystream run 'my job.py' -p count=2 --strategy lazy --autoscaler my_policies:Calm"
    )
    assert sub.working_dir == tmp_path


def test_a_repeated_hold_or_warning_is_recorded_once(caplog: pytest.LogCaptureFixture) -> None:
    sim = SimPipeline([(0, 8_000)])
    loop = make_loop(sim, Fixed(50), max_parallelism=3, cooldown_s=0, window_s=1.0)
    with caplog.at_level(logging.WARNING, logger="raystream.autoscaler"):
        asyncio.run(drive(sim, loop, 30))
    assert sim.p == 3 and loop.decisions == 1
    holds = [e for e in loop.history if e["action"] == "hold"]
    assert len(holds) == 1 and "clamped to 3" in holds[0]["warnings"][0]
    assert sum("clamped to 3" in r.getMessage() for r in caplog.records) == 2  # act, first hold


def _run_loop(sim: SimPipeline, loop: Autoscaler, until_s: float) -> None:
    """``Autoscaler.run`` itself on the fake clock: its sleeps advance the pipeline."""

    async def sleep(s: float) -> None:
        sim.advance(s)

    loop._sleep = sleep
    asyncio.run(loop.run(lambda: sim.t < until_s))


def test_a_change_of_the_sources_target_rate_brings_the_next_tick_forward() -> None:
    # a 4x step at t=10.02, just after a tick: with 1 s ticks the decision would wait ~1 s
    def run(demand_poll_s: float) -> tuple[SimPipeline, Autoscaler]:
        sim = SimPipeline([(0, 8_000), (10.02, 32_000)])

        async def demand() -> dict[str, float]:
            return {"src": sim.rate()}

        loop = make_loop(sim, DS2(), demand_poll_s=demand_poll_s)
        loop._demand = demand
        _run_loop(sim, loop, 14.0)
        return sim, loop

    sim, loop = run(0.05)
    assert [p for _, p in sim.rescales] == [4]
    decided = next(e["t_s"] for e in loop.history if e["action"] == "scale_out")
    assert 10.02 <= decided <= 10.02 + 0.05 + 1e-9, decided  # at the next poll, not tick
    assert loop.early_ticks == 1
    sim, loop = run(0.0)  # no polling: the next tick (t=11)
    decided = next(e["t_s"] for e in loop.history if e["action"] == "scale_out")
    assert decided == 11.0 and loop.early_ticks == 0


def test_a_change_of_demand_is_decided_from_the_last_reading_without_reading_again() -> None:
    # the metrics reading of busy instances is slow: each takes 0.09 s of the fake clock. A 4x
    # step at t=10.2 (after the reading of
    # the tick at t=10): deciding from the last reading (true rate, busy) with the sources' new
    # target rate needs no reading, so the scale-out comes at the poll that saw the change
    def run(decide_on_demand: bool) -> tuple[SimPipeline, Autoscaler, list[float]]:
        sim = SimPipeline([(0, 8_000), (10.2, 32_000)])
        reads: list[float] = []

        async def slow_metrics() -> dict[str, Any]:
            reads.append(sim.t)
            snapshot = await sim.metrics()
            sim.advance(0.09)
            return snapshot

        async def demand() -> dict[str, float]:
            return {"src": sim.rate()}

        loop = make_loop(sim, DS2(), decide_on_demand=decide_on_demand)
        loop._metrics = slow_metrics
        loop._demand = demand
        _run_loop(sim, loop, 14.0)
        return sim, loop, reads

    sim, loop, reads = run(True)
    out = next(e for e in loop.history if e["action"] == "scale_out")
    assert [p for _, p in sim.rescales] == [4], sim.rescales  # 32k / (10k x 0.9) -> 4
    assert 10.2 <= out["t_s"] <= 10.2 + 0.05 + 1e-9, out["t_s"]  # the poll, no reading
    assert out["signals_from"] == "demand" and out["reading_s"] == 0.0
    assert "target input 32,000 eps" in out["reason"]  # the new demand, not the sampled 8k
    assert not [t for t in reads if 10.2 <= t <= out["t_s"]]  # nothing was read for it
    sim, loop, reads = run(False)  # read first: 0.09 s later, same answer
    out = next(e for e in loop.history if e["action"] == "scale_out")
    assert [p for _, p in sim.rescales] == [4]
    assert out["signals_from"] == "reading" and out["reading_s"] == pytest.approx(0.09)
    assert out["t_s"] >= 10.2 + 0.09 - 1e-9


def test_decide_on_demand_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="decide_on_demand must be True or False, got 'yes'"):
        AutoscalerConfig(decide_on_demand="yes")  # type: ignore[arg-type]
