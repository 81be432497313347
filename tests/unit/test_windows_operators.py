"""The window and join operators on a real keyed processor (RocksDB state, RocksDB timers, no
Ray): batches and watermarks in, rows out, against brute-force Python oracles."""

from __future__ import annotations

import builtins
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import raystream.operators as ops
from raystream.operators import count, joins, windows

import raystream as rs
from raystream.errors import DataflowDefinitionError
from raystream.runtime.outputs import port_of
from raystream.runtime.processors import KeyedProcessor
from raystream.runtime.watermarks import WATERMARK_MAX


def _processor(tmp: Path, op: Any, two_inputs: bool = False) -> KeyedProcessor:
    flow = rs.Dataflow("t", num_key_groups=8, sub_groups=4)
    src = pa.table({"k": [1], "event_time": [0], "x": [0]})
    a = flow.source(rs.sources.from_table(src), name="a").key_by("k")
    if two_inputs:
        b = flow.source(rs.sources.from_table(src), name="b").key_by("k")
        a.connect(b).apply(op, name="op")
    else:
        a.apply(op, name="op")
    return KeyedProcessor(flow.steps["op"], flow.key_space, tmp / "op", range(8))


def _events(seed: int, n: int, keys: int, late_fraction: float = 0.0) -> pa.Table:
    rng = np.random.default_rng(seed)
    clock = np.cumsum(rng.integers(0, 30, n))
    t = clock - rng.integers(0, 200, n)
    far = rng.random(n) < late_fraction
    t = t - far * rng.integers(1000, 3000, n)
    k = rng.integers(0, keys, n)
    return pa.table(
        {
            "k": [f"k{v}" for v in k.tolist()],
            "event_time": t.astype(np.int64),
            "x": rng.integers(-20, 100, n),
            "id": np.arange(n),
        }
    )


def _run(
    proc: KeyedProcessor, table: pa.Table, seed: int, delay: int, inputs: np.ndarray | None = None
) -> tuple[list[pa.RecordBatch], list[Any]]:
    """Feed ``table`` in random-sized batches; after each, watermark = max seen - delay - 1.
    Returns the output batches and the watermark each record saw."""
    rng = np.random.default_rng(seed)
    outs: list[Any] = []
    seen: list[Any] = []
    i = 0
    max_seen = None
    n = table.num_rows
    while i < n:
        m = int(rng.integers(1, 80))
        if inputs is not None:  # a batch holds records of one input
            j = i + 1
            while j < min(n, i + m) and inputs[j] == inputs[i]:
                j += 1
            m = j - i
        chunk = table.slice(i, m).to_batches()[0]
        wm = proc.watermark
        outs += proc.process(chunk, input=None if inputs is None else int(inputs[i]))
        seen += [wm] * chunk.num_rows
        mx = int(np.max(chunk.column("event_time").to_numpy()))
        max_seen = mx if max_seen is None else np.maximum(max_seen, mx)
        new_wm = int(max_seen) - delay - 1
        if new_wm > proc.watermark:
            outs += proc.on_watermark(new_wm)
        i += m
    outs += proc.on_watermark(WATERMARK_MAX)
    return outs, seen


def _main(outs: list[Any]) -> pa.Table:
    main = [b for port, b in map(port_of, outs) if port == ""]
    return pa.Table.from_batches(main) if main else pa.table({})


@pytest.mark.parametrize(("size", "slide"), [(100, 100), (300, 100), (250, 60)])
def test_tumbling_and_sliding_on_the_processor_vs_python(tmp_path: Path, size, slide) -> None:
    table = _events(size + slide, 3000, keys=15)
    agg = [count(), ops.sum("x"), ops.max("x")]
    op = windows.tumbling(size, agg) if size == slide else windows.sliding(size, slide, agg)
    proc = _processor(tmp_path, op)
    outs, _ = _run(proc, table, seed=1, delay=250)  # jitter < delay: no late records
    got = _main(outs).to_pylist()
    exp: dict[tuple[str, int], list[int]] = defaultdict(list)
    for r in table.to_pylist():
        t = r["event_time"]
        for s in range(t - size - slide, t + 1):
            if s % slide == 0 and s <= t < s + size:
                exp[(r["k"], s)].append(r["x"])
    rows = {(r["k"], r["window_start"]): r for r in got}
    assert len(rows) == len(got), "a window fired twice"
    assert set(rows) == set(exp)
    for kw, xs in exp.items():
        r = rows[kw]
        assert (r["count"], r["x_sum"], r["x_max"]) == (len(xs), sum(xs), max(xs)), kw
        assert r["window_end"] == kw[1] + size and r["event_time"] == kw[1] + size - 1
    proc.close()


def test_session_on_the_processor_vs_sorted_scan(tmp_path: Path) -> None:
    table = _events(7, 2500, keys=10)
    gap = 90
    proc = _processor(tmp_path, windows.session(gap, [count(), ops.sum("x")]))
    outs, _ = _run(proc, table, seed=2, delay=250)
    got = {(r["k"], r["window_start"], r["window_end"]): r for r in _main(outs).to_pylist()}
    by_key: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for r in table.to_pylist():
        by_key[r["k"]].append((r["event_time"], r["x"]))
    exp = {}
    for k, items in by_key.items():
        cur = None
        for t, x in sorted(items):
            if cur is not None and t < cur[1]:
                cur = (cur[0], t + gap, [*cur[2], x])
            else:
                if cur is not None:
                    exp[(k, cur[0], cur[1])] = cur[2]
                cur = (t, t + gap, [x])
        exp[(k, cur[0], cur[1])] = cur[2]
    assert set(got) == set(exp)
    for kse, xs in exp.items():
        assert (got[kse]["count"], got[kse]["x_sum"]) == (len(xs), sum(xs))
    proc.close()


def test_late_records_go_to_the_late_side_output(tmp_path: Path) -> None:
    table = _events(3, 3000, keys=8, late_fraction=0.05)
    size = 100
    proc = _processor(tmp_path, windows.tumbling(size, count()))
    outs, seen = _run(proc, table, seed=3, delay=100)
    ported = [port_of(o) for o in outs]
    late_ids = sorted(i for port, b in ported if port == "late" for i in b.column("id").to_pylist())
    main = pa.Table.from_batches([b for port, b in ported if port == ""])
    on_time = table.filter(pa.array(~np.isin(table["id"].to_numpy(), late_ids)))
    per_window = defaultdict(int)
    for r in on_time.to_pylist():
        per_window[(r["k"], r["event_time"] // size * size)] += 1
    got = dict(
        zip(
            zip(main["k"].to_pylist(), main["window_start"].to_pylist(), strict=True),
            main["count"].to_pylist(),
            strict=True,
        )
    )
    assert main.num_rows == len(got), "a window fired twice"
    assert got == per_window, "on-time records are counted, late ones are not"
    exp_late = sorted(
        r["id"]
        for r, wm in zip(table.to_pylist(), seen, strict=True)
        if r["event_time"] // size * size + size - 1 <= wm
    )
    assert exp_late and late_ids == exp_late


def test_interval_join_on_the_processor_vs_nested_loops(tmp_path: Path) -> None:
    n = 1500
    table = _events(11, n, keys=12)
    rng = np.random.default_rng(5)
    inputs = np.repeat(rng.integers(0, 2, n // 10), 10)  # runs of one side
    lower, upper = -40, 25
    proc = _processor(tmp_path, joins.interval_join(lower, upper), two_inputs=True)
    outs, _ = _run(proc, table, seed=4, delay=250, inputs=inputs)
    out = _main(outs)
    got = sorted(zip(out["id_left"].to_pylist(), out["id_right"].to_pylist(), strict=True))
    rows = table.to_pylist()
    left = [r for r, s in zip(rows, inputs, strict=True) if s == 0]
    right = [r for r, s in zip(rows, inputs, strict=True) if s == 1]
    exp = sorted(
        (a["id"], b["id"])
        for a in left
        for b in right
        if a["k"] == b["k"]
        and a["event_time"] + lower <= b["event_time"] <= a["event_time"] + upper
    )
    assert exp and got == exp
    for side in ("left", "right"):
        assert not list(proc.states.iter_values(side, "str")), f"{side} buffers not cleaned"
    proc.close()


def test_definition_errors() -> None:
    with pytest.raises(DataflowDefinitionError, match="size_ms .* > 0, got 0"):
        windows.tumbling(0, count())
    with pytest.raises(DataflowDefinitionError, match="slide 20 > size 10"):
        windows.sliding(10, 20, count())
    with pytest.raises(DataflowDefinitionError, match="slide_ms .* > 0, got -1"):
        windows.sliding(10, -1, count())
    with pytest.raises(DataflowDefinitionError, match="gap_ms .* > 0, got 0"):
        windows.session(0, count())
    with pytest.raises(DataflowDefinitionError, match="allowed_lateness_ms must be an int >= 0"):
        windows.tumbling(10, count(), allowed_lateness_ms=-1)
    with pytest.raises(DataflowDefinitionError, match="lower 5 > upper 1"):
        joins.interval_join(5, 1)
    with pytest.raises(DataflowDefinitionError, match="keep must be 'all' or 'latest'"):
        joins.join(keep="some")


def test_dedupe_on_the_processor_vs_python_rule(tmp_path: Path) -> None:
    """Oracle: per record in arrival order, with the watermark its batch saw: it passes iff its
    key has no entry whose expiry (passed time + within) is after that watermark; in one batch
    only a key's first record can pass."""
    table = _events(12, 3000, keys=40)
    within = 150
    proc = _processor(tmp_path, ops.dedupe(within))
    rng = np.random.default_rng(6)
    sizes = []
    outs: list[Any] = []
    seen: list[Any] = []
    i, max_seen = 0, None
    while i < table.num_rows:  # the same feeding as _run, remembering the batch boundaries
        m = int(rng.integers(1, 80))
        chunk = table.slice(i, m).to_batches()[0]
        seen.append(proc.watermark)
        outs += proc.process(chunk)
        sizes.append(chunk.num_rows)
        mx = int(np.max(chunk.column("event_time").to_numpy()))
        max_seen = mx if max_seen is None else builtins.max(max_seen, mx)
        if max_seen - 251 > proc.watermark:
            outs += proc.on_watermark(max_seen - 251)
        i += chunk.num_rows
    got = sorted(_main(outs)["id"].to_pylist())
    rows = table.to_pylist()
    expiry: dict[str, int] = {}
    expected = []
    pos = 0
    for size, wm in zip(sizes, seen, strict=True):
        firsts: dict[str, dict[str, Any]] = {}
        for r in rows[pos : pos + size]:
            firsts.setdefault(r["k"], r)
        for k, r in firsts.items():
            if k not in expiry or expiry[k] <= wm:
                expected.append(r["id"])
                expiry[k] = r["event_time"] + within
        pos += size
    assert got == sorted(expected)
    assert 40 < len(expected) < table.num_rows // 2, "some keys pass again, most records drop"
    proc.close()


def test_top_n_on_the_processor_vs_sorted_prefixes(tmp_path: Path) -> None:
    """After every batch, the last emitted (key, rank) rows equal the top 3 of the key's
    records so far (sorted by x descending, earlier first on ties)."""
    table = _events(13, 1500, keys=7)
    proc = _processor(tmp_path, ops.top_n(3, by="x"))
    current: dict[tuple[str, int], int] = {}
    pos = 0
    rng = np.random.default_rng(8)
    rows = table.to_pylist()
    while pos < table.num_rows:
        m = int(rng.integers(1, 60))
        chunk = table.slice(pos, m).to_batches()[0]
        for b in proc.process(chunk):
            for r in b.to_pylist():
                current[(r["k"], r["rank"])] = r["id"]
        pos += chunk.num_rows
        so_far: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for r in rows[:pos]:
            so_far[r["k"]].append((-r["x"], r["id"]))
        expected = {
            (k, rank): rid for k, v in so_far.items() for rank, (_, rid) in enumerate(sorted(v)[:3])
        }
        assert current == expected
    proc.close()


@pytest.mark.parametrize("kind", ["window", "all"])
def test_window_and_regular_join_on_the_processor_vs_nested_loops(tmp_path: Path, kind) -> None:
    n = 1200
    table = _events(14, n, keys=15)
    rng = np.random.default_rng(9)
    inputs = np.repeat(rng.integers(0, 2, n // 8), 8)
    op = joins.window_join(100) if kind == "window" else joins.join()
    proc = _processor(tmp_path, op, two_inputs=True)
    outs, _ = _run(proc, table, seed=5, delay=250, inputs=inputs)
    out = _main(outs)
    got = sorted(zip(out["id_left"].to_pylist(), out["id_right"].to_pylist(), strict=True))
    rows = table.to_pylist()
    left = [r for r, s in zip(rows, inputs, strict=True) if s == 0]
    right = [r for r, s in zip(rows, inputs, strict=True) if s == 1]
    exp = sorted(
        (a["id"], b["id"])
        for a in left
        for b in right
        if a["k"] == b["k"] and (kind == "all" or a["event_time"] // 100 == b["event_time"] // 100)
    )
    assert exp and got == exp
    if kind == "window":
        assert (out["window_start"].to_numpy() // 100 * 100 == out["window_start"].to_numpy()).all()
        for side in ("left", "right"):
            assert not list(proc.states.iter_values(side, "str")), f"{side} buffers not cleaned"
    proc.close()


def test_join_buffers_store_each_key_compactly() -> None:
    """A key's stored rows pickle to their own size, not to the whole batch they came from."""
    import pickle

    from raystream.operators.join_logic import Buffers

    n = 20_000
    rows = pa.record_batch({"k": [f"k{i % 1000}" for i in range(n)], "x": np.arange(n)})
    key = np.arange(n) % 1000
    values = Buffers([None] * 1000).values(1000, rows, key, "k")
    whole = len(pickle.dumps(rows))
    sizes = [len(pickle.dumps(v)) for v in values]
    assert max(sizes) < whole / 50, (max(sizes), whole)
    assert sum(v[1].num_rows for v in values) == n
    assert values[7][1].column("x").to_pylist() == list(range(7, n, 1000))
