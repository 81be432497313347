"""An operator chain at run time: the instances of several steps in one actor. No Ray here.

The head is an ordinary :class:`OperatorInstance` (it reads the source or its inputs and runs
the loop); every later member is one too, with its own processor, metrics, barrier handling,
checkpoint state and sink writer, but no loop and no inbox traffic: its predecessor's output is a
:class:`LocalChannel`, which hands each batch, barrier, watermark and end of stream to it by a
direct call (the batch object itself: no copy, no serialisation, no buffering). Records, barriers
and watermarks therefore reach a member in the order its predecessor emitted them, and a barrier
passes the whole chain (each member snapshotting, pre-committing and acknowledging it under its
own instance id) before the head's next batch.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from raystream.errors import context_of
from raystream.runtime.instance import InstanceSpec, OperatorInstance, Reporter, Sender
from raystream.runtime.messages import Barrier, ChannelId, EndOfStream, Watermark

__all__ = ["Chain", "ChainSpec", "LocalChannel"]

_ORIGIN = "_raystream_chain_origin"  # set on an exception: the chained instance it came from


@dataclass(frozen=True)
class ChainSpec:
    """The specs of one chain's instances at one index, head first."""

    specs: tuple[InstanceSpec, ...]

    @property
    def id(self) -> ChannelId:
        return self.specs[0].id

    @property
    def ids(self) -> tuple[ChannelId, ...]:
        return tuple(s.id for s in self.specs)


class LocalChannel:
    """The output of a chained step to the next step in the same actor (the interface of
    :class:`raystream.runtime.channels.OutputChannel`). Busy time stays per step: the time the
    next step takes for a batch is taken off the sender's busy time it was counted in."""

    def __init__(self, sender: OperatorInstance, member: OperatorInstance) -> None:
        self.sender = sender
        self.member = member
        self.receiver: ChannelId = member.spec.id
        self.channel: ChannelId = sender.spec.id
        self.overtaking = False
        self.max_inflight_seen = 0
        self.batches_sent = 0
        self.rows_sent = 0

    @property
    def deadline(self) -> float | None:
        """The next member's own next deadline (its outputs' linger, recursively)."""
        return self.member._next_deadline()  # noqa: SLF001 - the chain drives its members

    @property
    def idle(self) -> bool:
        return True

    async def add(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        t0 = time.perf_counter()
        try:
            await self._deliver(batch)
        finally:  # _emit runs inside the sender's busy(): that time is the member's
            self.sender.metrics.busy_s -= time.perf_counter() - t0
        self.batches_sent += 1
        self.rows_sent += batch.num_rows

    async def flush(self) -> None:
        """Nothing waits here; what waits in the member's outputs goes once due."""
        await self.member._flush_due()  # noqa: SLF001

    def overtake(self, on: bool) -> None:
        """A rescale barrier is on its way: the member's outputs stop waiting for credit too."""
        self.overtaking = on
        if on:
            for _, channels in self.member.outputs:
                for c in channels:
                    c.overtake(True)

    async def push(self, item: Any) -> None:
        await self._deliver(item)

    async def send_watermark(self, watermark: Watermark) -> None:
        await self.flush()
        await self._deliver(watermark)

    async def mark(self, item: Any) -> None:
        """A fence or after-fences mark: the member processed what came here when it came, so
        the mark goes on its outputs, after what it sent on."""
        for _, channels in self.member.outputs:
            for c in channels:
                await c.mark(item)

    async def drain(self) -> None:
        """Until what the member sent on was acknowledged."""
        for _, channels in self.member.outputs:
            for c in channels:
                await c.drain()

    async def _deliver(self, item: Any) -> None:
        m = self.member
        ch = self.channel
        try:
            if isinstance(item, pa.RecordBatch):
                m.watermarks.on_records(ch)
                await m._on_batch(item, ch)  # noqa: SLF001
            elif isinstance(item, Barrier):
                await m._on_barrier(ch, item)  # noqa: SLF001
            elif isinstance(item, Watermark):
                w = m.watermarks.on_watermark(ch, item.timestamp_ms, item.idle)
                await m._advance_watermark(w)  # noqa: SLF001
            elif isinstance(item, EndOfStream):
                m._eos.add(ch)  # noqa: SLF001
                w = m.watermarks.on_end(ch)
                await m._complete_barriers()  # noqa: SLF001
                if m._eos >= m.inputs:  # noqa: SLF001
                    await m._close_receiver()  # noqa: SLF001
                    m.finished = True
                else:
                    await m._advance_watermark(w)  # noqa: SLF001
        except Exception as e:
            if not hasattr(e, _ORIGIN):  # the innermost member it came from
                setattr(e, _ORIGIN, m.spec.id)
                _fail(m, e)
            raise


def _fail(inst: OperatorInstance, e: BaseException) -> None:
    inst.error = f"{type(e).__name__}: {e}"
    inst.error_traceback = "".join(traceback.format_exception(e))
    inst.error_context = context_of(e)  # type: ignore[arg-type]
    if inst.writer is not None:
        inst.writer.abort()
        inst.writer = None


class Chain:
    """The instances of one chain at one index; ``run`` runs the head's loop, which drives the
    rest. An error in a member ends the chain; it is reported as that member's."""

    def __init__(self, spec: ChainSpec) -> None:
        self.spec = spec
        self.instances = [OperatorInstance(s) for s in spec.specs]
        for a, b in zip(self.instances, self.instances[1:], strict=False):
            a.local[b.spec.id] = LocalChannel(a, b)
        self.done = asyncio.Event()

    @property
    def head(self) -> OperatorInstance:
        return self.instances[0]

    @property
    def members(self) -> list[OperatorInstance]:
        return self.instances[1:]

    def by_id(self) -> dict[ChannelId, OperatorInstance]:
        return {i.spec.id: i for i in self.instances}

    def connect(self, sender: Sender, report: Reporter) -> None:
        """Wire every instance (in-process use; an actor connects each one as it is asked)."""
        for inst in self.instances:
            inst.connect(sender, report)

    async def run(self) -> None:
        """Open the members (sinks open their writers, restore what a checkpoint holds), run
        the head to its end; members that did not end with it get its error."""
        head = self.head
        report = head._report  # noqa: SLF001

        def origin_aware(event: str, info: dict[str, Any]) -> Any:
            e = info.get("exception")
            if event == "failed" and e is not None and hasattr(e, _ORIGIN):
                info = {**info, "instance": getattr(e, _ORIGIN)}
            return report(event, info)

        head._report = origin_aware  # noqa: SLF001
        try:
            for m in reversed(self.members):
                await m._open_receiver()  # noqa: SLF001
        except Exception as e:  # noqa: BLE001 - reported like a failure of the head's loop
            _fail(m, e)
            head.error, head.error_traceback = m.error, m.error_traceback
            head.error_context = m.error_context
            origin_aware("failed", {"instance": m.spec.id, "error": m.error, "exception": e})
            self._end()
            return
        await head.run()
        self._end()

    def _end(self) -> None:
        head = self.head
        for m in self.members:
            if not m.finished and m.error is None:
                m.error = f"the chain's head {head.spec.id} ended first: {head.error}"
            if m.error is None:
                m._report("finished", {"instance": m.spec.id, "result": m.result})  # noqa: SLF001
        self.done.set()

    def origin(self) -> ChannelId | None:
        """The chained instance whose error ended the chain (None: no error, or the head's)."""
        for m in self.members:
            if m.error is not None and not m.error.startswith("the chain's head"):
                return m.spec.id
        return None
