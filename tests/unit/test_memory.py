"""Resident memory readings (the peak an instance reaches while state moves)."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from raystream.runtime.memory import PeakRss, rss_bytes

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")


@linux
def test_rss_follows_memory_the_process_touches() -> None:
    before = rss_bytes()
    block = np.ones(64 * 2**20, dtype=np.uint8)  # 64 MiB, every page written
    during = rss_bytes()
    assert before is not None and during is not None
    assert during - before >= 48 * 2**20, (before, during)
    del block


@linux
def test_the_sampler_keeps_the_peak_of_memory_freed_before_it_stopped() -> None:
    rss = PeakRss(interval_s=0.005)
    block = np.ones(96 * 2**20, dtype=np.uint8)
    time.sleep(0.05)  # several samples while the block is held
    del block
    time.sleep(0.02)
    rss.stop()
    assert rss.start is not None and rss.peak is not None
    assert rss.growth is not None and rss.growth >= 80 * 2**20, rss.growth
    assert rss.peak >= (rss_bytes() or 0)  # the block is gone now, the peak kept it
    peak = rss.peak
    rss.stop()  # idempotent: no later sample
    np.ones(128 * 2**20, dtype=np.uint8)
    time.sleep(0.02)
    assert rss.peak == peak
