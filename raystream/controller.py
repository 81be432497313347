"""The controller: deploys a job's instances, coordinates barriers, reports status and metrics.

A plain class; :func:`raystream.runtime.actors.controller_actor_class` makes it a named actor
(``raystream-controller:<job>`` in namespace ``raystream``) that other processes find by name.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import ray

from raystream.dataflow import Dataflow
from raystream.metrics import LatencyRecorder
from raystream.plan import PhysicalPlan, physical_plan
from raystream.runtime.instance import RuntimeConfig
from raystream.runtime.messages import Barrier, ChannelId

__all__ = ["Controller"]


class Controller:
    """Owns one running job."""

    def __init__(
        self,
        flow: Dataflow,
        parallelism: dict[str, int] | None,
        config: RuntimeConfig,
        state_dir: str,
        *,
        cleanup_state: bool = True,
    ) -> None:
        self.flow = flow
        self.config = config
        self.state_dir = state_dir
        self.cleanup_state = cleanup_state
        self.origin_ns = time.time_ns()
        self.plan: PhysicalPlan = physical_plan(flow, parallelism, config, self.origin_ns, state_dir)
        self.handles: dict[ChannelId, Any] = {}
        self.run_refs: dict[ChannelId, Any] = {}
        self.outcomes: dict[ChannelId, dict[str, Any]] = {}
        self.state = "created"
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.error: dict[str, Any] | None = None
        self._epoch = 0
        self._barrier_acks: dict[int, list[dict[str, Any]]] = {}
        self._barrier_done: dict[int, asyncio.Event] = {}

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self, self_handle: Any) -> dict[str, Any]:
        """Create every instance actor, wire the channels, start the loops (sources last)."""
        from raystream.runtime.actors import InstanceActor

        for iid, spec in self.plan.instances.items():
            self.handles[iid] = InstanceActor.options(
                name=None, max_concurrency=10_000
            ).remote(spec)
        await asyncio.gather(*(h.ping.remote() for h in self.handles.values()))
        await asyncio.gather(
            *(
                h.connect.remote(self._receivers_of(iid), self_handle)
                for iid, h in self.handles.items()
            )
        )
        order = [i for i in self.handles if i not in self.plan.sources] + self.plan.sources
        for iid in order:
            self.run_refs[iid] = self.handles[iid].run.remote()
        self.state = "running"
        self.started_at = time.time()
        asyncio.get_running_loop().create_task(self._watch())
        return self.describe()

    def _receivers_of(self, iid: ChannelId) -> dict[ChannelId, Any]:
        spec = self.plan.instances[iid]
        return {
            (out.step, i): self.handles[(out.step, i)]
            for out in spec.outputs
            for i in range(out.parallelism)
        }

    async def _watch(self) -> None:
        """Collect each instance's outcome; the first failure stops the whole job."""
        futures = [asyncio.ensure_future(_outcome(ref, iid)) for iid, ref in self.run_refs.items()]
        for next_done in asyncio.as_completed(futures):
            out = await next_done
            iid = out["instance"]
            self.outcomes[iid] = out
            if out.get("error") and self.error is None:
                self.error = {"instance": iid, "error": out["error"]}
                self.state = "failed"
                await self._stop_all()
                return
        self.state = "finished"
        self.ended_at = time.time()
        await self._release()

    async def wait(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Wait until the job finished or failed; returns the outcome."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.state in ("created", "running"):
            if deadline is not None and time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        return self.outcome()

    def outcome(self) -> dict[str, Any]:
        return {
            "job": self.flow.name,
            "state": self.state,
            "error": self.error,
            "elapsed_s": ((self.ended_at or time.time()) - (self.started_at or time.time())),
            "results": {
                iid: out.get("result") for iid, out in self.outcomes.items() if iid in self.plan.sinks
            },
            "metrics": [out.get("metrics", {}) for out in self.outcomes.values()],
            "origin_ns": self.origin_ns,
        }

    async def stop(self) -> dict[str, Any]:
        if self.state in ("created", "running"):
            self.state = "stopped"
            await self._stop_all()
        return self.outcome()

    async def _stop_all(self) -> None:
        for h in self.handles.values():
            ray.kill(h, no_restart=True)
        self.ended_at = self.ended_at or time.time()
        await self._release()

    async def _release(self) -> None:
        for h in self.handles.values():
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001, S110 - already gone
                pass
        if self.cleanup_state:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    # ---- barriers -------------------------------------------------------------------------
    async def checkpoint(self, directory: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """Aligned checkpoint: sources inject a barrier; every keyed instance snapshots its
        RocksDB into ``directory/<step>/<index>`` when the barrier passed all its inputs."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        acks = await self.inject(Barrier(self._next_epoch(), "checkpoint", {"directory": directory}), timeout_s)
        return {
            "epoch": acks[0]["epoch"] if acks else None,
            "directory": directory,
            "source_offsets": {str(a["instance"]): a["source_offset"] for a in acks if "source_offset" in a},
            "snapshots": {
                str(a["instance"]): {"path": a["snapshot"], "key_groups": a["key_groups"]}
                for a in acks
                if "snapshot" in a
            },
        }

    def _next_epoch(self) -> int:
        self._epoch += 1
        return self._epoch

    async def inject(self, barrier: Barrier, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Inject ``barrier`` at every source; wait until every instance has acknowledged it."""
        if self.state != "running":
            from raystream.errors import ConfigError

            msg = f"job {self.flow.name!r} is {self.state}; barriers need a running job"
            raise ConfigError(msg)
        self._barrier_acks[barrier.epoch] = []
        self._barrier_done[barrier.epoch] = asyncio.Event()
        await asyncio.gather(*(self.handles[s].inject_barrier.remote(barrier) for s in self.plan.sources))
        try:
            await asyncio.wait_for(self._barrier_done[barrier.epoch].wait(), timeout_s)
        except TimeoutError:
            pass
        return self._barrier_acks.pop(barrier.epoch)

    async def on_barrier(self, info: dict[str, Any]) -> None:
        epoch = info["epoch"]
        acks = self._barrier_acks.get(epoch)
        if acks is None:
            return
        acks.append(info)
        if len(acks) >= len(self.plan.instances):
            self._barrier_done[epoch].set()

    # ---- observation ----------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {
            "job": self.flow.name,
            "state": self.state,
            "parallelism": {n: s.parallelism for n, s in self.plan.steps.items()},
            "routing_epochs": {n: t.epoch for n, t in self.plan.routing.items()},
        }

    async def metrics(self) -> dict[str, Any]:
        """Live metrics of every running instance, plus the job's latency summary so far."""
        live = {iid: h for iid, h in self.handles.items() if iid not in self.outcomes}
        snaps = list(await asyncio.gather(*(h.metrics.remote() for h in live.values()), return_exceptions=True))
        snaps = [s for s in snaps if isinstance(s, dict)]
        snaps += [o.get("metrics", {}) for o in self.outcomes.values()]
        lat = [s["latency"] for s in snaps if s.get("latency")]
        summary = LatencyRecorder.merge_snapshots(lat).summary() if lat else None
        return {"job": self.flow.name, "state": self.state, "instances": snaps, "latency": summary}

    async def status(self) -> dict[str, Any]:
        return {**self.describe(), **(await self.metrics())}


async def _outcome(ref: Any, iid: ChannelId) -> dict[str, Any]:
    """An instance's run() result; an actor that died becomes an error outcome."""
    try:
        return dict(await ref)
    except Exception as e:  # noqa: BLE001 - the actor process died or was killed
        return {"instance": iid, "result": None, "error": f"{type(e).__name__}: {e}", "metrics": {}}
