"""The autoscaler loop the controller runs: sample signals, ask the policy, guard, rescale, log.

A plain class over three injected functions (metrics, rescale, clock), so it runs under plain
asyncio in unit tests with a fake clock. Every ``interval_s`` it samples the metrics of every
instance into a :class:`~raystream.autoscaler.signals.SignalWindow`; once the window is full it
asks the policy, passes the answer through the :class:`~raystream.autoscaler.guard.Guard` and
carries out the changes one operator at a time with the configured migration strategy. After a
rescale the window starts over (warm-up), as DS2 does. A policy that raises, or a rescale that
fails, is logged and the job keeps running.

Every decision (and every hold with a new reason) is logged on the ``raystream.autoscaler``
logger and kept in :attr:`Autoscaler.history`, which ``Job.status()`` and the job result show.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

from raystream.autoscaler.guard import AutoscalerConfig, Change, Guard
from raystream.autoscaler.policy import (
    OperatorSignals,
    ScalingContext,
    as_decision,
    policy_callable,
)
from raystream.autoscaler.signals import SignalWindow
from raystream.errors import ConfigError
from raystream.plugins import AUTOSCALER_POLICIES
from raystream.plugins import load as load_plugin

__all__ = [
    "Autoscaler",
    "demand_changed",
    "next_tick_wait",
    "resolve_policy",
    "source_demand",
    "with_demand",
]

log = logging.getLogger("raystream.autoscaler")

MetricsFn = Callable[[], Awaitable[Mapping[str, Any]]]
RescaleFn = Callable[[str, int], Awaitable[Mapping[str, Any]]]
DemandFn = Callable[[], Awaitable[Mapping[str, float]]]  # source step -> target rate, eps
MAX_HISTORY = 1000
WINDOW_READY = 0.95  # a decision once the samples cover this much of the window


def resolve_policy(spec: Any, config: AutoscalerConfig) -> tuple[Any, str]:
    """The policy object for ``spec`` (a name, ``"module:attr"`` or an object) and its label.
    Fails with the known names when a name is unknown."""
    if spec is None or spec is False:
        msg = "autoscaler: expected a policy name, 'module:attr' or an object, got None"
        raise ConfigError(msg)
    if isinstance(spec, str):
        policy = load_plugin(AUTOSCALER_POLICIES, spec, **dict(config.policy_args))
        label = spec
    else:
        if config.policy_args:
            msg = (
                f"autoscaler_config: policy_args {sorted(config.policy_args)} apply only to a "
                f"policy given by name or import path; set them on the object {spec!r} instead"
            )
            raise ConfigError(msg)
        policy = spec
        label = getattr(spec, "__name__", None) or type(spec).__name__
    policy_callable(policy)  # fails now if it cannot decide
    return policy, label


class Autoscaler:
    """One job's autoscaler."""

    def __init__(
        self,
        policy: Any,
        config: AutoscalerConfig,
        *,
        kinds: Mapping[str, str],
        upstream: Mapping[str, tuple[str, ...]],
        rescalable: Mapping[str, str],
        parallelism: Callable[[], Mapping[str, int]],
        metrics: MetricsFn,
        rescale: RescaleFn,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        busy: Callable[[], bool] = lambda: False,
        label: str = "policy",
        max_allowed: int | None = None,
        demand: DemandFn | None = None,
    ) -> None:
        self.policy = policy
        self._decide = policy_callable(policy)
        self.label = label
        self.config = config
        self.kinds = dict(kinds)
        self.upstream = {k: tuple(v) for k, v in upstream.items()}
        self.guard = Guard(config, rescalable, operators=kinds, max_allowed=max_allowed)
        self.window = SignalWindow(config.window_s)
        self._parallelism = parallelism
        self._metrics = metrics
        self._rescale = rescale
        self._clock = clock
        self._sleep = sleep
        self._busy = busy
        self.started_s = clock()
        self.history: list[dict[str, Any]] = []
        self.decisions = 0  # rescales carried out
        self.last_signals: dict[str, OperatorSignals] = {}
        self._last_hold: dict[str, str] = {}
        self._seen_parallelism = dict(parallelism())
        self._demand = demand
        self._demand_base: dict[str, float] = {}  # sources' target rates at the last tick
        self.early_ticks = 0  # ticks a change of demand brought forward
        self.last_reading_s = 0.0  # how long the last tick's reading took
        self._changed_demand: dict[str, float] | None = None  # what brought this tick forward
        self._decided_on = "reading"  # the last tick's signals: a new reading, or the demand

    # ---- the loop -------------------------------------------------------------------------
    async def run(self, running: Callable[[], bool]) -> None:
        """Tick every ``interval_s`` while ``running()``; never raises (errors are logged)."""
        log.info("autoscaler %s started: %s", self.label, self.config)
        while running():
            began = self._clock()
            try:
                await self.tick()
            except Exception as e:  # noqa: BLE001 - the job must keep running
                log.warning("autoscaler tick failed: %s: %s", type(e).__name__, e, exc_info=True)
                self._record({"action": "error", "reason": f"tick failed: {type(e).__name__}: {e}"})
            # one tick per interval: the time the tick took (asking busy instances for their
            # counters, a rescale) comes off the wait, so the samples stay interval_s apart
            await self._wait_next_tick(began, running)

    async def _wait_next_tick(self, began: float, running: Callable[[], bool]) -> None:
        """Until the next tick is due; meanwhile, every ``demand_poll_s``, the sources' target
        rates: if one changed by more than ``demand_change`` since the last tick (a load step),
        the next tick comes at once instead of up to ``interval_s`` later."""
        wait = next_tick_wait(began, self._clock(), self.config.interval_s)
        poll = self.config.demand_poll_s
        if self._demand is None or poll <= 0 or poll >= wait or not self._demand_base:
            await self._sleep(wait)
            return
        end = self._clock() + wait
        while running():
            left = end - self._clock()
            if left <= 0:
                return
            await self._sleep(min(poll, left))
            if not self.window.ready(WINDOW_READY):
                continue  # no decision could be taken yet anyway
            try:
                now = await self._demand()
            except Exception:  # noqa: BLE001 - a source that does not answer: tick as usual
                continue
            if demand_changed(self._demand_base, now, self.config.demand_change):
                self.early_ticks += 1
                self._changed_demand = dict(now)
                return

    async def tick(self) -> list[dict[str, Any]]:
        """One sample; once the window is full, one decision. Returns the entries it recorded.

        A tick that a change of the sources' target rates brought forward decides (with
        ``decide_on_demand``) on the window as it is, with those new target rates, without a new
        reading: the true rates and busy times of the last ``window_s`` do not change within a
        few milliseconds, and reading every instance (busy ones answer between two slices of
        their records) delayed the decision by up to ~0.1 s."""
        changed, self._changed_demand = self._changed_demand, None
        if self._busy():  # a rescale runs (e.g. one asked by hand): its signals mean nothing
            self.window.reset()
            return []
        current = dict(self._parallelism())
        if current != self._seen_parallelism:  # changed from outside: start the window over
            self._seen_parallelism = current
            self.window.reset()
        if changed is not None and self.config.decide_on_demand and self.window.ready(WINDOW_READY):
            now = self._clock()
            self.last_reading_s = 0.0
            self._decided_on = "demand"
            self._demand_base = dict(changed)
            signals = with_demand(self.window.signals(self.kinds, current), changed)
        else:
            read_at = self._clock()
            snap = await self._metrics()
            now = self._clock()
            self.last_reading_s = now - read_at
            self._decided_on = "reading"
            self._demand_base = source_demand(snap.get("instances", []))
            self.window.add(now, snap.get("instances", []))
            if not self.window.ready(WINDOW_READY):
                return []
            signals = self.window.signals(self.kinds, current)
        self.last_signals = signals
        ctx = ScalingContext(
            now_s=now,
            elapsed_s=now - self.started_s,
            operators=signals,
            upstream=self.upstream,
            rescalable=frozenset(self.guard.rescalable),
            min_parallelism={op: self.guard.bounds(op)[0] for op in self.guard.rescalable},
            max_parallelism={op: self.guard.bounds(op)[1] for op in self.guard.rescalable},
        )
        try:
            decision = as_decision(self._decide(ctx))
        except Exception as e:  # noqa: BLE001 - a broken policy must not stop the job
            log.warning(
                "autoscaler %s: the policy raised %s: %s; no change",
                self.label,
                type(e).__name__,
                e,
            )
            return [
                self._record(
                    {"action": "error", "reason": f"policy raised {type(e).__name__}: {e}"}
                )
            ]
        entries = []
        for change in self.guard.apply(decision, signals, now):
            entry = self._entry(change, signals.get(change.operator), now)
            acting = change.action in ("scale_out", "scale_in")
            if not acting and not self._news(change):
                continue  # the same hold or warning as last time: logged and recorded once
            for w in change.warnings:
                log.warning("autoscaler %s: %s", self.label, w)
            if acting:
                entries.append(await self._carry_out(change, entry))
            else:
                log.info("autoscaler %s: %s", self.label, _describe(entry))
                entries.append(self._record(entry))
        return entries

    async def _carry_out(self, change: Change, entry: dict[str, Any]) -> dict[str, Any]:
        log.info("autoscaler %s: %s", self.label, _describe(entry))
        t0 = self._clock()
        try:
            stats = await self._rescale(change.operator, change.target)
        except Exception as e:  # noqa: BLE001 - logged; the job keeps running
            entry["result"] = f"failed: {type(e).__name__}: {e}"
            log.warning("autoscaler %s: rescale of %r failed: %s", self.label, change.operator, e)
        else:
            entry["result"] = "done"
            entry["rescale"] = {
                k: stats.get(k) for k in ("strategy", "duration_s", "moved_key_groups")
            }
            self.decisions += 1
        end = self._clock()
        entry["duration_s"] = end - t0
        self.guard.rescaled(change.operator, end)
        self._last_hold.pop(change.operator, None)
        self._seen_parallelism = dict(self._parallelism())
        self.window.reset()
        return self._record(entry)

    def next_scale_out_instances(self) -> int:
        """Instances the policy's next scale-out would add, over every rescalable operator,
        within its maximum parallelism: from the policy's ``next_scale_out(parallelism)`` (the
        parallelism it would ask for next when overloaded); 0 for a policy without one."""
        fn = getattr(self.policy, "next_scale_out", None)
        if fn is None:
            return 0
        current = self._parallelism()
        total = 0
        for op in self.guard.rescalable:
            p = int(current.get(op, 1))
            hi = self.guard.bounds(op)[1]
            total += max(0, min(hi, int(fn(p))) - p)
        return total

    def next_parallelism(self, op: str) -> int | None:
        """The parallelism the policy's next scale-out of ``op`` would ask for (within its
        bounds), or None (a policy without ``next_scale_out``, an operator it does not rescale)."""
        fn = getattr(self.policy, "next_scale_out", None)
        if fn is None or op not in self.guard.rescalable:
            return None
        p = int(self._parallelism().get(op, 1))
        return max(p, min(self.guard.bounds(op)[1], int(fn(p))))

    def next_rescale_after_s(self) -> float:
        """Seconds after an operator's rescale ended before this autoscaler can rescale it
        again: its cooldown, and a (nearly) full signal window (the window starts over)."""
        return max(float(self.config.cooldown_s), float(self.config.window_s) * WINDOW_READY)

    # ---- records --------------------------------------------------------------------------
    def _news(self, change: Change) -> bool:
        """A hold or an ignored wish worth recording: not a plain "keep what runs", and not the
        same (guard reason, warnings) as the last one recorded for this operator."""
        if change.target == change.proposed and not change.warnings:
            self._last_hold.pop(change.operator, None)
            return False
        key = " | ".join(
            [change.action, *(n.split(":")[0] for n in change.notes), *change.warnings]
        )
        if self._last_hold.get(change.operator) == key:
            return False
        self._last_hold[change.operator] = key
        return True

    def _entry(self, c: Change, sig: OperatorSignals | None, now: float) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "t_s": now - self.started_s,
            "policy": self.label,
            "operator": c.operator,
            "from": c.current,
            "proposed": c.proposed,
            "to": c.target,
            "action": c.action,
            "reason": c.reason,
            "guard": list(c.notes),
            "warnings": list(c.warnings),
            "reading_s": round(self.last_reading_s, 4),  # the sample's own time
            "signals_from": self._decided_on,  # a new reading, or the last one and new demand
        }
        if sig is not None:
            entry["signals"] = {
                "input_rate_eps": round(sig.input_rate_eps, 1),
                "busy_fraction": round(sig.busy_fraction, 3),
                "true_rate_eps": None if sig.true_rate_eps is None else round(sig.true_rate_eps, 1),
                "backlog_batches": sig.backlog_batches,
            }
        return entry

    def _record(self, entry: dict[str, Any]) -> dict[str, Any]:
        entry.setdefault("t_s", self._clock() - self.started_s)
        entry.setdefault("policy", self.label)
        self.history.append(entry)
        del self.history[:-MAX_HISTORY]
        return entry

    def summary(self) -> dict[str, Any]:
        """For ``status()``: the policy, the rescales done, the last few decisions and signals."""
        return {
            "policy": self.label,
            "decisions": self.decisions,
            "early_ticks": self.early_ticks,
            "recent": self.history[-5:],
            "signals": {
                n: {
                    "input_rate_eps": round(s.input_rate_eps, 1),
                    "busy_fraction": round(s.busy_fraction, 3),
                    "true_rate_eps": s.true_rate_eps,
                    "backlog_batches": s.backlog_batches,
                    "parallelism": s.parallelism,
                }
                for n, s in self.last_signals.items()
            },
        }

    @classmethod
    def for_controller(
        cls, controller: Any, policy: Any, label: str, config: AutoscalerConfig
    ) -> Autoscaler:
        """Wired to a :class:`~raystream.controller.Controller`'s metrics and rescale."""
        steps = controller.plan.steps

        async def metrics() -> Mapping[str, Any]:
            """Every instance's counters; unlike ``Controller.metrics`` no latency merge (it grows
            with the run and the autoscaler does not need it)."""
            live = [h for i, h in controller.handles.items() if i not in controller.outcomes]
            # the load per sub-group of the keyed instances too: a rescale decided on this
            # reading plans from it at once (their instances may be busy with a backlog)
            keyed = [
                i
                for i in controller.handles
                if i not in controller.outcomes
                and i not in controller.retired
                and steps.get(i[0]) is not None
                and steps[i[0]].is_keyed
            ]
            snaps, loads = await asyncio.gather(
                asyncio.gather(*(h.metrics.remote() for h in live), return_exceptions=True),
                asyncio.gather(
                    *(controller.handles[i].sub_group_load.remote() for i in keyed),
                    return_exceptions=True,
                ),
            )
            got = [s for s in snaps if isinstance(s, dict)]
            controller.note_reading(
                got,
                {i: a for i, a in zip(keyed, loads, strict=True) if not isinstance(a, Exception)},
            )
            done = [o.get("metrics", {}) for o in controller.outcomes.values()]
            return {"instances": got + done}

        async def demand() -> Mapping[str, float]:
            """The live sources' target rates only (they answer at once, unlike a busy keyed
            instance)."""
            live = [
                controller.handles[i]
                for i in controller.plan.sources
                if i not in controller.outcomes
            ]
            snaps = await asyncio.gather(*(h.metrics.remote() for h in live))
            return source_demand(snaps)

        async def rescale(step: str, parallelism: int) -> Mapping[str, Any]:
            return await controller.rescale(step, parallelism, config.strategy)  # type: ignore[no-any-return]

        return cls(
            policy,
            config,
            kinds={n: s.kind for n, s in steps.items()},
            upstream={n: tuple(s.upstream) for n, s in steps.items()},
            rescalable={n: s.kind for n, s in steps.items() if s.is_keyed},
            parallelism=lambda: controller.parallelism,
            metrics=metrics,
            rescale=rescale,
            busy=controller._rescale_lock.locked,
            label=label,
            max_allowed=controller.flow.key_space.num_key_groups,
            demand=demand,
        )


def source_demand(instances: Any) -> dict[str, float]:
    """Target rate per source step (sum over its live instances) from metric snapshots; steps
    whose sources report none (not rate-limited) are left out.

    >>> source_demand([{"step": "gen", "target_rate_eps": 5e3}, {"step": "gen", "index": 1,
    ...   "target_rate_eps": 5e3}, {"step": "count"}, {"step": "gen", "finished": True}])
    {'gen': 10000.0}
    """
    out: dict[str, float] = {}
    for m in instances:
        if (
            isinstance(m, Mapping)
            and m.get("target_rate_eps") is not None
            and not m.get("finished")
        ):
            out[str(m["step"])] = out.get(str(m["step"]), 0.0) + float(m["target_rate_eps"])
    return out


def demand_changed(before: Mapping[str, float], now: Mapping[str, float], change: float) -> bool:
    """True if a source's target rate in ``now`` differs from ``before`` by more than
    ``change`` (a fraction of the larger of the two); a source in only one of them does not count.

    >>> demand_changed({"gen": 5e3}, {"gen": 2e4}, 0.2), demand_changed({"gen": 5e3}, {"gen": 5.5e3}, 0.2)
    (True, False)
    """
    for step, rate in now.items():
        old = before.get(step)
        if old is None:
            continue
        if abs(rate - old) > change * max(abs(rate), abs(old), 1e-9):
            return True
    return False


def with_demand(
    signals: Mapping[str, OperatorSignals], demand: Mapping[str, float]
) -> dict[str, OperatorSignals]:
    """``signals`` with the target rates of the source steps in ``demand`` replaced (the rest as
    they are): what a policy sees when the sources were asked for a new rate since the reading.

    >>> sig = {"gen": OperatorSignals("gen", "source", 1, target_rate_eps=5e3),
    ...        "count": OperatorSignals("count", "keyed", 1, true_rate_eps=9e3)}
    >>> out = with_demand(sig, {"gen": 2e4, "gone": 1.0})
    >>> out["gen"].target_rate_eps, out["count"] is sig["count"], sorted(out)
    (20000.0, True, ['count', 'gen'])
    """
    return {
        name: (
            replace(sig, target_rate_eps=float(demand[name]))
            if name in demand and sig.kind == "source"
            else sig
        )
        for name, sig in signals.items()
    }


def next_tick_wait(began_s: float, now_s: float, interval_s: float) -> float:
    """Seconds to wait after a tick that began at ``began_s`` (it is ``now_s``) so that ticks
    start ``interval_s`` apart; a tick that took longer than that (a rescale) is followed by a
    short pause, not by a burst of catch-up ticks.

    >>> next_tick_wait(10.0, 10.05, 0.25), next_tick_wait(10.0, 12.0, 0.25)
    (0.2, 0.025)
    """
    return round(max(interval_s - (now_s - began_s), interval_s / 10), 9)


def _describe(e: dict[str, Any]) -> str:
    what = {"scale_out": "scale out", "scale_in": "scale in"}.get(e["action"], e["action"])
    text = f"{e['operator']} {e['from']} -> {e['to']} ({what}; asked {e['proposed']!r})"
    if e.get("reason"):
        text += f": {e['reason']}"
    if e.get("guard"):
        text += f" | guard: {'; '.join(e['guard'])}"
    return text
