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

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from raystream.errors import ReconfigurationError
from raystream.history import BoundedHistory
from raystream.metrics import LatencyRecorder
from raystream.reconfigure import check_replacement
from raystream.runtime.messages import Barrier

__all__ = ["Reconfigurations"]

PEAK_AFTER_S = 2.0  # latency is looked at until this long after a change ended
# how a move carries the instance's state: its RocksDB files whole, or rows sub-group by
# sub-group (on demand and hottest first, as a rescale)
MOVE_TRANSFERS = ("files", "rows")


def _fn_name(fn: Any) -> str:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{module}:{name}" if module else str(name)


class Reconfigurations:
    """Replace a step's function; records of every change; the graph and its version."""

    _turn_queued_s: float | None = None  # how long the change in its turn waited for it

    # ---- the queue of changes ------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _change_turn(self: Any) -> AsyncIterator[float]:
        """Wait for this change's turn: one change at a time (rescales, replacements, inserts,
        removes, moves), in the order asked, never during a checkpoint. Yields how long it
        waited; its record says so (``queued_s``). A change given up while it waits (its call
        cancelled) leaves the queue as it found it."""
        asked = time.monotonic()
        self._queued += 1
        waiting = True
        try:
            async with self._rescale_lock:
                self._queued -= 1
                waiting = False
                self._turn_queued_s = time.monotonic() - asked
                try:
                    yield self._turn_queued_s
                finally:
                    self._turn_queued_s = None
        finally:
            if waiting:
                self._queued -= 1

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
        async with self._change_turn():
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
            # the barrier went out and the job runs: every instance switches as it arrives
            self._adopt_step(step, new_step)
            msg = (
                f"the replace barrier of {step!r} (epoch {epoch}) went out, but not every "
                f"instance acknowledged it in time: {type(e).__name__}: {e}. The instances switch "
                "to the new function as the barrier reaches them"
            )
            raise ReconfigurationError(msg) from e
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
            # where each source emitted the barrier: the records before it went to the old fn
            source_offsets={
                f"{a['instance'][0]}/{a['instance'][1]}": int(a["source_offset"])
                for a in acks
                if "source_offset" in a
            },
        )
        # a recovery restarts with the new function: give it a checkpoint taken after it
        await self._checkpoint_after(record)
        return record

    async def _checkpoint_after(self: Any, record: dict[str, Any]) -> None:
        """With checkpoints on: one right after a change (replace, insert, remove), so a
        recovery replays through the graph and functions as the change left them from that
        point; ``record["checkpoint_after"]`` says which one (or why it failed)."""
        if self.config.checkpoint_interval_s > 0 or self.config.checkpoint_dir:
            try:
                ck = await self._take_checkpoint(120.0)
                record["checkpoint_after"] = ck["checkpoint_id"]
            except Exception as e:  # noqa: BLE001 - the change is done; the next one comes
                record["checkpoint_after"] = f"failed: {type(e).__name__}: {e}"

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

    async def _interrupted(self: Any, attempt: int, timeout_s: float = 1.0) -> bool:
        """Whether a failure (a recovery, or the job failed) interrupted a change begun in
        ``attempt``: an actor's death reaches the change's calls about when the watcher sees it,
        so this waits up to ``timeout_s`` for the watcher to say so."""
        deadline = time.monotonic() + timeout_s
        while self._attempt == attempt and self.state not in ("recovering", "failed"):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def _interrupted_error(self: Any, what: str, e: BaseException) -> ReconfigurationError:
        """The refusal of a change a failure interrupted: what happens and what to do."""
        msg = (
            f"an instance of job {self.flow.name!r} failed during the {what} "
            f"({type(e).__name__}); the job recovers (or recovered) from its latest checkpoint "
            f"with the graph it had before (unless its restart strategy gave up): nothing of the "
            f"{what} is in force, request it again"
        )
        return ReconfigurationError(msg)

    def _check_still_running(self: Any, attempt: int, what: str) -> None:
        """A queued change whose turn came: refused if the job ended, its sources finished or
        it recovered (another attempt) while the change waited."""
        if self._attempt != attempt or self.state != "running" or self._sources_done():
            msg = (
                f"job {self.flow.name!r} is {self.state}"
                f"{' and its sources finished' if self._sources_done() else ''}"
                f"{' (it recovered meanwhile)' if self._attempt != attempt else ''}: {what}"
            )
            raise ReconfigurationError(msg)

    # ---- move an instance ---------------------------------------------------------------------
    def _at(self: Any, step: str, index: int) -> Any:
        """The instance id at routing index ``index`` of ``step`` (another id after a move)."""
        iid = self.slots.get((step, index))
        return iid if iid is not None and iid in self.specs else (step, index)

    def _current_output(self: Any, out: Any) -> Any:
        """``out`` as it is now: the step's routing table, parallelism and instances."""
        p = self.parallelism[out.step]
        ids = tuple(self._at(out.step, i) for i in range(p))
        return replace(
            out,
            routing=self.routing.get(out.step),
            parallelism=p,
            receivers=() if ids == tuple((out.step, i) for i in range(p)) else ids,
        )

    async def move(
        self: Any, step: str, index: int, node_id: str, strategy_args: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Move instance ``index`` of keyed step ``step`` to node ``node_id``: a new actor there
        takes over its key groups and the old actor retires. ``strategy_args["transfer"]``:
        ``"files"`` (default; the old RocksDB whole before the barrier, the rows written since
        at it: raystream.runtime.move_files) or ``"rows"`` (on-demand fetches first, the rest
        hottest first, as in a rescale; the other keys are FetchPolicy options). Queued like a
        rescale. An unknown step, index, node or transfer is refused (ReconfigurationError)
        before anything changes."""
        from raystream.placement import cluster_nodes

        steps = self.plan.steps
        if step not in steps or not steps[step].is_keyed:
            keyed = [n for n, s in steps.items() if s.is_keyed]
            what = "no such step" if step not in steps else f"it is a {steps[step].kind} step"
            msg = f"cannot move an instance of {step!r}: {what}; keyed steps can be moved: {keyed}"
            raise ReconfigurationError(msg)
        if not self.config.migration_support:
            msg = "this job runs with migration_support=False; restart it with it on to move"
            raise ReconfigurationError(msg)
        self._check_movable(step)  # a sink chained to it would have to move too
        fetch = dict(strategy_args or {})
        transfer = fetch.get("transfer", "files")
        if transfer not in MOVE_TRANSFERS:
            msg = (
                f"cannot move {step!r}/{index}: transfer must be one of {MOVE_TRANSFERS} (the "
                f"instance's RocksDB files, or its rows sub-group by sub-group), got {transfer!r}"
            )
            raise ReconfigurationError(msg)
        nodes = await asyncio.to_thread(cluster_nodes)
        if node_id not in {n.node_id for n in nodes}:
            known = ", ".join(f"{n.node_id} ({n.address})" for n in nodes)
            msg = (
                f"cannot move {step!r}/{index} to node {node_id!r}: no alive node has that id; "
                f"the nodes are: {known}"
            )
            raise ReconfigurationError(msg)
        attempt = self._attempt
        async with self._change_turn():
            p = self.parallelism[step]
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < p:
                msg = (
                    f"cannot move {step!r}/{index}: the step has instances 0..{p - 1} "
                    "(routing indexes)"
                )
                raise ReconfigurationError(msg)
            self._check_still_running(attempt, f"{step!r}/{index} was not moved")
            try:
                return await self._move(step, index, node_id, fetch)
            except Exception as e:
                import ray

                if await self._interrupted(attempt):
                    what = f"move of {step!r}/{index}"
                    raise self._interrupted_error(what, e) from e
                ended = self.state != "running" or self._sources_done()
                if not (ended and isinstance(e, ray.exceptions.RayActorError)):
                    raise
                msg = (
                    f"job {self.flow.name!r} is {self.state}"
                    f"{' and its sources finished' if self._sources_done() else ''}: an "
                    f"actor of the move of {step!r}/{index} ended during it "
                    f"({type(e).__name__}); move instances while the sources still read"
                )
                raise ReconfigurationError(msg) from None

    async def _move(
        self: Any, step: str, index: int, node_id: str, fetch: dict[str, Any]
    ) -> dict[str, Any]:
        from pathlib import Path

        import numpy as np
        import ray

        from raystream.keys import RoutingTable
        from raystream.rescale import FetchPolicy
        from raystream.runtime.actors import NAMESPACE, InstanceActor, instance_actor_name
        from raystream.runtime.move_files import FILES_POLICY

        t0 = time.time()
        fetch = dict(fetch)
        by_files = fetch.pop("transfer", "files") == "files"
        p = self.parallelism[step]
        current = self.routing[step]
        old_iid = self._at(step, index)
        old = self.handles[old_iid]
        s = self.flow.key_space.sub_groups
        heat = np.asarray(await old.sub_group_load.remote())
        # a fresh channel id: past any routing index a rescale can use (<= num_key_groups)
        self._moves = getattr(self, "_moves", 0) + 1
        new_iid = (step, self.flow.key_space.num_key_groups + self._moves)
        epoch = self._next_epoch()
        template = self.specs[old_iid]
        upstream = [
            iid
            for iid in self.specs
            if iid[0] in template.step.upstream and iid not in self.retired
        ]
        outputs = tuple(self._current_output(o) for o in template.outputs)
        spec = replace(
            template,
            index=new_iid[1],
            inputs=tuple(upstream),
            outputs=outputs,
            owned_key_groups=(),
            state_path=str(Path(self.plan_dir) / step / f"{new_iid[1]}-e{epoch}"),
            restore=None,
        )
        options = self.plan.steps[step].actor
        # a warm spare on the target node (RuntimeConfig.change_spares), or a new process (the
        # warm standbys are named for the indexes a scale-out would make) named after the
        # instance it replaces (that name is still the old actor's until it retires) and the
        # graph version this move makes, as the Ray dashboard shows it
        spare = self._take_spares(1, node_id) if options.is_default else []
        if spare:
            handle, actor_name, _ = spare[0]
            await handle.configure.remote(spec)
        else:
            version = self.graph_version + 1
            actor_name = f"{instance_actor_name(self.flow.name, step, index)}:v{version}"
            handle = InstanceActor.options(
                name=actor_name,
                namespace=NAMESPACE,
                max_concurrency=10_000,
                **options.ray_options(node_id),
            ).remote(spec)
        self.specs[new_iid] = spec
        self.handles[new_iid] = handle
        self.actor_names[new_iid] = actor_name
        self.nodes[new_iid] = await handle.ping.remote()
        t_actor = time.time()
        downstream = {r for o in outputs for r in o.receiver_ids}
        await handle.connect.remote(self._receivers_of(new_iid), self._self)
        await asyncio.gather(*(self.handles[d].add_inputs.remote([new_iid]) for d in downstream))
        await asyncio.gather(
            *(self.handles[u].add_receivers.remote({new_iid: handle}) for u in upstream)
        )
        self._run(new_iid)
        # connections opened now, not by the barrier's push to the new actor and its first
        # output downstream (each waited ~50 ms on a busy node, records queued behind it)
        await asyncio.gather(
            handle.warm.remote(list(self._receivers_of(new_iid))),
            *(self.handles[u].warm.remote([new_iid]) for u in upstream),
        )
        files: dict[str, Any] | None = None
        if by_files:
            # the old instance's files copied and opened there, then the rows it changed since
            # in rounds: last before the barrier (what is written meanwhile waits at the seal)
            same_node = self.nodes.get(old_iid) == self.nodes[new_iid]
            try:
                files = await handle.begin_take_over.remote(epoch, old, same_node)
                files.update(await handle.catch_up.remote())
            except Exception as e:  # noqa: BLE001 - the rows go instead; the record says why
                by_files = False
                files = {"error": f"{type(e).__name__}: {e}; moved by rows instead"}
        t_copied = time.time()
        # the plan: a migration whose target gives the old instance's key groups to the new one
        moving = current.key_groups_of(index).tolist()
        groups = [g for kg in moving for g in range(kg * s, (kg + 1) * s)]
        # by files: the old instance's RocksDB goes whole (raystream.runtime.move_files), the
        # engines fetch nothing; by rows: on demand and hottest first, as in a rescale
        policy = FILES_POLICY if by_files else FetchPolicy(**fetch)
        table = RoutingTable(epoch=epoch, owners=current.owners, parallelism=p)
        peers = {i: self.handles[self._at(step, i)] for i in range(p)}
        base = {"epoch": epoch, "policy": policy, "incoming": {}, "outgoing": [], "heat": {}}
        tasks = {i: dict(base) for i in range(p)}
        tasks[index] = {**base, "outgoing": groups, "by_files": by_files}
        arriving = {**base, "incoming": dict.fromkeys(groups, index)}
        arriving["owner_ids"] = {index: old_iid[1]}  # its channels downstream (see AfterFences)
        arriving["heat"] = {g: float(heat[g]) for g in groups}
        self._migration_reports.setdefault(epoch, {})  # reports may come at the barrier
        await asyncio.gather(
            *(peers[i].prepare_migration.remote(tasks[i], peers) for i in range(p)),
            handle.prepare_migration.remote(arriving, peers),
        )
        # by files: waits until the old instance sealed, then takes the rows changed since
        files_call = handle.finish_take_over.remote(epoch) if by_files else None
        payload = {
            "step": step,
            "table": table,
            "final": True,
            "aligned": False,
            "move": {"index": index, "to": new_iid},
        }
        taken = await asyncio.gather(
            *(
                self.handles[i].inject_barrier.remote(Barrier(epoch, "rescale", payload))
                for i in self.plan.sources
            )
        )
        t_injected = time.time()
        if not any(taken):
            if files_call is not None:  # no seal will come at the old instance
                ray.cancel(files_call)
            msg = (
                f"job {self.flow.name!r} reached the end of its input before the move of "
                f"{step!r}/{index} started: nothing moved (the new actor ends empty)"
            )
            raise ReconfigurationError(msg)
        waiting = {i: peers[i] for i in range(p)}
        waiting[p] = handle
        ids = [self._at(step, i) for i in range(p)] + [new_iid]
        stats = await self._await_migration(step, p, epoch, waiting, p + 1, ids)
        if files_call is not None:
            files = await files_call
        self.routing[step] = table
        self.slots[(step, index)] = new_iid
        self.retired.add(old_iid)
        self.actor_names.pop(old_iid, None)
        t1 = time.time()
        waits = [w for st in stats for w in st.get("fetch_wait_ms", [])]
        record = self._record_reconfiguration(
            "move",
            step,
            t0,
            t1,
            epochs=[epoch],
            moved={
                "key_groups": len(moving),
                "bytes": int(sum(st.get("bytes_in", 0) for st in stats)),
                "rows": int(sum(st.get("rows_in", 0) for st in stats)),
                "on_demand_fetches": int(sum(st.get("on_demand_fetches", 0) for st in stats)),
            },
            change=(
                f"routing index {index}: {list(old_iid)} on {self.nodes.get(old_iid)} -> "
                f"{list(new_iid)} on {self.nodes[new_iid]}"
            ),
            instance=list(new_iid),
            node_id=self.nodes[new_iid],
            actors=[actor_name],
            spares_used=len(spare),  # 1: the new actor was a warm spare
            fetch_wait_ms_p99=float(np.percentile(waits, 99)) if waits else 0.0,
            phases_s={
                **_move_phases(t0, t_actor, t_injected, t1, stats),
                **({"files_open": round(t_copied - t0, 3)} if files_call is not None else {}),
            },
            transfer="files" if by_files else "rows",
            **({"files": files} if files is not None else {}),
        )
        if spare:
            self._refill_spares_later(f"move {step!r}/{index}")
        return record

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
        if self._turn_queued_s is not None:  # how long it waited behind other changes
            record["queued_s"] = round(self._turn_queued_s, 3)
        self.reconfigurations.append(record)
        return record

    def reconfiguration_records(
        self: Any,
        latency: LatencyRecorder | None,
        complete: bool = True,
        last: int | None = None,
    ) -> list[dict[str, Any]]:
        """Every change kept (the newest RECORDS_KEPT; the ``last`` ones if given); with sink
        latency, the peak (max) and p99 of the records that reached a sink from the change's
        start until ``PEAK_AFTER_S`` after its end.

        Once the sinks' latency is past that span (and ``complete``: every sink answered), a
        change's figures are kept with it: they do not change any more, a status call does not
        read those windows again, and they outlive the windows (``metrics_windows_retained_s``).
        """
        settled: dict[int, tuple[Any, Any]] = self._settled_latency
        newest = latency.newest_s if latency else None
        out = []
        changes = self.reconfigurations
        # the position of the oldest change kept (a long job's oldest ones are gone)
        oldest = len(changes) - len(changes.kept()) if isinstance(changes, BoundedHistory) else 0
        for i in [i for i in settled if i < oldest]:
            del settled[i]
        first = max(oldest, 0 if last is None else len(changes) - last)
        for i in range(first, len(changes)):
            r = dict(changes[i])
            if i in settled:
                r["peak_latency_ms"], r["p99_latency_ms"] = settled[i]
            elif latency:
                s = latency.summary_between(r["start_s"], r["end_s"] + PEAK_AFTER_S)
                r["peak_latency_ms"] = s["max_ms"]
                r["p99_latency_ms"] = s["p99_ms"]
                if complete and newest is not None and newest > r["end_s"] + PEAK_AFTER_S + 1.0:
                    settled[i] = (s["max_ms"], s["p99_ms"])
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
                    "chain": self.chain_of(name),  # the steps sharing its actors
                }
            )
        return rows


def _move_phases(
    t0: float, actor_ready: float, injected: float, end: float, stats: list[Any]
) -> dict[str, Any]:
    """Seconds from a move's start to each of its phases: the new actor answers, the barrier is
    injected, the new owner switches, the old owner seals and serves its first on-demand chunk,
    the last sub-group arrives, each instance finishes its part (the new one last in the list),
    the move is done; the calls and chunks that carried the state; how long records waited for
    their state at the new owner (p50 and max, ms)."""
    import numpy as np

    def since(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 3)

    new = stats[-1]
    old = next((st for st in stats[:-1] if st.get("chunks_out")), {})
    waits = new.get("fetch_wait_ms") or [0.0]
    return {
        "actor_ready": since(actor_ready),
        "barrier_injected": since(injected),
        "switched": since(new.get("activated_wall")),
        "sealed": since(old.get("sealed_wall")),
        "first_on_demand_served": since(old.get("first_urgent_served_wall")),
        "all_arrived": since(new.get("all_arrived_wall")),
        # old owner: its outgoing state left the cache (ready to go)
        "ready": since(old.get("ready_wall")),
        "finished": [since(st.get("finished_wall")) for st in stats],
        "done": since(end),
        "fetch_calls": new.get("fetch_calls"),
        "chunks_out": old.get("chunks_out"),
        "record_wait_ms": {
            "p50": round(float(np.percentile(waits, 50)), 1),
            "max": round(float(max(waits)), 1),
        },
    }
