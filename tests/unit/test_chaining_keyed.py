"""Stateless steps chained after a keyed step, without Ray: which steps chain after it (and why
not), the followers' parallelism (by default, and after a rescale, restore or recovery), the
physical plan of such a chain, a scale-out's new chain actors, refusals, and the chain running
in-process against collections.Counter."""

from __future__ import annotations

import asyncio
import tempfile
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import raystream as rs
from raystream.chaining import (
    follow_keyed,
    follower_parallelism,
    not_chained_because,
    plan_chains,
    steps_following,
)
from raystream.keyed_chains import KeyedChains
from raystream.plan import physical_plan
from raystream.reconfigurations import Reconfigurations
from tests._chain_ops import parity_tagger
from raystream.runtime.chain import ChainSpec
from raystream.runtime.instance import RuntimeConfig
from raystream.runtime.local import run_local

EVENTS = 20_000
KEYS = 60


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    """One row per record: its key and the count of its key up to it."""
    before = state.get(batch.keys)
    counts = batch.counts
    state.put(batch.keys, before + counts)
    rank = np.arange(batch.records.num_rows) - np.repeat(np.cumsum(counts) - counts, counts)
    return pa.record_batch(
        {
            "key": batch.records.column("key"),
            "count": pa.array(np.repeat(before, counts) + rank + 1, pa.int64()),
        }
    )


@rs.map_batches
def fmt(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Derives a column: the count's parity."""
    return batch.append_column("even", pc.equal(pc.bit_wise_and(batch["count"], 1), 0))


@rs.filter
def keep(record: dict[str, Any]) -> bool:
    return bool(record["even"])


def _gen() -> Any:
    return rs.sources.generator(events=EVENTS, keys=KEYS, zipf=1.1, seed=11, chunk_rows=1024)


def _flow(
    name: str = "keyed-chain",
    *,
    count_p: int | None = 2,
    fmt_p: int | None = None,
    sink_p: int | None = 2,
    sink_chain: bool = True,
) -> rs.Dataflow:
    flow = rs.Dataflow(name)
    s = flow.source(_gen(), name="source").key_by("key").apply(count, parallelism=count_p)
    s = s.apply(fmt) if fmt_p is None else s.apply(fmt, parallelism=fmt_p)
    s.apply(keep).sink(rs.sinks.collect(), name="out", parallelism=sink_p)
    if not sink_chain:
        flow.options("out", chain=False)
    return flow


def _steps(flow: rs.Dataflow, parallelism: dict[str, int] | None = None, chaining: bool = True):
    return flow.with_parallelism(follower_parallelism(flow.steps, parallelism, enabled=chaining))


def _oracle() -> list[tuple[int, int]]:
    """Every (key, count) the filter keeps: each key's even counts up to its number of events."""
    keys = _gen().generate_all()["key"].to_pylist()
    return sorted((k, c) for k, n in Counter(keys).items() for c in range(2, n + 1, 2))


# ---- planning ------------------------------------------------------------------------------


def test_stateless_steps_and_the_sink_chain_after_a_keyed_step() -> None:
    flow = _flow()
    steps = _steps(flow)
    # fmt and keep were given no parallelism: they take count's, as they chain after it
    assert [steps[n].parallelism for n in ("count", "fmt", "keep", "out")] == [2, 2, 2, 2]
    assert plan_chains(steps) == [("count", "fmt", "keep", "out")]
    assert steps_following(steps) == {"fmt": "count", "keep": "count", "out": "count"}
    plan = physical_plan(flow, None, RuntimeConfig(), 0, tempfile.mkdtemp())
    assert plan.chains == {
        ("count", i): (("count", i), ("fmt", i), ("keep", i), ("out", i)) for i in range(2)
    }
    head, mid, tail, sink = (plan.instances[(s, 1)] for s in ("count", "fmt", "keep", "out"))
    assert [(o.partitioning, o.receiver_ids) for o in head.outputs] == [("local", (("fmt", 1),))]
    assert [(o.partitioning, o.receiver_ids) for o in tail.outputs] == [("local", (("out", 1),))]
    assert mid.inputs == (("count", 1),) and sink.inputs == (("keep", 1),)
    # count reads every source instance by key group, as an unchained keyed step does
    assert head.inputs == (("source", 0),)


def test_a_sink_at_its_default_parallelism_ends_the_chain_before_it() -> None:
    flow = _flow(sink_p=None)
    steps = _steps(flow)
    assert plan_chains(steps) == [("count", "fmt", "keep")]
    assert "parallelism differs" in str(not_chained_because(steps["keep"], steps["out"], steps))
    plan = physical_plan(flow, None, RuntimeConfig(), 0, tempfile.mkdtemp())
    tail = plan.instances[("keep", 1)]
    assert [(o.partitioning, o.receiver_ids) for o in tail.outputs] == [
        ("rebalance", (("out", 0),))
    ]
    assert plan.instances[("out", 0)].inputs == (("keep", 0), ("keep", 1))


def test_a_followers_output_never_forwards_one_to_one() -> None:
    """keep -> out at equal parallelism, out not chained: keep's parallelism follows count's
    rescales and out's does not, so the edge is a rebalance, not forward."""
    flow = _flow(sink_chain=False)
    plan = physical_plan(flow, None, RuntimeConfig(), 0, tempfile.mkdtemp())
    assert plan_chains(plan.steps) == [("count", "fmt", "keep")]
    tail = plan.instances[("keep", 0)]
    assert [o.partitioning for o in tail.outputs] == ["rebalance"]
    assert plan.instances[("out", 1)].inputs == (("keep", 0), ("keep", 1))


def test_what_keeps_a_stateless_step_from_chaining_after_a_keyed_step() -> None:
    # chaining off: the defaults are as before (1), nothing chains
    flow = _flow()
    steps = _steps(flow, chaining=False)
    assert steps["fmt"].parallelism == steps["keep"].parallelism == 1
    assert plan_chains(steps, enabled=False) == []
    # chain=False on the first follower: it keeps its default 1 and nothing chains after count
    flow.options("fmt", chain=False)
    steps = _steps(flow)
    assert steps["fmt"].parallelism == 1 and not steps_following(steps)
    assert "chain=False" in str(
        not_chained_because(steps["count"], replace(steps["fmt"], parallelism=2), steps)
    )
    # a parallelism given to the follower is kept: not equal, not chained
    steps = _steps(_flow(fmt_p=3))
    assert steps["fmt"].parallelism == 3
    assert "parallelism differs" in str(not_chained_because(steps["count"], steps["fmt"], steps))
    # in parallelism={...} too
    steps = _steps(_flow(), {"keep": 1})
    assert plan_chains(steps) == [("count", "fmt")] and steps["keep"].parallelism == 1
    # a fan-out after the keyed step: each reader keeps its default
    fan = rs.Dataflow("fan")
    c = fan.source(_gen(), name="source").key_by("key").apply(count, parallelism=2)
    c.map(lambda r: r, name="a").sink(rs.sinks.collect(), name="o1")
    c.map(lambda r: r, name="b").sink(rs.sinks.collect(), name="o2")
    steps = _steps(fan)
    assert steps["a"].parallelism == steps["b"].parallelism == 1
    assert "feeds several steps" in str(not_chained_because(steps["count"], steps["a"], steps))
    # other actor options
    opts = _flow()
    opts.options("fmt", num_cpus=0.5)
    steps = _steps(opts)
    assert steps["fmt"].parallelism == 1 and plan_chains(steps) == []


def test_a_chain_after_a_keyed_step_feeds_the_next_keyed_step_by_key_group() -> None:
    flow = rs.Dataflow("two-keyed")
    (
        flow.source(_gen(), name="source")
        .key_by("key")
        .apply(count, parallelism=2)
        .apply(fmt)
        .key_by("even")
        .apply(count, name="by_parity", parallelism=3)
        .sink(rs.sinks.collect(), name="out")
    )
    plan = physical_plan(flow, None, RuntimeConfig(), 0, tempfile.mkdtemp())
    assert plan_chains(plan.steps) == [("count", "fmt")]
    tail = plan.instances[("fmt", 0)]
    assert [(o.partitioning, o.parallelism) for o in tail.outputs] == [("key_group", 3)]
    assert plan.instances[("by_parity", 2)].inputs == (("fmt", 0), ("fmt", 1))


def test_followers_take_the_keyed_steps_parallelism_after_a_rescale_restore_or_recovery() -> None:
    following = {"fmt": "count", "keep": "count", "out": "count"}
    assert follow_keyed({"count": 3, "fmt": 2, "keep": 2, "out": 2, "x": 2}, following) == {
        "count": 3,
        "fmt": 3,
        "keep": 3,
        "out": 3,
        "x": 2,
    }
    # a recovery plans at the current parallelism of every step: the rescaled keyed step's,
    # its followers' with it, and an unchained step's as it runs (not its default again)
    from raystream.recovery import Recovery

    flow = _flow(sink_chain=False)
    plan = physical_plan(flow, None, RuntimeConfig(), 0, tempfile.mkdtemp())
    from raystream.keys import RoutingTable

    ctl = SimpleNamespace(
        flow=flow,
        plan=plan,  # the plan the job runs with (a recovery keeps its chains)
        config=RuntimeConfig(),
        state="recovering",
        _parallelism_arg={},
        routing={"count": RoutingTable.uniform(flow.key_space.num_key_groups, 3)},
        parallelism={"source": 1, "count": 3, "fmt": 3, "keep": 3, "out": 2},
        following=steps_following(plan.steps),
        origin_ns=0,
        storage_spec=("mem", "x"),
        _restore_storage=lambda m: ("mem", "x"),
        _attempt=1,
        _sink_writers={},
        _epoch=0,
    )
    Recovery._replan(ctl, None, tempfile.mkdtemp())
    assert ctl.parallelism == {"source": 1, "count": 3, "fmt": 3, "keep": 3, "out": 2}
    assert {h: ids for h, ids in ctl.plan.chains.items() if h[0] == "count"} == {
        ("count", i): (("count", i), ("fmt", i), ("keep", i)) for i in range(3)
    }
    assert ctl.following == {"fmt": "count", "keep": "count"}
    assert ctl.plan.instances[("out", 1)].inputs == tuple(("keep", i) for i in range(3))


def _controller(flow: rs.Dataflow) -> Any:
    plan = physical_plan(flow, None, RuntimeConfig(), 0, tempfile.mkdtemp())
    ctl = SimpleNamespace(
        plan=plan,
        specs=dict(plan.instances),
        following=steps_following(plan.steps),
        parallelism={n: s.parallelism for n, s in plan.steps.items()},
        routing=dict(plan.routing),
        slots={},
        retired=set(),
        actor_names={},
        _sink_writers={},
        _writers_used={},
    )
    for cls in (KeyedChains, Reconfigurations):
        for name in ("_followers", "_writer_for", "_current_output", "_at"):
            if hasattr(cls, name):
                setattr(ctl, name, getattr(cls, name).__get__(ctl))
    return ctl


def test_a_scale_out_starts_a_chain_actor_with_every_follower() -> None:
    ctl = _controller(_flow(sink_chain=False))
    assert KeyedChains._followers(ctl, "count") == ["fmt", "keep"]
    assert KeyedChains._chain_ids(ctl, ("keep", 2)) == [("count", 2), ("fmt", 2), ("keep", 2)]
    spec = ctl.specs[("count", 0)]
    new = replace(spec, index=2, owned_key_groups=())
    actor, members = KeyedChains._chained_spawn(ctl, "count", new, 3)
    assert isinstance(actor, ChainSpec) and actor.ids == (("count", 2), ("fmt", 2), ("keep", 2))
    head, mid, tail = actor.specs
    assert head.outputs[0].receiver_ids == (("fmt", 2),) and mid.inputs == (("count", 2),)
    assert tail.inputs == (("fmt", 2),) and tail.step.parallelism == 3
    # the tail sends to the unchained sink as it runs now
    assert [(o.step, o.partitioning, o.receiver_ids) for o in tail.outputs] == [
        ("out", "rebalance", (("out", 0), ("out", 1)))
    ]
    assert ctl.plan.chains[("count", 2)] == actor.ids and ctl.specs[("keep", 2)] is tail
    assert members == [mid, tail]
    # a scale-in retires the followers of the retired indexes, and they follow the parallelism
    retired = KeyedChains._follow_rescale(ctl, "count", 1, 3)
    assert sorted(retired) == [("fmt", 1), ("fmt", 2), ("keep", 1), ("keep", 2)]
    assert ctl.parallelism["fmt"] == ctl.parallelism["keep"] == 1 and ctl.parallelism["out"] == 2
    assert ctl.retired == set(retired)


def test_moving_and_inserting_refuse_a_keyed_chain_with_a_hint() -> None:
    from raystream.rewiring import Rewiring

    ctl = _controller(_flow(sink_chain=False))
    with pytest.raises(rs.ReconfigurationError, match=r"\['fmt', 'keep'\] run chained.*'fmt'"):
        KeyedChains._check_movable(ctl, "count")

    @rs.filter
    def anything(record: dict[str, Any]) -> bool:
        return True

    for after in ("count", "fmt"):  # inside the chain: no channel there
        with pytest.raises(rs.ReconfigurationError, match=r"chained.*chain=False"):
            asyncio.run(Rewiring.insert(ctl, after, anything))
    # after its tail: its instances come and go with count's
    with pytest.raises(
        rs.ReconfigurationError, match=r"after 'keep'.*keyed step 'count'.*options\('fmt'"
    ):
        asyncio.run(Rewiring.insert(ctl, "keep", anything))
    with pytest.raises(rs.ReconfigurationError, match=r"chained.*chain=False"):
        asyncio.run(Rewiring.remove(ctl, "fmt"))
    assert Rewiring.chain_of(ctl, "fmt") == ["count", "fmt", "keep"]


# ---- running in-process --------------------------------------------------------------------


@pytest.mark.parametrize("chaining", [True, False])
def test_keyed_count_with_chained_map_filter_and_sink_matches_counter(chaining: bool) -> None:
    flow = _flow(f"keyed-chain-{chaining}")
    out = asyncio.run(
        run_local(flow, state_dir=tempfile.mkdtemp(), config=RuntimeConfig(chaining=chaining))
    )
    table = out["out"]
    assert table is not None
    rows = list(zip(table["key"].to_pylist(), table["count"].to_pylist(), strict=True))
    assert all(table["even"].to_pylist())
    assert sorted(rows) == _oracle()  # every row once
    if not chaining:  # fmt and keep run at 1 and the sink at 2: a rebalance mixes a key's rows
        return
    last: dict[int, int] = {}
    for k, c in rows:  # per key in order
        assert c == last.get(k, 0) + 2, (k, c, last.get(k))
        last[k] = c


def test_a_replace_barrier_swaps_a_followers_function_inside_the_chain() -> None:
    """count -> fmt -> keep -> sink as one chain (records pushed to its head): a replace barrier
    for fmt passes count and reaches fmt in order, so every row before it went through the old
    function and every row after it through the new one, as for an unchained step."""
    from raystream.reconfigure import check_replacement
    from raystream.runtime.chain import Chain
    from raystream.runtime.messages import Barrier, EndOfStream

    flow = rs.Dataflow("keyed-chain-replace")
    flow.source(_gen(), name="src").options(chain=False).key_by("key").apply(count).apply(
        parity_tagger(1, "fmt")
    ).apply(keep).sink(rs.sinks.collect(), name="out")
    plan = physical_plan(flow, None, RuntimeConfig(), 0, tempfile.mkdtemp())
    ids = plan.chains[("count", 0)]
    assert ids == (("count", 0), ("fmt", 0), ("keep", 0), ("out", 0))
    chain = Chain(ChainSpec(tuple(plan.instances[i] for i in ids)))
    events: list[tuple[str, Any]] = []
    chain.connect(lambda r, p: None, lambda event, info: events.append((event, info)))
    new_step, migrations = check_replacement(plan.steps["fmt"], parity_tagger(2, "fmt"))
    keys = _gen().generate_all()
    half = keys.num_rows // 2

    async def drive() -> None:
        task = asyncio.ensure_future(chain.run())
        src = ("src", 0)
        seq = 0
        for k, part in enumerate([keys.slice(0, half), keys.slice(half)]):
            for b in part.to_batches(max_chunksize=4096):
                await chain.head.push(src, seq, b)
                seq += 1
            if k == 0:
                payload = {"step": "fmt", "new_step": new_step, "migrations": migrations}
                barrier = Barrier(1, "replace", {**payload, "aligned": True})
                await chain.head.push(src, seq, barrier)
                seq += 1
        await chain.head.push(src, seq, EndOfStream())
        await task

    asyncio.run(drive())
    assert chain.head.error is None, chain.head.error_traceback
    acks = [tuple(e["instance"]) for ev, e in events if ev == "barrier" and e["epoch"] == 1]
    assert acks == [("out", 0), ("keep", 0), ("fmt", 0), ("count", 0)]
    table = chain.instances[-1].result
    rows = list(
        zip(table["key"].to_pylist(), table["count"].to_pylist(), table["version"].to_pylist(), strict=True)
    )
    before = Counter(keys.slice(0, half)["key"].to_pylist())
    for k, c, v in rows:  # a key's count c is from the first half iff c <= its count there
        assert v == (1 if c <= before[k] else 2), (k, c, v, before[k])
    assert sorted((k, c) for k, c, _ in rows) == _oracle()
    assert chain.instances[1].step.fn is new_step.fn
