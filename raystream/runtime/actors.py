"""The Ray edge: the only place ``ray.remote`` is applied.

Operator instances and the controller are plain classes; these thin wrappers make them actors.
Every actor takes ``num_cpus=0`` so a 2-core machine can hold a whole dataflow.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray

from raystream.runtime import wire
from raystream.runtime.chain import Chain, ChainSpec
from raystream.runtime.instance import InstanceSpec, OperatorInstance
from raystream.runtime.messages import Barrier, ChannelId
from raystream.runtime.migration import MigrationTask
from raystream.runtime.reset import StaleAttemptError, reset_endpoint

__all__ = [
    "InstanceActor",
    "InstanceEndpoint",
    "MemberHandle",
    "actor_of",
    "NAMESPACE",
    "controller_actor_class",
    "controller_name",
    "instance_actor_name",
    "source_actor_name",
]

log = logging.getLogger(__name__)

NAMESPACE = "raystream"
# an instance serves moved state (serve_state) on a loop and thread of its own: Ray's
# concurrency group of this name, so an old owner answers fetches while it processes records
TRANSFER_GROUP = "transfer"
TRANSFER_CONCURRENCY = 64  # serve calls taken at once (they queue by urgency inside)
# a rescale's heads-up (expect_rescale) runs on a loop and thread of its own, at once, while the
# instance's loop processes a slice of records: that slice ends after the call in progress
CONTROL_GROUP = "control"


def controller_name(job: str) -> str:
    return f"raystream-controller:{job}"


def instance_actor_name(job: str, step: str, index: int) -> str:
    """Instances deployed with the job (and on recovery) are named actors in namespace
    ``raystream``: outside writers (Spark tasks) find sources by name, and a person finds any
    instance in the Ray dashboard or with ``ray.get_actor(name, namespace="raystream")``."""
    return f"raystream:{job}:{step}:{index}"


source_actor_name = instance_actor_name


class InstanceEndpoint:
    """The calls of one operator instance (the actor's, or a chained instance's in it)."""

    def __init__(self, spec: InstanceSpec | None) -> None:
        """``spec=None`` makes a warm standby: process started and imports done; a scale-out
        gives it its spec with :meth:`configure` instead of waiting for a new process."""
        init_at = time.time()
        wire.register()  # slices this actor sends (a router's pieces, hand-overs) as their rows
        with contextlib.suppress(ImportError):  # pandas is optional (the [spark] extra) ...
            import pandas  # noqa: F401 - ... pyarrow's to_numpy imports it lazily: pay that here
        pandas_at = time.time()
        self._instance = OperatorInstance(spec) if spec is not None else None  # type: ignore[assignment]
        self._startup = {
            "init_at": init_at,
            "pandas_s": round(pandas_at - init_at, 4),
            "instance_s": round(time.time() - pandas_at, 4),  # a keyed one opens RocksDB
        }
        self._receivers: dict[ChannelId, Any] = {}
        self._events: list[tuple[str, dict[str, Any]]] = []
        self._controller: Any = None
        self._metrics_task: asyncio.Task[None] | None = None
        self._run_task: asyncio.Task[None] | None = None
        self._run_call: asyncio.Task[Any] | None = None
        # the job attempt this actor serves: pushes stamped with another one are dropped (a
        # sender of an attempt a recovery replaced, see reset)
        self._attempt = spec.attempt if spec is not None else -1
        self._resets = 0
        # serve_state calls running on the transfer group's loop: {task: its loop} (a reset
        # cancels them before it closes the state they read)
        self._serving: dict[asyncio.Task[Any], asyncio.AbstractEventLoop] = {}
        self._serving_lock = threading.Lock()
        gc.freeze()  # what the imports made lives on: full collections need not walk it
        self._startup["init_done_at"] = time.time()

    async def configure(self, spec: InstanceSpec) -> None:
        self._instance = OperatorInstance(spec)
        self._attempt = spec.attempt

    async def reset(self, attempt: int) -> dict[str, Any]:
        """A recovery keeps this actor's process for ``attempt``: fence the old attempt (its
        pushes are dropped from now on), stop the instance (or chain) and its loop, close its
        state, drop its wiring; :meth:`configure` then makes it the new attempt's instance.
        Returns this process's id and node."""
        self._attempt = attempt
        await reset_endpoint(self, attempt)
        gc.collect()  # the old attempt's instances, batches and state handles
        self._resets += 1
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        return {"pid": os.getpid(), "node_id": node}

    def _instances(self) -> list[OperatorInstance]:
        """The operator instances this actor runs (a chain's, head first)."""
        return [self._instance] if self._instance is not None else []

    def _unconfigure(self) -> None:
        self._instance = None  # type: ignore[assignment]

    async def startup(self) -> dict[str, Any]:
        """When this actor's process started and how long its start-up steps took (wall-clock
        marks, see :mod:`raystream.runtime.startup`; ``restore_s``: a recovery's state load)."""
        from raystream.runtime.startup import timeline

        restore_s = getattr(self._instance, "restore_s", None)
        return timeline(runtime_loaded_at=_LOADED_AT, restore_s=restore_s, **self._startup)

    async def connect(self, receivers: dict[ChannelId, Any], controller: Any) -> None:
        self._receivers = receivers
        self._controller = controller
        self._instance.connect(self._send, self._report)

    def _send(self, receiver: ChannelId, payload: tuple[ChannelId, int, Any]) -> Any:
        channel, seq, item = payload
        return asyncio.wrap_future(
            self._receivers[receiver].push.remote(channel, seq, item, self._attempt).future()
        )

    def _report(self, event: str, info: dict[str, Any]) -> None:
        if event == "barrier" and self._controller is not None:
            self._controller.on_barrier.remote(info)
        elif event == "migration_done" and self._controller is not None:
            self._controller.on_migration_done.remote(info)

    async def run(self) -> dict[str, Any]:
        """Run the instance to its end; returns its result or its error (never raises)."""
        exporter = self._start_metrics_export()
        attempt, inst = self._attempt, self._instance
        self._run_call = asyncio.current_task()  # a reset answers this call, see below
        self._run_task = asyncio.ensure_future(self._run_instance())
        try:
            await self._run_task
        except asyncio.CancelledError:
            if self._attempt == attempt:  # not a reset: the call itself was cancelled
                raise
            # reset for a new attempt: this outcome belongs to the old one
            return {"instance": inst.spec.id, "result": None, "error": None, "reset": True}
        finally:
            self._run_task = self._run_call = None
            self._stop_metrics_export(exporter)
        origin = self._error_origin()
        failed = self._chain_instance(origin) if origin is not None else inst
        return {
            "instance": inst.spec.id,
            "result": inst.result,
            "error": failed.error if inst.error is not None else None,
            "error_instance": origin,
            "traceback": failed.error_traceback,
            "context": failed.error_context,
            "metrics": {**inst.snapshot_metrics(), **_where()},
            "acked": sorted(inst.acked),
            "sink_state": inst.final_sink_state,
        }

    async def _run_instance(self) -> None:
        await self._instance.run()

    def _error_origin(self) -> ChannelId | None:
        """The instance an error came from when it is not this one (a chained step's)."""
        return None

    def _chain_instance(self, iid: ChannelId) -> OperatorInstance:
        return self._instance

    async def push(
        self, channel: ChannelId, seq: int, item: Any, attempt: int | None = None
    ) -> None:
        """``attempt``: the sender's (``None``: a direct writer that names none); a push of an
        attempt a recovery replaced is answered and dropped, never processed."""
        if attempt is not None and attempt != self._attempt:
            self._stale_pushes += 1
            if self._stale_pushes == 1 or attempt > self._attempt:
                log.warning(
                    "%s dropped a push of channel %s from attempt %d (it serves attempt %d)%s",
                    self._instance.spec.id if self._instance is not None else "a warm actor",
                    channel,
                    attempt,
                    self._attempt,
                    ": a sender AHEAD of this actor, its channel stops here"
                    if attempt > self._attempt
                    else "",
                )
            return
        await self._instance.push(channel, seq, item)

    _stale_pushes = 0  # pushes of another attempt dropped (see reset)

    async def inject_barrier(self, barrier: Barrier) -> bool:
        return self._instance.inject_barrier(barrier)

    # ---- push ingest (Spark tasks call these on named source actors) ------------------------
    async def ingest(
        self, token: tuple[Any, ...], offset: int, batch: Any, attempt: int | None = None
    ) -> dict[str, int]:
        self._instance.check_attempt(attempt)
        return await self._instance.ingest_buffer().offer(token, offset, batch)

    async def resume_offset(self, token: tuple[Any, ...], attempt: int | None = None) -> int:
        """Where a writer of ``token`` (a retried Spark task) starts: the rows before are taken."""
        self._instance.check_attempt(attempt)
        return self._instance.ingest_buffer().resume_offset(token)

    async def reserve(
        self,
        token: tuple[Any, ...],
        offset: int,
        rows: int,
        version: int,
        pieces: list[Any],
        attempt: int | None = None,
        max_event_ms: int | None = None,
    ) -> dict[str, Any]:
        """A direct writer's reservation (raystream.direct); a new route and an "again" come
        with the receivers' handles (the writer pushes to them)."""
        self._instance.check_attempt(attempt)
        got = await self._instance.reserve(token, offset, rows, version, pieces, max_event_ms)
        if got["status"] == "reroute":
            got["handles"] = [self._receivers.get(tuple(r)) for r in got["receivers"]]
        elif got["status"] == "again":
            got["handles"] = [self._receivers.get(tuple(r)) for r, _, _ in got["pieces"]]
        return got

    async def end_ingest(self, attempt: int | None = None) -> None:
        self._instance.check_attempt(attempt)
        await self._instance.ingest_buffer().end()

    async def wait_ingested(
        self, pieces: list[tuple[tuple[Any, ...], int]], timeout_s: float, attempt: int | None
    ) -> bool:
        """Wait until the rows of ``pieces`` [(token, rows)] went downstream (False: timeout)."""
        self._instance.check_attempt(attempt)
        return await self._instance.ingest_buffer().wait_taken(dict(pieces), timeout_s)

    async def fail_ingest(self, reason: str) -> None:
        await self._instance.ingest_buffer().fail(reason)

    # ---- rescaling ---------------------------------------------------------------------------
    async def add_receivers(self, receivers: dict[ChannelId, Any]) -> None:
        self._receivers.update(receivers)
        await self._instance.add_receivers(list(receivers))

    async def warm(self, receivers: list[ChannelId]) -> None:
        """Open the way to these receivers now, one ping each: the first call from this process
        to a new actor waits for its address and a connection, and records queued behind a
        move's or rescale's first push to it would wait for that too."""
        await asyncio.gather(
            *(self._receivers[r].ping.remote() for r in receivers if r in self._receivers)
        )

    async def add_inputs(self, channels: list[ChannelId]) -> None:
        await self._instance.add_inputs(channels)

    async def prepare_migration(self, task: dict[str, Any], peers: dict[int, Any]) -> None:
        """``task``: epoch, policy, incoming {sub-group: owner}, outgoing [sub-groups], heat."""

        self._peers = peers

        def fetch(owner: int, epoch: int, groups: list[int], max_bytes: int, urgent: bool) -> Any:
            return asyncio.wrap_future(
                peers[owner]
                .serve_state.remote(epoch, groups, max_bytes, urgent, self._attempt)
                .future()
            )

        self._instance.prepare_migration(
            MigrationTask(
                epoch=task["epoch"],
                policy=task["policy"],
                incoming=dict(task["incoming"]),
                outgoing=set(task["outgoing"]),
                heat=dict(task.get("heat", {})),
                owner_ids=dict(task.get("owner_ids", {})),
                by_files=bool(task.get("by_files", False)),
            ),
            fetch,
        )
        # a first call to an actor sets up the connection to it (~0.1 s): done now, before the
        # barrier, not by the first on-demand fetch
        for owner in set(task["incoming"].values()):
            peers[owner].ping.remote()

    @ray.method(concurrency_group=TRANSFER_GROUP)
    async def serve_state(
        self,
        epoch: int,
        groups: list[int],
        max_bytes: int,
        urgent: bool = False,
        attempt: int | None = None,
    ) -> Any:
        """Moved state, served on the transfer group's own loop and thread (see
        :mod:`raystream.runtime.migration`): never behind the instance's record slices.

        A reset (a recovery keeping this actor) cancels the calls in progress (their callers
        get a :class:`StaleAttemptError`) and refuses new ones of the old attempt; a chunk read
        before the reset is never answered after it."""
        task = asyncio.current_task()
        assert task is not None
        with self._serving_lock:  # registered before the check: a reset after it sees this call
            self._serving[task] = asyncio.get_running_loop()
        try:
            self._check_caller(attempt, "serve_state")
            serving, inst = self._attempt, self._instance
            try:
                out = await inst.serve_state(epoch, groups, max_bytes, urgent)
            except asyncio.CancelledError:
                if self._attempt == serving:  # not a reset: the call itself was cancelled
                    raise
                out = None
            if self._attempt != serving or self._instance is not inst:
                msg = (
                    f"serve_state of epoch {epoch} (attempt {serving}) was stopped: this actor "
                    f"was reset for attempt {self._attempt} while it served (the job recovered "
                    "from a checkpoint)"
                )
                raise StaleAttemptError(msg)
            return out
        finally:
            with self._serving_lock:
                self._serving.pop(task, None)

    def _serving_calls(self) -> dict[asyncio.Task[Any], asyncio.AbstractEventLoop]:
        """The serve_state calls in progress, with their loops (see :func:`reset_endpoint`)."""
        with self._serving_lock:
            return dict(self._serving)

    async def migration_done(self, epoch: int) -> dict[str, Any]:
        return await self._instance.migration_done(epoch)

    async def sub_group_load(self) -> Any:
        return self._instance.sub_group_load()

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def expect_rescale(self, hold_s: float) -> None:
        """A rescale of this instance's step starts: its barrier comes soon (see
        :meth:`OperatorInstance.expect_rescale`). Runs on the control group's thread, not
        behind the slice of records in progress: that slice ends after its call in progress."""
        self._instance.expect_rescale(hold_s)

    async def snapshot_state(self, directory: str) -> dict[str, Any]:
        return self._instance.snapshot_state(directory)

    async def restore_state(
        self,
        epoch: int,
        sources: list[tuple[int, str, list[int]]],
        key_groups: list[int],
        state_path: str,
    ) -> dict[str, Any]:
        peers = self._peers

        def read(owner: int, path: str, groups: list[int]) -> Any:
            ref = peers[owner].read_snapshot.remote(path, groups, self._attempt)
            return asyncio.wrap_future(ref.future())

        return await self._instance.restore_state(epoch, sources, key_groups, state_path, read)

    async def read_snapshot(
        self, path: str, key_groups: list[int], attempt: int | None = None
    ) -> Any:
        self._check_caller(attempt, "read_snapshot")
        return self._instance.read_snapshot(path, key_groups)

    # ---- moving a whole instance by its RocksDB files (raystream.runtime.move_files) ---------
    async def copy_files(self, epoch: int) -> dict[str, Any]:
        from raystream.runtime.move_files import copy_files

        return await copy_files(self._instance, epoch)

    async def hand_over_changes(self, epoch: int) -> dict[str, Any]:
        from raystream.runtime.move_files import hand_over_changes

        return await hand_over_changes(self._instance, epoch)

    async def read_moved_file(self, directory: str, name: str, offset: int, size: int) -> bytes:
        from raystream.runtime.move_files import read_piece

        return await asyncio.to_thread(read_piece, directory, name, offset, size)

    async def drop_moved_files(self, directory: str) -> None:
        import shutil

        await asyncio.to_thread(shutil.rmtree, directory, True)

    async def begin_take_over(self, epoch: int, old: Any, same_node: bool) -> dict[str, Any]:
        """New instance of a move, before its barrier: the files of instance ``old`` (a
        handle) in place and open. :meth:`finish_take_over` completes the move after it."""
        from raystream.runtime.move_files import FilesTakeOver

        def call(ref: Any) -> Any:
            return asyncio.wrap_future(ref.future())

        self._take_over = (FilesTakeOver(self._instance, epoch), old)
        return await self._take_over[0].begin(
            same_node,
            lambda: call(old.copy_files.remote(epoch)),
            lambda d, n, o, k: call(old.read_moved_file.remote(d, n, o, k)),
            lambda d: call(old.drop_moved_files.remote(d)),
        )

    async def take_changes(self) -> Any:
        from raystream.runtime.move_files import take_changes

        return take_changes(self._instance)

    async def catch_up(self) -> dict[str, Any]:
        """New instance of a move, before its barrier: the rows changed since the copy."""
        take_over, old = self._take_over
        return await take_over.catch_up(
            lambda: asyncio.wrap_future(old.take_changes.remote().future())
        )

    async def finish_take_over(self, epoch: int) -> dict[str, Any]:
        take_over, old = self._take_over
        ref = old.hand_over_changes.remote(epoch)
        return await take_over.finish(lambda: asyncio.wrap_future(ref.future()))

    # ---- checkpoints -----------------------------------------------------------------------
    async def checkpoint_complete(self, checkpoint_id: int) -> Any:
        """The checkpoint is recorded: a two-phase sink publishes what it pre-committed up to it;
        at the end of input (``FINAL_CHECKPOINT``) it also returns its result."""
        inst = self._instance
        if getattr(inst.writer, "slow_commit", False):  # publishing to a remote store
            await asyncio.to_thread(inst.checkpoints.commit, inst.writer, checkpoint_id)
        else:
            inst.checkpoints.commit(inst.writer, checkpoint_id)
        from raystream.runtime.snapshots import FINAL_CHECKPOINT

        if checkpoint_id == FINAL_CHECKPOINT and inst.writer is not None:
            if not inst.finished_published:  # a finished branch may have published already
                inst.result = inst.writer.close()
                inst.finished_published = True
            return inst.result
        return None

    async def persist_end(self, checkpoint_id: int) -> dict[str, Any]:
        """This sink ended keeping its last rows in memory (collect) while the job runs on: store
        them in checkpoint ``checkpoint_id``; returns its durable end (every blob it committed)."""
        inst = self._instance
        name = f"{inst.step.name}/{inst.spec.index}"
        return await asyncio.to_thread(inst.checkpoints.persist_end, checkpoint_id, name)

    async def heartbeat(self) -> dict[str, int]:
        """Answered by the event loop: an instance whose loop is stuck does not answer."""
        inst = self._instance
        if inst is None:
            return {}
        now = time.monotonic()
        for each in self._instances():  # an input channel stopped by a push that never came
            each.inbox.check_missing_pushes(now)
        return {"records_in": inst.metrics.records_in, "rows_emitted": inst.rows_emitted}

    async def pause(self) -> None:
        self._instance.pause()

    async def resume(self) -> None:
        self._instance.resume()

    async def metrics(self) -> dict[str, Any]:
        return {**self._instance.snapshot_metrics(), **_where()}

    async def stop(self) -> None:
        self._instance.stop()

    async def abort(self) -> None:
        """The job failed or was stopped: leave no half-written sink file behind."""
        self._instance.abort()

    # ---- Ray metrics export (Prometheus / Ray Dashboard), see raystream/metrics_export.py -----
    def _export_metrics(self, exporter: Any, *, up: bool = True) -> None:
        inst = self._instance
        backend = getattr(inst.processor, "backend", None)
        size = backend.size_bytes() if hasattr(backend, "size_bytes") and up else None
        exporter.export(inst.metrics, inst.inbox.depth(), inst.latency, up=up, state_bytes=size)

    def _start_metrics_export(self) -> Any:
        """A background task exporting this instance's counters every ``metrics_export_s``."""
        period_s = float(getattr(self._instance.spec.config, "metrics_export_s", 1.0))
        if period_s <= 0:
            return None
        from raystream.metrics_export import RayMetricsExporter

        spec = self._instance.spec
        exporter = RayMetricsExporter(spec.job, spec.step.name, spec.index)

        async def loop() -> None:
            while True:
                with contextlib.suppress(Exception):  # metrics never stop the dataflow
                    self._export_metrics(exporter)
                await asyncio.sleep(period_s)

        self._metrics_task = asyncio.get_running_loop().create_task(loop())
        return exporter

    def _stop_metrics_export(self, exporter: Any) -> None:
        """The instance ended: stop the task and export the final counts once more."""
        if self._metrics_task is not None:
            self._metrics_task.cancel()
            self._metrics_task = None
        if exporter is not None:
            with contextlib.suppress(Exception):
                self._export_metrics(exporter, up=False)

    def _check_caller(self, attempt: int | None, call: str) -> None:
        """A peer's call of an attempt a recovery replaced is refused (answered at once)."""
        if attempt is not None and attempt != self._attempt:
            msg = (
                f"{call} was sent by an instance of attempt {attempt}, but this actor now "
                f"serves attempt {self._attempt}: the job recovered from a checkpoint in between"
            )
            raise StaleAttemptError(msg)

    async def ping(self) -> str:
        """Alive and imports done; returns the id of the node this actor runs on."""
        await asyncio.sleep(0)
        return ray.get_runtime_context().get_node_id()


class _ChainMember(InstanceEndpoint):
    """A chained instance's calls, answered by the actor of its chain's head."""

    def __init__(self, instance: OperatorInstance, chain: Chain) -> None:  # noqa: D107
        self._instance = instance
        self._chain = chain
        self._receivers = {}
        self._events = []
        self._controller = None
        self._metrics_task = None
        self._run_task = self._run_call = None
        self._attempt = instance.spec.attempt
        self._serving = {}
        self._serving_lock = threading.Lock()

    async def _run_instance(self) -> None:
        await self._chain.done.wait()  # the head's loop drives this instance

    def _error_origin(self) -> ChannelId | None:
        # a member the head's end took down reports the chained instance that failed, so the
        # job's error names that step whichever of the chain's outcomes the controller reads first
        head = self._chain.head
        if head.error is None:
            return None
        return self._chain.origin() or head.spec.id

    def _chain_instance(self, iid: ChannelId) -> OperatorInstance:
        return self._chain.by_id()[iid]


class _InstanceActor(InstanceEndpoint):
    """An operator instance as an async Ray actor, or an operator chain (a ChainSpec): the
    chained instances are reached through :class:`MemberHandle` (``call_member``)."""

    def __init__(self, spec: InstanceSpec | ChainSpec | None, controller: Any = None) -> None:
        """``controller``: a warm standby gets its job's controller handle when it starts: the
        first call that brings that handle into a process waited ~55-90 ms (measured in a
        scale-out's :meth:`connect`; later calls with it ~3-8 ms), on the scale-out's path."""
        chain = Chain(spec) if isinstance(spec, ChainSpec) else None
        super().__init__(None if chain is not None else spec)
        self._chain = chain
        self._controller = controller
        self._members: dict[ChannelId, _ChainMember] = {}
        if chain is not None:
            self._instance = chain.head
            self._members = {m.spec.id: _ChainMember(m, chain) for m in chain.members}
            self._attempt = chain.head.spec.attempt

    async def configure(self, spec: InstanceSpec | ChainSpec) -> None:  # type: ignore[override]
        """A warm standby (or an actor a recovery reset) becomes an instance, or an operator
        chain (a keyed step's scale-out with the steps chained after it)."""
        if isinstance(spec, ChainSpec):
            self._chain = Chain(spec)
            self._instance = self._chain.head
            self._members = {m.spec.id: _ChainMember(m, self._chain) for m in self._chain.members}
            self._attempt = self._chain.head.spec.attempt
        else:
            self._chain = None
            self._members = {}
            await super().configure(spec)

    def _instances(self) -> list[OperatorInstance]:
        if self._chain is not None:
            return list(self._chain.instances)
        return super()._instances()

    def _unconfigure(self) -> None:
        for member in self._members.values():
            member._attempt = self._attempt  # a stale push to a member is dropped too
        super()._unconfigure()
        self._chain = None
        self._members = {}

    async def _run_instance(self) -> None:
        if self._chain is None:
            await self._instance.run()
        else:
            await self._chain.run()

    def _error_origin(self) -> ChannelId | None:
        return self._chain.origin() if self._chain is not None else None

    def _chain_instance(self, iid: ChannelId) -> OperatorInstance:
        return self._chain.by_id()[iid] if self._chain is not None else self._instance

    async def call_member(self, iid: ChannelId, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` of chained instance ``iid`` (what its MemberHandle forwards)."""
        result = getattr(self._members[tuple(iid)], method)(*args, **kwargs)  # type: ignore[index]
        return await result if inspect.isawaitable(result) else result


InstanceActor = ray.remote(
    num_cpus=0,
    max_restarts=0,
    concurrency_groups={TRANSFER_GROUP: TRANSFER_CONCURRENCY, CONTROL_GROUP: 1},
)(_InstanceActor)


class MemberHandle:
    """The handle of a chained instance: ``h.method.remote(...)`` calls ``method`` of that
    instance in the actor of its chain's head (``actor``), so the controller addresses every
    instance alike. Stopping it (:func:`actor_of`) stops the whole chain's actor."""

    def __init__(self, actor: Any, iid: ChannelId) -> None:
        self.actor = actor
        self.iid = iid

    def __getattr__(self, name: str) -> _MemberMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        return _MemberMethod(self.actor, self.iid, name)

    def __repr__(self) -> str:
        return f"MemberHandle({self.iid}, in {self.actor!r})"


@dataclass(frozen=True)
class _MemberMethod:
    actor: Any
    iid: ChannelId
    name: str

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.actor.call_member.remote(self.iid, self.name, *args, **kwargs)


def actor_of(handle: Any) -> Any:
    """The Ray actor behind ``handle`` (a chained instance's: its chain's actor)."""
    return handle.actor if isinstance(handle, MemberHandle) else handle


def _where() -> dict[str, str]:
    """The node this process runs on (for ``raystream status``)."""
    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
    }


_controller_actor: Any = None
_LOADED_AT = time.time()  # this module (and the raystream runtime it imports) is loaded


def controller_actor_class() -> Any:
    """The controller as an actor class (made on first use: controller.py imports this module)."""
    global _controller_actor
    if _controller_actor is None:
        from raystream.controller import Controller

        _controller_actor = ray.remote(num_cpus=0, max_restarts=0)(Controller)
    return _controller_actor
