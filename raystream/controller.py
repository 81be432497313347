"""The controller: deploys a job's instances, coordinates barriers, reports status and metrics.

A plain class; :func:`raystream.runtime.actors.controller_actor_class` makes it a named actor
(``raystream-controller:<job>`` in namespace ``raystream``) that other processes find by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import ray

from raystream.assignment import check_rescale_parallelism, rebalance
from raystream.change_spares import ChangeSpares
from raystream.chaining import steps_following
from raystream.checkpointing import RestartStrategy, default_checkpoint_dir
from raystream.dataflow import Dataflow
from raystream.errors import JobFailedError, RaystreamError, RescaleError
from raystream.keyed_chains import KeyedChains
from raystream.keys import RoutingTable
from raystream.metrics import LatencyRecorder, step_totals
from raystream.placement import check_satisfiable, choose_nodes, cluster_nodes, reachable_nodes
from raystream.plan import PhysicalPlan, physical_plan
from raystream.plugins import MIGRATION_STRATEGIES
from raystream.plugins import load as load_plugin
from raystream.rescale import FetchPolicy, RescaleContext
from raystream.runtime.actors import actor_of
from raystream.runtime.instance import RuntimeConfig
from raystream.history import CHECKPOINT_HISTORY, RECORDS_KEPT, BoundedHistory
from raystream.reconfigurations import Reconfigurations
from raystream.recovery import Recovery
from raystream.rewiring import Rewiring
from raystream.root_cause import root_cause
from raystream.standby_prep import Preparation, mismatch, prepared_parallelism
from raystream.warm_watch import WarmWatch
from raystream.runtime.messages import Barrier, ChannelId
from raystream.runtime.migration import transfer_summary

__all__ = ["Controller"]

# a rescale plans from the autoscaler's reading (load per sub-group, backlog) if it is this fresh
READING_MAX_AGE_S = 2.0
# an old owner takes short slices this long after a rescale starts, or until its task came
EXPECT_RESCALE_S = 2.0
STANDBY_STARTS_KEPT = 8  # standby waves whose start-up time the estimate keeps
# metrics()/status() wait this long for an instance's own metrics: one that does not answer (its
# node was lost and Ray has not declared it dead yet, ~15 s; its loop is stuck) is listed in
# "unanswered" instead of holding up the caller
METRICS_ANSWER_S = 5.0
RECONFIGURATIONS_SHOWN = 100  # changes listed by metrics()/status(), the newest


class Controller(Recovery, Reconfigurations, Rewiring, KeyedChains, ChangeSpares, WarmWatch):
    """Owns one running job."""

    def __init__(
        self,
        flow: Dataflow,
        parallelism: dict[str, int] | None,
        config: RuntimeConfig,
        state_dir: str,
        *,
        cleanup_state: bool = True,
        autoscaler: tuple[Any, str, Any] | None = None,  # (policy, label, AutoscalerConfig)
        restore_from: tuple[str, str] | None = None,  # ("checkpoint", "latest"|id|path) | ("savepoint", path)
        parallelism_given: tuple[str, ...] = (),  # steps whose parallelism the user chose
    ) -> None:
        self.flow = flow
        self.config = config
        self._parallelism_arg = dict(parallelism or {})
        self.plan_dir = state_dir
        self.state_dir = state_dir
        self.cleanup_state = cleanup_state
        self.origin_ns = time.time_ns()
        self.plan: PhysicalPlan = physical_plan(
            flow, parallelism, config, self.origin_ns, state_dir
        )
        self.handles: dict[ChannelId, Any] = {}
        self.outcomes: dict[ChannelId, dict[str, Any]] = {}
        self.state = "created"
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.error: dict[str, Any] | None = None
        self._epoch = 0
        self.routing = dict(self.plan.routing)
        self.parallelism = {n: s.parallelism or 1 for n, s in self.plan.steps.items()}
        self.specs = dict(self.plan.instances)
        self.retired: set[ChannelId] = set()
        # the newest RECORDS_KEPT of each (a BoundedHistory: len() counts them all)
        self.rescales: BoundedHistory = BoundedHistory(RECORDS_KEPT)
        self._rescale_lock = asyncio.Lock()
        self._waiters = 0  # wait() calls for the end in flight (a driver's, a CLI's)
        self._queued = 0
        self._run_futures: dict[ChannelId, asyncio.Future[Any]] = {}
        self._run_handles: dict[ChannelId, Any] = {}
        # instances of this attempt retired by a change whose index came back: their metrics
        # added up per step (every one: the totals of status()), and the newest RECORDS_KEPT
        # of their metrics themselves (for the job's result)
        self._retired_totals: dict[str, dict[str, float]] = {}
        self._history: BoundedHistory = BoundedHistory(RECORDS_KEPT)
        # warm actors, each named for the instance it would become: (actor, its node id, slot)
        self._standby: list[tuple[Any, str, ChannelId]] = []
        self.nodes: dict[ChannelId, str] = {}  # the node each instance runs on
        self._failed_nodes: dict[ChannelId, str] = {}  # ... in the attempt a recovery replaces
        self._unreachable: set[str] = set()  # ... of those, the nodes found lost
        self._standby_filling = False  # outcomes of retired instances whose id came back
        self._standby_creating: set[ChannelId] = set()  # slots a fill is starting an actor for
        # standbys configured and connected for their slot ahead (raystream.standby_prep)
        self._prepared: dict[ChannelId, Preparation] = {}
        self._preparing: set[ChannelId] = set()  # slots being prepared now
        self._preparations = 0  # preparations made (each gets a state folder of its own)
        self._spawning: set[ChannelId] = set()  # ids a scale-out is starting an instance for
        self._standby_refill = False  # a fill was asked for while one ran
        # steps whose refill after a scale-out waits until its load is gone (ds2): a scale-in
        # meanwhile leaves its own refill to that one (standby_pacing)
        self._refill_waiting: Counter[str] = Counter()
        # after each scale-out: when and why (the newest RECORDS_KEPT; len() counts all)
        self.standby_refills: BoundedHistory = BoundedHistory(RECORDS_KEPT)
        self._standby_starts: list[tuple[int, float]] = []  # (processes, seconds) per wave
        self._cpus: float | None = None
        self._init_spares()  # warm actors under neutral names for inserts and moves
        self._init_warm_watch()  # ... and a watch over them and the standbys
        self._barrier_acks: dict[int, list[dict[str, Any]]] = {}
        self._barrier_done: dict[int, asyncio.Event] = {}
        self._barrier_expected: dict[int, set[ChannelId]] = {}
        # migration step epoch -> the instances that reported their part done, with their stats
        self._migration_reports: dict[int, dict[ChannelId, dict[str, Any]]] = {}
        self.final_checkpoint: dict[str, Any] | None = None
        self._autoscaler_spec = autoscaler
        self.autoscaler: Any = None
        # checkpoints and recovery (raystream.recovery)
        self.storage_spec = (config.checkpoint_dir or default_checkpoint_dir(), flow.name)
        self._storage: Any = None
        self.restart = RestartStrategy(
            config.restart_attempts, config.restart_delay_s, config.restart_failure_rate
        )
        self.recoveries: BoundedHistory = BoundedHistory(RECORDS_KEPT)  # len() counts all
        # what each replaced attempt did (the newest RECORDS_KEPT; len() counts them all), and
        # the per-step totals of every failed attempt, those no longer kept included
        self.failed_attempts: BoundedHistory = BoundedHistory(RECORDS_KEPT)
        self._failed_totals: dict[str, dict[str, float]] = {}
        # the newest CHECKPOINT_HISTORY records of each; len() counts them all (completed, failed)
        self.checkpoint_stats: BoundedHistory = BoundedHistory(CHECKPOINT_HISTORY)
        self.failed_checkpoints: BoundedHistory = BoundedHistory(CHECKPOINT_HISTORY)
        self.restore_from = restore_from
        self.parallelism_given = set(parallelism_given)
        self.restored_from: dict[str, Any] | None = None
        self._attempt = 0
        self._heartbeats: dict[ChannelId, float] = {}
        self._hung: dict[ChannelId, str] = {}
        self._source_emitted: dict[ChannelId, int] = {}
        # one record per change (every kind): the newest RECORDS_KEPT (len() counts them all)
        self.reconfigurations: BoundedHistory = BoundedHistory(RECORDS_KEPT)
        # change index -> its (peak, p99) sink latency, once the sinks are past it
        self._settled_latency: dict[int, tuple[Any, Any]] = {}
        self.graph_version = 1  # +1 per completed change of the running graph
        self.slots: dict[tuple[str, int], ChannelId] = {}  # routing index -> instance, if moved
        # steps chained after a keyed step follow its rescales (raystream.keyed_chains)
        self.following = steps_following(self.plan.steps, enabled=config.chaining)
        self._sink_writers: dict[ChannelId, int] = {}  # sink instance -> its writer index
        self._writers_used: dict[str, set[int]] = {}  # sink -> writer indexes ever opened
        self._retired_results: list[tuple[ChannelId, Any]] = []
        self._retired_sink_states: list[tuple[str, Any]] = []  # listed in every checkpoint
        # the wall-clock marks of each deploy (the first also this process's start-up)
        self.deploys: list[dict[str, Any]] = []
        self._startup = {"init_at": time.time()}

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self, self_handle: Any) -> dict[str, Any]:
        """Create every instance actor, wire the channels, start the loops (sources last)."""
        self._self = self_handle
        if self.config.checkpoint_interval_s > 0 or self.config.checkpoint_dir:
            await asyncio.to_thread(lambda: self.storage)  # not writable: fail now, say where
        for step in self.flow.steps.values():  # an output folder that cannot be written, too
            if step.kind == "sink" and callable(getattr(step.fn, "check_writable", None)):
                await asyncio.to_thread(step.fn.check_writable)
        if self.restore_from is not None:
            manifest = await self._resolve_restore(*self.restore_from)
            self._replan(manifest, self.state_dir)
        else:
            self._replan(None, self.state_dir, fresh=True)
        await self._deploy()
        self.state = "running"
        self.started_at = time.time()
        asyncio.get_running_loop().create_task(self._watch())
        self._start_recovery_loops()
        if self._autoscaler_spec is not None:
            from raystream.autoscaling import Autoscaler

            self.autoscaler = Autoscaler.for_controller(self, *self._autoscaler_spec)
            asyncio.get_running_loop().create_task(
                self.autoscaler.run(lambda: self.state == "running")
            )
        if self.config.migration_support and any(s.is_keyed for s in self.plan.steps.values()):
            asyncio.get_running_loop().create_task(self._fill_standby(self.config.standby_delay_s))
            asyncio.get_running_loop().create_task(self._keep_standbys_prepared())
        if self.config.change_spares:
            delay = self.config.standby_delay_s
            asyncio.get_running_loop().create_task(self._fill_spares(delay))
        asyncio.get_running_loop().create_task(self._watch_warm_actors())
        return self.describe()

    async def _deploy(self, start_at: float | None = None) -> None:
        """Create every instance actor of ``self.plan`` (named), wire them, start the loops
        (sources last; not before ``start_at``, a ``time.monotonic`` time, if given)."""
        from raystream.runtime.actors import (
            NAMESPACE,
            InstanceActor,
            MemberHandle,
            instance_actor_name,
        )
        from raystream.runtime.chain import ChainSpec
        from raystream.runtime.startup import timeline

        marks: dict[str, Any] = {"deploy_at": time.time()}
        if not self.deploys:
            marks["controller"] = timeline(**self._startup)
        self.handles = {}
        nodes = await asyncio.to_thread(cluster_nodes)
        if self.state == "recovering":
            # a node lost with the failed attempt is still listed alive until Ray's health
            # checks give up on it: a recovery places nothing on a node whose raylet is gone
            up, lost = await asyncio.to_thread(reachable_nodes, nodes)
            if up:
                nodes = up
                marks["unreachable_nodes"] = lost
        marks["nodes"] = [n.node_id for n in nodes]
        for step in self.plan.steps.values():
            check_satisfiable(step.name, step.actor, nodes)
        # an operator chain is one actor, its head's; the other instances are reached in it
        chained = {m: head for head, ids in self.plan.chains.items() for m in ids[1:]}
        # a recovery's actors reset in place (raystream.actor_reuse) run the same instances
        kept = await self._kept_for_plan(chained, marks)
        chosen: dict[ChannelId, str | None] = {}
        job_placed: Counter[str] = Counter(
            n for n in (self._failed_nodes.get(h) for h in kept) if n is not None
        )
        for name, step in self.plan.steps.items():
            iids = [
                iid for iid in self.specs if iid[0] == name and iid not in chained | kept.keys()
            ]
            picks = choose_nodes(name, step.actor, nodes, len(iids), job_placed=job_placed)
            chosen.update(zip(iids, picks, strict=True))
            job_placed.update(p for p in picks if p is not None)
        configured = []
        for iid, spec in self.specs.items():
            if iid in chained:
                self.handles[iid] = MemberHandle(self.handles[chained[iid]], iid)
                continue
            ids = self.plan.chains.get(iid)
            actor_spec = ChainSpec(tuple(self.specs[i] for i in ids)) if ids else spec
            if iid in kept:
                self.handles[iid] = kept[iid]
                configured.append(kept[iid].configure.remote(actor_spec))
                continue
            self.handles[iid] = InstanceActor.options(
                name=instance_actor_name(self.flow.name, *iid),
                namespace=NAMESPACE,
                max_concurrency=10_000,
                **self.plan.steps[iid[0]].actor.ray_options(chosen[iid]),
            ).remote(actor_spec)
        if self.state == "recovering":
            marks["actors_kept"] = sorted(f"{s}/{i}" for s, i in kept)
            marks["actors_started"] = sorted(
                f"{s}/{i}" for s, i in self.handles if (s, i) not in chained | kept.keys()
            )
        marks["placed_at"] = time.time()  # placement chosen, every actor asked for (or reset)
        await asyncio.gather(*configured)
        # the first deploy starts the warm standbys beside the job's actors, and its sources
        # only once they are up: their start-up (~1 CPU-s each) is not beside the first events
        warm = asyncio.ensure_future(self._fill_standby_once()) if self._standbys_first() else None
        where = await asyncio.gather(*(h.ping.remote() for h in self.handles.values()))
        self.nodes = dict(zip(self.handles, where, strict=True))
        marks["actors_ready_at"] = time.time()  # every actor constructed (RocksDB open)
        await asyncio.gather(
            *(
                h.connect.remote(self._receivers_of(iid), self._self)
                for iid, h in self.handles.items()
            )
        )
        marks["connected_at"] = time.time()
        if start_at is not None and start_at > time.monotonic():  # a recovery's restart delay
            marks["delay_left_s"] = start_at - time.monotonic()
            await asyncio.sleep(marks["delay_left_s"])
        if warm is not None:
            try:
                await warm
            except Exception:  # noqa: BLE001 - no standby yet: the fill after the start retries
                pass
            marks["standbys_ready_at"] = time.time()
        now = time.monotonic()
        self._heartbeats = dict.fromkeys(self.handles, now)
        order = [i for i in self.handles if i not in self.plan.sources] + self.plan.sources
        for iid in order:
            self._run(iid)
        marks["running_at"] = time.time()
        self.deploys.append(marks)

    async def _kept_for_plan(
        self, chained: dict[ChannelId, ChannelId], marks: dict[str, Any]
    ) -> dict[ChannelId, Any]:
        """The actors a recovery reset for this plan, by head: each runs the same instances in
        the new plan (else it is stopped here and its instances get a new actor)."""
        kept_actors = getattr(self, "_kept_actors", {})
        if self.state != "recovering":
            return {}
        kept: dict[ChannelId, Any] = {}
        gone: dict[ChannelId, Any] = {}
        for head, (ids, actor) in kept_actors.items():
            plan_ids = frozenset(self.plan.chains.get(head) or (head,))
            if head in self.specs and head not in chained and plan_ids == ids:
                kept[head] = actor
            else:
                gone[head] = actor
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
        if gone:
            await self._names_free(gone)
            marks["actors_not_kept"] = sorted(f"{s}/{i}" for s, i in gone)
        return kept

    def _drop_warm_actors_gone(self, alive: list[str]) -> list[str]:
        """Forget the warm standbys and change spares on nodes not in ``alive`` (they died with
        their node: a scale-out, insert or move must not wait for them) and refill both; returns
        the names of the actors dropped."""
        from raystream.placement import on_nodes_gone

        gone_standbys = [
            self._standby[k] for k in on_nodes_gone([n for _, n, _ in self._standby], alive)
        ]
        gone_spares = [self._spares[k] for k in on_nodes_gone([n for *_, n in self._spares], alive)]
        return self._drop_warm_entries(gone_standbys, gone_spares)

    def _drop_warm_entries(
        self, standbys: list[Any], spares: list[Any], why: str = "node lost"
    ) -> list[str]:
        """Forget these warm standbys ((actor, node, slot)) and change spares ((actor, name,
        node)), stop their actors and refill both; returns their names (standbys first)."""
        from raystream.runtime.actors import instance_actor_name

        standbys = [e for e in standbys if e in self._standby]  # not taken meanwhile
        spares = [e for e in spares if e in self._spares]
        for entry in standbys:
            self._standby.remove(entry)
            # its preparation is gone with it: status must not list the slot as prepared until
            # the refill's standby is prepared (the scale-out would not use it: other actor)
            self._prepared.pop(entry[2], None)
        for entry in spares:
            self._spares.remove(entry)
        for h in [e[0] for e in [*standbys, *spares]]:
            try:
                ray.kill(h, no_restart=True)  # its name is freed at once
            except Exception:  # noqa: BLE001, S110 - already gone
                pass
        loop = asyncio.get_running_loop()
        if standbys and self.config.migration_support:
            loop.create_task(self._fill_standby())
        if spares:
            self._refill_spares_later(why)
        return [instance_actor_name(self.flow.name, *slot) for *_, slot in standbys] + [
            name for _, name, _ in spares
        ]

    def _standbys_first(self) -> bool:
        """Whether this deploy starts the warm standbys before the sources run: the job's first,
        with ``standby_before_sources`` and no ``standby_delay_s``."""
        c = self.config
        return (
            not self.deploys
            and c.standby_before_sources
            and c.standby_delay_s == 0
            and c.standby_instances > 0
            and c.migration_support
            and any(s.is_keyed for s in self.plan.steps.values())
        )

    def _may_fill_standbys(self) -> bool:
        """The job runs, or its first deploy does (:meth:`_standbys_first`)."""
        return self.state == "running" or (self.state == "created" and not self.deploys)

    def _run(self, iid: ChannelId) -> None:
        # heartbeats count from now: an index a scale-in retired and a scale-out reuses must not
        # inherit its old incarnation's last heartbeat (it would be "hung" at once)
        self._heartbeats[iid] = time.monotonic()
        self._run_futures[iid] = asyncio.ensure_future(_outcome(self.handles[iid].run.remote(), iid))
        self._run_handles[iid] = self.handles[iid]

    def _receivers_of(self, iid: ChannelId) -> dict[ChannelId, Any]:
        spec = self.specs[iid]
        return {r: self.handles[r] for out in spec.outputs for r in out.receiver_ids}

    async def _watch(self) -> None:
        """Collect outcomes as instances end (new ones join on rescale). A failure (an error, an
        actor that died, one that stopped answering heartbeats) recovers the job from its latest
        checkpoint when checkpointing is on and the restart strategy allows, else fails it; the
        job is finished when every instance is."""
        while self.state in ("running", "recovering"):
            pending = {i: f for i, f in self._run_futures.items() if i not in self.outcomes}
            if pending:
                await asyncio.wait(
                    list(pending.values()), timeout=0.25, return_when=asyncio.FIRST_COMPLETED
                )
            attempt = self._attempt
            for iid, fut in pending.items():
                if not fut.done() or self._attempt != attempt:
                    continue
                if self._run_futures.get(iid) is not fut:
                    # a reused id (scale-in, then out): this was its retired holder's run, and
                    # the instance now under that id is another actor; it must not be stopped
                    continue
                out = fut.result()
                self.outcomes[iid] = out
                if out.get("error") and self.error is None and self.state == "running":
                    # a sender that lost its receiver: the receiver's death is the cause
                    at, why = await root_cause(iid, out, pending)
                    cause = {
                        "instance": tuple(why.get("error_instance") or at),
                        "error": self._hung.pop(at, None) or why["error"],
                        "traceback": why.get("traceback"),
                        "context": why.get("context"),
                    }
                    if await self._recover_or_fail(cause):
                        break  # a new attempt runs: collect its outcomes
                    return
                if iid in self.retired:
                    self._stop_retired(iid)  # (a chain's actor once all its instances ended)
                    if self.config.migration_support:  # its index may get a standby now
                        self._refill_after_scale_in(self.following.get(iid[0], iid[0]))
                self._check_barriers()
            if self.state == "running" and all(i in self.outcomes for i in self._run_futures):
                if await self._final_commit():
                    break
        if self.state != "running":
            return
        self.state = "failed" if self.error is not None else "finished"  # a rescale may fail it
        self.ended_at = time.time()
        await self._release()

    async def wait(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Wait until the job finished or failed; returns the outcome."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._waiters += 1
        try:
            while self.state in ("created", "running", "recovering"):
                if deadline is not None and time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            if self.state not in ("created", "running"):
                await self._rescales_settled(10.0)
            return self.outcome()
        finally:
            self._waiters -= 1

    def outcome(self) -> dict[str, Any]:
        return {
            "job": self.flow.name,
            "state": self.state,
            "error": self.error,
            "elapsed_s": ((self.ended_at or time.time()) - (self.started_at or time.time())),
            "results": {
                iid: out.get("result")
                for iid, out in self.outcomes.items()
                if iid in self.plan.sinks and not out.get("handed_over")
            },
            "retired_results": self.retired_sink_results(),
            # the newest RECORDS_KEPT of each (newest last); <name>_total counts them all
            "rescales": self.rescales.kept(),
            "rescales_total": len(self.rescales),
            "standby_refills": self.standby_refills.kept(),
            "standby_refills_total": len(self.standby_refills),
            "spare_refills": self.spare_refills.kept(),
            "spare_refills_total": len(self.spare_refills),
            "recoveries": self.recoveries.kept(),
            "recoveries_total": len(self.recoveries),
            "checkpoints": self.checkpoint_summary(),
            "autoscaling": list(self.autoscaler.history) if self.autoscaler else [],
            # every instance of this attempt (of those retired: the newest RECORDS_KEPT)
            "metrics": [
                *self._history.kept(),
                *(o.get("metrics", {}) for o in self.outcomes.values()),
            ],
            "retired_instances_total": len(self._history),
            "failed_attempts": self.failed_attempts.kept(),
            "failed_attempts_total": len(self.failed_attempts),
            "origin_ns": self.origin_ns,
        }

    async def stop(self, checkpoint: bool = True) -> dict[str, Any]:
        """Stop the job; first take a final checkpoint (output up to it published; the job can
        resume from it with ``from_checkpoint``). ``checkpoint=False``: a hard stop (cancel)."""
        if self.state == "running" and checkpoint:
            try:
                async with self._rescale_lock:
                    self.final_checkpoint = await self._take_checkpoint(120.0)
            except Exception as e:  # noqa: BLE001 - the stop goes on; the reason is kept
                self.final_checkpoint = {"error": f"{type(e).__name__}: {e}"}
        if self.state in ("created", "running", "recovering"):
            self.state = "stopped"
            await self._stop_all()
        await self._waiters_answered(15.0)
        return self.outcome()

    async def _waiters_answered(self, timeout_s: float) -> None:
        """Until every wait() for the end has its answer: the process that stopped the job
        removes this controller next, and a driver waiting on the job must see "stopped",
        not a killed controller."""
        if not self._waiters:
            return
        deadline = time.monotonic() + timeout_s
        while self._waiters and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # their answers leave before this one

    async def _stop_all(self) -> None:
        live = [h for iid, h in self.handles.items() if iid not in self.outcomes]
        if live:  # sinks abort their temporary files before the actors go
            await asyncio.wait(
                [asyncio.ensure_future(_quietly(h.abort.remote())) for h in live], timeout=5
            )
        for h in self.handles.values():
            ray.kill(actor_of(h), no_restart=True)
        self.ended_at = self.ended_at or time.time()
        await self._release()

    async def _release(self) -> None:
        standby, self._standby = self._standby, []
        spares = self._spare_handles()
        for h in [*self.handles.values(), *(h for h, *_ in standby), *spares]:
            try:
                ray.kill(actor_of(h), no_restart=True)
            except Exception:  # noqa: BLE001, S110 - already gone
                pass
        if self.cleanup_state:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    # ---- barriers -------------------------------------------------------------------------
    def _next_epoch(self) -> int:
        self._epoch += 1
        return self._epoch

    async def inject(
        self, barrier: Barrier, timeout_s: float = 60.0, taken: list[bool] | None = None
    ) -> list[dict[str, Any]]:
        """Inject ``barrier`` at every source; wait until every instance has acknowledged it.
        ``taken`` gets each source's answer (False: its input had ended, it emits no barrier)."""
        if self.state != "running":
            from raystream.errors import ConfigError

            msg = f"job {self.flow.name!r} is {self.state}; barriers need a running job"
            raise ConfigError(msg)
        self._barrier_acks[barrier.epoch] = []
        self._barrier_done[barrier.epoch] = asyncio.Event()
        self._barrier_expected[barrier.epoch] = {
            i for i in self.handles if i not in self.outcomes and i not in self.retired
        }
        answers = await asyncio.gather(
            *(self.handles[s].inject_barrier.remote(barrier) for s in self.plan.sources)
        )
        if taken is not None:
            taken.extend(bool(a) for a in answers)
        done = self._barrier_done[barrier.epoch]
        deadline = time.monotonic() + timeout_s
        try:
            while not done.is_set():
                self._check_barriers()
                if done.is_set():
                    break
                if self.state != "running" or self._sources_done():
                    msg = (
                        f"barrier {barrier.epoch} ({barrier.kind}) did not pass every instance: the job "
                        f"is {self.state}{' and its sources finished' if self._sources_done() else ''}"
                    )
                    raise RaystreamError(msg)
                if time.monotonic() > deadline:
                    msg = (
                        f"barrier {barrier.epoch} ({barrier.kind}) was acknowledged by "
                        f"{len(self._barrier_acks[barrier.epoch])} of {len(self.handles) - len(self.retired)} "
                        f"instances within {timeout_s} s"
                    )
                    raise RaystreamError(msg)
                try:
                    await asyncio.wait_for(done.wait(), 0.05)
                except TimeoutError:
                    pass
            return self._barrier_acks[barrier.epoch]
        finally:
            self._barrier_acks.pop(barrier.epoch, None)
            self._barrier_done.pop(barrier.epoch, None)
            self._barrier_expected.pop(barrier.epoch, None)

    async def on_migration_done(self, info: dict[str, Any]) -> None:
        """An instance finished its part of a migration step (with its statistics, as
        ``migration_done`` returns them): sent by the instance the moment it is done."""
        reports = self._migration_reports.get(int(info.get("epoch", -1)))
        if reports is not None:
            reports[tuple(info["instance"])] = info

    async def on_barrier(self, info: dict[str, Any]) -> None:
        epoch = info["epoch"]
        acks = self._barrier_acks.get(epoch)
        if acks is None:
            return
        acks.append(info)
        self._check_barriers()

    def _check_barriers(self) -> None:
        """A barrier is through once every instance that was live when it was injected has
        acknowledged it, or has finished without ever acknowledging it (its inputs all ended
        first: it owes nothing). An instance that finished after acknowledging is waited for:
        its acknowledgement (sent before it finished) may still be on its way."""
        for epoch, expected in self._barrier_expected.items():
            acked = {tuple(a["instance"]) for a in self._barrier_acks.get(epoch, [])}
            waiting = {
                i
                for i in expected - acked
                if not (i in self.outcomes and epoch not in self.outcomes[i].get("acked", []))
            }
            if not waiting:
                self._barrier_done[epoch].set()

    # ---- rescaling -------------------------------------------------------------------------
    async def rescale(
        self, step: str, parallelism: int, strategy: Any = None, **strategy_args: Any
    ) -> dict[str, Any]:
        """Change the parallelism of keyed step ``step`` while the job runs; returns the
        migration's statistics once all state settled. A rescale requested while one runs waits
        for it (queued, in order)."""
        strat = self._check_rescale(step, parallelism, strategy, strategy_args)
        attempt = self._attempt
        async with self._change_turn():
            if self._attempt != attempt or self.state == "recovering":
                how = "is recovering" if self.state == "recovering" else "recovered"
                msg = (
                    f"job {self.flow.name!r} {how} from a failure while the rescale of "
                    f"{step!r} to {parallelism} waited; nothing was changed, request it again"
                    " once the job runs"
                )
                raise RescaleError(msg)
            if self.state != "running":
                msg = f"job {self.flow.name!r} is {self.state}; only a running job can be rescaled"
                raise RescaleError(msg)
            switched: list[int] = []  # migration steps whose barrier a source emitted
            try:
                return await self._rescale(step, parallelism, strat, switched)
            except RescaleError:
                raise
            except Exception as e:
                await asyncio.sleep(0.5)  # let the watcher record an instance failure first
                if self._attempt != attempt or self.state == "recovering":
                    raise RescaleError(self._interrupted_rescale(step, parallelism)) from e
                if self.error is not None:
                    err = self.error
                    msg = f"job {self.flow.name!r} failed during the rescale, in instance {err['instance']}: {err['error']}"
                    raise JobFailedError(msg) from e
                if (self.state != "running" or self._sources_done()) and not switched:
                    raise RescaleError(self._not_started(step, parallelism)) from e
                if self.state != "running" or self._sources_done():
                    msg = (
                        f"job {self.flow.name!r} reached the end of its input while rescaling "
                        f"{step!r} to {parallelism}; the steps done so far are consistent "
                        "(results stay exact), the rest was not carried out"
                    )
                    raise RescaleError(msg) from e
                raise

    def _interrupted_rescale(self, step: str, parallelism: int) -> str:
        """What the caller of a rescale a failure cut short is told: a recovery redeploys at the
        routing in force, the last one whose migration step completed (the start's if none)."""
        now = self.routing[step].parallelism
        return (
            f"an instance of job {self.flow.name!r} failed during the rescale of {step!r} to "
            f"{parallelism}; the job recovers (or recovered) from its latest checkpoint with "
            f"{step!r} at parallelism {now} (the routing of the rescale's last completed "
            "migration step, or the one it started from); request the rescale again"
        )

    def _check_rescale(
        self, step: str, parallelism: Any, strategy: Any, args: dict[str, Any]
    ) -> Any:
        steps = self.plan.steps
        if step not in steps:
            msg = f"cannot rescale {step!r}: no such step; the steps are {list(steps)}"
            raise RescaleError(msg)
        if not steps[step].is_keyed:
            keyed = [n for n, s in steps.items() if s.is_keyed]
            msg = f"cannot rescale {step!r}: it is a {steps[step].kind} step; keyed steps can be rescaled: {keyed}"
            raise RescaleError(msg)
        check_rescale_parallelism(parallelism, self.flow.key_space.num_key_groups, step)
        if not self.config.migration_support:
            msg = "this job runs with migration_support=False; restart it with it on to rescale"
            raise RescaleError(msg)
        return load_plugin(MIGRATION_STRATEGIES, strategy or self.config.migration, **args)

    def _ended_mid_rescale(self, step: str, parallelism: int, done: int, steps: int) -> str:
        """The message for a rescale in steps that the job's end overtook after some moved."""
        return (
            f"job {self.flow.name!r} reached the end of its input while rescaling {step!r} to "
            f"{parallelism}: {done} of its {steps} migration steps were done and are consistent "
            "(results stay exact); the rest was not carried out"
        )

    def _not_started(self, step: str, parallelism: int) -> str:
        """The message for a rescale the job's end overtook before any state moved."""
        return (
            f"job {self.flow.name!r} reached the end of its input before the rescale of {step!r} "
            f"to {parallelism} could start: its sources had finished, so nothing was moved; "
            f"{step!r} keeps parallelism {self.parallelism[step]} until the job finishes and "
            "results stay exact. Rescale a job only while its sources still read"
        )

    async def _rescale(
        self, step: str, parallelism: int, strategy: Any, switched: list[int]
    ) -> dict[str, Any]:
        """``switched`` gets the index of every migration step whose barrier a source emitted."""
        if self._sources_done():
            raise RescaleError(self._not_started(step, parallelism))
        t0 = time.time()
        old = self.routing[step]
        s = self.flow.key_space.sub_groups
        live = [i for i in range(old.parallelism)]
        for i in live:  # small slices from now: the barrier follows the plan and the new instances
            self.handles[self._at(step, i)].expect_rescale.remote(EXPECT_RESCALE_S)
        reading = self._fresh_reading(step, live)
        if reading is not None:  # the autoscaler's reading behind this decision, ms old
            loads, backlog = reading
        else:  # asked now (a busy instance answers between two slices of its records)
            loads, backlog = await asyncio.gather(
                asyncio.gather(
                    *(self.handles[self._at(step, i)].sub_group_load.remote() for i in live)
                ),
                self._backlog(step, live),
            )
        # when each phase before the move ended: load and backlog known, plan made, new
        # instances started, tasks sent (not waited for), barrier injected, tasks acknowledged
        marks = {"load": time.time()}
        heat = np.sum(loads, axis=0)
        kg_load = heat.reshape(-1, s).sum(axis=1)
        target = rebalance(old, parallelism, kg_load)
        plan = strategy.plan(RescaleContext(step, old, target, kg_load, s))
        marks["plan"] = time.time()
        spawn_marks: dict[str, float] = {}
        t_spawn = time.time()
        if parallelism > old.parallelism:
            await self._spawn(step, range(old.parallelism, parallelism), spawn_marks)
        marks["spawn"] = time.time()
        width = max(parallelism, old.parallelism)
        peers = {i: self.handles[self._at(step, i)] for i in range(width)}
        current = old
        stats: list[dict[str, Any]] = []
        moved: set[int] = set()
        epochs: list[int] = []
        policy = plan.policy
        for k, table in enumerate(plan.steps):
            if self._sources_done() and not switched:
                raise RescaleError(self._not_started(step, parallelism))
            if self._sources_done():
                msg = self._ended_mid_rescale(step, parallelism, k, len(plan.steps))
                raise RescaleError(msg)
            epoch = self._next_epoch()
            epochs.append(epoch)
            table = RoutingTable(epoch=epoch, owners=table.owners, parallelism=table.parallelism)
            final = k == len(plan.steps) - 1
            tasks = _migration_tasks(current, table, width, s, heat, policy, epoch)
            # old owners' instance indexes (their channels downstream; another after a move):
            # a new owner names them in its AfterFences mark
            owner_ids = {i: self._at(step, i)[1] for i in range(width)}
            for t in tasks.values():
                t["owner_ids"] = owner_ids
            moved.update(current.moved_key_groups(table).tolist())
            # the tasks go out on the control path and the barrier right after them, without
            # waiting for the answers: a busy instance takes its task between two slices of its
            # records, before the barrier reaches it (or waits for it when the barrier came first)
            self._migration_reports.setdefault(epoch, {})  # reports may come at the barrier
            prepared = asyncio.gather(
                *(peers[i].prepare_migration.remote(tasks[i], peers) for i in range(width))
            )
            if policy.full_restore or policy.pause_sources:
                await prepared
            marks.setdefault("prepare", time.time())
            payload = {"step": step, "table": table, "final": final, "aligned": policy.full_restore}
            barrier = Barrier(epoch, "rescale", payload)
            if policy.pause_sources:
                await asyncio.gather(*(self.handles[i].pause.remote() for i in self.plan.sources))
            try:
                if policy.full_restore:
                    await self._stop_and_restore(step, barrier, table, width, peers)
                else:
                    taken = await asyncio.gather(
                        *(self.handles[i].inject_barrier.remote(barrier) for i in self.plan.sources)
                    )
                    marks.setdefault("injected", time.time())
                    await prepared  # off the barrier's path: the instances wait for it if need be
                    marks.setdefault("tasks_acknowledged", time.time())
                    if not any(taken):
                        # every source had ended its output: no instance will see this barrier,
                        # so nothing of this step moves; instances started for it get
                        # EndOfStream from their (ended) upstream and finish empty
                        if not switched:
                            raise RescaleError(self._not_started(step, parallelism))
                        msg = self._ended_mid_rescale(step, parallelism, k, len(plan.steps))
                        raise RescaleError(msg)
                switched.append(k)
                stats += await self._await_migration(step, parallelism, epoch, peers, width)
            finally:
                if policy.pause_sources:
                    await asyncio.gather(
                        *(_quietly(self.handles[i].resume.remote()) for i in self.plan.sources)
                    )
            current = table
            self.routing[step] = table
        self.parallelism[step] = parallelism
        retired_followers = self._follow_rescale(step, parallelism, old.parallelism)
        for i in range(parallelism, old.parallelism):
            iid = self._at(step, i)
            self.retired.add(iid)
            self.actor_names.pop(iid, None)  # status lists the actors of live instances
            if iid in self.outcomes and iid in self._run_handles:
                # it ended (handed everything over) before it was marked retired, so the watch
                # did not stop it: stop it now, its name is free for the next scale-out
                self._stop_retired(iid)
        await self._settle_retired_followers(retired_followers)
        if parallelism <= old.parallelism:  # (after a scale-out: once it caught up, below)
            self._refill_after_scale_in(step)
        t1 = time.time()
        waits = [w for st in stats for w in st.get("fetch_wait_ms", [])]
        # per old owner and migration step: the wait of its first on-demand request, from the
        # seal (or the request, if later) until its chunk went out; the worst of those is "first"
        serve_waits = [st.get("serve_wait_ms", []) for st in stats]
        firsts = [w[0] for w in serve_waits if w]
        every = [x for w in serve_waits for x in w]

        def since_start(key: str, pick: Any) -> float | None:
            times = [st[key] for st in stats if st.get(key) is not None]
            return float(pick(times) - t0) if times else None

        record = {
            "step": step,
            "from": old.parallelism,
            "to": parallelism,
            "strategy": plan.strategy,
            "steps": len(plan.steps),
            "start_s": t0 - self.origin_ns / 1e9,
            "end_s": t1 - self.origin_ns / 1e9,
            "duration_s": t1 - t0,
            "moved_key_groups": len(moved),
            "moved_bytes": int(sum(st.get("bytes_in", 0) for st in stats)),
            "moved_rows": int(sum(st.get("rows_in", 0) for st in stats)),
            "on_demand_fetches": int(sum(st.get("on_demand_fetches", 0) for st in stats)),
            "fetch_wait_ms": {
                "p50": float(np.percentile(waits, 50)) if waits else 0.0,
                "p99": float(np.percentile(waits, 99)) if waits else 0.0,
                "count": len(waits),
            },
            "on_demand_serve_wait_ms": {
                "first": float(max(firsts)) if firsts else None,
                "p99": float(np.percentile(every, 99)) if every else None,
                "max": float(max(every)) if every else None,
                "count": len(every),
            },
            # from the request (the decision) to: the first instance switching its routing, the
            # last old owner sealing, the first on-demand chunk served; the backlog then
            # the phases before the move, each's seconds: load and backlog (the autoscaler's
            # reading, or asked of the old owners), the plan, new instances started and wired,
            # migration tasks sent, the barrier injected, then (off the barrier's path) the
            # tasks acknowledged
            "prepare_phases_s": {
                phase: round(at - before, 4)
                for (phase, at), before in zip(
                    marks.items(), [t0, *list(marks.values())[:-1]], strict=True
                )
            },
            # the move, in seconds from the request: per instance (index order of the last
            # migration step) its switch, seal, first on-demand chunk out, last incoming
            # sub-group in and end of its part; then the whole rescale's end
            # the spawn's parts, seconds each (cold_started: instances no warm standby was for)
            "spawn_phases_s": _phases(t_spawn, spawn_marks),
            "move_phases_s": _move_timeline(
                t0, marks.get("injected", marks.get("tasks_acknowledged")), stats[-width:], t1
            ),
            "switch_s": since_start("activated_wall", min),
            "sealed_s": since_start("sealed_wall", max),
            "first_on_demand_served_s": since_start("first_urgent_served_wall", min),
            "backlog_at_start": backlog,
            # the longest an old owner took at its seal to send its fences downstream (it hands
            # out state without waiting for them to be read: receivers hold new owners' output)
            "fence_ms": max(
                (float(st["fence_ms"]) for st in stats if st.get("fence_ms") is not None),
                default=None,
            ),
            # resident memory per instance from its switch to the end of its move: the most any
            # instance grew (peak minus its reading at the switch), and the highest peak
            "max_rss_growth_mb": _max_mb(
                st["rss_peak_bytes"] - st["rss_start_bytes"]
                for st in stats
                if st.get("rss_peak_bytes") is not None and st.get("rss_start_bytes") is not None
            ),
            "max_rss_peak_mb": _max_mb(
                st["rss_peak_bytes"] for st in stats if st.get("rss_peak_bytes") is not None
            ),
            "handover_rows": int(sum(st.get("handover_rows_out", 0) for st in stats)),
            "chunks": int(sum(st.get("chunks_out", 0) for st in stats)),
            "max_chunk_bytes": int(max((st.get("max_chunk_bytes", 0) for st in stats), default=0)),
            "max_inflight_chunks": int(
                max((st.get("max_inflight_chunks", 0) for st in stats), default=0)
            ),
            "transfer": transfer_summary(stats, width),
        }
        self.rescales.append(record)
        if parallelism > old.parallelism:  # new processes only once the backlog is worked off
            asyncio.get_running_loop().create_task(self._fill_standby_after_catch_up(record))
        self._export("rescale", record["duration_s"])
        self._record_reconfiguration(
            "rescale",
            step,
            t0,
            t1,
            epochs=epochs,
            moved={
                "key_groups": record["moved_key_groups"],
                "bytes": record["moved_bytes"],
                "rows": record["moved_rows"],
            },
            change=f"parallelism {old.parallelism} -> {parallelism} ({plan.strategy})",
        )
        return record

    async def _backlog(self, step: str, live: list[int]) -> dict[str, Any]:
        """Work waiting for ``step`` now: records queued in its instances' inboxes, records its
        sources are behind their schedule, and both in seconds of the step's work (records x
        measured cost per record / instances)."""
        snaps = await asyncio.gather(
            *(self.handles[self._at(step, i)].metrics.remote() for i in live),
            *(self.handles[s].metrics.remote() for s in self.plan.sources),
            return_exceptions=True,  # a figure for the report: never fails the rescale
        )
        snaps = [m if isinstance(m, dict) else {} for m in snaps]
        return _backlog_of(snaps[: len(live)], snaps[len(live) :])

    def note_reading(self, snaps: list[Any], loads: dict[ChannelId, np.ndarray]) -> None:
        """The autoscaler's latest reading: every live instance's metrics and each keyed
        instance's load per sub-group. A rescale it decides on right after plans from it instead
        of asking instances that are busy with a backlog again."""
        by_id = {(m.get("step"), m.get("index")): m for m in snaps if isinstance(m, dict)}
        epochs = {n: t.epoch for n, t in self.routing.items()}
        self._reading = (time.monotonic(), by_id, dict(loads), epochs)

    def _fresh_reading(
        self, step: str, live: list[int]
    ) -> tuple[list[np.ndarray], dict[str, Any]] | None:
        """(loads, backlog) of ``step``'s instances ``live`` from the autoscaler's reading if it
        is at most READING_MAX_AGE_S old, was taken at the step's current routing epoch and has
        every one of them and every live source; else None (then they are asked)."""
        reading = getattr(self, "_reading", None)
        if reading is None:
            return None
        at, by_id, loads, epochs = reading
        if time.monotonic() - at > READING_MAX_AGE_S:
            return None
        if epochs.get(step) != self.routing[step].epoch:
            return None
        ids = [self._at(step, i) for i in live]
        sources = [i for i in self.plan.sources if i not in self.outcomes]
        if any(i not in loads or i not in by_id for i in ids) or any(
            i not in by_id for i in sources
        ):
            return None
        mine = [by_id[i] for i in ids]
        return [loads[i] for i in ids], _backlog_of(mine, [by_id[i] for i in sources])

    async def _await_migration(
        self,
        step: str,
        parallelism: int,
        epoch: int,
        peers: dict[int, Any],
        width: int,
        ids: list[ChannelId] | None = None,
    ) -> list[dict[str, Any]]:
        """Every instance's statistics of migration step ``epoch`` once its part is done: from
        the report each instance sends the moment it is done (``on_migration_done``), or from
        its ``migration_done`` call, whichever comes first (a busy instance answers a call
        between two slices of its records). ``ids``: the instances of ``peers`` (default: the
        step's instances at those routing indexes). If that takes longer than
        ``rescale_timeout_s``, the job fails and a RescaleError says which instances did not
        finish and what they were waiting for."""
        ids = ids or [self._at(step, i) for i in range(width)]
        reports = self._migration_reports.setdefault(epoch, {})
        calls = [
            asyncio.ensure_future(_result_of(peers[i].migration_done.remote(epoch)))
            for i in range(width)
        ]
        timeout_s = float(self.config.rescale_timeout_s)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                for c in calls:
                    error = c.exception() if c.done() and not c.cancelled() else None
                    if error is not None:
                        raise error  # an instance's migration failed: the job fails with it
                pending = [
                    c for i, c in enumerate(calls) if not c.done() and ids[i] not in reports
                ]
                if not pending or time.monotonic() > deadline:
                    break
                await asyncio.wait(pending, timeout=0.002)
        finally:
            self._migration_reports.pop(epoch, None)
        if not pending:
            out = [reports.get(ids[i]) or calls[i].result() for i in range(width)]
            for c in calls:
                c.cancel()  # answered by a report: its call is not waited for
            return out
        for c in calls:
            c.cancel()
        stuck = [i for i, c in enumerate(calls) if c in pending]
        snaps = await asyncio.gather(
            *(asyncio.wait_for(_result_of(peers[i].metrics.remote()), 10) for i in stuck),
            return_exceptions=True,
        )
        waits = "; ".join(
            f"{(step, i)} {_waiting_for(snap, epoch)}" for i, snap in zip(stuck, snaps, strict=True)
        )
        what = (
            f"the rescale of {step!r} to {parallelism} (migration step epoch {epoch}) did not "
            f"finish within rescale_timeout_s={timeout_s:g} s; {len(stuck)} of {width} instances "
            f"had not finished their part: {waits}."
        )
        if self.config.checkpoint_interval_s > 0:  # a failure like any other: recover
            for i in stuck:
                self._hung[(step, i)] = f"RescaleError: {what}"
                ray.kill(peers[i], no_restart=True)
            msg = f"{what} Those instances were stopped; the job recovers from its latest checkpoint"
            raise RescaleError(msg)
        msg = (
            f"{what} The job {self.flow.name!r} is failed and stopped; restart it (a larger "
            "rescale_timeout_s if that much state has to move)"
        )
        self.error = {"instance": (step, stuck[0]), "error": f"RescaleError: {msg}"}
        self.state = "failed"
        await self._stop_all()
        raise RescaleError(msg)

    async def _rescales_settled(self, timeout_s: float) -> None:
        """The job ended: give rescales still in flight or queued a moment to answer (with a
        RescaleError) before the caller of :meth:`wait` ends this controller."""
        deadline = time.monotonic() + timeout_s
        while (self._rescale_lock.locked() or self._queued) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def _fill_standby(self, delay_s: float = 0.0, *, in_waves: bool = False) -> None:
        """Keep ``standby_instances`` warm actors (started, imports done) for scale-outs of keyed
        steps without actor options. Ray names an actor only when it is created, so each is
        created under the name of the instance it would become (``standby_slots``); a slot
        whose name is still held (a retiring instance) is left for a later fill. The first fill
        waits ``delay_s``: its processes would compete with the job's own start-up, and a job
        that ends sooner (or rescales before: it starts what it needs) needs none."""
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        if self._standby_filling:
            self._standby_refill = True  # the running fill goes round once more
            return
        self._standby_filling = True
        try:
            self._standby_refill = True
            while self._standby_refill and self.state == "running":
                self._standby_refill = False
                await self._fill_standby_once(in_waves=in_waves)
        finally:
            self._standby_filling = False

    async def _fill_standby_after_catch_up(self, record: dict[str, Any]) -> None:
        """Refill the warm standbys a scale-out used once its step caught up with its backlog
        (``raystream.standby_pacing``): their start-up would take the CPU the catch-up needs.
        A step that does not keep up gets them 1 s after the scale-out (the next one needs them);
        they start in waves (the first alone, the rest side by side), and the wait ends in time
        for them to be up when the autoscaler could next scale the step out. With a policy that
        does not plan its next scale-out (ds2) the wait lasts until the load the scale-out came
        for is gone (``standby_pacing.unloaded_busy``), at most ``MAX_DEFER_S``.
        ``standby_refills`` (in the job's result) gets one entry per scale-out: its step and
        ``start_s``, the seconds waited after its end, and why the wait ended (the rescale
        record itself is not changed after the rescale returned it)."""
        from raystream.standby_pacing import (
            MAX_BUSY,
            MAX_DEFER_S,
            refill_deadline_s,
            start_estimate_s,
            unloaded_busy,
            wait_caught_up,
        )

        step = record["step"]
        epoch = self.routing[step].epoch
        # done by the time the policy could ask for the next scale-out, even if not caught up
        missing = max(0, self._standby_count() - len(self._standby))
        cpus = self._cluster_cpus()
        start_s = start_estimate_s(self._standby_starts, cpus)
        # ... if the policy plans its next scale-out (threshold doubles): a policy that sizes
        # from rates (ds2) does not scale out again because the step is catching up, and
        # processes starting during the catch-up make it longer
        plans_next = self.autoscaler is not None and self.autoscaler.next_scale_out_instances() > 0
        next_s = self.autoscaler.next_rescale_after_s() if plans_next else None
        max_wait_s = refill_deadline_s(next_s, missing, start_s, cpus)
        max_busy: Any = MAX_BUSY
        deferred = self.autoscaler is not None and not plans_next
        if deferred:
            # ... and such a policy's step does not scale out again while it keeps up: the
            # refill waits until the load the scale-out came for is gone (the step would be
            # carried by the instances it had), or MAX_DEFER_S; a scale-in meanwhile (after a
            # catch-up) keeps it waiting, at the limit for the instances the step has then
            def max_busy(reading: dict[str, Any]) -> float:
                return unloaded_busy(record["from"], int(reading.get("instances") or record["to"]))

            max_wait_s = MAX_DEFER_S

        async def read() -> dict[str, Any] | None:
            table = self.routing.get(step)
            if self.state != "running" or table is None:
                return None  # ended
            if table.epoch != epoch and (not deferred or self.parallelism[step] > record["to"]):
                return None  # rescaled again (that rescale asks for its own fill)
            try:
                return await self._backlog(step, list(range(self.parallelism[step])))
            except Exception:  # noqa: BLE001 - (an instance replaced meanwhile) not known:
                return {}  # such readings never count as caught up; the fill comes at max_wait_s

        if deferred:
            self._refill_waiting[step] += 1
        try:
            waited = await wait_caught_up(read, max_wait_s=max_wait_s, max_busy=max_busy)
        finally:
            if deferred:
                self._refill_waiting[step] -= 1
        if waited["last"] is None:
            return  # the job ended, or the step was rescaled again: that rescale asks for a fill
        self.standby_refills.append(
            {
                "step": step,
                "rescale_start_s": record["start_s"],
                "after_s": round(waited["waited_s"], 3),
                "caught_up": waited["caught_up"],
                "not_draining": waited["not_draining"],  # the new capacity did not keep up
                "deadline": waited["max_wait"],  # ... or the next scale-out could come soon
                "max_wait_s": round(max_wait_s, 3),
                # busy at most this on the readings (with the step's width at the last one)
                "max_busy": round(
                    max_busy(waited["last"]) if callable(max_busy) else max_busy, 4
                ),
                "scaled_in_meanwhile": self.parallelism[step] < record["to"],
                "start_estimate_s": round(start_s, 3),
                "waves": [],  # (processes, seconds until all were up) per wave
            }
        )
        if self.state == "running" and not self._rescale_lock.locked():
            # (a rescale that runs now asks for a fill when it ends)
            await self._fill_standby(in_waves=True)

    def _refill_after_scale_in(self, step: str) -> None:
        """Refill the warm standbys after a scale-in of ``step`` (or a retired instance of it
        stopped): now, unless the refill after an earlier scale-out of it waits until the load
        that scale-out came for is gone (ds2, e.g. 1->4 with catch-up, then 4->3 in the high
        phase): then that refill does it, and no process starts beside the loaded step."""
        if self._refill_waiting[step] > 0:
            return
        asyncio.get_running_loop().create_task(self._fill_standby())

    def _cluster_cpus(self) -> float:
        """CPUs of the Ray cluster (standby processes starting side by side share them)."""
        if self._cpus is None:
            try:
                self._cpus = float(ray.cluster_resources().get("CPU", 1.0)) or 1.0
            except Exception:  # noqa: BLE001 - not known: as if one core
                self._cpus = 1.0
        return self._cpus

    def _standby_count(self) -> int:
        """Warm standbys to keep: ``standby_instances``, or as many as the autoscaler's policy
        would add in its next scale-out if that is more (so it starts no process either)."""
        count = self.config.standby_instances
        if self.autoscaler is not None and count > 0:
            count = max(count, self.autoscaler.next_scale_out_instances())
        return count

    async def _fill_standby_once(self, *, in_waves: bool = False) -> None:
        """Start the missing warm standbys: side by side (the next scale-out waits for the
        slowest, not their sum), or ``in_waves`` (``standby_pacing.refill_waves``: the first
        alone, then the rest side by side: after a scale-out the job runs on, and process
        start-ups take the cores of a small machine). Each wave's time goes into the estimate
        of a process's start-up (and into the last ``standby_refills`` entry)."""
        from raystream.placement import standby_slots
        from raystream.standby_pacing import refill_waves
        from raystream.runtime.actors import NAMESPACE, InstanceActor, instance_actor_name

        steps = {
            n: self.parallelism[n]
            for n, st in self.plan.steps.items()
            if st.is_keyed and st.actor.is_default
        }
        # names held by instances: live or retiring ones (a retired one that ended was
        # stopped: its name is free, or soon)
        held = {i for i in self.handles if not (i in self.retired and i in self.outcomes)}
        count = self._standby_count()
        wanted = standby_slots(steps, held, count)
        pooled = {slot for *_, slot in self._standby}
        started: list[tuple[ChannelId, Any]] = []
        missing = [slot for slot in wanted if slot not in pooled]
        waves = refill_waves(len(missing)) if in_waves else [len(missing)]
        wave_started = time.monotonic()

        async def pool(slot: ChannelId, h: Any) -> None:
            try:
                node = await h.ping.remote()
                if not self._may_fill_standbys():  # the job ended meanwhile: do not leak it
                    ray.kill(h, no_restart=True)
                    return
                self._standby.append((h, node, slot))
            finally:
                self._standby_creating.discard(slot)

        for slot in wanted:
            if not self._may_fill_standbys():
                break
            if slot in pooled:
                continue
            if slot in self.handles:  # a retired instance's name: wait until it is free
                try:
                    await self._name_free(slot, timeout_s=5.0)
                except RescaleError:
                    continue
            if slot in self._spawning or (slot in self.handles and slot not in self.retired):
                continue  # a scale-out took this index meanwhile
            try:
                h = InstanceActor.options(
                    name=instance_actor_name(self.flow.name, *slot),
                    namespace=NAMESPACE,
                    max_concurrency=10_000,
                    scheduling_strategy="SPREAD",
                ).remote(None, self._self)  # the controller's handle now, not at the scale-out
            except ValueError:  # the name is still held: a later fill takes the slot
                continue
            self._standby_creating.add(slot)
            started.append((slot, h))
            if waves and len(started) >= waves[0]:
                await self._standby_wave(started, wave_started, in_waves, pool)
                waves.pop(0)
                started, wave_started = [], time.monotonic()

        # the processes of a wave start side by side: a scale-out right after this fill waits
        # for the slowest of them, not for their sum
        if started:
            await self._standby_wave(started, wave_started, in_waves, pool)
        # standbys named for indexes beyond the next ones (a scale-in came) make room
        extra = len(self._standby) - count
        for entry in [e for e in self._standby if e[2] not in wanted][: max(0, extra)]:
            self._standby.remove(entry)
            ray.kill(entry[0], no_restart=True)

    async def _standby_wave(
        self,
        started: list[tuple[ChannelId, Any]],
        t0: float,
        in_waves: bool,
        pool: Callable[[ChannelId, Any], Awaitable[None]],
    ) -> None:
        """Wait until the standby processes ``started`` side by side (since ``t0``) are up;
        learn how long that took."""
        await asyncio.gather(*(pool(slot, h) for slot, h in started))
        took = time.monotonic() - t0
        self._standby_starts = [*self._standby_starts, (len(started), took)][-STANDBY_STARTS_KEPT:]
        if in_waves and self.standby_refills:
            self.standby_refills[-1].setdefault("waves", []).append([len(started), round(took, 3)])

    async def _take_standby(self, iid: ChannelId, node: str | None) -> Any:
        """The warm standby actor named for instance ``iid`` if it runs on ``node`` (any node if
        None), or None: then a new actor is started on the chosen node under that name (a
        standby there on another node is stopped first, to free the name)."""
        deadline = time.monotonic() + 15
        while iid in self._standby_creating and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # it is starting: cheaper than starting another process
        while iid in self._preparing and time.monotonic() < deadline:
            await asyncio.sleep(0.002)  # it is being configured for this slot: a few ms
        for k, (handle, where, slot) in enumerate(self._standby):
            if slot != iid:
                continue
            del self._standby[k]
            if node is None or where == node:
                return handle
            ray.kill(handle, no_restart=True)
            await self._name_free(iid)
        return None

    async def _name_free(self, iid: ChannelId, timeout_s: float = 15.0) -> None:
        """Wait until no actor holds the name of instance ``iid`` (one was killed)."""
        from raystream.runtime.actors import NAMESPACE, instance_actor_name

        name = instance_actor_name(self.flow.name, *iid)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                await asyncio.to_thread(ray.get_actor, name, namespace=NAMESPACE)
            except ValueError:
                return
            await asyncio.sleep(0.02)
        msg = f"actor {name} still holds its name {timeout_s} s after it was stopped"
        raise RescaleError(msg)

    def _sources_done(self) -> bool:
        return all(i in self.outcomes for i in self.plan.sources)

    async def _spawn(
        self, step: str, indexes: range, marks: dict[str, float] | None = None
    ) -> None:
        """Start new instances of ``step`` (empty state, named like deployed ones) and wire them
        to both neighbours. ``marks`` gets the wall-clock end of each part: nodes chosen,
        actors taken (warm standbys) or started, configured, answered a ping, wired."""
        marks = {} if marks is None else marks
        from raystream.runtime.actors import (
            NAMESPACE,
            InstanceActor,
            MemberHandle,
            instance_actor_name,
        )

        live = {
            iid: node
            for iid, node in self.nodes.items()
            if iid in self.handles and iid not in self.outcomes and iid not in self.retired
        }
        options = self.plan.steps[step].actor
        picks = choose_nodes(
            step,
            options,
            await asyncio.to_thread(cluster_nodes),
            len(indexes),
            step_placed=Counter(node for iid, node in live.items() if iid[0] == step),
            job_placed=Counter(live.values()),
        )
        marks["nodes"] = time.time()
        reused: set[ChannelId] = set()
        # an index retired by an earlier scale-in comes back: let the old go (and its sink)
        for iid in [j for i in indexes for j in self._chain_ids((step, i))]:
            if iid in self.retired:
                deadline = time.monotonic() + 60
                while iid not in self.outcomes:
                    if time.monotonic() > deadline:
                        msg = f"instance {iid} retired earlier has not finished handing over"
                        raise RescaleError(msg)
                    await asyncio.sleep(0.01)
                self._retire_outcome(iid)
                self.retired.discard(iid)
                reused.add(iid)
                self._run_futures.pop(iid, None)
        member_specs: dict[ChannelId, Any] = {}  # the steps chained after the new instances
        tails: list[ChannelId] = []  # each new chain's last instance (sends to the next steps)
        new: dict[ChannelId, Any] = {}
        configuring = []  # warm standbys becoming instances, side by side (each opens RocksDB)
        ready: dict[ChannelId, str | None] = {}  # instances of prepared standbys: their node
        upstream: list[ChannelId] = []
        for i, node in zip(indexes, picks, strict=True):
            self._spawning.add((step, i))  # no standby fill takes this name meanwhile
            self.actor_names.pop((step, i), None)  # a scale-out's instance has the usual name
            try:
                handle = await self._take_standby((step, i), node) if options.is_default else None
                prep = self._prepared.pop((step, i), None)
                if handle is not None and prep is not None:
                    # configured and connected ahead: used if it is what would be sent now
                    ahead, receivers = self._slot_actor_spec(
                        step, i, indexes.stop, prep.state_path, handle
                    )
                    if mismatch(prep, handle, ahead, receivers) is not None:
                        prep = None
                elif prep is not None:
                    prep = None
                path = (
                    prep.state_path
                    if prep is not None
                    else str(Path(self.plan_dir) / step / f"{i}-e{self._epoch + 1}")
                )
                spec = self._slot_spec(step, i, path)
                upstream = list(spec.inputs)
                self.specs[(step, i)] = spec
                actor_spec, members = self._chained_spawn(step, spec, indexes.stop)
                if handle is not None and prep is not None:
                    for iid in (spec.id, *(m.id for m in members)):
                        ready[iid] = prep.node
                elif handle is not None:
                    configuring.append(handle.configure.remote(actor_spec))
                else:
                    if (step, i) in reused:  # the retired instance of this index was stopped
                        await self._name_free((step, i))
                    handle = InstanceActor.options(
                        name=instance_actor_name(self.flow.name, step, i),
                        namespace=NAMESPACE,
                        max_concurrency=10_000,
                        **options.ray_options(node),
                    ).remote(actor_spec)
                self.handles[(step, i)] = handle
            finally:
                self._spawning.discard((step, i))
            new[(step, i)] = handle
            for m in members:
                member_specs[m.id] = MemberHandle(handle, m.id)
            tails.append(members[-1].id if members else (step, i))
        marks["taken"] = time.time()
        prepared = len({iid for iid in ready if iid in new})
        marks["cold_started"] = float(len(indexes) - len(configuring) - prepared)
        marks["prepared_standbys"] = float(prepared)
        await asyncio.gather(*configuring)
        marks["configured"] = time.time()
        self.handles.update(member_specs)
        keyed_new = dict(new)
        new.update(member_specs)
        asked = [iid for iid in new if iid not in ready]
        where = await asyncio.gather(*(new[iid].ping.remote() for iid in asked))
        marks["pinged"] = time.time()
        self.nodes.update(zip(asked, where, strict=True))
        self.nodes.update({iid: n for iid, n in ready.items() if n is not None})
        # the next steps take each new chain's tail as a new input (a chained follower's input
        # is the instance before it in its actor, in its spec: nothing to add there)
        downstream = {r for t in tails for o in self.specs[t].outputs for r in o.receiver_ids}
        try:
            await asyncio.gather(
                *(
                    self.handles[i].connect.remote(self._receivers_of(i), self._self)
                    for i in new
                    if i not in ready
                )
            )
            marks["connected"] = time.time()
            # a downstream instance reopens an input whose id a retired instance had once it
            # read that one's EndOfStream (add_inputs waits for it)
            await asyncio.gather(*(self.handles[d].add_inputs.remote(tails) for d in downstream))
            marks["inputs_added"] = time.time()
            await asyncio.gather(
                *(self.handles[u].add_receivers.remote(keyed_new) for u in upstream)
            )
        except Exception as e:
            await asyncio.sleep(0.5)  # let the watcher record an end or a failure first
            if self.state != "running" or self._sources_done() or self.error is not None:
                raise  # the job ended or failed meanwhile: the rescale's caller says which
            # the job runs on, but some neighbours may expect the new instances already: the
            # dataflow is no longer whole, so the job fails (a half wiring must not hang it)
            msg = (
                f"the scale-out of {step!r} could not wire its new instances {sorted(new)} to "
                f"their neighbours: {type(e).__name__}: {e}. The job {self.flow.name!r} is "
                "failed and stopped; restart it (from its latest checkpoint if it has one)"
            )
            self.error = {"instance": next(iter(new)), "error": f"RescaleError: {msg}"}
            self.state = "failed"
            await self._stop_all()
            raise RescaleError(msg) from e
        marks["wired"] = time.time()
        for iid in new:
            self._run(iid)

    def _slot_spec(self, step: str, i: int, state_path: str) -> Any:
        """The spec a scale-out gives new instance ``i`` of keyed step ``step`` now: the
        step's processor, inputs from every live upstream instance, outputs to the next steps as
        they run, empty state in ``state_path``."""
        template = self.specs[(step, 0)]
        upstream = [
            iid
            for iid in self.specs
            # an upstream instance that ended (or ends before the barrier reaches it) sends
            # EndOfStream to the new instances when they are added (add_receivers)
            if iid[0] in template.step.upstream and iid not in self.retired
        ]
        return replace(
            template,
            index=i,
            inputs=tuple(upstream),
            outputs=tuple(self._current_output(o) for o in template.outputs),
            owned_key_groups=(),
            state_path=state_path,
            restore=None,
        )

    def _slot_actor_spec(
        self, step: str, i: int, parallelism: int, state_path: str, handle: Any
    ) -> tuple[Any, dict[ChannelId, dict[ChannelId, Any]]]:
        """What the actor ``handle`` of new instance ``i`` would be configured with now (the
        step at ``parallelism``), and each of its instances' receivers; nothing registered."""
        from raystream.runtime.actors import MemberHandle

        spec = self._slot_spec(step, i, state_path)
        actor_spec, members = self._chained_spawn(step, spec, parallelism, register=False)
        specs = [spec, *members]
        here = {s.id for s in specs}
        if members:
            specs[0] = actor_spec.specs[0]  # the head sends to the next member, in the actor
        receivers = {
            s.id: {
                r: MemberHandle(handle, r) if r in here else self.handles[r]
                for out in s.outputs
                for r in out.receiver_ids
            }
            for s in specs
        }
        return actor_spec, receivers

    async def _keep_standbys_prepared(self, every_s: float = 0.25) -> None:
        """While the job runs: configure and connect each warm standby for the slot it holds
        (``raystream.standby_prep``), again when the plan changed under its preparation. Not
        while a rescale or another change runs (it reads the plan as it changes)."""
        while self.state in ("running", "recovering", "starting"):
            await asyncio.sleep(every_s)
            if self.state != "running" or self._rescale_lock.locked() or self._queued:
                continue
            try:
                await self._prepare_standbys()
            except Exception:  # noqa: BLE001 - a standby that is not prepared is configured
                pass  # by the scale-out (as without preparations)

    async def _prepare_standbys(self) -> None:
        from raystream.runtime.actors import MemberHandle

        pooled = [slot for *_, slot in self._standby]
        for stale in [s for s in self._prepared if s not in pooled]:
            self._prepared.pop(stale)  # its standby was taken or stopped
        for handle, node, slot in list(self._standby):
            step, i = slot
            if (
                self.state != "running"
                or self._rescale_lock.locked()
                or self._queued
                or step not in self.routing
                or slot in self._spawning
                or slot in self._preparing
                or i < self.parallelism.get(step, 0)
            ):
                continue
            target = prepared_parallelism(pooled, step, self.parallelism[step])
            planned = self.autoscaler.next_parallelism(step) if self.autoscaler else None
            if planned is not None and self.parallelism[step] <= i < planned:
                target = planned  # the policy's next scale-out (threshold doubles) takes it
            prep = self._prepared.get(slot)
            if prep is not None:
                ahead, receivers = self._slot_actor_spec(
                    step, i, target, prep.state_path, handle
                )
                if mismatch(prep, handle, ahead, receivers) is None:
                    continue  # still what a scale-out would send
            self._preparations += 1
            path = str(
                Path(self.plan_dir) / step / f"{i}-standby-{self.origin_ns}-{self._preparations}"
            )
            actor_spec, receivers = self._slot_actor_spec(step, i, target, path, handle)
            self._prepared.pop(slot, None)
            self._preparing.add(slot)
            try:
                await handle.configure.remote(actor_spec)
                await asyncio.gather(
                    *(
                        (handle if iid == slot else MemberHandle(handle, iid)).connect.remote(
                            recv, self._self
                        )
                        for iid, recv in receivers.items()
                    )
                )
                if any(h is handle for h, *_ in self._standby):  # (not stopped meanwhile)
                    self._prepared[slot] = Preparation(
                        slot=slot,
                        handle=handle,
                        node=node,
                        actor_spec=actor_spec,
                        receivers=receivers,
                        state_path=path,
                        parallelism=target,
                        ids=tuple(receivers),
                    )
            finally:
                self._preparing.discard(slot)

    async def _stop_and_restore(
        self, step: str, barrier: Barrier, table: RoutingTable, width: int, peers: dict[int, Any]
    ) -> None:
        """Stop-and-restart: (sources paused) drain behind the barrier, snapshot every instance,
        restore each new owner's key groups into a fresh RocksDB from all snapshots."""
        await self.inject(barrier, timeout_s=600)
        directory = str(Path(self.state_dir) / "_restart" / f"e{barrier.epoch}")
        snaps = await asyncio.gather(
            *(peers[i].snapshot_state.remote(directory) for i in range(width))
        )
        held = [(i, sn["path"], set(sn["key_groups"])) for i, sn in enumerate(snaps)]

        def sources(mine: list[int]) -> list[tuple[int, str, list[int]]]:
            return [(i, path, sorted(kgs & set(mine))) for i, path, kgs in held if kgs & set(mine)]

        calls = []
        for i in range(width):
            mine = table.key_groups_of(i).tolist() if i < table.parallelism else []
            state_path = str(Path(self.state_dir) / step / f"{i}-restored-e{barrier.epoch}")
            calls.append(peers[i].restore_state.remote(barrier.epoch, sources(mine), mine, state_path))
        await asyncio.gather(*calls)
        shutil.rmtree(directory, ignore_errors=True)

    # ---- observation ----------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {
            "job": self.flow.name,
            "state": self.state,
            "parallelism": dict(self.parallelism),
            "routing_epochs": {n: t.epoch for n, t in self.routing.items()},
            "rescaling": self._rescale_lock.locked(),
            "queued_rescales": self._queued,
            "graph_version": self.graph_version,
            "graph": self.graph(),
            # instances whose actor is not named raystream:<job>:<step>:<index> (inserted, moved)
            "actor_names": {f"{s}/{i}": n for (s, i), n in self.actor_names.items()},
            "change_spares": [n for _, n, _ in self._spares],
            "standbys": [f"{s}/{i}" for _, _, (s, i) in self._standby],  # warm, by slot
            # warm standbys configured and connected for their slot (raystream.standby_prep)
            "prepared_standbys": [f"{s}/{i}" for s, i in sorted(self._prepared)],
            # warm actors found dead or on a lost node while the job ran (then refilled)
            "warm_actors_dropped": self.warm_actors_dropped.kept(),  # the newest RECORDS_KEPT
            "warm_actors_dropped_total": len(self.warm_actors_dropped),
            "autoscaler": self.autoscaler.summary() if self.autoscaler else None,
            "checkpoints": self.checkpoint_summary(),
            "recoveries": self.recoveries.kept(),  # the newest RECORDS_KEPT
            "recoveries_total": len(self.recoveries),
            "rescales_total": len(self.rescales),
            "standby_refills_total": len(self.standby_refills),
            "deploys": list(self.deploys[:1] + self.deploys[1:][-5:]),
        }

    async def metrics(self) -> dict[str, Any]:
        """Live metrics of every running instance, plus the job's latency summary so far."""
        live = {
            iid: h
            for iid, h in self.handles.items()
            if iid not in self.outcomes and self._askable(iid)
        }
        asked = list(
            await asyncio.gather(
                *(
                    asyncio.wait_for(_result_of(h.metrics.remote()), METRICS_ANSWER_S)
                    for h in live.values()
                ),
                return_exceptions=True,
            )
        )
        unanswered = [
            f"{s}/{i}" for (s, i), a in zip(live, asked, strict=True) if not isinstance(a, dict)
        ]
        snaps = [s for s in asked if isinstance(s, dict)]
        snaps += [o.get("metrics", {}) for o in self.outcomes.values()]
        snaps = [{**s, "attempt": self._attempt} for s in snaps]
        lat = [s["latency"] for s in snaps if s.get("latency")]
        merged = LatencyRecorder.merge_snapshots(lat) if lat else None
        summary = merged.summary() if merged is not None else None
        return {
            "job": self.flow.name,
            "state": self.state,
            "instances": snaps,
            # live instances that did not answer within METRICS_ANSWER_S (or died meanwhile)
            "unanswered": unanswered,
            "latency": summary,
            "recoveries": self.recoveries.kept(),  # the newest RECORDS_KEPT
            "recoveries_total": len(self.recoveries),
            "checkpoints": self.checkpoint_summary(),
            # the last RECONFIGURATIONS_SHOWN changes (a job rescaled every minute for days
            # would otherwise send thousands with every status call) and how many there were
            "reconfigurations": self.reconfiguration_records(
                merged, complete=not unanswered, last=RECONFIGURATIONS_SHOWN
            ),
            "reconfigurations_total": len(self.reconfigurations),
            # every attempt's totals per step (failed ones kept at their recovery) and their sum
            **self.attempts_summary(snaps),
        }

    async def status(self) -> dict[str, Any]:
        return {**self.describe(), **(await self.metrics())}

    def _retire_outcome(self, iid: ChannelId) -> None:
        """Instance ``iid`` of this attempt ended for good (its index comes back as a new
        instance): its metrics go into the per-step totals of the retired, and into the newest
        RECORDS_KEPT listed in the result."""
        metrics = self.outcomes.pop(iid).get("metrics", {})
        self._retired_totals = step_totals([metrics], self._retired_totals)
        self._history.append(metrics)


async def _quietly(ref: Any) -> None:
    try:
        await ref
    except Exception:  # noqa: BLE001, S110 - the actor may already be gone
        pass


async def _result_of(ref: Any) -> Any:
    return await ref


def _max_mb(values: Any) -> float | None:
    """The largest of ``values`` (bytes) in MiB, None if there are none."""
    top = max(values, default=None)
    return None if top is None else round(top / 2**20, 1)


def _waiting_for(snap: Any, epoch: int) -> str:
    """What one instance still waits for in migration step ``epoch``, from its metrics."""
    if not isinstance(snap, dict):
        return f"did not answer ({type(snap).__name__}: {snap})"
    mig = snap.get("migration") or {}
    if mig.get("epoch") != epoch:
        return f"has no migration task of epoch {epoch} (it has {mig.get('epoch')})"
    live = int(snap.get("inputs", 0)) - int(snap.get("eos", 0))
    seen = int((snap.get("barriers_open") or {}).get(epoch, 0))
    parts = []
    if not mig.get("active"):
        parts.append(f"has not seen the rescale barrier on any of its {live} live inputs")
    elif not mig.get("sealed"):
        parts.append(f"saw the rescale barrier on {seen} of {live} live inputs (not sealed)")
    parts.append(
        f"{mig.get('arrived', 0)}/{mig.get('incoming', 0)} sub-groups in "
        f"({mig.get('requested', 0)} requested, {mig.get('pending_rows', 0)} records "
        f"({mig.get('pending_bytes', 0)} bytes) waiting)"
    )
    parts.append(f"{mig.get('outgoing_left', 0)} sub-groups still to hand out")
    if mig.get("outgoing_left"):
        parts.append(
            f"{mig.get('chunks_out', 0)} chunks served, {mig.get('serve_calls_queued', 0)} "
            f"serve calls queued, serving loop: {mig.get('server', '?')}"
        )
    if snap.get("finished"):
        parts.append("its input ended")
    return ", ".join(parts)


async def _outcome(ref: Any, iid: ChannelId) -> dict[str, Any]:
    """An instance's run() result; an actor that died becomes an error outcome."""
    try:
        return dict(await ref)
    except Exception as e:  # noqa: BLE001 - the actor process died or was killed
        error = f"{type(e).__name__}: {e}"
        return {"instance": iid, "result": None, "error": error, "metrics": {}, "died": True}


def _backlog_of(mine: list[dict[str, Any]], sources: list[dict[str, Any]]) -> dict[str, Any]:
    """The backlog of a step from its instances' metrics (``mine``) and its sources'."""
    queued = int(sum(m.get("backlog_rows", 0) for m in mine))
    lag = int(sum(m.get("lag_rows", 0) for m in sources))
    costs = [m["row_cost_s"] for m in mine if m.get("row_cost_s")]
    cost = float(np.mean(costs)) if costs else None
    per = max(len(mine), 1)
    return {
        "queued_rows": queued,
        "source_lag_rows": lag,
        "queued_work_s": queued * cost / per if cost is not None else None,
        "total_work_s": (queued + lag) * cost / per if cost is not None else None,
        "row_cost_us": cost * 1e6 if cost is not None else None,
        "busy_s": float(sum(m.get("busy_s", 0) or 0 for m in mine)),
        "instances": len(mine),
    }


def _phases(t0: float, marks: dict[str, float]) -> dict[str, float]:
    """Seconds each part took, from wall-clock ends in order (counts, not times, kept as they
    are: keys ending in ``_started``)."""
    out: dict[str, float] = {}
    before = t0
    for name, at in marks.items():
        if name.endswith("_started") or name == "prepared_standbys":
            out[name] = at
            continue
        out[name] = round(at - before, 4)
        before = at
    return out


def _move_timeline(
    t0: float, injected: float | None, stats: list[dict[str, Any]], end: float
) -> dict[str, Any]:
    """Seconds from ``t0`` to each phase of a move, per instance (see ``move_phases_s``)."""

    def since(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 3)

    keys = ("activated_wall", "sealed_wall", "first_urgent_served_wall", "all_arrived_wall")
    names = ("switched", "sealed", "first_on_demand_served", "all_arrived")
    return {
        "barrier_injected": since(injected),
        **{
            name: [since(st.get(key)) for st in stats]
            for key, name in zip(keys, names, strict=True)
        },
        "finished": [since(st.get("finished_wall")) for st in stats],
        "handover_rows_out": [int(st.get("handover_rows_out", 0)) for st in stats],
        "chunks_out": [int(st.get("chunks_out", 0)) for st in stats],
        "fetch_calls": [int(st.get("fetch_calls", 0)) for st in stats],
        # per instance and serve call: new owner [made, answered, imported, urgent, sub-groups
        # completed, handed-over rows]; old owner [came, answered, urgent] (seconds from t0)
        "fetch_log": [
            [[since(a), since(b), since(c), u, n, h] for a, b, c, u, n, h in st.get("fetch_log", [])]
            for st in stats
        ],
        "serve_log": [
            [[since(a), since(b), u] for a, b, u in st.get("serve_log", [])] for st in stats
        ],
        "done": since(end),
    }


def _migration_tasks(
    current: RoutingTable,
    table: RoutingTable,
    width: int,
    sub_groups: int,
    heat: np.ndarray,
    policy: FetchPolicy,
    epoch: int,
) -> dict[int, dict[str, Any]]:
    """Per instance index: which sub-groups come in (and from whom) and which go out."""
    tasks: dict[int, dict[str, Any]] = {
        i: {"epoch": epoch, "policy": policy, "incoming": {}, "outgoing": [], "heat": {}}
        for i in range(width)
    }
    for kg in current.moved_key_groups(table).tolist():
        src, dst = int(current.owners[kg]), int(table.owners[kg])
        for g in range(kg * sub_groups, (kg + 1) * sub_groups):
            tasks[dst]["incoming"][g] = src
            tasks[dst]["heat"][g] = float(heat[g])
            tasks[src]["outgoing"].append(g)
    return tasks
