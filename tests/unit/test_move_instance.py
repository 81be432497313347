"""Moving an instance, on operator instances under plain asyncio (no Ray): what the controller's
``move`` does, played by the test.

source -> count (2 instances) -> sink. While the (paced, skewed) source runs, a new instance with
a fresh channel id takes routing index 0: the source redirects index 0 to it at a rescale barrier
that carries ``move`` (the routing table itself does not change), the old instance 0 gets the
barrier and then EndOfStream, hands all its sub-groups over (on demand first, then the rest
hottest first) and ends. Checked against a ``collections.Counter`` over the generator's rows:
every event counted exactly once, per key counts rising in the order the sink received them,
the old instance took no record after the barrier, the new one took records and state.
"""

from __future__ import annotations

import asyncio
import collections
import shutil
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
from raystream.runtime.move_files import (
    FILES_POLICY,
    FilesTakeOver,
    copy_files,
    hand_over_changes,
    read_piece,
    take_changes,
)

EVENTS = 6_000
KEYS = 300
NUM_KEY_GROUPS = 16
SUB_GROUPS = 4
SOURCE, OLD, OTHER, SINK = ("source", 0), ("count", 0), ("count", 1), ("out", 0)
NEW = ("count", NUM_KEY_GROUPS + 1)  # a fresh id, past any routing index
FINISH_S = 30.0


@rs.keyed_batches(name="count", state=rs.ValueState(int, default=0))
def count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


def _generator() -> Any:
    return rs.sources.generator(events=EVENTS, keys=KEYS, zipf=1.2, seed=5, rate_eps=10_000.0)


async def _move(
    state_dir: Path, transfer: str = "rows"
) -> tuple[dict[ChannelId, OperatorInstance], dict[str, Any] | None]:
    flow = rs.Dataflow("move", num_key_groups=NUM_KEY_GROUPS, sub_groups=SUB_GROUPS)
    flow.source(_generator()).key_by("key").apply(count).sink(rs.sinks.collect(), name="out")
    config = RuntimeConfig(batch_rows=200, source_batch_rows=200, linger_ms=2.0)
    plan = physical_plan(flow, {"count": 2}, config, time.time_ns(), state_dir)
    insts: dict[ChannelId, OperatorInstance] = {}

    def send(receiver: ChannelId, payload: tuple[ChannelId, int, Any]) -> Any:
        channel, seq, item = payload
        return asyncio.ensure_future(insts[receiver].push(channel, seq, item))

    def add(iid: ChannelId, inst: OperatorInstance) -> None:
        insts[iid] = inst
        inst.connect(send, lambda event, info: None)

    for iid, spec in plan.instances.items():
        add(iid, OperatorInstance(spec))
    runs = {iid: asyncio.ensure_future(i.run()) for iid, i in insts.items()}
    await asyncio.sleep(0.25)  # a third of the input went through

    # the controller's _move: a new instance, wired, its migration prepared, the barrier
    table = plan.routing["count"]
    spec = replace(
        plan.instances[OLD],
        index=NEW[1],
        owned_key_groups=(),
        state_path=str(state_dir / "count" / "new"),
    )
    add(NEW, OperatorInstance(spec))
    await insts[SINK].add_inputs([NEW])
    await insts[SOURCE].add_receivers([NEW])
    runs[NEW] = asyncio.ensure_future(insts[NEW].run())
    s = SUB_GROUPS
    groups = [g for kg in table.key_groups_of(0).tolist() for g in range(kg * s, (kg + 1) * s)]
    heat = insts[OLD].sub_group_load()
    peers = {0: insts[OLD], 1: insts[OTHER]}

    async def fetch(owner: int, e: int, gs: list[int], max_bytes: int, urgent: bool) -> Any:
        return await peers[owner].serve_state(e, gs, max_bytes, urgent)

    # rows: several chunks, background pulls take turns; files: the engines fetch nothing
    policy = FILES_POLICY if transfer != "rows" else FetchPolicy(chunk_bytes=2_000)
    insts[OLD].prepare_migration(MigrationTask(1, policy, {}, set(groups)), fetch)
    insts[OTHER].prepare_migration(MigrationTask(1, policy, {}, set()), fetch)
    insts[NEW].prepare_migration(
        MigrationTask(
            1, policy, dict.fromkeys(groups, 0), set(), heat={g: float(heat[g]) for g in groups}
        ),
        fetch,
    )
    moved = {"index": 0, "to": NEW}
    payload = {"step": "count", "table": table, "final": True, "aligned": False, "move": moved}
    taking = None
    if transfer != "rows":  # the controller's calls, as the actors make them
        take = FilesTakeOver(insts[NEW], 1)
        copied: dict[str, Any] = {}

        async def copy() -> dict[str, Any]:
            copied.update(await copy_files(insts[OLD], 1))
            return copied

        async def read(directory: str, name: str, offset: int, size: int) -> bytes:
            return read_piece(directory, name, offset, size)

        async def release(directory: str) -> None:
            shutil.rmtree(directory)

        await take.begin(transfer == "files_same_node", copy, read, release)
        await asyncio.sleep(0.05)  # records run on at the old instance meanwhile
        rounds = await take.catch_up(lambda: _now(take_changes(insts[OLD])), small_bytes=1)
        assert rounds["catch_up_bytes"] and rounds["catch_up_bytes"][0] > 0
        taking = asyncio.ensure_future(take.finish(lambda: hand_over_changes(insts[OLD], 1)))
        # the barrier goes out at once (a paced source does not wait for its next batch): it
        # is injected once the old instance ran on past the catch-up, so that the hand-over
        # at the barrier has rows written since (changed_rows)
        await _records_grow(insts[OLD])
    assert insts[SOURCE].inject_barrier(Barrier(1, "rescale", payload))
    done, pending = await asyncio.wait(list(runs.values()), timeout=FINISH_S)
    for t in pending:
        t.cancel()
    assert not pending, f"{[i for i, t in runs.items() if t in pending]} did not finish"
    errors = {iid: i.error for iid, i in insts.items() if i.error}
    assert not errors, errors
    if taking is not None:
        assert not Path(copied["directory"]).exists()  # renamed, or pulled and dropped
        return insts, {**taking.result(), "copied": copied}
    return insts, None


async def _now(value: Any) -> Any:
    return value


async def _records_grow(inst: OperatorInstance, timeout_s: float = 10.0) -> None:
    """Until ``inst`` processed more records than it had now."""
    before = int(inst.snapshot_metrics()["records_in"])
    deadline = time.monotonic() + timeout_s
    while int(inst.snapshot_metrics()["records_in"]) <= before:
        if time.monotonic() > deadline:
            msg = f"{inst.spec.id} processed no record in {timeout_s} s (still {before})"
            raise AssertionError(msg)
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("transfer", ["rows", "files_same_node", "files_pulled"])
def test_a_moved_instance_hands_all_its_state_to_the_new_actor_and_counts_stay_exact(
    tmp_path: Path, transfer: str
) -> None:
    insts, files = asyncio.run(_move(tmp_path, transfer))
    reader = _generator().open(0, 1)
    keys: list[Any] = []
    while (batch := reader.read(1000)) is not None:
        keys.extend(batch.column("key").to_pylist())
    expected = collections.Counter(keys)

    out = insts[SINK].result
    assert isinstance(out, pa.Table)
    last: dict[Any, int] = {}
    for k, c in zip(out.column("key").to_pylist(), out.column("count").to_pylist(), strict=True):
        assert c > last.get(k, 0), f"key {k}: count {c} after {last.get(k)}"
        last[k] = c
    assert last == dict(expected)

    old, new = insts[OLD], insts[NEW]
    assert old.engine is not None and new.engine is not None
    assert not old.engine.held.any(), "the old instance still holds sub-groups"
    assert new.engine.task is not None and new.engine.task.done.is_set()
    stats = new.engine.stats()
    assert stats["rows_in"] > 0 and stats["bytes_in"] > 0
    n_new = int(new.snapshot_metrics()["records_in"])
    n_old = int(old.snapshot_metrics()["records_in"])
    n_other = int(insts[OTHER].snapshot_metrics()["records_in"])
    assert n_new > 0 and n_old > 0
    assert n_new + n_old + n_other == EVENTS
    # the new actor holds exactly the key groups of routing index 0, every sub-group of them
    held = new.engine.held.reshape(-1, SUB_GROUPS)
    index0 = RoutingTable.uniform(NUM_KEY_GROUPS, 2).key_groups_of(0)
    assert np.array_equal(np.flatnonzero(held.any(axis=1)), index0)
    assert held[index0].all()
    if files is not None:  # the old RocksDB went whole, then the rows written since
        sizes = dict(files["copied"]["files"])
        assert files["files"] == len(sizes) > 0 and files["file_bytes"] == sum(sizes.values())
        assert files["pulled_bytes"] == (
            0 if transfer == "files_same_node" else sum(sizes.values())
        )
        assert files["copied"]["key_groups"] == index0.tolist()
        assert files["changed_rows"] > 0  # the source ran on between the copy and the barrier
        assert not old.engine.handover and old.engine.task.done.is_set()


def test_cli_move_and_update_call_the_job_and_print_the_change(monkeypatch: Any) -> None:
    from click.testing import CliRunner

    import raystream.cli as cli

    calls: list[tuple[Any, ...]] = []
    record = {"epoch": 9, "duration_s": 1.5, "graph_version": 3, "change": "index 1 -> node n2"}

    class _Job:
        def move(self, step: str, index: int, node_id: str) -> dict[str, Any]:
            calls.append(("move", step, index, node_id))
            moved = {"key_groups": 4, "bytes": 12_345, "on_demand_fetches": 2}
            return {**record, "moved": moved}

        def replace(self, step: str, op: Any, migrate_state: Any = None) -> dict[str, Any]:
            calls.append(("replace", step, op, migrate_state))
            return {**record, "change": "a -> b", "moved": {"migrated_state_rows": 7}}

    monkeypatch.setattr(cli, "_connect", lambda address=None: None)
    monkeypatch.setattr(rs, "attach", lambda name: _Job())
    runner = CliRunner()
    moved = runner.invoke(cli.main, ["move", "kc", "count", "1", "n2"])
    assert moved.exit_code == 0, moved.output
    shown = " ".join(moved.output.split())
    assert "moved 'count'/1 at epoch 9 in 1.50 s: index 1 -> node n2; 4 key groups" in shown
    spec = "tests.unit.test_move_instance:count"
    args = ["update", "kc", "count", spec, "--migrate-state", "builtins:abs"]
    updated = runner.invoke(cli.main, args)
    assert updated.exit_code == 0, updated.output
    assert "7 state rows migrated" in updated.output
    assert calls[0] == ("move", "count", 1, "n2")
    assert calls[1][0] == "replace" and calls[1][2].fn.__name__ == "count" and calls[1][3] is abs


def test_a_moves_phases_are_seconds_from_its_start_per_instance() -> None:
    from raystream.reconfigurations import _move_phases

    t0 = 1_000.0
    old = {"sealed_wall": t0 + 2.0, "first_urgent_served_wall": t0 + 2.25, "chunks_out": 3}
    old["finished_wall"] = t0 + 2.5
    old["ready_wall"] = t0 + 2.125
    peer = {"finished_wall": t0 + 1.75, "chunks_out": 0}
    new = {
        "activated_wall": t0 + 1.5,
        "all_arrived_wall": t0 + 3.0,
        "finished_wall": t0 + 3.25,
        "fetch_calls": 3,
        "fetch_wait_ms": [10.0, 30.0, 20.0],
    }
    got = _move_phases(t0, t0 + 1.0, t0 + 1.25, t0 + 3.5, [peer, old, new])
    assert got == {
        "actor_ready": 1.0,
        "barrier_injected": 1.25,
        "switched": 1.5,
        "sealed": 2.0,
        "first_on_demand_served": 2.25,
        "all_arrived": 3.0,
        "ready": 2.125,
        "finished": [1.75, 2.5, 3.25],
        "done": 3.5,
        "fetch_calls": 3,
        "chunks_out": 3,
        "record_wait_ms": {"p50": float(np.median([10.0, 30.0, 20.0])), "max": 30.0},
    }


def test_a_move_with_an_unknown_transfer_is_refused_before_anything_changes() -> None:
    from types import SimpleNamespace

    from raystream.errors import ReconfigurationError
    from raystream.reconfigurations import MOVE_TRANSFERS, Reconfigurations

    flow = rs.Dataflow("refuse", num_key_groups=NUM_KEY_GROUPS, sub_groups=SUB_GROUPS)
    flow.source(_generator()).key_by("key").apply(count).sink(rs.sinks.collect(), name="out")
    plan = physical_plan(flow, {"count": 2}, RuntimeConfig(), time.time_ns(), Path("unused"))
    checked: list[str] = []
    controller = SimpleNamespace(
        plan=plan, config=RuntimeConfig(), _check_movable=checked.append, _queued=0
    )
    move = Reconfigurations.move(controller, "count", 0, "node", {"transfer": "bytes"})
    try:
        asyncio.run(move)
    except ReconfigurationError as e:
        msg = str(e)
    else:
        raise AssertionError("a move with transfer='bytes' was not refused")
    assert f"transfer must be one of {MOVE_TRANSFERS}" in msg and "got 'bytes'" in msg
    assert checked == ["count"] and controller._queued == 0  # refused before it queued
