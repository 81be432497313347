"""A keyed instance processes a slice of records in calls; a rescale's control call or its barrier
that comes while a slice runs ends that slice after the call in progress, not after the whole
slice. Without Ray: the instances of a job in one event loop (tests._loop_job), the input of the
keyed step pushed by hand, so the barrier comes exactly while a slice runs.

Every record is still processed once and per key in order: the count checks each record's
``seq`` (0, 1, 2, ... per key) against the key's count, and the totals against a
``collections.Counter`` over the input.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

import raystream as rs
from raystream.keys import RoutingTable
from raystream.plan import physical_plan
from raystream.rescale import FetchPolicy
from raystream.runtime import instance as inst_mod
from raystream.runtime.instance import OperatorInstance, RuntimeConfig, _stamp
from raystream.runtime.messages import Barrier, ChannelId, EndOfStream
from raystream.runtime.migration import MigrationTask
from tests._loop_job import LoopJob
from tests._ordered_count import ordered_count as ordered_count_costing

COST_S = 100e-6  # per record: a slice (SLICE_TARGET_S, 0.1 s) is 1,000 records, ...
CALL_ROWS = 200  # ... a call (SLICE_CALL_TARGET_S, 0.02 s) 200
EVENTS = 3_000
KEYS = 50
NUM_KEY_GROUPS = 16
SUB_GROUPS = 4
SOURCE: ChannelId = ("source", 0)
COUNT: ChannelId = ("count", 0)
NEW: ChannelId = ("count", 1)
SINK: ChannelId = ("out", 0)


ordered_count = ordered_count_costing(COST_S)


def _generator() -> Any:
    return rs.sources.generator(events=EVENTS, keys=KEYS, zipf=1.1, seed=3, key_type="str")


def _input() -> list[pa.RecordBatch]:
    """The source's rows, stamped as the source would, in batches of 1,000."""
    reader = _generator().open(0, 1)
    out = []
    while (batch := reader.read(1000)) is not None:
        out.append(_stamp(batch, np.full(batch.num_rows, time.time_ns(), np.int64)))
    return out


class Job(LoopJob):
    """count (and its sink) in this loop; the test pushes the count's input itself."""

    def __init__(self, state_dir: Path) -> None:
        flow = rs.Dataflow("slices", num_key_groups=NUM_KEY_GROUPS, sub_groups=SUB_GROUPS)
        flow.source(_generator()).key_by("key").apply(ordered_count).sink(
            rs.sinks.collect(), name="out"
        )
        plan = physical_plan(flow, {"count": 1}, RuntimeConfig(), time.time_ns(), state_dir)
        super().__init__(plan, state_dir, 30.0)
        self.count = self.instances[COUNT]
        # learnt already: 100 us per record, a fixed part told apart (about none)
        cost = self.count.batch_cost
        for rows in (500, 1000, 500, 1000, 500, 1000):
            cost.learn(COST_S * rows, rows)
        # and kept: a slow call on a loaded machine does not change the slices under test
        self.count._learn_cost = lambda elapsed_s, rows: None  # type: ignore[method-assign]
        self.calls: list[tuple[int, int]] = []  # (rows of the call, records_in before it)

    def log_calls(self, during_first: Any) -> None:
        """Log every call of the count's processor; ``during_first()`` runs inside the first."""
        process = self.count.processor.process

        def logged(batch: pa.RecordBatch, **kw: Any) -> Any:
            self.calls.append((batch.num_rows, self.count.metrics.records_in))
            out = process(batch, **kw)
            if len(self.calls) == 1:
                during_first()
            return out

        self.count.processor.process = logged  # type: ignore[method-assign]

    async def feed(self, batches: list[pa.RecordBatch]) -> int:
        """Queue ``batches`` at the count (they are read as one batch); returns the next seq."""
        for seq, b in enumerate(batches):
            await self.count.push(SOURCE, seq, b)
        return len(batches)


def _check_exact(job: Job) -> None:
    out = job.instances[SINK].result
    assert isinstance(out, pa.Table)
    assert sum(out.column("out_of_order").to_pylist()) == 0, "a key's records came out of order"
    agg = out.group_by("key").aggregate([("count", "max")])
    got = dict(zip(agg["key"].to_pylist(), agg["count_max"].to_pylist(), strict=True))
    expected = collections.Counter(k for b in _input() for k in b.column("key").to_pylist())
    assert got == dict(expected), "counts differ from the input's (a record lost or twice)"


def test_slice_rows_at_the_learnt_cost() -> None:
    """The premise of the tests below: a slice is 1,000 records, a call 200."""
    cost = inst_mod.BatchCost()
    for rows in (500, 1000, 500, 1000, 500, 1000):
        cost.learn(COST_S * rows, rows)
    assert cost.slice_rows(inst_mod.SLICE_TARGET_S, 64, 4096) == 1000
    call = cost.call_rows(inst_mod.SLICE_CALL_TARGET_S, inst_mod.SLICE_CALL_MAX_OVERHEAD, 64)
    assert call == CALL_ROWS


def test_a_control_call_during_a_slice_ends_it_after_the_call_in_progress(tmp_path: Path) -> None:
    """``expect_rescale`` runs in another thread (the actor's control group) while a slice is
    processed: the slice ends after the call in progress, and the following ones are short."""

    async def go() -> tuple[Job, list[int]]:
        job = Job(tmp_path)

        def control_call() -> None:  # from another thread, while the call runs; done after it
            t = threading.Thread(target=job.count.expect_rescale, args=(5.0,))
            t.start()
            t.join()

        job.log_calls(control_call)
        emitted_at: list[int] = []  # records_in each time the count sends a slice's output
        emit = job.count._emit

        async def logged_emit(batches: list[pa.RecordBatch]) -> None:
            emitted_at.append(job.count.metrics.records_in)
            await emit(batches)

        job.count._emit = logged_emit  # type: ignore[method-assign]
        seq = await job.feed(_input())
        await job.count.push(SOURCE, seq, EndOfStream())
        for iid in (COUNT, SINK):
            job.run(iid)
        await job.finish()
        return job, emitted_at

    job, emitted_at = asyncio.run(go())
    # the first slice (1,000 records planned) ended after its first call
    assert emitted_at[0] == CALL_ROWS, (emitted_at, job.calls)
    # and the next ones are of SERVE_SLICE_TARGET_S (200 records, or fewer: the cost as measured)
    steps = np.diff(emitted_at)
    assert steps.size and steps.max() <= 200, emitted_at
    assert sum(rows for rows, _ in job.calls) == EVENTS  # none twice
    _check_exact(job)


def test_a_rescale_barrier_pushed_during_a_slice_waits_for_one_call(tmp_path: Path) -> None:
    """The count (1 -> 2) gets its rescale barrier while the first slice of a 3,000-record
    backlog runs: the switch comes after that slice's call in progress (200 records), not after
    the slice (1,000); the queued rest goes to the new owner (moving sub-groups) or is processed
    after the switch. The migration tasks come after the barrier (as the controller may send
    them). Exact, in order."""

    async def go() -> tuple[Job, list[int]]:
        job = Job(tmp_path)
        count = job.count
        template = job.plan.instances[COUNT]
        spec = replace(
            template,
            index=1,
            inputs=(SOURCE,),
            owned_key_groups=(),
            state_path=str(tmp_path / "count" / "1-e1"),
        )
        job._add(NEW, OperatorInstance(spec))
        await job.instances[SINK].add_inputs([NEW])
        owners = np.zeros(NUM_KEY_GROUPS, dtype=np.int32)
        owners[NUM_KEY_GROUPS // 2 :] = 1
        table = RoutingTable(epoch=1, owners=owners, parallelism=2)
        moving = [
            g
            for kg in range(NUM_KEY_GROUPS // 2, NUM_KEY_GROUPS)
            for g in range(kg * SUB_GROUPS, (kg + 1) * SUB_GROUPS)
        ]
        policy = FetchPolicy(on_demand=True, background="hot_first")
        peers = {0: count, 1: job.instances[NEW]}

        async def fetch(owner: int, e: int, groups: list[int], max_bytes: int, urgent: bool) -> Any:
            return await peers[owner].serve_state(e, groups, max_bytes, urgent)

        def prepare() -> None:
            count.prepare_migration(
                MigrationTask(1, policy, incoming={}, outgoing=set(moving)), fetch
            )
            job.instances[NEW].prepare_migration(
                MigrationTask(1, policy, incoming=dict.fromkeys(moving, 0), outgoing=set()),
                fetch,
            )

        barrier = Barrier(1, "rescale", {"step": "count", "table": table, "final": True})
        loop = asyncio.get_running_loop()
        seq = await job.feed(_input())

        def barrier_comes() -> None:  # as the source would send it: to both, then the end
            asyncio.ensure_future(count.push(SOURCE, seq, barrier))
            asyncio.ensure_future(count.push(SOURCE, seq + 1, EndOfStream()))
            asyncio.ensure_future(job.instances[NEW].push(SOURCE, 0, barrier))
            asyncio.ensure_future(job.instances[NEW].push(SOURCE, 1, EndOfStream()))
            loop.call_later(0.05, prepare)  # the tasks come after the barrier

        job.log_calls(barrier_comes)
        switched_at: list[int] = []
        switch = count._switch

        async def logged_switch(b: Barrier) -> None:
            switched_at.append(count.metrics.records_in)
            await switch(b)

        count._switch = logged_switch  # type: ignore[method-assign]
        for iid in (COUNT, NEW, SINK):
            job.run(iid)
        await job.finish()
        return job, switched_at

    job, switched_at = asyncio.run(go())
    # the old owner switched after the call in progress, not after its slice of 1,000
    assert switched_at == [CALL_ROWS], (switched_at, job.calls)
    old_task = job.count.engine.task  # type: ignore[union-attr]
    new_task = job.instances[NEW].engine.task  # type: ignore[union-attr]
    assert old_task is not None and new_task is not None and new_task.done.is_set()
    assert old_task.handover_rows_out > 0  # the queued rest of moving sub-groups went along
    _check_exact(job)

