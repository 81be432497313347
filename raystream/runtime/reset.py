"""Taking an instance actor back to a warm, unconfigured state (a recovery that keeps it).

A recovery rolls every instance back to the latest checkpoint; an actor whose process is alive
need not be replaced for that: :func:`reset_endpoint` stops what the old attempt's instance (or
operator chain) runs in this process and leaves the actor as a warm standby is before its
``configure``. The old attempt is fenced by the caller first (its pushes are dropped from then
on, see ``InstanceEndpoint.push``); what is reset here:

- the instance's loop (the ``run`` task) and the tasks it started: the metrics export, the
  migration engine's tasks; a source's ingest buffer fails, so an outside writer of the old
  attempt (a Spark task) gets the attempt error instead of waiting for room;
- every other call in progress on the actor's loop (pushes of the old attempt waiting in the
  old inbox for room, a rescale's or move's calls of the old attempt) is cancelled: its caller
  gets its answer (an error) at once, as it would from an actor that died;
- sinks drop what they did not pre-commit (as a failing instance does; the pre-committed
  parts stay for the restore);
- moved state being served (``serve_state`` on the actor's transfer loop, and the migration
  engine's serving loop there) is cancelled first, and the reset waits for it to end: it reads
  the state closed below; its callers get a ``StaleAttemptError``, never a chunk read before;
- keyed state: RocksDB is closed without writing its caches (the old attempt's folder is
  deleted next: writing them would be wasted work on the recovery's path);
- the wiring (receivers, peers, a move's take-over) is dropped, then a full garbage collection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from raystream.errors import RaystreamError

__all__ = ["StaleAttemptError", "reset_endpoint", "stale_attempt_reason", "stop_serving"]

log = logging.getLogger("raystream.reset")

RUN_STOP_S = 5.0  # the old loop gets this long to end once cancelled


class StaleAttemptError(RaystreamError):
    """A call sent by an instance of a job attempt that a recovery replaced."""


def stale_attempt_reason(job: str, step: str, index: int, old: int, new: int) -> str:
    return (
        f"source {step!r}/{index} of job {job!r} was reset from attempt {old} to attempt {new}: "
        "the job recovered from a checkpoint; the feed re-sends for the new attempt"
    )


async def reset_endpoint(endpoint: Any, attempt: int) -> None:
    """Stop and drop ``endpoint``'s instances (see the module doc); ``attempt``: the new one."""
    instances = endpoint._instances()
    for inst in instances:
        inst.stop()
    await stop_serving(endpoint, instances)
    for inst in instances:  # writers of the old attempt stop waiting first
        buffer = getattr(inst.reader, "buffer", None)
        if buffer is not None and hasattr(buffer, "fail"):
            reason = stale_attempt_reason(
                inst.spec.job, inst.step.name, inst.spec.index, inst.spec.attempt, attempt
            )
            with contextlib.suppress(Exception):
                await buffer.fail(reason)
    for _ in range(5):  # the writers waiting for room wake and get that error first
        await asyncio.sleep(0)
    task = endpoint._run_task
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(task), RUN_STOP_S)
    current = asyncio.current_task()
    others = [
        t
        for t in asyncio.all_tasks()
        if t is not current and t is not endpoint._run_call and not t.done()
    ]
    for t in others:
        t.cancel()
    if others:
        await asyncio.wait(others, timeout=RUN_STOP_S)
    if endpoint._metrics_task is not None:
        endpoint._metrics_task.cancel()
        endpoint._metrics_task = None
    for inst in instances:
        await _release(inst)
    endpoint._unconfigure()
    endpoint._receivers = {}
    for name in ("_peers", "_take_over"):
        if hasattr(endpoint, name):
            delattr(endpoint, name)


async def stop_serving(endpoint: Any, instances: list[Any]) -> list[Any]:
    """Cancel the moved-state serving in progress on other loops (the actor's transfer group):
    the endpoint's ``serve_state`` calls and each instance's migration engine serving loop; wait
    until they ended (at most ``RUN_STOP_S``). Returns those still running then (logged)."""
    here = asyncio.get_running_loop()
    pending: list[Any] = []

    def cancel(task: Any, loop: asyncio.AbstractEventLoop) -> None:
        if task.done():
            return
        if loop is here:
            task.cancel()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(task.cancel)
        else:
            return
        pending.append(task)

    calls = endpoint._serving_calls() if hasattr(endpoint, "_serving_calls") else {}
    for task, loop in calls.items():
        cancel(task, loop)
    for inst in instances:
        migration = getattr(getattr(inst, "engine", None), "task", None)
        server = getattr(migration, "server", None)
        if server is not None:
            cancel(server, server.get_loop())
    deadline = time.monotonic() + RUN_STOP_S
    while any(not t.done() for t in pending) and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    stuck = [t for t in pending if not t.done()]
    if stuck:
        log.warning(
            "reset: %d state serving task(s) did not end within %.1f s of their cancel",
            len(stuck),
            RUN_STOP_S,
        )
    return stuck


async def _release(inst: Any) -> None:
    """Free what one instance of the old attempt holds in this process."""
    engine = inst.engine
    for task in list(getattr(engine, "_tasks", ())):
        task.cancel()
    if inst.writer is not None:
        with contextlib.suppress(Exception):
            inst.abort()
    reader = inst.reader
    if reader is not None and hasattr(reader, "close"):
        with contextlib.suppress(Exception):
            reader.close()
    processor = inst.processor
    # keyed state: dropped without writing its cache (the folder is deleted next)
    close = getattr(processor, "discard", None) or getattr(processor, "close", None)
    if close is not None:
        try:
            await asyncio.to_thread(close)  # RocksDB: waits for a checkpoint in a thread
        except Exception as e:  # noqa: BLE001 - the folder is deleted anyway
            log.warning("closing the state of %s failed: %s", inst.spec.id, e)
