"""The dataflow API: definition-time errors with precise messages, and the graph it builds."""

from __future__ import annotations

import pyarrow as pa
import pytest

import raystream as rs
from raystream.dataflow import Operator
from raystream.errors import ConfigError, DataflowDefinitionError

TBL = pa.table({"key": [1, 2, 3], "v": [1.0, 2.0, 3.0]})


def keyed_stream(flow: rs.Dataflow | None = None):
    flow = flow or rs.Dataflow("t")
    return flow, flow.source(rs.sources.from_table(TBL)).key_by("key")


# ---- arity of each decorator kind ----------------------------------------------------------------
def _f0():
    return None


def _f1(a):
    return a


def _f2(a, b):
    return a


def _f3(a, b, c):
    return a


def _f4(a, b, c, d):
    return a


@pytest.mark.parametrize(
    ("decorator", "kwargs", "fn", "want", "got"),
    [
        (rs.map, {}, _f2, "1 positional", "takes 2"),
        (rs.map, {}, _f0, "1 positional", "takes 0"),
        (rs.filter, {}, _f2, "fn(record: dict) -> bool", "takes 2"),
        (rs.flat_map, {}, _f0, "1 positional", "takes 0"),
        (rs.map_batches, {}, _f2, "RecordBatch", "takes 2"),
        (rs.keyed, {}, _f3, "2 positional", "takes 3"),
        (rs.keyed, {"state": rs.ValueState(int)}, _f2, "3 positional", "takes 2"),
        (rs.keyed, {"state": rs.ValueState(int)}, _f4, "3 positional", "takes 4"),
        (rs.keyed_batches, {}, _f2, "1 positional", "takes 2"),
        (rs.keyed_batches, {"state": rs.MapState()}, _f1, "2 positional", "takes 1"),
    ],
)
def test_wrong_arity_is_rejected(decorator, kwargs, fn, want, got) -> None:
    with pytest.raises(DataflowDefinitionError) as ei:
        decorator(**kwargs)(fn)
    msg = str(ei.value)
    assert want in msg and got in msg and fn.__name__ in msg
    assert f"@rs.{decorator.__name__}" in msg


def test_flexible_signatures_are_accepted() -> None:
    assert rs.map(lambda r, extra=1: r).kind == "map"
    assert rs.keyed(lambda *a: a).kind == "keyed"
    op = rs.keyed(state=rs.ValueState(int))(lambda k, recs, st, opt=None: None)
    assert op.state == {"": rs.ValueState(int)}
    assert rs.map_batches(len).kind == "map_batches"  # builtin: trusted


def test_decorator_with_and_without_parentheses() -> None:
    @rs.map
    def a(r):
        return r

    @rs.map(name="bee")
    def b(r):
        return r

    assert isinstance(a, Operator) and a.name == "a" and a({"x": 1}) == {"x": 1}
    assert b.name == "bee"


def test_non_callable_is_rejected() -> None:
    with pytest.raises(DataflowDefinitionError, match="needs a function, got int"):
        rs.map(5)


def test_state_only_on_keyed_operators() -> None:
    with pytest.raises(DataflowDefinitionError, match="only @rs.keyed and @rs.keyed_batches take state="):
        rs.map(state=rs.ValueState(int))(_f1)


@pytest.mark.parametrize(
    ("state", "needle"),
    [(5, "got int: 5"), ([rs.ValueState()], "got list"), ({"a": 1}, "got {'a': 1}"), ({"1a": rs.ValueState()}, "identifier")],
)
def test_bad_state_values(state, needle) -> None:
    with pytest.raises(DataflowDefinitionError) as ei:
        rs.keyed(state=state)(_f3)
    assert needle in str(ei.value) and "state=" in str(ei.value)


# ---- graph building -----------------------------------------------------------------------------
def test_keyed_operator_on_unkeyed_stream() -> None:
    flow = rs.Dataflow("t")
    s = flow.source(rs.sources.from_table(TBL))
    op = rs.keyed(lambda k, r: None, name="cnt")
    with pytest.raises(DataflowDefinitionError) as ei:
        s.apply(op)
    msg = str(ei.value)
    assert "'cnt'" in msg and "not keyed" in msg and "key_by" in msg and "'source'" in msg
    # a map on a keyed stream drops the keying
    flow2, ks = keyed_stream()
    mapped = ks.map(lambda r: r, name="m")
    with pytest.raises(DataflowDefinitionError, match="not keyed"):
        mapped.apply(rs.keyed_batches(lambda b: None, name="kb"))


def test_key_by_unknown_column() -> None:
    flow = rs.Dataflow("t")
    s = flow.source(rs.sources.from_table(TBL))
    with pytest.raises(DataflowDefinitionError) as ei:
        s.key_by("user")
    msg = str(ei.value)
    assert "'user'" in msg and "['key', 'v']" in msg
    # after a filter the schema is still known; after a map it is not (no check)
    f = s.filter(lambda r: True, name="f")
    with pytest.raises(DataflowDefinitionError, match="no column 'nope'"):
        f.key_by("nope")
    assert s.map(lambda r: r, name="m").key_by("anything").key.column == "anything"


def test_key_by_bad_arguments() -> None:
    flow = rs.Dataflow("t")
    s = flow.source(rs.sources.from_table(TBL))
    with pytest.raises(DataflowDefinitionError, match="column name or a function, got int"):
        s.key_by(3)  # type: ignore[arg-type]
    with pytest.raises(DataflowDefinitionError, match="one argument"):
        s.key_by(lambda a, b: a)
    ks = s.key_by(lambda b: b.column("key"))
    assert ks.key.fn is not None and ks.key.key_column == "_key"


def test_duplicate_step_names() -> None:
    flow, s = keyed_stream()
    op = rs.keyed(lambda k, r: None, name="cnt")
    s.apply(op)
    with pytest.raises(DataflowDefinitionError) as ei:
        s.apply(op)
    msg = str(ei.value)
    assert "duplicate step name 'cnt'" in msg and "name=" in msg and "'source'" in msg
    s.apply(op, name="cnt2")  # renaming fixes it
    with pytest.raises(DataflowDefinitionError, match="duplicate step name 'source'"):
        flow.source(rs.sources.from_table(TBL))


def test_apply_non_operator() -> None:
    _, s = keyed_stream()
    with pytest.raises(DataflowDefinitionError) as ei:
        s.apply(_f1)  # type: ignore[arg-type]
    assert "got function" in str(ei.value) and "Decorate the function first" in str(ei.value)


def test_source_and_sink_type_checks() -> None:
    flow = rs.Dataflow("t")
    with pytest.raises(DataflowDefinitionError, match="source\\(\\) expects a source.*got int"):
        flow.source(1)
    s = flow.source(rs.sources.from_table(TBL))
    with pytest.raises(DataflowDefinitionError, match="sink\\(\\) expects a sink.*got str"):
        s.sink("out")


@pytest.mark.parametrize("name", ["", "has space", "9lives", "x" * 65, None])
def test_bad_dataflow_names(name) -> None:
    with pytest.raises(DataflowDefinitionError, match="Dataflow name"):
        rs.Dataflow(name)  # type: ignore[arg-type]


def test_bad_step_name() -> None:
    _, s = keyed_stream()
    with pytest.raises(DataflowDefinitionError, match="step name 'a b'"):
        s.apply(rs.map(_f1), name="a b")


def test_graph_shape() -> None:
    flow, s = keyed_stream(rs.Dataflow("t", num_key_groups=64, sub_groups=8))
    st = rs.ValueState(int, default=0)
    out = s.apply(rs.keyed(state=st)(_f3), name="count")
    out.sink(rs.sinks.collect())
    assert list(flow.steps) == ["source", "count", "sink_0"]
    step = flow.steps["count"]
    assert step.kind == "keyed" and step.is_keyed and step.upstream == ("source",)
    assert step.key.column == "key" and step.state == {"": st}
    assert flow.steps["sink_0"].upstream == ("count",)
    assert flow.key_space == rs.KeySpace(64, 8)


# ---- parallelism ----------------------------------------------------------------------------------
def _flow_with_sink():
    flow, s = keyed_stream()
    s.apply(rs.keyed(_f2), name="count").map(lambda r: r, name="m").sink(rs.sinks.collect())
    return flow


@pytest.mark.parametrize("p", [0, -1, 1.5, True, "2"])
def test_with_parallelism_rejects_non_positive_ints(p) -> None:
    with pytest.raises(ConfigError) as ei:
        _flow_with_sink().with_parallelism({"count": p})
    assert "'count'" in str(ei.value) and "int >= 1" in str(ei.value) and repr(p) in str(ei.value)


def test_with_parallelism_above_key_groups() -> None:
    flow = _flow_with_sink()
    with pytest.raises(ConfigError) as ei:
        flow.with_parallelism({"count": 129})
    msg = str(ei.value)
    assert "at most the number of key groups (128)" in msg and "got 129" in msg and "num_key_groups" in msg
    steps = flow.with_parallelism({"count": 128, "m": 500})  # unkeyed steps are not bounded
    assert steps["count"].parallelism == 128 and steps["m"].parallelism == 500
    assert steps["source"].parallelism == 1
    assert flow.steps["count"].parallelism is None  # the flow itself is not changed


def test_with_parallelism_unknown_step_and_missing_sink() -> None:
    with pytest.raises(DataflowDefinitionError, match=r"unknown step\(s\) \['nope'\]"):
        _flow_with_sink().with_parallelism({"nope": 2})
    flow, s = keyed_stream()
    s.apply(rs.keyed(_f2), name="count")
    with pytest.raises(DataflowDefinitionError, match="has no sink"):
        flow.with_parallelism({})


def test_operator_parallelism_checked_at_apply() -> None:
    _, s = keyed_stream(rs.Dataflow("t", num_key_groups=4))
    with pytest.raises(ConfigError, match="got 5"):
        s.apply(rs.keyed(_f2, parallelism=5), name="a")
    with pytest.raises(ConfigError, match="got 0"):
        s.apply(rs.keyed(_f2), name="b", parallelism=0)
    assert s.apply(rs.keyed(_f2, parallelism=4), name="c").step == "c"
