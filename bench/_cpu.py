"""CPU seconds of a process tree (this process, the local Ray it started, Ray's workers).

Linux only (``/proc``). A sampler thread reads every descendant's user + system time a few times
a second and keeps each process's highest reading, so processes that exit during the run (the
job's actors are killed when it ends) still count up to their last sample.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

__all__ = ["CpuSampler"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float, str] | None:
    """(parent pid, user + system CPU seconds, name) of ``pid``, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK, name


def _tree(root: int) -> dict[int, tuple[float, str]]:
    stats: dict[int, tuple[int, float, str]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            s = _stat(int(entry.name))
            if s is not None:
                stats[int(entry.name)] = s
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, tuple[float, str]] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            out[pid] = (stats[pid][1], stats[pid][2])
        todo.extend(children.get(pid, ()))
    return out


class CpuSampler:
    """CPU seconds the process tree under ``root`` (default: this process) spent between
    :meth:`start` and :meth:`stop`, in total and per process name (e.g. ``ray::Instance``)."""

    def __init__(self, root: int | None = None, interval_s: float = 0.2) -> None:
        self.root = root or os.getpid()
        self.interval_s = interval_s
        self._base: dict[int, float] = {}
        self._last: dict[int, tuple[float, str]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        for pid, (cpu, name) in _tree(self.root).items():
            self._base.setdefault(pid, 0.0 if self._thread is not None else cpu)
            prev = self._last.get(pid)
            self._last[pid] = (max(cpu, prev[0]) if prev else cpu, name)

    def start(self) -> None:
        self._sample()  # processes alive now count from their current CPU time
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def stop(self) -> dict[str, float | dict[str, float]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        by_name: dict[str, float] = {}
        for pid, (cpu, name) in self._last.items():
            by_name[name] = by_name.get(name, 0.0) + cpu - self._base.get(pid, 0.0)
        total = sum(by_name.values())
        top = dict(
            sorted(
                ((k, round(v, 2)) for k, v in by_name.items() if v >= 0.05), key=lambda kv: -kv[1]
            )
        )
        return {"total_s": round(total, 2), "by_process": top}
