"""The migration engine inside one keyed operator instance (no Ray here).

It knows which global sub-groups (``key_group * sub_groups + sub_group``) the instance holds,
which it will receive and from whom, and which it must hand out. Protocol, per rescale epoch:

* ``prepare``: the controller says what moves (before the barrier is injected).
* ``activate`` (first rescale barrier on any input): from now on records of sub-groups that are
  assigned here but not here yet are buffered per sub-group, in arrival order, and fetched.
* ``seal`` (the barrier on every input): no record of an outgoing sub-group can still arrive, so
  outgoing sub-groups may be handed out (``serve``); requests that came earlier wait for this.
* New owners pull: on demand when a record needs a sub-group, in the background hottest first,
  or all at once, as the strategy's :class:`FetchPolicy` says. A sub-group comes in chunks of at
  most ``chunk_bytes`` (one ``serve`` call each, resumed where the last stopped), with at most
  ``inflight_chunks`` calls outstanding per (new owner, old owner) pair. Calls are few: an
  on-demand fetch asks for its sub-groups and then for every other sub-group of that old owner
  not asked for yet (they fill the chunk's room, at most ``RIDER_ROOM_BYTES``; what does not
  fit follows as a bulk pull), and before each call the sub-groups with records waiting here go
  first, then the hottest, by runs of consecutive sub-groups (one iterator each at the old
  owner). A chunk is filled in the order asked and sent in key order (one
  Arrow batch per key range read, each sorted).
* The old owner serves one chunk at a time, on-demand requests before background pulls (the
  requests queued meanwhile back to back, for up to ``SERVE_BURST_S``). Serving runs on the
  event loop ``serve`` is called from: under Ray a loop of its own, in its own thread (the
  actor's ``transfer`` concurrency group), so a request is answered while the instance's loop
  processes records, and no chunk waits for a slice of them. Once sealed (its fences sent), the
  sub-groups it hands out are evicted from its write-back cache (on the instance's loop, once;
  the rest of its cache stays) and are never written here again, so the serving thread reads
  them from RocksDB while the instance goes on; what changes the instance's own bookkeeping
  (held, outgoing, dropping the range, handed-over records) runs back on the instance's loop.
* A sub-group is released (its buffered records processed, then new ones directly) when it
  arrived, or with ``hold="all_moved"`` when every incoming sub-group arrived; at an instance
  that also hands sub-groups out in the same step, not before it sealed.
* Order downstream: at the seal an old owner sends a ``Fence`` on every output; a new owner sends
  ``AfterFences`` (naming its old owners) before its first output made from moved state, and a
  receiver holds the new owner's channel from there until it has read those fences
  (:mod:`raystream.runtime.channels`). Nobody waits for an acknowledgement: an old owner hands
  out state as soon as it sealed. An instance that both receives and hands out releases what it
  received only once sealed, so its own fence precedes its mark on every channel.
* Heat (what hot-first orders by) is a decaying rate per sub-group (:class:`DecayingHeat`).
* Queued work moves with the state: a rescale barrier overtakes the old owner's queued batches,
  and the records of outgoing sub-groups in them (sent before the barrier, not applied) are held
  back (``hold_back``) and handed out with the chunk that completes their sub-group; the new owner
  applies the state, then those records (per channel, in order), then the records it buffered.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from raystream.errors import StateError
from raystream.rescale import FetchPolicy
from raystream.runtime.memory import PeakRss

__all__ = [
    "HANDOVER_META",
    "DecayingHeat",
    "MigrationEngine",
    "MigrationTask",
    "PrioritySlots",
    "contiguous_runs",
    "pair_rates",
    "transfer_summary",
]

# the old owner serves queued requests back to back for up to this long before records run again
SERVE_BURST_S = 0.02
# transfer first: while another thread serves moved state, the instance's loop waits up to this
# long (without the GIL) before each slice of its records, so the serving thread has the process
TRANSFER_FIRST_S = 0.05
# an on-demand chunk that carries other sub-groups along is at most this large (or chunk_bytes)
RIDER_ROOM_BYTES = 256 << 10
# a bulk pull deals a pair's sub-groups out to its calls in runs of consecutive sub-groups (one
# iterator each at the old owner), about this many per call: even shares, hot-first roughly kept
RUNS_PER_CALL = 4
# schema metadata of a batch of records handed over with a sub-group's state: its sub-group
HANDOVER_META = b"raystream.handover"

# fetch(owner_index, epoch, sub_groups, max_bytes, urgent) -> (completed sub-groups, chunks)
Fetcher = Callable[
    [int, int, list[int], int, bool], Awaitable[tuple[list[int], list[pa.RecordBatch]]]
]


class DecayingHeat:
    """Records per second per sub-group, exponentially decayed: a record counts half after
    ``half_life_s``, so the heat says what is hot now, not since the instance started."""

    def __init__(
        self, size: int, half_life_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not half_life_s > 0:
            msg = f"heat half-life must be > 0 seconds, got {half_life_s!r}"
            raise StateError(msg)
        self.half_life_s = float(half_life_s)
        self.clock = clock
        self.counts = np.zeros(size, dtype=np.float64)  # decayed counts as of self._at
        self._at = clock()

    def _decay_to(self, now: float) -> None:
        dt = now - self._at
        if dt > 0:
            self.counts *= 0.5 ** (dt / self.half_life_s)
            self._at = now

    def add(self, sub_group: np.ndarray, records: np.ndarray | None = None) -> None:
        """Count one record per entry of ``sub_group`` (global sub-group ids), now; or
        ``records[i]`` records for entry ``i`` (e.g. per distinct key of a batch)."""
        self._decay_to(self.clock())
        self.counts += np.bincount(sub_group, weights=records, minlength=len(self.counts))

    def rate(self) -> np.ndarray:
        """Records per second per sub-group now (decayed count x ln 2 / half-life: a steady
        rate r reads r once the stream ran for a few half-lives)."""
        self._decay_to(self.clock())
        return self.counts * (math.log(2) / self.half_life_s)


class PrioritySlots:
    """``size`` slots; waiters that are ``urgent`` get a free slot before the others, in
    arrival order within each class; ``reserved`` of the slots are for urgent waiters only (so
    an on-demand fetch never waits for a background call to come back)."""

    def __init__(self, size: int, reserved: int = 0) -> None:
        if not 0 <= reserved < size:
            msg = f"reserved slots must be in [0, {size}), got {reserved}"
            raise StateError(msg)
        self.size = size
        self.reserved = reserved
        self.used = 0
        self.max_used = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def _free_for(self, urgent: bool) -> bool:
        return self.used < (self.size if urgent else self.size - self.reserved)

    async def acquire(self, urgent: bool) -> None:
        if self._free_for(urgent) and not (
            self._waiters and self._waiters[0][0] <= int(not urgent)
        ):
            self._take()
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (0 if urgent else 1, next(self._seq), fut))
        await fut  # the slot was taken for us by release()

    def _take(self) -> None:
        self.used += 1
        self.max_used = max(self.max_used, self.used)

    def release(self) -> None:
        self.used -= 1
        while self._waiters:
            urgent_first, _, fut = self._waiters[0]
            if fut.done():  # cancelled
                heapq.heappop(self._waiters)
                continue
            if not self._free_for(urgent_first == 0):
                return  # the first in line cannot go: nobody behind it can
            heapq.heappop(self._waiters)
            self._take()
            fut.set_result(None)


@dataclass
class _ServeRequest:
    urgent: bool
    groups: list[int]
    max_bytes: int
    arrived_at: float
    future: asyncio.Future[tuple[list[int], list[pa.RecordBatch]]]
    arrived_wall: float = 0.0


@dataclass
class MigrationTask:
    """This instance's part of one rescale step."""

    epoch: int
    policy: FetchPolicy
    incoming: dict[int, int]  # sub-group -> old owner index
    outgoing: set[int]
    # old owner routing index -> its instance index (its channels' ids downstream; another
    # number after a move); absent: the same
    owner_ids: dict[int, int] = field(default_factory=dict)
    heat: dict[int, float] = field(default_factory=dict)  # sub-group -> records/s (decayed)
    active: bool = False
    sealed: asyncio.Event = field(default_factory=asyncio.Event)
    # old owner: a Fence went out on every output after all it made before the seal (set with
    # the seal; a receiver fed by a new owner too reads up to it before the new owner's output)
    fenced: asyncio.Event = field(default_factory=asyncio.Event)
    fence_ms: float | None = None  # milliseconds sending the fences took
    hands_out: bool = False  # sub-groups were to go out from here (``outgoing`` empties)
    # old owner of a move by files (raystream.runtime.move_files): its whole state goes as
    # RocksDB files and the rows changed since, read through its cache, which is then dropped
    # (nothing is evicted at the seal)
    by_files: bool = False
    # old owner: sealed, fenced and the outgoing sub-groups evicted: state may go out (set on
    # the instance's loop, read by the serving loop, which may run in another thread)
    ready: threading.Event = field(default_factory=threading.Event)
    served: set[int] = field(default_factory=set)  # old owner: sub-groups handed out in full
    # serving loops waiting for ``ready``: (loop, future), woken from the instance's loop
    ready_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = field(
        default_factory=list
    )
    # old owner: the serve calls of this step waiting for a chunk (a heap: urgent first, then
    # in arrival order) and the loop serving them, woken by ``serve_wake``. They belong to the
    # step, not the engine: a call of the next step may come (on the transfer thread) while
    # the instance's loop is still inside ``prepare``
    serve_queue: list[tuple[int, int, _ServeRequest]] = field(default_factory=list)
    server: asyncio.Task[Any] | None = None
    serve_wake: asyncio.Event | None = None
    # this process's resident memory from the switch here to the end of the move (bytes)
    rss: PeakRss | None = None
    activated_at: float = 0.0
    requested: set[int] = field(default_factory=set)
    arrived: set[int] = field(default_factory=set)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    on_demand_fetches: int = 0
    fetch_calls: int = 0  # serve calls made (new owner)
    bytes_in: int = 0
    bytes_out: int = 0
    rows_in: int = 0
    fetch_wait_ms: list[float] = field(default_factory=list)
    finished_at: float | None = None
    # old owner: where each partly served sub-group continues; chunks handed out; the wait of
    # each on-demand request from the seal (or its arrival, if later) to its chunk, in order
    cursors: dict[int, bytes] = field(default_factory=dict)
    sealed_at: float = 0.0
    evicted: bool = False
    chunks_out: int = 0
    max_chunk_bytes: int = 0
    serve_wait_ms: list[float] = field(default_factory=list)
    export_s: float = 0.0  # old owner: seconds spent reading chunks out of RocksDB
    import_s: float = 0.0  # new owner: seconds spent writing chunks into RocksDB
    fetch_rtt_ms: list[float] = field(default_factory=list)  # new owner: per serve call
    # new owner: most serve calls outstanding to one old owner at once
    max_inflight_chunks: int = 0
    # queued records handed over with their sub-group (old owner: out; new owner: in)
    handover_rows_out: int = 0
    handover_rows_in: int = 0
    # wall-clock seconds (time.time) of the switch here, the seal, the first on-demand chunk out
    activated_wall: float | None = None
    sealed_wall: float | None = None
    first_urgent_served_wall: float | None = None
    all_arrived_wall: float | None = None  # new owner: the last incoming sub-group arrived
    finished_wall: float | None = None
    # old owner: sealed, fenced and evicted: from then on it hands out state
    ready_wall: float | None = None
    # new owner: when it first ran released records, how many ran before it went back to its
    # inputs (the backlog that waited for state), how old the oldest of them was (ms since its
    # ingest) and when that backlog was done (set after the task is done: in the instance's
    # final metrics, not in the move's record)
    first_release_wall: float | None = None
    first_release_rows: int = 0
    first_release_age_ms: float | None = None
    first_drained_wall: float | None = None
    # new owner, per old owner: state bytes taken in and when its last chunk arrived
    pair_bytes_in: dict[int, int] = field(default_factory=dict)
    pair_last_in_wall: dict[int, float] = field(default_factory=dict)
    # new owner, per serve call: wall-clock times it was made, answered (back on this loop) and
    # its chunk imported, whether urgent, sub-groups completed, handed-over rows it carried
    fetch_log: list[tuple[float, float, float, bool, int, int]] = field(default_factory=list)
    # old owner, per serve call: wall-clock times it came and was answered, whether urgent
    serve_log: list[tuple[float, float, bool]] = field(default_factory=list)


class MigrationEngine:
    """Held / incoming / outgoing sub-groups of one instance, and the records waiting for state."""

    def __init__(
        self,
        backend: Any,
        num_key_groups: int,
        sub_groups: int,
        owned_key_groups: Any,
        *,
        max_pending_bytes: int = 64 << 20,
        heat_half_life_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.sub_groups = sub_groups
        self.held = np.zeros(num_key_groups * sub_groups, dtype=bool)
        for kg in owned_key_groups:
            self.held[int(kg) * sub_groups : (int(kg) + 1) * sub_groups] = True
        self.heat = DecayingHeat(num_key_groups * sub_groups, heat_half_life_s, clock)
        self.task: MigrationTask | None = None
        self.pending: dict[int, list[pa.RecordBatch]] = {}
        self.pending_since: dict[int, float] = {}
        self.pending_rows = 0
        self.pending_bytes = 0
        self.max_pending_bytes = max_pending_bytes
        self._slots: dict[int, PrioritySlots] = {}  # per old owner: serve calls outstanding
        self._serve_seq = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None  # the instance's loop
        self._ready_lock = threading.Lock()
        self._serve_idle = threading.Event()  # no request being served or queued (once ready)
        self._serve_idle.set()
        self._releasable: list[int] = []
        self.fetcher: Fetcher | None = None
        self.poke: Callable[[], None] = lambda: None
        # called once this instance's part of a migration step is done (tells the controller)
        self.on_done: Callable[[MigrationTask], None] = lambda task: None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._released = asyncio.Event()
        # old owner: pre-barrier records of outgoing sub-groups, not applied, to hand out
        self.handover: dict[int, list[pa.RecordBatch]] = {}
        self.handover_rows = 0
        self.handed_in_rows = 0  # handed-over records taken in here, not yet in records_in

    # ---- record path -----------------------------------------------------------------------
    @property
    def migrating(self) -> bool:
        return self.task is not None and self.task.active and not self.task.done.is_set()

    def split(self, batch: Any, sub_group: np.ndarray, *, count: bool = True) -> Any:
        """Rows this instance can process now; the others are buffered (and fetched)."""
        if count:
            self.heat.add(sub_group)
        ok = self.held[sub_group]
        if ok.all():
            return batch
        task = self.task
        missing = sub_group[~ok]
        if task is None or not task.active:
            bad = sorted(set((missing // self.sub_groups).tolist()))[:10]
            msg = (
                f"records of key group(s) {bad} reached an instance that does not own them; "
                "state is never created afresh for a key group owned elsewhere"
            )
            raise StateError(msg)
        unknown = [g for g in set(missing.tolist()) if g not in task.incoming]
        if unknown:
            bad = sorted({g // self.sub_groups for g in unknown})[:10]
            msg = (
                f"records of key group(s) {bad} are neither held nor incoming at epoch {task.epoch}"
            )
            raise StateError(msg)
        rest = batch.filter(pa.array(~ok))
        order = np.argsort(missing, kind="stable")
        sorted_g = missing[order]
        rest = rest.take(pa.array(order))
        starts = np.flatnonzero(np.r_[True, sorted_g[1:] != sorted_g[:-1]])
        bounds = np.append(starts, len(sorted_g))
        now = time.monotonic()
        wanted = []
        for i, s in enumerate(starts.tolist()):
            g = int(sorted_g[s])
            piece = rest.slice(s, int(bounds[i + 1]) - s)
            if g not in self.pending:
                self.pending[g] = []
                self.pending_since[g] = now
            self.pending[g].append(piece)
            self.pending_rows += piece.num_rows
            self.pending_bytes += piece.nbytes
            if g not in task.requested:
                wanted.append(g)
        if wanted and task.policy.on_demand:
            task.on_demand_fetches += len(wanted)
            self._request(wanted, on_demand=True)
        return batch.filter(pa.array(ok)) if ok.any() else None

    @property
    def over_limit(self) -> bool:
        """More bytes of records wait for their state than ``max_pending_bytes``."""
        return self.pending_bytes > self.max_pending_bytes

    @property
    def holds_watermark(self) -> bool:
        """The instance must not advance its watermark: records wait here for their state, or
        records of outgoing sub-groups wait to be handed out (their windows must not fire here
        without them), or incoming sub-groups may still bring records sent before the barrier."""
        task = self.task
        return bool(
            self.pending_rows
            or self.handover_rows
            or (
                task is not None
                and self.migrating
                and not task.policy.full_restore
                and len(task.arrived) < len(task.incoming)
            )
        )

    def hold_back(self, batch: Any, sub_group: np.ndarray) -> Any:
        """Old owner, a batch read before the rescale barrier but not applied: the records of
        outgoing sub-groups are held back (handed out with their state, in this order); returns
        the rows that stay here (None: none)."""
        task = self.task
        if task is None or not task.outgoing or batch.num_rows == 0:
            return batch
        if task.sealed.is_set():
            msg = (
                f"records sent before the barrier of epoch {task.epoch} reached the old owner "
                "after it sealed its outgoing sub-groups"
            )
            raise StateError(msg)
        moving = np.zeros(len(self.held), dtype=bool)
        moving[np.fromiter(task.outgoing, dtype=np.int64, count=len(task.outgoing))] = True
        out = moving[sub_group]
        if not out.any():
            return batch
        gone = sub_group[out]
        rest = batch.filter(pa.array(out)) if not out.all() else batch
        order = np.argsort(gone, kind="stable")
        sorted_g = gone[order]
        rest = rest.take(pa.array(order))
        starts = np.flatnonzero(np.r_[True, sorted_g[1:] != sorted_g[:-1]])
        bounds = np.append(starts, len(sorted_g))
        for i, s in enumerate(starts.tolist()):
            piece = rest.slice(s, int(bounds[i + 1]) - s)
            self.handover.setdefault(int(sorted_g[s]), []).append(piece)
            self.handover_rows += piece.num_rows
        task.handover_rows_out += int(out.sum())
        return None if out.all() else batch.filter(pa.array(~out))

    def take_released(self) -> list[pa.RecordBatch]:
        """Buffered records of sub-groups that may now be processed, in arrival order per
        sub-group; the sub-groups are held from now on. The pieces (one per sub-group and
        batch it came in) are joined into as few batches as their schemas allow, sub-group
        after sub-group: a keyed step runs them as it runs any batch, not piece by piece."""
        task = self.task
        if task is None or not self._releasable:
            return []
        if task.policy.hold == "all_moved" and len(task.arrived) < len(task.incoming):
            return []
        if task.hands_out and not task.sealed.is_set():
            return []  # its own fence first (see the module's doc)
        groups, self._releasable = self._releasable, []
        out: list[pa.RecordBatch] = []
        now = time.monotonic()
        for g in groups:
            self.held[g] = True
            pieces = self.pending.pop(g, None)
            if pieces:
                since = self.pending_since.pop(g)
                task.fetch_wait_ms.append((now - since) * 1000)
                self.pending_rows -= sum(p.num_rows for p in pieces)
                self.pending_bytes -= sum(p.nbytes for p in pieces)
                out.extend(pieces)
        self._check_done()
        self._released.set()
        return _merge_runs(out)

    # ---- protocol ------------------------------------------------------------------------
    def prepare(self, task: MigrationTask) -> None:
        """Take the task of a rescale step. It is published (``self.task``) last: the serving
        loop (another thread under Ray) serves the step's calls the moment it sees it."""
        last = self.task
        if last is not None and not last.done.is_set():
            msg = f"epoch {task.epoch} prepared while epoch {last.epoch} is still moving"
            raise StateError(msg)
        for g in task.outgoing:
            if not self.held[g]:
                msg = f"sub-group {g} is to be handed out but is not held here"
                raise StateError(msg)
        self._slots = {}
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        task.hands_out = bool(task.outgoing)
        self.task = task
        server = last.server if last is not None else None
        if server is not None and not server.done():  # the last step's (idle: it is done)
            server.get_loop().call_soon_threadsafe(server.cancel)

    def activate(self, epoch: int) -> None:
        task = self.task
        if task is None or task.epoch != epoch or task.active:
            return
        task.active = True
        task.activated_at = time.monotonic()
        task.activated_wall = time.time()
        task.rss = PeakRss()
        if task.policy.full_restore:
            return  # stop-and-restart: the controller drives snapshot and restore
        self._spawn(self._background(task))
        self._check_done()

    def restored(self, groups: list[int]) -> None:
        """Stop-and-restart: the state of ``groups`` is here (restored from snapshots) and
        nothing is handed out any more; buffered records, if any, are released in order."""
        task = self.task
        assert task is not None
        task.arrived.update(groups)
        task.requested.update(groups)
        task.outgoing.clear()
        self._releasable.extend(groups)
        self._check_done()
        self.poke()

    def seal(self, epoch: int, *, fence_ms: float | None = None) -> None:
        """The barrier of ``epoch`` came on every input, and the instance sent a fence on every
        output (``fence_ms``: how long that took; None: nothing to fence). The outgoing
        sub-groups may go out now: receivers, not this instance, wait for the fence."""
        task = self.task
        if task is not None and task.epoch == epoch and not task.sealed.is_set():
            task.sealed_at = time.monotonic()
            task.sealed_wall = time.time()
            task.sealed.set()
            task.fence_ms = fence_ms
            task.fenced.set()
            self._make_ready(task)
            self._check_done()
            self.poke()  # what arrived before the seal may be released now

    def _make_ready(self, task: MigrationTask) -> None:
        """Sealed and fenced (on the instance's loop): the outgoing sub-groups leave the
        write-back cache (written to RocksDB first), once; from now on nothing writes them here,
        and the serving loop may read them."""
        if task.ready.is_set() or self.task is not task:
            return
        if task.outgoing and not task.by_files:
            self.backend.evict_sub_groups(divmod(g, self.sub_groups) for g in task.outgoing)
        task.evicted = True
        task.ready_wall = time.time()
        with self._ready_lock:
            task.ready.set()
            waiters, task.ready_waiters = task.ready_waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_resolve, fut)

    async def _wait_ready(self, task: MigrationTask) -> None:
        """Until ``task`` is ready to hand out state, on whatever loop serves it."""
        with self._ready_lock:
            if task.ready.is_set():
                return
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            task.ready_waiters.append((asyncio.get_running_loop(), fut))
        await fut

    def give_way(self, max_s: float = TRANSFER_FIRST_S) -> None:
        """On the instance's loop, before a slice of records: while a loop in another thread
        serves moved state, block (without the GIL) until it is idle, at most ``max_s``. The
        transfer goes first: records buffered at the new owners wait for it, and the old owner's
        own records wait at most ``max_s`` per slice."""
        task = self.task
        server = task.server if task is not None else None
        if server is None or self._serve_idle.is_set() or server.get_loop() is self._loop:
            return
        self._serve_idle.wait(max_s)

    def _on_instance_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the instance's loop: now if this is it, else soon, from there."""
        loop = self._loop
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is None or here is loop or loop.is_closed():
            fn(*args)
        else:
            loop.call_soon_threadsafe(fn, *args)

    def _check_done(self) -> None:
        task = self.task
        if task is None or task.done.is_set() or not task.active:
            return
        if (
            not task.outgoing
            and len(task.arrived) == len(task.incoming)
            and not self._releasable
            and not any(g in self.pending for g in task.incoming)
        ):
            if task.sealed.is_set() or not task.outgoing:
                task.finished_at = time.monotonic()
                task.finished_wall = time.time()
                if task.rss is not None:
                    task.rss.stop()
                task.done.set()
                self.on_done(task)

    # ---- new owner: fetching -----------------------------------------------------------------
    def _request(self, groups: list[int], *, on_demand: bool) -> None:
        task = self.task
        assert task is not None
        by_owner: dict[int, list[int]] = {}
        for g in groups:
            if g in task.requested:
                continue
            task.requested.add(g)
            by_owner.setdefault(task.incoming[g], []).append(g)
        for owner, gs in by_owner.items():
            if on_demand:
                # the owner's other sub-groups not asked for yet ride along, hottest run first,
                # in the room the chunk has left (one call instead of one per sub-group later)
                riders = self._riders(task, owner) if task.policy.background != "none" else []
                task.requested.update(riders)
                self._spawn(self._fetch(task, owner, self._hot_runs(task, gs), riders=riders))
                continue
            self._pull(task, owner, gs)

    def _riders(self, task: MigrationTask, owner: int) -> list[int]:
        return self._hot_runs(
            task, [g for g, o in task.incoming.items() if o == owner and g not in task.requested]
        )

    def _hot_runs(self, task: MigrationTask, groups: list[int]) -> list[int]:
        """``groups`` as runs of consecutive sub-groups of one key group (key order inside a
        run), the run with the hottest member first (records waiting here count first; see
        :meth:`_hot_first`): the old owner reads a run with one RocksDB iterator, not one per
        sub-group (an on-demand chunk with its riders is often a whole move's state)."""
        ranked = self._hot_first(task, groups)
        return [g for run in contiguous_runs(ranked, self.sub_groups) for g in run]

    def _pending_first(self, groups: list[int]) -> list[int]:
        """Sub-groups with records waiting here first; otherwise in the order given."""
        pending = self.pending
        return sorted(groups, key=lambda g: g not in pending)

    def _hot_first(self, task: MigrationTask, groups: list[int]) -> list[int]:
        """Sub-groups with records waiting here first, then the rest; hottest first in each."""
        pending = self.pending
        return sorted(groups, key=lambda g: (g not in pending, -task.heat.get(g, 0.0), g))

    def _pull(self, task: MigrationTask, owner: int, gs: list[int]) -> None:
        """A bulk pull: one sequence of calls per background slot of the pair, to keep the
        pair's pipeline full. The sub-groups go in key-ordered runs (:func:`contiguous_runs`:
        the old owner reads a run with one iterator), ``RUNS_PER_CALL`` runs per call, hottest
        run first, dealt round-robin."""
        slots = self._slots_of(task, owner)
        k = max(1, slots.size - slots.reserved)
        runs = contiguous_runs(self._hot_first(task, gs), self.sub_groups, k * RUNS_PER_CALL)
        for i in range(min(k, len(runs))):
            seq = [g for run in runs[i::k] for g in run]
            self._spawn(self._fetch(task, owner, seq, urgent=False))

    def _slots_of(self, task: MigrationTask, owner: int) -> PrioritySlots:
        slots = self._slots.get(owner)
        if slots is None:
            size = task.policy.inflight_chunks
            reserved = 1 if task.policy.on_demand and size > 1 else 0
            slots = self._slots[owner] = PrioritySlots(size, reserved)
        return slots

    async def _fetch(
        self,
        task: MigrationTask,
        owner: int,
        groups: list[int],
        *,
        urgent: bool = True,
        riders: list[int] | None = None,
    ) -> None:
        """Pull ``groups`` from ``owner``: one chunk per call, each call holding one of the
        pair's ``inflight_chunks`` slots until its chunk is imported; before each call the
        sub-groups with records waiting here go first. ``riders`` (urgent calls only) come
        after ``groups`` in the first call; those that did not fit go on as a bulk pull."""
        assert self.fetcher is not None
        slots = self._slots_of(task, owner)
        remaining = list(groups) + list(riders or ())
        first = True
        while remaining:
            if not first:
                # a bulk pull keeps its key-ordered runs, those with records waiting here first
                remaining = (
                    self._hot_runs(task, remaining) if urgent else self._pending_first(remaining)
                )
            await slots.acquire(urgent)
            try:
                task.max_inflight_chunks = max(task.max_inflight_chunks, slots.used)
                task.fetch_calls += 1
                room = task.policy.chunk_bytes
                if first and riders:  # the records waiting here need only the first groups
                    room = min(room, RIDER_ROOM_BYTES)
                t0 = time.perf_counter()
                made_wall = time.time()
                done, chunks = await self.fetcher(owner, task.epoch, remaining, room, urgent)
                t1 = time.perf_counter()
                back_wall = time.time()
                task.fetch_rtt_ms.append((t1 - t0) * 1000)
                handed: dict[int, list[pa.RecordBatch]] = {}
                for chunk in chunks:
                    meta = chunk.schema.metadata or {}
                    if HANDOVER_META in meta:  # records sent before the barrier, not applied
                        handed.setdefault(int(meta[HANDOVER_META]), []).append(_untag(chunk))
                        continue
                    task.rows_in += self.backend.import_chunk(chunk)
                    task.bytes_in += chunk.nbytes
                    task.pair_bytes_in[owner] = task.pair_bytes_in.get(owner, 0) + chunk.nbytes
                    task.pair_last_in_wall[owner] = time.time()
                task.import_s += time.perf_counter() - t1
                handed_rows = sum(p.num_rows for ps in handed.values() for p in ps)
                task.fetch_log.append(
                    (made_wall, back_wall, time.time(), urgent, len(done), handed_rows)
                )
            finally:
                slots.release()
            if not done and not chunks:
                msg = f"instance {owner} served nothing of sub-groups {remaining[:5]}..."
                raise StateError(msg)
            task.arrived.update(done)
            if task.all_arrived_wall is None and len(task.arrived) == len(task.incoming):
                task.all_arrived_wall = time.time()
            for g, pieces in handed.items():
                self._hand_in(task, g, pieces)
            self._releasable.extend(done)
            finished = set(done)
            remaining = [g for g in remaining if g not in finished]
            if first and riders:
                left = set(riders) - finished
                remaining = [g for g in remaining if g not in left]
                if left:
                    self._pull(task, owner, [g for g in riders if g in left])
            first = False
            self.poke()

    def _hand_in(self, task: MigrationTask, g: int, pieces: list[pa.RecordBatch]) -> None:
        """Records of ``g`` its old owner had not applied: they go before the ones buffered
        here (sent after the barrier), and run right after ``g``'s state is in."""
        if g not in task.incoming:
            msg = f"records of sub-group {g} were handed over, but it is not incoming here"
            raise StateError(msg)
        self.pending[g] = pieces + self.pending.get(g, [])
        self.pending_since.setdefault(g, time.monotonic())
        rows = sum(p.num_rows for p in pieces)
        self.pending_rows += rows
        self.pending_bytes += sum(p.nbytes for p in pieces)
        task.handover_rows_in += rows
        self.handed_in_rows += rows  # they count as input here, where they are applied

    async def _background(self, task: MigrationTask) -> None:
        policy = task.policy
        if policy.background == "none":
            if policy.background_after_s <= 0:
                return
            try:
                await asyncio.wait_for(task.done.wait(), policy.background_after_s)
                return
            except TimeoutError:
                pass
        order = sorted(task.incoming, key=lambda g: (-task.heat.get(g, 0.0), g))
        if policy.background == "all":
            self._request(order, on_demand=False)
            return
        sem = asyncio.Semaphore(policy.fetch_concurrency)
        for start in range(0, len(order), policy.chunk_sub_groups):
            chunk = [
                g for g in order[start : start + policy.chunk_sub_groups] if g not in task.requested
            ]
            if not chunk:
                continue
            await sem.acquire()
            # on-demand fetches may have claimed some while we waited for a slot
            chunk = [g for g in chunk if g not in task.requested]
            if not chunk:
                sem.release()
                continue
            by_owner: dict[int, list[int]] = {}
            for g in chunk:
                task.requested.add(g)
                by_owner.setdefault(task.incoming[g], []).append(g)
            jobs = [self._fetch(task, o, gs, urgent=False) for o, gs in by_owner.items()]

            async def run(jobs: list[Any] = jobs) -> None:
                try:
                    await asyncio.gather(*jobs)
                finally:
                    sem.release()

            self._spawn(run())

    # ---- old owner: serving -----------------------------------------------------------------
    async def serve(
        self, epoch: int, groups: list[int], max_bytes: int, urgent: bool = False
    ) -> tuple[list[int], list[pa.RecordBatch]]:
        """One chunk (at most ``max_bytes``) of ``groups``, in their order, once sealed; returns
        the sub-groups it completed and the chunk. Requests queue; ``urgent`` (on-demand) ones
        are served before the others, one chunk at a time."""
        task = self.task
        if task is None or task.epoch != epoch:
            msg = f"fetch for epoch {epoch}, but this instance is at {task.epoch if task else None}"
            raise StateError(msg)
        if max_bytes < 1:
            msg = f"a fetch must allow chunks of >= 1 byte, got max_bytes={max_bytes}"
            raise StateError(msg)
        loop = asyncio.get_running_loop()
        req = _ServeRequest(
            urgent, list(groups), max_bytes, time.monotonic(), loop.create_future(), time.time()
        )
        heapq.heappush(task.serve_queue, (0 if urgent else 1, next(self._serve_seq), req))
        server = task.server
        if server is None or server.done() or server.get_loop() is not loop:
            # requests of one epoch come on one loop (the actor's transfer group, or the
            # instance's own loop when called directly)
            task.serve_wake = asyncio.Event()
            task.server = loop.create_task(self._serve_loop(task))
        assert task.serve_wake is not None
        task.serve_wake.set()
        return await req.future

    async def _serve_loop(self, task: MigrationTask) -> None:
        try:
            await self._serve_requests(task)
        except Exception as e:  # noqa: BLE001 - every waiting requester fails with it
            self._serve_idle.set()
            queue, task.serve_queue = task.serve_queue, []
            for _, _, req in queue:
                if not req.future.done():
                    req.future.set_exception(e)
            self._on_instance_loop(self._fail, e)

    def _fail(self, e: BaseException) -> None:
        self.error = e
        self.poke()

    async def _serve_requests(self, task: MigrationTask) -> None:
        await self._wait_ready(task)  # sealed, fenced, evicted (on the instance's loop)
        burst_from = time.monotonic()
        queue = task.serve_queue
        while self.task is task:
            if not queue:
                self._serve_idle.set()
                wake = task.serve_wake
                assert wake is not None
                wake.clear()
                await wake.wait()
                burst_from = time.monotonic()
                continue
            self._serve_idle.clear()
            _, _, req = heapq.heappop(queue)
            if req.urgent:
                start = max(req.arrived_at, task.sealed_at)
                task.serve_wait_ms.append((time.monotonic() - start) * 1000)
                if task.first_urgent_served_wall is None:
                    task.first_urgent_served_wall = time.time()
            try:
                req.future.set_result(self._serve_chunk(task, req.groups, req.max_bytes))
            except Exception as e:  # noqa: BLE001 - the requester's call fails with it
                req.future.set_exception(e)
            task.serve_log.append((req.arrived_wall, time.time(), req.urgent))
            if queue and time.monotonic() - burst_from < SERVE_BURST_S:
                continue  # requests queued while records ran: serve them together
            await asyncio.sleep(0)  # records, and new (urgent) requests, between bursts
            burst_from = time.monotonic()

    def _serve_chunk(
        self, task: MigrationTask, groups: list[int], max_bytes: int
    ) -> tuple[list[int], list[pa.RecordBatch]]:
        """One chunk of ``groups`` (read from RocksDB on the serving loop's thread); what it
        completes is handed out on the instance's loop (:meth:`_handed_out`). Consecutive
        sub-groups of one key group asked for in key order are one key range, read with one
        iterator (:meth:`RocksStateBackend.export_run`)."""
        t0 = time.perf_counter()
        done: list[int] = []
        pieces: list[tuple[int, pa.RecordBatch]] = []  # (first sub-group, rows in key order)
        records: list[pa.RecordBatch] = []
        room = max_bytes
        s = self.sub_groups
        i = 0
        while i < len(groups) and room > 0:
            run = [self._servable(task, groups[i])]
            i += 1
            while (
                i < len(groups)
                and groups[i] == run[-1] + 1
                and groups[i] // s == run[0] // s
                and groups[i] not in task.cursors  # a started one resumes at its own key
            ):
                run.append(self._servable(task, groups[i]))
                i += 1
            kg, first = divmod(run[0], s)
            piece, nxt, resume = self.backend.export_run(
                kg, first, first + len(run) - 1, task.cursors.get(run[0]), room, alone=not pieces
            )
            if piece.num_rows:
                pieces.append((run[0], piece))
                room -= piece.nbytes
            for g in run[: nxt - first]:
                task.cursors.pop(g, None)
                task.served.add(g)
                done.append(g)
                # with the chunk that completes the sub-group (fixed since the seal)
                records.extend(_tag(rec, g) for rec in self.handover.get(g, ()))
            if resume is not None:
                task.cursors[kg * s + nxt] = resume
                break
        # served in the order asked (hottest first), sent in key order: one batch per run read
        # (rows sorted), not copied into one
        state = [piece for _, piece in sorted(pieces, key=lambda p: p[0])]
        size = sum(piece.nbytes for piece in state)
        task.chunks_out += 1
        task.bytes_out += size
        task.max_chunk_bytes = max(task.max_chunk_bytes, size)
        task.export_s += time.perf_counter() - t0
        if done:
            self._on_instance_loop(self._handed_out, task, done)
        return done, state + records

    @staticmethod
    def _servable(task: MigrationTask, g: int) -> int:
        if g not in task.outgoing or g in task.served:
            msg = f"sub-group {g} was asked for twice or is not handed out by this instance"
            raise StateError(msg)
        return g

    def _handed_out(self, task: MigrationTask, done: list[int]) -> None:
        """Old owner, on the instance's loop: ``done`` went out in full; drop them here."""
        for g in done:
            kg, sg = divmod(g, self.sub_groups)
            self.backend.drop_sub_group(kg, sg, evicted=True)
            self.held[g] = False
            task.outgoing.discard(g)
            for rec in self.handover.pop(g, ()):
                self.handover_rows -= rec.num_rows
        self._check_done()
        self.poke()

    # ---- waiting ----------------------------------------------------------------------------
    async def wait_released(self) -> None:
        self._released.clear()
        await self._released.wait()

    def stats(self) -> dict[str, Any]:
        t = self.task
        if t is None:
            return {}
        return {
            "epoch": t.epoch,
            "active": t.active,
            "sealed": t.sealed.is_set(),
            "done": t.done.is_set(),
            "requested": len(t.requested),
            "arrived": len(t.arrived),
            "pending_rows": self.pending_rows,
            "pending_bytes": self.pending_bytes,
            "max_pending_bytes": self.max_pending_bytes,
            "incoming": len(t.incoming),
            "outgoing_left": len(t.outgoing),
            "on_demand_fetches": t.on_demand_fetches,
            "fetch_calls": t.fetch_calls,
            "bytes_in": t.bytes_in,
            "bytes_out": t.bytes_out,
            "rows_in": t.rows_in,
            "fetch_wait_ms": list(t.fetch_wait_ms),
            "serve_wait_ms": list(t.serve_wait_ms),
            "fetch_rtt_ms": list(t.fetch_rtt_ms),
            "export_s": t.export_s,
            "import_s": t.import_s,
            "fence_ms": t.fence_ms,
            "rss_start_bytes": t.rss.start if t.rss is not None else None,
            "rss_peak_bytes": t.rss.peak if t.rss is not None else None,
            "fenced": t.fenced.is_set(),
            "chunks_out": t.chunks_out,
            "serve_calls_queued": len(t.serve_queue),
            "server": _server_state(t),
            "max_chunk_bytes": t.max_chunk_bytes,
            "max_inflight_chunks": t.max_inflight_chunks,
            "handover_rows_out": t.handover_rows_out,
            "handover_rows_in": t.handover_rows_in,
            "activated_wall": t.activated_wall,
            "sealed_wall": t.sealed_wall,
            "first_urgent_served_wall": t.first_urgent_served_wall,
            "all_arrived_wall": t.all_arrived_wall,
            "ready_wall": t.ready_wall,
            "first_release_wall": t.first_release_wall,
            "first_release_rows": t.first_release_rows,
            "first_release_age_ms": t.first_release_age_ms,
            "first_drained_wall": t.first_drained_wall,
            "pair_bytes_in": dict(t.pair_bytes_in),
            "pair_last_in_wall": dict(t.pair_last_in_wall),
            "fetch_log": list(t.fetch_log),
            "serve_log": list(t.serve_log),
            "finished_wall": t.finished_wall,
            "duration_s": (t.finished_at - t.activated_at)
            if t.finished_at and t.activated_at
            else None,
        }

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.error = task.exception()
            self.poke()

    error: BaseException | None = None


def _server_state(task: MigrationTask) -> str:
    """The old owner's serving loop of ``task``, in words (for a rescale that did not finish)."""
    server = task.server
    if server is None:
        return "none (no serve call came)"
    if server.done():
        return "ended"
    return "serving" if task.ready.is_set() else "waiting for the seal and fence"


def _merge_runs(pieces: list[pa.RecordBatch]) -> list[pa.RecordBatch]:
    """Consecutive pieces with the same schema (metadata included: e.g. which input) joined
    into one batch each; the order of rows stays."""
    out: list[pa.RecordBatch] = []
    run: list[pa.RecordBatch] = []
    for piece in pieces:
        if run and not piece.schema.equals(run[0].schema, check_metadata=True):
            out.append(_join(run))
            run = []
        run.append(piece)
    if run:
        out.append(_join(run))
    return out


def _join(run: list[pa.RecordBatch]) -> pa.RecordBatch:
    if len(run) == 1 or not any(p.num_rows for p in run):
        return run[0]
    return pa.Table.from_batches(run, schema=run[0].schema).combine_chunks().to_batches()[0]


def contiguous_runs(groups: list[int], sub_groups: int, pieces: int = 1) -> list[list[int]]:
    """``groups`` (global sub-groups, ranked: hottest first) as runs of consecutive sub-groups
    of one key group each, in key order inside a run, none longer than
    ``len(groups) // pieces`` (at least 1; so there are at least ``pieces`` runs, of even
    lengths, for that many calls to share out evenly), ranked by their best-ranked member."""
    rank = {g: i for i, g in enumerate(groups)}
    longest = max(1, len(groups) // max(1, pieces))
    ordered = sorted(rank)
    runs: list[list[int]] = []
    cut = 0
    for j in range(1, len(ordered) + 1):
        if (
            j == len(ordered)
            or ordered[j] != ordered[j - 1] + 1
            or ordered[j] // sub_groups != ordered[j - 1] // sub_groups
        ):
            run = ordered[cut:j]
            parts = -(-len(run) // longest)
            runs.extend(
                [int(g) for g in part] for part in np.array_split(np.asarray(run), parts)
            )
            cut = j
    runs.sort(key=lambda r: (min(rank[g] for g in r), r[0]))
    return runs


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _tag(batch: pa.RecordBatch, g: int) -> pa.RecordBatch:
    meta = dict(batch.schema.metadata or {})
    meta[HANDOVER_META] = str(g).encode()
    return batch.replace_schema_metadata(meta)


def _untag(batch: pa.RecordBatch) -> pa.RecordBatch:
    meta = {k: v for k, v in (batch.schema.metadata or {}).items() if k != HANDOVER_META}
    return batch.replace_schema_metadata(meta or None)


def pair_rates(stats: list[dict[str, Any]], width: int) -> list[float]:
    """MB/s of every (new owner, old owner) pair of a move: the state bytes (Arrow chunk bytes:
    keys, values, offsets) the new owner took in from that old owner, over the time from when
    both could move state (the later of the new owner's switch and the old owner being ready to
    hand out: sealed, fenced, evicted) until the pair's last chunk arrived. ``stats``: each
    step's :meth:`MigrationEngine.stats` of instances ``0 .. width - 1``, step after step."""
    rates = []
    for at in range(0, len(stats) - width + 1, width):
        step = stats[at : at + width]
        for st in step:
            switch = st.get("activated_wall")
            for owner, nbytes in (st.get("pair_bytes_in") or {}).items():
                ready = step[int(owner)].get("ready_wall") if int(owner) < width else None
                end = (st.get("pair_last_in_wall") or {}).get(owner)
                if switch is None or ready is None or end is None or not nbytes:
                    continue
                start = max(switch, ready)
                if end > start:
                    rates.append(nbytes / 1e6 / (end - start))
    return rates


def transfer_summary(stats: list[dict[str, Any]], width: int | None = None) -> dict[str, Any]:
    """Where a move's transfer time went, over every instance's :meth:`MigrationEngine.stats`:
    old owners' seconds reading chunks out of RocksDB and new owners' seconds writing them in
    (summed over instances), the round trip of each serve call as its new owner saw it (call to
    chunk back: queueing at the old owner, reading, Ray), the MB/s each new owner took in
    from its switch until its last incoming sub-group arrived and, given ``width`` (instances per
    step in ``stats``), the MB/s of every (new owner, old owner) pair (:func:`pair_rates`)."""
    rtts = [x for st in stats for x in st.get("fetch_rtt_ms", [])]
    per_new = []
    for st in stats:
        start, end = st.get("activated_wall"), st.get("all_arrived_wall")
        if st.get("bytes_in") and start is not None and end is not None and end > start:
            per_new.append(st["bytes_in"] / 1e6 / (end - start))
    per_pair = pair_rates(stats, width) if width else []
    return {
        "export_s": round(sum(st.get("export_s", 0.0) for st in stats), 4),
        "import_s": round(sum(st.get("import_s", 0.0) for st in stats), 4),
        "calls": len(rtts),
        "call_rtt_ms": {
            "p50": float(np.percentile(rtts, 50)) if rtts else None,
            "p99": float(np.percentile(rtts, 99)) if rtts else None,
            "max": float(max(rtts)) if rtts else None,
        },
        "new_owner_mb_s": [round(x, 1) for x in per_new],
        "pair_mb_s": [round(x, 1) for x in per_pair],
    }
