"""Order across a move without waiting for downstream (no Ray): an old owner hands out state as
soon as it sealed; an instance that both hands out and takes over sub-groups in one step releases
what it took over only once it sealed itself, so its own fence goes out before its AfterFences
mark (receivers never wait for each other in a circle)."""

from __future__ import annotations

import asyncio
import collections
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
from raystream.runtime.instance import OperatorInstance, RuntimeConfig
from raystream.runtime.messages import Barrier
from raystream.runtime.migration import MigrationEngine, MigrationTask
from raystream.state.rocks import RocksStateBackend
from tests._loop_job import LoopJob

S = 2  # sub-groups per key group


def _groups(*kgs: int) -> list[int]:
    return [kg * S + s for kg in kgs for s in range(S)]


async def _until(cond: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        await asyncio.sleep(0.001)


def test_an_instance_that_also_hands_out_releases_what_it_took_over_only_once_sealed(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        dbs = [RocksStateBackend(tmp_path / "a"), RocksStateBackend(tmp_path / "b")]
        a = MigrationEngine(dbs[0], 4, S, (0, 1))
        b = MigrationEngine(dbs[1], 4, S, (2, 3))
        engines = {0: a, 1: b}

        def fetcher(me: int) -> Any:
            async def fetch(owner: int, epoch: int, groups: list[int], max_bytes: int, urgent: bool):
                assert owner != me
                return await engines[owner].serve(epoch, groups, max_bytes, urgent)

            return fetch

        a.fetcher, b.fetcher = fetcher(0), fetcher(1)
        policy = FetchPolicy(on_demand=True, background="all")
        try:
            # a swaps key group 1 for b's key group 2
            a.prepare(MigrationTask(1, policy, incoming=dict.fromkeys(_groups(2), 1),
                                    outgoing=set(_groups(1))))  # fmt: skip
            b.prepare(MigrationTask(1, policy, incoming=dict.fromkeys(_groups(1), 0),
                                    outgoing=set(_groups(2))))  # fmt: skip
            assert a.task.hands_out and b.task.hands_out  # type: ignore[union-attr]
            a.activate(1)
            b.activate(1)
            b.seal(1, fence_ms=0.1)  # b sealed: it hands key group 2 out at once
            assert b.task.ready.is_set() and b.task.fence_ms == 0.1  # type: ignore[union-attr]
            await _until(lambda: set(_groups(2)) <= a.task.arrived, "a's take-over")  # type: ignore[union-attr]
            assert a.take_released() == []
            assert not a.held[_groups(2)].any(), "released before a's own seal"
            a.seal(1)
            a.take_released()
            assert a.held[_groups(2)].all()
            await _until(lambda: set(_groups(1)) <= b.task.arrived, "b's take-over")  # type: ignore[union-attr]
            b.take_released()  # b sealed before: released at once
            assert b.held[_groups(1)].all()
        finally:
            for db in dbs:
                db.close()

    asyncio.run(go())


def test_an_old_owner_that_takes_nothing_over_serves_right_after_its_seal(tmp_path: Path) -> None:
    async def go() -> None:
        dbs = [RocksStateBackend(tmp_path / "old"), RocksStateBackend(tmp_path / "new")]
        old = MigrationEngine(dbs[0], 4, S, range(4))
        new = MigrationEngine(dbs[1], 4, S, ())

        async def fetch(owner: int, epoch: int, groups: list[int], max_bytes: int, urgent: bool):
            return await old.serve(epoch, groups, max_bytes, urgent)

        new.fetcher = fetch
        policy = FetchPolicy(on_demand=True, background="all")
        try:
            old.prepare(MigrationTask(1, policy, incoming={}, outgoing=set(_groups(3))))
            new.prepare(MigrationTask(1, policy, incoming=dict.fromkeys(_groups(3), 0),
                                      outgoing=set()))  # fmt: skip
            old.activate(1)
            new.activate(1)
            old.seal(1, fence_ms=2.0)
            assert old.task.fenced.is_set() and old.task.ready.is_set()  # type: ignore[union-attr]
            await _until(lambda: new.task.done.is_set() or (  # type: ignore[union-attr]
                new.take_released() == [] and set(_groups(3)) <= new.task.arrived  # type: ignore[union-attr]
            ), "the take-over")
            new.take_released()  # not sealed itself, but it hands nothing out
            assert new.held[_groups(3)].all()
        finally:
            for db in dbs:
                db.close()

    asyncio.run(go())


# ---- a scale-out behind a stalled downstream step, every instance in this event loop ----------
EVENTS = 30_000
KEYS = 100
NUM_KEY_GROUPS = 16
SOURCE, COUNT, NEW, SLOW, SINK = ("source", 0), ("count", 0), ("count", 1), ("slow", 0), ("out", 0)
FINISH_S = 30.0


@rs.keyed_batches(name="count", state=rs.ValueState(int, default=0))
def count_added(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new, "added": batch.counts})


@rs.map_batches(name="slow")
def passing(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch


def _generator() -> Any:
    return rs.sources.generator(events=EVENTS, keys=KEYS, zipf=1.1, seed=3, key_type="str")


def _oracle() -> dict[Any, int]:
    keys = _generator().generate_all().column("key").to_pylist()
    return dict(collections.Counter(keys))


class StalledDownstream(LoopJob):
    """source -> count (keyed, 1 instance, scaled out to 2) -> slow (1 instance) -> sink, with
    the slow step not reading at all until the new owner has sent output: the old owner's
    outputs from before its seal are all still queued there, behind nothing of the new owner's."""

    def __init__(self, state_dir: Path) -> None:
        flow = rs.Dataflow("fence", num_key_groups=NUM_KEY_GROUPS, sub_groups=S)
        flow.source(_generator()).key_by("key").apply(count_added).apply(
            passing, parallelism=1
        ).sink(rs.sinks.collect(), name="out")
        config = RuntimeConfig(
            batch_rows=200, source_batch_rows=100, linger_ms=1.0, inbox_capacity=8,
            adaptive_batching=False,
        )  # fmt: skip
        plan = physical_plan(flow, {"count": 1}, config, time.time_ns(), state_dir)
        assert set(plan.instances) == {SOURCE, COUNT, SLOW, SINK}
        super().__init__(plan, state_dir, FINISH_S)

    async def scale_out(self, epoch: int) -> None:
        template = self.plan.instances[COUNT]
        spec = replace(
            template, index=1, inputs=(SOURCE,), owned_key_groups=(),
            state_path=str(self.state_dir / "count" / "1-e1"),
        )  # fmt: skip
        self._add(NEW, OperatorInstance(spec))
        await self.instances[SLOW].add_inputs([NEW])
        await self.instances[SOURCE].add_receivers([NEW])
        self.run(NEW)
        owners = np.zeros(NUM_KEY_GROUPS, dtype=np.int32)
        owners[NUM_KEY_GROUPS // 2 :] = 1
        table = RoutingTable(epoch=epoch, owners=owners, parallelism=2)
        moving = _groups(*range(NUM_KEY_GROUPS // 2, NUM_KEY_GROUPS))
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
        payload = {"step": "count", "table": table, "final": True, "aligned": False}
        assert self.instances[SOURCE].inject_barrier(Barrier(epoch, "rescale", payload))


async def _scale_out_behind_a_stalled_step(state_dir: Path) -> StalledDownstream:
    job = StalledDownstream(state_dir)
    for iid in (SINK, SOURCE, COUNT):
        job.run(iid)
    slow = job.instances[SLOW]
    deadline = time.monotonic() + 20
    while slow.inbox.unread(COUNT) < slow.spec.config.inbox_capacity:
        assert time.monotonic() < deadline, "no backlog built up in front of the slow step"
        await asyncio.sleep(0.005)
    await job.scale_out(1)
    new = job.instances[NEW]
    while not (new.engine.task.arrived and slow.inbox.unread(NEW) >= 2):  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the new owner sent nothing to the slow step"
        await asyncio.sleep(0.005)
    # the old owner sealed and handed out state without waiting for the slow step to read
    assert job.instances[COUNT].engine.task.ready.is_set()  # type: ignore[union-attr]
    assert slow.inbox.unread(COUNT) >= 2  # its outputs from before, then its fence, still there
    job.run(SLOW)
    await job.finish()
    return job


def test_a_receiver_reads_the_old_owners_outputs_first_without_anyone_waiting(
    tmp_path: Path,
) -> None:
    job = asyncio.run(_scale_out_behind_a_stalled_step(tmp_path))
    out = job.instances[SINK].result
    assert isinstance(out, pa.Table)
    check_order_and_counts(out, _oracle())
    assert job.instances[SLOW].inbox.holds == 1  # it held the new owner's channel once


def check_order_and_counts(out: pa.Table, expected: dict[Any, int]) -> None:
    """Per key, in the order the sink got the rows: each count is the one before plus what the
    row added (nothing read out of order, lost or doubled); the last is the key's events."""
    df = out.select(["key", "count", "added"]).to_pandas()
    running = df.groupby("key", sort=False)["added"].cumsum()
    bad = np.flatnonzero(running.to_numpy() != df["count"].to_numpy())
    assert bad.size == 0, (
        f"key {df['key'].iloc[int(bad[0])]!r}: count {df['count'].iloc[int(bad[0])]} where "
        f"the rows before it add up to {running.iloc[int(bad[0])]} (read out of order)"
    )
    assert df.groupby("key")["count"].last().to_dict() == expected
