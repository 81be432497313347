"""The migration engine inside one keyed operator instance (no Ray here).

It knows which global sub-groups (``key_group * sub_groups + sub_group``) the instance holds,
which it will receive and from whom, and which it must hand out. Protocol, per rescale epoch:

* ``prepare``: the controller says what moves (before the barrier is injected).
* ``activate`` (first rescale barrier on any input): from now on records of sub-groups that are
  assigned here but not here yet are buffered per sub-group, in arrival order, and fetched.
* ``seal`` (the barrier on every input): no record of an outgoing sub-group can still arrive, so
  outgoing sub-groups may be handed out (``serve``); requests that came earlier wait for this.
* New owners pull: on demand when a record needs a sub-group, in the background hottest first,
  or all at once, as the strategy's :class:`FetchPolicy` says; chunks are bounded in bytes.
* A sub-group is released (its buffered records processed, then new ones directly) when it
  arrived, or with ``hold="all_moved"`` when every incoming sub-group arrived.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from raystream.errors import StateError
from raystream.rescale import FetchPolicy

__all__ = ["MigrationEngine", "MigrationTask"]

# fetch(owner_index, epoch, sub_groups, max_bytes) -> (served sub-groups, state chunks)
Fetcher = Callable[[int, int, list[int], int], Awaitable[tuple[list[int], list[pa.RecordBatch]]]]


@dataclass
class MigrationTask:
    """This instance's part of one rescale step."""

    epoch: int
    policy: FetchPolicy
    incoming: dict[int, int]  # sub-group -> old owner index
    outgoing: set[int]
    heat: dict[int, float] = field(default_factory=dict)  # sub-group -> measured records
    active: bool = False
    sealed: asyncio.Event = field(default_factory=asyncio.Event)
    activated_at: float = 0.0
    requested: set[int] = field(default_factory=set)
    arrived: set[int] = field(default_factory=set)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    on_demand_fetches: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    rows_in: int = 0
    fetch_wait_ms: list[float] = field(default_factory=list)
    finished_at: float | None = None


class MigrationEngine:
    """Held / incoming / outgoing sub-groups of one instance, and the records waiting for state."""

    def __init__(
        self,
        backend: Any,
        num_key_groups: int,
        sub_groups: int,
        owned_key_groups: Any,
        *,
        max_pending_rows: int = 1_000_000,
    ) -> None:
        self.backend = backend
        self.sub_groups = sub_groups
        self.held = np.zeros(num_key_groups * sub_groups, dtype=bool)
        for kg in owned_key_groups:
            self.held[int(kg) * sub_groups : (int(kg) + 1) * sub_groups] = True
        self.heat = np.zeros(num_key_groups * sub_groups, dtype=np.int64)
        self.task: MigrationTask | None = None
        self.pending: dict[int, list[pa.RecordBatch]] = {}
        self.pending_since: dict[int, float] = {}
        self.pending_rows = 0
        self.max_pending_rows = max_pending_rows
        self._releasable: list[int] = []
        self.fetcher: Fetcher | None = None
        self.poke: Callable[[], None] = lambda: None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._released = asyncio.Event()

    # ---- record path -----------------------------------------------------------------------
    @property
    def migrating(self) -> bool:
        return self.task is not None and self.task.active and not self.task.done.is_set()

    def split(self, batch: Any, sub_group: np.ndarray, *, count: bool = True) -> Any:
        """Rows this instance can process now; the others are buffered (and fetched)."""
        if count:
            self.heat += np.bincount(sub_group, minlength=len(self.heat))
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
            if g not in task.requested:
                wanted.append(g)
        if wanted and task.policy.on_demand:
            task.on_demand_fetches += len(wanted)
            self._request(wanted, on_demand=True)
        return batch.filter(pa.array(ok)) if ok.any() else None

    @property
    def over_limit(self) -> bool:
        return self.pending_rows > self.max_pending_rows

    def take_released(self) -> list[pa.RecordBatch]:
        """Buffered records of sub-groups that may now be processed, in arrival order per
        sub-group; the sub-groups are held from now on."""
        task = self.task
        if task is None or not self._releasable:
            return []
        if task.policy.hold == "all_moved" and len(task.arrived) < len(task.incoming):
            return []
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
                out.extend(pieces)
        self._check_done()
        self._released.set()
        return out

    # ---- protocol ------------------------------------------------------------------------
    def prepare(self, task: MigrationTask) -> None:
        if self.task is not None and not self.task.done.is_set():
            msg = f"epoch {task.epoch} prepared while epoch {self.task.epoch} is still moving"
            raise StateError(msg)
        self.task = task
        for g in task.outgoing:
            if not self.held[g]:
                msg = f"sub-group {g} is to be handed out but is not held here"
                raise StateError(msg)

    def activate(self, epoch: int) -> None:
        task = self.task
        if task is None or task.epoch != epoch or task.active:
            return
        task.active = True
        task.activated_at = time.monotonic()
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

    def seal(self, epoch: int) -> None:
        if self.task is not None and self.task.epoch == epoch:
            self.task.sealed.set()
            self._check_done()

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
                task.done.set()

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
            self._spawn(self._fetch(task, owner, gs))

    async def _fetch(self, task: MigrationTask, owner: int, groups: list[int]) -> None:
        assert self.fetcher is not None
        remaining = list(groups)
        while remaining:
            served, chunks = await self.fetcher(
                owner, task.epoch, remaining, task.policy.chunk_bytes
            )
            if not served:
                msg = f"instance {owner} served none of sub-groups {remaining[:5]}..."
                raise StateError(msg)
            for chunk in chunks:
                task.rows_in += self.backend.import_chunk(chunk)
                task.bytes_in += chunk.nbytes
            task.arrived.update(served)
            self._releasable.extend(served)
            served_set = set(served)
            remaining = [g for g in remaining if g not in served_set]
            self.poke()

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
        order = sorted(task.incoming, key=lambda g: (-task.heat.get(g, 0), g))
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
            jobs = [self._fetch(task, o, gs) for o, gs in by_owner.items()]

            async def run(jobs: list[Any] = jobs) -> None:
                try:
                    await asyncio.gather(*jobs)
                finally:
                    sem.release()

            self._spawn(run())

    # ---- old owner: serving -----------------------------------------------------------------
    async def serve(
        self, epoch: int, groups: list[int], max_bytes: int
    ) -> tuple[list[int], list[pa.RecordBatch]]:
        """Hand out sub-groups (at least one, then up to ``max_bytes``) once sealed."""
        task = self.task
        if task is None or task.epoch != epoch:
            msg = f"fetch for epoch {epoch}, but this instance is at {task.epoch if task else None}"
            raise StateError(msg)
        await task.sealed.wait()
        served: list[int] = []
        chunks: list[pa.RecordBatch] = []
        size = 0
        for g in groups:
            if g not in task.outgoing:
                msg = f"sub-group {g} was asked for twice or is not handed out by this instance"
                raise StateError(msg)
            kg, sg = divmod(g, self.sub_groups)
            chunk = self.backend.export_sub_group(kg, sg)
            self.backend.drop_sub_group(kg, sg)
            self.held[g] = False
            task.outgoing.discard(g)
            chunks.append(chunk)
            size += chunk.nbytes
            task.bytes_out += chunk.nbytes
            served.append(g)
            if size >= max_bytes:
                break
        self._check_done()
        return served, chunks

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
            "incoming": len(t.incoming),
            "outgoing_left": len(t.outgoing),
            "on_demand_fetches": t.on_demand_fetches,
            "bytes_in": t.bytes_in,
            "bytes_out": t.bytes_out,
            "rows_in": t.rows_in,
            "fetch_wait_ms": list(t.fetch_wait_ms),
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
