"""Insert a stateless step between two running ones, or take one out, at one barrier.

A mixin of :class:`raystream.controller.Controller`, queued with rescales, replacements, moves
and checkpoints (one at a time, one epoch counter, one record per change).

Insert: the new step's instances start, wired to the downstream step (which takes them as new
inputs); then a ``rewire`` barrier from every source, aligned at every instance like a checkpoint
barrier. Each instance of the upstream step, once aligned, ends its output to the downstream step
(what it sent before the barrier, the barrier, EndOfStream) and sends to the new step from then
on. So every record before the barrier goes the old way, every record after it through the new
step. Remove is the same with the roles swapped: the upstream step sends to the downstream step
again (its old inputs there reopen), the removed step's instances get the barrier and
EndOfStream and end.

Steps go in or out between a step and a downstream step that reads only its main output. A keyed
step goes in with ``key_by``: its instances start with empty state and their own routing table
(uniform over its parallelism), the upstream step routes to them by key group from the barrier
on, and from then on it rescales, moves, checkpoints and recovers like any keyed step. A keyed
step comes out with ``state="drop"`` or ``state="emit"`` (raystream.step_changes): its instances
see the barrier and their input end, then drop their state, or fire every timer and send each
key's final state downstream (after the barrier; the downstream step's direct input from the
upstream step flows meanwhile), and end.

With checkpoints on, a checkpoint is taken right after each insert and remove (its id in the
change's record, ``checkpoint_after``): a recovery restores the graph as it runs now, so from
that checkpoint on it replays exactly as the change made it. A failure before that checkpoint
completes recovers from an older one through the new graph, as if the change had happened at
that checkpoint: an inserted keyed step starts empty there and sees the replayed records; a
removed step's state (emitted or not) is not restored, the replayed records go past it. Sinks
publish nothing after that checkpoint before it, so the output stays consistent with that run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import ray

from raystream.errors import ReconfigurationError
from raystream.reconfigurations import _fn_name
from raystream.runtime.messages import Barrier
from raystream.step_changes import (
    check_removal_state,
    graph_with_step,
    graph_without_step,
    inserted_step,
)

__all__ = ["Rewiring"]


class Rewiring:
    """Insert and remove steps of a running job."""

    @contextlib.asynccontextmanager
    async def _queue_turn(self: Any, what: str) -> AsyncIterator[None]:
        """Wait for this change's turn in the queue of changes; refuse it if the job is no
        longer running (or recovered meanwhile), with nothing changed."""
        attempt = self._attempt
        async with self._change_turn():
            self._check_still_running(attempt, f"{what} was not carried out")
            yield

    # ---- insert / remove a stateless step -------------------------------------------------------
    def chain_of(self: Any, step: str) -> list[str]:
        """The steps whose instances run in the actors of ``step``, head first (operator
        chaining); [] when it runs alone."""
        return _chain_of(self.plan, step)

    def _live_ids(self: Any, step: str) -> list[Any]:
        """The instance ids of ``step`` by routing index (or index, for a step without routing)."""
        if step in self.routing:
            return [self._at(step, i) for i in range(self.parallelism[step])]
        return sorted(
            iid
            for iid in self.specs
            if iid[0] == step and iid not in self.retired and iid[1] < self.parallelism[step]
        )

    def _edge_to(self: Any, down: str, key: Any) -> Any:
        """An output to step ``down`` as it runs now (by key group if it is keyed)."""
        from raystream.runtime.instance import OutputSpec

        keyed = self.plan.steps[down].is_keyed
        out = OutputSpec(
            down,
            self.parallelism[down],
            "key_group" if keyed else "rebalance",
            key=key if keyed else None,
        )
        return self._current_output(out)

    async def insert(
        self: Any,
        after: str,
        op: Any,
        name: str | None = None,
        parallelism: int = 1,
        before: str | None = None,
        key_by: Any = None,
    ) -> dict[str, Any]:
        """Put operator ``op`` as a new step between ``after`` and its downstream step ``before``
        (the only one if None) at one barrier; a keyed operator needs ``key_by``. Refused
        (nothing changes) for a sink, an unknown step, a name in use, a keyed operator without
        key_by, or a downstream step with several inputs or reading a side output."""
        from raystream.dataflow import _NAME, Operator

        steps = self.plan.steps
        if after not in steps or steps[after].kind == "sink":
            what = "no such step" if after not in steps else "it is a sink"
            msg = f"cannot insert a step after {after!r}: {what}; the steps are {list(steps)}"
            raise ReconfigurationError(msg)
        down = [n for n, s in steps.items() if after in s.upstream]
        if before is None and len(down) == 1:
            before = down[0]
        if before not in down:
            msg = (
                f"cannot insert a step after {after!r} before {before!r}: {after!r} feeds "
                f"{down}; pass before= one of them"
            )
            raise ReconfigurationError(msg)
        d = steps[before]
        if len(d.upstream) != 1 or d.port_for(after):
            msg = (
                f"cannot insert a step between {after!r} and {before!r}: {before!r} reads "
                f"{list(d.upstream)}{' (a side output)' if d.port_for(after) else ''}; only a "
                "step that reads the main output of one step can get a step put before it"
            )
            raise ReconfigurationError(msg)
        if before in _chained_with(self.plan, after):
            msg = (
                f"cannot insert a step between {after!r} and {before!r}: they run chained in "
                f"one actor (operator chaining), with no channel between them to rewire; start "
                f"the job with flow.options({before!r}, chain=False) (or chaining=False) to "
                "insert steps there"
            )
            raise ReconfigurationError(msg)
        keyed = getattr(self, "following", {}).get(after)
        if keyed is not None:
            first = next(f for f, k in self.following.items() if k == keyed)
            msg = (
                f"cannot insert a step after {after!r}: it runs chained in the actors of keyed "
                f"step {keyed!r} and follows its rescales (operator chaining), so its instances "
                f"come and go with {keyed!r}'s; start the job with flow.options({first!r}, "
                f"chain=False) (or chaining=False) to insert steps after {after!r}"
            )
            raise ReconfigurationError(msg)
        name = name or (op.name if isinstance(op, Operator) else "")
        new = inserted_step(
            op, name, after, parallelism, key_by, num_key_groups=self.flow.key_space.num_key_groups
        )
        if not _NAME.match(name) or name in steps:
            msg = (
                f"the inserted step needs a new name matching {_NAME.pattern}, got {name!r} "
                f"(steps: {list(steps)}); pass name="
            )
            raise ReconfigurationError(msg)
        if new.is_keyed and not self.config.migration_support:
            msg = (
                f"cannot insert keyed step {name!r}: this job runs with "
                "migration_support=False; restart it with it on to insert keyed steps"
            )
            raise ReconfigurationError(msg)
        async with self._queue_turn(f"insert {name!r} after {after!r}"):
            return await self._insert(after, before, new)

    async def _insert(self: Any, after: str, before: str, new: Any) -> dict[str, Any]:
        from pathlib import Path

        from raystream.keys import RoutingTable
        from raystream.runtime.actors import NAMESPACE, InstanceActor, instance_actor_name
        from raystream.runtime.instance import OutputSpec

        t0 = time.time()
        name, parallelism = new.name, new.parallelism
        await self._free_ids(name, parallelism)
        d = self.plan.steps[before]
        ups = self._live_ids(after)
        to_d = self._edge_to(before, d.key_for(after))
        # named with the graph version this insert makes (the Ray dashboard shows it; a step
        # removed and inserted again under its name gets new names and a new state folder)
        version = self.graph_version + 1
        table = None
        if new.is_keyed:  # empty state, its own routing table
            table = RoutingTable.uniform(self.flow.key_space.num_key_groups, parallelism)
            to_new = OutputSpec(name, parallelism, "key_group", key=new.key, routing=table)
        else:
            to_new = OutputSpec(name, parallelism, "rebalance")
        template = self.specs[ups[0]]
        specs = {
            (name, j): replace(
                template,
                step=new,
                index=j,
                inputs=tuple(ups),
                outputs=(to_d,),
                state_path=(
                    str(Path(self.plan_dir) / name / f"{j}-v{version}") if table else None
                ),
                owned_key_groups=(
                    tuple(int(g) for g in table.key_groups_of(j)) if table else ()
                ),
                restore=None,
                source_parallelism=1,
            )
            for j in range(parallelism)
        }
        # warm spares (RuntimeConfig.change_spares) first: no process starts while the job runs
        spares = self._take_spares(len(specs))
        names: dict[Any, str] = {}
        handles: dict[Any, Any] = {}
        configuring = []
        for iid, spec in specs.items():
            if spares:
                handle, names[iid], _ = spares.pop(0)
                configuring.append(handle.configure.remote(spec))
            else:
                names[iid] = f"{instance_actor_name(self.flow.name, *iid)}:v{version}"
                handle = InstanceActor.options(
                    name=names[iid], namespace=NAMESPACE, max_concurrency=10_000
                ).remote(spec)
            handles[iid] = handle
        used_spares = len(configuring)
        attempt = self._attempt
        try:
            self.specs.update(specs)
            self.handles.update(handles)
            self.actor_names.update(names)
            await asyncio.gather(*configuring)
            where = await asyncio.gather(*(h.ping.remote() for h in handles.values()))
            self.nodes.update(zip(handles, where, strict=True))
            await asyncio.gather(
                *(h.connect.remote(self._receivers_of(i), self._self) for i, h in handles.items())
            )
            await asyncio.gather(
                *(self.handles[r].add_inputs.remote(list(specs)) for r in to_d.receiver_ids)
            )
            await asyncio.gather(*(self.handles[u].add_receivers.remote(handles) for u in ups))
            for iid in specs:
                self._run(iid)
            self.parallelism[name] = parallelism
            t_ready = time.time()  # the new instances run, wired to both neighbours
            epoch, offsets = await self._rewire(after, before, to_new, f"insert {name!r}")
        except Exception as e:
            if await self._interrupted(attempt):
                self._forget_uninserted(specs, handles)
                raise self._interrupted_error(f"insert of {name!r}", e) from e
            raise
        # the graph as it runs now: recoveries, rescales and scale-outs build on it
        if table is not None:
            self.routing[name] = table
        for steps in (self.plan.steps, self.flow.steps):
            changed = graph_with_step(steps, new, before)
            steps.clear()
            steps.update(changed)
        self._set_outputs(ups, before, to_new)
        for iid, spec in list(self.specs.items()):
            if iid[0] == before:
                self.specs[iid] = replace(spec, step=replace(spec.step, upstream=(name,)))
        keyed = f", keyed by {new.key.column or 'a function'}" if new.key else ""
        t1 = time.time()
        record = self._record_reconfiguration(
            "insert",
            name,
            t0,
            t1,
            epochs=[epoch],
            moved={},
            change=f"{after} -> {name} ({new.kind} {_fn_name(new.fn)}{keyed}) -> {before}",
            instances=parallelism,
            source_offsets=offsets,
            actors=list(names.values()),
            spares_used=used_spares,  # of the instances, how many took a warm spare actor
            # seconds from the start: the new instances started and wired, the barrier passed
            phases_s={"instances_ready": round(t_ready - t0, 3), "switched": round(t1 - t0, 3)},
        )
        if used_spares:
            self._refill_spares_later(f"insert {name!r}")
        await self._checkpoint_after(record)
        return record

    def _forget_uninserted(self: Any, specs: dict[Any, Any], handles: dict[Any, Any]) -> None:
        """A failure interrupted an insert before the graph took the new step: the recovery
        redeploys the graph without it, so its actors (started, maybe after the recovery listed
        the actors to stop) are stopped here and the job's records forget them."""
        from raystream.runtime.actors import actor_of

        for iid, h in handles.items():
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor_of(h), no_restart=True)
            tables = (self.specs, self.handles, self.actor_names, self.nodes, self._run_futures)
            for table in tables:
                table.pop(iid, None)
        self.parallelism.pop(next(iter(specs))[0], None)

    async def _free_ids(self: Any, name: str, parallelism: int, timeout_s: float = 60.0) -> None:
        """A step removed earlier had this name: once each of its instances with an id the new
        step takes has ended, its outcome goes to the history, so the job watches (and ends
        with) the new instance under that id."""
        deadline = time.monotonic() + timeout_s
        for iid in [(name, j) for j in range(parallelism) if (name, j) in self._run_futures]:
            while iid not in self.outcomes:
                if time.monotonic() > deadline:
                    msg = (
                        f"cannot insert {name!r}: instance {iid} of the step removed earlier "
                        f"under that name has not ended within {timeout_s:g} s; nothing changed, "
                        "insert it again later or under another name"
                    )
                    raise ReconfigurationError(msg)
                await asyncio.sleep(0.01)
            self._retire_outcome(iid)
            self.retired.discard(iid)
            self._run_futures.pop(iid, None)

    async def remove(self: Any, step: str, state: str | None = None) -> dict[str, Any]:
        """Take step ``step`` out at one barrier: its upstream step sends to its downstream step
        again, its instances end. A keyed step needs ``state``: ``"drop"`` drops its state,
        ``"emit"`` fires its timers and sends each key's final state downstream first.
        Refused (nothing changes) for a source, a sink, a keyed step without ``state``, or a step
        with several inputs or downstream steps."""
        steps = self.plan.steps
        s = steps.get(step)
        down = [n for n, t in steps.items() if step in t.upstream]
        problem = None
        if s is None:
            problem = f"no such step; the steps are {list(steps)}"
        elif s.kind in ("source", "sink"):
            problem = (
                f"it is a {s.kind} step; operator steps (stateless, or keyed with state='drop' "
                "or 'emit') can be removed"
            )
        elif s.is_keyed and state is None:  # the first thing to say about a keyed step
            check_removal_state(s, steps[down[0]] if len(down) == 1 else None, state)
        elif len(s.upstream) != 1 or s.ports or len(down) != 1:
            problem = (
                f"it reads {list(s.upstream)} and feeds {down}; only a step with one upstream "
                "step (its main output) and one downstream step can be removed"
            )
        elif len(steps[down[0]].upstream) != 1:
            problem = f"its downstream step {down[0]!r} has several inputs"
        elif _chained_with(self.plan, step):
            problem = (
                f"it runs chained in one actor with {sorted(_chained_with(self.plan, step))} "
                f"(operator chaining); start the job with flow.options({step!r}, chain=False) "
                "(or chaining=False) to remove it while the job runs"
            )
        if problem is not None:
            msg = f"cannot remove {step!r}: {problem}"
            raise ReconfigurationError(msg)
        mode = check_removal_state(s, steps[down[0]], state)
        async with self._queue_turn(f"remove {step!r}"):
            return await self._remove(step, down[0], mode)

    async def _remove(self: Any, step: str, before: str, mode: str | None) -> dict[str, Any]:
        attempt = self._attempt
        try:
            return await self._removing(step, before, mode)
        except Exception as e:
            if await self._interrupted(attempt):
                raise self._interrupted_error(f"removal of {step!r}", e) from e
            raise

    async def _removing(self: Any, step: str, before: str, mode: str | None) -> dict[str, Any]:
        t0 = time.time()
        s = self.plan.steps[step]
        after = s.upstream[0]
        d = self.plan.steps[before]
        ups = self._live_ids(after)
        mine = self._live_ids(step)
        to_d = self._edge_to(before, d.key_for(step))
        await asyncio.gather(*(self.handles[r].add_inputs.remote(ups) for r in to_d.receiver_ids))
        # the upstream instances may never have sent to these (started by a recovery or a
        # scale-out since): they get their handles before the barrier
        receivers = {r: self.handles[r] for r in to_d.receiver_ids}
        await asyncio.gather(*(self.handles[u].add_receivers.remote(receivers) for u in ups))
        removal = {"removes": step, "state": mode} if mode else {}
        epoch, offsets = await self._rewire(after, step, to_d, f"remove {step!r}", removal)
        self.retired.update(mine)
        for iid in mine:
            self.actor_names.pop(iid, None)
        for steps in (self.plan.steps, self.flow.steps):
            changed = graph_without_step(steps, step)
            steps.clear()
            steps.update(changed)
        self.parallelism.pop(step, None)
        self.routing.pop(step, None)
        for slot in [k for k in getattr(self, "slots", {}) if k[0] == step]:
            self.slots.pop(slot)
        for entry in [e for e in getattr(self, "_standby", []) if e[2][0] == step]:
            self._standby.remove(entry)  # warm spares named for its instances
            ray.kill(entry[0], no_restart=True)
        self._set_outputs(ups, step, to_d)
        for iid, spec in list(self.specs.items()):
            if iid[0] == before:
                self.specs[iid] = replace(spec, step=replace(spec.step, upstream=(after,)))
        state_note = f"; its state: {mode}" if mode else ""
        record = self._record_reconfiguration(
            "remove",
            step,
            t0,
            time.time(),
            epochs=[epoch],
            moved={},
            change=f"{after} -> {before} (without {step}: {_fn_name(s.fn)}{state_note})",
            instances=len(mine),
            source_offsets=offsets,
            state=mode,
        )
        await self._checkpoint_after(record)
        return record

    async def _rewire(
        self: Any,
        after: str,
        replaces: str,
        output: Any,
        what: str,
        extra: dict[str, Any] | None = None,
    ) -> tuple[int, dict[str, int]]:
        """One aligned barrier: every instance of ``after`` replaces its output to
        ``replaces`` by ``output`` (``extra``: more for the payload, e.g. a removed keyed
        step's ``removes`` and ``state``). Returns the epoch and where each source emitted it."""
        epoch = self._next_epoch()
        payload = {"step": after, "replaces": replaces, "output": output, "aligned": True}
        payload.update(extra or {})
        taken: list[bool] = []
        try:
            acks = await self.inject(
                Barrier(epoch, "rewire", payload), float(self.config.rescale_timeout_s), taken=taken
            )
        except Exception as e:
            msg = (
                f"the {what} barrier (epoch {epoch}) did not pass every instance: "
                f"{type(e).__name__}: {e}"
                + (" (no source emitted it: nothing changed)" if taken and not any(taken) else "")
            )
            raise ReconfigurationError(msg) from e
        offsets = {
            f"{a['instance'][0]}/{a['instance'][1]}": int(a["source_offset"])
            for a in acks
            if "source_offset" in a
        }
        return epoch, offsets

    def _set_outputs(self: Any, ups: list[Any], old: str, new: Any) -> None:
        for u in ups:
            spec = self.specs[u]
            outs = tuple(replace(new, port=o.port) if o.step == old else o for o in spec.outputs)
            self.specs[u] = replace(spec, outputs=outs)



def _chain_of(plan: Any, step: str) -> list[str]:
    for ids in getattr(plan, "chains", {}).values():
        names = [s for s, _ in ids]
        if step in names:
            return names
    return []


def _chained_with(plan: Any, step: str) -> set[str]:
    """The other steps that run in the actors of ``step`` (operator chaining)."""
    return set(_chain_of(plan, step)) - {step}
