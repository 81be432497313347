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
from tests._loop_job import LoopJob

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


class Job(LoopJob):
    """The instances of one job in this event loop, and the controller's calls of a scale-out."""

    def __init__(self, state_dir: Path) -> None:
        flow = rs.Dataflow("race", num_key_groups=NUM_KEY_GROUPS, sub_groups=SUB_GROUPS)
        flow.source(_generator()).key_by("key").apply(count).sink(rs.sinks.collect(), name="out")
        config = RuntimeConfig(batch_rows=500, source_batch_rows=500, linger_ms=1.0)
        plan = physical_plan(flow, {"count": 1}, config, time.time_ns(), state_dir)
        super().__init__(plan, state_dir, FINISH_S)

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
        await self.instances[SINK].add_inputs([NEW])
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

        async def fetch(owner: int, e: int, groups: list[int], max_bytes: int, urgent: bool) -> Any:
            return await peers[owner].serve_state(e, groups, max_bytes, urgent)

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


# ------------------------------------------------------------------------------------------
# the bound on buffered records holds for the whole move, not only until the barrier aligned


async def _buffer_past_the_seal(state_dir: Path) -> tuple[OperatorInstance, int]:
    """Instance 0 of ``count`` holds the lower half of the key groups and is to receive the
    upper half from instance 1, whose state never comes (its fetches wait). The rescale barrier
    arrives on its only input (so it is sealed at once); then records of the upper half arrive,
    more bytes of them than ``migration_buffer_bytes``."""
    job = Job(state_dir)
    template = job.plan.instances[COUNT]
    config = replace(template.config, migration_buffer_bytes=2_000)
    lower = tuple(range(NUM_KEY_GROUPS // 2))
    spec = replace(
        template,
        config=config,
        owned_key_groups=lower,
        state_path=str(state_dir / "count" / "0-half"),
    )
    inst = OperatorInstance(spec)
    job._add(COUNT, inst)
    never = asyncio.Event()

    async def fetch(owner: int, e: int, groups: list[int], max_bytes: int, urgent: bool) -> Any:
        await never.wait()

    upper = [
        g
        for kg in range(NUM_KEY_GROUPS // 2, NUM_KEY_GROUPS)
        for g in range(kg * SUB_GROUPS, (kg + 1) * SUB_GROUPS)
    ]
    inst.prepare_migration(
        MigrationTask(1, FetchPolicy(), incoming=dict.fromkeys(upper, 1), outgoing=set()), fetch
    )
    owners = np.zeros(NUM_KEY_GROUPS, dtype=np.int32)
    owners[NUM_KEY_GROUPS // 2 :] = 1
    table = RoutingTable(epoch=1, owners=owners, parallelism=2)
    payload = {"step": "count", "table": table, "final": True, "aligned": False}
    await inst._on_barrier(SOURCE, Barrier(1, "rescale", payload))
    engine = inst.engine
    assert engine is not None and engine.task is not None and engine.task.sealed.is_set()
    reader = _generator().open(0, 1)
    while not engine.over_limit:
        batch = reader.read(200)
        assert batch is not None
        await inst._on_batch(batch, SOURCE)
    await inst._run_released(engine)
    fetches = list(engine._tasks)  # noqa: SLF001 - the fetches that wait forever
    for t in fetches:
        t.cancel()
    await asyncio.gather(*fetches, return_exceptions=True)
    inst.processor.close()
    return inst, engine.pending_bytes


def test_buffered_records_over_the_byte_bound_hold_the_input_after_the_seal(
    tmp_path: Path,
) -> None:
    inst, pending = asyncio.run(_buffer_past_the_seal(tmp_path))
    assert pending > 2_000
    assert SOURCE in inst.inbox._blocked, "the input kept flowing past the byte bound"  # noqa: SLF001


# ------------------------------------------------------------------------------------------
# a scale-in then a scale-out that reuses an instance index


async def _reuse_an_index(state_dir: Path) -> tuple[pa.Table, list[pa.RecordBatch], bool]:
    """The sink reads ``count`` 0 and 1. Instance 1 was retired: its last rows and its
    EndOfStream are queued at the sink, unread. A scale-out starts a new instance 1 and adds it
    as the sink's input again before the sink read them: the input is reopened only after the
    EndOfStream of the old one was read; the new one starts at sequence 0."""
    from raystream.runtime.messages import EndOfStream

    job = Job(state_dir)
    sink = OperatorInstance(replace(job.plan.instances[SINK], inputs=(COUNT, NEW)))
    job._add(SINK, sink)

    def rows(keys: list[str], start: int) -> pa.RecordBatch:
        return pa.record_batch({"key": keys, "count": list(range(start, start + len(keys)))})

    sent = [rows(["a", "b", "c"], 1), rows(["b", "d"], 10), rows(["e"], 20)]
    await sink.push(NEW, 0, sent[0])  # the retired instance 1
    await sink.push(NEW, 1, EndOfStream())
    reopen = asyncio.ensure_future(sink.add_inputs([NEW]))
    await asyncio.sleep(0.05)
    waited = not reopen.done()
    job.run(SINK)
    await asyncio.wait_for(reopen, FINISH_S)
    await sink.push(NEW, 0, sent[1])  # the new instance 1, from sequence 0
    await sink.push(COUNT, 0, sent[2])
    await sink.push(NEW, 1, EndOfStream())
    await sink.push(COUNT, 1, EndOfStream())
    await asyncio.wait_for(job.runs[SINK], FINISH_S)
    assert sink.error is None, sink.error
    return sink.result, sent, waited


def test_an_input_reused_after_a_scale_in_reopens_once_the_old_one_ended(tmp_path: Path) -> None:
    out, sent, waited = asyncio.run(_reuse_an_index(tmp_path))
    assert waited, "the input was reopened while the retired instance's EndOfStream was unread"

    def tuples(t: Any) -> collections.Counter[tuple[Any, Any]]:
        keys, counts = t.column("key").to_pylist(), t.column("count").to_pylist()
        return collections.Counter(zip(keys, counts, strict=True))

    expected = sum((tuples(b) for b in sent), collections.Counter())
    assert tuples(out) == expected
