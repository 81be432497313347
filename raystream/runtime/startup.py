"""When this process started and how long its start-up steps took (for ``bench/deploy.py``).

A Ray worker process boots (Python, ``import ray``, registers with the raylet), then the first
task it runs (an actor's creation) imports raystream, then the actor is constructed. The marks
are wall-clock seconds (``time.time()``), comparable across processes of one machine.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

__all__ = ["process_started_at", "timeline"]


def process_started_at() -> float | None:
    """The wall-clock time this process was created (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 of stat: start time in clock ticks after boot
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def timeline(**marks: Any) -> dict[str, Any]:
    """This process's start-up marks: process creation, when ``import raystream`` began, plus
    ``marks`` (the caller's own: e.g. when its constructor ran)."""
    package = sys.modules.get("raystream")
    return {
        "pid": os.getpid(),
        "process_started_at": process_started_at(),
        "raystream_import_at": getattr(package, "_IMPORT_STARTED_AT", None),
        "now": time.time(),
        **marks,
    }
