"""A receiver acknowledges a push (the sender's credit) when the batch is queued, not after it
processed it: the call that brought a batch returns before the batch's processing holds the
event loop. Else a paced sender's credit waits for the processing of what it sent, and an
adaptive channel falls into a cadence of double batches that stays (every record waiting a
linger more). Without Ray: the count (and its sink) in one event loop, the push made as a Ray
call runs, a task whose end is the acknowledgement."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

import raystream as rs
from raystream.plan import physical_plan
from raystream.runtime.instance import RuntimeConfig, _stamp
from raystream.runtime.messages import ChannelId, EndOfStream
from tests._loop_job import LoopJob
from tests._ordered_count import ordered_count

SOURCE: ChannelId = ("source", 0)
COUNT: ChannelId = ("count", 0)
COST_S = 50e-6  # per record: a batch of 200 takes 10 ms
ROWS = 200


def _batches(n: int) -> list[pa.RecordBatch]:
    reader = rs.sources.generator(events=n * ROWS, keys=50, seed=3, key_type="str").open(0, 1)
    out = []
    while (batch := reader.read(ROWS)) is not None:
        out.append(_stamp(batch, np.full(batch.num_rows, time.time_ns(), np.int64)))
    return out


def test_a_push_is_acknowledged_before_its_batch_is_processed(tmp_path: Path) -> None:
    flow = rs.Dataflow("acks", num_key_groups=16)
    gen = rs.sources.generator(events=1, keys=50, seed=3, key_type="str")
    flow.source(gen).key_by("key").apply(ordered_count(COST_S)).sink(rs.sinks.collect(), name="out")
    plan = physical_plan(flow, {"count": 1}, RuntimeConfig(), time.time_ns(), tmp_path)

    async def go() -> list[tuple[float, float, float]]:
        job = LoopJob(plan, tmp_path, 30.0)
        count = job.instances[COUNT]
        ends: list[float] = []
        process = count.processor.process

        def timed(batch: pa.RecordBatch, **kw: Any) -> Any:
            out = process(batch, **kw)
            ends.append(time.monotonic())
            return out

        count.processor.process = timed  # type: ignore[method-assign]
        for iid in plan.instances:
            if iid != SOURCE:
                job.run(iid)
        await asyncio.sleep(0.05)  # the count waits for input
        # (sent, acknowledged, processed) per push, one at a time as a paced source sends
        times = []
        for seq, batch in enumerate(_batches(5)):
            acked: list[float] = []
            sent = time.monotonic()
            call = asyncio.ensure_future(count.push(SOURCE, seq, batch))
            call.add_done_callback(lambda _: acked.append(time.monotonic()))
            while len(ends) <= seq:
                await asyncio.sleep(0.001)
            times.append((sent, acked[0], ends[seq]))
        await count.push(SOURCE, 5, EndOfStream())
        await job.finish()
        return times

    times = asyncio.run(go())
    for sent, acked, processed in times:
        assert acked < processed, (
            f"push acknowledged {1000 * (acked - sent):.1f} ms after it was sent, its batch "
            f"processed after {1000 * (processed - sent):.1f} ms: expected the acknowledgement first"
        )
