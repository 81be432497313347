"""Inserting a keyed step into a running job and removing it with its state dropped or emitted,
on operator instances under plain asyncio (no Ray): what the controller's ``insert`` / ``remove``
do, played by the test; and the pure parts (which steps go in or out, each key's final state).

source -> out. While the paced source runs, a keyed count with two instances (its own routing
table, empty state) goes in between them at one ``rewire`` barrier and comes out at a second one.
Checked against ``collections.Counter`` over the generator's rows and the source's offsets at the
two barriers: the sink gets the raw events before the first and from the second barrier on, the
count's rows in between grow per key up to exactly the events between the barriers, and with
``state="emit"`` one final-state row per key equal to that count (none with ``"drop"``, whose
state folders are gone).
"""

from __future__ import annotations

import asyncio
import collections
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import raystream as rs
from raystream.dataflow import KeySpec, Step
from raystream.keys import KeySpace, RoutingTable
from raystream.plan import physical_plan
from raystream.runtime.instance import InstanceSpec, OperatorInstance, OutputSpec, RuntimeConfig
from raystream.runtime.messages import Barrier, ChannelId
from raystream.state.final import final_state_batches, state_columns
from raystream.state.handles import KeyedStates, KeySet
from raystream.state.rocks import RocksStateBackend
from raystream.step_changes import check_removal_state, inserted_step
from tests.integration._helpers import Batches

EVENTS = 12_000  # 1.2 s of input at 10k events/s: both barriers come well before its end
SOURCE, SINK = ("source", 0), ("out", 0)
COUNT_P = 2
FINISH_S = 30.0


@rs.keyed_batches(name="count", state=rs.ValueState(int, default=0))
def count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


def _generator() -> Any:
    return rs.sources.generator(events=EVENTS, keys=200, zipf=1.1, seed=5, rate_eps=10_000.0)


async def _until(check: Any, what: str, timeout_s: float = FINISH_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        await asyncio.sleep(0.01)


async def _insert_then_remove(
    state_dir: Path, mode: str
) -> tuple[list[pa.RecordBatch], dict[int, int], list[Path]]:
    flow = rs.Dataflow("keyedrewire", num_key_groups=16, sub_groups=4)
    flow.source(_generator()).sink(Batches(), name="out")
    config = RuntimeConfig(batch_rows=200, source_batch_rows=200, linger_ms=2.0)
    plan = physical_plan(flow, None, config, time.time_ns(), state_dir)
    insts: dict[ChannelId, OperatorInstance] = {}
    offsets: dict[int, int] = {}

    def send(receiver: ChannelId, payload: tuple[ChannelId, int, Any]) -> Any:
        channel, seq, item = payload
        return asyncio.ensure_future(insts[receiver].push(channel, seq, item))

    def report(event: str, info: dict[str, Any]) -> None:
        if event == "barrier" and "source_offset" in info:
            offsets[info["epoch"]] = info["source_offset"]

    def add(iid: ChannelId, inst: OperatorInstance) -> None:
        insts[iid] = inst
        inst.connect(send, report)

    for iid, spec in plan.instances.items():
        add(iid, OperatorInstance(spec))
    runs = [asyncio.ensure_future(i.run()) for i in insts.values()]
    source = insts[SOURCE]
    await _until(lambda: source.rows_emitted > 0, "the source emitted nothing")

    # insert: a keyed step as the controller builds it (empty state, its own routing table)
    step = inserted_step(count, "count", "source", COUNT_P, "key", num_key_groups=16)
    table = RoutingTable.uniform(16, COUNT_P)
    to_out = plan.instances[SOURCE].outputs[0]
    paths = []
    for j in range(COUNT_P):
        paths.append(state_dir / "count" / f"{j}-v2")
        spec = InstanceSpec(
            job="keyedrewire",
            step=step,
            index=j,
            key_space=flow.key_space,
            inputs=(SOURCE,),
            outputs=(OutputSpec("out", 1, "rebalance"),),
            config=config,
            origin_ns=plan.instances[SOURCE].origin_ns,
            state_path=str(paths[-1]),
            owned_key_groups=tuple(int(g) for g in table.key_groups_of(j)),
        )
        add(("count", j), OperatorInstance(spec))
    new = [("count", j) for j in range(COUNT_P)]
    await insts[SINK].add_inputs(new)
    await insts[SOURCE].add_receivers(new)
    runs += [asyncio.ensure_future(insts[iid].run()) for iid in new]
    to_count = OutputSpec("count", COUNT_P, "key_group", key=KeySpec("key"), routing=table)
    insert = {"step": "source", "replaces": "out", "output": to_count, "aligned": True}
    assert insts[SOURCE].inject_barrier(Barrier(1, "rewire", insert))
    await asyncio.sleep(0.25)
    # records through the inserted step (a loaded machine may have held the source back)
    await _until(
        lambda: 1 in offsets and source.rows_emitted > offsets[1], "nothing after the insert"
    )

    # remove: the source sends to out again (its old input reopens); the count's instances end
    await insts[SINK].add_inputs([SOURCE])
    remove = {
        "step": "source",
        "replaces": "count",
        "output": to_out,
        "aligned": True,
        "removes": "count",
        "state": check_removal_state(step, plan.steps["out"], mode),
    }
    assert insts[SOURCE].inject_barrier(Barrier(2, "rewire", remove))

    done, pending = await asyncio.wait(runs, timeout=FINISH_S)
    for t in pending:
        t.cancel()
    assert not pending, "the job did not finish"
    errors = {iid: i.error for iid, i in insts.items() if i.error}
    assert not errors, errors
    return insts[SINK].result, offsets, paths


@pytest.mark.parametrize("mode", ["emit", "drop"])
def test_inserted_keyed_count_counts_exactly_between_its_barriers(
    tmp_path: Path, mode: str
) -> None:
    batches, offsets, paths = asyncio.run(_insert_then_remove(tmp_path, mode))
    start, end = offsets[1], offsets[2]
    assert 0 < start < end < EVENTS, offsets
    rows = _generator().generate_all()
    keys = rows.column("key").to_pylist()
    seqs = rows.column("seq").to_pylist()
    between = collections.Counter(keys[start:end])
    assert between, "no events between the barriers"

    raw = [b for b in batches if "seq" in b.schema.names]
    counts = [b for b in batches if "count" in b.schema.names]
    final = [b for b in batches if "state" in b.schema.names]
    assert len(raw) + len(counts) + len(final) == len(batches)
    # raw events: exactly those outside the two barriers (the source sends them to out)
    got_raw = sorted(
        (k, s) for b in raw for k, s in zip(b["key"].to_pylist(), b["seq"].to_pylist(), strict=True)
    )
    outside = list(range(start)) + list(range(end, EVENTS))
    assert got_raw == sorted((keys[i], seqs[i]) for i in outside)
    # the inserted count: fresh state at the insert barrier, every event between counted once
    last: dict[int, int] = {}
    for b in counts:
        for k, c in zip(b["key"].to_pylist(), b["count"].to_pylist(), strict=True):
            assert c > last.get(k, 0), f"key {k}: count {c} after {last.get(k)}"
            last[k] = c
    assert last == dict(between)
    if mode == "emit":  # one row per key: its final state
        emitted = [
            (k, v)
            for b in final
            for k, v in zip(b["key"].to_pylist(), b["state"].to_pylist(), strict=True)
        ]
        assert len(emitted) == len(between)
        assert dict(emitted) == dict(between)
    else:
        assert final == []
    assert not any(p.exists() for p in paths), "the removed step's state folders remain"


# ---- each key's final state, from RocksDB --------------------------------------------------


STATES = {
    "n": rs.ValueState(int, default=0),
    "seen": rs.MapState(),
    "log": rs.ListState(),
    "best": rs.ValueState(object, default="none"),
}


@pytest.mark.parametrize("key_type", ["int", "str"])
@pytest.mark.parametrize("known_kind", [True, False])
def test_final_state_rows_are_every_key_state(
    tmp_path: Path, key_type: str, known_kind: bool
) -> None:
    space = KeySpace(num_key_groups=8, sub_groups=4)
    backend = RocksStateBackend(tmp_path / "db")
    states = KeyedStates(backend, STATES, space)
    rng = np.random.default_rng(7)
    raw_keys = rng.choice(10_000, size=60, replace=False)
    keys = [int(k) for k in raw_keys] if key_type == "int" else [f"k{k}" for k in raw_keys]
    expected: dict[Any, dict[str, Any]] = {}
    keyset = KeySet.of(keys, space)
    pre = states.preload(keyset)
    for i, k in enumerate(keys):
        h = states.handles_for(pre, i)
        row: dict[str, Any] = {}
        if i % 3:
            h.n.value = i * 10
            row["n"] = i * 10
        if i % 4 == 0:
            h.seen[f"m{i}"] = i
            h.seen[f"z{i}"] = -i
            row["seen"] = {f"m{i}": i, f"z{i}": -i}
        if i % 5 == 1:
            h.log.extend([i, i + 1])
            row["log"] = [i, i + 1]
        if i % 2:
            h.best.value = f"b{i}"
            row["best"] = f"b{i}"
        if row:
            expected[k] = row
    states.write_back(keyset, pre)
    # a key group this instance no longer owns (moved out): left out
    held = np.ones(space.num_key_groups * space.sub_groups, dtype=bool)
    gone_kg = int(keyset.key_group[0])
    held[gone_kg * space.sub_groups : (gone_kg + 1) * space.sub_groups] = False
    kg_of = dict(zip(keys, keyset.key_group.tolist(), strict=True))
    expected = {k: v for k, v in expected.items() if kg_of[k] != gone_kg}

    out = final_state_batches(
        backend,
        STATES,
        "key",
        key_type if known_kind else None,
        held=held,
        sub_groups=space.sub_groups,
        chunk_rows=7,
    )
    backend.close()
    assert all(b.num_rows <= 7 for b in out)
    table = pa.Table.from_batches(out)
    assert table.column_names == ["key", "n", "seen", "log", "best"]
    got = {r["key"]: r for r in table.to_pylist()}
    assert set(got) == set(expected)
    for k, row in expected.items():
        g = got[k]
        assert g["n"] == row.get("n", 0)  # the declared default where never written
        assert g["best"] == row.get("best", "none")
        assert g["log"] == row.get("log")
        assert {e["key"]: e["value"] for e in g["seen"]} == row.get("seen", {})


def test_final_state_column_names() -> None:
    assert state_columns({"": rs.ValueState(int)}, "key") == {"": "state"}
    assert state_columns({"key": rs.ValueState(int), "n": rs.ValueState(int)}, "key") == {
        "key": "state_key",
        "n": "n",
    }


# ---- which steps go in or out (the controller's checks, before anything changes) ------------


@rs.filter
def keep_all(record: dict[str, Any]) -> bool:
    return True


def test_inserted_step_is_checked() -> None:
    keyed = inserted_step(count, "tally", "source", 3, "key", num_key_groups=16)
    assert keyed.is_keyed and keyed.key == KeySpec(column="key") and keyed.upstream == ("source",)
    assert keyed.state == count.state and keyed.parallelism == 3
    by_fn = inserted_step(count, "tally", "source", 1, lambda b: b.column("key"))
    assert by_fn.key is not None and by_fn.key.fn is not None
    plain = inserted_step(keep_all, "keep", "source", 2)
    assert not plain.is_keyed and plain.key is None

    def refused(match: str, *args: Any, **kw: Any) -> None:
        with pytest.raises(rs.ReconfigurationError, match=match):
            inserted_step(*args, **kw)

    refused(r"needs key_by=.*key_by='key'", count, "tally", "source", 1)
    refused("key_by is for keyed operators", keep_all, "keep", "source", 1, "key")
    refused("insert takes an operator", lambda r: r, "f", "source", 1)
    refused("int >= 1", count, "tally", "source", 0, "key")
    refused("at most 16 instances", count, "tally", "source", 17, "key", num_key_groups=16)
    refused("column name or a function", count, "tally", "source", 1, 5)


def test_removal_state_is_checked() -> None:
    keyed = inserted_step(count, "tally", "source", 1, "key")
    sink = Step("out", "sink", Batches(), ("tally",))
    assert check_removal_state(keyed, sink, "drop") == "drop"
    assert check_removal_state(keyed, sink, "emit") == "emit"
    plain = inserted_step(keep_all, "keep", "source", 1)
    assert check_removal_state(plain, sink, None) is None

    def refused(match: str, *args: Any) -> None:
        with pytest.raises(rs.ReconfigurationError, match=match):
            check_removal_state(*args)

    refused(r"state per key; say what happens to it: state='drop'.*'out'", keyed, sink, None)
    refused(r"one of \['drop', 'emit'\].*got 'flush'", keyed, sink, "flush")
    refused("keeps no state; leave state= out", plain, sink, "drop")
    by_user = Step("per_user", "keyed", count.fn, ("tally",), key=KeySpec(column="user"))
    refused("keyed by 'user'.*columns", keyed, by_user, "emit")
    by_key = Step("again", "keyed", count.fn, ("tally",), key=KeySpec(column="key"))
    assert check_removal_state(keyed, by_key, "emit") == "emit"


# ---- the graph a recovery restarts from, after an insert and after a remove ---------------------


def test_recovery_plans_the_changed_graph_and_restores_what_its_checkpoint_holds(
    tmp_path: Path,
) -> None:
    """What the controller's recovery builds (``physical_plan`` on the job's graph as changed,
    at the current routing; ``restore_specs`` from the latest checkpoint): after an insert the
    new keyed step is planned with its table, starts empty from a checkpoint taken before the
    insert and restores its key groups from one taken after; after the remove, its state in a
    checkpoint is left out and the upstream step sends to the sink again."""
    from raystream.checkpointing import restore_specs
    from raystream.step_changes import graph_with_step, graph_without_step

    flow = rs.Dataflow("keyedrewire", num_key_groups=16, sub_groups=4)
    flow.source(_generator()).sink(Batches(), name="out")
    config = RuntimeConfig(chaining=False)
    new = inserted_step(count, "count", "source", 1, "key", num_key_groups=16)
    changed = graph_with_step(flow.steps, new, "out")
    assert list(changed) == ["source", "count", "out"] and changed["out"].upstream == ("count",)
    flow.steps.clear()
    flow.steps.update(changed)
    rescaled = RoutingTable.uniform(16, 2, epoch=5)  # the count was rescaled to 2 meanwhile
    # as Recovery._replan: the parallelism of each routed step is its table's
    routing = {"count": rescaled}
    plan = physical_plan(flow, {"count": 2}, config, 0, tmp_path, routing=routing)
    (to_count,) = plan.instances[SOURCE].outputs
    assert (to_count.step, to_count.partitioning, to_count.routing) == (
        "count",
        "key_group",
        rescaled,
    )
    owned = [plan.instances[("count", j)].owned_key_groups for j in range(2)]
    assert sorted(g for o in owned for g in o) == list(range(16)) and all(owned)
    assert all(plan.instances[("count", j)].inputs == (SOURCE,) for j in range(2))
    assert plan.instances[SINK].inputs == (("count", 0), ("count", 1))

    storage = ("file:///nowhere", "keyedrewire")
    before = {"checkpoint_id": 3, "instances": {"source/0": {"source": {"offset": 100}}}}
    after = {
        "checkpoint_id": 4,
        "instances": {
            "source/0": {"source": {"offset": 250}},
            "count/0": {"state": {"files": ["a"]}, "key_groups": list(range(16))},
        },
    }
    empty = restore_specs(before, plan.instances, plan.routing, storage)
    assert [empty[("count", j)]["keyed"] for j in range(2)] == [[], []]
    assert empty[SOURCE]["source"] == {"offset": 100}
    full = restore_specs(after, plan.instances, plan.routing, storage)
    for j in range(2):
        (part,) = full[("count", j)]["keyed"]
        assert part["key_groups"] == list(owned[j])

    removed = graph_without_step(flow.steps, "count")
    assert list(removed) == ["source", "out"] and removed["out"].upstream == ("source",)
    flow.steps.clear()
    flow.steps.update(removed)
    plan = physical_plan(flow, None, config, 0, tmp_path, routing={})
    assert [o.step for o in plan.instances[SOURCE].outputs] == ["out"]
    assert plan.instances[SINK].inputs == (SOURCE,) and not plan.routing
    restored = restore_specs(after, plan.instances, plan.routing, storage)
    assert set(restored) == {SOURCE, SINK} and restored[SOURCE]["source"] == {"offset": 250}


# ---- the command line (the cluster faked) ---------------------------------------------------


def test_cli_insert_takes_key_by_and_remove_takes_state(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from raystream import cli, reconfigure

    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    class FakeJob:
        def insert(self, *args: Any, **kw: Any) -> dict[str, Any]:
            calls.append(("insert", args, kw))
            return {"epoch": 7, "change": "source -> tally -> out", "graph_version": 2}

        def remove(self, *args: Any, **kw: Any) -> dict[str, Any]:
            calls.append(("remove", args, kw))
            return {"epoch": 8, "change": "source -> out", "graph_version": 3}

    monkeypatch.setattr(cli, "_connect", lambda address=None: None)
    monkeypatch.setattr(rs, "attach", lambda name: FakeJob())
    monkeypatch.setattr(reconfigure, "load_object", lambda spec, what="operator": count)

    def invoke(*args: str) -> Any:
        return CliRunner().invoke(cli.main, list(args), prog_name="raystream")

    out = invoke("insert", "kc", "source", "ops:tally", "--name", "tally", "--key-by", "key")
    assert out.exit_code == 0, out.output
    assert "inserted at epoch 7" in out.output
    assert calls[-1] == (
        "insert",
        ("source", count),
        {"name": "tally", "parallelism": 1, "before": None, "key_by": "key"},
    )
    out = invoke("remove", "kc", "tally", "--state", "emit")
    assert out.exit_code == 0, out.output
    assert calls[-1] == ("remove", ("tally",), {"state": "emit"})
    out = invoke("remove", "kc", "keep")
    assert out.exit_code == 0 and calls[-1] == ("remove", ("keep",), {"state": None})
    out = invoke("remove", "kc", "tally", "--state", "flush")
    assert out.exit_code == 2 and "'flush' is not one of 'drop', 'emit'" in out.output
