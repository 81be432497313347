"""Guard rails around any autoscaler policy. No Ray here; the clock is passed in.

Whatever a policy asks, the core:

1. ignores (with a warning) operators that do not exist or cannot be rescaled, and answers that
   are not whole numbers;
2. clamps to ``[min_parallelism, max_parallelism]`` per operator (with a warning);
3. never scales down an operator that is fully busy (``max_busy_fraction >= full_busy_fraction``)
   or whose backlog grows;
4. scales down only to the highest parallelism asked for during the last ``stabilization_s``
   seconds, and only once that long a history exists (no flapping on one quiet window);
5. scales down by at most ``max_scale_down_factor`` at once (4 -> 2 with factor 2);
6. leaves an operator alone for ``cooldown_s`` after its last rescale.

Example::

    >>> from raystream.autoscaler.policy import OperatorSignals, ScalingDecision
    >>> g = Guard(AutoscalerConfig(max_parallelism=4), rescalable={"count": "keyed"})
    >>> sig = {"count": OperatorSignals("count", "keyed", parallelism=1)}
    >>> [(c.operator, c.target, c.action) for c in g.apply(ScalingDecision({"count": 9}), sig, 0.0)]
    [('count', 4, 'scale_out')]
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from raystream.autoscaler.policy import OperatorSignals, ScalingDecision

from raystream.errors import ConfigError

__all__ = ["AutoscalerConfig", "Change", "Guard"]


def _number(name: str, value: Any, *, minimum: float, strict: bool = False) -> None:
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if bad or value < minimum or (strict and value == minimum):
        op = ">" if strict else ">="
        msg = f"autoscaler_config: {name} must be a number {op} {minimum:g}, got {value!r}"
        raise ConfigError(msg)


def _bound(name: str, value: Any) -> None:
    values = value.values() if isinstance(value, Mapping) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            msg = (
                f"autoscaler_config: {name} must be an int >= 1 or a dict {{operator: int >= 1}}, "
                f"got {value!r}"
            )
            raise ConfigError(msg)


@dataclass(frozen=True)
class AutoscalerConfig:
    """Knobs of the autoscaler loop and its guard rails (all times in seconds).

    ``min_parallelism``/``max_parallelism`` are an int for every operator or a dict per operator
    (operators not in the dict get 1 and ``default_max_parallelism``). ``strategy`` is the
    migration strategy of autoscaler rescales (default: the job's). ``policy_args`` are passed
    to a policy given by name or import path.
    """

    min_parallelism: int | Mapping[str, int] = 1
    max_parallelism: int | Mapping[str, int] = 8
    default_max_parallelism: int = 8
    interval_s: float = 1.0  # how often signals are sampled and the policy asked
    # between two samples, the sources' target rates are read this often (0: not); a change by
    # more than demand_change (a fraction) samples and asks the policy at once
    demand_poll_s: float = 0.05
    demand_change: float = 0.2
    # such a change is decided on from the last sample with the sources' new target rates, not
    # after a new reading of every instance (busy ones answer late: it delayed decisions ~0.1 s)
    decide_on_demand: bool = True
    window_s: float = 5.0  # sliding window of the signals (also the warm-up after a rescale)
    cooldown_s: float = 10.0  # no rescale of an operator this long after its last one
    stabilization_s: float = 10.0  # scale down only to the highest wish of this long
    max_scale_down_factor: float = 2.0  # at most 1/2 of the instances go at once
    full_busy_fraction: float = 0.9  # at or above: never scaled down
    strategy: str | None = None
    policy_args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _bound("min_parallelism", self.min_parallelism)
        _bound("max_parallelism", self.max_parallelism)
        _bound("default_max_parallelism", self.default_max_parallelism)
        _number("interval_s", self.interval_s, minimum=0, strict=True)
        _number("window_s", self.window_s, minimum=0, strict=True)
        _number("demand_poll_s", self.demand_poll_s, minimum=0)
        _number("demand_change", self.demand_change, minimum=0, strict=True)
        if not isinstance(self.decide_on_demand, bool):
            msg = f"autoscaler_config: decide_on_demand must be True or False, got {self.decide_on_demand!r}"
            raise ConfigError(msg)
        _number("cooldown_s", self.cooldown_s, minimum=0)
        _number("stabilization_s", self.stabilization_s, minimum=0)
        _number("max_scale_down_factor", self.max_scale_down_factor, minimum=1)
        _number("full_busy_fraction", self.full_busy_fraction, minimum=0, strict=True)
        if self.full_busy_fraction > 1:
            msg = f"autoscaler_config: full_busy_fraction must be in (0, 1], got {self.full_busy_fraction!r}"
            raise ConfigError(msg)
        if self.window_s < self.interval_s:
            msg = (
                f"autoscaler_config: window_s ({self.window_s}) must be >= interval_s "
                f"({self.interval_s}): a window needs at least two samples"
            )
            raise ConfigError(msg)
        if not isinstance(self.policy_args, Mapping):
            msg = f"autoscaler_config: policy_args must be a dict of policy options, got {self.policy_args!r}"
            raise ConfigError(msg)
        for op in set(_keys(self.min_parallelism)) | set(_keys(self.max_parallelism)):
            lo, hi = self.min_of(op), self.max_of(op)
            if lo > hi:
                msg = (
                    f"autoscaler_config: min_parallelism of {op or 'every operator'!r} is {lo}, above "
                    f"its max_parallelism {hi}; expected min <= max"
                )
                raise ConfigError(msg)

    @classmethod
    def of(cls, value: AutoscalerConfig | Mapping[str, Any] | None) -> AutoscalerConfig:
        if value is None:
            return cls()
        if isinstance(value, AutoscalerConfig):
            return value
        if not isinstance(value, Mapping):
            msg = f"autoscaler_config must be a dict or an AutoscalerConfig, got {value!r}"
            raise ConfigError(msg)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            msg = f"autoscaler_config: unknown option(s) {unknown}; known: {sorted(known)}"
            raise ConfigError(msg)
        return cls(**value)

    def min_of(self, op: str) -> int:
        if isinstance(self.min_parallelism, Mapping):
            return int(self.min_parallelism.get(op, 1))
        return int(self.min_parallelism)

    def max_of(self, op: str) -> int:
        if isinstance(self.max_parallelism, Mapping):
            return int(self.max_parallelism.get(op, self.default_max_parallelism))
        return int(self.max_parallelism)

    def check_operators(self, rescalable: Mapping[str, Any]) -> None:
        """Per-operator bounds must name rescalable operators."""
        for name, value in (
            ("min_parallelism", self.min_parallelism),
            ("max_parallelism", self.max_parallelism),
        ):
            unknown = sorted(set(_keys(value)) - set(rescalable) - {""})
            if unknown:
                msg = (
                    f"autoscaler_config: {name} names {unknown}, which are not rescalable "
                    f"operators of this job; expected some of {sorted(rescalable)}"
                )
                raise ConfigError(msg)


def _keys(value: Any) -> list[str]:
    return list(value) if isinstance(value, Mapping) else [""]


@dataclass(frozen=True)
class Change:
    """What the guard made of one operator's wish. ``action``: scale_out | scale_in | hold |
    ignored. ``notes`` say what the guard changed and why; ``warnings`` flag bad policy output."""

    operator: str
    current: int
    proposed: Any
    target: int
    action: str
    reason: str
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


class Guard:
    """Applies the guard rails; remembers wishes (stabilisation) and rescale times (cooldown)."""

    def __init__(
        self,
        config: AutoscalerConfig,
        rescalable: Mapping[str, Any],
        *,
        operators: Mapping[str, Any] | None = None,
        max_allowed: int | None = None,
    ) -> None:
        config.check_operators(rescalable)
        self.config = config
        self.rescalable = dict(rescalable)
        self.operators = set(operators or rescalable)
        self.max_allowed = max_allowed  # e.g. the number of key groups
        self._wishes: dict[str, list[tuple[float, int]]] = {}
        self._last_rescale: dict[str, float] = {}

    def rescaled(self, op: str, now_s: float) -> None:
        """``op`` was rescaled (finished) at ``now_s``: its cooldown starts."""
        self._last_rescale[op] = now_s

    def bounds(self, op: str) -> tuple[int, int]:
        lo, hi = self.config.min_of(op), self.config.max_of(op)
        if self.max_allowed is not None:
            hi = min(hi, self.max_allowed)
            lo = min(lo, hi)
        return lo, hi

    def apply(
        self, decision: ScalingDecision, signals: Mapping[str, OperatorSignals], now_s: float
    ) -> list[Change]:
        out: list[Change] = []
        for op, proposed in decision.parallelism.items():
            reason = decision.reason(op)
            if op not in self.rescalable:
                what = (
                    "an operator that cannot be rescaled (only keyed steps can)"
                    if op in self.operators
                    else "an unknown operator"
                )
                warn = (
                    f"policy asked parallelism {proposed!r} for {op!r}, {what}; ignored. "
                    f"Rescalable: {sorted(self.rescalable)}"
                )
                out.append(Change(op, 0, proposed, 0, "ignored", reason, warnings=(warn,)))
                continue
            sig = signals.get(op)
            current = sig.parallelism if sig is not None else 1
            target, warnings = self._whole(op, proposed)
            if target is None:
                out.append(
                    Change(op, current, proposed, current, "ignored", reason, warnings=warnings)
                )
                continue
            out.append(self._guard(op, current, proposed, target, reason, warnings, sig, now_s))
        return out

    def _whole(self, op: str, proposed: Any) -> tuple[int | None, tuple[str, ...]]:
        """The wish as an int in bounds, or None if it is no number at all."""
        if (
            isinstance(proposed, bool)
            or not isinstance(proposed, (int, float))
            or not math.isfinite(proposed)
        ):
            return None, (
                f"policy asked parallelism {proposed!r} for {op!r}; expected an int; ignored",
            )
        warnings: list[str] = []
        target = int(proposed)
        if target != proposed:
            target = math.ceil(proposed)
            warnings.append(
                f"policy asked parallelism {proposed!r} for {op!r}; rounded up to {target}"
            )
        lo, hi = self.bounds(op)
        if target < lo or target > hi:
            clamped = min(max(target, lo), hi)
            warnings.append(
                f"policy asked parallelism {target} for {op!r}, outside [{lo}, {hi}]; clamped to {clamped}"
            )
            target = clamped
        return target, tuple(warnings)

    def _guard(
        self,
        op: str,
        current: int,
        proposed: Any,
        target: int,
        reason: str,
        warnings: tuple[str, ...],
        sig: OperatorSignals | None,
        now_s: float,
    ) -> Change:
        cfg = self.config
        notes: list[str] = []

        def change(t: int, action: str) -> Change:
            return Change(op, current, proposed, t, action, reason, tuple(notes), warnings)

        wished = self._remember(op, target, now_s)
        if target == current:
            return change(current, "hold")
        if target < current:
            if sig is not None and sig.max_busy_fraction >= cfg.full_busy_fraction:
                notes.append(
                    f"no scale-in: an instance is {sig.max_busy_fraction:.0%} busy "
                    f"(full at {cfg.full_busy_fraction:.0%})"
                )
                return change(current, "hold")
            if sig is not None and sig.backlog_growth_batches > 0:
                notes.append(f"no scale-in: backlog grew by {sig.backlog_growth_batches} batches")
                return change(current, "hold")
            covered, highest = wished
            if not covered:
                notes.append(
                    f"no scale-in yet: wishes cover less than stabilization_s={cfg.stabilization_s:g} s"
                )
                return change(current, "hold")
            if highest >= current:
                notes.append(
                    f"no scale-in: {highest} was asked within the last {cfg.stabilization_s:g} s"
                )
                return change(current, "hold")
            if highest > target:
                notes.append(
                    f"stabilised to {highest}, the highest wish of the last {cfg.stabilization_s:g} s"
                )
                target = highest
            floor = math.ceil(current / cfg.max_scale_down_factor)
            if target < floor:
                notes.append(
                    f"limited to {floor} by max_scale_down_factor={cfg.max_scale_down_factor:g}"
                )
                target = floor
        last = self._last_rescale.get(op)
        if last is not None and now_s - last < cfg.cooldown_s:
            notes.append(
                f"cooldown: {cfg.cooldown_s - (now_s - last):.1f} s left of {cfg.cooldown_s:g} s"
            )
            return change(current, "hold")
        return change(target, "scale_out" if target > current else "scale_in")

    def _remember(self, op: str, target: int, now_s: float) -> tuple[bool, int]:
        """Record a wish; returns (history covers stabilization_s, highest wish in it)."""
        wishes = self._wishes.setdefault(op, [])
        wishes.append((now_s, target))
        cutoff = now_s - self.config.stabilization_s
        older = [i for i, (t, _) in enumerate(wishes) if t <= cutoff]
        if older:  # keep the newest wish from before the window: it was in force at its start
            del wishes[: older[-1]]
        covered = wishes[0][0] <= cutoff
        return covered, max(p for _, p in wishes)
