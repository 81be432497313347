"""Timers in RocksDB (no Ray): layout, index, firing order, moving with a sub-group."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import raystream as rs
from raystream.dataflow import Dataflow
from raystream.keys import KeySpace
from raystream.runtime.processors import KeyedProcessor
from raystream.runtime.timers import EVENT_TIMERS, PROCESSING_TIMERS, encode_timers
from raystream.runtime.watermarks import WATERMARK_MAX
from raystream.state.handles import KeySet
from raystream.state.layout import encode_keys, sub_group_bounds

WINDOW = 10


def fire(timers: rs.FiredTimers, state: Any) -> pa.RecordBatch:
    sums = state.get(timers.keyset)
    out = []
    for i, ts in enumerate(timers.timestamps.tolist()):
        out.append(sums[i].pop(ts + 1))
    state.put(timers.keyset, sums)
    return timers.output({"sum": out, "watermark": [timers.watermark] * len(out)})


@rs.keyed_batches(state=rs.ValueState(object), on_timer=fire)
def window_sum(batch: rs.KeyedBatch, state: Any) -> None:
    """Tumbling event-time windows of WINDOW ms: sum of ``v`` per key and window."""
    sums = state.get(batch.keys)
    et = batch.records.column("event_time").to_numpy()
    v = batch.records.column("v").to_numpy()
    idx = batch.key_index()
    ends = et // WINDOW * WINDOW + WINDOW
    late = ends - 1 <= batch.watermark
    for i, e, x in zip(idx[~late].tolist(), ends[~late].tolist(), v[~late].tolist(), strict=True):
        d = sums[i] if sums[i] is not None else {}
        sums[i] = d
        d[e] = d.get(e, 0) + x
    state.put(batch.keys, [d if d is not None else {} for d in sums])
    pairs = np.unique(np.stack([idx[~late], ends[~late] - 1]), axis=1)
    batch.timers.register_at(pairs[0], pairs[1])


def _processor(tmp: Path, op: Any, name: str = "w", owned: Any = None) -> KeyedProcessor:
    flow = Dataflow("t", num_key_groups=8, sub_groups=4)
    flow.source(rs.sources.from_table(pa.table({"k": [1]}))).key_by("k").apply(op, name=name)
    step = flow.steps[name]
    owned = range(8) if owned is None else owned
    return KeyedProcessor(step, flow.key_space, tmp / name, owned)


def _events(n: int, keys: int, seed: int, key_type: str = "int") -> pa.Table:
    rng = np.random.default_rng(seed)
    et = np.sort(rng.integers(10, 500, n))
    et = et + rng.integers(-5, 6, n)  # out of order by at most 10
    k = rng.integers(0, keys, n)
    key: Any = k if key_type == "int" else np.array([f"k{x}" for x in k], object)
    return pa.table({"k": key, "v": rng.integers(1, 100, n), "event_time": et})


@pytest.mark.parametrize("key_type", ["int", "str"])
def test_window_sums_fire_once_in_order_and_match_an_oracle(tmp_path: Path, key_type: str) -> None:
    proc = _processor(tmp_path, window_sum)
    events = _events(4000, 37, seed=1, key_type=key_type)
    outs: list[pa.RecordBatch] = []
    for b in events.to_batches(max_chunksize=300):
        outs += proc.process(b)
        wm = int(b.column("event_time").to_numpy().max()) - 11  # out of order by <= 10
        fired = proc.on_watermark(wm)
        for f in fired:  # everything fired is due, and was registered
            assert (f.column("event_time").to_numpy() <= wm).all()
        outs += fired
    outs += proc.on_watermark(WATERMARK_MAX)
    out = pa.Table.from_batches(outs)
    # oracle: plain dict over all events (none is late: the watermark lags by the bound)
    expected: dict[tuple[Any, int], int] = defaultdict(int)
    for k, v, t in zip(*(events[c].to_pylist() for c in ("k", "v", "event_time")), strict=True):
        expected[(k, t // WINDOW * WINDOW + WINDOW - 1)] += v
    got = list(zip(out["k"].to_pylist(), out["event_time"].to_pylist(), strict=True))
    assert len(got) == len(set(got)), "a timer fired twice"
    assert dict(zip(got, out["sum"].to_pylist(), strict=True)) == expected
    # per key, timers fire in timestamp order
    per_key: dict[Any, list[int]] = defaultdict(list)
    for k, t in got:
        per_key[k].append(t)
    assert all(ts == sorted(ts) for ts in per_key.values())
    assert proc.timers.next_due(EVENT_TIMERS) is None
    proc.close()


def test_timer_key_layout_sits_under_the_keys_prefix() -> None:
    ks = KeySpace(8, 4)
    keys = KeySet.of(pa.array([5, -3], pa.int64()), ks)
    enc = encode_timers(keys.key_group, keys.sub_group, EVENT_TIMERS, keys.keys, np.array([7, -1]))
    plain = encode_keys(keys.key_group, keys.sub_group, EVENT_TIMERS, keys.keys)
    for e, p, kg, sg in zip(enc, plain, keys.key_group, keys.sub_group, strict=True):
        lo, hi = sub_group_bounds(int(kg), int(sg))
        assert lo <= e < hi
        assert e[:4] == p[:4] and e[12:] == p[4:]
    # big-endian with the sign flipped: byte order is time order
    t = [encode_timers(keys.key_group[:1], keys.sub_group[:1], 254, keys.keys[:1], np.array([x]))[0]
         for x in (-5, 0, 3, 1 << 40)]
    assert t == sorted(t)


def test_registered_at_or_before_the_watermark_fires_at_the_next_advance(tmp_path: Path) -> None:
    proc = _processor(tmp_path, window_sum)
    proc.on_watermark(100)
    b = pa.record_batch({"k": [1], "v": [5], "event_time": [95]})  # late for the step itself
    assert proc.process(b) == []
    ks = KeySet.of(pa.array([1, 2], pa.int64()), proc.key_space)
    proc.states.vectorised().put(ks, [{51: 1}, {61: 2}])
    proc.timers.register(EVENT_TIMERS, ks, np.array([50, 60]))
    out = pa.Table.from_batches(proc.on_watermark(101))
    assert sorted(zip(out["k"].to_pylist(), out["sum"].to_pylist())) == [(1, 1), (2, 2)]
    proc.close()


def test_deleted_timers_do_not_fire_and_negative_means_none(tmp_path: Path) -> None:
    calls: list[list[int]] = []

    def on(timers: rs.FiredTimers) -> None:
        calls.append(sorted(timers.keys.to_pylist()))

    @rs.keyed_batches(on_timer=on)
    def reg(batch: rs.KeyedBatch) -> None:
        k = batch.keys.keys.to_numpy()
        batch.timers.register(np.where(k % 2 == 0, 10, -1))  # odd keys: no timer
        batch.timers.delete_at(np.flatnonzero(k == 4), 10)

    proc = _processor(tmp_path, reg, "reg")
    proc.process(pa.record_batch({"k": pa.array(range(8), pa.int64())}))
    proc.on_watermark(WATERMARK_MAX)
    assert calls == [[0, 2, 6]]
    proc.close()


def test_several_timers_of_one_key_fire_in_separate_calls_in_time_order(tmp_path: Path) -> None:
    calls: list[tuple[list[int], list[int]]] = []

    def on(timers: rs.FiredTimers) -> None:
        calls.append((timers.keys.to_pylist(), timers.timestamps.tolist()))
        if 30 in timers.timestamps.tolist():
            timers.timers.register_at(np.flatnonzero(timers.timestamps == 30), 35)

    @rs.keyed_batches(on_timer=on)
    def reg(batch: rs.KeyedBatch) -> None:
        batch.timers.register(np.array([30, 20]))
        batch.timers.register(np.array([10, 40]))

    proc = _processor(tmp_path, reg, "reg")
    proc.process(pa.record_batch({"k": pa.array([1, 2], pa.int64())}))
    proc.on_watermark(100)
    fired = [(k, t) for keys, ts in calls for k, t in zip(keys, ts, strict=True)]
    assert sorted(fired) == [(1, 10), (1, 30), (1, 35), (2, 20), (2, 40)]
    for keys, _ in calls:
        assert len(keys) == len(set(keys))
    order = {k: [t for kk, t in fired if kk == k] for k in (1, 2)}
    assert order == {1: [10, 30, 35], 2: [20, 40]}
    proc.close()


def test_timers_move_with_their_sub_group(tmp_path: Path) -> None:
    """Export a sub-group's range from one instance into another: its timers fire there only."""
    a = _processor(tmp_path / "a", window_sum)
    b = _processor(tmp_path / "b", window_sum, owned=[])
    events = _events(2000, 50, seed=5)
    outs = a.process(events.to_batches()[0])
    ks = a.key_space
    keys = pa.array(sorted(set(events["k"].to_pylist())), pa.int64())
    kg, sg = ks.locate(keys)
    g = int(kg[0]) * ks.sub_groups + int(sg[0])
    moving = [k for k, x, y in zip(keys.to_pylist(), kg, sg, strict=True) if x * ks.sub_groups + y == g]
    # move g: what the migration engine does (export, drop, held flags)
    chunk = a.backend.export_sub_group(g // ks.sub_groups, g % ks.sub_groups)
    a.backend.drop_sub_group(g // ks.sub_groups, g % ks.sub_groups)
    a.engine.held[g] = False
    b.backend.import_chunk(chunk)
    b.engine.held[g] = True
    outs_a = pa.Table.from_batches(a.on_watermark(WATERMARK_MAX) + outs)
    outs_b = pa.Table.from_batches(b.on_watermark(WATERMARK_MAX))
    assert set(outs_b["k"].to_pylist()) == set(moving) and moving
    assert not set(outs_a["k"].to_pylist()) & set(moving)
    both = pa.concat_tables([outs_a.select(["k", "sum"]), outs_b.select(["k", "sum"])])
    total = defaultdict(int)
    for k, s in zip(both["k"].to_pylist(), both["sum"].to_pylist(), strict=True):
        total[k] += s
    expected = defaultdict(int)
    for k, v in zip(events["k"].to_pylist(), events["v"].to_pylist(), strict=True):
        expected[k] += v
    assert total == expected
    a.close()
    b.close()


def test_outgoing_sub_groups_do_not_fire_while_a_rescale_hands_them_out(tmp_path: Path) -> None:
    from raystream.rescale import FetchPolicy
    from raystream.runtime.migration import MigrationTask

    proc = _processor(tmp_path, window_sum)
    proc.process(_events(500, 20, seed=2).to_batches()[0])
    held = np.flatnonzero(proc.engine.held)
    task = MigrationTask(1, FetchPolicy(), incoming={}, outgoing=set(held.tolist()))
    proc.engine.prepare(task)
    task.active = True
    assert proc.on_watermark(WATERMARK_MAX - 1) == []
    assert proc.timers.next_due(EVENT_TIMERS) is None
    proc.close()


def test_processing_time_timers(tmp_path: Path) -> None:
    seen: list[tuple[str, list[int]]] = []

    def on(timers: rs.FiredTimers) -> None:
        seen.append((timers.domain, timers.keys.to_pylist()))

    @rs.keyed_batches(on_timer=on)
    def reg(batch: rs.KeyedBatch) -> None:
        batch.timers.register_processing(np.array([1_000, 5_000]))

    proc = _processor(tmp_path, reg, "reg")
    proc.process(pa.record_batch({"k": pa.array([1, 2], pa.int64())}))
    assert proc.next_processing_ms() == 1_000
    assert proc.timers.next_due(PROCESSING_TIMERS) == 1_000
    proc.fire_processing(2_000)
    assert seen == [("processing", [1])]
    assert proc.on_watermark(WATERMARK_MAX) == []  # event-time firing leaves them alone
    assert proc.next_processing_ms() == 5_000
    proc.close()


def test_timer_index_is_rebuilt_after_reopening(tmp_path: Path) -> None:
    proc = _processor(tmp_path, window_sum)
    proc.process(_events(300, 10, seed=4).to_batches()[0])
    first = proc.timers.next_due(EVENT_TIMERS)
    proc.close()
    again = _processor(tmp_path, window_sum)
    assert first is not None and again.timers.next_due(EVENT_TIMERS) == first
    again.close()


def test_timers_need_on_timer_and_int_timestamps(tmp_path: Path) -> None:
    @rs.keyed_batches
    def no_timer(batch: rs.KeyedBatch) -> None:
        batch.timers.register(5)

    proc = _processor(tmp_path, no_timer, "nt")
    with pytest.raises(rs.StateError, match="on_timer"):
        proc.process(pa.record_batch({"k": pa.array([1], pa.int64())}))
    proc.close()

    @rs.keyed_batches(on_timer=lambda t: None)
    def bad(batch: rs.KeyedBatch) -> None:
        batch.timers.register(np.array([1.5]))

    proc = _processor(tmp_path, bad, "bad")
    with pytest.raises(rs.SchemaError, match="int64"):
        proc.process(pa.record_batch({"k": pa.array([1], pa.int64())}))
    proc.close()
    with pytest.raises(rs.DataflowDefinitionError, match="on_timer"):
        rs.keyed(on_timer=lambda t: None)(lambda k, r: ())
    with pytest.raises(rs.DataflowDefinitionError, match="on_timer"):
        rs.keyed_batches(state=rs.ValueState(int), on_timer=lambda t: None)(lambda b, s: None)
