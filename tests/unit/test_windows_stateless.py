"""Stateless column helpers (raystream.operators.stateless) against pyarrow / plain Python."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from raystream.operators import stateless as st

from raystream.errors import DataflowDefinitionError, SchemaError
from raystream.runtime.processors import MapBatchesProcessor


def _batch() -> pa.RecordBatch:
    rng = np.random.default_rng(0)
    x = rng.integers(-5, 5, 200).tolist()
    x[3] = None
    return pa.record_batch(
        {"k": [f"k{i % 7}" for i in range(200)], "x": x, "event_time": np.arange(200)}
    )


def _run(op, batch):
    from raystream.dataflow import Step

    outs = MapBatchesProcessor(Step(op.name, "map_batches", op.fn)).process(batch)
    return pa.Table.from_batches(outs) if outs else None


def test_select_drop_rename() -> None:
    b = _batch()
    assert _run(st.select("x"), b).column_names == ["x", "event_time"]
    assert _run(st.drop("k"), b).column_names == ["x", "event_time"]
    out = _run(st.rename({"x": "y"}), b)
    assert (
        out.column_names == ["k", "y", "event_time"] and out["y"].to_pylist() == b["x"].to_pylist()
    )
    with pytest.raises(SchemaError, match=r"no column\(s\) \['nope'\]"):
        _run(st.select("nope"), b)


@pytest.mark.parametrize("op", ["==", "!=", "<", "<=", ">", ">="])
def test_where_vs_python(op) -> None:
    b = _batch()
    py = {"==": lambda v: v == 1, "!=": lambda v: v != 1, "<": lambda v: v < 1,
          "<=": lambda v: v <= 1, ">": lambda v: v > 1, ">=": lambda v: v >= 1}[op]  # fmt: skip
    out = _run(st.where("x", op, 1), b)
    exp = [r["event_time"] for r in b.to_pylist() if r["x"] is not None and py(r["x"])]
    assert out["event_time"].to_pylist() == exp


def test_with_column_and_errors() -> None:
    b = _batch()
    out = _run(st.with_column("y", lambda t: pc.multiply(t["event_time"], 2)), b)
    assert out["y"].to_pylist() == [2 * i for i in range(200)]
    out = _run(st.with_column("x", lambda t: [0] * t.num_rows), b)
    assert out["x"].to_pylist() == [0] * 200 and out.column_names == ["k", "x", "event_time"]
    with pytest.raises(SchemaError, match="returned 1 values for 200 records"):
        _run(st.with_column("y", lambda t: [1]), b)
    with pytest.raises(DataflowDefinitionError, match="op must be one of"):
        st.where("x", "=~", 1)
    with pytest.raises(DataflowDefinitionError, match="one or more column names"):
        st.select()
