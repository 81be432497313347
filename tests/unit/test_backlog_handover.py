"""Rescaling under backlog, without Ray: the rescale barrier overtakes queued batches, and the
old owner hands the queued records of moving sub-groups over with their state.

Part 1 checks the inbox and output channel on their own (plain asyncio). Part 2 wires the
instances of a source -> slow keyed count -> sink job in one event loop (pushes are tasks, as Ray
calls are), lets a backlog build at the count step, scales it out 1 -> 2 mid-stream, and checks
exact counts against a ``collections.Counter`` over the generator's rows, per-key order (the
generator's ``seq`` is 0, 1, 2, ... per key: every record must continue where its key stopped),
that records were handed over, and that the old owner sealed before its backlog was processed.
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
from raystream.runtime.channels import Inbox, OutputChannel, OvertakingBarrier
from raystream.runtime.instance import OperatorInstance, RuntimeConfig
from raystream.runtime.messages import Barrier, ChannelId, Watermark
from raystream.runtime.migration import MigrationEngine, MigrationTask
from raystream.state.rocks import RocksStateBackend
from tests._loop_job import LoopJob
from tests._ordered_count import ordered_count as ordered_count_costing

CH: ChannelId = ("up", 0)


def _batch(*values: int) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"key": list(values)})


def _rescale(epoch: int = 1, aligned: bool = False) -> Barrier:
    return Barrier(epoch, "rescale", {"step": "count", "aligned": aligned})


async def _put_all(inbox: Inbox, items: list[Any]) -> None:
    for seq, item in enumerate(items):
        await inbox.put(CH, seq, item)


# ---- part 1: inbox and output channel --------------------------------------------------------
def test_a_rescale_barrier_overtakes_the_batches_after_the_last_control_event() -> None:
    async def go() -> list[Any]:
        inbox = Inbox(capacity=10)
        b0, b1, b2 = _batch(0), _batch(1), _batch(2)
        await _put_all(inbox, [b0, Watermark(5), b1, b2, _rescale(), _batch(3)])
        assert inbox.overtaking == 1
        assert inbox.backlog_rows() == 4
        return [inbox.get_nowait() for _ in range(5)]

    got = asyncio.run(go())
    assert got[4] is None  # nothing else queued
    items = [item for _, item in got[:4]]
    # b0 and the watermark stay ahead; the barrier carries b1, b2 in order; b3 is post-barrier
    assert items[0].column("key").to_pylist() == [0]
    assert items[1] == Watermark(5)
    assert isinstance(items[2], OvertakingBarrier)
    assert [b.column("key").to_pylist() for b in items[2].pre_barrier] == [[1], [2]]
    assert items[3].column("key").to_pylist() == [3]


def test_a_rescale_barrier_at_the_front_of_a_channel_is_read_first() -> None:
    async def go() -> Any:
        inbox = Inbox(capacity=10)
        other: ChannelId = ("up", 1)
        await inbox.put(other, 0, _batch(7))
        await _put_all(inbox, [_batch(1), _rescale()])
        return inbox.get_nowait()

    ch, item = asyncio.run(go())
    assert ch == CH and isinstance(item, OvertakingBarrier)


@pytest.mark.parametrize("barrier", [Barrier(1, "checkpoint"), _rescale(aligned=True)])
def test_aligned_barriers_do_not_overtake(barrier: Barrier) -> None:
    async def go() -> list[Any]:
        inbox = Inbox(capacity=10)
        await _put_all(inbox, [_batch(0), barrier])
        assert inbox.overtaking == 0
        return [inbox.get_nowait()[1] for _ in range(2)]  # type: ignore[index]

    first, second = asyncio.run(go())
    assert isinstance(first, pa.RecordBatch) and second == barrier


def test_pushes_before_an_overtaking_barrier_enter_without_room() -> None:
    async def go() -> tuple[bool, Any]:
        inbox = Inbox(capacity=1)
        await inbox.put(CH, 0, _batch(0))
        waiting = asyncio.ensure_future(inbox.put(CH, 1, _batch(1)))  # no room: waits
        await asyncio.sleep(0.01)
        was_waiting = not waiting.done()
        await asyncio.wait_for(inbox.put(CH, 2, _rescale()), 1.0)  # lets seq 1 in first
        await asyncio.wait_for(waiting, 1.0)
        return was_waiting, inbox.get_nowait()

    was_waiting, (_, item) = asyncio.run(go())
    assert was_waiting
    assert isinstance(item, OvertakingBarrier)
    assert [b.column("key").to_pylist() for b in item.pre_barrier] == [[0], [1]]


def test_put_back_batches_go_before_the_queue_and_into_a_leading_overtaking_barrier() -> None:
    async def go() -> tuple[Any, Any, Any]:
        inbox = Inbox(capacity=10)
        await _put_all(inbox, [_batch(1), _rescale()])
        inbox.put_back(CH, [_batch(0)])  # read before batch 1: the barrier overtakes it too
        first = inbox.get_nowait()
        other = Inbox(capacity=10)
        await _put_all(other, [Watermark(1), _batch(2)])
        other.put_back(CH, [_batch(0), _batch(1)])
        return first, other.get_nowait(), other.get_nowait()

    (_, ob), (_, a), (_, b) = asyncio.run(go())
    assert [x.column("key").to_pylist() for x in ob.pre_barrier] == [[0], [1]]
    assert a.column("key").to_pylist() == [0] and b.column("key").to_pylist() == [1]


def test_a_push_waiting_for_credit_goes_once_the_channel_overtakes() -> None:
    async def go() -> tuple[int, int]:
        acks: list[asyncio.Future[None]] = []

        def send(_: Any) -> asyncio.Future[None]:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            acks.append(fut)
            return fut

        out = OutputChannel(send, batch_rows=1, linger_ms=0, max_inflight=1)
        await out.push("a")
        blocked = asyncio.ensure_future(out.push("b"))  # no credit: waits for "a"'s ack
        await asyncio.sleep(0.01)
        before = len(acks)
        out.overtake(True)
        await asyncio.wait_for(blocked, 1.0)
        after = len(acks)
        out.overtake(False)
        for f in acks:
            f.set_result(None)
        await out.drain()
        return before, after

    assert asyncio.run(go()) == (1, 2)


def test_held_back_records_arrive_with_their_sub_group_before_buffered_ones(
    tmp_path: Path,
) -> None:
    """Engine level: the old owner holds back pre-barrier records of outgoing sub-groups (per
    sub-group, in order) and hands them out with the chunk that completes the sub-group; the new
    owner releases them before the records it buffered itself (sent after the barrier)."""
    async def go() -> tuple[Any, int, int, list[pa.RecordBatch]]:
        old_db = RocksStateBackend(tmp_path / "old")
        new_db = RocksStateBackend(tmp_path / "new")
        old = MigrationEngine(old_db, 4, 2, range(4))
        new = MigrationEngine(new_db, 4, 2, ())
        moving = [4, 5, 6, 7]  # key groups 2 and 3

        async def fetch(owner: int, epoch: int, groups: list[int], max_bytes: int, urgent: bool):
            return await old.serve(epoch, groups, max_bytes, urgent)

        new.fetcher = fetch
        policy = FetchPolicy(on_demand=True, background="none")
        try:
            old.prepare(MigrationTask(1, policy, incoming={}, outgoing=set(moving)))
            new.prepare(MigrationTask(1, policy, incoming=dict.fromkeys(moving, 0), outgoing=set()))
            g_move, g_stay = 5, 0
            batch = pa.RecordBatch.from_pydict({"i": [0, 1, 2, 3, 4]})
            stay = old.hold_back(batch, np.array([g_move, g_stay, g_move, g_move, g_stay]))
            kept = old.handover_rows
            old.activate(1)
            new.activate(1)
            # a post-barrier record of the same sub-group reaches the new owner first
            post = pa.RecordBatch.from_pydict({"i": [5]})
            assert new.split(post, np.array([g_move])) is None  # buffered, fetched on demand
            old.seal(1)
            deadline = time.monotonic() + 10
            while g_move not in new.task.arrived:  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "the sub-group did not arrive"
                await asyncio.sleep(0.001)
            return stay, kept, old.handover_rows, new.take_released()
        finally:
            old_db.close()
            new_db.close()

    stay, kept, left, released = asyncio.run(go())
    assert stay.column("i").to_pylist() == [1, 4]
    assert kept == 3 and left == 0
    assert [r for b in released for r in b.column("i").to_pylist()] == [0, 2, 3, 5]
    assert all(b"raystream.handover" not in (b.schema.metadata or {}) for b in released)


# ---- part 2: a scale-out of an overloaded keyed step --------------------------------------------
EVENTS = 3_000
KEYS = 200
NUM_KEY_GROUPS = 16
SUB_GROUPS = 4
COST_S = 200e-6  # per record: the count step is slower than the unthrottled source
COUNT = ("count", 0)
NEW = ("count", 1)
SOURCE = ("source", 0)
SINK = ("out", 0)
FINISH_S = 30.0


ordered_count = ordered_count_costing(COST_S)


def _generator() -> Any:
    return rs.sources.generator(events=EVENTS, keys=KEYS, zipf=1.1, seed=5, key_type="str")


def _oracle() -> collections.Counter[Any]:
    reader = _generator().open(0, 1)
    keys: list[Any] = []
    while (batch := reader.read(1000)) is not None:
        keys.extend(batch.column("key").to_pylist())
    return collections.Counter(keys)


class Job(LoopJob):
    """The instances of one job in this event loop, and the controller's part of a scale-out."""

    def __init__(self, state_dir: Path) -> None:
        flow = rs.Dataflow("backlog", num_key_groups=NUM_KEY_GROUPS, sub_groups=SUB_GROUPS)
        flow.source(_generator()).key_by("key").apply(ordered_count).sink(
            rs.sinks.collect(), name="out"
        )
        config = RuntimeConfig(
            batch_rows=200, source_batch_rows=100, linger_ms=1.0, inbox_capacity=8
        )
        plan = physical_plan(flow, {"count": 1}, config, time.time_ns(), state_dir)
        super().__init__(plan, state_dir, FINISH_S)

    async def scale_out(self, epoch: int, tasks_late_s: float = 0.0) -> None:
        """Start instance 1 of ``count``, wire it, prepare the move of the upper half of the key
        groups, inject the rescale barrier at the source. ``tasks_late_s`` > 0: the barrier goes
        first and the migration tasks reach the instances that much later (the controller sends
        both without waiting; the barrier may overtake a task to an idle new instance)."""
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

        def prepare() -> None:
            self.instances[COUNT].prepare_migration(
                MigrationTask(epoch, policy, incoming={}, outgoing=set(moving)), fetch
            )
            self.instances[NEW].prepare_migration(
                MigrationTask(epoch, policy, incoming=dict.fromkeys(moving, 0), outgoing=set()),
                fetch,
            )

        payload = {"step": "count", "table": table, "final": True, "aligned": False}
        if tasks_late_s <= 0:
            prepare()
        else:
            asyncio.get_running_loop().call_later(tasks_late_s, prepare)
        assert self.instances[SOURCE].inject_barrier(Barrier(epoch, "rescale", payload))


async def _overloaded_scale_out(state_dir: Path, tasks_late_s: float = 0.0) -> tuple[Job, int, int]:
    """The count step starts late, so its inbox is full (and its sender out of credit) when the
    rescale starts: ``backlog_rows`` queued at the old owner. Returns the job, that backlog, and
    how many records the old owner had processed when it sealed its outgoing sub-groups."""
    job = Job(state_dir)
    for iid in (SINK, SOURCE):
        job.run(iid)
    old = job.instances[COUNT]
    full = old.spec.config.inbox_capacity  # batches
    deadline = time.monotonic() + 20
    while old.inbox.depth() < full and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    assert old.inbox.depth() >= full, f"the backlog did not build up ({old.inbox.depth()})"
    deadline = time.monotonic() + 20
    backlog_rows = old.inbox.backlog_rows()
    await job.scale_out(1, tasks_late_s)
    # the barrier reaches the old owner's inbox although it is full and its sender out of credit
    while not old.inbox.overtaking and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    assert old.inbox.overtaking == 1, "the rescale barrier did not reach the full inbox"
    engine = old.engine
    assert engine is not None
    at_seal: list[int] = []
    seal = engine.seal

    def seal_and_note(epoch: int, **how: Any) -> None:
        # records the old owner processed itself (those it hands over count at the new owner)
        at_seal.append(old.metrics.snapshot()["records_in"])
        seal(epoch, **how)

    engine.seal = seal_and_note  # type: ignore[method-assign]
    job.run(COUNT)
    while engine.task is None and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    assert engine.task is not None, "the old owner got no migration task"
    await asyncio.wait_for(engine.task.sealed.wait(), FINISH_S)
    processed = at_seal[0]
    await job.finish()
    return job, backlog_rows, processed


@pytest.mark.parametrize("tasks_late_s", [0.0, 0.2], ids=["tasks_first", "barrier_first"])
def test_an_overloaded_old_owner_hands_queued_records_over_with_their_state(
    tmp_path: Path, tasks_late_s: float
) -> None:
    """Also when the migration tasks come after the barrier (the controller does not wait for
    them): the barrier, and every fetch, waits for the task at each instance; still exact."""
    job, backlog_rows, processed_at_seal = asyncio.run(
        _overloaded_scale_out(tmp_path, tasks_late_s)
    )
    out = job.instances[SINK].result
    assert isinstance(out, pa.Table)
    assert sum(out.column("out_of_order").to_pylist()) == 0, "a key's records came out of order"
    agg = out.group_by("key").aggregate([("count", "max")])
    got = dict(zip(agg["key"].to_pylist(), agg["count_max"].to_pylist(), strict=True))
    expected = _oracle()
    assert sum(expected.values()) == EVENTS
    assert got == dict(expected)
    old_task = job.instances[COUNT].engine.task  # type: ignore[union-attr]
    new_task = job.instances[NEW].engine.task  # type: ignore[union-attr]
    assert old_task is not None and new_task is not None and new_task.done.is_set()
    # queued records of moving sub-groups went with their state, all of them arrived
    assert old_task.handover_rows_out > 0
    assert new_task.handover_rows_in == old_task.handover_rows_out
    # the seal did not wait for the backlog queued when the rescale started
    assert processed_at_seal == 0, (processed_at_seal, backlog_rows)


def test_an_old_owner_takes_short_slices_while_a_rescale_barrier_is_expected(
    tmp_path: Path,
) -> None:
    """The controller tells the old owners a rescale starts (``expect_rescale``) before it plans
    and configures the new instances: until the migration task comes (or ``hold_s`` passed) a
    slice is about SERVE_SLICE_TARGET_S of work, so the barrier waits for a short slice."""
    from raystream.runtime import instance as inst_mod

    job = Job(tmp_path)
    old = job.instances[COUNT]
    for _ in range(20):  # learnt: 100 us per row, no fixed part
        old.batch_cost.learn(0.1, 1000)
        old.batch_cost.learn(0.2, 2000)
    normal = old._slice_rows()
    assert normal == int(inst_mod.SLICE_TARGET_S / 1e-4)  # 1000 rows, 0.1 s
    old.expect_rescale(5.0)
    short = old._slice_rows()
    assert short == int(inst_mod.SERVE_SLICE_TARGET_S / 1e-4)  # 200 rows, 0.02 s
    # the task came: the migration decides (outgoing sub-groups: short slices; none: normal)
    policy = FetchPolicy(on_demand=True, background="none")
    old.prepare_migration(MigrationTask(1, policy, incoming={}, outgoing=set()), None)
    assert old._slice_rows() == normal
    old.expect_rescale(0.0)  # expired at once (a rescale that never came)
    assert old._slice_rows() == normal


def test_a_fetch_that_sees_the_new_task_while_it_is_prepared_is_served(tmp_path: Path) -> None:
    """An old owner serves state on the transfer group's loop, in another thread. A new owner's
    fetch that came before the migration task polls for it there; ``prepare`` wakes the last
    epoch's server on that loop to stop it (``call_soon_threadsafe``: the GIL is released, the
    polling fetch may run). A fetch that saw the new task by then was queued before the queue
    was reset, and never answered (the rescale hung: the old owner "still had sub-groups to hand
    out" that were all requested). Here the fetch runs exactly there, in the same thread."""

    async def go() -> tuple[list[int], bool]:
        db = RocksStateBackend(tmp_path / "old")
        engine = MigrationEngine(db, 4, 2, range(4))
        loop = asyncio.get_running_loop()
        last = MigrationTask(
            0, FetchPolicy(on_demand=True, background="none"), incoming={}, outgoing=set()
        )
        last.done.set()
        last.server = loop.create_task(asyncio.sleep(3600))  # the last epoch's server, idle
        engine.task = last
        moving = [4, 5]
        task = MigrationTask(
            1, FetchPolicy(on_demand=True, background="none"), incoming={}, outgoing=set(moving)
        )
        early: list[Any] = []
        saw_task = False
        wake = loop.call_soon_threadsafe

        def racing(cb: Any, *args: Any, **kw: Any) -> Any:
            nonlocal saw_task
            if engine.task is task:  # the polling fetch sees its task: it asks now
                saw_task = True
                coro = engine.serve(1, moving, 1 << 20, True)
                early.append((coro, coro.send(None)))  # runs until it waits for its chunk
            return wake(cb, *args, **kw)

        loop.call_soon_threadsafe = racing  # type: ignore[method-assign]
        try:
            engine.prepare(task)
        finally:
            loop.call_soon_threadsafe = wake  # type: ignore[method-assign]
        try:
            if early:
                coro, fut = early[0]
                engine.activate(1)
                engine.seal(1)
                await asyncio.wait_for(asyncio.shield(fut), 5.0)
                coro.close()
                done, _ = fut.result()
            else:  # it saw the old task: it keeps polling, and asks once prepare is done
                fetch = asyncio.ensure_future(engine.serve(1, moving, 1 << 20, True))
                engine.activate(1)
                engine.seal(1)
                done, _ = await asyncio.wait_for(fetch, 5.0)
            return sorted(done), saw_task
        finally:
            db.close()

    done, _ = asyncio.run(go())
    assert done == [4, 5]
