"""What one operator instance does for checkpoints and recovery. No Ray here.

- At a checkpoint barrier (after it went on downstream, as Flink does): a source reports its
  position; a keyed instance starts a RocksDB checkpoint (it only swaps out its dirty cache
  entries, O(1); writing them, the memtable flush and the hard links run in a thread: the loop
  goes on) and copies its files to checkpoint storage, acknowledging once they are durable; a sink
  pre-commits (two-phase commit), its slow part (closing a Parquet part, building an in-memory
  sink's table) in that thread too.
- On recovery: a source rewinds to its recorded position, a keyed instance restores the key
  groups it owns from whichever instance held them at the checkpoint, a sink publishes what the
  checkpoint pre-committed and drops the rest.
"""

from __future__ import annotations

import asyncio
import io
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from raystream.runtime.watermarks import WATERMARK_MIN
from raystream.state.rocks import RocksStateBackend

if TYPE_CHECKING:
    from raystream.runtime.instance import InstanceSpec, OperatorInstance

__all__ = [
    "FINAL_CHECKPOINT",
    "CheckpointState",
    "restore_keyed",
    "restore_pushed",
    "restore_sink",
    "rewind_source",
    "source_state",
]

# the pre-commit id of a sink's end of input: published after the last regular checkpoint
FINAL_CHECKPOINT = 1 << 62
_SKIP_ROWS = 1 << 20  # rows a rewinding source reads (and drops) at once


def open_storage(storage: tuple[str, ...]) -> Any:
    """``(uri, job)``: the job's checkpoint storage; ``("savepoint", uri)``: a savepoint."""
    from raystream.checkpoint.storage import CheckpointStorage, open_savepoint

    if storage[0] == "savepoint":
        return open_savepoint(storage[1])[0]
    uri, job = storage
    return CheckpointStorage(uri, job)


class CheckpointState:
    """Per instance: its handle on checkpoint storage and the uploads under way."""

    def __init__(self, spec: InstanceSpec) -> None:
        self.spec = spec
        self._storage: Any = None
        # a collect sink's committed rows, one blob a checkpoint: {"path", "size"}
        self.sink_blobs: list[dict[str, Any]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.uploaded_bytes = 0
        self.referenced_bytes = 0
        self.taken = 0  # checkpoints this instance took part in
        # an in-memory sink's rows since its last pre-commit, kept at its end (persist_end)
        self.end_rows: pa.Table | None = None

    @property
    def active(self) -> bool:
        """Whether this job's output goes through checkpoints (two-phase commit up to the end):
        it checkpoints periodically, was restored from one, or took one on request."""
        cfg = self.spec.config
        return cfg.checkpoint_interval_s > 0 or self.spec.restore is not None or self.taken > 0

    @property
    def storage(self) -> Any:
        if self._storage is None:
            assert self.spec.storage is not None, "this job has no checkpoint storage"
            self._storage = open_storage(self.spec.storage)
        return self._storage

    @staticmethod
    def two_phase(writer: Any) -> bool:
        return callable(getattr(writer, "pre_commit", None))

    def take(
        self, inst: OperatorInstance, barrier: Any, info: dict[str, Any]
    ) -> Callable[[], dict[str, Any]] | None:
        """Do the synchronous part of checkpoint ``barrier.epoch`` at this instance (aligned: no
        record after the barrier was processed yet); return the slow part (an upload, run in a
        thread after the barrier went on) or None. A failure fails this checkpoint, not the job."""
        cid = barrier.epoch
        self.taken += 1
        if self.spec.storage is None:
            info["error"] = "this job has no checkpoint storage"
            return None
        instance = f"{inst.step.name}/{inst.spec.index}"
        if inst.writer is not None:  # a sink's watermark at the barrier (partition commit)
            w = getattr(inst, "_wm_sent", WATERMARK_MIN)
            info["watermark_ms"] = None if w <= WATERMARK_MIN else int(w)
        try:
            proc = inst.processor
            if proc is not None and hasattr(proc, "backend"):
                local = Path(f"{self.spec.state_path}-checkpoints") / f"chk-{cid}"
                shutil.rmtree(local, ignore_errors=True)
                # writing the barrier's dirty entries, the memtable flush and the RocksDB
                # checkpoint run in a thread; later writes wait in the write-back cache
                taken = proc.backend.snapshot_async(local)
                info["key_groups"] = proc.owned_key_groups
                uid = proc.backend.uid
                storage = self.storage

                def upload() -> dict[str, Any]:
                    try:
                        taken.result()
                        desc = storage.upload_state(cid, instance, str(local), uid)
                    finally:
                        shutil.rmtree(local, ignore_errors=True)
                    return {"state": desc}

                return upload
            writer = inst.writer
            split = getattr(writer, "pre_commit_split", None)
            deferred = getattr(writer, "pre_commit_deferred", None)
            if not callable(split) and callable(deferred):  # remote uploads after the barrier
                state, upload = deferred(cid)
                if upload is None:
                    info["sink_state"] = state
                    return None

                def finish_upload() -> dict[str, Any]:
                    upload()
                    return {"sink_state": state}

                return finish_upload
            if writer is not None and self.two_phase(writer):
                split = getattr(writer, "pre_commit_split", None)
                if callable(split):  # the slow part (closing a file) runs in the thread
                    state, finish = split(cid)
                    if finish is not None:

                        def close_part() -> dict[str, Any]:
                            finish()
                            return {"sink_state": state}

                        return close_part
                else:
                    state = writer.pre_commit(cid)
                if isinstance(state, dict) and _in_memory_rows(state):
                    rows = state["rows"]
                    storage = self.storage
                    blobs = self.sink_blobs

                    def upload_rows() -> dict[str, Any]:
                        # every checkpoint references the blobs of all earlier ones: they are
                        # shared files with a size, kept while a retained manifest lists them
                        table = rows() if callable(rows) else rows  # built here, off the loop
                        if table.num_rows:
                            data = _ipc(table)
                            ref = storage.put_blob(cid, instance, "rows.arrow", data, shared=True)
                            blobs.append({"path": ref, "size": len(data)})
                        return {"sink_state": {"blobs": list(blobs)}}

                    return upload_rows
                info["sink_state"] = state
        except Exception as e:  # noqa: BLE001 - reported in the acknowledgement
            info["error"] = f"{type(e).__name__}: {e}"
        return None

    def finish_later(
        self,
        work: Callable[[], dict[str, Any]],
        info: dict[str, Any],
        report: Callable[[str, dict[str, Any]], Any],
    ) -> None:
        async def run() -> None:
            try:
                out = await asyncio.to_thread(work)
                info.update(out)
                state = out.get("state") or {}
                self.uploaded_bytes += int(state.get("uploaded_bytes", 0))
                self.referenced_bytes += int(state.get("referenced_bytes", 0))
            except Exception as e:  # noqa: BLE001 - the checkpoint fails, the job goes on
                info["error"] = f"{type(e).__name__}: {e}"
            report("barrier", info)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def end_of_input(self, writer: Any) -> Any:
        """A two-phase sink reached the end of its input: pre-commit that end (published once the
        controller recorded it). Rows a sink keeps in memory (collect) stay here until a later
        checkpoint stores them (:meth:`persist_end`): the state reported is ``{"in_memory":
        True}``; any other sink's pre-committed state is durable as it is."""
        state = writer.pre_commit(FINAL_CHECKPOINT)
        if isinstance(state, dict) and _in_memory_rows(state):
            rows = state["rows"]
            self.end_rows = rows() if callable(rows) else rows
            return {"in_memory": True}
        return state

    def persist_end(self, checkpoint_id: int, instance: str) -> dict[str, Any]:
        """Store the rows an ended in-memory sink kept since its last pre-commit in checkpoint
        ``checkpoint_id`` (its branch finished while the job runs on): the state returned lists
        every blob it committed, so this checkpoint and every later one hold all of its rows and
        a recovery gives them back. Idempotent: a second call stores nothing new."""
        rows, self.end_rows = self.end_rows, None
        if rows is not None and rows.num_rows:
            data = _ipc(rows)
            ref = self.storage.put_blob(checkpoint_id, instance, "end.arrow", data, shared=True)
            self.sink_blobs.append({"path": ref, "size": len(data)})
        return {"blobs": list(self.sink_blobs)}

    def commit(self, writer: Any, checkpoint_id: int) -> None:
        if writer is not None and callable(getattr(writer, "commit", None)):
            writer.commit(checkpoint_id)


# ---- sources ------------------------------------------------------------------------------
def source_state(inst: OperatorInstance) -> dict[str, Any]:
    """A source's position at a checkpoint barrier: the rows it emitted before it; a file
    source adds its (unit, row) and listing digest; a push source adds, per writer token, the rows of it that went downstream (its dedupe table)."""
    state: dict[str, Any] = {"offset": inst.rows_emitted}
    position = getattr(inst.reader, "position", None)
    if callable(position):  # a file source: (unit, row) and its listing's digest
        state["position"] = position()
    buffer = getattr(inst.reader, "buffer", None)
    if buffer is not None and hasattr(buffer, "checkpoint_state"):
        state["pushed"] = buffer.checkpoint_state()
    return {"source_state": state}


def restore_pushed(inst: OperatorInstance) -> None:
    """Recovery of a push source, as its buffer opens (before any writer's rows are taken):
    the checkpoint's dedupe table comes back, so re-sent rows it covers are dropped."""
    buffer = getattr(inst.reader, "buffer", None)
    restore = inst.spec.restore or {}
    state = restore.get("source") or {}
    if buffer is None or not hasattr(buffer, "restore"):
        return
    if state.get("finished"):
        buffer.restore_complete()
        return
    offset = int(state.get("offset", 0))
    if offset and "pushed" not in state:
        msg = (
            f"source {inst.step.name!r} takes pushed rows ({inst.step.fn.describe()}) and the "
            f"checkpoint {restore.get('checkpoint_id')} records {offset} rows of it without the "
            "writers' positions (a checkpoint of an older raystream?); restart the job without "
            "--from-checkpoint"
        )
        from raystream.errors import SourceError

        raise SourceError(msg)
    if "pushed" in state:
        buffer.restore(state["pushed"])
    inst.rows_emitted = offset


def rewind_source(inst: OperatorInstance, restore: dict[str, Any]) -> None:
    """Recovery: continue after the rows a checkpoint's state already holds. The reader is read
    up to there and what it returns is dropped (readers are deterministic: same rows, same order).
    A push source is not read: its buffer took the checkpoint's table when it opened, and its
    writers re-send (:func:`restore_pushed`)."""
    state = restore.get("source") or {}
    if state.get("finished"):
        inst._source_done = True  # noqa: SLF001 - it had ended before the checkpoint
        return
    if hasattr(inst.reader, "aread"):
        return
    offset = int(state.get("offset", 0))
    if "position" in state and callable(getattr(inst.reader, "check_position", None)):
        inst.reader.check_position(state["position"])
    if callable(getattr(inst.reader, "skip", None)):  # skips what it can without reading
        inst.rows_emitted = inst.reader.skip(offset)
        return
    skipped = 0
    while skipped < offset:
        batch = inst.reader.read(min(_SKIP_ROWS, offset - skipped))
        if batch is None:
            break
        skipped += batch.num_rows
    inst.rows_emitted = skipped


# ---- keyed state ---------------------------------------------------------------------------
def restore_keyed(inst: OperatorInstance) -> None:
    """Recovery: load the key groups this instance owns from the checkpoint's instance states.

    The state that holds most of them is downloaded as this instance's new RocksDB and opened in
    place (files, no row copy; the key groups it should not bring are dropped by range); each
    other one is downloaded into a temporary folder and its key groups are copied in by rows."""
    restore = inst.spec.restore or {}
    parts = restore.get("keyed") or []
    if not parts:
        return
    began = time.monotonic()
    proc = inst.processor
    storage = open_storage(restore["storage"])
    parts = sorted(parts, key=lambda part: -len(part["key_groups"]))
    base, others = parts[0], parts[1:]
    owned = [int(g) for g in proc.owned_key_groups]
    path = Path(proc.backend.path)
    local = Path(tempfile.mkdtemp(prefix=f"{path.name}-restored-", dir=path.parent)) / "db"
    storage.materialize_state(base["state"], str(local))
    fresh = RocksStateBackend(local, cache_entries=proc.cache_entries)
    from_base = {int(g) for g in base["key_groups"]}
    for g in range(proc.key_space.num_key_groups):
        if g not in from_base:
            fresh.drop_key_group(g)
    proc.swap_backend(fresh, owned)
    rows = 0
    for part in others:
        tmp = Path(tempfile.mkdtemp(prefix="raystream-restore-", dir=path.parent))
        try:
            snap = storage.materialize_state(part["state"], str(tmp / "db"))
            rows += proc.backend.restore_key_groups(snap, part["key_groups"])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    timers = getattr(proc, "timers", None)
    if timers is not None and others:  # timers came back with their key groups: index them
        timers.reindex()
    inst.metrics.restored_rows = rows  # type: ignore[attr-defined] - rows copied (not opened)
    inst.restore_s = time.monotonic() - began  # type: ignore[attr-defined] - see actors.startup


# ---- sinks ---------------------------------------------------------------------------------
async def restore_sink(inst: OperatorInstance) -> None:
    """Give a two-phase sink the state of the checkpoint the job restarts from (None: no
    checkpoint: it drops whatever earlier attempts left pending)."""
    writer = inst.writer
    if writer is None or not callable(getattr(writer, "restore", None)):
        return
    restore = inst.spec.restore
    if restore is None:
        return  # a first start
    state = restore.get("sink")
    if isinstance(state, dict) and "blobs" in state:
        storage = open_storage(restore["storage"])  # type: ignore[index]
        blobs = list(state["blobs"])
        refs = [b["path"] if isinstance(b, dict) else b for b in blobs]
        tables = await asyncio.to_thread(lambda: [_from_ipc(storage.get_blob(r)) for r in refs])
        inst.checkpoints.sink_blobs = blobs
        state = {"tables": tables}
    writer.restore(state)


def _in_memory_rows(state: dict[str, Any]) -> bool:
    """A pre-commit of a sink that keeps its output in memory: ``{"rows": table}``, or
    ``{"rows": fn}`` where ``fn()`` builds that table (called in a thread)."""
    rows = state.get("rows")
    return isinstance(rows, pa.Table) or callable(rows)


def _ipc(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


def _from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_file(pa.py_buffer(data)).read_all()


async def gather_pending(state: CheckpointState) -> None:
    """Wait for uploads under way (tests; an instance that ends waits for them)."""
    tasks: list[Awaitable[None]] = list(state._tasks)  # noqa: SLF001
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
