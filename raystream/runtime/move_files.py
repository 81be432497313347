"""Moving a whole instance by its RocksDB files (no Ray here).

When every sub-group of an instance moves to one new instance (``job.move``), exporting its
rows sub-group by sub-group and importing them again is the slow way: records of each moving
sub-group wait at the new instance until that sub-group's rows arrived, and a hot instance has
no cold sub-groups. Instead, in two steps:

1. Before the move barrier, the old instance takes a RocksDB checkpoint of its whole state
   (hard links, after writing its cached entries and flushing the memtable, in a thread while
   its records go on) and from that moment tracks the keys it writes. The new instance puts
   the checkpoint in place (renamed on the same node, a copy on another filesystem; from
   another node pulled in pieces, actor to actor) and opens it as its own RocksDB.
   Then, still before the barrier, the rows it changed since come over in rounds (each
   brings what was written during the one before) until a round is small.
2. At the barrier nothing waits for the files any more: once the old instance sealed (the
   barrier came on every input, and what it sent downstream was read: the migration engine's
   seal and fence), it hands over only the rows it wrote or deleted since the last round, and
   the records it had queued but not applied (a move barrier overtakes its queue). The new
   instance writes those rows, then runs the handed-over records and those that waited here,
   per sub-group in the order sent.

Both sides run inside a migration task prepared as for a row-by-row move (every sub-group of
the old instance outgoing, incoming at the new one) whose fetch policy fetches nothing itself
(``on_demand=False, background="none"``); these functions do the transfer instead.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from raystream.errors import StateError
from raystream.rescale import FetchPolicy

__all__ = [
    "FILES_POLICY",
    "PIECE_BYTES",
    "FilesTakeOver",
    "copy_files",
    "hand_over_changes",
    "pack_records",
    "read_piece",
    "take_changes",
    "unpack_records",
]

# the fetch policy of a move by files: the migration engine fetches nothing by itself
FILES_POLICY = FetchPolicy(on_demand=False, background="none")
PIECE_BYTES = 8 << 20  # a file pulled from another node comes in pieces of this size
# rows changed since the copy are caught up before the barrier in rounds, until one is
# smaller than this (or this many were made): only what follows waits at the barrier
CATCH_UP_ROUNDS = 4
CATCH_UP_BYTES = 512 << 10
# the old instance frees its cache this long after its hand-over answered (off the move's path)
FREE_CACHE_AFTER_S = 1.0


def _handoff_dir(backend_path: Path, epoch: int) -> Path:
    return backend_path.with_name(f"{backend_path.name}.move-e{epoch}")


def _whole(inst: Any, epoch: int | None) -> tuple[Any, Any]:
    """The migration engine and task of an instance that hands over everything it holds."""
    engine = inst.engine
    task = engine.task if engine is not None else None
    if epoch is not None and (task is None or task.epoch != epoch):
        msg = (
            f"{inst.spec.id} was asked to hand over its files for move epoch {epoch}, but its "
            f"migration is at epoch {task.epoch if task else None}"
        )
        raise StateError(msg)
    return engine, task


async def copy_files(inst: Any, epoch: int) -> dict[str, Any]:
    """Old instance, before the move barrier: a checkpoint of its whole RocksDB (hard links,
    after writing its cached entries and flushing the memtable, in a thread: records go on
    meanwhile); from that moment on the keys it writes are tracked. Returns the folder, its
    files (name, bytes), the key groups it holds and the time the checkpoint took."""
    engine, _ = _whole(inst, None)
    backend = inst.processor.backend
    t0 = time.monotonic()
    directory = _handoff_dir(Path(backend.path), epoch)
    if directory.exists():  # left by a failed attempt
        shutil.rmtree(directory)
    taken = backend.snapshot_async(directory)  # the state of this moment ...
    backend.track_writes()  # ... and every key written after it
    await asyncio.wrap_future(taken)
    s = engine.sub_groups
    return {
        "directory": str(directory),
        "files": sorted((f.name, f.stat().st_size) for f in directory.iterdir() if f.is_file()),
        "key_groups": sorted({g // s for g in np.flatnonzero(engine.held).tolist()}),
        "checkpoint_ms": round((time.monotonic() - t0) * 1000, 1),
    }


def _compactions(backend: Any) -> dict[str, int | None]:
    """RocksDB's compactions running now and files in its level 0 (they take CPU beside the
    job: a move's window is read against them)."""
    db = backend._db  # noqa: SLF001

    def prop(name: str) -> int | None:
        try:
            v = db.property_value(name)
        except Exception:  # noqa: BLE001 - a diagnostic only
            return None
        return int(v) if v not in (None, "") else None

    return {
        "running": prop("rocksdb.num-running-compactions"),
        "pending_bytes": prop("rocksdb.estimate-pending-compaction-bytes"),
        "l0_files": prop("rocksdb.num-files-at-level0"),
    }


def _changes_chunk(backend: Any, keys: list[bytes]) -> pa.RecordBatch:
    """The current value of each key (null: deleted), as a state chunk."""
    values = backend.multi_get(keys)
    return pa.RecordBatch.from_arrays(
        [pa.array(keys, pa.binary()), pa.array(values, pa.binary())], names=["key", "value"]
    )


def take_changes(inst: Any) -> pa.RecordBatch:
    """Old instance, before the move barrier (records still run here): the rows written or
    deleted since :func:`copy_files` or the last call; tracking starts over from now."""
    backend = inst.processor.backend
    # rows held in memory (timers, resident states) are written (and tracked) first, so they go
    # in this catch-up round rather than all in the final, blocking hand-over
    backend._write_pending(None)  # noqa: SLF001
    keys = backend.take_tracked()
    backend.track_writes()  # at once: no write between the two
    return _changes_chunk(backend, keys)


async def hand_over_changes(inst: Any, epoch: int) -> dict[str, Any]:
    """Old instance, once sealed and fenced: the rows it wrote or deleted since
    :func:`copy_files` (a state chunk; a null value deletes the key) and the records it had
    not applied (sub-group -> batches). The instance then holds nothing and its part of the
    move is done."""
    engine, task = _whole(inst, epoch)
    await task.sealed.wait()
    # from the seal until this call went on (the seal's eviction and the loop's other work)
    woke_ms = round((time.time() - (task.sealed_wall or time.time())) * 1000, 1)
    backend = inst.processor.backend
    # sealed: no record changes this state any more, so the changed rows are read now, while the
    # fence (sent before the seal) goes round downstream; a row written after this (none is
    # expected) is read again below
    compacting = _compactions(backend)
    t0 = time.monotonic()
    cpu0, pcpu0 = time.thread_time(), time.process_time()
    backend._write_pending(None)  # noqa: SLF001 - timers held in memory: written (and tracked)
    t_pending = time.monotonic()
    early = backend.take_tracked()
    backend.track_writes()
    reads0, t_read = backend.db_reads, time.monotonic()
    changes = _changes_chunk(backend, early)
    # of which reading the rows (those not in the cache come from RocksDB)
    read_ms = round((time.monotonic() - t_read) * 1000, 1)
    db_reads = backend.db_reads - reads0
    early_ms = round((time.monotonic() - t0) * 1000, 1)
    # this thread's CPU time in it: far below changes_ms, the thread waited (GIL, scheduler)
    early_cpu_ms = round((time.thread_time() - cpu0) * 1000, 1)
    # and every thread's of this process: far above the thread's, another thread ran meanwhile
    early_process_cpu_ms = round((time.process_time() - pcpu0) * 1000, 1)
    t_fence = time.monotonic()
    await task.fenced.wait()
    fence_wait_ms = round((time.monotonic() - t_fence) * 1000, 1)
    held = set(np.flatnonzero(engine.held).tolist())
    if held != set(task.outgoing):
        msg = (
            f"{inst.spec.id} hands over its RocksDB files only when all it holds moves: it "
            f"holds {len(held)} sub-groups, {len(task.outgoing)} are handed out"
        )
        raise StateError(msg)
    t1 = time.monotonic()
    backend._write_pending(None)  # noqa: SLF001
    late = backend.take_tracked()
    if late:  # written between the seal and the fence: every changed row read again
        changes = _changes_chunk(backend, sorted(set(early) | set(late)))
    # everything went: closing this instance writes none of it. The cache (the state of the
    # hottest keys, tens of MB) is let go of after the answer went out: freeing it took the
    # loop ~25 ms here, with every record of the moved instance waiting for this answer
    cached, backend._cache = backend._cache, {}  # noqa: SLF001
    dirty, backend._dirty = backend._dirty, {}  # noqa: SLF001
    backend.discard_cache()
    asyncio.get_running_loop().call_later(FREE_CACHE_AFTER_S, _free, cached, dirty)
    records = pack_records(engine.handover)
    # nothing is held or handed out here any more: the engine's part is done
    engine.handover = {}
    engine.handover_rows = 0
    engine.held[:] = False
    task.outgoing.clear()
    task.bytes_out = changes.nbytes
    task.chunks_out = 1
    task.first_urgent_served_wall = time.time()
    engine._check_done()  # noqa: SLF001 - the engine's own completion check
    return {
        "changes": changes,
        "records": records,
        # reading the changed rows: at the seal (while the fence went round), and after the fence
        "changes_ms": round(early_ms + (time.monotonic() - t1) * 1000, 1),
        "fence_wait_ms": fence_wait_ms,  # after the rows were read, until the fence came back
        "woke_ms": woke_ms,
        "changes_cpu_ms": early_cpu_ms,
        "changes_read_ms": read_ms,
        # of which writing the rows held in memory (timers, resident states), and taking the keys
        "changes_pending_ms": round((t_pending - t0) * 1000, 1),
        "changes_keys_ms": round((t_read - t_pending) * 1000, 1),
        "changes_process_cpu_ms": early_process_cpu_ms,
        "changes_db_reads": db_reads,
        "compactions_at_seal": compacting,
        "late_rows": len(late),
        "handed_wall": time.time(),
    }


def pack_records(handover: dict[int, list[pa.RecordBatch]]) -> dict[str, Any]:
    """The records an old instance hands over (sub-group -> pieces, in order) as few batches
    with contiguous buffers: one per schema, the pieces one after another, and for each piece
    its sub-group, batch, offset and rows. A piece is a slice of a batch the barrier overtook,
    and a slice is pickled with its whole parent buffers: ~300 sub-group pieces of a
    1,200-row batch made ~300 copies of it."""
    schemas: list[pa.Schema] = []
    parts: list[list[pa.RecordBatch]] = []
    offsets: list[int] = []
    pieces = []
    for g, ps in handover.items():
        for p in ps:
            for i, schema in enumerate(schemas):
                if p.schema.equals(schema, check_metadata=True):
                    break
            else:
                i = len(schemas)
                schemas.append(p.schema)
                parts.append([])
                offsets.append(0)
            pieces.append((int(g), i, offsets[i], p.num_rows))
            parts[i].append(p)
            offsets[i] += p.num_rows
    return {"batches": [pa.concat_batches(ps) for ps in parts], "pieces": pieces}


def unpack_records(packed: dict[str, Any]) -> dict[int, list[pa.RecordBatch]]:
    """:func:`pack_records` undone: sub-group -> its pieces, in the order handed over."""
    batches = packed["batches"]
    out: dict[int, list[pa.RecordBatch]] = {}
    for g, i, offset, rows in packed["pieces"]:
        out.setdefault(g, []).append(batches[i].slice(offset, rows))
    return out


def _free(*held: dict[Any, Any]) -> None:
    """Let go of a handed-over instance's cache (see :func:`hand_over_changes`)."""
    for d in held:
        d.clear()


def read_piece(directory: str, name: str, offset: int, size: int) -> bytes:
    """Old instance: ``size`` bytes of file ``name`` of a handed-over folder from ``offset``."""
    path = Path(directory) / name
    if path.parent != Path(directory) or not path.is_file():
        msg = f"{name!r} is not a file of the handed-over state folder {directory}"
        raise StateError(msg)
    with path.open("rb") as f:
        f.seek(offset)
        return f.read(size)


def _move_folder(src: Path, dst: Path) -> None:
    """``src`` becomes ``dst``: renamed, or copied where it is another filesystem."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(src, dst)
    except OSError:  # another filesystem
        shutil.copytree(src, dst)
        shutil.rmtree(src, ignore_errors=True)


async def _pull_files(
    files: list[tuple[str, int]],
    dst: Path,
    read: Callable[[str, int, int], Awaitable[bytes]],
) -> int:
    """Pull every file (name, bytes) into ``dst`` through ``read(name, offset, size)``."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    total = 0
    for name, size in files:
        with (dst / name).open("wb") as f:
            offset = 0
            while offset < size:
                data = await read(name, offset, min(PIECE_BYTES, size - offset))
                if not data:
                    msg = f"file {name!r} of the moved state ended at {offset} of {size} bytes"
                    raise StateError(msg)
                f.write(data)
                offset += len(data)
        total += size
    return total


class FilesTakeOver:
    """New instance's side of a move by files: :meth:`begin` before the move barrier (the old
    instance's files in place and open, holding nothing yet), :meth:`finish` after it (the
    rows changed since, the records the old instance had not applied, then release)."""

    def __init__(self, inst: Any, epoch: int) -> None:
        self.inst = inst
        self.epoch = epoch
        self.stats: dict[str, Any] = {}
        self.key_groups: list[int] = []

    async def begin(
        self,
        same_node: bool,
        copy: Callable[[], Awaitable[dict[str, Any]]],
        read: Callable[[str, str, int, int], Awaitable[bytes]],
        release: Callable[[str], Awaitable[Any]],
    ) -> dict[str, Any]:
        """Ask the old instance for a copy of its files (``copy``), put them in place (renamed
        on ``same_node``; else pulled with ``read(directory, name, offset, size)``, then the old
        folder dropped with ``release(directory)``) and open them as this instance's RocksDB.
        Nothing is held here yet: records of the moving key groups wait for :meth:`finish`."""
        inst = self.inst
        t0 = time.monotonic()
        got = await copy()
        t_copied = time.monotonic()
        dst = Path(f"{inst.spec.state_path}.moved")
        pulled = 0
        if same_node:
            await asyncio.to_thread(_move_folder, Path(got["directory"]), dst)
        else:
            pulled = await _pull_files(
                got["files"], dst, lambda n, o, k: read(got["directory"], n, o, k)
            )
            await release(got["directory"])
        t_placed = time.monotonic()
        proc = inst.processor
        fresh = await asyncio.to_thread(proc.fresh_backend, dst)
        # held stays empty: each sub-group is held once its buffered records are released
        # (take_released), so no record of it runs before those that waited
        proc.swap_backend(fresh, [])
        self.key_groups = list(got["key_groups"])
        self.stats = {
            "checkpoint_ms": got["checkpoint_ms"],
            "copied_s": round(t_copied - t0, 3),
            "placed_ms": round((t_placed - t_copied) * 1000, 1),
            "opened_ms": round((time.monotonic() - t_placed) * 1000, 1),
            "files": len(got["files"]),
            "file_bytes": sum(size for _, size in got["files"]),
            "pulled_bytes": pulled,
            "same_node": same_node,
            "compactions_at_open": _compactions(fresh),
        }
        return dict(self.stats)

    def _apply(self, changes: pa.RecordBatch) -> None:
        """Write changed rows (a null value deletes the key) past the cache: nothing was read
        here yet, so the cache is empty."""
        if not changes.num_rows:
            return
        value = changes.column(1)
        deleted = value.is_null().to_numpy(zero_copy_only=False)
        keys = changes.column(0).to_pylist()
        puts = [k for k, d in zip(keys, deleted, strict=True) if not d]
        gone = [k for k, d in zip(keys, deleted, strict=True) if d]
        self.inst.processor.backend.write_direct(puts, value.drop_null().to_pylist(), deletes=gone)

    async def catch_up(
        self,
        take: Callable[[], Awaitable[pa.RecordBatch]],
        rounds: int = CATCH_UP_ROUNDS,
        small_bytes: int = CATCH_UP_BYTES,
    ) -> dict[str, Any]:
        """Before the barrier: the rows the old instance changed since the copy, in rounds
        (each brings what was written during the one before) until a round is smaller than
        ``small_bytes`` or ``rounds`` were made; what is written after the last round comes
        at the seal (:meth:`finish`), so records wait only for that."""
        sizes = []
        for _ in range(rounds):
            changes = await take()
            self._apply(changes)
            sizes.append(changes.nbytes)
            if changes.nbytes < small_bytes:
                break
        self.stats["catch_up_bytes"] = sizes
        return {"catch_up_bytes": sizes}

    async def finish(self, hand_over: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """Once the old instance sealed (``hand_over`` answers then): write the rows it changed
        since the copy, take the records it had not applied (before those buffered here), and
        release every moved sub-group. A failure fails the instance (the job recovers)."""
        inst = self.inst
        engine = inst.engine
        task = engine.task
        try:
            if task is None or task.epoch != self.epoch:
                msg = (
                    f"{inst.spec.id} takes over files for move epoch {self.epoch}, but its "
                    f"migration is at epoch {task.epoch if task else None}"
                )
                raise StateError(msg)
            s = engine.sub_groups
            groups = [g for kg in self.key_groups for g in range(kg * s, (kg + 1) * s)]
            if set(groups) != set(task.incoming):
                msg = (
                    f"the files handed over hold key groups {self.key_groups[:8]}..., not the "
                    f"{len(task.incoming)} sub-groups this instance takes over at epoch "
                    f"{self.epoch}"
                )
                raise StateError(msg)
            t0 = time.monotonic()
            got = await hand_over()
            t_handed = time.monotonic()
            received_wall = time.time()
            changes = got["changes"]
            backend = inst.processor.backend
            self._apply(changes)
            handed = unpack_records(got["records"])
            for g, pieces in handed.items():
                engine._hand_in(task, int(g), pieces)  # noqa: SLF001 - before those buffered here
            task.bytes_in = self.stats["file_bytes"] + changes.nbytes
            task.rows_in = int(backend._db.property_int_value("rocksdb.estimate-num-keys") or 0)  # noqa: SLF001
            task.all_arrived_wall = time.time()
            engine.restored(groups)
            inst.inbox.poke()
            return {
                **self.stats,
                "hand_over_wait_ms": round((t_handed - t0) * 1000, 1),
                "changes_ms": got["changes_ms"],
                "fence_wait_ms": got.get("fence_wait_ms"),
                "late_rows": got.get("late_rows"),
                "woke_ms": got.get("woke_ms"),
                "changes_cpu_ms": got.get("changes_cpu_ms"),
                "changes_read_ms": got.get("changes_read_ms"),
                "changes_pending_ms": got.get("changes_pending_ms"),
                "changes_keys_ms": got.get("changes_keys_ms"),
                "changes_process_cpu_ms": got.get("changes_process_cpu_ms"),
                "changes_db_reads": got.get("changes_db_reads"),
                "old_compactions_at_seal": got.get("compactions_at_seal"),
                "compactions_at_hand_over": _compactions(backend),
                # from the old instance's answer to its arrival here (the call's return path)
                "answer_in_ms": round((received_wall - got["handed_wall"]) * 1000, 1),
                "changed_rows": changes.num_rows,
                "changed_bytes": changes.nbytes,
                "applied_ms": round((time.monotonic() - t_handed) * 1000, 1),
                "handover_rows": int(sum(p.num_rows for ps in handed.values() for p in ps)),
                "handover_bytes": int(sum(b.nbytes for b in got["records"]["batches"])),
            }
        except BaseException as e:
            engine.error = e if isinstance(e, Exception) else StateError(repr(e))
            engine.poke()
            raise
