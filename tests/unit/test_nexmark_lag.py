"""bench/nexmark/lag.py: the wall-clock time a window closed at the sources, from their watermark
timelines, against a plain-Python scan of the same points."""

from __future__ import annotations

import random

import numpy as np

from tests._bench import import_bench

lag = import_bench("bench.nexmark.lag")


def closed_at(timelines: list[list[list[int]]], end: int) -> int:
    """The latest over sources of the first time its watermark reached ``end - 1``."""
    times = []
    for points in timelines:
        hit = [t for t, w in points if w >= end - 1]
        times.append(min(hit) if hit else 2**63 - 1)
    return max(times)


def test_window_close_time_is_the_last_source_to_pass_the_window_end() -> None:
    rnd = random.Random(7)
    timelines = []
    for _ in range(3):
        t, w, points = 1_000, 0, []
        for _ in range(200):
            t += rnd.randrange(1, 50)
            w += rnd.randrange(0, 30)
            points.append([t, w])
        timelines.append(points)
    ends = np.array([rnd.randrange(0, 7_000) for _ in range(500)] + [1, 10**9], np.int64)
    got = lag.window_close_ns(timelines, ends)
    assert got.tolist() == [closed_at(timelines, int(e)) for e in ends]
