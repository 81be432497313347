"""A source reader that polls (returns empty batches while it has nothing yet) does not hold
its instance's event loop: the other instances, calls and barriers go on meanwhile (on the real
runtime without Ray, every instance in one event loop)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

import raystream as rs
from raystream import testing


class _Polling:
    """Instance 0 returns empty batches until instance 1 has been read once (or 5 s passed):
    a source loop that does not yield on an empty batch never lets instance 1 run."""

    def __init__(self, flags: dict[str, float]) -> None:
        self.flags = flags

    def schema(self) -> pa.Schema:
        return pa.schema([("x", pa.int64())])

    def open(self, index: int, parallelism: int) -> Any:
        return _PollingReader(index, self.flags)

    def describe(self) -> str:
        return "polling"


class _PollingReader:
    def __init__(self, index: int, flags: dict[str, float]) -> None:
        self.index, self.flags, self.done = index, flags, False
        self.started = 0.0

    def read(self, n: int) -> pa.RecordBatch | None:
        import time

        if self.done:
            return None
        if self.index == 1:
            self.flags.setdefault("other_read", 1.0)
        elif "other_read" not in self.flags:
            self.started = self.started or time.monotonic()
            if time.monotonic() - self.started < 5:
                return pa.record_batch({"x": pa.array([], pa.int64())})
            self.flags["gave_up"] = 1.0
        self.done = True
        return pa.record_batch({"x": [self.index]})

    def close(self) -> None:
        pass


def test_a_source_that_returns_empty_batches_lets_the_other_instances_run() -> None:
    flags: dict[str, float] = {}
    flow = rs.Dataflow("polling")
    flow.source(_Polling(flags), parallelism=2).sink(rs.sinks.collect(), name="out")
    out = testing.run(flow)["out"]
    assert sorted(out.column("x").to_pylist()) == [0, 1]
    assert "gave_up" not in flags, "instance 0's empty reads kept instance 1 from running"
