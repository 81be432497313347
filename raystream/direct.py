"""Direct push: writers (Spark tasks) send rows straight to the first keyed step; the source
instance stays the sequencer, the rows bypass it.

When the step after a push source is a key partitioning (``key_by(column)``), a writer does the
routing itself. For each push it

1. sorts the rows by key group (:func:`raystream.presort.sort_by_key_group`), stamps them as
   the source would (ingest time, event time) and cuts them into runs of equal owner under the
   source's routing table (:func:`cut`);
2. asks the source instance for sequence numbers: ``reserve(token, offset, rows, version,
   pieces)``, a small call without data. The source checks its dedupe table as for a pushed
   batch (:meth:`raystream.ingest.IngestBuffer.reserve`), takes the next sequence number of its
   output channel to each piece's keyed instance and records the rows as taken, so a checkpoint
   barrier it sends later (a later sequence number on every channel) holds them;
3. pushes each piece to its keyed instance as ``push((source step, index), seq, rows)``: the
   instance's inbox orders pushes by sequence number per channel, so the rows sit between the
   source's own barriers, watermarks and end of input exactly where the source would have put
   them.

A writer that dies after reserving leaves a gap in a channel's sequence numbers; the receiver
waits at the gap (what comes after it, barriers included, waits too) until the retried writer
reserves the same rows again: it gets the *same* sequence numbers and row ranges back
(``"again"``), sends them, and a receiver drops a sequence number it already has. A routing
table is versioned by the source; a writer whose version is stale (a rescale barrier passed the
source in between) gets ``"reroute"`` with the new table and cuts again; what it reserved before
had lower sequence numbers than the barrier, like rows the source had routed itself before it.

This module holds the parts without Ray: the writer's view of a route and its cutting, and the
source's sequencer (:class:`DirectSequencer`, driven by a source
:class:`~raystream.runtime.instance.OperatorInstance`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from raystream.errors import SourceError
from raystream.keys import RoutingTable
from raystream.presort import owner_runs

if TYPE_CHECKING:
    from raystream.ingest import IngestBuffer, Token
    from raystream.runtime.channels import OutputChannel

__all__ = ["DirectSequencer", "Piece", "Route", "cut"]

Range = tuple[int, int]
# a piece of a push: routing index of its receiver and its rows' ranges in the push (sorted by
# key group, so one range per run of equal owners)
Piece = tuple[int, list[Range]]

# more runs than this per receiver: the pieces of one receiver are sent as one push of several
# ranges instead of one push per run
MAX_RUNS_PER_RECEIVER = 4


@dataclass(frozen=True)
class Route:
    """A writer's view of the source's routing: version, owner per key group, the receivers'
    channel ids (routing index -> id), the channel the source sends on, and the event-time
    column the source stamps (None: ingest time)."""

    version: int
    owners: np.ndarray
    receivers: tuple[tuple[str, int], ...]
    sender: tuple[str, int]
    event_column: str | None = None

    @property
    def table(self) -> RoutingTable:
        return RoutingTable(self.version, self.owners, len(self.receivers))

    @staticmethod
    def of(answer: dict[str, Any]) -> Route:
        return Route(
            int(answer["version"]),
            np.asarray(answer["owners"], dtype=np.int32),
            tuple(tuple(r) for r in answer["receivers"]),  # type: ignore[misc]
            tuple(answer["sender"]),  # type: ignore[arg-type]
            answer.get("event_column"),
        )


def cut(kg: np.ndarray, route: Route) -> list[Piece]:
    """The pieces of a push whose rows have key groups ``kg`` (sorted by key group): one per run
    of equal owners, or one per receiver (several ranges) when runs are many."""
    runs = owner_runs(kg, route.table)
    if len(runs) <= MAX_RUNS_PER_RECEIVER * len(route.receivers):
        return [(r, [(s, e)]) for r, s, e in runs]
    per: dict[int, list[Range]] = {}
    for r, s, e in runs:
        per.setdefault(r, []).append((s, e))
    return sorted(per.items())


def rows_of(batch: pa.RecordBatch, ranges: list[Range]) -> pa.RecordBatch:
    """The rows of ``ranges`` of ``batch``, in order (zero-copy for one range)."""
    if len(ranges) == 1:
        s, e = ranges[0]
        return batch.slice(s, e - s)
    return pa.concat_batches([batch.slice(s, e - s) for s, e in ranges])


class DirectSequencer:
    """The source's side of direct push: hands out sequence numbers on its output channels for
    rows writers send themselves (see the module doc).

    ``output()`` gives the current routing table and output channels (routing index ->
    channel; a rescale changes both), None once direct push no longer applies (a rewire put a
    step between: writers then push rows to the source); ``on_rows(rows, max_event_ms)`` is called, inside the
    allocation, for the rows reserved (the source's metrics and watermarks)."""

    def __init__(
        self,
        buffer: IngestBuffer,
        sender: tuple[str, int],
        output: Callable[[], tuple[RoutingTable, list[OutputChannel]] | None],
        on_rows: Callable[[int, int | None], None],
        event_column: str | None = None,
    ) -> None:
        self.buffer = buffer
        self.sender = sender
        self.version = 0
        self.event_column = event_column
        self._output = output
        self.on_rows = on_rows
        self._held = 0  # barriers being sent now: no reservation gets a sequence number
        self._free = asyncio.Event()
        self._free.set()
        self.reroutes = 0
        self.busy_waits = 0

    # ---- the source's barriers --------------------------------------------------------------
    def hold(self, reroute: bool) -> None:
        """A barrier is being sent on the outputs: reservations wait until :meth:`release`
        (none gets a sequence number between the barrier's on two channels, nor between the
        barrier and the dedupe table the checkpoint records). ``reroute``: the routing or the
        receivers change with it (rescale, rewire); writers must fetch the new route."""
        self._held += 1
        self._free.clear()
        if reroute:
            self.version += 1

    def release(self) -> None:
        self._held -= 1
        if self._held == 0:
            self._free.set()

    # ---- writers ----------------------------------------------------------------------------
    @property
    def channels(self) -> list[OutputChannel]:
        out = self._output()
        return [] if out is None else out[1]

    def route(self) -> dict[str, Any]:
        out = self._output()
        if out is None:
            return {"status": "source"}
        table, channels = out
        return {
            "status": "reroute",
            "version": self.version,
            "owners": table.owners,
            "receivers": [c.receiver for c in channels],
            "sender": self.sender,
            "event_column": self.event_column,
        }

    async def reserve(
        self,
        token: Token,
        offset: int,
        rows: int,
        version: int,
        pieces: list[Piece],
        max_event_ms: int | None = None,
    ) -> dict[str, Any]:
        """Sequence numbers for ``pieces`` of rows ``offset .. offset + rows`` of ``token`` cut by
        routing ``version`` (see :meth:`IngestBuffer.reserve` for the answers)."""
        while True:
            await self._free.wait()
            if version != self.version or self._output() is None:
                self.reroutes += 1
                return self.route()
            if sum(e - s for _, ranges in pieces for s, e in ranges) != rows:
                msg = (
                    f"the pieces of rows {offset}..{offset + rows} of {token} do not add up to "
                    f"{rows} rows: {pieces}"
                )
                raise SourceError(msg)
            pending = [c for c in self.channels if c._pending]
            for c in pending:  # rows the source routed itself go first
                await c.flush()
            if pending:
                continue

            def allocate() -> Any:
                if self._held or version != self.version:
                    return "retry"
                if any(c._pending for c in self.channels):
                    return "retry"
                out = []
                for index, ranges in pieces:
                    c = self.channels[index]
                    n = sum(e - s for s, e in ranges)
                    out.append((c.receiver, c.reserve_seq(n), ranges))
                self.on_rows(rows, max_event_ms)
                return {"pieces": out}

            got = await self.buffer.reserve(token, offset, rows, allocate)
            if got["status"] != "retry":
                return got
            self.busy_waits += 1
            await asyncio.sleep(0)

    def stats(self) -> dict[str, Any]:
        return {
            "direct": True,
            "routing_version": self.version,
            "reroutes": self.reroutes,
            "busy_waits": self.busy_waits,
        }



class DirectWriter:
    """A writer's side of direct push (one Spark task's partition): reserve at ``source`` (a
    source instance's handle), push the pieces to the keyed instances, at most
    ``max_inflight`` pushes' pieces unacknowledged. ``gone(what)`` makes the error raised when
    an instance died (the job ended or recovers)."""

    def __init__(
        self,
        source: Any,
        token: Token,
        attempt: int | None,
        gone: Callable[[str], Exception],
        max_inflight: int = 2,
    ) -> None:
        self.source = source
        self.token = token
        self.attempt = attempt
        self.gone = gone
        self.max_inflight = max_inflight
        self.route: Route | None = None
        self.handles: list[Any] = []
        self._inflight: deque[tuple[list[Any], bool]] = deque()
        self.pushes = 0
        self.duplicate_pushes_lost = 0  # re-sent pieces whose receiver had retired (delivered)

    def push(
        self,
        offset: int,
        batch: pa.RecordBatch,
        recut: Callable[[int, int], pa.RecordBatch] | None = None,
    ) -> dict[str, int] | None:
        """Rows ``offset ..`` of the token (``batch`` sorted by key group, with its key-group
        column): accepted/duplicate rows, or None when the source takes no direct pushes (the
        caller pushes the rows to it). ``recut(lo, hi)``: rows ``lo .. hi`` of this piece in
        row order, sorted by key group (for a "split": an attempt that failed mid-partition
        reserved a shorter piece at ``offset``; its rows go again under that reservation)."""
        import ray

        from raystream.presort import take_key_groups
        from raystream.runtime.instance import _stamp

        rest, kg = take_key_groups(batch)
        if kg is None:
            return None
        n = rest.num_rows
        ingest_ns = np.full(n, time.time_ns(), np.int64)
        stamped: pa.RecordBatch | None = None
        max_event: int | None = None
        while True:
            route = self.route
            if route is not None and stamped is None:
                event_ms = None
                if route.event_column is not None:
                    from raystream.runtime.watermarks import event_time_ms

                    event_ms = event_time_ms(rest, route.event_column)
                    max_event = int(event_ms.max()) if n else None
                stamped = _stamp(rest, ingest_ns, event_ms)
            pieces = cut(kg, route) if route is not None else [(0, [(0, n)])]
            version = route.version if route is not None else -1
            try:
                ans = ray.get(
                    self.source.reserve.remote(
                        self.token, offset, n, version, pieces, self.attempt, max_event
                    )
                )
            except ray.exceptions.RayActorError:
                raise self.gone("the source instance died during a reservation") from None
            status = ans["status"]
            if status == "reroute":
                self.route = Route.of(ans)
                self.handles = ans["handles"]
                if route is None or route.event_column != self.route.event_column:
                    stamped = None
                continue
            if status == "source":
                return None
            if status == "drop":
                return {"accepted": 0, "duplicate": n}
            if status == "split":
                head = int(ans["rows"])
                if recut is None or not 0 < head < n:
                    msg = f"rows {offset}..{offset + n} of {self.token}: cannot cut at {head}"
                    raise SourceError(msg)
                first = self.push(offset, recut(0, head), recut)
                rest = self.push(
                    offset + head, recut(head, n), lambda lo, hi: recut(head + lo, head + hi)
                )
                if first is None or rest is None:  # the source took direct pushes a moment ago
                    msg = f"source instance of {self.token} stopped taking direct pushes"
                    raise SourceError(msg)
                return {k: first[k] + rest[k] for k in ("accepted", "duplicate")}
            again = status == "again"
            assert stamped is not None and self.route is not None
            handles = ans["handles"] if again else [self.handles[i] for i, _ in pieces]
            sender = self.route.sender
            refs = [
                h.push.remote(
                    sender, seq, rows_of(stamped, [tuple(r) for r in ranges]), self.attempt
                )
                for (_, seq, ranges), h in zip(ans["pieces"], handles, strict=True)
                if h is not None  # a receiver gone from the source's map retired: it had them
            ]
            self.pushes += len(refs)
            self._inflight.append((refs, again))
            self._settle(self.max_inflight)
            return {"accepted": 0, "duplicate": n} if again else {"accepted": n, "duplicate": 0}

    def _settle(self, keep: int) -> None:
        import ray

        while len(self._inflight) > keep:
            refs, again = self._inflight.popleft()
            for ref in refs:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    if not again:
                        raise self.gone("a keyed instance died during a direct push") from None
                    # a re-sent piece: an instance that retired got it before it retired (its
                    # end of input came after it); a dead one fails the job anyway
                    self.duplicate_pushes_lost += 1

    def close(self) -> None:
        """Wait until every push was acknowledged."""
        self._settle(0)
