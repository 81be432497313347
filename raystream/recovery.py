"""The controller's checkpoints, savepoints, failure detection and recovery.

A mixin of :class:`raystream.controller.Controller` (it uses the controller's plan, handles and
barriers); the pure parts (manifests, what each instance restores, the restart strategy) live in
:mod:`raystream.checkpointing`.

- **Checkpoints** are aligned barriers injected at the sources every ``checkpoint_interval_s``.
  A checkpoint is complete once every instance acknowledged it (keyed instances after their
  files are in checkpoint storage) and its manifest is written; then sinks publish what they
  pre-committed. Checkpoints and rescales are serialised: one that falls due during a rescale
  waits for it to end.
- **Failures**: an instance whose ``run`` errs, whose actor dies (Ray reports it) or that answers
  no heartbeat within ``heartbeat_timeout_s`` (killed, then treated like a death).
- **Recovery**: every instance is stopped and started again from the latest complete checkpoint
  (a global restart, as Flink does for all-to-all graphs), at the job's current parallelism:
  keyed instances load the key groups they own from whichever instances held them, sources
  rewind, sinks publish what the checkpoint pre-committed and drop the rest. The processes of
  live actors are kept (``recovery_keeps_actors``, :mod:`raystream.actor_reuse`): they are reset
  in place and configured for the new attempt; only dead, hung or lost ones are replaced.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray

from raystream.chaining import chain_edges, follow_keyed, steps_following
from raystream.checkpointing import build_manifest, manifest_routing, restore_specs
from raystream.errors import CheckpointError, RaystreamError
from raystream.history import RECORDS_KEPT, BoundedHistory
from raystream.metrics import step_totals, sum_totals
from raystream.partition_commit import JobPartitionCommits, now_ms, written_partitions
from raystream.runtime.actors import actor_of
from raystream.runtime.messages import Barrier, ChannelId
from raystream.runtime.snapshots import FINAL_CHECKPOINT

__all__ = ["Recovery"]

log = logging.getLogger("raystream.recovery")


class Recovery:
    """Checkpoints and recovery of a running job (mixed into the Controller)."""

    # ---- storage and plans ----------------------------------------------------------------
    @property
    def storage(self: Any) -> Any:
        if self._storage is None:
            from raystream.checkpoint.storage import CheckpointStorage

            uri, job = self.storage_spec
            self._storage = CheckpointStorage(uri, job, retain=self.config.checkpoints_retained)
        return self._storage

    def _replan(
        self: Any, manifest: dict[str, Any] | None, base_dir: str, *, fresh: bool = False
    ) -> None:
        """Build the physical plan of a (re)start: fresh, from ``manifest`` at its routing (or at
        the parallelism the user asked for), or on recovery at the current routing."""
        from raystream.plan import physical_plan

        parallelism = dict(self._parallelism_arg or {})
        routing = None
        if not fresh:
            if self.state == "recovering":
                routing = in_graph(self.routing, self.flow.steps)
            else:  # a start from a checkpoint or savepoint
                routing = {
                    n: t
                    for n, t in manifest_routing(manifest or {}).items()
                    if n not in self.parallelism_given or parallelism.get(n) == t.parallelism
                }
            if self.state == "recovering":  # at the job's current parallelism, every step
                for n, p in getattr(self, "parallelism", {}).items():
                    parallelism.setdefault(n, p)
                # the graph as it runs: not a step a change had started when a failure
                # interrupted it (an insert whose barrier did not pass), nor one removed since
                parallelism = in_graph(parallelism, self.flow.steps)
            for n, t in routing.items():
                parallelism[n] = t.parallelism
            # the steps chained after a keyed step have its parallelism (raystream.keyed_chains)
            parallelism = follow_keyed(parallelism, getattr(self, "following", {}))
        # a recovery keeps the chains the job runs with (None: a start plans them)
        chained = chain_edges(self.plan.chains) if self.state == "recovering" else None
        plan = physical_plan(
            self.flow,
            parallelism,
            self.config,
            self.origin_ns,
            base_dir,
            routing=routing,
            chained=chained,
        )
        restore = (
            {}
            if fresh
            else restore_specs(
                manifest, plan.instances, plan.routing, self._restore_storage(manifest)
            )
        )
        specs = {
            iid: replace(
                spec,
                storage=self.storage_spec,
                restore=restore.get(iid),
                attempt=self._attempt,
                sink_writer=getattr(self, "_sink_writers", {}).get(iid),
            )
            for iid, spec in plan.instances.items()
        }
        self.plan = replace(plan, instances=specs)
        self.plan_dir = base_dir
        self.specs = dict(specs)
        self.routing = dict(plan.routing)
        self.parallelism = {n: s.parallelism or 1 for n, s in plan.steps.items()}
        self.following = steps_following(
            plan.steps, enabled=self.config.chaining, allowed=chained
        )
        if manifest is not None:
            self._epoch = max(self._epoch, int(manifest["checkpoint_id"]))
        # partition commits: the folders pending at the checkpoint (committed again when due)
        self._partition_commits = JobPartitionCommits(self.flow.steps)
        self._partition_commits.restore(manifest)

    def _restore_storage(self: Any, manifest: dict[str, Any] | None) -> tuple[str, ...]:
        """Where a restoring instance reads state files: the job's storage or a savepoint."""
        where = (manifest or {}).get("_storage")
        return tuple(where) if where else self.storage_spec  # type: ignore[no-any-return]

    async def _resolve_restore(self: Any, kind: str, where: str) -> dict[str, Any]:
        """The manifest a job starts from: ``("checkpoint", "latest" | id | path)`` or
        ``("savepoint", path)``; checked against this dataflow."""
        from raystream.checkpoint.storage import check_compatible, open_savepoint

        if kind == "checkpoint" and (where == "latest" or str(where).isdigit()):
            storage = self.storage
            if where == "latest":
                manifest = await asyncio.to_thread(storage.latest)
                if manifest is None:
                    uri, job = self.storage_spec
                    msg = (
                        f"no complete checkpoint of job {job!r} under {uri!r}; start it without "
                        "--from-checkpoint, or pass the checkpoint_dir the job used"
                    )
                    raise CheckpointError(msg)
            else:
                manifest = await asyncio.to_thread(storage.load, int(where))
        else:
            _, manifest = await asyncio.to_thread(open_savepoint, str(where))
            manifest = dict(manifest, _storage=["savepoint", str(where)])
        check_compatible(
            manifest,
            self.flow.name,
            {n: s.kind for n, s in self.flow.steps.items()},
            self.flow.key_space.num_key_groups,
            self.flow.key_space.sub_groups,
        )
        self.restored_from = {
            "kind": kind,
            "where": str(where),
            "checkpoint_id": manifest["checkpoint_id"],
        }
        return manifest

    # ---- loops --------------------------------------------------------------------------
    def _start_recovery_loops(self: Any) -> None:
        loop = asyncio.get_running_loop()
        existing = self._existing_checkpoint_ids()
        self._epoch = max(self._epoch, max(existing, default=0))
        if self.config.checkpoint_interval_s > 0:
            loop.create_task(self._checkpoint_loop())
        loop.create_task(self._heartbeat_loop())

    def _existing_checkpoint_ids(self: Any) -> list[int]:
        try:
            lister = getattr(self.storage, "_chk_ids", None) or self.storage.checkpoints
            return list(lister())
        except Exception:  # noqa: BLE001 - no storage yet: checkpoints will say why
            return []

    async def _checkpoint_loop(self: Any) -> None:
        interval = self.config.checkpoint_interval_s
        while self.state in ("running", "recovering"):
            await asyncio.sleep(interval)
            if self.state != "running" or self._sources_done():
                continue
            async with self._rescale_lock:  # a checkpoint due during a rescale waits for it
                if self.state != "running" or self._sources_done():
                    continue
                try:
                    await self._take_checkpoint(max(60.0, 10 * interval))
                except Exception as e:  # noqa: BLE001 - the job goes on; the next one may succeed
                    self.failed_checkpoints.append(
                        {"at_s": self._now_s(), "error": f"{type(e).__name__}: {e}"}
                    )
                    log.warning("job %s: checkpoint failed: %s", self.flow.name, e)

    async def _heartbeat_loop(self: Any) -> None:
        """Ask every live instance for a heartbeat each second; one that has not answered for
        ``heartbeat_timeout_s`` is hung: it is killed and handled like a dead one."""
        timeout = self.config.heartbeat_timeout_s
        period = min(1.0, timeout / 4)
        while self.state in ("running", "recovering"):
            await asyncio.sleep(period)
            if self.state != "running":
                continue
            attempt = self._attempt
            now = time.monotonic()
            for iid, h in list(self.handles.items()):
                if iid in self.outcomes:
                    continue
                asyncio.ensure_future(self._beat(iid, h, attempt))
                last = self._heartbeats.get(iid, now)
                if now - last > timeout and iid not in self._hung:
                    self._hung[iid] = (
                        f"instance {iid} answered no heartbeat for {now - last:.0f} s "
                        f"(heartbeat_timeout_s={timeout}): its event loop is stuck"
                    )
                    log.warning("job %s: %s; killing it", self.flow.name, self._hung[iid])
                    ray.kill(actor_of(h), no_restart=True)

    async def _beat(self: Any, iid: ChannelId, handle: Any, attempt: int) -> None:
        try:
            beat = await handle.heartbeat.remote()
        except Exception:  # noqa: BLE001 - a dead actor shows up in its run() outcome
            return
        if attempt == self._attempt:
            self._heartbeats[iid] = time.monotonic()
            if isinstance(beat, dict) and "rows_emitted" in beat:
                self._source_emitted[iid] = int(beat["rows_emitted"])

    # ---- checkpoints ----------------------------------------------------------------------
    async def checkpoint(self: Any, timeout_s: float = 120.0) -> dict[str, Any]:
        """Take a checkpoint now (waits for a running rescale to end first)."""
        async with self._rescale_lock:
            return await self._take_checkpoint(timeout_s)  # type: ignore[no-any-return]

    async def savepoint(self: Any, path: str, timeout_s: float = 120.0) -> dict[str, Any]:
        """A checkpoint copied to ``path`` as a self-contained savepoint (never deleted by
        retention); ``rs.start(flow, from_savepoint=path)`` resumes from it."""
        async with self._rescale_lock:
            stats = await self._take_checkpoint(timeout_s, savepoint=True)
        where = await asyncio.to_thread(self.storage.savepoint, stats["checkpoint_id"], path)
        return {**stats, "savepoint": where}

    async def _take_checkpoint(
        self: Any, timeout_s: float, *, savepoint: bool = False
    ) -> dict[str, Any]:
        if self.state != "running":
            msg = (
                f"job {self.flow.name!r} is {self.state}; only a running job can take a checkpoint"
            )
            raise CheckpointError(msg)
        storage = self.storage  # a storage that cannot be written fails here, before the barrier
        t0 = time.monotonic()
        cid = self._next_epoch()
        attempt = self._attempt
        acks = await self.inject(Barrier(cid, "checkpoint", {}), timeout_s)
        if attempt != self._attempt:
            msg = f"checkpoint {cid} was interrupted by a recovery"
            raise CheckpointError(msg)
        aligned_s = time.monotonic() - t0
        await self._persist_ended_sinks(cid)
        acks = list(acks) + self._finished_sink_states()
        commits = self._partition_commits
        marks = commits.add_acks(acks, now_ms()) if commits else {}
        manifest = build_manifest(
            job=self.flow.name,
            checkpoint_id=cid,
            acks=acks,
            finished_sources=[i for i in self.plan.sources if i in self.outcomes],
            steps={n: s.kind for n, s in self.flow.steps.items()},
            parallelism=dict(self.parallelism),
            routing=dict(self.routing),
            num_key_groups=self.flow.key_space.num_key_groups,
            sub_groups=self.flow.key_space.sub_groups,
            savepoint=savepoint,
            finished=self._finished_before(cid),
            retired_sinks=self._retired_sink_states,
            partition_commits=commits.snapshot() if commits else None,
        )
        await asyncio.to_thread(storage.complete, cid, manifest)
        live_sinks = [i for i in self.plan.sinks if i not in self.outcomes]
        # a sink that reached its end before this checkpoint (its branch finished) publishes
        # that end now: the checkpoint records it, so a recovery restores it as finished
        ended = [a["instance"] for a in acks if a.get("final_sink_state")]
        published = await asyncio.gather(
            *(_quietly(self.handles[i].checkpoint_complete.remote(cid)) for i in live_sinks),
            *(
                _quietly(self.handles[i].checkpoint_complete.remote(FINAL_CHECKPOINT))
                for i in ended
            ),
        )
        if commits and all(published):  # every instance's parts of the checkpoint are visible
            await asyncio.to_thread(commits.commit_due, marks, now_ms())
        states = [a["state"] for a in acks if "state" in a]
        stats = {
            "checkpoint_id": cid,
            "at_s": self._now_s(),
            "duration_s": time.monotonic() - t0,
            "aligned_s": aligned_s,
            # the longest any instance held inputs for alignment, and spent on its loop on the
            # checkpoint (snapshot start, sink pre-commit, forwarding the barrier)
            "max_align_s": max((float(a.get("align_s", 0.0)) for a in acks), default=0.0),
            "max_sync_s": max((float(a.get("sync_s", 0.0)) for a in acks), default=0.0),
            # ... of which the longest snapshot start (sync_s less forwarding the barrier, which
            # waits for credit when downstream is slow, as any batch would)
            "max_start_s": max(
                (float(a.get("sync_s", 0.0)) - float(a.get("forward_s", 0.0)) for a in acks),
                default=0.0,
            ),
            "uploaded_bytes": int(sum(s.get("uploaded_bytes", 0) for s in states)),
            "referenced_bytes": int(sum(s.get("referenced_bytes", 0) for s in states)),
            "source_offsets": {
                k: e["source"].get("offset")
                for k, e in manifest["instances"].items()
                if "source" in e
            },
        }
        self.checkpoint_stats.append(stats)
        self._export("checkpoint", stats["duration_s"])
        return stats

    # ---- what driver-side feeders (Spark) ask ----------------------------------------------
    async def feed_status(self: Any) -> dict[str, Any]:
        """Cheap: the job's state, its attempt (recoveries so far) and whether it recovers (it
        checkpoints): a feeder re-sends its input to each new attempt."""
        return {
            "state": self.state,
            "attempt": self._attempt,
            "recovers": self.config.checkpoint_interval_s > 0,
            "error": (self.error or {}).get("error"),
        }

    async def await_checkpoint(self: Any, attempt: int, timeout_s: float) -> dict[str, Any]:
        """Wait for a checkpoint whose barriers were injected after this call to complete (it
        holds every row the sources emitted before the call). ``ok`` False when ``attempt``
        ended (a recovery) or the job ended or the wait timed out; ``state`` says which."""
        after = self._epoch
        deadline = time.monotonic() + timeout_s
        while True:
            done = [c for c in self.checkpoint_stats if c["checkpoint_id"] > after]
            if done:
                return {"ok": True, "checkpoint_id": done[0]["checkpoint_id"]}
            if self._attempt != attempt or self.state != "running" or self._sources_done():
                return {"ok": False, "state": self.state, "attempt": self._attempt}
            if time.monotonic() > deadline:
                return {"ok": False, "state": "timeout", "attempt": self._attempt}
            await asyncio.sleep(0.02)

    def _finished_before(self: Any, cid: int) -> list[tuple[str, int]]:
        """Instances of the current plan that ended without error and without acknowledging
        checkpoint ``cid`` (their inputs all ended before its barrier could reach them)."""
        return [
            iid
            for iid, out in self.outcomes.items()
            if iid in self.specs
            and iid not in self.retired
            and not out.get("error")
            and cid not in out.get("acked", [])
        ]

    async def _persist_ended_sinks(self: Any, cid: int) -> None:
        """Sinks that reached their end keeping it in memory (collect; their branch finished)
        store it in checkpoint ``cid``: from then on their end is durable, and this and every
        later checkpoint hold all their rows (a recovery restarts them too)."""
        ended = [
            iid
            for iid, out in self.outcomes.items()
            if iid in self.plan.sinks and _in_memory(out.get("sink_state"))
        ]
        states = await asyncio.gather(*(self.handles[i].persist_end.remote(cid) for i in ended))
        for iid, state in zip(ended, states, strict=True):
            self.outcomes[iid]["sink_state"] = state

    def _finished_sink_states(self: Any) -> list[dict[str, Any]]:
        """Sinks that already reached their end (one branch of a dataflow ended) keep their
        pre-committed end in every later checkpoint."""
        return [
            {"instance": iid, "sink_state": out["sink_state"], "final_sink_state": True}
            for iid, out in self.outcomes.items()
            if iid in self.plan.sinks and _durable(out.get("sink_state"))
        ]

    def _export(self: Any, event: str, seconds: float) -> None:
        if self.config.metrics_export_s > 0:
            try:
                from raystream.metrics_export import export_job_event

                export_job_event(self.flow.name, event, seconds)
            except Exception as e:  # noqa: BLE001 - metrics never fail the job
                log.debug("metrics export failed: %s", e)

    def checkpoint_summary(self: Any) -> dict[str, Any]:
        last = self.checkpoint_stats[-1] if self.checkpoint_stats else None
        return {
            "completed": len(self.checkpoint_stats),
            "failed": len(self.failed_checkpoints),
            "last": last,
            "recent": self.checkpoint_stats[-20:],
            "last_failure": self.failed_checkpoints[-1] if self.failed_checkpoints else None,
            "storage": _without_credentials(f"{self.storage_spec[0]}/{self.storage_spec[1]}"),
            "restored_from": self.restored_from,
            **(
                {
                    "partition_commits": {
                        "committed": commits.committed,
                        "at_end_of_input": commits.at_end,
                        "errors": commits.errors[-20:],
                    }
                }
                if (commits := getattr(self, "_partition_commits", None))
                else {}
            ),
        }

    def _now_s(self: Any) -> float:
        return time.time() - self.origin_ns / 1e9

    async def _final_commit(self: Any) -> bool:
        """Every instance reached the end of its input: record the sinks' pre-committed ends as
        a final checkpoint (when the job checkpoints), then let them publish. False when the job
        did not finish (a failure here recovered or failed it)."""
        staged = {
            iid: out["sink_state"]
            for iid, out in self.outcomes.items()
            if iid in self.plan.sinks and out.get("sink_state") is not None
        }
        if not staged:  # no checkpoints: every sink published at its end
            await self._commit_partitions_at_end(written=True)
            return True
        commits = self._partition_commits
        try:
            durable = [
                {"instance": i, "sink_state": st} for i, st in staged.items() if _durable(st)
            ]
            if commits:
                commits.add_acks(durable, now_ms())
            if durable and (self.config.checkpoint_interval_s > 0 or self.checkpoint_stats):
                cid = self._next_epoch()
                manifest = build_manifest(
                    job=self.flow.name,
                    checkpoint_id=cid,
                    acks=durable,
                    finished_sources=list(self.plan.sources),
                    steps={n: s.kind for n, s in self.flow.steps.items()},
                    parallelism=dict(self.parallelism),
                    routing=dict(self.routing),
                    num_key_groups=self.flow.key_space.num_key_groups,
                    sub_groups=self.flow.key_space.sub_groups,
                    final=True,
                    retired_sinks=self._retired_sink_states,
                    partition_commits=commits.snapshot() if commits else None,
                )
                await asyncio.to_thread(self.storage.complete, cid, manifest)
            results = await asyncio.gather(
                *(self.handles[i].checkpoint_complete.remote(FINAL_CHECKPOINT) for i in staged)
            )
        except Exception as e:  # noqa: BLE001 - a sink died while publishing: a failure like any
            iid = next(iter(staged))
            cause = {
                "instance": iid,
                "error": f"publishing the output failed: {type(e).__name__}: {e}",
            }
            await self._recover_or_fail(cause)
            return False
        for iid, res in zip(staged, results, strict=True):
            self.outcomes[iid]["result"] = res
        # the final states' folders were added above: what is pending is what is left
        await self._commit_partitions_at_end(written=False)
        return True

    async def _commit_partitions_at_end(self: Any, *, written: bool) -> None:
        """End of input (the maximal watermark): commit every partition folder still pending
        (as Flink's ``endInput``), now that all parts are published; ``written``: also every
        folder the sinks' results name (no checkpoints: nothing went through the committer)."""
        commits = self._partition_commits
        if not commits:
            return
        results = [
            (iid[0], out.get("result"))
            for iid, out in self.outcomes.items()
            if iid in self.plan.sinks and written
        ]
        await asyncio.to_thread(commits.commit_end, written_partitions(results))

    # ---- recovery -----------------------------------------------------------------------
    async def _recover_or_fail(self: Any, cause: dict[str, Any]) -> bool:
        """Recover from ``cause`` if checkpointing is on and the restart strategy allows; else
        fail the job with it. True when a new attempt runs."""
        if self.config.checkpoint_interval_s <= 0:
            await self._fail(cause)
            return False
        while True:
            delay = self.restart.next_delay()
            if delay is None:
                why = self.restart.why_not()
                await self._fail({**cause, "error": f"{cause['error']} (not recovered: {why})"})
                return False
            try:
                await self._recover(cause, delay)
                return True
            except Exception as e:  # noqa: BLE001 - e.g. an instance died while redeploying
                log.warning("job %s: recovery attempt failed: %s", self.flow.name, e)
                cause = {
                    **cause,
                    "error": f"{cause['error']}; then recovery attempt {self._attempt} failed: "
                    f"{type(e).__name__}: {e}",
                }

    async def _fail(self: Any, cause: dict[str, Any]) -> None:
        self.error = cause
        await self._stop_all()  # sinks abort their partial files first
        self.state = "failed"

    async def _recover(self: Any, cause: dict[str, Any], delay_s: float) -> None:
        t0 = time.monotonic()
        self.state = "recovering"
        self._attempt += 1
        log.warning(
            "job %s: instance %s failed (%s); recovering (attempt %d)",
            self.flow.name,
            cause["instance"],
            cause["error"],
            self._attempt,
        )
        phases = _Phases(failed_at=time.time())
        self._failed_nodes = dict(self.nodes)  # where the failed attempt's instances ran
        # instances on a node that is gone answer nothing: not asked (each ask would wait out
        # its timeout), they are listed as unreported
        self._unreachable = await self._unreachable_nodes(set(self.nodes.values()))
        emitted = dict(self._source_emitted)
        emitted.update(await self._source_positions())
        await self._keep_attempt_metrics(cause, self._attempt - 1)
        phases.mark("positions_s")
        old = dict(self.handles)
        for head, (_, actor) in getattr(self, "_kept_actors", {}).items():
            old.setdefault(head, actor)  # kept by a recovery whose redeploy failed before them
        futures = list(self._run_futures.values())
        # the actors kept for the new attempt are reset in place (before the old attempt's
        # state folders go); the others are killed and replaced
        self._kept_actors = await self._reset_kept_actors(old, self._attempt)
        phases.mark("reset_s")
        kept_ids = {i for ids, _ in self._kept_actors.values() for i in ids}
        for iid, h in old.items():
            if iid in kept_ids:
                continue
            try:
                ray.kill(actor_of(h), no_restart=True)
            except Exception:  # noqa: BLE001, S110 - already gone
                pass
        if futures:
            await asyncio.wait(futures, timeout=15)
        phases.mark("kill_s")
        await self._names_free({i: h for i, h in old.items() if i not in kept_ids})
        phases.mark("names_free_s")
        for epoch, done in list(self._barrier_done.items()):  # barriers of the old attempt end
            self._barrier_expected.pop(epoch, None)
            done.set()
        # the restart delay runs from the failure, while the old instances are stopped (as in
        # Flink) and the new ones' processes start; their loops start once it is over
        start_at = t0 + delay_s
        # a rescale or checkpoint of the old attempt fails on the dead actors and lets go first
        async with self._rescale_lock:
            if self.state != "recovering":
                return  # stopped meanwhile
            phases.mark("lock_s")
            await self._restart_from_latest(cause, t0, emitted, phases, start_at)

    async def _restart_from_latest(
        self: Any,
        cause: dict[str, Any],
        t0: float,
        emitted: dict[ChannelId, int],
        phases: _Phases | None = None,
        start_at: float | None = None,
    ) -> None:
        """Redeploy every instance from the latest checkpoint; their loops start at ``start_at``
        (``time.monotonic``; None: at once)."""
        phases = phases or _Phases(failed_at=time.time())
        manifest = await asyncio.to_thread(self.storage.latest)
        old_dir = self.plan_dir
        for name, step in self.plan.steps.items():
            if step.is_keyed:
                shutil.rmtree(Path(old_dir) / name, ignore_errors=True)
        self.outcomes = {}
        self._forget_retired_sinks()  # the restore folds their states into live sink instances
        self._run_futures = {}
        self._run_handles = {}
        self.retired = set()
        self.actor_names = {}  # every instance is redeployed under its usual name
        self._hung = {}
        self._source_emitted = {}
        self._replan(manifest, str(Path(self.state_dir) / f"attempt-{self._attempt}"))
        phases.mark("replan_s")
        await self._deploy(start_at)
        self._kept_actors = {}
        phases.mark("deploy_s")
        if self.state != "recovering":  # stopped while the new attempt was deployed
            await self._stop_all()
            return
        self.state = "running"
        failed_nodes = getattr(self, "_failed_nodes", {})
        # warm standbys and spares that died with a lost node are replaced
        dropped = self._drop_warm_actors_gone(self.deploys[-1]["nodes"])
        replayed = 0
        for iid in self.plan.sources:
            at = (manifest or {}).get("instances", {}).get(f"{iid[0]}/{iid[1]}", {}).get(
                "source"
            ) or {}
            if not at.get("finished"):
                replayed += max(0, emitted.get(iid, 0) - int(at.get("offset", 0)))
        record = {
            "attempt": self._attempt,
            "at_s": self._now_s(),
            "instance": list(cause["instance"]),
            "cause": cause["error"],
            "checkpoint_id": (manifest or {}).get("checkpoint_id"),
            "parallelism": dict(self.parallelism),
            "downtime_s": time.monotonic() - t0,
            "records_replayed": replayed,
            # the node the failed instance ran on, and the nodes of the failed attempt that
            # were gone at the redeploy (their instances now run on the nodes that are left)
            "node": failed_nodes.get(tuple(cause["instance"])),
            "lost_nodes": sorted(
                set(self.deploys[-1].get("unreachable_nodes", ())) & set(failed_nodes.values())
            ),
            "warm_actors_lost": dropped,
            # actors whose processes the new attempt kept (reset in place) and those it started
            "actors_kept": self.deploys[-1].get("actors_kept", []),
            "actors_started": self.deploys[-1].get("actors_started", []),
            "failed_at": phases.failed_at,  # wall clock
            "phases": {**phases.durations, "deploy": _deploy_phases(self.deploys[-1])},
        }
        self.recoveries.append(record)
        self._export("recovery", record["downtime_s"])
        log.warning("job %s: recovered: %s", self.flow.name, record)

    async def _unreachable_nodes(self: Any, among: set[str]) -> set[str]:
        """The nodes of ``among`` whose raylet does not take a connection (lost)."""
        from raystream.placement import cluster_nodes, reachable_nodes

        try:
            nodes = [n for n in await asyncio.to_thread(cluster_nodes) if n.node_id in among]
            _, lost = await asyncio.to_thread(reachable_nodes, nodes)
        except Exception as e:  # noqa: BLE001 - not known: every instance is asked as before
            log.debug("probing the nodes failed: %s", e)
            return set()
        return set(lost)

    def _askable(self: Any, iid: ChannelId) -> bool:
        """Not on a node found lost at this recovery."""
        return self.nodes.get(iid) not in getattr(self, "_unreachable", ())

    async def _keep_attempt_metrics(self: Any, cause: dict[str, Any], attempt: int) -> None:
        """Before a recovery resets or replaces every instance: keep what the failed ``attempt`` did
        (each instance's last metrics: live ones are asked, ended ones gave theirs; one that
        died without answering is listed in ``unreported``)."""
        live, ended = await self._attempt_snapshots(attempt, timeout_s=2.0)
        # the retired instances' metrics: the newest kept (listed), every one in the totals
        retired = [{**m, "attempt": attempt} for m in self._history.kept() if m]
        snaps = [*live, *retired, *ended]
        totals = step_totals([*live, *ended], self._retired_totals)
        self._failed_totals = sum_totals([self._failed_totals, totals])
        self.failed_attempts.append(
            {
                "attempt": attempt,
                "ended_s": self._now_s(),
                "cause": cause["error"],
                "instance": list(cause["instance"]),
                "instances": snaps,
                "unreported": sorted(
                    f"{s}/{i}"
                    for s, i in set(self.handles) - {(m.get("step"), m.get("index")) for m in snaps}
                ),
                "totals": totals,
            }
        )
        self._history = BoundedHistory(RECORDS_KEPT)
        self._retired_totals = {}

    async def _attempt_snapshots(
        self: Any, attempt: int, timeout_s: float
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The metrics of the instances of ``attempt`` (live ones asked, at most ``timeout_s``;
        ended ones from their outcome), each tagged with it: (live, ended). Retired instances
        are not among them (``_history``, ``_retired_totals``)."""
        live = {
            iid: h
            for iid, h in self.handles.items()
            if iid not in self.outcomes and self._askable(iid)
        }
        asked = await asyncio.gather(
            *(asyncio.wait_for(_result(h.metrics.remote()), timeout_s) for h in live.values()),
            return_exceptions=True,
        )
        live_snaps = [{**s, "attempt": attempt} for s in asked if isinstance(s, dict) and s]
        ended = [o.get("metrics", {}) for o in self.outcomes.values()]
        return live_snaps, [{**s, "attempt": attempt} for s in ended if s]

    def attempts_summary(self: Any, current: list[dict[str, Any]]) -> dict[str, Any]:
        """What every attempt did: the failed ones (kept at their recovery; the newest
        RECORDS_KEPT listed) and the running one (``current``: its instances' metrics, added to
        those of its instances retired so far; none while it is being deployed); ``totals`` adds
        up every attempt per step, those no longer listed included (records a recovery replayed
        are counted again, as they were processed again)."""
        if self.state == "recovering":  # the instances at hand belong to the failed attempt
            totals = step_totals([])
        else:
            totals = step_totals(current, self._retired_totals)
        now = {"attempt": self._attempt, "instances": None, "totals": totals}
        attempts = [
            {k: v for k, v in a.items() if k != "instances"} for a in self.failed_attempts
        ] + [{k: v for k, v in now.items() if k != "instances"}]
        return {
            "attempts": attempts,
            "attempts_total": len(self.failed_attempts) + 1,
            "totals": sum_totals([self._failed_totals, totals]),
        }

    async def _source_positions(self: Any) -> dict[ChannelId, int]:
        """Rows each live source emitted, asked right before the restart (what is replayed)."""
        live = [i for i in self.plan.sources if i not in self.outcomes and self._askable(i)]
        beats = await asyncio.gather(
            *(asyncio.wait_for(self.handles[i].heartbeat.remote(), 2.0) for i in live),
            return_exceptions=True,
        )
        return {
            i: int(b["rows_emitted"])
            for i, b in zip(live, beats, strict=True)
            if isinstance(b, dict) and "rows_emitted" in b
        }

    async def _reset_kept_actors(
        self: Any, old: dict[ChannelId, Any], attempt: int
    ) -> dict[ChannelId, tuple[frozenset[ChannelId], Any]]:
        """Choose the actors of the failed attempt a recovery keeps (:mod:`raystream.actor_reuse`)
        and reset each for ``attempt``; returns {head: (its instances, actor)} of those that
        answered their reset within ``RESET_TIMEOUT_S`` (the others are replaced)."""
        from raystream.actor_reuse import choose_kept_actors
        from raystream.runtime.actors import MemberHandle

        groups: dict[ChannelId, set[ChannelId]] = {}
        heads = {_actor_key(h): iid for iid, h in old.items() if not isinstance(h, MemberHandle)}
        for iid, h in old.items():
            head = heads.get(_actor_key(actor_of(h)))
            groups.setdefault(head if head is not None else iid, set()).add(iid)
        old_actors = {head: frozenset(ids) for head, ids in groups.items()}
        # the new plan runs the same chains over the graph as it runs (checked again when it
        # is deployed): an actor with an instance a change retired or left half-added is not kept
        new_actors = {
            head: ids
            for head, ids in old_actors.items()
            if all(i[0] in self.flow.steps and i not in self.retired for i in ids)
        }
        dead = {i for i, out in self.outcomes.items() if out.get("died")} | set(self._hung)
        choice = choose_kept_actors(
            old_actors,
            new_actors,
            dead=dead,
            nodes=self.nodes,
            lost_nodes=getattr(self, "_unreachable", ()),
            neutral=set(getattr(self, "actor_names", {})),
            enabled=self.config.recovery_keeps_actors,
        )
        asked = await asyncio.gather(
            *(
                asyncio.wait_for(_result(old[h].reset.remote(attempt)), RESET_TIMEOUT_S)
                for h in choice.kept
            ),
            return_exceptions=True,
        )
        kept = {}
        for head, answer in zip(choice.kept, asked, strict=True):
            if isinstance(answer, dict):
                kept[head] = (old_actors[head], old[head])
            else:
                log.info("job %s: actor of %s not kept (reset: %r)", self.flow.name, head, answer)
        return kept

    async def _names_free(self: Any, old: dict[ChannelId, Any], timeout_s: float = 15.0) -> None:
        """Wait until the killed instances' actor names can be taken again."""
        from raystream.runtime.actors import NAMESPACE, instance_actor_name

        deadline = time.monotonic() + timeout_s
        for iid in old:
            name = instance_actor_name(self.flow.name, *iid)
            while time.monotonic() < deadline:
                try:
                    ray.get_actor(name, namespace=NAMESPACE)
                except ValueError:
                    break
                await asyncio.sleep(0.05)
            else:
                msg = f"actor {name} did not go away within {timeout_s} s after it was killed"
                raise RaystreamError(msg)

    async def cancel(self: Any) -> dict[str, Any]:
        """Stop at once, without a final checkpoint (what was not committed is dropped)."""
        return await self.stop(checkpoint=False)  # type: ignore[no-any-return]


class _Phases:
    """Durations of a recovery's consecutive steps (seconds, by ``time.monotonic``)."""

    def __init__(self, failed_at: float) -> None:
        self.failed_at = failed_at
        self.durations: dict[str, float] = {}
        self._last = time.monotonic()

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.durations[name] = round(now - self._last, 4)
        self._last = now


RESET_TIMEOUT_S = 5.0  # a kept actor that does not answer its reset this soon is replaced


def _actor_key(actor: Any) -> Any:
    """What identifies a Ray actor across its handles."""
    return getattr(actor, "_actor_id", None) or id(actor)


def _deploy_phases(marks: dict[str, Any]) -> dict[str, float]:
    """A deploy's steps from its wall-clock marks: placement (nodes chosen, actors asked for),
    actors (until every one answered: process, imports, constructor), wiring, loops started."""
    keys = ["deploy_at", "placed_at", "actors_ready_at", "connected_at", "running_at"]
    names = ["placement_s", "actors_s", "wiring_s", "loops_s"]
    steps = zip(names, keys, keys[1:], strict=False)
    out = {n: round(marks[b] - marks[a], 4) for n, a, b in steps}
    out["delay_left_s"] = round(marks.get("delay_left_s", 0.0), 4)  # part of loops_s
    return out


def in_graph(per_step: dict[str, Any], steps: Any) -> dict[str, Any]:
    """The entries of ``per_step`` (parallelism, routing tables) for steps of the graph
    ``steps``; what a recovery redeploys is the graph as it runs, and an entry a change left for
    a step it never added (interrupted) or one it took out would make the plan refuse the
    graph."""
    return {n: v for n, v in per_step.items() if n in steps}


def _without_credentials(uri: str) -> str:
    """``s3://KEY:SECRET@bucket/...`` as ``s3://***@bucket/...`` (status and logs show it)."""
    scheme, sep, rest = uri.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return uri


def _in_memory(state: Any) -> bool:
    return isinstance(state, dict) and bool(state.get("in_memory"))


def _durable(state: Any) -> bool:
    return state is not None and not _in_memory(state)


async def _result(ref: Any) -> Any:
    return await ref


async def _quietly(ref: Any) -> bool:
    """Await ``ref``; False (not raised) if it failed: the actor may already be gone."""
    try:
        await ref
    except Exception:  # noqa: BLE001 - the actor may already be gone
        return False
    return True
