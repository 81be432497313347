"""Aggregations per group (raystream.operators.aggregations) against plain-Python oracles:
partials of a whole batch, and partials of two halves merged, give the same results."""

from __future__ import annotations

import statistics
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pytest
from raystream.operators import aggregations as A
from raystream.operators.aggregations import Groups, Rows

from raystream.errors import DataflowDefinitionError, SchemaError


def _data(seed: int, n: int = 3000, groups: int = 40):
    rng = np.random.default_rng(seed)
    g = rng.integers(0, groups, n)
    g[:groups] = np.arange(groups)  # dense ids
    x = rng.integers(-1000, 1000, n)
    y = rng.normal(size=n)
    return g, pa.record_batch({"x": x, "y": y, "u": [f"u{v}" for v in rng.integers(0, 30, n)]})


def _oracle(g, batch):
    by = defaultdict(list)
    for gi, r in zip(g.tolist(), batch.to_pylist(), strict=True):
        by[gi].append(r)
    return by


AGGS = [
    A.count(),
    A.sum("x"),
    A.sum("y"),
    A.min("x"),
    A.max("y"),
    A.mean("x"),
    A.top_k("x", 3),
    A.top_k("y", 2, largest=False),
    A.aggregate(set, lambda acc, r: acc | {r["u"]}, lambda a, b: a | b, len, name="users"),
]


def _expected(agg, recs):
    xs = [r["x"] for r in recs]
    ys = [r["y"] for r in recs]
    name = agg.names[0]
    return {
        "count": len(recs),
        "x_sum": sum(xs),
        "y_sum": sum(ys),
        "x_min": min(xs),
        "y_max": max(ys),
        "x_mean": statistics.fmean(xs),
        "x_top_k": sorted(xs, reverse=True)[:3],
        "y_top_k": sorted(ys)[:2],
        "users": len({r["u"] for r in recs}),
    }[name]


def _check(agg, result, by):
    name = agg.names[0]
    got = list(result[name])
    for gi in range(len(by)):
        exp = _expected(agg, by[gi])
        val = got[gi]
        if isinstance(exp, float):
            assert val == pytest.approx(exp, rel=1e-9, abs=1e-9), (name, gi)
        elif isinstance(exp, list):
            assert val == pytest.approx(exp), (name, gi)
        else:
            assert val == exp, (name, gi)


@pytest.mark.parametrize("agg", AGGS, ids=lambda a: a.names[0])
@pytest.mark.parametrize("seed", [1, 2])
def test_partial_and_merged_halves_match_python(agg, seed) -> None:
    g, batch = _data(seed)
    by = _oracle(g, batch)
    whole = agg.partial(Rows(batch), Groups.of(g))
    _check(agg, agg.result(whole), by)
    # two halves, partials of each, merged: the same
    n = batch.num_rows
    cut = n // 3
    parts = []
    ids = []
    for lo, hi in ((0, cut), (cut, n)):
        sub_g = g[lo:hi]
        uniq, dense = np.unique(sub_g, return_inverse=True)
        parts.append(agg.partial(Rows(batch.slice(lo, hi - lo)), Groups.of(dense)))
        ids.append(uniq)
    from raystream.operators.window_logic import _concat_parts

    cat = {k: _concat_parts([p[k] for p in parts]) for k in parts[0]}
    merged = agg.merge(cat, Groups.of(np.concatenate(ids)))
    _check(agg, agg.result(merged), by)


def test_combined_and_rows_through_an_index() -> None:
    g, batch = _data(3, n=500, groups=10)
    agg = A.as_aggregation([A.count(), A.sum("x")], "test")
    assert agg.names == ("count", "x_sum")
    idx = np.concatenate([np.arange(500), np.arange(0, 500, 2)])  # some rows twice
    gg = g[idx]
    res = agg.result(agg.partial(Rows(batch, idx), Groups.of(gg)))
    xs = batch.column("x").to_numpy()
    for gi in range(10):
        sel = idx[gg == gi]
        assert res["count"][gi] == len(sel)
        assert res["x_sum"][gi] == int(xs[sel].sum())


def test_by_pairs_groups_equal_pairs() -> None:
    rng = np.random.default_rng(5)
    a, b = rng.integers(0, 5, 400), rng.integers(-3, 3, 400) * 1000
    gr = Groups.by_pairs(a, b)
    pairs = sorted(set(zip(a.tolist(), b.tolist(), strict=True)))
    assert gr.n == len(pairs)
    for i in range(400):
        assert pairs[gr.ids[i]] == (a[i], b[i])


def test_definition_errors_say_what_came() -> None:
    with pytest.raises(DataflowDefinitionError, match="k >= 1, got 0"):
        A.top_k("x", 0)
    with pytest.raises(DataflowDefinitionError, match="must be a function"):
        A.aggregate(set, None, None, len)  # type: ignore[arg-type]
    with pytest.raises(DataflowDefinitionError, match="same column name"):
        A.as_aggregation([A.count(), A.count()], "w")
    with pytest.raises(DataflowDefinitionError, match="expects an aggregation"):
        A.as_aggregation("count", "w")
    with pytest.raises(SchemaError, match="no|columns"):
        A.sum("nope").partial(Rows(pa.record_batch({"x": [1]})), Groups.of(np.array([0])))
    with pytest.raises(SchemaError, match="null"):
        A.sum("x").partial(Rows(pa.record_batch({"x": [1, None]})), Groups.of(np.array([0, 0])))
