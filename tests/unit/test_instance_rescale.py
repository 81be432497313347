"""A scale-out racing the end of the input, on operator instances under plain asyncio (no Ray).

The instances of a source -> keyed count -> sink job are wired in one event loop; pushes are
tasks, as Ray calls are. The test plays the controller's part of a scale-out of ``count`` from 1
to 2 instances (start the new instance, wire it to its neighbours, prepare the migration, inject
the rescale barrier) at three moments: before the source read anything, after the new instance
was wired but before the source ended, and after the source ended. Final counts are checked
against a ``collections.Counter`` over the generator's own rows.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import raystream as rs
from raystream.keys import RoutingTable
from raystream.plan import physical_plan
from raystream.rescale import FetchPolicy
from raystream.runtime.instance import OperatorInstance, RuntimeConfig
from raystream.runtime.messages import Barrier, ChannelId
from raystream.runtime.migration import MigrationTask

EVENTS = 6_000
KEYS = 300
NUM_KEY_GROUPS = 16
SUB_GROUPS = 4
COUNT = ("count", 0)
NEW = ("count", 1)
SOURCE = ("source", 0)
SINK = ("out", 0)
FINISH_S = 20.0  # far more than these few thousand rows need; a hang fails the test


@rs.keyed_batches(name="count", state=rs.ValueState(int, default=0))
def count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


def _generator() -> Any:
    return rs.sources.generator(events=EVENTS, keys=KEYS, zipf=1.2, seed=7, key_type="str")


def _oracle() -> collections.Counter[Any]:
    reader = _generator().open(0, 1)
    keys: list[Any] = []
    while (batch := reader.read(1000)) is not None:
        keys.extend(batch.column("key").to_pylist())
    return collections.Counter(keys)


class Job:
    """The instances of one job in this event loop, and the controller's calls of a scale-out."""

    def __init__(self, state_dir: Path) -> None:
        flow = rs.Dataflow("race", num_key_groups=NUM_KEY_GROUPS, sub_groups=SUB_GROUPS)
        flow.source(_generator()).key_by("key").apply(count).sink(rs.sinks.collect(), name="out")
        config = RuntimeConfig(batch_rows=500, source_batch_rows=500, linger_ms=1.0)
        self.plan = physical_plan(flow, {"count": 1}, config, time.time_ns(), state_dir)
        self.state_dir = state_dir
        self.instances: dict[ChannelId, OperatorInstance] = {}
        self.runs: dict[ChannelId, asyncio.Task[None]] = {}
        for iid, spec in self.plan.instances.items():
            self._add(iid, OperatorInstance(spec))

    def _add(self, iid: ChannelId, inst: OperatorInstance) -> None:
        self.instances[iid] = inst
        inst.connect(self._send, lambda event, info: None)

    def _send(self, receiver: ChannelId, payload: tuple[ChannelId, int, Any]) -> Any:
        channel, seq, item = payload
        return asyncio.ensure_future(self.instances[receiver].push(channel, seq, item))

    def run(self, iid: ChannelId) -> None:
        self.runs[iid] = asyncio.get_running_loop().create_task(self.instances[iid].run())

    async def spawn_new_instance(self) -> None:
        """What the controller's ``_spawn`` does for instance 1 of ``count``."""
        template = self.plan.instances[COUNT]
        spec = replace(
            template,
            index=1,
            inputs=(SOURCE,),
            owned_key_groups=(),
            state_path=str(self.state_dir / "count" / "1-e1"),
        )
        self._add(NEW, OperatorInstance(spec))
        self.instances[SINK].add_inputs([NEW])
        await self.instances[SOURCE].add_receivers([NEW])
        self.run(NEW)

    def prepare(self, epoch: int) -> RoutingTable:
        """Move the upper half of the key groups to the new instance."""
        owners = np.zeros(NUM_KEY_GROUPS, dtype=np.int32)
        owners[NUM_KEY_GROUPS // 2 :] = 1
        table = RoutingTable(epoch=epoch, owners=owners, parallelism=2)
        moving = [
            g
            for kg in range(NUM_KEY_GROUPS // 2, NUM_KEY_GROUPS)
            for g in range(kg * SUB_GROUPS, (kg + 1) * SUB_GROUPS)
        ]
        policy = FetchPolicy(on_demand=True, background="hot_first")
        peers = {0: self.instances[COUNT], 1: self.instances[NEW]}

        async def fetch(owner: int, e: int, groups: list[int], max_bytes: int) -> Any:
            return await peers[owner].serve_state(e, groups, max_bytes)

        self.instances[COUNT].prepare_migration(
            MigrationTask(epoch, policy, incoming={}, outgoing=set(moving)), fetch
        )
        self.instances[NEW].prepare_migration(
            MigrationTask(epoch, policy, incoming=dict.fromkeys(moving, 0), outgoing=set()), fetch
        )
        return table

    def inject(self, epoch: int, table: RoutingTable) -> bool:
        payload = {"step": "count", "table": table, "final": True, "aligned": False}
        return self.instances[SOURCE].inject_barrier(Barrier(epoch, "rescale", payload))

    async def finish(self) -> None:
        """Every instance ends (a new one that nobody sends to would wait forever)."""
        runs = list(self.runs.values())
        _, pending = await asyncio.wait(runs, timeout=FINISH_S)
        waiting = [iid for iid, t in self.runs.items() if t in pending]
        for t in pending:
            t.cancel()
        assert not waiting, f"instances {waiting} did not finish within {FINISH_S} s"
        errors = {iid: inst.error for iid, inst in self.instances.items() if inst.error}
        assert not errors, errors

    def final_counts(self) -> dict[Any, int]:
        out = self.instances[SINK].result
        assert isinstance(out, pa.Table)
        agg = out.group_by("key").aggregate([("count", "max")])
        return dict(zip(agg["key"].to_pylist(), agg["count_max"].to_pylist(), strict=True))

    def records_in(self, iid: ChannelId) -> int:
        return int(self.instances[iid].snapshot_metrics()["records_in"])


async def _scale_out(state_dir: Path, moment: str) -> Job:
    job = Job(state_dir)
    for iid in (SINK, COUNT):
        job.run(iid)
    if moment == "before_any_record":
        await job.spawn_new_instance()
        table = job.prepare(1)
        assert job.inject(1, table) is True
        job.run(SOURCE)
    elif moment == "wired_then_input_ended":
        await job.spawn_new_instance()
        table = job.prepare(1)
        job.run(SOURCE)
        await job.runs[SOURCE]  # the source ends before the barrier is injected
        assert job.inject(1, table) is False, "an ended source must refuse the barrier"
    else:  # "input_ended_then_wired": the source ended before the scale-out started
        job.run(SOURCE)
        await job.runs[SOURCE]
        await job.spawn_new_instance()
        table = job.prepare(1)
        assert job.inject(1, table) is False, "an ended source must refuse the barrier"
    await job.finish()
    return job


@pytest.mark.parametrize(
    "moment", ["before_any_record", "wired_then_input_ended", "input_ended_then_wired"]
)
def test_a_scale_out_racing_the_end_of_input_finishes_and_counts_exactly(
    tmp_path: Path, moment: str
) -> None:
    job = asyncio.run(_scale_out(tmp_path, moment))
    expected = _oracle()
    assert sum(expected.values()) == EVENTS
    assert job.final_counts() == dict(expected)
    new_engine = job.instances[NEW].engine
    assert new_engine is not None and new_engine.task is not None
    if moment == "before_any_record":
        # the barrier went out before any record: the new owner took over its key groups
        assert new_engine.task.done.is_set()
        assert job.records_in(NEW) > 0 and job.records_in(COUNT) > 0
        assert job.records_in(NEW) + job.records_in(COUNT) == EVENTS
    else:
        # the input ended first: the old owner counted everything, nothing moved, and the new
        # instance ended empty instead of waiting for a source that will never send to it
        assert not new_engine.task.active and not job.instances[COUNT].engine.task.active
        assert job.records_in(COUNT) == EVENTS and job.records_in(NEW) == 0
