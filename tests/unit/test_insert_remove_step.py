"""Inserting a stateless step between two running ones and removing it again, on operator
instances under plain asyncio (no Ray): what the controller's ``insert`` / ``remove`` do, played
by the test.

source -> count -> sink. While the paced source runs, a filter that drops even keys goes in
between source and count at one ``rewire`` barrier and comes out at a second one. Checked against
a ``collections.Counter`` over the generator's rows and the source's offsets at the two barriers:
the events dropped are exactly the even-key events between the two barriers; every other event is
counted exactly once, and per key the counts rise in the order the sink received them.
"""

from __future__ import annotations

import asyncio
import collections
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

import raystream as rs
from raystream.dataflow import KeySpec, Step
from raystream.plan import physical_plan
from raystream.runtime.instance import InstanceSpec, OperatorInstance, OutputSpec, RuntimeConfig
from raystream.runtime.messages import Barrier, ChannelId

EVENTS = 12_000  # 1.2 s at 10k/s: the two barriers go in 0.1 s of stream apart
SOURCE, COUNT, SINK, FILTER = ("source", 0), ("count", 0), ("out", 0), ("drop_even", 0)
FINISH_S = 30.0


@rs.keyed_batches(name="count", state=rs.ValueState(int, default=0))
def count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


def drop_even(record: dict[str, Any]) -> bool:
    return bool(record["key"] % 2)


async def _emitted(source: OperatorInstance, rows: int) -> None:
    """Until the source sent ``rows`` (the barriers go in at points of the stream, not after
    fixed sleeps a slow machine could stretch past its end)."""
    deadline = time.monotonic() + FINISH_S
    while source.rows_emitted < rows:
        assert time.monotonic() < deadline, f"the source sent {source.rows_emitted} rows"
        await asyncio.sleep(0.002)


def _generator() -> Any:
    return rs.sources.generator(events=EVENTS, keys=200, zipf=1.1, seed=3, rate_eps=10_000.0)


async def _insert_then_remove(state_dir: Path) -> tuple[OperatorInstance, dict[int, int]]:
    flow = rs.Dataflow("rewire", num_key_groups=16, sub_groups=4)
    flow.source(_generator()).key_by("key").apply(count).sink(rs.sinks.collect(), name="out")
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
    await _emitted(insts[SOURCE], 1_000)

    # insert: the filter's instance, wired to count; the source's output to count is replaced
    to_count = plan.instances[SOURCE].outputs[0]
    step = Step("drop_even", "filter", drop_even, ("source",), parallelism=1)
    spec = InstanceSpec(
        job="rewire",
        step=step,
        index=0,
        key_space=flow.key_space,
        inputs=(SOURCE,),
        outputs=(to_count,),
        config=config,
        origin_ns=plan.instances[SOURCE].origin_ns,
    )
    add(FILTER, OperatorInstance(spec))
    await insts[COUNT].add_inputs([FILTER])
    await insts[SOURCE].add_receivers([FILTER])
    runs.append(asyncio.ensure_future(insts[FILTER].run()))
    to_filter = OutputSpec("drop_even", 1, "forward")
    insert = {"step": "source", "replaces": "count", "output": to_filter, "aligned": True}
    assert insts[SOURCE].inject_barrier(Barrier(1, "rewire", insert))
    await _emitted(insts[SOURCE], insts[SOURCE].rows_emitted + 1_000)  # through the filter
    assert insts[SOURCE].rows_emitted < EVENTS - 1_000, "the input nearly ended before the remove"

    # remove: the source sends to count again (its old input reopens), the filter ends
    assert to_count.key == KeySpec(column="key")
    await insts[COUNT].add_inputs([SOURCE])
    remove = {"step": "source", "replaces": "drop_even", "output": to_count, "aligned": True}
    assert insts[SOURCE].inject_barrier(Barrier(2, "rewire", remove))

    done, pending = await asyncio.wait(runs, timeout=FINISH_S)
    for t in pending:
        t.cancel()
    assert not pending, "the job did not finish"
    errors = {iid: i.error for iid, i in insts.items() if i.error}
    assert not errors, errors
    return insts[SINK], offsets


def test_inserted_filter_drops_exactly_the_events_between_its_two_barriers(
    tmp_path: Path,
) -> None:
    sink, offsets = asyncio.run(_insert_then_remove(tmp_path))
    start, end = offsets[1], offsets[2]
    assert 0 < start < end < EVENTS, offsets
    keys = _generator().generate_all().column("key").to_pylist()
    kept = [k for i, k in enumerate(keys) if not (start <= i < end and k % 2 == 0)]
    expected = collections.Counter(kept)
    assert len(kept) < EVENTS, "the filter dropped nothing"

    out = sink.result
    assert isinstance(out, pa.Table)
    last: dict[int, int] = {}
    for k, c in zip(out.column("key").to_pylist(), out.column("count").to_pylist(), strict=True):
        assert c > last.get(k, 0), f"key {k}: count {c} after {last.get(k)}"
        last[k] = c
    assert last == dict(expected)


# ---- refusals before anything changes (the controller's checks, on a plain graph) ------------


def _controller_like() -> Any:
    from types import SimpleNamespace

    flow = rs.Dataflow("graph")
    a = flow.source(_generator(), name="a")
    b = flow.source(_generator(), name="b")
    keyed = a.union(b).key_by("key").apply(count)
    keyed.apply(rs.map(lambda r: r, name="tidy")).sink(rs.sinks.collect(), name="out")
    keyed.sink(rs.sinks.collect(), name="raw")
    return SimpleNamespace(
        plan=SimpleNamespace(steps=flow.with_parallelism(None)),
        flow=flow,
        config=RuntimeConfig(migration_support=False),
    )


@rs.filter
def keep_all(record: dict[str, Any]) -> bool:
    return True


def test_insert_and_remove_refuse_what_they_cannot_do() -> None:
    import pytest

    from raystream.rewiring import Rewiring

    ctl = _controller_like()

    def refused(call: Any, match: str) -> None:
        with pytest.raises(rs.ReconfigurationError, match=match):
            asyncio.run(call)

    refused(Rewiring.insert(ctl, "out", keep_all), "after 'out': it is a sink")
    refused(Rewiring.insert(ctl, "nope", keep_all), "after 'nope': no such step")
    refused(Rewiring.insert(ctl, "count", keep_all), r"feeds \['tidy', 'raw'\]; pass before=")
    refused(Rewiring.insert(ctl, "a", keep_all), r"'count' reads \['a', 'b'\]")
    refused(Rewiring.insert(ctl, "count", count, before="raw"), "needs key_by=")
    refused(Rewiring.insert(ctl, "count", keep_all, before="raw", key_by="key"), "stateless")
    refused(
        Rewiring.insert(ctl, "count", count, name="again", before="raw", key_by="key"),
        "migration_support=False",
    )
    groups = ctl.flow.key_space.num_key_groups
    refused(
        Rewiring.insert(ctl, "count", count, "c2", groups + 1, "raw", "key"),
        f"at most {groups} instances",
    )
    refused(Rewiring.insert(ctl, "count", keep_all, name="out", before="raw"), "new name")
    refused(Rewiring.insert(ctl, "count", keep_all, parallelism=0, before="raw"), "int >= 1")
    refused(Rewiring.remove(ctl, "count"), "keyed_batches step with state per key; say what")
    refused(Rewiring.remove(ctl, "count", state="drop"), r"it reads \['a', 'b'\]")
    refused(Rewiring.remove(ctl, "tidy", state="drop"), "keeps no state; leave state= out")
    refused(Rewiring.remove(ctl, "out"), "it is a sink step")
    refused(Rewiring.remove(ctl, "a"), "it is a source step")
    refused(Rewiring.remove(ctl, "nope"), "no such step")
