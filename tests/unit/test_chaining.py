"""Operator chaining without Ray: which steps chain (and why not), and chains running in-process
(results against collections.Counter, per-step metrics, barriers through the chain, no copies,
errors named after the chained step, reconfigurations refused with a hint)."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import raystream as rs
from raystream.chaining import not_chained_because, plan_chains
from raystream.plan import physical_plan
from raystream.runtime.chain import Chain, ChainSpec
from raystream.runtime.instance import RuntimeConfig
from raystream.runtime.local import run_local
from raystream.runtime.messages import Barrier

EVENTS = 20_000
KEYS = 50


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


def _gen() -> Any:
    return rs.sources.generator(events=EVENTS, keys=KEYS, zipf=1.1, seed=3, chunk_rows=2048)


@rs.map_batches
def tag(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.append_column("odd", pc.equal(pc.bit_wise_and(batch["key"], 1), 1))


@rs.filter
def odd(record: dict[str, Any]) -> bool:
    return bool(record["odd"])


def _keycount(flow: rs.Dataflow, sink: Any = None, sink_parallelism: int | None = None) -> None:
    src = flow.source(_gen(), name="source", parallelism=2)
    src.apply(tag, parallelism=2).apply(odd, parallelism=2).key_by("key").apply(
        count, parallelism=2
    ).sink(sink or rs.sinks.collect(), name="out", parallelism=sink_parallelism)


def _oracle() -> Counter[int]:
    keys = _gen().generate_all()["key"].to_pylist()
    return Counter(k for k in keys if k % 2 == 1)


def _final_counts(table: pa.Table) -> dict[int, int]:
    got: dict[int, int] = {}
    for k, c in zip(table["key"].to_pylist(), table["count"].to_pylist(), strict=True):
        got[k] = max(got.get(k, 0), c)
    return got


# ---- planning ------------------------------------------------------------------------------


def test_source_and_stateless_steps_chain_up_to_the_key_partitioning() -> None:
    flow = rs.Dataflow("chains")
    _keycount(flow)
    steps = flow.with_parallelism(None)
    assert plan_chains(steps) == [("source", "tag", "odd")]
    assert "hash edge" in str(not_chained_because(steps["odd"], steps["count"], steps))
    # the default sink parallelism (1) is not the keyed step's (2): the sink runs alone
    assert "parallelism differs" in str(not_chained_because(steps["count"], steps["out"], steps))
    assert plan_chains(steps, enabled=False) == []

    plan = physical_plan(flow, None, RuntimeConfig(), 0, tempfile.mkdtemp())
    assert plan.chains == {("source", i): (("source", i), ("tag", i), ("odd", i)) for i in range(2)}
    assert plan.actor_of(("odd", 1)) == ("source", 1) and plan.actor_of(("count", 0)) == (
        "count",
        0,
    )
    head, mid, tail = (plan.instances[(s, 1)] for s in ("source", "tag", "odd"))
    assert [o.partitioning for o in head.outputs] == ["local"]
    assert head.outputs[0].receiver_ids == (("tag", 1),)
    assert mid.inputs == (("source", 1),) and tail.inputs == (("tag", 1),)
    # the tail partitions by key group for the keyed step, as an unchained step would
    assert [o.partitioning for o in tail.outputs] == ["key_group"]
    off = physical_plan(flow, None, RuntimeConfig(chaining=False), 0, tempfile.mkdtemp())
    assert off.chains == {} and [o.partitioning for o in off.instances[("source", 1)].outputs] == [
        "forward"
    ]


def test_what_does_not_chain() -> None:
    flow = rs.Dataflow("nochains")
    a = flow.source(_gen(), name="a", parallelism=2)
    b = flow.source(_gen(), name="b", parallelism=2)
    # different parallelism (set below)
    a.map(lambda r: r, name="wide")
    # fan-out: b feeds two steps
    b.map(lambda r: r, name="left").sink(rs.sinks.collect(), name="s1", parallelism=2)
    b.map(lambda r: r, name="right").sink(rs.sinks.collect(), name="s2", parallelism=1)
    # union input
    c = flow.source(_gen(), name="c")
    d = flow.source(_gen(), name="d")
    c.union(d).map(lambda r: r, name="both").sink(rs.sinks.collect(), name="s3")
    # chain=False on a step, and different actor options
    e = flow.source(_gen(), name="e")
    e.map(lambda r: r, name="own").options(chain=False).map(lambda r: r, name="after").options(
        num_cpus=0.5
    ).sink(rs.sinks.collect(), name="s4")
    steps = flow.with_parallelism({"wide": 3, "left": 2, "right": 2})
    why = {
        (u, d): not_chained_because(steps[u], steps[d], steps)
        for u, d in [
            ("a", "wide"),
            ("b", "left"),
            ("c", "both"),
            ("e", "own"),
            ("own", "after"),
            ("after", "s4"),
            ("left", "s1"),
            ("right", "s2"),
        ]
    }
    assert "parallelism differs" in str(why[("a", "wide")])
    assert "feeds several steps" in str(why[("b", "left")])
    assert "reads several steps" in str(why[("c", "both")])
    assert "chain=False" in str(why[("e", "own")]) and "chain=False" in str(why[("own", "after")])
    assert "actor options" in str(why[("after", "s4")])
    assert why[("left", "s1")] is None  # a sink after a stateless step at equal parallelism
    assert "parallelism differs" in str(why[("right", "s2")])
    assert plan_chains(steps) == [("left", "s1"), ("both", "s3")]


def test_chain_false_and_side_outputs_on_the_flow() -> None:
    flow = rs.Dataflow("opts")

    @rs.map_batches
    def split(batch: pa.RecordBatch) -> Any:
        return rs.Outputs(main=batch, odd=batch)

    s = flow.source(_gen(), name="src").apply(split)
    s.side_output("odd").sink(rs.sinks.collect(), name="odd_out")
    flow.options("src", num_cpus=0)
    flow.options("src", chain=False)
    assert (
        flow.steps["src"].chain is False
        and flow.steps["src"].actor.ray_options(None).get("num_cpus") == 0
    )  # chain= alone keeps the actor options
    steps = flow.with_parallelism(None)
    assert "side output" in str(not_chained_because(steps["split"], steps["odd_out"], steps))
    with pytest.raises(rs.DataflowDefinitionError, match="chain= takes True or False"):
        flow.options("src", chain="no")
    with pytest.raises(rs.ConfigError, match="chaining must be True or False"):
        RuntimeConfig(chaining="yes")  # type: ignore[arg-type]


# ---- running chains in-process ---------------------------------------------------------------


@pytest.mark.parametrize("chaining", [True, False])
def test_chained_keycount_matches_counter(chaining: bool) -> None:
    flow = rs.Dataflow(f"chained-{chaining}")
    _keycount(flow)
    out = asyncio.run(
        run_local(flow, state_dir=tempfile.mkdtemp(), config=RuntimeConfig(chaining=chaining))
    )
    table = out["out"]
    assert table is not None
    assert _final_counts(table) == dict(_oracle())


def _run_chain(flow: rs.Dataflow, barriers: Any = None) -> tuple[Chain, list]:
    """The whole flow as one chain (source -> ... -> sink, parallelism 1), run to its end;
    ``barriers(chain)`` is called once the chain is built (to inject barriers from a step)."""
    plan = physical_plan(flow, None, RuntimeConfig(), time.time_ns(), tempfile.mkdtemp())
    (ids,) = plan.chains.values()
    assert len(ids) == len(plan.instances)
    storage = (tempfile.mkdtemp(), flow.name)  # a two-phase sink pre-commits at barriers
    chain = Chain(ChainSpec(tuple(replace(plan.instances[i], storage=storage) for i in ids)))
    events: list[tuple[str, Any]] = []

    def sender(receiver: Any, payload: Any) -> Any:
        raise AssertionError(f"a whole-flow chain sends nothing out, got one to {receiver}")

    chain.connect(sender, lambda event, info: events.append((event, info)))
    if barriers is not None:
        barriers(chain)
    asyncio.run(chain.run())
    assert chain.head.error is None, chain.head.error_traceback
    return chain, events


class _CountingSink:
    """A two-phase sink that remembers how many rows it had at each pre-commit."""

    def __init__(self) -> None:
        self.at_pre_commit: dict[int, int] = {}
        self.rows = 0

    def open(self, index: int, parallelism: int) -> _CountingSink:
        return self

    def write(self, batch: pa.RecordBatch) -> None:
        self.rows += batch.num_rows

    def pre_commit(self, checkpoint_id: int) -> dict[str, int]:
        self.at_pre_commit[checkpoint_id] = self.rows
        return {"rows_so_far": self.rows}

    def commit(self, checkpoint_id: int) -> None:
        pass

    def close(self) -> int:
        return self.rows

    def abort(self) -> None:
        pass


class _CountsAtPreCommit(_CountingSink):
    """A two-phase sink that keeps its batches and, at each pre-commit, the last count per key."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[pa.RecordBatch] = []
        self.at_pre_commit: dict[int, Any] = {}

    def write(self, batch: pa.RecordBatch) -> None:
        self.batches.append(batch)
        self.rows += batch.num_rows

    def pre_commit(self, checkpoint_id: int) -> dict[str, int]:
        self.at_pre_commit[checkpoint_id] = _final_counts(pa.Table.from_batches(self.batches))
        return {"rows_so_far": self.rows}


def test_a_chain_passes_the_same_batch_and_keeps_metrics_per_step() -> None:
    seen: list[tuple[int, int]] = []  # (address the first step made, address the second got)
    made: list[int] = []

    @rs.map_batches
    def first(batch: pa.RecordBatch) -> pa.RecordBatch:
        out = pa.record_batch({"key": pc.multiply(batch["key"], 2)})
        made.append(out.column(0).buffers()[1].address)
        return out

    @rs.map_batches
    def second(batch: pa.RecordBatch) -> pa.RecordBatch:
        seen.append((made[-1], batch.column(0).buffers()[1].address))
        time.sleep(0.02)  # work of this step, not of the steps before it (long beside theirs)
        return batch

    flow = rs.Dataflow("nocopy")
    flow.source(_gen(), name="src").apply(first).apply(second).filter(
        lambda r: r["key"] % 4 == 0, name="quarter"
    ).sink(rs.sinks.collect(), name="out")
    chain, _ = _run_chain(flow)
    assert seen and all(a == b for a, b in seen)  # the very buffers, no copy on the way
    keys = _gen().generate_all()["key"].to_numpy()
    kept = int(np.sum((keys * 2) % 4 == 0))
    m = {i.spec.step.name: i.metrics for i in chain.instances}
    assert m["src"].records_out == EVENTS
    assert m["first"].records_in == EVENTS and m["first"].records_out == EVENTS
    assert m["second"].records_in == EVENTS and m["quarter"].records_in == EVENTS
    assert m["quarter"].records_out == kept and m["out"].records_in == kept
    result = chain.instances[-1].result
    assert result.num_rows == kept
    assert sorted(result["key"].to_pylist()) == sorted(int(k) * 2 for k in keys if k * 2 % 4 == 0)
    # busy time per step: second's sleeps are its own, not its predecessors'
    slept = 0.02 * len(seen)
    assert m["second"].busy_s >= slept * 0.9
    assert m["first"].busy_s < slept * 0.5 and m["src"].busy_s < slept * 0.5


def test_barriers_pass_the_chain_in_order_and_each_step_acknowledges() -> None:
    sink = _CountingSink()
    at_rows = (3000, 11000)  # a step injects a checkpoint barrier at the source past these rows
    seen = [0]
    holder: list[Chain] = []

    @rs.map_batches
    def inject(batch: pa.RecordBatch) -> pa.RecordBatch:
        before, seen[0] = seen[0], seen[0] + batch.num_rows
        for epoch, rows in enumerate(at_rows, start=1):
            if before < rows <= seen[0]:
                assert holder[0].head.inject_barrier(Barrier(epoch, "checkpoint", {}))
        return batch

    flow = rs.Dataflow("barriers")
    flow.source(_gen(), name="src").apply(inject).map(lambda r: r, name="m").sink(sink, name="out")
    chain, events = _run_chain(flow, barriers=holder.append)
    acks = [e for ev, e in events if ev == "barrier"]
    for epoch in (1, 2):
        mine = [e for e in acks if e["epoch"] == epoch]
        # the barrier reaches the sink first (each step forwards it, then acknowledges)
        assert [tuple(e["instance"]) for e in mine] == [
            ("out", 0),
            ("m", 0),
            ("inject", 0),
            ("src", 0),
        ]
        offset = next(e["source_offset"] for e in mine if e["instance"] == ("src", 0))
        assert offset >= at_rows[epoch - 1]
        # aligned: the sink pre-committed exactly the rows the source emitted before the barrier
        assert sink.at_pre_commit[epoch] == offset
        assert next(e for e in mine if e["instance"] == ("out", 0))["sink_state"] == {
            "rows_so_far": offset
        }
    assert [tuple(e["instance"]) for ev, e in events if ev == "finished"] == [
        ("src", 0),
        ("inject", 0),
        ("m", 0),
        ("out", 0),
    ]
    assert sink.rows == EVENTS


def test_an_error_in_a_chained_step_names_that_step() -> None:
    @rs.map
    def boom(record: dict[str, Any]) -> dict[str, Any]:
        if record["key"] == 7:
            raise ValueError("key seven")
        return record

    flow = rs.Dataflow("boom")
    flow.source(_gen(), name="src").apply(boom).sink(rs.sinks.collect(), name="out")
    with pytest.raises(rs.JobFailedError, match=r"boom.*key seven") as err:
        asyncio.run(run_local(flow, state_dir=tempfile.mkdtemp()))
    assert "'src'" not in str(err.value).split("key seven")[0]


def test_insert_and_remove_refuse_to_cut_a_chain() -> None:
    from raystream.rewiring import Rewiring

    flow = rs.Dataflow("rewire")
    _keycount(flow)
    plan = physical_plan(flow, None, RuntimeConfig(), 0, tempfile.mkdtemp())
    ctl = SimpleNamespace(plan=plan)

    @rs.filter
    def keep(record: dict[str, Any]) -> bool:
        return True

    with pytest.raises(rs.ReconfigurationError, match=r"chained.*chain=False"):
        asyncio.run(Rewiring.insert(ctl, "tag", keep))
    with pytest.raises(rs.ReconfigurationError, match=r"chained.*chain=False"):
        asyncio.run(Rewiring.remove(ctl, "odd"))
    assert Rewiring.chain_of(ctl, "odd") == ["source", "tag", "odd"]
    assert Rewiring.chain_of(ctl, "count") == []


def test_status_rows_name_the_chain() -> None:
    from raystream.status_view import operator_rows

    st = {
        "parallelism": {"source": 1, "tag": 1, "count": 1},
        "graph": [
            {"step": "source", "chain": ["source", "tag"]},
            {"step": "tag", "chain": ["source", "tag"]},
            {"step": "count", "chain": []},
        ],
        "instances": [
            {"step": "source", "index": 0, "role": "source", "records_out": 5},
            {"step": "tag", "index": 0, "role": "operator", "records_in": 5, "records_out": 5},
            {"step": "count", "index": 0, "role": "operator", "records_in": 5},
        ],
    }
    rows = {r["operator"]: r for r in operator_rows(st, now_ns=0)}
    assert rows["source"]["chain"] == rows["tag"]["chain"] == "source > tag"
    assert rows["count"]["chain"] == ""
    assert rows["tag"]["records_in"] == 5  # per step, not per actor


# ---- a sink chained to a keyed step ----------------------------------------------------------


def test_a_sink_at_the_keyed_steps_parallelism_chains_to_it_and_follows_it() -> None:
    from raystream.chaining import follow_keyed, steps_following

    flow = rs.Dataflow("keyed-sink")
    _keycount(flow, sink_parallelism=2)
    steps = flow.with_parallelism(None)
    assert not_chained_because(steps["count"], steps["out"], steps) is None
    assert plan_chains(steps) == [("source", "tag", "odd"), ("count", "out")]
    assert steps_following(steps) == {"out": "count"}
    assert steps_following(steps, enabled=False) == {}
    # the sink follows the keyed step's parallelism (a rescale, a restore, a recovery)
    assert follow_keyed({"count": 3, "out": 2, "tag": 2}, {"out": "count"}) == {
        "count": 3,
        "out": 3,
        "tag": 2,
    }
    assert follow_keyed({"tag": 2}, {"out": "count"}) == {"tag": 2}
    plan = physical_plan(flow, {"count": 3, "out": 3}, RuntimeConfig(), 0, tempfile.mkdtemp())
    assert {h: ids for h, ids in plan.chains.items() if h[0] == "count"} == {
        ("count", i): (("count", i), ("out", i)) for i in range(3)
    }
    head, tail = plan.instances[("count", 2)], plan.instances[("out", 2)]
    assert [(o.partitioning, o.receiver_ids) for o in head.outputs] == [("local", (("out", 2),))]
    assert tail.inputs == (("count", 2),) and tail.step.parallelism == 3
    # the sink is still one of the job's sinks (two-phase commit, results per instance)
    assert sorted(plan.sinks) == [("out", i) for i in range(3)]
    # chain=False on the sink keeps it alone
    flow.options("out", chain=False)
    assert "chain=False" in str(
        not_chained_because(*(flow.with_parallelism(None)[n] for n in ("count", "out")), steps)
    )


@pytest.mark.parametrize("chaining", [True, False])
def test_keyed_count_with_a_chained_sink_matches_counter(chaining: bool) -> None:
    flow = rs.Dataflow(f"keyed-sink-{chaining}")
    _keycount(flow, sink_parallelism=2)
    out = asyncio.run(
        run_local(flow, state_dir=tempfile.mkdtemp(), config=RuntimeConfig(chaining=chaining))
    )
    table = out["out"]
    assert table is not None
    assert _final_counts(table) == dict(_oracle())


def test_a_chained_keyed_step_and_sink_checkpoint_in_one_barrier_pass() -> None:
    """keyed -> sink as one chain (no source chain before it: records pushed to its head):
    a checkpoint barrier passes the keyed step (snapshot) and then its sink (pre-commit of
    exactly the rows emitted before the barrier)."""
    sink = _CountsAtPreCommit()
    flow = rs.Dataflow("keyed-sink-barrier")
    flow.source(_gen(), name="src", parallelism=1).options(chain=False).key_by("key").apply(
        count
    ).sink(sink, name="out")
    plan = physical_plan(flow, None, RuntimeConfig(), time.time_ns(), tempfile.mkdtemp())
    assert plan.chains == {("count", 0): (("count", 0), ("out", 0))}
    storage = (tempfile.mkdtemp(), flow.name)
    chain = Chain(
        ChainSpec(
            tuple(replace(plan.instances[i], storage=storage) for i in plan.chains[("count", 0)])
        )
    )
    events: list[tuple[str, Any]] = []
    chain.connect(lambda r, p: None, lambda event, info: events.append((event, info)))
    keys = _gen().generate_all()
    half = keys.num_rows // 2

    async def drive() -> None:
        task = asyncio.ensure_future(chain.run())
        src = ("src", 0)
        parts = [keys.slice(0, half), keys.slice(half)]
        seq = 0
        for k, part in enumerate(parts):
            for b in part.to_batches(max_chunksize=4096):
                await chain.head.push(src, seq, b)
                seq += 1
            if k == 0:
                await chain.head.push(src, seq, Barrier(1, "checkpoint", {}))
                seq += 1
        from raystream.runtime.messages import EndOfStream

        await chain.head.push(src, seq, EndOfStream())
        await task

    asyncio.run(drive())
    assert chain.head.error is None, chain.head.error_traceback
    acks = [tuple(e["instance"]) for ev, e in events if ev == "barrier" and e["epoch"] == 1]
    assert acks[0] == ("out", 0) and ("count", 0) in acks
    # aligned: the sink's rows up to the barrier hold exactly the counts of the first half
    assert sink.at_pre_commit[1] == Counter(keys.slice(0, half)["key"].to_pylist())
    assert _final_counts(pa.Table.from_batches(sink.batches)) == Counter(keys["key"].to_pylist())
    # the job checkpoints: the end of input is pre-committed too (published by the controller)
    from raystream.runtime.snapshots import FINAL_CHECKPOINT

    assert sink.at_pre_commit[FINAL_CHECKPOINT] == Counter(keys["key"].to_pylist())
    assert chain.instances[1].final_sink_state == {"rows_so_far": sink.rows}


def test_a_sink_index_that_comes_back_gets_a_new_writer_index() -> None:
    from raystream.keyed_chains import KeyedChains

    flow = rs.Dataflow("writers")
    _keycount(flow, sink_parallelism=2)
    plan = physical_plan(flow, None, RuntimeConfig(), 0, tempfile.mkdtemp())
    ctl = SimpleNamespace(plan=plan, specs=dict(plan.instances), _sink_writers={}, _writers_used={})
    writer = KeyedChains._writer_for.__get__(ctl)
    assert writer(("out", 2)) is None  # a new index: its own
    assert writer(("out", 2)) == 3  # back after a scale-in: one no writer had
    assert writer(("out", 3)) == 4 and ctl._sink_writers == {("out", 2): 3, ("out", 3): 4}
    assert writer(("out", 5)) is None  # never had


def test_a_sink_opens_its_writer_at_its_writer_index(tmp_path: Any) -> None:
    from raystream.runtime.instance import OperatorInstance

    flow = rs.Dataflow("writer-index")
    _keycount(flow, sink=rs.sinks.parquet(str(tmp_path / "out")), sink_parallelism=2)
    plan = physical_plan(flow, None, RuntimeConfig(), 0, tempfile.mkdtemp())
    spec = replace(plan.instances[("out", 1)], sink_writer=7)
    inst = OperatorInstance(spec)
    asyncio.run(inst._open_receiver())
    inst.writer.write(pa.record_batch({"key": [1, 2], "count": [1, 1]}))
    written = inst.writer.close()
    assert [p.rsplit("/", 1)[-1] for p in written.paths] == ["part-00007.parquet"]
    assert written.rows == 2


def test_reconfigurations_refuse_to_cut_a_keyed_chain() -> None:
    from raystream.keyed_chains import KeyedChains
    from raystream.rewiring import Rewiring

    flow = rs.Dataflow("rewire-keyed")
    _keycount(flow, sink_parallelism=2)
    plan = physical_plan(flow, None, RuntimeConfig(), 0, tempfile.mkdtemp())
    ctl = SimpleNamespace(plan=plan, following={"out": "count"})

    @rs.filter
    def keep(record: dict[str, Any]) -> bool:
        return True

    with pytest.raises(rs.ReconfigurationError, match=r"chained.*chain=False"):
        asyncio.run(Rewiring.insert(ctl, "count", keep))
    assert Rewiring.chain_of(ctl, "count") == ["count", "out"]
    with pytest.raises(rs.ReconfigurationError, match=r"cannot move.*\['out'\] run chained"):
        KeyedChains._check_movable(
            SimpleNamespace(following={"out": "count"}, _followers=lambda s: ["out"]), "count"
        )


@pytest.mark.parametrize(("flag", "tail"), [("--no-chaining", " --no-chaining"), (None, "")])
def test_submit_passes_no_chaining_to_the_cluster_side_run(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, flag: str | None, tail: str
) -> None:
    from click.testing import CliRunner

    import raystream.submit as submit_mod
    from raystream.cli import main

    job = tmp_path / "job.py"
    job.write_text("")
    sent: list[Any] = []
    monkeypatch.setattr(submit_mod, "submit", lambda sub, target: (sent.append(sub), "id")[::-1])
    args = ["submit", str(job), "-p", "count=2", "--address", "http://h:8265", "--no-wait"]
    out = CliRunner().invoke(main, args + ([flag] if flag else []))
    assert out.exit_code == 0, out.output
    assert sent[0].entrypoint() == f"python -m raystream run job.py -p count=2{tail}"


def test_a_restore_folds_the_states_of_retired_sink_instances_into_the_first() -> None:
    from raystream.checkpointing import build_manifest, restore_specs

    routing = {"count": rs.keys.RoutingTable.uniform(8, 2)}
    kinds = {"src": "source", "count": "keyed_batches", "out": "sink"}
    acks = [
        {"instance": ("out", 0), "sink_state": {"blobs": ["b0"]}},
        {"instance": ("out", 1), "sink_state": {"blobs": ["b1"]}},
        # taken at parallelism 3: a scale-in retired out/2 after this checkpoint
        {"instance": ("out", 2), "sink_state": {"blobs": ["b2"]}},
    ]
    manifest = build_manifest(
        job="j",
        checkpoint_id=7,
        acks=acks,
        finished_sources=[],
        steps=kinds,
        parallelism={"count": 2, "out": 2},
        routing=routing,
        num_key_groups=8,
        sub_groups=2,
        final=True,  # (no keyed state in this manifest)
        retired_sinks=[("out", {"blobs": ["r5"]})],  # retired and published earlier
    )
    specs = restore_specs(manifest, [("out", 0), ("out", 1)], {}, ("mem", "j"))
    assert specs[("out", 0)]["sink"] == {"blobs": ["b0", "b2", "r5"]}
    assert specs[("out", 1)]["sink"] == {"blobs": ["b1"]}
    # at parallelism 3 again (the index came back) only the retired one is folded
    specs3 = restore_specs(manifest, [("out", i) for i in range(3)], {}, ("mem", "j"))
    assert specs3[("out", 0)]["sink"] == {"blobs": ["b0", "r5"]}
    assert specs3[("out", 2)]["sink"] == {"blobs": ["b2"]}
    # a sink state of another shape cannot be taken over: a clear error, nothing dropped
    odd = dict(manifest, retired_sinks=[["out", {"rows_so_far": 3}]])
    with pytest.raises(rs.CheckpointError, match=r"sink 'out'.*cannot take over.*chain=False"):
        restore_specs(odd, [("out", 0)], {}, ("mem", "j"))


def test_a_parquet_sink_restored_with_a_retired_writers_parts_publishes_them_once(
    tmp_path: Any,
) -> None:
    """Writer 2 (retired) pre-committed a part at checkpoint 4 and published it; writer 0 has a
    part pending at 4. A restore of writer 0 with writer 2's state folded in publishes its own
    part, keeps writer 2's (published once, not deleted), and the rows read back are all rows."""
    import pyarrow.parquet as pq

    from raystream.checkpointing import fold_sink_states

    sink = rs.sinks.parquet(str(tmp_path / "out"))
    w0, w2 = sink.open(0, 3), sink.open(2, 3)
    w0.write(pa.record_batch({"key": [1, 2], "count": [1, 1]}))
    w2.write(pa.record_batch({"key": [3], "count": [1]}))
    s0, s2 = w0.pre_commit(4), w2.pre_commit(4)
    w2.commit(4)  # the retired writer's part was published
    w0.abort()  # the instance died before checkpoint 4's commit
    again = sink.open(0, 2)
    again.restore(fold_sink_states(s0, [s2], "out"))
    done = again.close()
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["part-00000-00000004.parquet", "part-00002-00000004.parquet"]
    rows = pq.read_table(str(tmp_path / "out")).sort_by("key")
    assert rows["key"].to_pylist() == [1, 2, 3] and done.rows == 3


def test_every_outcome_of_a_failed_chain_names_the_step_that_failed(monkeypatch: Any) -> None:
    """The controller takes the first outcome it reads: the chain's members that the head's end
    took down must name the failed step (and carry its traceback), not themselves."""
    from raystream.runtime import actors

    monkeypatch.setattr(actors, "_where", lambda: {})

    @rs.map_batches
    def broken_parser(batch: pa.RecordBatch) -> pa.RecordBatch:
        raise ValueError("price column holds 'abc'")

    flow = rs.Dataflow("chain-outcomes")
    flow.source(_gen(), name="source").apply(broken_parser, name="parse").sink(
        rs.sinks.collect(), name="out"
    )
    config = RuntimeConfig(metrics_export_s=0)
    plan = physical_plan(flow, None, config, time.time_ns(), tempfile.mkdtemp())
    (ids,) = plan.chains.values()
    actor = actors._InstanceActor(ChainSpec(tuple(plan.instances[i] for i in ids)))  # noqa: SLF001
    actor._instance.connect(lambda *a: None, lambda *a: None)  # noqa: SLF001
    for m in actor._chain.members:  # noqa: SLF001
        m.connect(lambda *a: None, lambda *a: None)

    async def outcomes() -> list[dict[str, Any]]:
        members = [actor._members[i].run() for i in ids[1:]]  # noqa: SLF001
        return await asyncio.gather(actor.run(), *members)

    results = asyncio.run(outcomes())
    assert [r["instance"] for r in results] == list(ids)
    for r in results:
        assert r["error_instance"] == ("parse", 0), r
        assert r["error"] == "ValueError: price column holds 'abc'", r
        assert "in broken_parser" in r["traceback"], r
