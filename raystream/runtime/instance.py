"""The body of one operator instance: inbox, processing loop, outputs, barriers. No Ray here.

The actor edge (:mod:`raystream.runtime.actors`) injects how to push to a receiver and how to
report to the controller, so this class runs under plain asyncio in unit tests.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raystream.dataflow import KeySpec, Step
from raystream.direct import DirectSequencer
from raystream.errors import RescaleError, SourceError, context_of
from raystream.history import ACKED_EPOCHS_KEPT, RecentEpochs
from raystream.ingest import IngestBuffer
from raystream.keys import KeySpace, RoutingTable
from raystream.metrics import DEFAULT_RETAIN_S, InstanceMetrics, LatencyRecorder, check_retain_s
from raystream.runtime import snapshots
from raystream.runtime.channels import (
    ByKeyGroup,
    Forward,
    Inbox,
    OutputChannel,
    OvertakingBarrier,
    Rebalance,
    concat_batches,
    overtakes,
)
from raystream.runtime.messages import (
    AfterFences,
    Barrier,
    ChannelId,
    EndOfStream,
    Fence,
    Watermark,
)
from raystream.runtime.migration import MigrationEngine, MigrationTask
from raystream.runtime.outputs import port_of
from raystream.runtime.processors import (
    EVENT_TIME,
    INGEST_TS,
    INPUT_EVENTS,
    KeyedProcessor,
    input_events_of,
    make_processor,
)
from raystream.runtime.slicing import BatchCost
from raystream.runtime.watermarks import (
    WATERMARK_MAX,
    WATERMARK_MIN,
    SourceWatermarks,
    WatermarkTracker,
    event_time_ms,
)
from raystream.sources import RateSchedule

__all__ = ["InstanceSpec", "OutputSpec", "OperatorInstance", "RuntimeConfig"]

SERVE_SLICE_ROWS = 4096  # rows an old owner processes between serving fetches of moved state
SLICE_TARGET_S = 0.1  # a keyed step takes a large batch in slices of about this much work ...
SLICE_MIN_ROWS = 64  # ... of at least this many rows, so a rescale barrier waits one slice at most
SERVE_SLICE_TARGET_S = 0.02  # ... and of this much while it hands out state (fetches wait less)
CALL_TURNS = 4  # event-loop turns between two slices of records of a keyed step
ACK_TURNS = 1  # event-loop turns a receiver gives before it processes a batch it read
SLICE_CALL_TARGET_S = 0.02  # a slice is processed in calls of about this much work ...
SLICE_CALL_MAX_OVERHEAD = 0.05  # ... where the fixed cost per call is at most this share of it
BARRIER_TURNS = 2  # event-loop turns between two calls of a slice: a rescale barrier gets in
TASK_WAIT_S = 60.0  # a rescale barrier waits at most this long for its migration task
WATERMARK_TIMELINE_MAX = 50_000  # points a source keeps of its watermark timeline

Sender = Callable[[ChannelId, tuple[ChannelId, int, Any]], Awaitable[Any]]
Reporter = Callable[[str, dict[str, Any]], Any]


@dataclass(frozen=True)
class RuntimeConfig:
    """Knobs of the data plane."""

    batch_rows: int = 100_000  # a sender ships a batch once it holds this many rows ...
    linger_ms: float = 5.0  # ... or once its oldest row waited this long
    adaptive_batching: bool = True  # ... or at once while no push to that receiver is in flight
    max_inflight: int = 4  # unacknowledged pushes per channel (credits)
    inbox_capacity: int = 4  # queued batches per input channel
    source_batch_rows: int = 100_000  # rows a source reads at once when unthrottled
    migration: str = "meces"  # default migration strategy for rescales
    migration_support: bool = True  # False: no per-sub-group tracking, rescale refused
    standby_instances: int = 2  # warm spare actors per job, so a scale-out starts no process
    standby_delay_s: float = 0.0  # ... started this long after the job starts (0: at once)
    standby_before_sources: bool = False  # True: started with the job's actors, sources after
    change_spares: int = 0  # warm actors under neutral names an insert or a move configures
    change_spare_refill_delay_s: float = 5.0  # ... refilled one by one this long after a change
    state_cache_entries: int = 500_000  # write-back cache in front of RocksDB, per instance (0: off)
    state_cache_bytes: int = 64 << 20  # ... and its bound in bytes of keys and values
    migration_buffer_bytes: int = 64 << 20  # records waiting for moving state, per instance
    heat_half_life_s: float = 10.0  # a sub-group's heat (hot-first order) halves in this time
    metrics_export_s: float = 1.0  # period of the Ray metrics (Prometheus) export; 0: off
    # per-window metrics (throughput, sink latency per 250 ms) kept for this long; the whole
    # run's totals and latency histogram are kept whatever it is (a job may run for days)
    metrics_windows_retained_s: float = DEFAULT_RETAIN_S
    checkpoint_interval_s: float = 0.0  # periodic checkpoints (and recovery from them); 0: off
    checkpoint_dir: str | None = None  # local path or pyarrow.fs URI; None: <tmp>/raystream-checkpoints
    checkpoints_retained: int = 3  # complete checkpoints kept; older ones and their files go
    restart_attempts: int = 3  # recoveries from a checkpoint before the job fails
    restart_delay_s: float = 1.0  # fixed delay before each recovery
    restart_failure_rate: tuple[int, float] | None = None  # at most N failures within S seconds
    heartbeat_timeout_s: float = 60.0  # an instance that answers no heartbeat this long is hung
    # a recovery resets the live actors in place (their processes live on) and starts new
    # ones only for actors that died or were lost; False: every process is replaced (for user
    # code that keeps module-level state it wants fresh)
    recovery_keeps_actors: bool = True
    rescale_timeout_s: float = 120.0  # a migration step not settled by then fails the job
    chaining: bool = True  # forward-connected steps of equal parallelism share one actor

    def __post_init__(self) -> None:
        from raystream.errors import ConfigError

        for name in ("batch_rows", "max_inflight", "inbox_capacity", "source_batch_rows"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                msg = f"{name} must be an int >= 1, got {v!r}"
                raise ConfigError(msg)
        for name in (
            "linger_ms",
            "checkpoint_interval_s",
            "restart_delay_s",
            "standby_delay_s",
            "change_spare_refill_delay_s",
        ):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                msg = f"{name} must be a number >= 0, got {v!r}"
                raise ConfigError(msg)
        check_retain_s(self.metrics_windows_retained_s, "metrics_windows_retained_s")
        if not isinstance(self.chaining, bool):
            msg = f"chaining must be True or False, got {self.chaining!r}"
            raise ConfigError(msg)
        if not isinstance(self.recovery_keeps_actors, bool):
            msg = (
                "recovery_keeps_actors must be True or False, got "
                f"{self.recovery_keeps_actors!r}"
            )
            raise ConfigError(msg)
        if not isinstance(self.adaptive_batching, bool):
            msg = f"adaptive_batching must be True or False, got {self.adaptive_batching!r}"
            raise ConfigError(msg)
        if not isinstance(self.heartbeat_timeout_s, (int, float)) or self.heartbeat_timeout_s <= 0:
            msg = f"heartbeat_timeout_s must be a number > 0, got {self.heartbeat_timeout_s!r}"
            raise ConfigError(msg)
        for name in ("state_cache_bytes", "migration_buffer_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                msg = f"{name} must be a number of bytes >= 1 (an int), got {v!r}"
                raise ConfigError(msg)
        h = self.heat_half_life_s
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not h > 0:
            msg = f"heat_half_life_s must be a number of seconds > 0, got {h!r}"
            raise ConfigError(msg)
        v = self.change_spares
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            msg = f"change_spares must be an int >= 0 (warm actors for changes), got {v!r}"
            raise ConfigError(msg)
        for name in ("checkpoints_retained",):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                msg = f"{name} must be an int >= 1, got {v!r}"
                raise ConfigError(msg)
        if not isinstance(self.restart_attempts, int) or self.restart_attempts < 0:
            msg = f"restart_attempts must be an int >= 0, got {self.restart_attempts!r}"
            raise ConfigError(msg)
        rate = self.restart_failure_rate
        if rate is not None and not (
            isinstance(rate, (tuple, list))
            and len(rate) == 2
            and isinstance(rate[0], int)
            and rate[0] >= 1
            and isinstance(rate[1], (int, float))
            and rate[1] > 0
        ):
            msg = (
                "restart_failure_rate must be (max_failures >= 1, interval_s > 0), e.g. (3, 60.0), "
                f"got {rate!r}"
            )
            raise ConfigError(msg)
        if self.checkpoint_dir is not None and (
            not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir
        ):
            msg = f"checkpoint_dir must be a path or a pyarrow.fs URI (str), got {self.checkpoint_dir!r}"
            raise ConfigError(msg)
        t = self.rescale_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            msg = f"rescale_timeout_s must be a number of seconds > 0, got {t!r}"
            raise ConfigError(msg)


@dataclass(frozen=True)
class OutputSpec:
    """One outgoing edge of an instance: to every instance of ``step``."""

    step: str
    parallelism: int
    partitioning: str  # forward | rebalance | key_group
    key: KeySpec | None = None
    routing: RoutingTable | None = None
    port: str = ""  # which output of the step goes on this edge: '' main, else a side output
    # the receiving instance per routing index when one was moved (empty: (step, i))
    receivers: tuple[ChannelId, ...] = ()

    @property
    def receiver_ids(self) -> tuple[ChannelId, ...]:
        return self.receivers or tuple((self.step, i) for i in range(self.parallelism))


@dataclass(frozen=True)
class InstanceSpec:
    job: str
    step: Step
    index: int
    key_space: KeySpace
    inputs: tuple[ChannelId, ...]
    outputs: tuple[OutputSpec, ...]
    config: RuntimeConfig
    origin_ns: int
    state_path: str | None = None
    owned_key_groups: tuple[int, ...] = ()
    source_parallelism: int = 1
    # recovery: what this instance starts from (see raystream.checkpointing.restore_specs)
    restore: dict[str, Any] | None = None
    storage: tuple[str, str] | None = None  # (checkpoint storage URI, job) when checkpointing
    attempt: int = 0  # the job's attempt (recoveries so far) this instance belongs to
    # sinks: the index its writer opens with (None: its own); a sink that follows a keyed step's
    # rescales takes a new one when it comes back at an index a retired instance had (its files)
    sink_writer: int | None = None

    @property
    def id(self) -> ChannelId:
        return (self.step.name, self.index)


class OperatorInstance:
    """One instance of a step: source, operator or sink."""

    def __init__(self, spec: InstanceSpec) -> None:
        self.spec = spec
        self.step = spec.step
        self.role = spec.step.kind if spec.step.kind in ("source", "sink") else "operator"
        self.inbox = Inbox(spec.config.inbox_capacity)
        for ch in spec.inputs:
            self.inbox.add_channel(ch)
        retain_s = spec.config.metrics_windows_retained_s
        self.metrics = InstanceMetrics(spec.origin_ns, retain_s=retain_s)
        self.latency = (
            LatencyRecorder(spec.origin_ns, retain_s=retain_s) if self.role == "sink" else None
        )
        self.processor: Any = None
        self.writer: Any = None
        self.reader: Any = None
        if self.role == "operator":
            self.processor = make_processor(
                spec.step,
                spec.key_space,
                spec.state_path,
                spec.owned_key_groups,
                track=spec.config.migration_support,
                cache_entries=spec.config.state_cache_entries,
                cache_bytes=spec.config.state_cache_bytes,
                max_pending_bytes=spec.config.migration_buffer_bytes,
                heat_half_life_s=spec.config.heat_half_life_s,
            )
        warm_up = getattr(spec.step.fn, "warm_up", None) if self.role == "source" else None
        if callable(warm_up):  # e.g. the lazy imports of its first read: paid before the run
            warm_up()
        self.outputs: list[tuple[Any, list[OutputChannel]]] = []
        self._pending_barriers: list[Barrier] = []
        self._barrier_injected = asyncio.Event()  # wakes a paced source waiting for its batch
        self._barrier_seen: dict[int, set[ChannelId]] = {}
        self._open_barriers: dict[int, Barrier] = {}
        self._barrier_first: dict[int, float] = {}  # epoch -> when its first input delivered it
        self._holding = False
        self._eos: set[ChannelId] = set()
        self._report: Reporter = lambda event, info: None
        self._sender: Sender | None = None
        self.inputs: set[ChannelId] = set(spec.inputs)
        self.paused = False
        self.finished = False
        self.result: Any = None
        self.final_sink_state: Any = None  # a two-phase sink's pre-committed end of input
        self.finished_published = False  # that end is published (checkpoint_complete)
        self.error: str | None = None
        self.error_traceback: str | None = None
        self.error_context: tuple[str, str] | None = None  # e.g. ("key", "'a'"): see errors.py
        self.rows_emitted = 0  # sources: rows sent so far (offset in their partition)
        self._pace: tuple[RateSchedule | None, float] = (None, 0.0)  # sources: schedule, start
        self._stop = False
        self._source_done = False  # a source restored from a checkpoint it had already finished
        self.checkpoints = snapshots.CheckpointState(spec)
        # epochs of the barriers this instance acknowledged (the newest ACKED_EPOCHS_KEPT)
        self.acked = RecentEpochs(ACKED_EPOCHS_KEPT)
        # event time: per-input watermarks, the last one forwarded, which input a channel is
        self.watermarks = WatermarkTracker(spec.inputs)
        self._wm_sent = WATERMARK_MIN
        # a source's watermarks as sent: (wall-clock ns, watermark ms), for watermark-lag reports
        self.watermark_timeline: list[tuple[int, int]] = []
        self._wm_deferred: int | None = None  # held back while moved sub-groups' records wait
        self._idle_sent = False
        self._input_of = {up: spec.step.input_of(up) for up in spec.step.upstream}
        self._barriers_closed = False  # sources: past the last barrier they will ever emit
        self._outputs_closed = False  # EndOfStream sent (or being sent) on every output
        self._unconnected: set[ChannelId] = set()  # new receivers not routed to yet
        self._removal: str | None = None  # the step was removed: its state "drop" or "emit"
        self._switched_epoch = 0  # the last rescale epoch this instance switched at
        self.batch_cost = BatchCost()  # keyed steps: learnt cost of a batch (slice sizes)
        self._rescale_expected_until = 0.0  # monotonic: small slices, a rescale barrier comes
        self.inbox.on_overtaking = self._overtake_outputs
        # receivers in this process (an operator chain, raystream.runtime.chain): a direct call
        self.local: dict[ChannelId, Any] = {}
        # a new owner's migration task whose AfterFences mark is still to go out (see _emit)
        self._after_fences: MigrationTask | None = None
        self.after_fences_sent = 0  # AfterFences marks sent (one per take-over)
        # push sources whose writers send rows to the keyed step themselves (raystream.direct)
        self.direct: DirectSequencer | None = None
        self._direct_ready = asyncio.Event()  # the source loop started: direct set (or not)
        self._direct_rows = 0  # rows reserved ...
        self._direct_event_max: int | None = None  # ... and their newest event time
        # channels to moved-away instances, still to be acknowledged (see _redirect)
        self._retiring: list[asyncio.Future[None]] = []

    # ---- wiring ---------------------------------------------------------------------------
    def connect(self, sender: Sender, report: Reporter) -> None:
        """Build output channels; ``sender(receiver_id, item)`` pushes one item to a receiver."""

        def acknowledging(event: str, info: dict[str, Any]) -> Any:
            if event == "barrier":
                self.acked.add(int(info["epoch"]))
            return report(event, info)

        self._report = acknowledging
        self._sender = sender
        self.outputs = [self._output(out) for out in self.spec.outputs]
        if isinstance(self.processor, KeyedProcessor):
            self.processor.engine.poke = self.inbox.poke
            # the controller hears of it at once, not when a busy loop answers its call
            engine = self.processor.engine
            engine.on_done = lambda task: self._report(
                "migration_done", {"instance": self.spec.id, **engine.stats()}
            )

    def _overtake_outputs(self, barrier: Barrier) -> None:
        """A rescale barrier is on its way here (or, at a source, injected): until it went out,
        this instance's pushes do not wait for credit, so it is not held behind a backlog
        downstream (bounded: what the instance is sending now, then the barrier)."""
        if barrier.epoch > self._switched_epoch:
            for _, channels in self.outputs:
                for c in channels:
                    c.overtake(True)

    def _output(self, out: OutputSpec) -> tuple[Any, list[OutputChannel]]:
        """The partitioner and the channels of one output."""
        if out.partitioning == "key_group":
            assert out.key is not None and out.routing is not None
            part: Any = ByKeyGroup(out.key, self.spec.key_space, out.routing)
        elif out.partitioning == "forward":
            part = Forward(self.spec.index)
        elif out.partitioning == "local":  # the next step of a chain: one receiver, here
            part = Forward(0)
        else:
            part = Rebalance(out.parallelism, start=self.spec.index)
        return part, [self._channel_to(r) for r in out.receiver_ids]

    async def _rewire(self, barrier: Barrier) -> None:
        """Insert or remove a step: this instance's output to step ``payload["replaces"]`` ends
        here (each channel: what was sent before the barrier, the barrier, EndOfStream), and the
        output ``payload["output"]`` takes its place (the barrier goes to it next)."""
        old_step = barrier.payload["replaces"]
        new: OutputSpec = barrier.payload["output"]
        outputs = list(self.spec.outputs)
        for k, out in enumerate(outputs):
            if out.step != old_step:
                continue
            for c in self.outputs[k][1]:
                await c.flush()
                await c.push(barrier)
                await c.push(EndOfStream())
                await c.drain()
            outputs[k] = replace(new, port=out.port)
            self.outputs[k] = self._output(outputs[k])
            self._unconnected.difference_update(c.receiver for c in self.outputs[k][1])
            if self._wm_sent > WATERMARK_MIN:
                for c in self.outputs[k][1]:
                    await c.push(Watermark(self._wm_sent))
        self.spec = replace(self.spec, outputs=tuple(outputs))

    def _channel_to(self, receiver: ChannelId) -> OutputChannel:
        if receiver in self.local:
            return self.local[receiver]  # type: ignore[no-any-return]
        assert self._sender is not None
        cfg = self.spec.config
        ch = OutputChannel(
            _bind(self._sender, receiver, self.spec.id),
            batch_rows=cfg.batch_rows,
            linger_ms=cfg.linger_ms,
            max_inflight=cfg.max_inflight,
            adaptive=cfg.adaptive_batching,
        )
        ch.receiver = receiver
        return ch

    # ---- rescaling: wiring, serving, driving the engine ---------------------------------------
    @property
    def engine(self) -> MigrationEngine | None:
        return self.processor.engine if isinstance(self.processor, KeyedProcessor) else None

    async def add_receivers(self, receivers: list[ChannelId]) -> None:
        """New downstream instances (a scale-out of a step this one sends to). They get a
        channel when the rescale barrier passes here (:meth:`_apply_rescale`). If this instance
        ends its output before that (its input ended before the barrier came), they still get an
        EndOfStream from it, now or when it ends, so they never wait for it."""
        have = {c.receiver for _, channels in self.outputs for c in channels}
        self._unconnected.update(r for r in receivers if r not in have)
        if self._outputs_closed:
            await self._end_unconnected()

    async def _end_unconnected(self) -> None:
        while self._unconnected:
            channel = self._channel_to(self._unconnected.pop())
            await channel.push(EndOfStream())
            await channel.drain()

    async def add_inputs(self, channels: list[ChannelId], timeout_s: float = 60.0) -> None:
        """New upstream instances (a scale-out of the step before this one). A channel id can
        come back after a scale-in retired it: it starts over at sequence 0, open again, once
        this instance read what the retired instance sent last (its EndOfStream)."""
        deadline = time.monotonic() + timeout_s
        for ch in channels:
            while ch in self.inputs and ch not in self._eos:
                if time.monotonic() > deadline:
                    msg = (
                        f"{self.spec.id} cannot take input {ch} again: the instance that had "
                        f"that id before did not end its output here within {timeout_s:g} s "
                        f"({self.inbox.unread(ch)} items of it unread)"
                    )
                    raise RescaleError(msg)
                await asyncio.sleep(0.005)
        for ch in channels:
            self.inbox.reset_channel(ch)
            self.inputs.add(ch)
            self._eos.discard(ch)
            self.watermarks.add(ch)

    def expect_rescale(self, hold_s: float) -> None:
        """The controller starts a rescale of this step: for the next ``hold_s`` seconds (or
        until the migration task comes: then :meth:`_serving` decides) take slices of
        SERVE_SLICE_TARGET_S, so that the barrier, coming a little later (after the plan and the
        new instances' configuration), waits for a short slice, not a SLICE_TARGET_S one.

        The actor runs this on a thread of its own while a slice is processed (it only sets a
        deadline): the slice in progress then ends after its call in progress
        (:meth:`_process_slice`)."""
        self._rescale_expected_until = time.monotonic() + max(0.0, hold_s)

    def prepare_migration(self, task: MigrationTask, fetcher: Any) -> None:
        engine = self.engine
        assert engine is not None
        engine.fetcher = fetcher
        engine.prepare(task)
        self._rescale_expected_until = 0.0  # the task is here: _serving() takes over
        self._after_fences = task if task.incoming else None

    async def serve_state(
        self, epoch: int, groups: list[int], max_bytes: int, urgent: bool = False
    ) -> tuple[list[int], list[pa.RecordBatch]]:
        engine = self.engine
        assert engine is not None
        await self._task_prepared(epoch)
        return await engine.serve(epoch, groups, max_bytes, urgent)

    async def _task_prepared(self, epoch: int) -> None:
        """The controller sends a rescale's task beside its barrier without waiting for the
        answer: a barrier (or a new owner's fetch) may come first; wait for the task then."""
        engine = self.engine
        assert engine is not None
        deadline = time.monotonic() + TASK_WAIT_S
        while engine.task is None or engine.task.epoch < epoch:
            if time.monotonic() > deadline:
                have = engine.task.epoch if engine.task is not None else None
                msg = (
                    f"{self.spec.id}: the rescale barrier (or a fetch) of epoch {epoch} came, "
                    f"but no migration task of that epoch within {TASK_WAIT_S:g} s (the last "
                    f"one is of epoch {have}); the controller did not reach this instance"
                )
                raise RescaleError(msg)
            await asyncio.sleep(0.001)

    async def migration_done(self, epoch: int) -> dict[str, Any]:
        engine = self.engine
        assert engine is not None
        await self._task_prepared(epoch)
        assert engine.task is not None and engine.task.epoch == epoch
        while not engine.task.done.is_set():
            if engine.error is not None:
                raise engine.error
            await asyncio.sleep(0.005)
        return {"instance": self.spec.id, **engine.stats()}

    def sub_group_load(self) -> np.ndarray:
        """Records per second per global sub-group, recent (decaying; the heat that plans
        hot-first moves)."""
        assert isinstance(self.processor, KeyedProcessor)
        return self.processor.engine.heat.rate()

    def read_snapshot(self, path: str, key_groups: list[int]) -> list[pa.RecordBatch]:
        """Rows of ``key_groups`` from a snapshot this instance took (for a restoring peer)."""
        from raystream.state.rocks import read_snapshot_key_groups

        return read_snapshot_key_groups(path, key_groups)

    def snapshot_state(self, directory: str) -> dict[str, Any]:
        """Stop-and-restart: a snapshot of this instance's whole state."""
        assert isinstance(self.processor, KeyedProcessor)
        path = self.processor.backend.snapshot(Path(directory) / f"{self.spec.index}")
        return {"path": str(path), "key_groups": self.processor.owned_key_groups}

    async def restore_state(
        self,
        epoch: int,
        sources: list[tuple[int, str, list[int]]],
        key_groups: list[int],
        state_path: str,
        read: Callable[[int, str, list[int]], Awaitable[list[pa.RecordBatch]]],
    ) -> dict[str, Any]:
        """Stop-and-restart: a fresh RocksDB holding ``key_groups``. ``sources`` says which
        instance's snapshot holds which of them; ``read`` pulls one key group at a time from that
        instance through Ray (actor to actor, bounded), never through a shared filesystem."""
        proc = self.processor
        assert isinstance(proc, KeyedProcessor)
        fresh = proc.fresh_backend(state_path)
        rows = 0
        nbytes = 0
        for owner, path, groups in sources:
            for kg in groups:
                for chunk in await read(owner, path, [kg]):
                    rows += fresh.import_chunk(chunk)
                    nbytes += chunk.nbytes
        proc.swap_backend(fresh, key_groups)
        engine = proc.engine
        if engine.task is not None and engine.task.epoch == epoch:
            engine.task.rows_in = rows
            engine.task.bytes_in = nbytes
            engine.restored(list(engine.task.incoming))
        self.inbox.poke()
        return {"rows": rows}

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    async def _apply_rescale(self, barrier: Barrier) -> None:
        """Switch: route the rescaled step's records by the barrier's table from now on."""
        step = barrier.payload["step"]
        table: RoutingTable = barrier.payload["table"]
        move = barrier.payload.get("move")  # {"index": i, "to": channel id of the new actor}
        for part, channels in self.outputs:
            if isinstance(part, ByKeyGroup) and channels[0].receiver[0] == step:
                if move is not None:  # what went to index i goes to the new actor from now on
                    await self._redirect(channels, move["index"], tuple(move["to"]), barrier)
                # rows already buffered per channel were split by the old table and go first
                part.table = table
                while len(channels) < table.parallelism:
                    receiver = (step, len(channels))
                    self._unconnected.discard(receiver)
                    channels.append(self._channel_to(receiver))
                    if self._wm_sent > WATERMARK_MIN:  # a new receiver catches up
                        await channels[-1].push(Watermark(self._wm_sent))

    async def _redirect(
        self, channels: list[OutputChannel], index: int, to: ChannelId, barrier: Barrier
    ) -> None:
        """A move: the channel at routing index ``index`` ends (what was sent before ``barrier``,
        the barrier, EndOfStream: its old instance hands its state over and retires); a channel
        to ``to`` takes its place (the barrier goes to it first, with the other channels)."""
        old = channels[index]
        await old.flush()
        await old.push(barrier)
        await old.push(EndOfStream())
        # acknowledged in the background: the old instance's loop is busy at its seal, and
        # waiting for it here held every output of this instance (the new actor's barrier too)
        self._retiring.append(asyncio.ensure_future(old.drain()))
        self._unconnected.discard(to)
        channels[index] = self._channel_to(to)
        if self._wm_sent > WATERMARK_MIN:  # the new instance catches up
            await channels[index].push(Watermark(self._wm_sent))

    # ---- called by senders and the controller --------------------------------------------
    async def push(self, channel: ChannelId, seq: int, item: Any) -> None:
        await self.inbox.put(channel, seq, item)

    def inject_barrier(self, barrier: Barrier) -> bool:
        """Sources: emit ``barrier`` at the next batch boundary. False (barrier not taken) once
        the source has passed the last point where it emits barriers: its input ended."""
        if self._barriers_closed:
            return False
        self._pending_barriers.append(barrier)
        self._barrier_injected.set()
        if overtakes(barrier):
            self._overtake_outputs(barrier)
        return True

    def stop(self) -> None:
        self._stop = True

    def abort(self) -> None:
        self._stop = True
        if self.writer is not None:
            self.writer.abort()
            self.writer = None

    def snapshot_metrics(self) -> dict[str, Any]:
        m = self.metrics
        m.backlog = self.inbox.depth()
        snap = m.snapshot()
        snap.update(
            step=self.step.name,
            index=self.spec.index,
            role=self.role,
            finished=self.finished,
            max_backlog_seen=self.inbox.max_depth_seen,
            max_inflight_seen=max(
                (c.max_inflight_seen for _, chans in self.outputs for c in chans), default=0
            ),
        )
        if self.latency is not None:
            snap["latency"] = self.latency.snapshot()
        if self.engine is not None and self.engine.task is not None:
            snap["migration"] = {
                k: v
                for k, v in self.engine.stats().items()
                if k not in ("fetch_wait_ms", "serve_wait_ms")
            }
        buffer = getattr(self.reader, "buffer", None)
        if isinstance(buffer, IngestBuffer):
            snap["ingest"] = buffer.stats()
            if self.direct is not None:  # rows reserved vs rows carried (rows_accepted)
                snap["ingest"].update(self.direct.stats())
        calls = getattr(self.processor, "async_stats", None)
        if calls is not None and self.step.async_calls is not None:  # an async def step
            snap["async_calls"] = {k: v[0] for k, v in calls.items()}
        if self.inbox.duplicate_pushes:
            snap["duplicate_pushes"] = self.inbox.duplicate_pushes
        if self.inbox.missing_pushes:  # an input channel stopped: an earlier push never came
            snap["missing_pushes"] = list(self.inbox.missing_pushes)
        pace, started = self._pace
        if pace is not None and not self.finished:  # what the autoscaler sees as demand
            t_s = time.monotonic() - started
            snap["target_rate_eps"] = pace.rate_at(t_s)
            snap["lag_rows"] = max(0, int(pace.rows_by(t_s)) - self.rows_emitted)
        snap["backlog_rows"] = self.inbox.backlog_rows()
        inbox = self.inbox
        if inbox.fences_read or inbox.marks_read or self.after_fences_sent:
            # order across moves: fences and AfterFences marks read here, channels of new owners
            # held for old owners' fences (and the longest hold), marks this instance sent
            snap["fences_read"] = inbox.fences_read
            snap["after_fences_read"] = inbox.marks_read
            snap["fence_holds"] = inbox.holds
            snap["fence_hold_ms_max"] = round(inbox.hold_ms_max, 1)
            snap["after_fences_sent"] = self.after_fences_sent
        if self.batch_cost.mean_row_s > 0:
            snap["row_cost_s"] = self.batch_cost.mean_row_s
        snap["inputs"] = len(self.inputs)
        snap["eos"] = len(self._eos)
        snap["barriers_open"] = {e: len(v) for e, v in self._barrier_seen.items()}
        snap["watermark_ms"] = self._wm_sent if self._wm_sent > WATERMARK_MIN else None
        if self.watermark_timeline and self.finished:  # once, in the final metrics
            snap["watermark_timeline"] = [list(p) for p in self.watermark_timeline]
        return snap

    # ---- the loop -------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            if self.spec.restore and self.role == "operator":
                with self.metrics.busy():
                    await asyncio.to_thread(snapshots.restore_keyed, self)
            if self.role == "source":
                await self._run_source()
            else:
                await self._run_receiver()
            self.finished = True
            self._report("finished", {"instance": self.spec.id, "result": self.result})
        except Exception as e:  # noqa: BLE001 - reported to the controller, which fails the job
            self.error = f"{type(e).__name__}: {e}"
            self.error_traceback = traceback.format_exc()
            self.error_context = context_of(e)
            if self.writer is not None:
                self.writer.abort()
            self._report(
                "failed",
                {
                    "instance": self.spec.id,
                    "error": self.error,
                    "exception": e,
                    "traceback": self.error_traceback,
                    "context": self.error_context,
                },
            )

    # ---- push ingest (sources that outside writers, e.g. Spark tasks, fill) ------------------
    def _open_reader(self) -> Any:
        if self.reader is None:
            self.reader = self.step.fn.open(self.spec.index, self.spec.source_parallelism)
            # a recovered push source knows what its checkpoint holds before any writer pushes
            snapshots.restore_pushed(self)
        return self.reader

    def check_attempt(self, attempt: int | None) -> None:
        """A writer that says which attempt of the job it feeds (``None``: any) is refused by the
        instances of another attempt: what it sends belongs to a feed the recovery replaced."""
        if attempt is not None and attempt != self.spec.attempt:
            msg = (
                f"this push was meant for attempt {attempt} of job {self.spec.job!r}, but source "
                f"{self.step.name!r}/{self.spec.index} belongs to attempt {self.spec.attempt}: "
                "the job recovered from a checkpoint in between; the feed re-sends for the new "
                "attempt"
            )
            raise SourceError(msg)

    def ingest_buffer(self) -> IngestBuffer:
        """The buffer a push source reads from (opened on first use: writers may come first)."""
        buffer = getattr(self._open_reader(), "buffer", None) if self.role == "source" else None
        if not isinstance(buffer, IngestBuffer):
            msg = (
                f"step {self.step.name!r} does not take pushed rows: it is a {self.role}"
                f"{' reading ' + self.step.fn.describe() if self.role == 'source' else ''}; "
                "push into a source built with rs.sources.spark / spark_stream / push"
            )
            raise SourceError(msg)
        return buffer

    def _open_direct(self) -> None:
        """Writers may send rows to the keyed step themselves (:mod:`raystream.direct`) when
        this push source has one output, partitioned by key group to remote instances, and
        watermarks need no user function of the rows."""
        buffer = getattr(self.reader, "buffer", None)
        event_time = self.step.event_time
        if (
            isinstance(buffer, IngestBuffer)
            and len(self.outputs) == 1
            and isinstance(self.outputs[0][0], ByKeyGroup)
            and not any(c.receiver in self.local for c in self.outputs[0][1])
            and (event_time is None or event_time.watermark is None)
        ):

            def output() -> tuple[RoutingTable, list[OutputChannel]] | None:
                if len(self.outputs) != 1 or not isinstance(self.outputs[0][0], ByKeyGroup):
                    return None  # a rewire put another step after the source
                part, channels = self.outputs[0]
                return part.table, channels

            self.direct = DirectSequencer(
                buffer,
                self.spec.id,
                output,
                self._on_reserved,
                None if event_time is None else event_time.column,
            )
        self._direct_ready.set()

    def _on_reserved(self, rows: int, max_event_ms: int | None) -> None:
        """Rows a writer reserved (and sends itself) count as this source's output."""
        self.metrics.record_out(rows)
        self.rows_emitted += rows
        self._direct_rows += rows
        self._idle_sent = False
        if max_event_ms is not None:
            self._direct_event_max = max(self._direct_event_max or max_event_ms, max_event_ms)

    async def reserve(
        self,
        token: tuple[Any, ...],
        offset: int,
        rows: int,
        version: int,
        pieces: list[Any],
        max_event_ms: int | None = None,
    ) -> dict[str, Any]:
        """A direct writer's reservation (:meth:`DirectSequencer.reserve`); ``{"status":
        "source"}`` when this source does not take direct pushes (the writer pushes rows)."""
        self.ingest_buffer()
        await self._direct_ready.wait()
        if self.direct is None:
            return {"status": "source"}
        return await self.direct.reserve(token, offset, rows, version, pieces, max_event_ms)

    async def _direct_watermark(self, source_wm: SourceWatermarks, seen: int) -> int:
        """The watermark after the rows writers reserved since ``seen`` rows (their newest
        event time, as the reservations reported it)."""
        if self._direct_rows == seen:
            return seen
        newest = self._direct_event_max
        w = source_wm.after_batch(None, np.array([] if newest is None else [newest], np.int64))  # type: ignore[arg-type]
        if w is not None:
            await self._send_watermark(Watermark(w))
        return self._direct_rows

    async def _read_pushed(self, chunk: int) -> pa.RecordBatch | None:
        """Wait for pushed rows, but never past the next linger deadline or ~20 ms, so barriers
        and partly filled output batches go out while writers are quiet."""
        await self._flush_due()
        deadline = self._next_deadline()
        wait = 0.02 if deadline is None else min(0.02, max(0.0, deadline - time.monotonic()))
        return await self.reader.aread(chunk, wait)  # type: ignore[no-any-return]

    async def _pace_wait(self, wait_s: float) -> bool:
        """A paced source waits ``wait_s`` for its next batch (or its outputs' linger deadline);
        a barrier injected meanwhile ends the wait (True), so it goes out at once, not up to
        ``linger_ms`` later, as a Flink source emits a barrier from its mailbox at once (a
        rescale's barrier waited here for the source's next batch)."""
        if self._pending_barriers:
            return True
        self._barrier_injected.clear()
        try:
            await asyncio.wait_for(self._barrier_injected.wait(), wait_s)
        except TimeoutError:
            return False
        return True

    async def _run_source(self) -> None:
        src = self.step.fn
        cfg = self.spec.config
        self._open_reader()
        pushed = hasattr(self.reader, "aread")
        pace = RateSchedule.of(src, self.spec.source_parallelism)  # None: unthrottled
        rate = pace.rate_at(0.0) if pace is not None else 0.0
        # at a fixed rate a source emits every linger_ms: small batches, low latency
        chunk = (
            cfg.source_batch_rows if rate <= 0 else max(1, int(rate * max(cfg.linger_ms, 1) / 1000))
        )
        if self.spec.restore:
            snapshots.rewind_source(self, self.spec.restore)
        started = time.monotonic()
        started_ns = time.time_ns()
        if pace is not None and self.rows_emitted:  # rewound: the schedule continues from there
            ahead_s = float(pace.time_of_row(self.rows_emitted))
            started -= ahead_s
            started_ns -= int(ahead_s * 1e9)
        self._pace = (pace, started)
        warm = rate <= 0
        event_time = self.step.event_time
        source_wm = SourceWatermarks(event_time) if event_time is not None else None
        if pushed:
            self._open_direct()
        direct_seen = 0
        while not self._stop and not self._source_done:
            await self._emit_pending_barriers()
            if source_wm is not None and self.direct is not None:
                direct_seen = await self._direct_watermark(source_wm, direct_seen)
            if source_wm is not None and source_wm.check_idle():
                await self._send_watermark(Watermark(self._wm_sent, idle=True))
            if self.paused:
                await asyncio.sleep(0.001)
                continue
            if pace is not None:
                # the rate may step (rate_schedule): batches follow the current rate
                now_rate = pace.rate_at(time.monotonic() - started)
                chunk = max(1, int(now_rate * max(cfg.linger_ms, 1) / 1000))
                due = started + float(pace.time_of_row(self.rows_emitted + chunk))
                wait = due - time.monotonic()
                if wait > 0:
                    deadline = self._next_deadline()
                    if deadline is not None and deadline < due:
                        if not await self._pace_wait(max(0.0, deadline - time.monotonic())):
                            await self._flush_due()
                        continue
                    if await self._pace_wait(wait):
                        continue  # a barrier came: it goes out now, the batch when due
            batch = await self._read_pushed(chunk) if pushed else self.reader.read(chunk)
            if batch is None:
                break
            if batch.num_rows == 0:  # nothing yet (a reader that polls): calls and peers go on
                await self._flush_due()
                await asyncio.sleep(0.001)
                continue
            with self.metrics.busy():
                if pace is not None:
                    # open loop: a record's ingest time is when the schedule says it arrives, so
                    # a stalled pipeline (or paused source) shows up as latency
                    rows = self.rows_emitted + np.arange(batch.num_rows)
                    ingest = started_ns + (pace.time_of_row(rows) * 1e9).astype(np.int64)
                else:
                    ingest = np.full(batch.num_rows, time.time_ns(), np.int64)
                event_ms = None if event_time is None else event_time_ms(batch, event_time.column)
                batch = _stamp(batch, ingest, event_ms)
                await self._emit([batch])
                if source_wm is not None:
                    w = source_wm.after_batch(batch, event_ms)  # type: ignore[arg-type]
                    if w is not None:
                        await self._send_watermark(Watermark(w))
            self.rows_emitted += batch.num_rows
            await self._flush_due()
            if not warm:
                # the schedule starts once the pipeline took its first batch (actors warm), so a
                # slow start is not replayed as a burst at a multiple of the rate
                for _, channels in self.outputs:
                    for c in channels:
                        await c.drain()
                warm = True
                ahead_s = float(pace.time_of_row(self.rows_emitted))  # type: ignore[union-attr]
                started = time.monotonic() - ahead_s
                started_ns = time.time_ns() - int(ahead_s * 1e9)
                self._pace = (pace, started)
            await asyncio.sleep(0)
        await self._emit_pending_barriers()
        self._barriers_closed = True  # no await since the last look at _pending_barriers
        self.reader.close()
        await self._finish_outputs()

    async def _emit_pending_barriers(self) -> None:
        while self._pending_barriers:
            barrier = self._pending_barriers.pop(0)
            direct = self.direct
            if direct is None:
                await self._emit_barrier(barrier)
                continue
            # no direct writer gets a sequence number while the barrier goes out
            direct.hold(reroute=barrier.kind in ("rescale", "rewire"))
            try:
                await self._emit_barrier(barrier)
            finally:
                direct.release()

    async def _emit_barrier(self, barrier: Barrier) -> None:
        if barrier.kind == "rescale":
            await self._switch(barrier)
        else:
            if barrier.kind == "rewire" and barrier.payload["step"] == self.step.name:
                await self._rewire(barrier)
            await self._forward_barrier(barrier)
        info = {
            "instance": self.spec.id,
            "epoch": barrier.epoch,
            "kind": barrier.kind,
            "source_offset": self.rows_emitted,
        }
        if barrier.kind == "checkpoint":
            info.update(snapshots.source_state(self))
        self._report("barrier", info)

    async def _open_receiver(self) -> None:
        if self.role == "sink":
            w = self.spec.index if self.spec.sink_writer is None else self.spec.sink_writer
            self.writer = self.step.fn.open(w, max(self.step.parallelism or 1, w + 1))
            await snapshots.restore_sink(self)

    async def _run_receiver(self) -> None:
        await self._open_receiver()
        engine = self.engine
        while not self._stop:
            if engine is not None:
                await self._run_released(engine)
            if self.inbox.incoming_overtaking:  # a rescale barrier is coming in: let it
                await self.inbox.let_overtaking_in()
            deadline = self._next_deadline()
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            got = await self.inbox.get(timeout)
            if got is not None:
                channel, item = got
                if isinstance(item, pa.RecordBatch):
                    await _let_acks_out()
                    self.watermarks.on_records(channel)
                    if self.spec.config.adaptive_batching:  # batches queued up: one larger
                        more = self.inbox.take_batches(
                            channel, self.spec.config.batch_rows - item.num_rows
                        )
                        item = concat_batches([item, *more]) if more else item
                    await self._on_batch(item, channel)
                elif isinstance(item, OvertakingBarrier):
                    await self._on_overtaking(channel, item)
                elif isinstance(item, Barrier):
                    await self._on_barrier(channel, item)
                elif isinstance(item, Watermark) and channel in self.inputs:
                    # (a forward sender's other channels carry no rows: their marks are noise)
                    w = self.watermarks.on_watermark(channel, item.timestamp_ms, item.idle)
                    await self._advance_watermark(w)
                elif isinstance(item, EndOfStream):
                    self._eos.add(channel)
                    w = self.watermarks.on_end(channel)
                    await self._complete_barriers()
                    if self._eos >= self.inputs:
                        break
                    await self._advance_watermark(w)
            await self._fire_processing_timers()
            await self._flush_due()
            await asyncio.sleep(0)
        await self._close_receiver()

    async def _close_receiver(self) -> None:
        """End of input: settle a migration, fire every timer, end the outputs, close."""
        engine = self.engine
        if engine is not None:
            await self._settle(engine)
        if isinstance(self.processor, KeyedProcessor) and self._removal != "drop":
            with self.metrics.busy():  # end of input: every timer fires
                await self._emit(self.processor.on_watermark(WATERMARK_MAX))
                if self._removal == "emit":  # removed: each key's final state goes on
                    await self._emit(await asyncio.to_thread(self.processor.final_state))
        await snapshots.gather_pending(self.checkpoints)  # a checkpoint's upload is part of it
        await self._finish_outputs()
        if self.processor is not None:
            if self._removal and isinstance(self.processor, KeyedProcessor):
                self.processor.backend.destroy()  # the step is gone: so is its state
            else:
                self.processor.close()
        if self.writer is not None:
            if self.checkpoints.two_phase(self.writer) and self.checkpoints.active:
                # end of input is a final checkpoint: published once the controller recorded it
                self.final_sink_state = self.checkpoints.end_of_input(self.writer)
            else:
                self.result = self.writer.close()

    async def _run_released(self, engine: MigrationEngine) -> None:
        """Process buffered records whose state arrived; hold post-barrier inputs while too many
        bytes of records wait (channels that have not delivered the barrier keep flowing: no
        deadlock). Once the barrier came on every input (sealed), every input is post-barrier:
        the bound holds until the move is done."""
        if engine.error is not None:
            raise engine.error
        if engine.handed_in_rows:  # records another instance handed over: input of this one
            self.metrics.record_in(engine.handed_in_rows)
            engine.handed_in_rows = 0
        released = engine.take_released()
        if released:
            first = _first_release(engine.task, released)
            with self.metrics.busy():
                queue = collections.deque(released)
                while queue:
                    piece = queue.popleft()
                    if first is not None:
                        first.first_release_rows += piece.num_rows
                    # in slices: a backlog handed over with the state can be seconds of work,
                    # and calls (pushes, fetches, the controller's) are answered in between
                    start = 0
                    while start < piece.num_rows:
                        n = self._slice_rows()
                        part = piece.slice(start, n)
                        t0 = time.perf_counter()
                        outs = self.processor.process(part, count=False)
                        self._learn_cost(time.perf_counter() - t0, part.num_rows)
                        await self._emit(outs)
                        start += n
                        await _let_calls_in()
                        # sub-groups whose state arrived meanwhile queue up behind (each one's
                        # records in order, all before any new input): their records no longer
                        # wait for their state, and the move is done without waiting for the
                        # records released before them to run
                        queue.extend(engine.take_released())
                if self._wm_sent > WATERMARK_MIN:  # due timers of arrived sub-groups
                    await self._emit(self.processor.on_watermark(self._wm_sent))
            if first is not None:
                first.first_drained_wall = time.time()
        if self._wm_deferred is not None and not engine.holds_watermark:
            w, self._wm_deferred = self._wm_deferred, None
            await self._on_watermark(w)
        task = engine.task
        if task is not None and engine.migrating and engine.over_limit:
            past = self.inputs if task.sealed.is_set() else self._barrier_seen.get(task.epoch, ())
            for ch in past:
                self.inbox.block(ch)
            self._holding = True
        elif self._holding:
            self.inbox.unblock_all()
            self._holding = False

    async def _settle(self, engine: MigrationEngine) -> None:
        """Before finishing: wait until every incoming sub-group arrived and its records ran, and
        every outgoing one was handed out."""
        while engine.task is not None and engine.task.active and not engine.task.done.is_set():
            await self._run_released(engine)
            await asyncio.sleep(0.002)
        await self._run_released(engine)

    async def _on_batch(self, batch: pa.RecordBatch, channel: ChannelId = ("", 0)) -> None:
        m = self.metrics
        keyed = isinstance(self.processor, KeyedProcessor)
        kw = {"input": self._input_of.get(channel[0], 0)} if keyed else {}
        if self.role == "sink":
            with m.busy():
                now = time.time_ns()
                names = batch.schema.names
                weights = None
                if INPUT_EVENTS in names:  # latency counts once per input event of a row
                    weights = input_events_of(batch)
                    batch = batch.drop_columns([INPUT_EVENTS])
                if self.latency is not None and INGEST_TS in names:
                    ingest = batch.column(INGEST_TS).to_numpy(zero_copy_only=False)
                    self.latency.record(ingest, now, weights)
                self.writer.write(batch)
                m.record_in(batch.num_rows, now)
        elif keyed and batch.num_rows > min(self._slice_rows(), self._call_rows()):
            # a large batch in slices (processed as smaller batches would be; order kept):
            # fetches of moved state are served in between, and a rescale barrier that
            # arrives meanwhile overtakes the rest (put back in front of the queue). Busy time
            # is counted per call, with the call's records, so a rate of records per busy
            # second (the autoscaler's true rate) never sees records without their time.
            start = 0
            while start < batch.num_rows:
                if (self.inbox.overtaking or self.inbox.incoming_overtaking) and start:
                    self.inbox.put_back(channel, [batch.slice(start)])
                    return
                self._give_way()
                start += await self._process_slice(batch, start, kw)
                await _let_calls_in()
        else:
            if keyed:
                self._give_way()
            with m.busy():
                t0 = time.perf_counter()
                outs = self.processor.process(batch, **kw)
                if inspect.isawaitable(outs):  # an async def stateless function's calls
                    outs = await outs
                if keyed:
                    self._learn_cost(time.perf_counter() - t0, batch.num_rows)
                m.record_in(batch.num_rows)
                await self._emit(outs)

    async def _process_slice(self, batch: pa.RecordBatch, start: int, kw: dict[str, Any]) -> int:
        """Process one slice of ``batch`` from row ``start``; returns its rows. A slice is
        :meth:`_slice_rows` of work, processed in calls of :meth:`_call_rows`. After each call
        the slice ends early when it is no longer due: a control call that ran meanwhile in
        another thread made the slice smaller (:meth:`expect_rescale`), or, after a few turns of
        the event loop, a rescale barrier was pushed. So that barrier waits for one call, not for
        the whole slice. The slice's output goes out once, at its end, as one call's would."""
        m = self.metrics
        outs: list[pa.RecordBatch] = []
        pos = start
        while pos < batch.num_rows:
            n = min(self._call_rows(), self._slice_rows() - (pos - start))
            if n <= 0:  # the slice is done (or became smaller meanwhile)
                break
            if pos > start:  # between two calls: a rescale barrier pushed meanwhile ends it
                for _ in range(BARRIER_TURNS):
                    await asyncio.sleep(0)
                if self.inbox.overtaking or self.inbox.incoming_overtaking:
                    break
                n = min(self._call_rows(), self._slice_rows() - (pos - start))
                if n <= 0:
                    break
            piece = batch.slice(pos, n)
            with m.busy():
                t0 = time.perf_counter()
                outs.extend(self.processor.process(piece, **kw))
                self._learn_cost(time.perf_counter() - t0, piece.num_rows)
                m.record_in(piece.num_rows)
            pos += piece.num_rows
        with m.busy():
            await self._emit(outs)
        return pos - start

    def _call_rows(self) -> int:
        """Rows of one processor call inside a slice (see :meth:`BatchCost.call_rows`)."""
        return self.batch_cost.call_rows(
            SLICE_CALL_TARGET_S, SLICE_CALL_MAX_OVERHEAD, SLICE_MIN_ROWS
        )

    def _slice_rows(self) -> int:
        """Rows of a slice: about SLICE_TARGET_S of work at the learnt cost (SERVE_SLICE_ROWS
        while unmeasured); while serving moved state, SERVE_SLICE_TARGET_S and at most
        SERVE_SLICE_ROWS (each round trip of a new owner's fetch waits for one slice), and so
        while a rescale barrier is expected (:meth:`expect_rescale`)."""
        if self._serving() or time.monotonic() < self._rescale_expected_until:
            rows = self.batch_cost.slice_rows(
                SERVE_SLICE_TARGET_S, SLICE_MIN_ROWS, SERVE_SLICE_ROWS
            )
            return min(rows, SERVE_SLICE_ROWS)
        return self.batch_cost.slice_rows(SLICE_TARGET_S, SLICE_MIN_ROWS, SERVE_SLICE_ROWS)

    def _learn_cost(self, elapsed_s: float, rows: int) -> None:
        self.batch_cost.learn(elapsed_s, rows)

    def _give_way(self) -> None:
        """An old owner whose moved state another thread serves lets it go first (briefly)."""
        if self._serving():
            self.engine.give_way()  # type: ignore[union-attr]

    def _serving(self) -> bool:
        """Sub-groups of this instance are still to be handed out, or still to come in, in a
        running migration (a fetch's round trip waits for a slice at either end)."""
        engine = self.engine
        task = engine.task if engine is not None else None
        if task is None:
            return False
        return bool(task.outgoing) or (task.active and len(task.arrived) < len(task.incoming))

    async def _on_overtaking(self, channel: ChannelId, item: OvertakingBarrier) -> None:
        """A rescale barrier that overtook ``item.pre_barrier`` (batches sent before it on
        ``channel``, not read yet). The old owner of the step being rescaled holds back their
        records of outgoing sub-groups (handed out with their state, so those can be sealed
        without processing the backlog first); the rest goes back in front of the queue and is
        processed in order, after the switch."""
        barrier = item.barrier
        engine = self.engine
        if engine is not None and barrier.payload.get("step") == self.step.name:
            await self._task_prepared(barrier.epoch)
        pre = item.pre_barrier
        if (
            pre
            and isinstance(self.processor, KeyedProcessor)
            and engine is not None
            and engine.task is not None
            and engine.task.epoch == barrier.epoch
            and barrier.payload["step"] == self.step.name
            and engine.task.outgoing
        ):
            kw = {"input": self._input_of.get(channel[0], 0)}
            stay = []
            for batch in pre:
                # held-back rows count as input at the new owner, which applies them
                rest = self.processor.hold_back(batch, **kw)
                if rest is not None:
                    stay.append(rest)
            pre = stay
        self.inbox.put_back(channel, pre)
        await self._on_barrier(channel, barrier)

    async def _on_barrier(self, channel: ChannelId, barrier: Barrier) -> None:
        """Count a barrier per input channel. Checkpoint barriers (and rescale barriers of a
        stop-and-restart, ``payload["aligned"]``) hold each channel that delivered them until all
        have; other rescale barriers never block: they switch on their first arrival."""
        if (
            barrier.kind == "rescale"
            and self.engine is not None
            and barrier.payload.get("step") == self.step.name
        ):
            await self._task_prepared(barrier.epoch)
        seen = self._barrier_seen.setdefault(barrier.epoch, set())
        first = not seen
        if first:
            self._barrier_first[barrier.epoch] = time.monotonic()
        seen.add(channel)
        self._open_barriers[barrier.epoch] = barrier
        aligned = barrier.kind == "checkpoint" or barrier.payload.get("aligned", False)
        if aligned:
            self.inbox.block(channel)
        elif first and barrier.kind == "rescale":
            await self._switch(barrier)
            engine = self.engine
            if barrier.payload["step"] == self.step.name and engine is not None:
                engine.activate(barrier.epoch)
        await self._complete_barriers()

    async def _complete_barriers(self) -> None:
        """Finish every barrier seen on all live inputs. Called on each barrier and on each
        EndOfStream (a channel that ended no longer owes a barrier)."""
        live = self.inputs - self._eos
        for epoch in sorted(self._open_barriers):
            barrier = self._open_barriers[epoch]
            if not self._barrier_seen.get(epoch, set()) >= live:
                continue
            del self._open_barriers[epoch]
            self._barrier_seen.pop(epoch, None)
            info: dict[str, Any] = {"instance": self.spec.id, "epoch": epoch, "kind": barrier.kind}
            engine = self.engine
            mine = barrier.kind == "rescale" and barrier.payload["step"] == self.step.name
            first_seen = self._barrier_first.pop(epoch, None)
            if barrier.kind == "checkpoint":
                # as Flink: the barrier goes on first (downstream aligns meanwhile), then the
                # snapshot starts (no record after the barrier ran yet: its writes, flush and
                # upload run in threads while records flow); the acknowledgement follows when
                # durable
                t0 = time.monotonic()
                info["align_s"] = t0 - first_seen if first_seen is not None else 0.0
                await self._forward_barrier(barrier)  # may wait for credit (backpressure)
                info["forward_s"] = time.monotonic() - t0
                upload = self.checkpoints.take(self, barrier, info)
                self.inbox.unblock_all()
                info["sync_s"] = time.monotonic() - t0
                if upload is not None:
                    self.checkpoints.finish_later(upload, info, self._report)
                    continue
            elif barrier.kind == "replace":  # aligned: every input delivered it
                if barrier.payload["step"] == self.step.name:
                    info["migrated_rows"] = await self._apply_replace(barrier)
                await self._forward_barrier(barrier)
                self.inbox.unblock_all()
            elif barrier.kind == "rewire":  # aligned: every input delivered it
                if barrier.payload["step"] == self.step.name:
                    await self._rewire(barrier)
                if barrier.payload.get("removes") == self.step.name:  # ends after this barrier
                    self._removal = barrier.payload.get("state") or "drop"
                await self._forward_barrier(barrier)
                self.inbox.unblock_all()
            elif barrier.payload.get("aligned"):
                await self._switch(barrier)
                if mine and engine is not None:
                    engine.activate(epoch)
                self.inbox.unblock_all()
            if mine and engine is not None:
                task = engine.task
                hands_out = task is not None and task.epoch == epoch and bool(task.outgoing)
                fence_ms = await self._fence_outputs(epoch) if hands_out else None
                engine.seal(epoch, fence_ms=fence_ms)
            self._report("barrier", info)

    async def _apply_replace(self, barrier: Barrier) -> int:
        """Replace barrier aligned here: every record before it went through the old function;
        the new one (and its state form) takes every record after it."""
        step = barrier.payload["new_step"]
        migrations = barrier.payload.get("migrations") or {}
        rows = 0
        if isinstance(self.processor, KeyedProcessor):
            with self.metrics.busy():
                rows = await asyncio.to_thread(self.processor.replace_step, step, migrations)
        elif self.processor is not None:
            self.processor.step = step
        self.step = step
        self.spec = replace(self.spec, step=step)
        return rows

    async def _switch(self, barrier: Barrier) -> None:
        """Send what was routed by the old table, forward the barrier everywhere, route by the new
        table from now on, and close channels to instances the new table retires."""
        await self._apply_rescale(barrier)
        await self._forward_barrier(barrier)
        self._switched_epoch = max(self._switched_epoch, barrier.epoch)
        for _, channels in self.outputs:
            for c in channels:
                c.overtake(False)
        table: RoutingTable = barrier.payload["table"]
        if barrier.payload.get("final"):
            for part, channels in self.outputs:
                if (
                    isinstance(part, ByKeyGroup)
                    and channels[0].receiver[0] == barrier.payload["step"]
                ):
                    for c in channels[table.parallelism :]:
                        await c.push(EndOfStream())
                        await c.drain()
                    del channels[table.parallelism :]

    async def _fence_outputs(self, epoch: int) -> float:
        """An old owner seals at ``epoch``: a :class:`Fence` on every output, after the rows
        before it. It does not wait for downstream to read them: a receiver also fed by a new
        owner holds what the new owner sends after its AfterFences mark until it has read this
        fence (:class:`raystream.runtime.channels.Inbox`). Returns the milliseconds it took."""
        t0 = time.monotonic()
        for _, channels in self.outputs:
            for c in channels:
                await c.mark(Fence(epoch))
        return (time.monotonic() - t0) * 1000

    async def _mark_after_fences(self, task: MigrationTask) -> None:
        """A new owner, before its first output made from state it took over (the first
        sub-group arrived; with sub-groups of its own to hand out in the same step, once it
        sealed too, so its own fence goes before this mark: receivers never wait in a circle):
        an :class:`AfterFences` naming the old owners on every output."""
        if not task.arrived or (task.hands_out and not task.sealed.is_set()):
            return
        self._after_fences = None
        senders = tuple(sorted({task.owner_ids.get(o, o) for o in task.incoming.values()}))
        mark = AfterFences(task.epoch, senders)
        self.after_fences_sent += 1
        for _, channels in self.outputs:
            for c in channels:
                await c.mark(mark)

    async def _forward_barrier(self, barrier: Barrier) -> None:
        for _, channels in self.outputs:
            for c in channels:
                await c.flush()
                await c.push(barrier)

    async def _emit(self, batches: list[pa.RecordBatch]) -> None:
        if self._after_fences is not None:
            await self._mark_after_fences(self._after_fences)
        for b in batches:
            if b.num_rows == 0:
                continue
            self._idle_sent = False  # rows make this sender active again downstream
            self.metrics.record_out(b.num_rows)
            port, b = port_of(b)
            for (part, channels), out in zip(self.outputs, self.spec.outputs, strict=True):
                if out.port != port:
                    continue
                for receiver, piece in part.split(b):
                    await channels[receiver].add(piece)

    def _next_deadline(self) -> float | None:
        deadlines = [
            c.deadline for _, chans in self.outputs for c in chans if c.deadline is not None
        ]
        if isinstance(self.processor, KeyedProcessor):
            due_ms = self.processor.next_processing_ms()
            if due_ms is not None:  # wall-clock ms -> monotonic s
                deadlines.append(time.monotonic() + (due_ms - time.time() * 1000) / 1000)
        return min(deadlines) if deadlines else None

    # ---- event time -----------------------------------------------------------------------
    async def _advance_watermark(self, watermark: int | None) -> None:
        """A watermark never overtakes records: while records of sub-groups still on their way
        (a rescale) wait here, the instance keeps its watermark and applies the newest one once
        they ran (else they would count as late, and their windows fire without them)."""
        engine = self.engine
        if watermark is not None and engine is not None and engine.holds_watermark:
            self._wm_deferred = max(self._wm_deferred or watermark, watermark)
            return
        await self._on_watermark(watermark)

    async def _on_watermark(self, watermark: int | None) -> None:
        """This instance's watermark advanced (or not: None): fire due timers, forward it; once
        every input is idle, tell the receivers this instance is idle too."""
        if watermark is not None:
            if isinstance(self.processor, KeyedProcessor):
                with self.metrics.busy():
                    await self._emit(self.processor.on_watermark(watermark))
            await self._send_watermark(Watermark(watermark))
        if self.watermarks.all_idle:
            await self._send_watermark(Watermark(self._wm_sent, idle=True))

    def _record_watermark(self, watermark_ms: int) -> None:
        """Keep (now, watermark) of a source; past the cap, every other point is dropped (the
        timeline keeps its span at half the resolution)."""
        timeline = self.watermark_timeline
        if len(timeline) >= WATERMARK_TIMELINE_MAX:
            del timeline[1:-1:2]
        timeline.append((time.time_ns(), watermark_ms))

    async def _send_watermark(self, wm: Watermark) -> None:
        """Forward on every output, after the rows before it; never backwards."""
        if wm.idle:
            if self._idle_sent:
                return
        elif wm.timestamp_ms <= self._wm_sent:
            return
        else:
            self._wm_sent = wm.timestamp_ms
            if self.role == "source":
                self._record_watermark(wm.timestamp_ms)
        self._idle_sent = wm.idle
        for part, channels in self.outputs:
            # a watermark only travels where rows can: a forward output uses one channel
            for c in [channels[part.index]] if isinstance(part, Forward) else channels:
                await c.send_watermark(wm)  # after the rows buffered for it (one push)

    async def _fire_processing_timers(self) -> None:
        proc = self.processor
        if isinstance(proc, KeyedProcessor) and proc.step.on_timer is not None:
            due = proc.next_processing_ms()
            now_ms = int(time.time() * 1000)
            if due is not None and due <= now_ms:
                with self.metrics.busy():
                    await self._emit(proc.fire_processing(now_ms))

    async def _flush_due(self) -> None:
        now = time.monotonic()
        for _, channels in self.outputs:
            for c in channels:
                d = c.deadline
                if d is not None and d <= now:
                    await c.flush()

    async def _finish_outputs(self) -> None:
        await self._send_watermark(Watermark(WATERMARK_MAX))  # end of input, before EndOfStream
        self._outputs_closed = True  # receivers added from now on get EndOfStream at once
        for _, channels in self.outputs:
            for c in channels:
                await c.flush()
                await c.push(EndOfStream())
        for _, channels in self.outputs:
            for c in channels:
                await c.drain()
        await self._drain_retired()
        await self._end_unconnected()

    async def _drain_retired(self) -> None:
        """Wait for the acknowledgements of channels a move retired (see :meth:`_redirect`)."""
        retiring, self._retiring = self._retiring, []
        for drained in retiring:
            await drained


async def _let_acks_out() -> None:
    """Before processing a batch (which holds the event loop): the push call that brought it
    returns now, so its acknowledgement (the sender's credit) goes back while the batch is
    processed, not after. Else a sender's credit waits for the processing of what it sent:
    an adaptive sender holds its next small batch until its linger deadline, the two go as one
    batch that takes twice as long, and a paced sender stays in that cadence (at half its
    batches' rate, every record waiting longer) until something stalls it back out."""
    for _ in range(ACK_TURNS):
        await asyncio.sleep(0)


def _first_release(task: Any, released: list[pa.RecordBatch]) -> Any:
    """The task, if these are the first records it releases here (their timing is recorded on
    it: when, and the age of the oldest since its ingest); else None."""
    if task is None or task.first_release_wall is not None:
        return None
    now = time.time()
    task.first_release_wall = now
    stamps = [pc.min(b.column(INGEST_TS)).as_py() for b in released if INGEST_TS in b.schema.names]
    stamps = [t for t in stamps if t is not None]
    if stamps:
        task.first_release_age_ms = round((now * 1e9 - min(stamps)) / 1e6, 1)
    return task


async def _let_calls_in() -> None:
    """Between two slices of records: CALL_TURNS turns of the event loop, so calls to this
    instance (pushes, fetches, the controller's) finish within a slice or two, not one turn per
    slice (a Ray call takes a few turns: its task is made, runs and answers)."""
    for _ in range(CALL_TURNS):
        await asyncio.sleep(0)


def _bind(sender: Sender, receiver: ChannelId, me: ChannelId) -> Callable[[Any], Awaitable[Any]]:
    def send(seq_item: tuple[int, Any]) -> Awaitable[Any]:
        seq, item = seq_item
        return sender(receiver, (me, seq, item))

    return send


def _stamp(
    batch: pa.RecordBatch, ingest_ns: np.ndarray, event_ms: np.ndarray | None = None
) -> pa.RecordBatch:
    """Give every record an ingest timestamp (ns) and an event time (ms): from the source's
    event-time column (``event_ms``), else kept if there, else the ingest time."""
    names = batch.schema.names
    if event_ms is not None:
        col = pa.array(event_ms, pa.int64())
        if EVENT_TIME in names:
            batch = batch.set_column(names.index(EVENT_TIME), EVENT_TIME, col)
        else:
            batch = batch.append_column(EVENT_TIME, col)
        names = batch.schema.names
    elif EVENT_TIME not in names:
        batch = batch.append_column(EVENT_TIME, pa.array(ingest_ns // 1_000_000))
    ingest = pa.array(ingest_ns)
    if INGEST_TS in names:
        return batch.set_column(names.index(INGEST_TS), INGEST_TS, ingest)
    return batch.append_column(INGEST_TS, ingest)
