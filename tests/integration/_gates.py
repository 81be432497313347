"""A source that runs until the test says where it ends, for tests whose action (a kill, a stop, a
savepoint) must land while the input flows, however slow the machine is.

``EndAtGate(gen, gate)`` reads the rate-limited source ``gen`` (one instance) until the file
``gate`` exists, then up to the event number written in it (``open_gate``), then ends. Its reader
writes how many events it sent to ``gate + ".events"`` when it closes (the oracle's prefix).

A recovery's reader reads the same events again up to the restored checkpoint's offset (the
runtime's rewind reads through ``read``): the test writes an end past the newest checkpoint's
offset (``end_after_checkpoint``), so a gate opened while a reader rewinds cannot end the stream
short of the checkpoint. Unlike ``_rescale_helpers.UntilGate`` (a count of rows after the gate
appears, counted from where that reader stands), the end is a position in the stream.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from ._rescale_helpers import _UntilGateReader


@dataclass(frozen=True)
class EndAtGate:
    gen: Any
    gate: str

    def schema(self) -> pa.Schema:
        return self.gen.schema()  # type: ignore[no-any-return]

    @property
    def rate_eps(self) -> float:
        return float(self.gen.rate_eps)

    def describe(self) -> str:
        return f"end_at_gate({self.gen.describe()})"

    def open(self, index: int, parallelism: int) -> Any:
        assert parallelism == 1, "one source instance: the gate holds one event number"
        return _EndAtGateReader(self, self.gen.open(index, parallelism), index, parallelism)


class _EndAtGateReader(_UntilGateReader):
    """``UntilGate``'s reader, but the end is the event number written in the gate."""

    def _end_once_gated(self) -> int:
        with open(self.spec.gate) as f:
            return int(f.read())


def open_gate(gate: str, end: int) -> None:
    """End the stream at event ``end`` (or where its reader stands, if it is past it)."""
    with open(gate + ".tmp", "w") as f:
        f.write(str(end))
    os.replace(gate + ".tmp", gate)  # appears whole


def end_after_checkpoint(status: dict[str, Any], more: int) -> int:
    """``more`` events past the source offset of the job's newest completed checkpoint."""
    last = status["checkpoints"]["last"] or {}
    offsets = (last.get("source_offsets") or {}).values()
    return max((int(v or 0) for v in offsets), default=0) + more


def events_sent(gate: str) -> int:
    """The events the gated source sent (written by its reader when it closed at the end)."""
    with open(gate + ".events") as f:
        return int(f.read())


# ---- holding a step's instances while the controller queues a change behind another --------


def hold(path: str) -> None:
    """Called by a step's function: while the file ``path`` exists (60 s at most), block this
    instance (its event loop: no record, barrier or state request gets through) and say so with
    a file ``<path>.held.<pid>``."""
    if not os.path.exists(path):
        return
    with open(f"{path}.held.{os.getpid()}", "w"):
        pass
    deadline = time.monotonic() + 60
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.005)


@contextmanager
def held(path: str, timeout_s: float = 60.0) -> Iterator[None]:
    """The instances whose function calls :func:`hold` block at their next batch until the
    block ends (the stream flows, so one blocks within milliseconds; this waits until one did)."""
    for marker in glob.glob(f"{path}.held.*"):
        os.remove(marker)
    with open(path, "w"):
        pass
    try:
        deadline = time.monotonic() + timeout_s
        while not glob.glob(f"{path}.held.*"):
            assert time.monotonic() < deadline, f"no instance held within {timeout_s} s"
            time.sleep(0.01)
        yield
    finally:
        os.remove(path)


def wait_described(
    job: Any, what: str, check: Callable[[dict[str, Any]], bool], timeout_s: float = 60.0
) -> None:
    """Until the controller's description (not ``status()``: that asks held instances for their
    metrics) passes ``check``."""
    import ray

    deadline = time.monotonic() + timeout_s
    while not check(d := ray.get(job.controller.describe.remote())):
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s: {d}"
        time.sleep(0.01)
