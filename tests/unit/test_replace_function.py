"""Replacing a step's function at a barrier, on operator instances under plain asyncio (no Ray),
and the checks that refuse a function that does not fit before anything changes.

The job: two paced generator sources, their union keyed into a two-instance count, one collect
sink. While the sources run, a ``replace`` barrier goes in at both (what the controller does);
the count function is swapped for one that also tags its output. Checked against a
``collections.Counter`` over the generators' own rows and the offsets at which each source
emitted the barrier:

* every event counted exactly once (final count per key = the oracle's);
* per key, counts rise strictly in the order the sink received them (per-key order);
* untagged rows are exactly those with count <= the key's events before the barrier, tagged rows
  those above (the old function took every record before the barrier, the new one every one
  after; with two inputs, the step aligned the barrier).
"""

from __future__ import annotations

import asyncio
import collections
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from click.testing import CliRunner

import raystream as rs
from raystream.dataflow import Step
from raystream.plan import physical_plan
from raystream.reconfigure import check_replacement, load_object, migrate_state_rows
from raystream.runtime.instance import OperatorInstance, RuntimeConfig
from raystream.runtime.messages import Barrier, ChannelId
from raystream.state.rocks import RocksStateBackend
from tests._cli import status_output

EVENTS = 4_000  # per source
KEYS = 200
RATE_EPS = 8_000.0  # per source: the input lasts ~0.5 s, the barrier goes in at ~0.2 / 0.3 s
FINISH_S = 30.0


@rs.keyed_batches(name="count", state=rs.ValueState(int, default=0))
def count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new, "tag": pa.nulls(len(new), pa.string())})


@rs.keyed_batches(name="count", state=rs.ValueState(int, default=0))
def count_tagged(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new, "tag": pa.array(["v2"] * len(new), pa.string())})


def _source(seed: int) -> Any:
    return rs.sources.generator(events=EVENTS, keys=KEYS, zipf=1.1, seed=seed, rate_eps=RATE_EPS)


def _keys(seed: int) -> list[int]:
    return _source(seed).generate_all().column("key").to_pylist()  # type: ignore[no-any-return]


class _Job:
    def __init__(self, state_dir: Path) -> None:
        flow = rs.Dataflow("replace", num_key_groups=16, sub_groups=4)
        a = flow.source(_source(1), name="a")
        b = flow.source(_source(2), name="b")
        a.union(b).key_by("key").apply(count).sink(rs.sinks.collect(), name="out")
        config = RuntimeConfig(batch_rows=200, source_batch_rows=200, linger_ms=2.0)
        plan = physical_plan(flow, {"count": 2}, config, time.time_ns(), state_dir)
        self.plan = plan
        self.instances = {iid: OperatorInstance(spec) for iid, spec in plan.instances.items()}
        self.acks: list[dict[str, Any]] = []
        for inst in self.instances.values():
            inst.connect(self._send, self._report)

    def _report(self, event: str, info: dict[str, Any]) -> None:
        if event == "barrier":
            self.acks.append(info)

    def _send(self, receiver: ChannelId, payload: tuple[ChannelId, int, Any]) -> Any:
        channel, seq, item = payload
        return asyncio.ensure_future(self.instances[receiver].push(channel, seq, item))

    async def run(self, new_step: Step, migrations: dict[str, Any] | None = None) -> None:
        runs = [asyncio.ensure_future(i.run()) for i in self.instances.values()]
        await asyncio.sleep(0.2)
        payload = {"step": "count", "new_step": new_step, "aligned": True}
        barrier = Barrier(1, "replace", {**payload, "migrations": migrations or {}})
        for iid in self.plan.sources:  # b emits it ~0.1 s after a: inputs are skewed
            assert self.instances[iid].inject_barrier(barrier), f"{iid} ended before the barrier"
            await asyncio.sleep(0.1)
        done, pending = await asyncio.wait(runs, timeout=FINISH_S)
        for t in pending:
            t.cancel()
        assert not pending, "the job did not finish"
        errors = {iid: i.error for iid, i in self.instances.items() if i.error}
        assert not errors, errors


def test_replaced_count_function_counts_once_and_tags_only_after_the_barrier(
    tmp_path: Path,
) -> None:
    job = _Job(tmp_path)
    new_step, _ = check_replacement(job.plan.steps["count"], count_tagged)
    asyncio.run(job.run(new_step))

    offsets = {a["instance"]: a["source_offset"] for a in job.acks if "source_offset" in a}
    assert set(offsets) == {("a", 0), ("b", 0)}
    assert 0 < offsets[("a", 0)] < EVENTS, "the barrier must land mid-stream"
    keys_a, keys_b = _keys(1), _keys(2)
    total = collections.Counter(keys_a + keys_b)
    before = collections.Counter(keys_a[: offsets[("a", 0)]] + keys_b[: offsets[("b", 0)]])
    # every instance of the step acknowledged the barrier, after swapping
    swapped = {tuple(a["instance"]) for a in job.acks if "migrated_rows" in a}
    assert swapped == {("count", 0), ("count", 1)}

    out = job.instances[("out", 0)].result
    assert isinstance(out, pa.Table)
    rows = out.to_pylist()
    last: dict[int, int] = {}
    for r in rows:  # per key, in the order the sink received them
        k, c = r["key"], r["count"]
        assert c > last.get(k, 0), f"key {k}: count {c} after {last.get(k)}"
        last[k] = c
        if c <= before[k]:
            assert r["tag"] is None, f"key {k}: count {c} <= {before[k]} tagged by the new fn"
        else:
            assert r["tag"] == "v2", f"key {k}: count {c} > {before[k]} not tagged"
    assert last == dict(total)
    assert any(r["tag"] == "v2" for r in rows) and any(r["tag"] is None for r in rows)


# ---- state migration ---------------------------------------------------------------------

SHIFT = 1_000_000


def test_state_migrated_at_the_barrier_is_what_the_new_function_continues_from(
    tmp_path: Path,
) -> None:
    job = _Job(tmp_path)
    new_step, migrations = check_replacement(
        job.plan.steps["count"], count_tagged, migrate_state=lambda v: v + SHIFT
    )
    asyncio.run(job.run(new_step, migrations))
    offsets = {a["instance"]: a["source_offset"] for a in job.acks if "source_offset" in a}
    keys_a, keys_b = _keys(1), _keys(2)
    total = collections.Counter(keys_a + keys_b)
    before = collections.Counter(keys_a[: offsets[("a", 0)]] + keys_b[: offsets[("b", 0)]])
    migrated = sum(a.get("migrated_rows", 0) for a in job.acks)
    assert migrated == len(before), "one state row per key seen before the barrier"
    out = job.instances[("out", 0)].result
    assert isinstance(out, pa.Table)
    last: dict[int, int] = {}
    for r in out.to_pylist():
        k, c = r["key"], r["count"]
        if r["tag"] == "v2":  # the new function: the migrated value plus what came after
            c -= SHIFT if before[k] else 0
            assert c > before[k], f"key {k}: {c} after the barrier, {before[k]} before"
        else:
            assert c <= before[k]
        last[k] = c
    assert last == dict(total)


def test_state_migration_rewrites_every_value_of_the_state(tmp_path: Path) -> None:
    from raystream.state.handles import KeyedStates

    ks = rs.KeySpace(16, 4)
    backend = RocksStateBackend(tmp_path / "db")
    old = {"": rs.ValueState(int, default=0)}
    new = {"": rs.ValueState(object, default=None)}
    keys = pa.array(list(range(50)), pa.int64())
    states = KeyedStates(backend, old, ks)
    from raystream.state.handles import KeySet

    ks_keys = KeySet.of(keys, ks)
    states.vectorised().put(ks_keys, list(range(100, 150)))
    rows = migrate_state_rows(backend, old, new, {"": lambda v: ("migrated", v)})
    assert rows == 50
    got = KeyedStates(backend, new, ks).vectorised().get(ks_keys)
    assert list(got) == [("migrated", v) for v in range(100, 150)]


# ---- refusals: nothing changes -----------------------------------------------------------


def _step(op: Any, kind_key: str = "key") -> Step:
    return Step(
        "count",
        op.kind,
        op.fn,
        ("source",),
        key=rs.dataflow.KeySpec(column=kind_key),
        state=op.state,
    )


@rs.keyed_batches(name="c", state=rs.ValueState(object))
def count_objects(batch: rs.KeyedBatch, state: Any) -> None:
    return None


@rs.keyed_batches(name="c", state={"n": rs.ValueState(int), "m": rs.MapState()})
def two_states(batch: rs.KeyedBatch, state: Any) -> None:
    return None


@rs.map
def a_map(record: dict[str, Any]) -> dict[str, Any]:
    return record


@rs.filter
def a_filter(record: dict[str, Any]) -> bool:
    return True


@pytest.mark.parametrize(
    ("op", "kwargs", "expect"),
    [
        (a_map, {}, "must be @rs.keyed or @rs.keyed_batches (the step is keyed_batches), got"),
        (count_tagged.fn, {}, "must be an operator made with @rs.keyed_batches"),
        (count_tagged, {"key": "user"}, "keyed by 'key', the replacement asks for 'user'"),
        (count_objects, {}, "as ValueState(pickle), the step holds it as ValueState(int64)"),
        (two_states, {}, "keep the step's states in order, [''] (new states may follow), got"),
        (count_tagged, {"migrate_state": {"x": abs}}, "unknown state(s) ['x']"),
        (count_tagged, {"migrate_state": 3}, "must be a function old value -> new value"),
    ],
)
def test_a_function_that_does_not_fit_is_refused_with_expected_and_got(
    op: Any, kwargs: dict[str, Any], expect: str
) -> None:
    with pytest.raises(rs.ReconfigurationError) as err:
        check_replacement(_step(count), op, **kwargs)
    assert expect in str(err.value)
    assert isinstance(err.value, rs.RaystreamError)


def test_changed_state_form_is_accepted_with_a_migration_function() -> None:
    step, migrations = check_replacement(_step(count), count_objects, migrate_state=str)
    assert step.fn is count_objects.fn and step.state == count_objects.state
    assert migrations == {"": str}


def test_stateless_kinds_and_ends_of_the_graph() -> None:
    step = _step(a_map)
    assert check_replacement(step, a_map)[0].fn is a_map.fn
    with pytest.raises(rs.ReconfigurationError, match="must be @rs.map .*got @rs.filter"):
        check_replacement(step, a_filter)
    sink = Step("out", "sink", rs.sinks.collect(), ("count",))
    with pytest.raises(rs.ReconfigurationError, match="it is a sink"):
        check_replacement(sink, a_map)


def test_module_attr_that_does_not_import_is_refused() -> None:
    with pytest.raises(rs.ReconfigurationError, match="cannot load the operator 'no_such_mod_x:f'"):
        load_object("no_such_mod_x:f")
    with pytest.raises(rs.ReconfigurationError, match="'package.module:attr', got 'justaname'"):
        load_object("justaname")
    with pytest.raises(rs.ReconfigurationError, match="AttributeError"):
        load_object("raystream.operators:no_such_operator")
    assert load_object("raystream.reconfigure:load_object") is load_object


def test_cli_update_refuses_a_bad_import_before_connecting() -> None:
    from raystream.cli import main

    result = CliRunner().invoke(main, ["update", "somejob", "count", "no_such_mod_x:count_v2"])
    assert result.exit_code == 2, result.output
    assert "cannot load the operator 'no_such_mod_x:count_v2'" in result.output


def test_cli_status_shows_the_graph_version_and_every_change(monkeypatch: Any) -> None:
    change = {
        "kind": "replace",
        "step": "count",
        "epoch": 7,
        "start_s": 3.0,
        "end_s": 3.25,
        "change": "ops:count -> ops:count_v2",
        "moved": {"migrated_state_rows": 1200},
        "peak_latency_ms": 41.5,
    }
    status = {
        "job": "kc",
        "state": "running",
        "parallelism": {"source": 1, "count": 2, "out": 1},
        "instances": [],
        "graph_version": 2,
        "graph": [
            {"step": "source", "kind": "source", "function": "gen"},
            {"step": "count", "kind": "keyed_batches", "function": "ops:count_v2"},
            {"step": "out", "kind": "sink", "function": "collect"},
        ],
        "reconfigurations": [change],
    }

    out = status_output(monkeypatch, status)
    assert "graph version 2: count (keyed_batches ops:count_v2)" in out
    assert "replace 'count' at epoch 7: t=3.0-3.2s, ops:count -> ops:count_v2" in out
    assert "migrated_state_rows 1,200; peak latency 41.5 ms" in out
