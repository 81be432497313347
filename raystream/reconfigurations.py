"""The controller's changes to a running job besides rescaling: replace a step's function, and
one record per change (rescales too), with the job's graph and its version.

A mixin of :class:`raystream.controller.Controller` (as :mod:`raystream.recovery` is). Every change
goes through the rescale queue (``_rescale_lock``): one at a time, in order, never during a
checkpoint; every change has its epoch from the one epoch counter.

Replace: validate (raystream.reconfigure; nothing changes when the function does not fit), then a
``replace`` barrier from every source. Every instance aligns it like a checkpoint barrier (a
channel that delivered it waits until every input has), so on a step with several inputs too,
every record sent before the barrier went through the old function and every record after it
goes through the new one. The replaced step's instances swap the function (and rewrite state,
if a state migration function was given) while aligned, then forward the barrier. Keyed state
stays where it is: per key and channel, order is kept and nothing is applied twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from raystream.errors import ReconfigurationError
from raystream.metrics import LatencyRecorder
from raystream.reconfigure import check_replacement
from raystream.runtime.messages import Barrier

__all__ = ["Reconfigurations"]

PEAK_AFTER_S = 2.0  # latency is looked at until this long after a change ended


def _fn_name(fn: Any) -> str:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{module}:{name}" if module else str(name)


class Reconfigurations:
    """Replace a step's function; records of every change; the graph and its version."""

    # ---- replace a function ------------------------------------------------------------------
    async def replace_function(
        self: Any,
        step: str,
        op: Any,
        migrate_state: Callable[[Any], Any] | dict[str, Callable[[Any], Any]] | None = None,
        key: str | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Replace the function of operator step ``step`` by operator ``op`` at a barrier; returns
        the change's record once every instance switched. Queued behind a running rescale or
        change. Refused (ReconfigurationError, nothing changed) when ``op`` does not fit."""
        steps = self.plan.steps
        if step not in steps:
            msg = (
                f"cannot replace the function of {step!r}: no such step; the steps are "
                f"{list(steps)}"
            )
            raise ReconfigurationError(msg)
        new_step, migrations = check_replacement(
            steps[step], op, key=key, migrate_state=migrate_state
        )
        attempt = self._attempt
        self._queued += 1
        try:
            async with self._rescale_lock:
                self._queued -= 1
                if self._attempt != attempt:
                    msg = (
                        f"job {self.flow.name!r} recovered from a failure while the replacement "
                        f"of {step!r} waited; nothing changed, request it again"
                    )
                    raise ReconfigurationError(msg)
                if self.state != "running" or self._sources_done():
                    msg = (
                        f"job {self.flow.name!r} is {self.state}"
                        f"{' and its sources finished' if self._sources_done() else ''}: the "
                        f"function of {step!r} was not replaced; replace functions while the "
                        "sources still read"
                    )
                    raise ReconfigurationError(msg)
                return await self._replace(step, new_step, migrations, attempt, timeout_s)
        finally:
            self._queued = max(0, self._queued)

    async def _replace(
        self: Any,
        step: str,
        new_step: Any,
        migrations: dict[str, Any],
        attempt: int,
        timeout_s: float | None,
    ) -> dict[str, Any]:
        old_fn = self.plan.steps[step].fn
        t0 = time.time()
        epoch = self._next_epoch()
        payload = {"step": step, "new_step": new_step, "migrations": migrations, "aligned": True}
        taken: list[bool] = []
        try:
            acks = await self.inject(
                Barrier(epoch, "replace", payload),
                float(timeout_s or self.config.rescale_timeout_s),
                taken=taken,
            )
        except Exception as e:
            if taken and not any(taken):
                msg = (
                    f"job {self.flow.name!r} reached the end of its input before the replace "
                    f"barrier of {step!r} went out: nothing changed"
                )
                raise ReconfigurationError(msg) from e
            if self._attempt != attempt or self.state != "running":
                msg = (
                    f"job {self.flow.name!r} failed or recovered while replacing the function of "
                    f"{step!r} (epoch {epoch}); the job recovers (or recovered) from its latest "
                    "checkpoint with the function it had; request the replacement again"
                )
                raise ReconfigurationError(msg) from e
            raise
        self._adopt_step(step, new_step)
        t1 = time.time()
        mine = [a for a in acks if tuple(a["instance"])[0] == step]
        record = self._record_reconfiguration(
            "replace",
            step,
            t0,
            t1,
            epochs=[epoch],
            moved={"migrated_state_rows": int(sum(a.get("migrated_rows", 0) for a in mine))},
            change=f"{_fn_name(old_fn)} -> {_fn_name(new_step.fn)}",
            instances=len(mine),
        )
        if self.config.checkpoint_interval_s > 0 or self.config.checkpoint_dir:
            # a recovery restarts with the new function: give it a checkpoint taken after it
            try:
                ck = await self._take_checkpoint(120.0)
                record["checkpoint_after"] = ck["checkpoint_id"]
            except Exception as e:  # noqa: BLE001 - the change is done; the next one comes
                record["checkpoint_after"] = f"failed: {type(e).__name__}: {e}"
        return record

    def _adopt_step(self: Any, name: str, new_step: Any) -> None:
        """The step runs ``new_step``'s function: new instances (scale-outs) and recoveries
        start with it."""
        fields = {"fn": new_step.fn, "state": new_step.state, "on_timer": new_step.on_timer}
        self.flow.steps[name] = replace(self.flow.steps[name], **fields)
        self.plan.steps[name] = replace(self.plan.steps[name], **fields)
        for iid, spec in list(self.specs.items()):
            if iid[0] == name:
                self.specs[iid] = replace(spec, step=replace(spec.step, **fields))
        for iid, spec in list(self.plan.instances.items()):
            if iid[0] == name:
                self.plan.instances[iid] = replace(spec, step=replace(spec.step, **fields))

    # ---- records, graph ------------------------------------------------------------------------
    def _record_reconfiguration(
        self: Any,
        kind: str,
        step: str,
        t0: float,
        t1: float,
        *,
        epochs: list[int],
        moved: dict[str, Any],
        change: str,
        **extra: Any,
    ) -> dict[str, Any]:
        self.graph_version += 1
        origin = self.origin_ns / 1e9
        record = {
            "kind": kind,
            "step": step,
            "epoch": epochs[-1] if epochs else None,
            "epochs": list(epochs),
            "start_s": t0 - origin,
            "end_s": t1 - origin,
            "duration_s": t1 - t0,
            "change": change,
            "moved": dict(moved),
            "graph_version": self.graph_version,
            **extra,
        }
        self.reconfigurations.append(record)
        return record

    def reconfiguration_records(self: Any, latency: LatencyRecorder | None) -> list[dict[str, Any]]:
        """Every change so far; with sink latency, the peak (max) and p99 of the records that
        reached a sink from the change's start until ``PEAK_AFTER_S`` after its end."""
        out = []
        for r in self.reconfigurations:
            r = dict(r)
            if latency:
                s = latency.summary_between(r["start_s"], r["end_s"] + PEAK_AFTER_S)
                r["peak_latency_ms"] = s["max_ms"]
                r["p99_latency_ms"] = s["p99_ms"]
            out.append(r)
        return out

    def graph(self: Any) -> list[dict[str, Any]]:
        """The running graph: each step's kind, function, parallelism and upstream steps."""
        rows = []
        for name, st in self.plan.steps.items():
            fn = st.fn
            what = (
                _fn_name(fn)
                if st.kind not in ("source", "sink")
                else (fn.describe() if hasattr(fn, "describe") else type(fn).__name__)
            )
            rows.append(
                {
                    "step": name,
                    "kind": st.kind,
                    "function": what,
                    "parallelism": self.parallelism.get(name),
                    "upstream": list(st.upstream),
                }
            )
        return rows

