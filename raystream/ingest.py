"""Push ingest: a bounded, deduplicating buffer that outside writers (Spark tasks) fill and a
source instance drains. No Ray here; the actor edge exposes :meth:`IngestBuffer.offer`.

Exactly-once hand-off. Every push names the *piece* of input it belongs to with a token
``(stream, batch_id, partition)`` and the row offset of its first row inside that piece. The
buffer remembers, per token, how many rows it accepted, and takes only rows past that mark:

* a retried Spark task re-sends its partition from offset 0; the prefix the failed attempt
  already delivered is skipped, the rest is taken;
* a replayed micro-batch (same stream, same batch id) is recognised and skipped;
* pushes of one writer that Ray delivers out of order wait until the rows before them arrived.

This relies on what Spark's own exactly-once sinks rely on: a partition of a (micro-)batch holds
the same rows in the same order when it is computed again (replayable, deterministic input).

Backpressure: :meth:`offer` waits while the buffer holds ``capacity_rows`` rows, so a writer
blocks while the dataflow is behind.

Checkpoints. Besides what it *accepted*, the buffer knows, per token, how many rows the reader
*took* (they went downstream). At a barrier the source records that table
(:meth:`IngestBuffer.checkpoint_state`); a recovered source starts from it
(:meth:`IngestBuffer.restore`), so when writers re-send, the rows the checkpoint holds are
dropped as duplicates and the rest is taken again.

Example::

    >>> import asyncio, pyarrow as pa
    >>> buf = IngestBuffer(pa.schema([("key", pa.int64())]), capacity_rows=10)
    >>> b = pa.record_batch({"key": [1, 2, 3]})
    >>> async def demo():
    ...     first = await buf.offer(("q", 0, 0), 0, b)
    ...     again = await buf.offer(("q", 0, 0), 0, b)      # a retry: skipped
    ...     await buf.end()
    ...     out = await buf.read(100, timeout_s=0.1)
    ...     return first, again, out.num_rows, await buf.read(100, timeout_s=0.1)
    >>> asyncio.run(demo())
    ({'accepted': 3, 'duplicate': 0}, {'accepted': 0, 'duplicate': 3}, 3, None)
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import pyarrow as pa

from raystream.errors import ConfigError, SchemaError, SourceError
from raystream.presort import KEY_GROUP_COLUMN, KeyGroupPlan, take_key_groups

__all__ = [
    "FeedContext",
    "Feeder",
    "IngestBuffer",
    "PushReader",
    "PushSource",
    "Token",
    "push",
]

Token = tuple[Hashable, ...]  # (stream, batch_id, partition)


class IngestBuffer:
    """Bounded FIFO of record batches with per-token row offsets (see the module doc)."""

    def __init__(
        self, schema: pa.Schema, *, capacity_rows: int, order_wait_s: float = 600.0
    ) -> None:
        if not isinstance(capacity_rows, int) or capacity_rows < 1:
            msg = f"capacity_rows must be an int >= 1, got {capacity_rows!r}"
            raise ConfigError(msg)
        self.schema = schema
        self.capacity_rows = capacity_rows
        self.order_wait_s = order_wait_s
        # queued rows: (token, offset of the batch's first row inside its piece, rows)
        self._queue: deque[tuple[Token, int, pa.RecordBatch]] = deque()
        self._rows = 0
        self._accepted: dict[Token, int] = {}
        # per token, the rows the reader took (emitted downstream): what a checkpoint records
        self._emitted: dict[Token, int] = {}
        self._emitted_newest: dict[Hashable, int] = {}
        # per stream: the newest batch id seen, and the floor below which every batch is known
        # complete (a micro-batch starts only once the one before it was committed), so its
        # pieces are forgotten and any late push of it is a duplicate
        self._newest: dict[Hashable, int] = {}
        self._floor: dict[Hashable, int] = {}
        self._changed = asyncio.Condition()
        self._ended = False
        self._complete = False  # restored from a checkpoint taken after the source's end
        self._error: str | None = None
        self.rows_accepted = 0
        self.rows_presorted = 0  # accepted rows their writer sorted by key group (presort)
        self.rows_duplicate = 0
        # direct push: rows whose writer sent them to the keyed instances itself (reserve)
        self.rows_reserved = 0
        self.reservations_split = 0  # reservations cut again where a failed attempt's ended
        self.reservations_again = 0  # reservations a writer's retry asked for again
        # (token, offset) -> (rows, what allocate() gave): a retried writer gets the same back
        self._reserved: dict[tuple[Token, int], tuple[int, dict[str, Any]]] = {}
        self.waits = 0  # offers that had to wait for room (backpressure reached the writer)
        self.max_queued_rows = 0

    # ---- writers --------------------------------------------------------------------------
    async def offer(self, token: Token, offset: int, batch: pa.RecordBatch) -> dict[str, int]:
        """Take the rows of ``batch`` (rows ``offset ..`` of piece ``token``) not taken before;
        waits for room and for earlier rows of the same piece. Returns accepted/duplicate rows."""
        batch = self._conform(batch)
        n = batch.num_rows
        deadline = time.monotonic() + self.order_wait_s
        waited = False
        async with self._changed:
            while True:
                if self._error is not None:
                    msg = f"ingest into this source failed: {self._error}"
                    raise SourceError(msg)
                done = self._accepted.get(token, 0)
                if self._complete or offset + n <= done or self._below_floor(token):
                    self.rows_duplicate += n
                    return {"accepted": 0, "duplicate": n}
                if self._ended:
                    msg = (
                        f"rows {offset}..{offset + n} of {token} arrived after the end of input "
                        "was declared; the job's source no longer takes rows"
                    )
                    raise SourceError(msg)
                in_order = offset <= done
                has_room = self._rows == 0 or self._rows + n <= self.capacity_rows
                if in_order and has_room:
                    break
                waited = waited or not has_room
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = f"rows {done}..{offset} to arrive" if not in_order else "room"
                    msg = (
                        f"push of rows {offset}..{offset + n} of {token} waited "
                        f"{self.order_wait_s} s for {missing}; is the dataflow stuck?"
                    )
                    raise SourceError(msg)
                try:
                    await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
                except TimeoutError:
                    pass
            skip = done - offset
            if 0 < skip < n and batch.schema.names[-1] == KEY_GROUP_COLUMN:
                # a push sorted by key group is not in row order: its first `skip` rows in the
                # sorted order are not the rows already taken
                msg = (
                    f"rows {offset}..{offset + n} of {token} partly overlap rows this source took "
                    f"up to {done}, and the push is sorted by key group, so the rows already "
                    "taken cannot be cut off; a writer must start where the source stands "
                    "(resume_offset) or push unsorted rows"
                )
                raise SourceError(msg)
            fresh = batch.slice(skip) if skip else batch
            self._accepted[token] = offset + n
            self._advance(token)
            if fresh.num_rows:
                self._queue.append((token, done, fresh))
                self._rows += fresh.num_rows
                self.max_queued_rows = max(self.max_queued_rows, self._rows)
            self.rows_accepted += fresh.num_rows
            if batch.schema.names[-1] == KEY_GROUP_COLUMN:
                self.rows_presorted += fresh.num_rows
            self.rows_duplicate += skip
            self.waits += int(waited)
            self._changed.notify_all()
            return {"accepted": fresh.num_rows, "duplicate": skip}

    async def reserve(
        self, token: Token, offset: int, rows: int, allocate: Callable[[], Any]
    ) -> dict[str, Any]:
        """Direct push (:mod:`raystream.direct`): take rows ``offset .. offset + rows`` of piece
        ``token`` without their data. The writer sends them to the keyed instances itself, under
        the sequence numbers ``allocate()`` hands out on the source's output channels.

        Answers ``{"status": "ok", **allocated}`` (new rows: recorded as accepted *and* taken,
        so a checkpoint after this holds them), ``{"status": "again", **allocated}`` (the same
        rows were reserved before, by an attempt of this writer that may have died before its
        pushes landed: the same sequence numbers again, a receiver drops what it already has),
        ``{"status": "drop"}`` (rows a checkpoint or an earlier push already holds) or
        ``{"status": allocate()}`` when that is a string (``"reroute"``, ``"busy"``: nothing
        recorded; the caller decides). Waits, like :meth:`offer`, for the piece's earlier rows;
        no room check (the rows never enter this buffer; the receivers' inboxes bound them)."""
        if not isinstance(rows, int) or rows < 0 or not isinstance(offset, int) or offset < 0:
            msg = f"reserve expects int offset >= 0 and rows >= 0, got offset={offset!r} rows={rows!r}"
            raise SourceError(msg)
        deadline = time.monotonic() + self.order_wait_s
        async with self._changed:
            while True:
                if self._error is not None:
                    msg = f"ingest into this source failed: {self._error}"
                    raise SourceError(msg)
                again = self._reserved.get((token, offset))
                if again is not None and again[0] == rows:
                    self.rows_duplicate += rows
                    self.reservations_again += 1
                    return {"status": "again", **again[1]}
                if again is not None and again[0] < rows:
                    # an attempt that failed mid-partition reserved a shorter last piece here:
                    # the writer re-sends those rows under that reservation, then the rest
                    self.reservations_split += 1
                    return {"status": "split", "rows": again[0]}
                done = self._accepted.get(token, 0)
                if self._complete or offset + rows <= done or self._below_floor(token):
                    self.rows_duplicate += rows
                    return {"status": "drop"}
                if self._ended:
                    msg = (
                        f"rows {offset}..{offset + rows} of {token} were reserved after the end "
                        "of input was declared; the job's source no longer takes rows"
                    )
                    raise SourceError(msg)
                if offset == done:
                    break
                if offset < done:
                    msg = (
                        f"rows {offset}..{offset + rows} of {token} overlap rows this source "
                        f"took up to {done} under other pushes; a direct writer must re-send "
                        "its piece cut the same way (deterministic input, same push_rows)"
                    )
                    raise SourceError(msg)
                left = deadline - time.monotonic()
                if left <= 0:
                    msg = (
                        f"reservation of rows {offset}..{offset + rows} of {token} waited "
                        f"{self.order_wait_s} s for rows {done}..{offset}; is the writer stuck?"
                    )
                    raise SourceError(msg)
                try:
                    await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
                except TimeoutError:
                    pass
            got = allocate()  # synchronous: nothing runs between this and the record below
            if isinstance(got, str):
                return {"status": got}
            self._accepted[token] = offset + rows
            self._advance(token)
            self._took(token, offset + rows)
            self._reserved[(token, offset)] = (rows, got)
            self.rows_accepted += rows
            self.rows_reserved += rows
            self._changed.notify_all()
            return {"status": "ok", **got}

    def resume_offset(self, token: Token) -> int:
        """Where a writer of ``token`` starts pushing: the rows before are taken (0 when the
        piece is done anyway, so every push is dropped as before)."""
        if self._complete or self._below_floor(token):
            return 0
        return self._accepted.get(token, 0)

    def _below_floor(self, token: Token) -> bool:
        return _batch_id(token) is not None and token[1] < self._floor.get(token[0], -1)

    def _advance(self, token: Token) -> None:
        """A push of batch ``b`` of a stream means Spark committed ``b - 1``: batches before
        ``b - 1`` can no longer be replayed; keep one more for pushes still in flight."""
        b = _batch_id(token)
        if b is None or b <= self._newest.get(token[0], -1):
            return
        stream = token[0]
        self._newest[stream] = b
        floor = b - 1
        if floor > self._floor.get(stream, -1):
            self._floor[stream] = floor
            for t in [
                t
                for t in self._accepted
                if t[0] == stream and _batch_id(t) is not None and t[1] < floor
            ]:
                del self._accepted[t]
            for key in [k for k in self._reserved if k[0][0] == stream and self._below_floor(k[0])]:
                del self._reserved[key]

    def _conform(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        if not isinstance(batch, pa.RecordBatch):
            msg = f"ingest expects a pyarrow.RecordBatch, got {type(batch).__name__}"
            raise SchemaError(msg)
        names = batch.schema.names
        schema = self.schema
        if names and names[-1] == KEY_GROUP_COLUMN:  # sorted by key group by its writer
            schema = schema.append(batch.schema.field(len(names) - 1))
        if names != schema.names:
            msg = (
                f"ingested batch has columns {names}, expected {self.schema.names} "
                "(the schema the source was defined with)"
            )
            raise SchemaError(msg)
        if not batch.schema.equals(schema):
            try:
                batch = batch.cast(schema)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                msg = (
                    f"ingested batch has schema {batch.schema}, which does not cast to "
                    f"{schema}: {e}"
                )
                raise SchemaError(msg) from e
        return batch

    async def end(self) -> None:
        """No more rows: the reader drains what is queued, then sees the end."""
        async with self._changed:
            self._ended = True
            self._changed.notify_all()

    async def fail(self, reason: str) -> None:
        """The writer side failed: the reader raises ``SourceError(reason)``."""
        async with self._changed:
            self._error = reason
            self._changed.notify_all()

    # ---- the reader (the source instance) ---------------------------------------------------
    async def read(self, max_rows: int, timeout_s: float) -> pa.RecordBatch | None:
        """Up to ``max_rows`` queued rows; an empty batch if none arrived within ``timeout_s``;
        ``None`` once the input ended and everything was read."""
        async with self._changed:
            if not self._queue and not self._ended and self._error is None:
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout_s)
                except TimeoutError:
                    pass
            if self._error is not None:
                msg = f"ingest into this source failed: {self._error}"
                raise SourceError(msg)
            if not self._queue:
                return None if self._ended else _empty(self.schema)
            parts: list[pa.RecordBatch] = []
            got = 0
            while self._queue and got < max_rows:
                token, start, head = self._queue[0]
                take = min(head.num_rows, max_rows - got)
                if take == head.num_rows:
                    self._queue.popleft()
                    parts.append(head)
                else:
                    parts.append(head.slice(0, take))
                    self._queue[0] = (token, start + take, head.slice(take))
                self._took(token, start + take)
                got += take
            self._rows -= got
            self._changed.notify_all()
            if len(parts) == 1:
                return parts[0]
            if any(not p.schema.equals(parts[0].schema) for p in parts[1:]):
                # writers differ in sorting by key group: the rows without, routed the usual way
                parts = [take_key_groups(p)[0] for p in parts]
            return pa.concat_batches(parts)

    def _took(self, token: Token, upto: int) -> None:
        """The reader took rows of ``token`` up to offset ``upto``. Rows are queued in the order
        writers delivered them and a stream's batch ``b`` is pushed only after ``b - 1`` was
        accepted whole, so once rows of ``b`` were taken every batch before it was taken whole:
        its pieces need no record below ``b - 1`` (the same floor :meth:`offer` keeps)."""
        self._emitted[token] = max(self._emitted.get(token, 0), upto)
        b = _batch_id(token)
        if b is not None and b > self._emitted_newest.get(token[0], -1):
            self._emitted_newest[token[0]] = b
            _forget_below(self._emitted, token[0], b - 1)

    # ---- checkpoints ------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        """What went downstream so far, JSON-able: per token the rows taken, per stream the
        newest batch id taken (batches two below it are complete and dropped when re-sent)."""
        return {
            "pieces": [[list(t), n] for t, n in self._emitted.items()],
            "newest": [[s, b] for s, b in self._emitted_newest.items()],
        }

    def restore_complete(self) -> None:
        """The checkpoint was taken after this source's input ended and was read whole: every
        re-sent row is a duplicate."""
        self._complete = True
        self._ended = True

    def restore(self, state: dict[str, Any]) -> None:
        """Start from a checkpoint's :meth:`checkpoint_state`: rows it covers are duplicates,
        every row after them is taken again. Only before the first row came in."""
        if self._accepted or self._queue or self.rows_accepted:
            msg = "a push source's checkpoint state can only be restored before rows came in"
            raise SourceError(msg)
        try:
            pieces = {_token(t): int(n) for t, n in state.get("pieces", [])}
            newest = {_hashable(s): int(b) for s, b in state.get("newest", [])}
        except (TypeError, ValueError) as e:
            msg = (
                "the checkpoint's state of this push source is malformed (expected "
                f"{{'pieces': [[token, rows], ...], 'newest': [[stream, batch], ...]}}): {e}"
            )
            raise SourceError(msg) from None
        self._accepted = dict(pieces)
        self._emitted = dict(pieces)
        self._emitted_newest = dict(newest)
        self._newest = dict(newest)
        self._floor = {s: b - 1 for s, b in newest.items()}

    async def wait_taken(self, pieces: dict[Token, int], timeout_s: float) -> bool:
        """Wait until the reader took ``pieces[token]`` rows of every token (or the piece's batch
        fell below its stream's floor: taken whole); False on timeout."""
        deadline = time.monotonic() + timeout_s
        async with self._changed:
            while True:
                if all(self._covered(t, n) for t, n in pieces.items()):
                    return True
                if self._error is not None:
                    msg = f"ingest into this source failed: {self._error}"
                    raise SourceError(msg)
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                try:
                    await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
                except TimeoutError:
                    pass

    def _covered(self, token: Token, rows: int) -> bool:
        b = _batch_id(token)
        if b is not None and b < self._emitted_newest.get(token[0], -1):
            return True
        return self._emitted.get(token, 0) >= rows

    def stats(self) -> dict[str, int]:
        return {
            "rows_accepted": self.rows_accepted,
            "rows_presorted": self.rows_presorted,
            "rows_duplicate": self.rows_duplicate,
            "rows_reserved": self.rows_reserved,  # direct push: rows that never passed here
            "reservations_split": self.reservations_split,
            "reservations_again": self.reservations_again,
            "queued_rows": self._rows,
            "max_queued_rows": self.max_queued_rows,
            "pieces": len(self._accepted),
            "backpressure_waits": self.waits,
        }


def _batch_id(token: Token) -> int | None:
    """The batch id of a ``(stream, batch id, partition)`` token; None for other shapes."""
    if len(token) == 3 and isinstance(token[1], int) and not isinstance(token[1], bool):
        return token[1]
    return None


def _forget_below(table: dict[Token, int], stream: Hashable, floor: int) -> None:
    for t in [t for t in table if t[0] == stream and _batch_id(t) is not None and t[1] < floor]:
        del table[t]


def _hashable(value: Any) -> Hashable:
    """JSON turned tuples into lists: back to tuples (a stream or token part may be one)."""
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value  # type: ignore[no-any-return]


def _token(value: Any) -> Token:
    if not isinstance(value, (list, tuple)):
        msg = f"a token is a list, got {value!r}"
        raise TypeError(msg)
    return tuple(_hashable(v) for v in value)


def _empty(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([], schema=schema)


# --------------------------------------------------------------------------------------------
# the source spec and its reader


class PushReader:
    """The reader side of a push source: the source instance awaits :meth:`aread`."""

    def __init__(self, buffer: IngestBuffer) -> None:
        self.buffer = buffer

    async def aread(self, max_rows: int, timeout_s: float) -> pa.RecordBatch | None:
        return await self.buffer.read(max_rows, timeout_s)

    def read(self, max_rows: int) -> pa.RecordBatch | None:  # the SourceReader protocol
        msg = "a push source is read with aread() by its source instance"
        raise SourceError(msg)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class PushSource:
    """A source whose rows outside writers push into the running job (see the module doc).

    Each source instance is a named actor (:func:`raystream.runtime.actors.source_actor_name`)
    with ``ingest(token, offset, batch)``, ``end_ingest()`` and ``fail_ingest(reason)``. The job
    ends when every instance was told the input ended. Spark sources build on this.
    """

    arrow_schema: pa.Schema
    capacity_rows: int = 400_000

    def __post_init__(self) -> None:
        if not isinstance(self.arrow_schema, pa.Schema):
            msg = f"a push source needs a pyarrow.Schema, got {type(self.arrow_schema).__name__}"
            raise ConfigError(msg)
        if not isinstance(self.capacity_rows, int) or self.capacity_rows < 1:
            msg = f"capacity_rows must be an int >= 1 (rows buffered per source instance), got {self.capacity_rows!r}"
            raise ConfigError(msg)

    def schema(self) -> pa.Schema:
        return self.arrow_schema

    def open(self, index: int, parallelism: int) -> PushReader:
        return PushReader(IngestBuffer(self.arrow_schema, capacity_rows=self.capacity_rows))

    @property
    def rate_eps(self) -> float:
        return 0.0

    def describe(self) -> str:
        return f"rows pushed in ({', '.join(self.arrow_schema.names)})"


def push(schema: pa.Schema, *, capacity_rows: int = 400_000) -> PushSource:
    """A source fed by outside writers through the source actors' ``ingest`` calls."""
    return PushSource(schema, capacity_rows)


# --------------------------------------------------------------------------------------------
# feeders: driver-side drivers of outside writers (a Spark job, a streaming query)


@dataclass(frozen=True)
class FeedContext:
    """What a feeder needs to reach a running job's source instances."""

    job: str
    step: str
    parallelism: int  # source instances; writer piece ``p`` goes to instance ``p % parallelism``
    ray_address: str  # the GCS address writers connect to (``ray.init(address=...)``)
    namespace: str
    auth_mode: str | None = None  # the driver's RAY_AUTH_MODE; the token itself never travels
    # set when the step after the source partitions by a key column: writers sort each push by
    # key group so the source instance only cuts it (raystream.presort)
    key_groups: KeyGroupPlan | None = None
    # with key_groups set: writers send the rows to the keyed step themselves, the source only
    # hands out sequence numbers (raystream.direct)
    direct: bool = False
    direct_rows: int = 0  # rows per reservation of a direct writer (0: its push_rows)


@runtime_checkable
class Feeder(Protocol):
    """Feeds one push source from the driver; started by ``rs.start`` after the deploy."""

    error: str | None

    def stop(self) -> None:
        """Stop feeding now (the job is stopping or failed)."""
        ...

    def join(self, timeout_s: float | None = None) -> None: ...
