"""The built-in autoscaler policies: ``ds2``, ``threshold``, ``schedule``, ``fixed``.

Each is a small frozen dataclass with ``decide(ctx) -> ScalingDecision``; options are its fields
(``rs.run(..., autoscaler="threshold", autoscaler_config={"policy_args": {"busy_high": 0.7}})``).
They only say what they would like; bounds, cooldowns and stabilisation are applied by the core
(:mod:`raystream.autoscaler.guard`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from raystream.autoscaler.policy import OperatorSignals, ScalingContext, ScalingDecision

from raystream.errors import ConfigError

__all__ = ["DS2", "Fixed", "Schedule", "Threshold"]


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        msg = f"{name} must be a number > 0, got {value!r}"
        raise ConfigError(msg)


def _check_fraction(name: str, value: Any, *, low: float = 0.0, high: float = 1.0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= high:
        msg = f"{name} must be a number in ({low}, {high}], got {value!r}"
        raise ConfigError(msg)


@dataclass(frozen=True)
class DS2:
    """DS2 (Kalavri et al., "Three steps is all you need", OSDI 2018).

    From sources to sinks: a source's target output rate is the rate it is asked to deliver
    (``target_rate_eps``; its observed output rate when unthrottled). An operator's target input
    rate is the sum of its upstream operators' target output rates, and its target output rate
    that times its selectivity. The parallelism that sustains it is
    ``ceil(target input rate / (true rate per instance * target_utilization))``, where the true
    rate counts records per *busy* second, so it does not depend on how loaded the operator is
    now. Because every operator is sized at once from true rates, a rate change converges in
    one to three decisions. Operators without a measured true rate (no input in the window) are
    left as they are.

    ``catch_up_s`` (off by default) also sizes for the backlog: DS2 sizes for the demand, so
    after a step up the new instances have only their headroom over the demand to work off what
    queued before they started. With ``catch_up_s`` an operator that cannot keep up is sized
    for ``target input + backlog / catch_up_s``, where the backlog is the rows its upstream
    sources are behind plus what the shortfall (target input minus what its instances process
    now) adds during ``rescale_s``, the expected time from the decision until new instances
    process. Once caught up the backlog term is gone and DS2 asks for the demand's size again.
    """

    target_utilization: float = 0.9  # plan for this fraction of an instance's true rate
    catch_up_s: float | None = None  # work off the expected backlog within this long (None: off)
    rescale_s: float = 0.5  # expected seconds from a decision until the new instances process

    def __post_init__(self) -> None:
        _check_fraction("target_utilization", self.target_utilization)
        if self.catch_up_s is not None:
            _check_positive("catch_up_s", self.catch_up_s)
        if isinstance(self.rescale_s, bool) or not isinstance(self.rescale_s, (int, float)) or (
            self.rescale_s < 0
        ):
            msg = f"rescale_s must be a number >= 0, got {self.rescale_s!r}"
            raise ConfigError(msg)

    def expected_backlog_rows(
        self, target_in: float, sig: OperatorSignals, source_lag_rows: int
    ) -> float:
        """Rows the operator will hold when new instances start: its sources' lag plus the
        shortfall (target input minus what its instances process now) over ``rescale_s``.

        >>> DS2(catch_up_s=1.0).expected_backlog_rows(
        ...     20_000, OperatorSignals("c", "keyed", 1, true_rate_eps=10_000), 500)
        5500.0
        """
        assert sig.true_rate_eps
        shortfall = max(0.0, target_in - sig.parallelism * sig.true_rate_eps)
        return float(source_lag_rows) + shortfall * self.rescale_s

    def decide(self, ctx: ScalingContext) -> ScalingDecision:
        target_out: dict[str, float] = {}
        want: dict[str, int] = {}
        why: dict[str, str] = {}
        for name in ctx.topological_order():
            sig = ctx.operators.get(name)
            if sig is None:
                continue
            ups = ctx.upstream.get(name, ())
            if not ups:  # a source
                target_out[name] = (
                    sig.target_rate_eps if sig.target_rate_eps else sig.output_rate_eps
                )
                continue
            target_in = sum(target_out.get(u, 0.0) for u in ups)
            target_out[name] = target_in * sig.selectivity
            if name not in ctx.rescalable:
                continue
            if not sig.true_rate_eps:
                continue
            per_instance = sig.true_rate_eps * self.target_utilization
            need = max(1, math.ceil(target_in / per_instance))
            catch_up = ""
            if self.catch_up_s is not None and need > sig.parallelism:
                lag = sum(
                    ctx.operators[u].lag_rows
                    for u in ups
                    if u in ctx.operators and not ctx.upstream.get(u, ())
                )
                backlog = self.expected_backlog_rows(target_in, sig, lag)
                extra = backlog / self.catch_up_s
                need = max(need, math.ceil((target_in + extra) / per_instance))
                catch_up = (
                    f" + backlog {backlog:,.0f} rows / catch-up {self.catch_up_s:g} s"
                    if extra
                    else ""
                )
            want[name] = need
            why[name] = (
                f"ds2: target input {target_in:,.0f} eps{catch_up} / (true rate "
                f"{sig.true_rate_eps:,.0f} eps per instance x {self.target_utilization:g}) -> "
                f"{need} (now {sig.parallelism}, busy {sig.busy_fraction:.0%})"
            )
        return ScalingDecision(want, why)


@dataclass(frozen=True)
class Threshold:
    """High and low water marks on busy time and backlog.

    Scale out (parallelism x ``scale_up_factor``, at least +1) when an operator is busier than
    ``busy_high`` or holds more than ``backlog_high_batches`` queued batches per instance; scale
    in by ``scale_down_step`` when it is less busy than ``busy_low`` and its backlog is at most
    ``backlog_low_batches`` per instance and not growing.
    """

    busy_high: float = 0.8
    busy_low: float = 0.3
    backlog_high_batches: float = 3.0
    backlog_low_batches: float = 0.5
    scale_up_factor: float = 2.0
    scale_down_step: int = 1

    def __post_init__(self) -> None:
        _check_fraction("busy_high", self.busy_high)
        _check_fraction("busy_low", self.busy_low)
        if self.busy_low >= self.busy_high:
            msg = f"busy_low must be below busy_high, got busy_low={self.busy_low}, busy_high={self.busy_high}"
            raise ConfigError(msg)
        if not self.backlog_low_batches < self.backlog_high_batches:
            msg = (
                f"backlog_low_batches must be below backlog_high_batches, got "
                f"{self.backlog_low_batches} and {self.backlog_high_batches}"
            )
            raise ConfigError(msg)
        if not self.scale_up_factor > 1:
            msg = f"scale_up_factor must be > 1, got {self.scale_up_factor!r}"
            raise ConfigError(msg)
        if not isinstance(self.scale_down_step, int) or self.scale_down_step < 1:
            msg = f"scale_down_step must be an int >= 1, got {self.scale_down_step!r}"
            raise ConfigError(msg)

    def next_scale_out(self, parallelism: int) -> int:
        """The parallelism a scale-out from ``parallelism`` asks for (the core keeps that many
        warm standby actors ready)."""
        return max(parallelism + 1, math.ceil(parallelism * self.scale_up_factor))

    def decide(self, ctx: ScalingContext) -> ScalingDecision:
        want: dict[str, int] = {}
        why: dict[str, str] = {}
        for name, sig in ctx.rescalable_signals().items():
            p = sig.parallelism
            backlog = sig.backlog_batches / max(p, 1)
            if sig.busy_fraction > self.busy_high or backlog > self.backlog_high_batches:
                want[name] = self.next_scale_out(p)
                why[name] = (
                    f"threshold: busy {sig.busy_fraction:.0%} (high {self.busy_high:.0%}), "
                    f"backlog {backlog:.1f} batches/instance (high {self.backlog_high_batches:g})"
                )
            elif (
                sig.busy_fraction < self.busy_low
                and backlog <= self.backlog_low_batches
                and sig.backlog_growth_batches <= 0
                and p > 1
            ):
                want[name] = max(1, p - self.scale_down_step)
                why[name] = (
                    f"threshold: busy {sig.busy_fraction:.0%} < low {self.busy_low:.0%}, "
                    f"backlog {backlog:.1f} batches/instance"
                )
        return ScalingDecision(want, why)


def _parallelism_spec(value: Any, where: str) -> int | dict[str, int]:
    if isinstance(value, Mapping):
        out = {str(k): v for k, v in value.items()}
        for k, v in out.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                msg = f"{where}: parallelism of {k!r} must be an int >= 1, got {v!r}"
                raise ConfigError(msg)
        return out
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        msg = f"{where}: expected an int >= 1 or a dict {{operator: int}}, got {value!r}"
        raise ConfigError(msg)
    return value


def _expand(spec: int | Mapping[str, int], ctx: ScalingContext) -> dict[str, int]:
    if isinstance(spec, int):
        return {n: spec for n in sorted(ctx.rescalable)}
    return dict(spec)


@dataclass(frozen=True)
class Schedule:
    """Parallelism by time since the job started: ``steps=[(0, 2), (60, {"count": 4}), ...]``.

    From ``at_s`` on, the entry's parallelism applies (an int means every rescalable operator);
    before the first entry nothing is asked.
    """

    steps: tuple[tuple[float, Any], ...] = ()

    def __post_init__(self) -> None:
        if not self.steps:
            msg = "schedule needs steps=[(at_s, parallelism), ...], got none"
            raise ConfigError(msg)
        norm: list[tuple[float, Any]] = []
        for item in self.steps:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                msg = f"schedule steps are (at_s, parallelism) pairs, got {item!r}"
                raise ConfigError(msg)
            at_s, p = item
            if isinstance(at_s, bool) or not isinstance(at_s, (int, float)) or at_s < 0:
                msg = f"schedule: at_s must be a number >= 0 (seconds since start), got {at_s!r}"
                raise ConfigError(msg)
            norm.append((float(at_s), _parallelism_spec(p, f"schedule step at {at_s} s")))
        times = [t for t, _ in norm]
        if times != sorted(times):
            msg = f"schedule steps must be in time order, got times {times}"
            raise ConfigError(msg)
        object.__setattr__(self, "steps", tuple(norm))

    def decide(self, ctx: ScalingContext) -> ScalingDecision:
        current = [(t, p) for t, p in self.steps if t <= ctx.elapsed_s]
        if not current:
            return ScalingDecision({})
        at_s, spec = current[-1]
        want = _expand(spec, ctx)
        return ScalingDecision(want, {n: f"schedule: step from {at_s:g} s" for n in want})


@dataclass(frozen=True)
class Fixed:
    """Always the same parallelism (an int for every rescalable operator, or a dict); with no
    ``parallelism`` it asks for nothing and the job keeps what it has."""

    parallelism: Any = None
    _spec: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.parallelism is not None:
            object.__setattr__(self, "_spec", _parallelism_spec(self.parallelism, "fixed"))

    def decide(self, ctx: ScalingContext) -> ScalingDecision:
        if self._spec is None:
            return ScalingDecision({})
        want = _expand(self._spec, ctx)
        return ScalingDecision(want, {n: "fixed" for n in want})
