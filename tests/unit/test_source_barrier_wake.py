"""A source at a fixed rate sleeps until its next batch is due; a barrier injected meanwhile (a
checkpoint's or a rescale's) goes out at once, between two batches, not when the next batch is
due (as a Flink source emits a barrier from its mailbox at once). Without Ray: the source alone,
its pushes recorded by a fake sender that acknowledges at once."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

import raystream as rs
from raystream.plan import physical_plan
from raystream.runtime.instance import OperatorInstance, RuntimeConfig
from raystream.runtime.messages import Barrier, EndOfStream

SOURCE = ("source", 0)


@rs.keyed_batches(name="count", state=rs.ValueState(int, default=0))
def count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


def _paced_source(tmp_path: Path, linger_ms: float) -> OperatorInstance:
    """The source of ``generator (100 events/s) -> key_by -> count -> collect``: it emits
    ``100 x linger_ms / 1000`` records every ``linger_ms``."""
    flow = rs.Dataflow("paced", num_key_groups=16)
    gen = rs.sources.generator(events=300, keys=50, seed=3, rate_eps=100)
    flow.source(gen).key_by("key").apply(count).sink(rs.sinks.collect(), name="out")
    plan = physical_plan(
        flow, {"count": 1}, RuntimeConfig(linger_ms=linger_ms), time.time_ns(), tmp_path
    )
    return OperatorInstance(plan.instances[SOURCE])


async def _barrier_delay(
    source: OperatorInstance, wait_after_batch_s: float
) -> tuple[float, list[Any]]:
    """Inject a checkpoint barrier ``wait_after_batch_s`` after the source's first batch went
    out; returns how long after the injection the barrier was pushed, and every pushed item."""
    sent: list[tuple[float, Any]] = []

    def send(receiver: Any, payload: tuple[Any, int, Any]) -> Any:
        sent.append((time.monotonic(), payload[2]))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    source.connect(send, lambda event, info: None)
    run = asyncio.ensure_future(source.run())
    while not any(isinstance(item, pa.RecordBatch) for _, item in sent):
        await asyncio.sleep(0.005)
    await asyncio.sleep(wait_after_batch_s)
    t0 = time.monotonic()
    assert source.inject_barrier(Barrier(1, "checkpoint"))
    while not any(isinstance(item, Barrier) for _, item in sent):
        await asyncio.sleep(0.005)
    took = next(t for t, item in sent if isinstance(item, Barrier)) - t0
    source.stop()
    await asyncio.wait_for(run, 5.0)
    return took, [item for _, item in sent]


def test_a_paced_source_sends_an_injected_barrier_without_waiting_for_its_next_batch(
    tmp_path: Path,
) -> None:
    """100 events/s with ``linger_ms`` 1,000: a batch of 100 every second. The barrier, injected
    0.1 s after the first batch, goes out long before the second is due (0.9 s later)."""
    took, items = asyncio.run(_barrier_delay(_paced_source(tmp_path, 1000.0), 0.1))
    assert took < 0.3, f"the barrier went out {took:.3f} s after it was injected (expected < 0.3 s)"
    # it went out between two batches: the one before it, the next one after
    kinds = [type(item).__name__ for item in items if not isinstance(item, EndOfStream)]
    assert kinds[:2] == ["RecordBatch", "Barrier"], kinds
    assert items[0].num_rows == 100
