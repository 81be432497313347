"""A warm spare's imports at the lowest CPU priority, so its start takes little CPU the job needs.

A job started with ``RuntimeConfig(change_spares=N)`` keeps warm spare actors
(raystream.change_spares) that inserts and moves configure instead of starting processes; a
spare used by a change is refilled while the job runs on. Most of a process's start-up CPU is
importing pyarrow, numpy, pandas and rocksdict; on a small machine running flat out that start
raised the sink latency of a 100k events/s job 3-4x over its steady p99.

The controller starts each spare with ``RAYSTREAM_WARM_SPARE=1`` in its environment.
``raystream/__init__`` calls :func:`warm_up_if_spare` first thing: in such a process the
modules of :data:`WARM_MODULES` are imported by a helper thread in the idle scheduling class
(``SCHED_IDLE``; else at nice 19: Linux schedules threads one by one; Ray already runs its
workers at nice 15, so nice 19 alone would still take a third of a worker's share), while the
main thread waits for it; the rest of raystream's import then finds them loaded. The main
thread's priority is never changed, so the instance the spare becomes runs at the priority it
would have had (raising a priority back needs privileges). (Tried for the scale-out standbys
too: there it cost throughput, as the per-actor ``runtime_env`` made Ray start an extra worker.)
On an idle machine the imports take as long as before; while the job keeps every core busy they
take the CPU left over, and the spare is ready later.

Stdlib only: this runs before anything else raystream imports.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from typing import Any

__all__ = ["SPARE_ENV", "WARM_MODULES", "WARM_NICE", "spare_env", "warm_up_if_spare"]

SPARE_ENV = "RAYSTREAM_WARM_SPARE"
# third-party modules an instance imports (raystream.runtime.actors, and pandas, which pyarrow's
# to_numpy imports lazily); raystream's own modules cannot be imported from another thread while
# the main thread is inside raystream/__init__ (it holds the package's import lock)
WARM_MODULES = ("numpy", "pyarrow", "pyarrow.compute", "rocksdict", "xxhash", "hdrh", "pandas")
WARM_NICE = 19  # the helper thread's nice value where there is no idle scheduling class

# what the warm-up did in this process (None: not a spare), for the start-up timeline
last_warm_up: dict[str, Any] | None = None


def spare_env() -> dict[str, str]:
    """The environment variables a warm spare actor is started with (its ``runtime_env``)."""
    return {SPARE_ENV: "1"}


def _lower_thread_priority(nice: int) -> str | None:
    """Put the calling thread (Linux: priorities are per thread) in the idle scheduling class
    (``SCHED_IDLE``: it runs when nothing else wants the CPU), or else at nice ``nice``; says
    which (``"idle"``, ``"nice <n>"``), or None where the platform has neither."""
    tid = threading.get_native_id()
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return "idle"
        except OSError:
            pass
    if hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            return f"nice {os.getpriority(os.PRIO_PROCESS, tid)}"
        except OSError:
            pass
    return None


def warm_up_if_spare(modules: tuple[str, ...] = WARM_MODULES) -> dict[str, Any] | None:
    """In a warm spare process (``RAYSTREAM_WARM_SPARE`` set; it is removed, so processes
    this one starts do not inherit it), import ``modules`` in a helper thread at nice
    :data:`WARM_NICE` and wait for it. Returns what it did (also kept in ``last_warm_up``):
    the modules imported, the thread's priority, its CPU and wall seconds; None elsewhere.
    A module that fails to import is left for the normal import to report."""
    global last_warm_up
    if os.environ.pop(SPARE_ENV, "") != "1":
        return None
    report: dict[str, Any] = {"modules": [], "failed": [], "priority": None}

    def run() -> None:
        report["priority"] = _lower_thread_priority(WARM_NICE)
        cpu0 = time.thread_time()
        for name in modules:
            try:
                importlib.import_module(name)
                report["modules"].append(name)
            except Exception:  # noqa: BLE001 - the main thread's own import will say why
                report["failed"].append(name)
        report["cpu_s"] = round(time.thread_time() - cpu0, 4)

    t0 = time.time()
    helper = threading.Thread(target=run, name="raystream-warm-spare", daemon=True)
    helper.start()
    helper.join()
    report["started_at"] = t0
    report["wall_s"] = round(time.time() - t0, 4)
    last_warm_up = report
    return report
