"""The body of one operator instance: inbox, processing loop, outputs, barriers. No Ray here.

The actor edge (:mod:`raystream.runtime.actors`) injects how to push to a receiver and how to
report to the controller, so this class runs under plain asyncio in unit tests.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from raystream.dataflow import KeySpec, Step
from raystream.keys import KeySpace, RoutingTable
from raystream.metrics import InstanceMetrics, LatencyRecorder
from raystream.runtime.channels import ByKeyGroup, Forward, Inbox, OutputChannel, Rebalance
from raystream.runtime.messages import Barrier, ChannelId, EndOfStream
from raystream.runtime.processors import EVENT_TIME, INGEST_TS, KeyedProcessor, make_processor

__all__ = ["InstanceSpec", "OutputSpec", "OperatorInstance", "RuntimeConfig"]

Sender = Callable[[ChannelId, tuple[ChannelId, int, Any]], Awaitable[Any]]
Reporter = Callable[[str, dict[str, Any]], Any]


@dataclass(frozen=True)
class RuntimeConfig:
    """Knobs of the data plane."""

    batch_rows: int = 100_000  # a sender ships a batch once it holds this many rows ...
    linger_ms: float = 5.0  # ... or once its oldest row waited this long
    max_inflight: int = 4  # unacknowledged pushes per channel (credits)
    inbox_capacity: int = 4  # queued batches per input channel
    source_batch_rows: int = 100_000  # rows a source reads at once when unthrottled

    def __post_init__(self) -> None:
        from raystream.errors import ConfigError

        for name in ("batch_rows", "max_inflight", "inbox_capacity", "source_batch_rows"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                msg = f"{name} must be an int >= 1, got {v!r}"
                raise ConfigError(msg)
        if not isinstance(self.linger_ms, (int, float)) or self.linger_ms < 0:
            msg = f"linger_ms must be a number >= 0, got {self.linger_ms!r}"
            raise ConfigError(msg)


@dataclass(frozen=True)
class OutputSpec:
    """One outgoing edge of an instance: to every instance of ``step``."""

    step: str
    parallelism: int
    partitioning: str  # forward | rebalance | key_group
    key: KeySpec | None = None
    routing: RoutingTable | None = None


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
    extra: dict[str, Any] = field(default_factory=dict)

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
        self.metrics = InstanceMetrics(spec.origin_ns)
        self.latency = LatencyRecorder(spec.origin_ns) if self.role == "sink" else None
        self.processor: Any = None
        self.writer: Any = None
        self.reader: Any = None
        if self.role == "operator":
            self.processor = make_processor(
                spec.step, spec.key_space, spec.state_path, spec.owned_key_groups
            )
        self.outputs: list[tuple[Any, list[OutputChannel]]] = []
        self._pending_barriers: list[Barrier] = []
        self._barrier_seen: dict[int, set[ChannelId]] = {}
        self._eos: set[ChannelId] = set()
        self._report: Reporter = lambda event, info: None
        self.finished = False
        self.result: Any = None
        self.error: str | None = None
        self.rows_emitted = 0  # sources: rows sent so far (offset in their partition)
        self._stop = False

    # ---- wiring ---------------------------------------------------------------------------
    def connect(self, sender: Sender, report: Reporter) -> None:
        """Build output channels; ``sender(receiver_id, item)`` pushes one item to a receiver."""
        cfg = self.spec.config
        self._report = report
        self.outputs = []
        for out in self.spec.outputs:
            if out.partitioning == "key_group":
                assert out.key is not None and out.routing is not None
                part: Any = ByKeyGroup(out.key, self.spec.key_space, out.routing)
            elif out.partitioning == "forward":
                part = Forward(self.spec.index)
            else:
                part = Rebalance(out.parallelism, start=self.spec.index)
            channels = [
                OutputChannel(
                    _bind(sender, (out.step, i), self.spec.id),
                    batch_rows=cfg.batch_rows,
                    linger_ms=cfg.linger_ms,
                    max_inflight=cfg.max_inflight,
                )
                for i in range(out.parallelism)
            ]
            self.outputs.append((part, channels))

    # ---- called by senders and the controller --------------------------------------------
    async def push(self, channel: ChannelId, seq: int, item: Any) -> None:
        await self.inbox.put(channel, seq, item)

    def inject_barrier(self, barrier: Barrier) -> None:
        """Sources: emit ``barrier`` at the next batch boundary."""
        self._pending_barriers.append(barrier)

    def stop(self) -> None:
        self._stop = True

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
        return snap

    # ---- the loop -------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            if self.role == "source":
                await self._run_source()
            else:
                await self._run_receiver()
            self.finished = True
            self._report("finished", {"instance": self.spec.id, "result": self.result})
        except Exception as e:  # noqa: BLE001 - reported to the controller, which fails the job
            self.error = f"{type(e).__name__}: {e}"
            if self.writer is not None:
                self.writer.abort()
            self._report(
                "failed",
                {
                    "instance": self.spec.id,
                    "error": self.error,
                    "exception": e,
                    "traceback": traceback.format_exc(),
                },
            )

    async def _run_source(self) -> None:
        src = self.step.fn
        cfg = self.spec.config
        self.reader = src.open(self.spec.index, self.spec.source_parallelism)
        rate = float(getattr(src, "rate_eps", 0) or 0) / self.spec.source_parallelism
        # at a fixed rate a source emits every linger_ms: small batches, low latency
        chunk = cfg.source_batch_rows if rate <= 0 else max(1, int(rate * max(cfg.linger_ms, 1) / 1000))
        started = time.monotonic()
        while not self._stop:
            await self._emit_pending_barriers()
            if rate > 0:
                due = started + (self.rows_emitted + chunk) / rate
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            batch = self.reader.read(chunk)
            if batch is None:
                break
            if batch.num_rows == 0:
                continue
            with self.metrics.busy():
                now = time.time_ns()
                batch = _stamp(batch, now)
                await self._emit([batch])
            self.rows_emitted += batch.num_rows
            await asyncio.sleep(0)
        await self._emit_pending_barriers()
        self.reader.close()
        await self._finish_outputs()

    async def _emit_pending_barriers(self) -> None:
        while self._pending_barriers:
            barrier = self._pending_barriers.pop(0)
            await self._forward_barrier(barrier)
            self._report(
                "barrier",
                {"instance": self.spec.id, "epoch": barrier.epoch, "kind": barrier.kind,
                 "source_offset": self.rows_emitted},
            )

    async def _run_receiver(self) -> None:
        if self.role == "sink":
            self.writer = self.step.fn.open(self.spec.index, self.step.parallelism)
        inputs = set(self.spec.inputs)
        while not self._stop:
            deadline = self._next_deadline()
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            got = await self.inbox.get(timeout)
            if got is not None:
                channel, item = got
                if isinstance(item, pa.RecordBatch):
                    await self._on_batch(item)
                elif isinstance(item, Barrier):
                    await self._on_barrier(channel, item)
                elif isinstance(item, EndOfStream):
                    self._eos.add(channel)
                    if self._eos >= inputs:
                        break
            await self._flush_due()
            await asyncio.sleep(0)
        await self._finish_outputs()
        if self.processor is not None:
            self.processor.close()
        if self.writer is not None:
            self.result = self.writer.close()

    async def _on_batch(self, batch: pa.RecordBatch) -> None:
        m = self.metrics
        with m.busy():
            if self.role == "sink":
                now = time.time_ns()
                if self.latency is not None and INGEST_TS in batch.schema.names:
                    ingest = batch.column(INGEST_TS).to_numpy(zero_copy_only=False)
                    self.latency.record(ingest, now)
                self.writer.write(batch)
                m.record_in(batch.num_rows, now)
            else:
                outs = self.processor.process(batch)
                m.record_in(batch.num_rows)
                await self._emit(outs)

    async def _on_barrier(self, channel: ChannelId, barrier: Barrier) -> None:
        seen = self._barrier_seen.setdefault(barrier.epoch, set())
        seen.add(channel)
        if barrier.kind == "checkpoint":
            self.inbox.block(channel)  # aligned: hold this channel until all delivered
        if seen >= set(self.spec.inputs):
            del self._barrier_seen[barrier.epoch]
            info: dict[str, Any] = {"instance": self.spec.id, "epoch": barrier.epoch, "kind": barrier.kind}
            if barrier.kind == "checkpoint" and isinstance(self.processor, KeyedProcessor):
                base = barrier.payload.get("directory")
                if base:
                    path = Path(base) / self.step.name / str(self.spec.index)
                    self.processor.backend.snapshot(path)
                    info["snapshot"] = str(path)
                    info["key_groups"] = np.flatnonzero(self.processor.owned).tolist()
            await self._forward_barrier(barrier)
            self.inbox.unblock_all()
            self._report("barrier", info)

    async def _forward_barrier(self, barrier: Barrier) -> None:
        for _, channels in self.outputs:
            for c in channels:
                await c.flush()
                await c.push(barrier)

    async def _emit(self, batches: list[pa.RecordBatch]) -> None:
        for b in batches:
            if b.num_rows == 0:
                continue
            self.metrics.record_out(b.num_rows)
            for part, channels in self.outputs:
                for receiver, piece in part.split(b):
                    await channels[receiver].add(piece)

    def _next_deadline(self) -> float | None:
        deadlines = [c.deadline for _, chans in self.outputs for c in chans if c.deadline is not None]
        return min(deadlines) if deadlines else None

    async def _flush_due(self) -> None:
        now = time.monotonic()
        for _, channels in self.outputs:
            for c in channels:
                d = c.deadline
                if d is not None and d <= now:
                    await c.flush()

    async def _finish_outputs(self) -> None:
        for _, channels in self.outputs:
            for c in channels:
                await c.flush()
                await c.push(EndOfStream())
        for _, channels in self.outputs:
            for c in channels:
                await c.drain()


def _bind(sender: Sender, receiver: ChannelId, me: ChannelId) -> Callable[[Any], Awaitable[Any]]:
    def send(seq_item: tuple[int, Any]) -> Awaitable[Any]:
        seq, item = seq_item
        return sender(receiver, (me, seq, item))

    return send


def _stamp(batch: pa.RecordBatch, now_ns: int) -> pa.RecordBatch:
    """Give every record an ingest timestamp (ns) and, if it has none, an event time (ms)."""
    n = batch.num_rows
    names = batch.schema.names
    if EVENT_TIME not in names:
        batch = batch.append_column(EVENT_TIME, pa.array(np.full(n, now_ns // 1_000_000, np.int64)))
    ingest = pa.array(np.full(n, now_ns, np.int64))
    if INGEST_TS in names:
        return batch.set_column(names.index(INGEST_TS), INGEST_TS, ingest)
    return batch.append_column(INGEST_TS, ingest)
