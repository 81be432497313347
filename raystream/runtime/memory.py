"""Resident memory of this process, and its peak while something runs (a state move).

RSS counts everything the process holds: Python objects, Arrow buffers and RocksDB's C++
allocations (memtables, block cache, iterators). Linux only (``/proc/self/statm``); elsewhere
the readings are None.
"""

from __future__ import annotations

import os
import threading

__all__ = ["PeakRss", "rss_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int | None:
    """This process's resident set size now, in bytes (None where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class PeakRss:
    """Samples RSS every ``interval_s`` in a daemon thread from construction until :meth:`stop`
    (a thread, so a busy event loop does not hide the peak); ``start``/``peak`` in bytes."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.start = rss_bytes()
        self.peak = self.start
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.start is not None:
            self._thread = threading.Thread(target=self._run, name="raystream-rss", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def _sample(self) -> None:
        now = rss_bytes()
        if now is not None and (self.peak is None or now > self.peak):
            self.peak = now

    def stop(self) -> None:
        """Take a last sample and end the thread (idempotent)."""
        if not self._stop.is_set():
            self._sample()
            self._stop.set()

    @property
    def growth(self) -> int | None:
        """Peak minus the reading at the start, in bytes."""
        if self.start is None or self.peak is None:
            return None
        return self.peak - self.start
