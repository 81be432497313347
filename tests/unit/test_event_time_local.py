"""Event time end to end in one asyncio loop (real instances, channels, RocksDB; no Ray)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pytest

import raystream as rs
from raystream.runtime.instance import RuntimeConfig
from raystream.runtime.local import run_local
from raystream.runtime.watermarks import WATERMARK_MAX

WINDOW_MS = 100
BOUND_MS = 50


def fire(timers: rs.FiredTimers, state: Any) -> pa.RecordBatch:
    sums = state.get(timers.keyset)
    out = [sums[i].pop(int(t) + 1) for i, t in enumerate(timers.timestamps)]
    state.put(timers.keyset, sums)
    return timers.output(
        {"window_end": timers.timestamps + 1, "sum": out, "fired_at": [timers.watermark] * len(out)}
    )


@rs.keyed_batches(state=rs.ValueState(object), on_timer=fire)
def window_sum(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch | None:
    """Tumbling windows; late records (window already fired) go out as rows with late=True."""
    sums = state.get(batch.keys)
    et = batch.records.column("event_time").to_numpy()
    v = batch.records.column("v").to_numpy()
    idx = batch.key_index()
    ends = et // WINDOW_MS * WINDOW_MS + WINDOW_MS
    late = ends - 1 <= batch.watermark
    for i, e, x in zip(idx[~late].tolist(), ends[~late].tolist(), v[~late].tolist(), strict=True):
        d = sums[i] if sums[i] is not None else {}
        sums[i] = d
        d[e] = d.get(e, 0) + x
    state.put(batch.keys, [d if d is not None else {} for d in sums])
    pairs = np.unique(np.stack([idx[~late], ends[~late] - 1]), axis=1)
    batch.timers.register_at(pairs[0], pairs[1])
    return None


def _events(n: int, keys: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    base = np.sort(rng.integers(1_000, 20_000, n))
    ts = base + rng.integers(0, BOUND_MS // 2, n)  # out of order by less than BOUND_MS
    return pa.table(
        {
            "key": rng.integers(0, keys, n),
            "v": rng.integers(1, 10, n),
            "ts": pa.array(ts * 1000, pa.timestamp("us")),
        }
    )


def _oracle_windows(events: pa.Table) -> dict[tuple[int, int], int]:
    con = duckdb.connect()
    con.register("e", events)
    rows = con.execute(
        f"""SELECT key, (epoch_ms(ts) // {WINDOW_MS}) * {WINDOW_MS} + {WINDOW_MS} AS w, sum(v)
            FROM e GROUP BY key, w"""
    ).fetchall()
    con.close()
    return {(int(k), int(w)): int(s) for k, w, s in rows}


def test_windows_fire_on_watermarks_mid_stream_and_match_duckdb(tmp_path: Path) -> None:
    events = _events(20_000, 40, seed=1)
    flow = rs.Dataflow("et-local", num_key_groups=16, sub_groups=4)
    (
        flow.source(
            rs.sources.from_table(events), event_time="ts", max_out_of_orderness_ms=BOUND_MS
        )
        .key_by("key")
        .apply(window_sum)
        .sink(rs.sinks.collect(), name="out")
    )
    cfg = RuntimeConfig(source_batch_rows=500, batch_rows=200, linger_ms=1)
    out = asyncio.run(
        run_local(flow, {"source": 2, "window_sum": 3}, state_dir=tmp_path, config=cfg)
    )["out"]
    assert out is not None
    got = dict(
        zip(
            zip(out["key"].to_pylist(), out["window_end"].to_pylist(), strict=True),
            out["sum"].to_pylist(),
            strict=True,
        )
    )
    assert len(got) == out.num_rows, "a window fired twice"
    assert got == _oracle_windows(events)
    fired_at = out["fired_at"].to_numpy()
    assert (fired_at >= out["window_end"].to_numpy() - 1).all(), "fired before its watermark"
    assert (fired_at < WATERMARK_MAX).mean() > 0.9, "windows fired at watermarks, not at the end"


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


def test_union_of_two_sources(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    a = pa.table({"key": rng.integers(0, 30, 3000), "x": rng.integers(0, 5, 3000)})
    b = pa.table({"key": rng.integers(10, 50, 2000), "x": rng.integers(0, 5, 2000)})
    flow = rs.Dataflow("union-local", num_key_groups=16, sub_groups=4)
    sa = flow.source(rs.sources.from_table(a), name="a")
    sb = flow.source(rs.sources.from_table(b), name="b")
    sa.union(sb).key_by("key").apply(count).sink(rs.sinks.collect(), name="out")
    cfg = RuntimeConfig(source_batch_rows=300)
    out = asyncio.run(run_local(flow, {"a": 2, "count": 2}, state_dir=tmp_path, config=cfg))["out"]
    last: dict[int, int] = {}
    for k, c in zip(out["key"].to_pylist(), out["count"].to_pylist(), strict=True):
        last[k] = max(last.get(k, 0), c)
    keys = np.concatenate([a["key"].to_numpy(), b["key"].to_numpy()])
    uk, n = np.unique(keys, return_counts=True)
    assert last == dict(zip(uk.tolist(), n.tolist(), strict=True))


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def balance(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    col = "amount" if batch.input == 0 else "paid"
    assert col in batch.records.schema.names, "batches of the two inputs were mixed"
    sign = 1 if batch.input == 0 else -1
    new = state.get(batch.keys) + sign * batch.reduce(col, "sum")
    state.put(batch.keys, new)
    return batch.output({"balance": new})


def test_connect_two_keyed_streams_shares_state(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    dep = pa.table({"account": rng.integers(0, 25, 4000), "amount": rng.integers(1, 100, 4000)})
    pay = pa.table(
        {"acct": rng.integers(0, 25, 3000), "paid": rng.integers(1, 50, 3000), "note": ["p"] * 3000}
    )
    flow = rs.Dataflow("connect-local", num_key_groups=16, sub_groups=4)
    d = flow.source(rs.sources.from_table(dep), name="deposits").key_by("account")
    p = flow.source(rs.sources.from_table(pay), name="payments").key_by("acct")
    d.connect(p).apply(balance).sink(rs.sinks.collect(), name="out")
    cfg = RuntimeConfig(source_batch_rows=250)
    out = asyncio.run(
        run_local(flow, {"deposits": 2, "balance": 3}, state_dir=tmp_path, config=cfg)
    )["out"]
    con = duckdb.connect()
    con.register("dep", dep)
    con.register("pay", pay)
    expected = dict(
        con.execute(
            """SELECT k, sum(x) FROM (SELECT account AS k, amount AS x FROM dep
                                      UNION ALL SELECT acct, -paid FROM pay) GROUP BY k"""
        ).fetchall()
    )
    # the last balance per account: per account, rows arrive in processing order at one sink
    final: dict[int, int] = {}
    for k, v in zip(out["account"].to_pylist(), out["balance"].to_pylist(), strict=True):
        final[k] = v
    assert final == {int(k): int(v) for k, v in expected.items()}


def test_union_and_connect_are_checked_at_definition() -> None:
    flow = rs.Dataflow("defs")
    a = flow.source(rs.sources.from_table(pa.table({"k": [1], "x": [1.0]})), name="a")
    b = flow.source(rs.sources.from_table(pa.table({"k": [1], "x": [1]})), name="b")
    c = flow.source(rs.sources.from_table(pa.table({"k": ["s"], "y": [1]})), name="c")
    with pytest.raises(rs.DataflowDefinitionError, match=r"x: double vs int64"):
        a.union(b)
    with pytest.raises(rs.DataflowDefinitionError, match="only the second has"):
        a.union(c)
    with pytest.raises(rs.DataflowDefinitionError, match="twice"):
        a.union(a)
    with pytest.raises(rs.DataflowDefinitionError, match="one type"):
        a.key_by("k").connect(c.key_by("k"))
    with pytest.raises(rs.DataflowDefinitionError, match="not keyed"):
        a.key_by("k").connect(b)
    with pytest.raises(rs.DataflowDefinitionError, match="feed both sides"):
        a.key_by("k").connect(a.key_by("x"))
    cs = a.key_by("k").connect(b.key_by("k"))
    with pytest.raises(rs.DataflowDefinitionError, match="keyed operator"):
        cs.apply(rs.map(lambda r: r))
    s = cs.apply(count)
    step = flow.steps["count"]
    assert step.upstream == ("a", "b") and step.inputs == (0, 1)
    assert [step.key_for(u).column for u in step.upstream] == ["k", "k"]
    assert s.step == "count"


class _TimedReader:
    """A pushed-style reader: ``plan`` is a list of (delay_s, batch or None); empty batches while
    it waits, None at the end."""

    def __init__(self, plan: list[tuple[float, pa.RecordBatch | None]]) -> None:
        self.plan = list(plan)
        self.due = None

    async def aread(self, max_rows: int, timeout_s: float) -> pa.RecordBatch | None:
        import time as _time

        if not self.plan:
            return None
        delay, batch = self.plan[0]
        if self.due is None:
            self.due = _time.monotonic() + delay
        if _time.monotonic() < self.due:
            await asyncio.sleep(min(timeout_s, self.due - _time.monotonic()))
            return _rows(0, 0)
        self.plan.pop(0)
        self.due = None
        return batch

    def close(self) -> None:
        pass


class _TimedSource:
    def __init__(self, plans: list[list[tuple[float, pa.RecordBatch | None]]]) -> None:
        self.plans = plans

    def schema(self) -> pa.Schema:
        return pa.schema([("key", pa.int64()), ("v", pa.int64()), ("t", pa.int64())])

    def open(self, index: int, parallelism: int) -> _TimedReader:
        return _TimedReader(self.plans[index])

    def describe(self) -> str:
        return "timed"


def _rows(t0: int, t1: int) -> pa.RecordBatch:
    t = np.arange(t0, t1, 10, dtype=np.int64)
    return pa.record_batch({"key": t % 3, "v": np.ones(len(t), np.int64), "t": t})


@pytest.mark.parametrize(("idle_ms", "via_map"), [(None, False), (100, False), (100, True)])
def test_an_idle_source_instance_does_not_hold_the_watermark_back(
    tmp_path: Path, idle_ms: float | None, via_map: bool
) -> None:
    """Instance 1 sends a little, then nothing for 1.5 s; instance 0 keeps going. With idleness
    windows fire while instance 1 is quiet; without, they wait for it. ``via_map``: a map step
    (forward, one instance per source instance) passes the idleness on."""
    busy = [(0.02, _rows(1_000 + 1_000 * i, 2_000 + 1_000 * i)) for i in range(20)]
    quiet = [(0.0, _rows(1_000, 1_100)), (1.5, _rows(1_100, 1_200)), (0.0, None)]
    flow = rs.Dataflow(f"idle-{idle_ms}-{via_map}", num_key_groups=8, sub_groups=2)
    stream = flow.source(_TimedSource([busy, quiet]), event_time="t", watermark_idle_ms=idle_ms)
    if via_map:
        stream = stream.map_batches(lambda b: b, name="same")
    stream.key_by("key").apply(window_sum).sink(rs.sinks.collect(), name="out")
    cfg = RuntimeConfig(linger_ms=1)
    par = {"source": 2, "same": 2} if via_map else {"source": 2}
    out = asyncio.run(run_local(flow, par, state_dir=tmp_path, config=cfg))["out"]
    fired_at = out["fired_at"].to_numpy()
    early = fired_at < WATERMARK_MAX
    if idle_ms is None:
        # instance 1's watermark stays at ~1190 until its end: windows ending later wait
        assert (out["window_end"].to_numpy()[early] <= 1_200).all()
        assert (~early).sum() > 100
    else:
        assert early.sum() > 100, "windows fired while instance 1 was idle"
    total = defaultdict(int)
    for k, s in zip(out["key"].to_pylist(), out["sum"].to_pylist(), strict=True):
        total[k] += s
    # without idleness nothing is late (instance 1 held the watermark back); with it, instance
    # 1's rows after its pause are normally behind the watermark (late) and dropped by
    # window_sum: only they may be missing
    parts = [np.arange(1_000 + 1_000 * i, 2_000 + 1_000 * i, 10) for i in range(20)]
    expected = {}
    for last in (1_200, 1_100):
        uk, n = np.unique(
            np.concatenate([*parts, np.arange(1_000, last, 10)]) % 3, return_counts=True
        )
        expected[last] = dict(zip(uk.tolist(), n.tolist(), strict=True))
    if idle_ms is None:
        assert dict(total) == expected[1_200]
    else:
        assert dict(total) in (expected[1_200], expected[1_100])


@rs.keyed_batches(state=rs.ValueState(object), on_timer=fire)
def window_sum_late(batch: rs.KeyedBatch, state: Any) -> rs.Outputs:
    """window_sum, with late records (their window fired already) to side output ``late``."""
    et = batch.records.column("event_time").to_numpy()
    late = et // WINDOW_MS * WINDOW_MS + WINDOW_MS - 1 <= batch.watermark
    window_sum.fn(batch, state)
    return rs.Outputs(main=None, late=batch.records.filter(pa.array(late)))


def test_late_records_go_to_a_side_output(tmp_path: Path) -> None:
    """One source instance: rows at 1000..1990, rows at 5000..5990 (the watermark after them,
    5989, goes on the same channel first), then rows at 1100..1190: those are late."""
    parts = [_rows(1_000, 2_000), _rows(5_000, 6_000), _rows(1_100, 1_200)]
    flow = rs.Dataflow("late-side", num_key_groups=8, sub_groups=2)
    windows = (
        flow.source(rs.sources.from_table(parts), event_time="t")
        .key_by("key")
        .apply(window_sum_late)
    )
    windows.sink(rs.sinks.collect(), name="out")
    windows.side_output("late").sink(rs.sinks.collect(), name="late")
    cfg = RuntimeConfig(source_batch_rows=100, linger_ms=1)
    out = asyncio.run(run_local(flow, state_dir=tmp_path, config=cfg))
    late = out["late"]
    assert late is not None and sorted(late["t"].to_pylist()) == list(range(1_100, 1_200, 10))
    assert "late" not in (out["out"].schema.metadata or {})
    assert sum(out["out"]["sum"].to_pylist()) == 200  # every on-time row in its window


def test_map_batches_side_output_and_definition_checks(tmp_path: Path) -> None:
    @rs.map_batches
    def split(batch: pa.RecordBatch) -> rs.Outputs:
        even = pa.array(batch.column("x").to_numpy() % 2 == 0)
        return rs.Outputs(main=batch.filter(even), odd=batch.filter(pa.compute.invert(even)))

    flow = rs.Dataflow("side-map")
    src = flow.source(rs.sources.from_table(pa.table({"x": list(range(100))})))
    s = src.apply(split)
    s.sink(rs.sinks.collect(), name="even")
    s.side_output("odd").sink(rs.sinks.collect(), name="odd")
    with pytest.raises(rs.DataflowDefinitionError, match="one operator step"):
        src.side_output("odd")
    with pytest.raises(rs.DataflowDefinitionError, match="identifier"):
        s.side_output("main")
    out = asyncio.run(run_local(flow, state_dir=tmp_path))
    assert sorted(out["even"]["x"].to_pylist()) == list(range(0, 100, 2))
    assert sorted(out["odd"]["x"].to_pylist()) == list(range(1, 100, 2))


def test_a_scale_out_sends_the_current_watermark_to_new_receivers(tmp_path: Path) -> None:
    """The upstream side of a rescale: channels to added instances start with the watermark
    the sender forwarded last, so a new instance catches up; old channels get no repeat."""
    from raystream.keys import RoutingTable
    from raystream.plan import physical_plan
    from raystream.runtime.instance import OperatorInstance
    from raystream.runtime.messages import Barrier, Watermark

    flow = rs.Dataflow("wm-rescale", num_key_groups=8, sub_groups=2)
    events = pa.table({"key": [1], "t": [5]})
    (
        flow.source(rs.sources.from_table(events), event_time="t")
        .key_by("key")
        .apply(count)
        .sink(rs.sinks.collect())
    )
    plan = physical_plan(flow, {"count": 2}, RuntimeConfig(), 0, tmp_path)
    src = OperatorInstance(plan.instances[("source", 0)])
    sent: list[tuple[Any, Any]] = []

    def sender(receiver: Any, payload: Any) -> Any:
        sent.append((receiver, payload[2]))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    async def go() -> None:
        src.connect(sender, lambda e, i: None)
        await src._send_watermark(Watermark(1_234))
        sent.clear()
        table = RoutingTable(epoch=1, owners=np.arange(8) % 3, parallelism=3)
        await src._switch(Barrier(1, "rescale", {"step": "count", "table": table}))

    asyncio.run(go())
    to_new = [item for r, item in sent if r == ("count", 2)]
    assert to_new[0] == Watermark(1_234) and isinstance(to_new[1], Barrier)
    assert all(not isinstance(item, Watermark) for r, item in sent if r != ("count", 2))


def test_processing_time_timers_fire_on_the_wall_clock_mid_stream(tmp_path: Path) -> None:
    import time as _time

    def on(timers: rs.FiredTimers) -> pa.RecordBatch:
        now = int(_time.time() * 1000)
        return timers.output({"due": timers.timestamps, "now": [now] * len(timers)})

    @rs.keyed_batches(on_timer=on)
    def remind(batch: rs.KeyedBatch) -> None:
        batch.timers.register_processing(int(_time.time() * 1000) + 150)

    # the next batch (and the end) come 1.5 s later: a timer that waited for them would be
    # >= 1.35 s late; the bound leaves a loaded machine 1 s of scheduling delay
    plan = [(0.0, _rows(1_000, 1_030)), (1.5, _rows(2_000, 2_030)), (1.5, None)]
    flow = rs.Dataflow("proc-timers", num_key_groups=8, sub_groups=2)
    flow.source(_TimedSource([plan])).key_by("key").apply(remind).sink(rs.sinks.collect())
    out = asyncio.run(run_local(flow, state_dir=tmp_path, config=RuntimeConfig(linger_ms=1)))
    t = out["sink_0"]
    # both batches' timers (3 keys each) fired, none before its time, none much after it
    assert t.num_rows == 6 and sorted(set(t["key"].to_pylist())) == [0, 1, 2]
    late_ms = t["now"].to_numpy() - t["due"].to_numpy()
    assert (late_ms >= 0).all() and (late_ms < 1_000).all(), late_ms


def test_watermarks_travel_only_where_rows_can(tmp_path: Path) -> None:
    """A forward output (source i -> map i) sends watermarks to its one receiver only, and a
    receiver ignores marks from a channel that is not one of its inputs: otherwise map 1 would
    forward source 0's watermark ahead of source 0's rows, which go through map 0."""
    from raystream.plan import physical_plan
    from raystream.runtime.instance import OperatorInstance
    from raystream.runtime.messages import EndOfStream, Watermark

    flow = rs.Dataflow("wm-forward", num_key_groups=8, sub_groups=2)
    src = flow.source(rs.sources.from_table(pa.table({"key": [1], "t": [5]})), event_time="t")
    src.map_batches(lambda b: b, name="same").sink(rs.sinks.collect())
    plan = physical_plan(flow, {"source": 2, "same": 2}, RuntimeConfig(), 0, tmp_path)
    source0 = OperatorInstance(plan.instances[("source", 0)])
    map1 = OperatorInstance(plan.instances[("same", 1)])
    sent: list[tuple[Any, Any]] = []

    def sender(receiver: Any, payload: Any) -> Any:
        sent.append((receiver, payload[2]))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    async def go() -> None:
        source0.connect(sender, lambda e, i: None)
        await source0._send_watermark(Watermark(500))
        map1.connect(sender, lambda e, i: None)
        await map1.push(("source", 0), 0, Watermark(500))
        await map1.push(("source", 0), 1, EndOfStream())
        await map1.push(("source", 1), 0, EndOfStream())
        await map1._run_receiver()

    asyncio.run(go())
    assert [r for r, item in sent if isinstance(item, Watermark)][0] == ("same", 0)
    assert ("same", 1) not in [r for r, item in sent if isinstance(item, Watermark)]
    # map 1 saw source 0's mark but only forwarded the end of input (+inf) of its own input
    from_map1 = [item for r, item in sent if isinstance(item, Watermark) and r[0] == "sink_0"]
    assert from_map1 == [Watermark(WATERMARK_MAX)]


def test_run_local_reports_a_failing_step(tmp_path: Path) -> None:
    def boom(record: dict) -> dict:
        raise ValueError("bad record")

    flow = rs.Dataflow("local-fail")
    flow.source(rs.sources.from_table(pa.table({"x": [1, 2]}))).map(boom).sink(rs.sinks.collect())
    with pytest.raises(rs.JobFailedError, match="bad record"):
        asyncio.run(run_local(flow, state_dir=tmp_path, timeout_s=30))
