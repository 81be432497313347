"""``metrics()``/``status()`` do not wait on an instance that does not answer (its node was
lost and Ray has not declared it dead yet, or its loop is stuck): without Ray, the controller
is a plain class and the handles are stand-ins whose calls answer or hang."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from raystream import controller as controller_module
from tests.unit._plain_controller import Call, plain_controller


class _Handle:
    def __init__(self, iid: tuple[str, int], hangs: bool) -> None:
        self.metrics = Call(None if hangs else {"step": iid[0], "index": iid[1]})


def test_an_instance_that_does_not_answer_is_listed_not_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(controller_module, "METRICS_ANSWER_S", 0.2)
    c = plain_controller("unanswered", tmp_path)
    hung = ("count", 1)
    c.handles = {iid: _Handle(iid, hangs=iid == hung) for iid in c.specs}
    t0 = time.monotonic()
    got = asyncio.run(asyncio.wait_for(c.metrics(), 3.0))  # the old code waited for ever
    assert time.monotonic() - t0 < 2.0
    assert got["unanswered"] == ["count/1"]
    answered = {(m["step"], m["index"]) for m in got["instances"]}
    assert answered == set(c.specs) - {hung}
