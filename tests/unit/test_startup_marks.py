"""Start-up and recovery timing marks (what bench/deploy.py reads): plain objects, no Ray."""

from __future__ import annotations

import os
import time

import raystream
from raystream.recovery import _deploy_phases, _Phases
from raystream.runtime.startup import process_started_at, timeline


def test_this_process_started_before_raystream_was_imported_and_before_now() -> None:
    started = process_started_at()
    assert started is not None  # Linux /proc
    marks = timeline(init_at=123.0)
    assert marks["pid"] == os.getpid() and marks["init_at"] == 123.0
    assert started - 1.0 <= raystream._IMPORT_STARTED_AT <= marks["now"] <= time.time()
    assert marks["raystream_import_at"] == raystream._IMPORT_STARTED_AT


def test_recovery_phases_are_consecutive_durations() -> None:
    phases = _Phases(failed_at=time.time())
    time.sleep(0.02)
    phases.mark("kill_s")
    phases.mark("names_free_s")
    assert list(phases.durations) == ["kill_s", "names_free_s"]
    assert phases.durations["kill_s"] >= 0.02 > phases.durations["names_free_s"] >= 0


def test_deploy_phases_come_from_the_deploy_marks() -> None:
    marks = {
        "deploy_at": 10.0,
        "placed_at": 10.1,
        "actors_ready_at": 12.6,
        "connected_at": 12.7,
        "running_at": 13.2,
        "delay_left_s": 0.5,
    }
    got = _deploy_phases(marks)
    want = {"placement_s": 0.1, "actors_s": 2.5, "wiring_s": 0.1, "loops_s": 0.5}
    assert {k: round(v, 6) for k, v in got.items() if k in want} == want
    assert got["delay_left_s"] == 0.5
    assert (
        _deploy_phases({k: v for k, v in marks.items() if k != "delay_left_s"})["delay_left_s"]
        == 0.0
    )
