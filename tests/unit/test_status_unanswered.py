"""``metrics()``/``status()`` do not wait on an instance that does not answer (its node was
lost and Ray has not declared it dead yet, or its loop is stuck): without Ray, the controller
is a plain class and the handles are stand-ins whose calls answer or hang."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

import raystream as rs
from raystream import controller as controller_module
from raystream.controller import Controller
from raystream.runtime.instance import RuntimeConfig


@rs.keyed_batches(name="count", state=rs.ValueState(int, default=0))
def count(batch: rs.KeyedBatch, state: object) -> object:
    return batch.output({"count": batch.counts})


class _Call:
    def __init__(self, answer: Any) -> None:
        self._answer = answer

    def remote(self) -> Any:
        async def reply() -> Any:
            if self._answer is None:
                await asyncio.Event().wait()  # never answers
            return self._answer

        return reply()


class _Handle:
    def __init__(self, iid: tuple[str, int], hangs: bool) -> None:
        self.metrics = _Call(None if hangs else {"step": iid[0], "index": iid[1]})


def test_an_instance_that_does_not_answer_is_listed_not_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(controller_module, "METRICS_ANSWER_S", 0.2)
    flow = rs.Dataflow("unanswered", num_key_groups=8, sub_groups=2)
    flow.source(rs.sources.generator(events=10, keys=4)).key_by("key").apply(count).sink(
        rs.sinks.collect(), name="out"
    )
    c = Controller(flow, {"count": 2}, RuntimeConfig(), str(tmp_path))
    hung = ("count", 1)
    c.handles = {iid: _Handle(iid, hangs=iid == hung) for iid in c.specs}
    t0 = time.monotonic()
    got = asyncio.run(asyncio.wait_for(c.metrics(), 3.0))  # the old code waited for ever
    assert time.monotonic() - t0 < 2.0
    assert got["unanswered"] == ["count/1"]
    answered = {(m["step"], m["index"]) for m in got["instances"]}
    assert answered == set(c.specs) - {hung}
