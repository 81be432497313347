"""A job's controller without Ray (it is a plain class), for unit tests of its bookkeeping:
source -> key_by("key") -> count (parallelism 2) -> collect sink "out". Tests give it stand-in
handles whose calls answer (or never do)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import raystream as rs
from raystream.controller import Controller
from raystream.runtime.instance import RuntimeConfig


@rs.keyed_batches(name="count", state=rs.ValueState(int, default=0))
def count(batch: rs.KeyedBatch, state: object) -> object:
    return batch.output({"count": batch.counts})


def plain_controller(name: str, tmp_path: Path, config: RuntimeConfig | None = None) -> Controller:
    flow = rs.Dataflow(name, num_key_groups=8, sub_groups=2)
    flow.source(rs.sources.generator(events=10, keys=4)).key_by("key").apply(count).sink(
        rs.sinks.collect(), name="out"
    )
    return Controller(flow, {"count": 2}, config or RuntimeConfig(), str(tmp_path))


class Call:
    """A stand-in for an actor method: ``.remote()`` answers ``answer`` (an exception instance
    is raised), or never answers if ``answer`` is ``None``."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def remote(self, *_: Any) -> Any:
        async def reply() -> Any:
            if self.answer is None:
                await asyncio.Event().wait()
            if isinstance(self.answer, BaseException):
                raise self.answer
            return self.answer

        return reply()
