"""A warm spare's imports at the lowest priority (raystream.runtime.warm_spare), each check
in a fresh interpreter: the warm-up runs as raystream is first imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from raystream.runtime.warm_spare import SPARE_ENV, WARM_MODULES, WARM_NICE

PROBE = (
    """
import json, os, sys, threading
before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
import raystream
from raystream.runtime import warm_spare
import raystream.runtime.actors
print(json.dumps({
    "report": warm_spare.last_warm_up,
    "main_nice_before": before,
    "main_nice_after": os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
    "main_policy": os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None,
    "normal_policy": getattr(os, "SCHED_OTHER", None),
    "env_left": os.environ.get(%r),
    "modules": sorted(sys.modules),
}))
"""
    % SPARE_ENV
)


def _probe(spare: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != SPARE_ENV}
    if spare:
        env[SPARE_ENV] = "1"
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread priority is Linux only")
def test_a_spare_imports_in_a_low_priority_thread_and_keeps_its_main_thread_priority() -> None:
    got = _probe(spare=True)
    rep = got["report"]
    assert rep is not None, "the warm-up did not run in a process started as a warm spare"
    assert rep["modules"] == list(WARM_MODULES), (
        f"imported {rep['modules']}, failed {rep['failed']}"
    )
    assert rep["priority"] in ("idle", f"nice {WARM_NICE}"), (
        f"helper thread priority: expected idle or nice {WARM_NICE}, got {rep['priority']}"
    )
    assert got["main_nice_after"] == got["main_nice_before"], (
        f"the main thread's nice changed: {got['main_nice_before']} -> {got['main_nice_after']}"
    )
    assert got["main_policy"] == got["normal_policy"], (
        f"the main thread's scheduling policy is {got['main_policy']}, expected SCHED_OTHER"
    )
    assert got["env_left"] is None, "the spare variable is left for child processes"


def test_an_ordinary_process_does_no_warm_up() -> None:
    got = _probe(spare=False)
    assert got["report"] is None, f"expected no warm-up, got {got['report']}"


def test_every_warm_module_is_one_an_instance_imports_anyway() -> None:
    """The warm-up imports nothing an instance would not (raystream.runtime.actors + pandas,
    which pyarrow's to_numpy imports lazily): it moves work, it adds none."""
    loaded = set(_probe(spare=False)["modules"])
    extra = [m for m in WARM_MODULES if m != "pandas" and m not in loaded]
    assert not extra, f"warm modules that raystream.runtime.actors does not import: {extra}"
