"""What an autoscaler policy sees and what it answers. No Ray here.

A policy maps a :class:`ScalingContext` (signals per operator over a sliding window, the graph,
the time) to a :class:`ScalingDecision` (desired parallelism per operator, with reasons). The
core (:mod:`raystream.autoscaler.guard`) applies bounds, cooldowns and stabilisation around it,
so a policy stays small and is tested with hand-built contexts.

A policy is an object with ``decide(ctx)`` or a plain function ``f(ctx)``; either may return a
:class:`ScalingDecision` or a plain ``{operator: parallelism}`` dict.

Example::

    >>> def double_when_busy(ctx):
    ...     return {n: s.parallelism * 2 for n, s in ctx.rescalable_signals().items()
    ...             if s.busy_fraction > 0.8}
    >>> ctx = ScalingContext(now_s=10.0, elapsed_s=10.0, operators={
    ...     "count": OperatorSignals("count", "keyed", parallelism=2, busy_fraction=0.9)},
    ...     upstream={"count": ()}, rescalable=frozenset({"count"}))
    >>> as_decision(double_when_busy(ctx)).parallelism
    {'count': 4}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from raystream.errors import ConfigError

__all__ = [
    "AutoscalerPolicy",
    "OperatorSignals",
    "ScalingContext",
    "ScalingDecision",
    "as_decision",
    "policy_callable",
]


@dataclass(frozen=True)
class OperatorSignals:
    """One operator (step) over the sliding window; rates are per second of wall time.

    - ``input_rate_eps`` / ``output_rate_eps``: records in / out per second, all instances.
    - ``busy_fraction``: busy (useful) time per wall second, averaged over instances (0..1);
      ``max_busy_fraction`` is the busiest instance's.
    - ``true_rate_eps``: records one instance processes per *busy* second (DS2's true processing
      rate); ``true_output_rate_eps`` the same for records out. None when nothing was processed.
    - ``backlog_batches``: batches queued at the operator's inputs now; ``backlog_growth_batches``
      its change over the window (> 0: growing).
    - sources only: ``target_rate_eps`` (the rate the source is asked to deliver now, None when
      unthrottled) and ``lag_rows`` (rows behind that schedule: demand not yet served).
    """

    name: str
    kind: str  # source | sink | map | ... | keyed | keyed_batches
    parallelism: int
    input_rate_eps: float = 0.0
    output_rate_eps: float = 0.0
    busy_fraction: float = 0.0
    max_busy_fraction: float = 0.0
    true_rate_eps: float | None = None
    true_output_rate_eps: float | None = None
    backlog_batches: int = 0
    backlog_growth_batches: int = 0
    target_rate_eps: float | None = None
    lag_rows: int = 0
    window_s: float = 0.0

    @property
    def selectivity(self) -> float:
        """Records out per record in (1.0 when nothing came in)."""
        if self.input_rate_eps <= 0:
            return 1.0
        return self.output_rate_eps / self.input_rate_eps


@dataclass(frozen=True)
class ScalingContext:
    """Everything a policy may look at. ``upstream[op]`` lists the operators feeding ``op``
    (the graph, sources first); ``rescalable`` the operators whose parallelism can change
    (keyed steps); ``now_s`` is the autoscaler's clock, ``elapsed_s`` the time since the job
    started; ``min_parallelism``/``max_parallelism`` are the bounds the core will enforce."""

    now_s: float
    elapsed_s: float
    operators: Mapping[str, OperatorSignals]
    upstream: Mapping[str, tuple[str, ...]]
    rescalable: frozenset[str]
    min_parallelism: Mapping[str, int] = field(default_factory=dict)
    max_parallelism: Mapping[str, int] = field(default_factory=dict)

    def rescalable_signals(self) -> dict[str, OperatorSignals]:
        return {n: s for n, s in self.operators.items() if n in self.rescalable}

    def topological_order(self) -> list[str]:
        """Operators from sources to sinks."""
        order: list[str] = []
        seen: set[str] = set()

        def visit(n: str) -> None:
            if n in seen:
                return
            seen.add(n)
            for u in self.upstream.get(n, ()):
                visit(u)
            order.append(n)

        for n in self.upstream:
            visit(n)
        for n in self.operators:
            visit(n)
        return order


@dataclass(frozen=True)
class ScalingDecision:
    """Desired parallelism per operator (leave an operator out to keep it), with a reason each."""

    parallelism: Mapping[str, int]
    reasons: Mapping[str, str] = field(default_factory=dict)

    def reason(self, op: str) -> str:
        return self.reasons.get(op, "")


@runtime_checkable
class AutoscalerPolicy(Protocol):
    """How many instances each operator should have."""

    def decide(self, ctx: ScalingContext) -> ScalingDecision: ...


def policy_callable(policy: Any) -> Callable[[ScalingContext], Any]:
    """The function to call: ``policy.decide`` or the policy itself if it is a plain function."""
    decide = getattr(policy, "decide", None)
    if callable(decide):
        return decide  # type: ignore[no-any-return]
    if callable(policy) and not isinstance(policy, type):
        return policy  # type: ignore[no-any-return]
    msg = (
        f"an autoscaler policy must have a decide(ctx) method or be a function f(ctx); got "
        f"{policy!r}. Give a name (ds2, threshold, schedule, fixed), 'module:attr', or an object."
    )
    raise ConfigError(msg)


def as_decision(answer: Any) -> ScalingDecision:
    """A policy's answer as a :class:`ScalingDecision` (a plain dict or None is accepted)."""
    if answer is None:
        return ScalingDecision({})
    if isinstance(answer, ScalingDecision):
        return answer
    if isinstance(answer, Mapping):
        return ScalingDecision(dict(answer), {k: "policy" for k in answer})
    msg = (
        f"an autoscaler policy must return a ScalingDecision or a dict {{operator: parallelism}}, "
        f"got {type(answer).__name__}: {answer!r}"
    )
    raise ConfigError(msg)
