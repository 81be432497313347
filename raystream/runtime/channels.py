"""Channels: the receiver's bounded inbox, the sender's output buffers, and partitioners.

Backpressure is credit-based. A sender keeps at most ``max_inflight`` pushes per channel
unacknowledged; the receiver acknowledges a push only once the batch is in its inbox, and an inbox
holds at most ``capacity`` items per channel. So per channel at most ``max_inflight + capacity``
batches exist between two instances, and a slow operator slows its senders down to the sources.

A rescale barrier that does not align (:func:`overtakes`) does not wait behind data: its sender
pushes it without waiting for credit (:attr:`OutputChannel.overtaking`), the pushes before it enter
the inbox without waiting for room, and in the inbox it overtakes the record batches queued after
the channel's last control event. It is read as an :class:`OvertakingBarrier` that carries those
batches (records sent before the barrier, in channel order), so the receiver can hand the records
of moving sub-groups over with their state and put the rest back in front of its queue.

Per-key order across a move is kept here, at the receiver: an old owner marks each output channel
with a :class:`Fence` when it seals, a new owner marks its channels with :class:`AfterFences`
before its first output made from state it took over, and the inbox reads nothing more of that
channel (*holds* it) until it has read each named old owner's fence. Neither waits for the other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from raystream.dataflow import KeySpec
from raystream.errors import InternalError, SchemaError
from raystream.keys import KeySpace, RoutingTable, stable_hash, to_key_array
from raystream.presort import split_by_destination, split_by_owner, take_key_groups
from raystream.runtime.messages import (
    AfterFences,
    Barrier,
    ChannelId,
    EndOfStream,
    Fence,
    RowsThenWatermark,
    Watermark,
)

log = logging.getLogger(__name__)

# a push that waits this long for an earlier push of its channel that never came in is reported
# (a push lost on the way would stop its channel for good: pushes are taken in sequence order);
# checked with each heartbeat the controller sends (Inbox.check_missing_pushes)
MISSING_PUSH_WARN_S = 30.0

__all__ = [
    "ByKeyGroup",
    "Forward",
    "Inbox",
    "OutputChannel",
    "OvertakingBarrier",
    "Rebalance",
    "concat_batches",
    "materialise_key",
    "overtakes",
]


def overtakes(item: Any) -> bool:
    """A rescale barrier that does not align: it may overtake queued record batches."""
    return (
        isinstance(item, Barrier)
        and item.kind == "rescale"
        and not item.payload.get("aligned", False)
    )


@dataclass
class OvertakingBarrier:
    """A rescale barrier as read from the inbox, with the record batches it overtook there
    (``pre_barrier``: sent before the barrier on the same channel, in order, not read yet)."""

    barrier: Barrier
    pre_barrier: list[pa.RecordBatch] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return sum(b.num_rows for b in self.pre_barrier)


@dataclass
class _Hold:
    """A channel held after its :class:`AfterFences` of ``epoch``: until the fences of the
    channels in ``waiting`` are read."""

    epoch: int
    waiting: set[ChannelId]
    since: float


class Inbox:
    """Per-input-channel FIFO queues with a capacity each, read round-robin by one loop."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._queues: dict[ChannelId, deque[Any]] = {}
        self._blocked: set[ChannelId] = set()
        self._order: list[ChannelId] = []
        self._next = 0
        self._readable = asyncio.Event()
        self._space: dict[ChannelId, asyncio.Condition] = {}
        self._next_seq: dict[ChannelId, int] = {}
        self.max_depth_seen = 0
        self.duplicate_pushes = 0  # pushes of a sequence number already taken (dropped)
        self._poked = False
        self._overtake_below: dict[ChannelId, int] = {}  # pushes below this seq skip the room check
        self.overtaking = 0  # OvertakingBarrier items queued, not read yet
        self.incoming_overtaking = 0  # overtaking barriers pushed, waiting for their turn
        # called when an overtaking barrier is pushed (before it waits for its turn)
        self.on_overtaking: Callable[[Barrier], None] = lambda barrier: None
        # per-key order across moves (see the module's doc): the newest fence epoch read per
        # channel, channels whose EndOfStream was read, and channels held for old owners' fences
        self._fence_read: dict[ChannelId, int] = {}
        self._ended: set[ChannelId] = set()
        self._held: dict[ChannelId, _Hold] = {}
        self.fences_read = 0  # fences passed so far
        self.marks_read = 0  # AfterFences marks passed so far
        self.holds = 0  # channels held so far
        self.hold_ms_max = 0.0  # the longest a channel was held
        # pushes in put() per channel (came in, waiting for their turn or room); per channel
        # whose waiting pushes all come after one that has not come in: (that one, since when);
        # and the reports of those that waited MISSING_PUSH_WARN_S (check_missing_pushes)
        self._arrived: dict[ChannelId, set[int]] = {}
        self._gaps: dict[ChannelId, tuple[int, float]] = {}
        self.missing_pushes: list[dict[str, Any]] = []

    def poke(self) -> None:
        """Wake a waiting :meth:`get` (it returns None): something besides input needs work."""
        self._poked = True
        self._readable.set()

    def add_channel(self, channel: ChannelId) -> None:
        if channel not in self._queues:
            self._queues[channel] = deque()
            self._space[channel] = asyncio.Condition()
            self._next_seq[channel] = 0
            self._order.append(channel)

    def reset_channel(self, channel: ChannelId) -> None:
        """(Re)open ``channel`` at sequence 0; a known channel must have nothing left unread."""
        if channel in self._queues:
            self._pass_marks(channel)
            if self._queues[channel]:
                msg = f"channel {channel} reopened with {len(self._queues[channel])} unread items"
                raise InternalError(msg)
            self._next_seq[channel] = 0
            self._blocked.discard(channel)
            self._overtake_below.pop(channel, None)
            # another instance now: its fences are to come (the old one's ended)
            self._fence_read.pop(channel, None)
            self._ended.discard(channel)
            self._release(channel)
        else:
            self.add_channel(channel)

    def remove_channel(self, channel: ChannelId) -> None:
        if channel in self._queues:
            self._pass_marks(channel)
        q = self._queues.pop(channel, None)
        if q:
            msg = f"channel {channel} removed with {len(q)} unread items"
            raise InternalError(msg)
        self._space.pop(channel, None)
        self._next_seq.pop(channel, None)
        self._overtake_below.pop(channel, None)
        self._blocked.discard(channel)
        self._order = [c for c in self._order if c != channel]
        self._held.pop(channel, None)
        self._fence_read.pop(channel, None)
        self._ended.discard(channel)
        self._release(channel)  # gone: nothing of it is left to wait for

    @property
    def channels(self) -> list[ChannelId]:
        return list(self._order)

    def depth(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def backlog_rows(self) -> int:
        """Records queued here, not read yet (with those an overtaking barrier carries)."""
        rows = 0
        for q in self._queues.values():
            for item in q:
                if isinstance(item, pa.RecordBatch):
                    rows += item.num_rows
                elif isinstance(item, OvertakingBarrier):
                    rows += item.rows
        return rows

    def unread(self, channel: ChannelId) -> int:
        """Items of ``channel`` queued here, not read yet."""
        return len(self._queues.get(channel, ()))

    async def put(self, channel: ChannelId, seq: int, item: Any) -> None:
        """Enqueue push number ``seq`` of ``channel`` once all earlier ones are in and the channel
        has room (the acknowledgement a sender's credit waits for).

        Ray runs the calls of an async actor concurrently, so pushes can arrive out of order;
        the sequence number restores the sender's order. A record batch whose sequence number
        the channel already took is dropped (:attr:`duplicate_pushes`): a direct writer
        (:mod:`raystream.direct`) that was retried sends its reserved pieces again.
        """
        if channel not in self._queues:
            self.add_channel(channel)
        arrived = self._arrived.setdefault(channel, set())
        arrived.add(seq)
        try:
            await self._put(channel, seq, item)
        finally:
            arrived.discard(seq)

    def check_missing_pushes(
        self, now: float, after_s: float | None = None
    ) -> list[dict[str, Any]]:
        """Channels whose pushes have waited ``after_s`` (MISSING_PUSH_WARN_S) for an earlier
        push that never came in (``now``: ``time.monotonic()``; called now and then, off the
        pushes' path): each reported once, logged as a warning and added to
        :attr:`missing_pushes`. A push waiting behind one that came in and waits for room is
        backpressure, not reported."""
        after_s = MISSING_PUSH_WARN_S if after_s is None else after_s
        new: list[dict[str, Any]] = []
        for channel, arrived in self._arrived.items():
            missing = self._next_seq.get(channel, 0)
            if not arrived or missing in arrived or min(arrived) < missing:
                self._gaps.pop(channel, None)
                continue
            gap = self._gaps.get(channel)
            if gap is None or gap[0] != missing:
                self._gaps[channel] = (missing, now)
                continue
            report = {"channel": channel, "waiting": min(arrived), "missing": missing}
            if now - gap[1] < after_s or report in self.missing_pushes:
                continue
            self.missing_pushes.append(report)
            new.append(report)
            log.warning(
                "input channel %s: push %d has waited %.0f s for push %d of the channel, which "
                "never came in; pushes are taken in order, so this channel stops here until it "
                "comes (it was lost or dropped on its way: look for a stale-attempt drop or a "
                "Ray RPC error in the sender's and this worker's logs)",
                channel, report["waiting"], now - gap[1], missing,
            )  # fmt: skip
        return new

    async def _put(self, channel: ChannelId, seq: int, item: Any) -> None:
        q = self._queues[channel]
        cond = self._space[channel]
        if isinstance(item, (Fence, AfterFences)):
            await self._put_mark(channel, seq, item)
            return
        if overtakes(item):
            # the pushes before it are pre-barrier records: they come in without room, so the
            # barrier's turn comes without waiting for the reader
            self._overtake_below[channel] = max(self._overtake_below.get(channel, 0), seq)
            self.on_overtaking(item)
            self.incoming_overtaking += 1
            try:
                async with cond:
                    cond.notify_all()
                    await cond.wait_for(lambda: self._next_seq[channel] == seq)
                    self._insert_overtaking(q, item)
                    self._next_seq[channel] = seq + 1
                    cond.notify_all()
            finally:
                self.incoming_overtaking -= 1
            self._readable.set()
            return
        async with cond:
            await cond.wait_for(
                lambda: self._next_seq[channel] > seq
                or (
                    self._next_seq[channel] == seq
                    and (len(q) < self.capacity or seq < self._overtake_below.get(channel, 0))
                )
            )
            if self._next_seq[channel] > seq:
                # a push this channel already took: a direct writer's retry re-sent it
                self.duplicate_pushes += 1
                return
            if isinstance(item, RowsThenWatermark):  # two items of one push, the batch first
                q.append(item.batch)
                q.append(item.watermark)
            else:
                q.append(item)
            self._next_seq[channel] = seq + 1
            cond.notify_all()
        # items queued besides watermarks (the bound a channel's room keeps; a watermark that
        # came with rows shares their push and takes no room of its own)
        queued = sum(1 for x in q if not isinstance(x, Watermark))
        self.max_depth_seen = max(self.max_depth_seen, queued)
        self._readable.set()

    async def _put_mark(self, channel: ChannelId, seq: int, mark: Fence | AfterFences) -> None:
        """Queue a fence or an after-fences mark in its turn (it takes no room)."""
        q = self._queues[channel]
        cond = self._space[channel]
        async with cond:
            await cond.wait_for(lambda: self._next_seq[channel] == seq)
            q.append(mark)
            self._next_seq[channel] = seq + 1
            cond.notify_all()
        self._readable.set()

    def _pass_marks(self, channel: ChannelId) -> None:
        """Pass the marks at the front of ``channel``'s queue (the reader is back for the next
        item, so what came before them was processed): a fence is noted as read (channels held
        for it may go on), an after-fences mark holds the channel while a fence it names is
        still to be read."""
        q = self._queues[channel]
        while q and channel not in self._held:
            head = q[0]
            if isinstance(head, Fence):
                q.popleft()
                self.fences_read += 1
                self._fence_read[channel] = max(self._fence_read.get(channel, -1), head.epoch)
                self._release(channel)
            elif isinstance(head, AfterFences):
                q.popleft()
                self.marks_read += 1
                self._hold(channel, head)
            else:
                return

    def _hold(self, channel: ChannelId, mark: AfterFences) -> None:
        step = channel[0]
        waiting = {
            (step, i)
            for i in mark.senders
            if (step, i) != channel
            and (step, i) in self._queues  # an input of this receiver
            and (step, i) not in self._ended
            and self._fence_read.get((step, i), -1) < mark.epoch
        }
        if waiting:
            self._held[channel] = _Hold(mark.epoch, waiting, time.monotonic())
            self.holds += 1

    def _release(self, read: ChannelId) -> None:
        """``read``'s fence (or its end) was read: channels held for it alone go on."""
        if not self._held:
            return
        done = read in self._ended or read not in self._queues
        epoch = self._fence_read.get(read, -1)
        for channel, hold in list(self._held.items()):
            if read in hold.waiting and (done or epoch >= hold.epoch):
                hold.waiting.discard(read)
                if not hold.waiting:
                    del self._held[channel]
                    held_ms = (time.monotonic() - hold.since) * 1000
                    self.hold_ms_max = max(self.hold_ms_max, held_ms)
                    self._readable.set()

    def held(self, channel: ChannelId) -> bool:
        """Whether ``channel`` waits for old owners' fences (nothing of it is read)."""
        return channel in self._held

    def _readable_channel(self, channel: ChannelId) -> bool:
        return channel not in self._blocked and channel not in self._held

    async def let_overtaking_in(self, timeout_s: float = 1.0) -> None:
        """Yield until the overtaking barriers pushed here are queued (each needs the pushes
        before it to come in first, a few turns of the event loop that a reader busy with
        records would otherwise stretch to one slice of records each)."""
        deadline = time.monotonic() + timeout_s
        while self.incoming_overtaking and time.monotonic() < deadline:
            await asyncio.sleep(0)

    def _insert_overtaking(self, q: deque[Any], barrier: Barrier) -> None:
        """Queue ``barrier`` ahead of the record batches after the last control event."""
        pre: list[pa.RecordBatch] = []
        while q and isinstance(q[-1], pa.RecordBatch):
            pre.append(q.pop())
        pre.reverse()
        q.append(OvertakingBarrier(barrier, pre))
        self.overtaking += 1

    def put_back(self, channel: ChannelId, batches: list[pa.RecordBatch]) -> None:
        """Put ``batches`` (read from ``channel``, in order) back: they come before everything
        queued on the channel, so an overtaking barrier at its front overtakes them too."""
        if not batches:
            return
        q = self._queues[channel]
        if q and isinstance(q[0], OvertakingBarrier):
            q[0].pre_barrier[:0] = batches
        else:
            q.extendleft(reversed(batches))
        self._readable.set()

    def block(self, channel: ChannelId) -> None:
        """Stop reading ``channel`` (aligned barriers); its sender keeps going until credit ends."""
        self._blocked.add(channel)

    def unblock_all(self) -> None:
        self._blocked.clear()
        self._readable.set()

    def get_nowait(self) -> tuple[ChannelId, Any] | None:
        n = len(self._order)
        for ch in self._order:
            self._pass_marks(ch)
        if self.overtaking:  # a rescale barrier at the front of a channel goes first
            for ch in self._order:
                q = self._queues[ch]
                if q and isinstance(q[0], OvertakingBarrier) and self._readable_channel(ch):
                    self.overtaking -= 1
                    item = q.popleft()
                    asyncio.get_running_loop().create_task(self._notify(ch))
                    return ch, item
        for i in range(n):
            ch = self._order[(self._next + i) % n]
            q = self._queues[ch]
            if q and self._readable_channel(ch):
                self._next = (self._next + i + 1) % n
                item = q.popleft()
                if isinstance(item, OvertakingBarrier):
                    self.overtaking -= 1
                elif isinstance(item, EndOfStream):  # nothing more of it: no fence to wait for
                    self._ended.add(ch)
                    self._release(ch)
                asyncio.get_running_loop().create_task(self._notify(ch))
                return ch, item
        return None

    def take_batches(self, channel: ChannelId, max_rows: int) -> list[pa.RecordBatch]:
        """Record batches queued next on ``channel``, in order, while they total at most
        ``max_rows`` rows; stops at anything else (a barrier, a watermark) or a blocked channel.
        Under load batches queue up, and the reader takes them as one larger batch."""
        q = self._queues.get(channel)
        out: list[pa.RecordBatch] = []
        if not q or not self._readable_channel(channel):
            return out
        rows = 0
        while q and isinstance(q[0], pa.RecordBatch) and rows + q[0].num_rows <= max_rows:
            batch = q.popleft()
            rows += batch.num_rows
            out.append(batch)
        if out:
            asyncio.get_running_loop().create_task(self._notify(channel))
        return out

    async def _notify(self, channel: ChannelId) -> None:
        cond = self._space.get(channel)
        if cond is not None:
            async with cond:
                cond.notify_all()

    async def get(self, timeout_s: float | None = None) -> tuple[ChannelId, Any] | None:
        """Next item round-robin over unblocked channels; None after ``timeout_s`` without one."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            got = self.get_nowait()
            if got is not None:
                return got
            if self._poked:
                self._poked = False
                return None
            self._readable.clear()
            if deadline is None:
                await self._readable.wait()
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                try:
                    await asyncio.wait_for(self._readable.wait(), remaining)
                except TimeoutError:
                    return None


ADAPTIVE_SMALL_FRACTION = 8  # adaptive channels send batches under batch_rows / 8 at once


class OutputChannel:
    """Buffers rows for one receiver; sends when ``batch_rows`` are there or ``linger_ms`` passed.

    ``send((seq, item)) -> awaitable`` performs the remote push; at most ``max_inflight`` pushes are
    unacknowledged at once.

    ``adaptive``: a small batch (under ``batch_rows / 8`` rows buffered) also goes at once while
    no push is in flight (every earlier one was acknowledged). A producer at a low rate makes
    small batches (a source emits ``rate x linger_ms`` rows at a time), so they leave as soon
    as they are made: low latency without tuning ``linger_ms``. Under load batches are large or
    pushes are in flight, and rows gather up to ``batch_rows`` for at most ``linger_ms`` (fewer,
    larger calls); the receiver also takes batches that queued up as one
    (:meth:`Inbox.take_batches`).
    """

    def __init__(
        self,
        send: Callable[[Any], Awaitable[Any]],
        *,
        batch_rows: int,
        linger_ms: float,
        max_inflight: int,
        adaptive: bool = False,
    ) -> None:
        self._send = send
        self.adaptive = adaptive
        self.batch_rows = batch_rows
        self._small_rows = max(1, batch_rows // ADAPTIVE_SMALL_FRACTION)
        self.linger_s = linger_ms / 1000.0
        self.max_inflight = max_inflight
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self._first_at: float | None = None
        self._inflight: deque[Any] = deque()
        self._seq = 0  # per-channel sequence number of the next push
        # while set, pushes do not wait for credit (a rescale barrier is on its way out: what is
        # in front of it must not wait behind the receiver's backlog); see :meth:`overtake`
        self.overtaking = False
        self._credit_wake: asyncio.Event | None = None
        self.receiver: ChannelId = ("", -1)
        self.max_inflight_seen = 0
        self.batches_sent = 0
        self.rows_sent = 0

    @property
    def deadline(self) -> float | None:
        """When the buffered rows must go out (monotonic seconds), or None if empty."""
        return None if self._first_at is None else self._first_at + self.linger_s

    async def add(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        if self._first_at is None:
            self._first_at = time.monotonic()
        self._pending.append(batch)
        self._pending_rows += batch.num_rows
        rows = self._pending_rows
        if rows >= self.batch_rows or (self.adaptive and rows < self._small_rows and self.idle):
            await self.flush()

    @property
    def idle(self) -> bool:
        """No push is in flight: every one sent was acknowledged."""
        return all(_done(ack) for ack in self._inflight)

    async def flush(self) -> None:
        if not self._pending:
            return
        batch = self._take_pending()
        await self.push(batch)
        self.rows_sent += batch.num_rows

    def _take_pending(self) -> pa.RecordBatch:
        pending, self._pending = self._pending, []
        self._pending_rows = 0
        self._first_at = None
        return pending[0] if len(pending) == 1 else concat_batches(pending)

    def reserve_seq(self, rows: int) -> int:
        """The next sequence number, for a push of ``rows`` rows another process sends to the
        receiver (:mod:`raystream.direct`); only while no rows are buffered here."""
        if self._pending:
            msg = f"reserve_seq with {self._pending_rows} rows buffered for {self.receiver}"
            raise InternalError(msg)
        seq = self._seq
        self._seq += 1
        self.batches_sent += 1
        self.rows_sent += rows
        return seq

    async def send_watermark(self, watermark: Watermark) -> None:
        """The buffered rows, then ``watermark``: in one push when rows wait."""
        if not self._pending:
            await self.push(watermark)
            return
        batch = self._take_pending()
        await self.push(RowsThenWatermark(batch, watermark))
        self.rows_sent += batch.num_rows

    def overtake(self, on: bool) -> None:
        """Push without waiting for credit (``on``) until a rescale barrier went out; a push
        waiting for credit now goes at once. Bounded: the sender turns it off at the barrier."""
        self.overtaking = on
        if on and self._credit_wake is not None:
            self._credit_wake.set()

    async def push(self, item: Any) -> None:
        """Send one item (a batch or a control event) under the credit limit, in order."""
        while len(self._inflight) >= self.max_inflight and not self.overtaking:
            head = self._inflight[0]
            if not _done(head):
                await self._wait_credit(head)
                continue
            await self._inflight.popleft()
        # drop acknowledged pushes from the front without waiting
        while self._inflight and _done(self._inflight[0]):
            self._inflight.popleft()
        self._inflight.append(self._send((self._seq, item)))
        self._seq += 1
        self.batches_sent += 1
        self.max_inflight_seen = max(self.max_inflight_seen, len(self._inflight))

    async def _wait_credit(self, head: Any) -> None:
        """Until the oldest push is acknowledged, or :meth:`overtake` is turned on."""
        wake = self._credit_wake = asyncio.Event()
        if not asyncio.isfuture(head):
            head = self._inflight[0] = asyncio.ensure_future(head)
        waker = asyncio.ensure_future(wake.wait())
        try:
            await asyncio.wait({head, waker}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waker.cancel()
            self._credit_wake = None

    async def mark(self, item: Fence | AfterFences) -> None:
        """Flush buffered rows, then send ``item`` (a :class:`Fence` or :class:`AfterFences`):
        in order after everything sent before it."""
        await self.flush()
        await self.push(item)

    async def drain(self) -> None:
        """Flush buffered rows and wait until every push was acknowledged."""
        await self.flush()
        while self._inflight:
            await self._inflight.popleft()


def _done(ack: Any) -> bool:
    """Whether an acknowledgement (an asyncio future) has arrived."""
    done = getattr(ack, "done", None)
    return bool(done()) if callable(done) else False


def concat_batches(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    """One record batch of ``batches`` (schemas unified if they differ, e.g. by a null column)."""
    try:
        return pa.Table.from_batches(batches).combine_chunks().to_batches()[0]
    except pa.ArrowInvalid:
        table = pa.concat_tables(
            [pa.Table.from_batches([b]) for b in batches], promote_options="permissive"
        )
        return table.combine_chunks().to_batches()[0]


def materialise_key(batch: pa.RecordBatch, key: KeySpec) -> tuple[pa.RecordBatch, pa.Array]:
    """The batch with its key column present, and the key array (validated: no nulls)."""
    if key.column is not None:
        idx = batch.schema.get_field_index(key.column)
        if idx < 0:
            msg = (
                f"records have no key column {key.column!r}; they have columns "
                f"{batch.schema.names}. Fix key_by(...) or the step before it."
            )
            raise SchemaError(msg)
        return batch, to_key_array(batch.column(idx), column=key.column)
    assert key.fn is not None
    if key.key_column in batch.schema.names:  # computed upstream by the partitioner
        return batch, to_key_array(batch.column(key.key_column), column=key.key_column)
    if key.per_record:
        raw = pa.array([key.fn(r) for r in batch.to_pylist()])
    else:
        raw = key.fn(batch)
    arr = to_key_array(raw, column="key_by(fn)")
    if len(arr) != batch.num_rows:
        msg = f"key_by(fn) returned {len(arr)} keys for a batch of {batch.num_rows} rows"
        raise SchemaError(msg)
    return batch.append_column(key.key_column, arr), arr


class Forward:
    """Instance i sends to instance i of the next step (same parallelism)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def split(self, batch: pa.RecordBatch) -> list[tuple[int, pa.RecordBatch]]:
        return [(self.index, take_key_groups(batch)[0])]


class Rebalance:
    """Whole batches round-robin over the receivers."""

    def __init__(self, receivers: int, start: int = 0) -> None:
        self.receivers = receivers
        self._next = start % receivers

    def split(self, batch: pa.RecordBatch) -> list[tuple[int, pa.RecordBatch]]:
        i = self._next
        self._next = (i + 1) % self.receivers
        return [(i, take_key_groups(batch)[0])]


class ByKeyGroup:
    """Rows to the owner of their key group, through a routing table (stable: per-key order kept)."""

    def __init__(self, key: KeySpec, key_space: KeySpace, table: RoutingTable) -> None:
        self.key = key
        self.key_space = key_space
        self.table = table

    def split(self, batch: pa.RecordBatch) -> list[tuple[int, pa.RecordBatch]]:
        if batch.num_rows == 0:
            return []
        # a writer (a Spark task) sorted the rows by key group already: cut, do not hash
        batch, kg = take_key_groups(batch, self.key.column, self.key_space)
        if kg is not None:
            return split_by_owner(batch, kg, self.table)
        batch, keys = materialise_key(batch, self.key)
        if self.table.parallelism == 1:
            return [(0, batch)]
        kg = self.key_space.key_group(stable_hash(keys))
        dest = self.table.owner_of(kg)
        first = int(dest[0])
        if (dest == first).all():
            return [(first, batch)]
        return split_by_destination(batch, dest, self.table.parallelism)
