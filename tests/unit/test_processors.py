"""Processors: grouping by key, KeyedBatch helpers, stateless processors, keyed processors with
RocksDB state, and snapshot/restore that continues exactly (vs collections.Counter)."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import raystream as rs
from raystream.errors import SchemaError, StateError
from raystream.keys import KeySpace, RoutingTable
from raystream.runtime.channels import ByKeyGroup
from raystream.runtime.processors import (
    EVENT_TIME,
    INGEST_TS,
    KeyedProcessor,
    MapBatchesProcessor,
    MapProcessor,
    group_by_key,
    make_processor,
)
from raystream.state.handles import VectorValueState

KS = KeySpace(128, 16)


def events(n: int, kind: str, seed: int, n_keys: int = 300) -> pa.Table:
    rng = np.random.default_rng(seed)
    raw = rng.zipf(1.3, size=n) % n_keys - n_keys // 2  # skewed, incl. negative ints
    keys = raw.tolist() if kind == "int" else [f"user-{x}-é" for x in raw]
    return pa.table(
        {
            "key": keys,
            "seq": np.arange(n, dtype=np.int64),
            EVENT_TIME: rng.integers(0, 10**6, size=n),
            INGEST_TS: rng.integers(0, 10**12, size=n),
        }
    )


# ---- group_by_key / KeyedBatch -------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["int", "str"])
def test_group_by_key_vs_python_groupby(kind) -> None:
    tbl = events(2000, kind, 1)
    b = tbl.to_batches()[0]
    kb = group_by_key(b, b.column("key"), KS, "key")
    rows = b.to_pylist()
    by_key: dict = defaultdict(list)
    for r in rows:
        by_key[r["key"]].append(r["seq"])
    distinct = kb.keys.keys.to_pylist()
    assert sorted(distinct, key=repr) == sorted(by_key, key=repr) and len(distinct) == len(by_key)
    assert kb.offsets[0] == 0 and kb.offsets[-1] == len(rows) and len(kb.offsets) == len(distinct) + 1
    assert kb.counts.tolist() == [len(by_key[k]) for k in distinct]
    for i, k in enumerate(distinct):
        recs = kb.records_of(i)
        assert set(recs.column("key").to_pylist()) == {k}
        assert recs.column("seq").to_pylist() == by_key[k]  # stable: arrival order kept
    assert kb.key_index().tolist() == [i for i, k in enumerate(distinct) for _ in by_key[k]]
    kg, sg = KS.locate(distinct)
    assert kb.keys.key_group.tolist() == kg.tolist() and kb.keys.sub_group.tolist() == sg.tolist()
    assert len(kb) == len(rows)


def test_group_by_key_empty_and_sorted_input() -> None:
    empty = pa.record_batch({"key": pa.array([], pa.int64())})
    kb = group_by_key(empty, empty.column("key"), KS, "key")
    assert len(kb.keys) == 0 and kb.offsets.tolist() == [0] and kb.reduce("key").tolist() == []
    b = pa.record_batch({"key": [1, 1, 2, 3]})
    kb = group_by_key(b, b.column("key"), KS, "key")
    assert kb.records is b  # already grouped: no copy
    assert kb.counts.tolist() == [2, 1, 1]


@pytest.mark.parametrize("kind", ["int", "str"])
def test_group_by_key_orders_keys_as_their_state_keys(kind) -> None:
    from raystream.state.layout import encode_keys

    b = events(3000, kind, 5, n_keys=2000).to_batches()[0]
    kb = group_by_key(b, b.column("key"), KS, "key")
    gsg = kb.keys.key_group.astype(np.int64) * KS.sub_groups + kb.keys.sub_group
    assert (np.diff(gsg) >= 0).all()  # by key group, then sub-group (RocksDB locality)
    if kind == "int":  # and then by key: the encoded state keys come sorted
        enc = encode_keys(kb.keys.key_group, kb.keys.sub_group, 0, kb.keys.keys)
        assert enc == sorted(enc) and len(set(enc)) == len(enc)
    # every record sits in its key's run, in arrival order
    seqs = kb.records.column("seq").to_pylist()
    keys = kb.records.column("key").to_pylist()
    for i, k in enumerate(kb.keys.keys.to_pylist()):
        lo, hi = int(kb.offsets[i]), int(kb.offsets[i + 1])
        assert set(keys[lo:hi]) == {k} and seqs[lo:hi] == sorted(seqs[lo:hi])


def test_reduce_and_output_vs_python() -> None:
    b = events(1500, "str", 2).to_batches()[0]
    kb = group_by_key(b, b.column("key"), KS, "key")
    rows = b.to_pylist()
    agg: dict = defaultdict(lambda: {"sum": 0, "min": None, "max": None, "it": [], "et": []})
    for r in rows:
        a = agg[r["key"]]
        a["sum"] += r["seq"]
        a["min"] = r["seq"] if a["min"] is None else min(a["min"], r["seq"])
        a["max"] = r["seq"] if a["max"] is None else max(a["max"], r["seq"])
        a["it"].append(r[INGEST_TS])
        a["et"].append(r[EVENT_TIME])
    keys = kb.keys.keys.to_pylist()
    assert kb.reduce("seq").tolist() == [agg[k]["sum"] for k in keys]
    assert kb.reduce("seq", "min").tolist() == [agg[k]["min"] for k in keys]
    assert kb.reduce("seq", "max").tolist() == [agg[k]["max"] for k in keys]
    out = kb.output({"n": kb.counts}).to_pydict()
    assert out["key"] == keys
    assert out["n"] == [len(agg[k]["it"]) for k in keys]
    assert out[INGEST_TS] == [min(agg[k]["it"]) for k in keys]  # oldest ingest
    assert out[EVENT_TIME] == [max(agg[k]["et"]) for k in keys]  # newest event time
    # explicit columns win over the derived ones
    out2 = kb.output({INGEST_TS: np.zeros(len(keys), np.int64)}).to_pydict()
    assert out2[INGEST_TS] == [0] * len(keys)


# ---- stateless processors ---------------------------------------------------------------------------
def _step(op, tbl: pa.Table, key: str | None = None):
    flow = rs.Dataflow("t")
    s = flow.source(rs.sources.from_table(tbl))
    if key is not None:
        s = s.key_by(key)
    s.apply(op)
    return flow, flow.steps[op.name]


def test_map_carries_meta_unless_set() -> None:
    tbl = events(50, "int", 3)

    @rs.map
    def double(r):
        out = {"key": r["key"], "y": r["seq"] * 2}
        if r["seq"] == 0:
            out[EVENT_TIME] = -1
        return out

    _, step = _step(double, tbl)
    p = make_processor(step, KS, None)
    assert isinstance(p, MapProcessor)
    (out,) = p.process(tbl.to_batches()[0])
    rows, src = out.to_pylist(), tbl.to_pylist()
    assert [r["y"] for r in rows] == [r["seq"] * 2 for r in src]
    assert [r[INGEST_TS] for r in rows] == [r[INGEST_TS] for r in src]
    assert [r[EVENT_TIME] for r in rows] == [-1] + [r[EVENT_TIME] for r in src[1:]]


def test_map_must_return_dict() -> None:
    _, step = _step(rs.map(lambda r: 1, name="bad"), events(3, "int", 0))
    with pytest.raises(SchemaError, match="'bad' must return a dict"):
        make_processor(step, KS, None).process(events(3, "int", 0).to_batches()[0])


def test_filter_keeps_columns_and_rows() -> None:
    tbl = events(300, "int", 4)
    _, step = _step(rs.filter(lambda r: r["seq"] % 3 == 0, name="f"), tbl)
    outs = make_processor(step, KS, None).process(tbl.to_batches()[0])
    got = pa.Table.from_batches(outs)
    assert got.schema == tbl.schema
    assert got.to_pylist() == [r for r in tbl.to_pylist() if r["seq"] % 3 == 0]
    _, none = _step(rs.filter(lambda r: False, name="f"), tbl)
    assert make_processor(none, KS, None).process(tbl.to_batches()[0]) == []


def test_flat_map_carries_meta() -> None:
    tbl = events(40, "str", 5)
    _, step = _step(rs.flat_map(lambda r: [{"k": r["key"], "i": i} for i in range(r["seq"] % 3)], name="fm"), tbl)
    (out,) = make_processor(step, KS, None).process(tbl.to_batches()[0])
    expected = [
        {"k": r["key"], "i": i, EVENT_TIME: r[EVENT_TIME], INGEST_TS: r[INGEST_TS]}
        for r in tbl.to_pylist()
        for i in range(r["seq"] % 3)
    ]
    assert out.to_pylist() == expected
    _, bad = _step(rs.flat_map(lambda r: [1], name="fm2"), tbl)
    with pytest.raises(SchemaError, match="must yield dicts"):
        make_processor(bad, KS, None).process(tbl.to_batches()[0])


def test_map_batches_carries_meta_when_row_count_kept() -> None:
    tbl = events(30, "int", 6)
    b = tbl.to_batches()[0]
    _, step = _step(rs.map_batches(lambda bt: pa.record_batch({"s": bt.column("seq")}), name="mb"), tbl)
    p = make_processor(step, KS, None)
    assert isinstance(p, MapBatchesProcessor)
    (out,) = p.process(b)
    assert out.column("s").equals(b.column("seq"))
    assert out.column(EVENT_TIME).equals(b.column(EVENT_TIME))
    assert out.column(INGEST_TS).equals(b.column(INGEST_TS))
    # dict and Table outputs, None, and a wrong type
    _, d = _step(rs.map_batches(lambda bt: {"s": bt.column("seq").to_pylist()[:2]}, name="mb"), tbl)
    (o,) = make_processor(d, KS, None).process(b)
    assert o.to_pydict() == {"s": b.column("seq").to_pylist()[:2]}
    _, n = _step(rs.map_batches(lambda bt: None, name="mb"), tbl)
    assert make_processor(n, KS, None).process(b) == []
    _, w = _step(rs.map_batches(lambda bt: [1], name="mb"), tbl)
    with pytest.raises(SchemaError, match="returned list"):
        make_processor(w, KS, None).process(b)


# ---- keyed processors ----------------------------------------------------------------------------------
def per_key_count():
    @rs.keyed(state=rs.ValueState(int, default=0))
    def count(key, records, state):
        state.value += len(records)
        yield key, state.value

    return count


def batch_count():
    @rs.keyed_batches(state=rs.ValueState(int, default=0))
    def count(batch, state):
        new = state.get(batch.keys) + batch.counts
        state.put(batch.keys, new)
        return batch.output({"count": new})

    return count


FORMS = {"keyed": per_key_count, "keyed_batches": batch_count}


def keyed_step(form: str, tbl: pa.Table):
    flow, step = _step(FORMS[form](), tbl, key="key")
    return flow, step


def final_counts(proc: KeyedProcessor, kind: str) -> dict:
    return dict(proc.states.iter_values("", kind))


def last_outputs(outs: list[pa.RecordBatch], form: str) -> dict:
    col = "value" if form == "keyed" else "count"
    last: dict = {}
    for b in outs:
        for k, v in zip(b.column("key").to_pylist(), b.column(col).to_pylist()):
            last[k] = v
    return last


@pytest.mark.parametrize("form", ["keyed", "keyed_batches"])
@pytest.mark.parametrize("kind", ["int", "str"])
def test_keyed_processor_counts_vs_counter(tmp_path: Path, form, kind) -> None:
    tbl = events(4000, kind, 7)
    flow, step = keyed_step(form, tbl)
    p = make_processor(step, flow.key_space, tmp_path / "a", owned=range(128))
    assert isinstance(p, KeyedProcessor)
    outs = []
    for b in tbl.to_batches(max_chunksize=333):
        outs += p.process(b)
    oracle = Counter(tbl.column("key").to_pylist())
    assert final_counts(p, kind) == oracle
    assert last_outputs(outs, form) == oracle
    # outputs carry the key's oldest ingest_ts / newest event_time per batch
    for b, o in zip(tbl.to_batches(max_chunksize=333), outs):
        per_key = defaultdict(list)
        for r in b.to_pylist():
            per_key[r["key"]].append(r)
        for r in o.to_pylist():
            assert r[INGEST_TS] == min(x[INGEST_TS] for x in per_key[r["key"]])
            assert r[EVENT_TIME] == max(x[EVENT_TIME] for x in per_key[r["key"]])
    p.close()


@pytest.mark.parametrize("form", ["keyed", "keyed_batches"])
@pytest.mark.parametrize("kind", ["int", "str"])
def test_snapshot_restore_continues_exactly(tmp_path: Path, form, kind) -> None:
    tbl = events(6000, kind, 11)
    flow, step = keyed_step(form, tbl)
    ks = flow.key_space
    half = tbl.num_rows // 2
    first, rest = tbl.slice(0, half), tbl.slice(half)

    a = make_processor(step, ks, tmp_path / "a", owned=range(128))
    for b in first.to_batches(max_chunksize=250):
        a.process(b)
    snap = a.backend.snapshot(tmp_path / "snap")
    # A keeps running after the snapshot; that must not leak into the restored state
    a.process(rest.to_batches(max_chunksize=1000)[0])

    table = RoutingTable.uniform(128, 2, epoch=1)
    procs = []
    for i in range(2):
        owned = table.key_groups_of(i).tolist()
        p = make_processor(step, ks, tmp_path / f"i{i}", owned=owned)
        p.backend.restore_key_groups(snap, owned)
        procs.append(p)

    outs: list[list[pa.RecordBatch]] = [[], []]
    for b in rest.to_batches(max_chunksize=250):
        kg, _ = ks.locate(b.column("key"))
        dest = table.owner_of(kg)
        for i in range(2):
            piece = b.filter(pa.array(dest == i))
            if piece.num_rows:
                outs[i] += procs[i].process(piece)

    oracle = Counter(tbl.column("key").to_pylist())
    merged: dict = {}
    for i, p in enumerate(procs):
        part = final_counts(p, kind)
        # each instance holds only its own key groups (single owner), and no key twice
        kgs, _ = ks.locate(list(part)) if part else (np.array([], int), None)
        assert set(table.owner_of(kgs).tolist()) <= {i}
        assert not set(part) & set(merged)
        merged.update(part)
    assert merged == oracle
    # the vectorised read agrees
    for i, p in enumerate(procs):
        mine = [k for k in oracle if int(table.owners[ks.locate([k])[0][0]]) == i]
        vec = VectorValueState(p.backend, 1, step.state[""], ks)
        assert vec.get(mine).tolist() == [oracle[k] for k in mine]
    # the last output per key after the restore is the whole-stream count
    after = {}
    for o in outs:
        after.update(last_outputs(o, form))
    assert after == {k: oracle[k] for k in set(rest.column("key").to_pylist())}
    for p in (a, *procs):
        p.close()


@pytest.mark.parametrize("form", ["keyed", "keyed_batches"])
def test_unowned_key_group_raises_state_error(tmp_path: Path, form) -> None:
    tbl = events(200, "int", 12)
    flow, step = keyed_step(form, tbl)
    p = make_processor(step, flow.key_space, tmp_path / "p", owned=range(64))
    b = tbl.to_batches()[0]
    kg, _ = flow.key_space.locate(b.column("key"))
    foreign = b.filter(pa.array(kg >= 64))
    assert foreign.num_rows
    with pytest.raises(StateError) as ei:
        p.process(foreign)
    bad = sorted(set(kg[kg >= 64].tolist()))[:10]
    assert str(bad) in str(ei.value) and "own" in str(ei.value)
    # nothing was written for the foreign keys
    assert p.backend.count_rows() == 0
    # owned key groups work
    p.process(b.filter(pa.array(kg < 64)))
    assert final_counts(p, "int") == Counter(k for k, g in zip(b.column("key").to_pylist(), kg) if g < 64)
    p.close()


@pytest.mark.parametrize("track", [True, False])
def test_heat_is_counted_per_record_and_foreign_keys_raise(tmp_path: Path, track) -> None:
    tbl = events(3000, "int", 21, n_keys=1000)
    flow, step = keyed_step("keyed_batches", tbl)
    ks = flow.key_space
    p = make_processor(step, ks, tmp_path / "p", owned=range(128), track=track)
    p.engine.heat.clock = lambda: 0.0  # no decay: the counts are exact
    p.engine.heat._at = 0.0
    for b in tbl.to_batches(max_chunksize=250):
        p.process(b)
    kg, sg = ks.locate(tbl.column("key"))
    per_record = np.bincount(ks.global_sub_group(kg, sg), minlength=len(p.engine.heat.counts))
    expected = per_record if track else np.zeros_like(per_record)
    assert p.engine.heat.counts.tolist() == expected.astype(float).tolist()
    assert final_counts(p, "int") == Counter(tbl.column("key").to_pylist())
    p.close()
    q = make_processor(step, ks, tmp_path / "q", owned=range(64), track=track)
    with pytest.raises(StateError, match="own"):
        q.process(tbl.to_batches()[0])
    assert q.backend.count_rows() == 0
    q.close()


def test_keyed_yield_forms_and_errors(tmp_path: Path) -> None:
    tbl = pa.table({"key": ["a", "b", "a"], "x": [1, 2, 3]})

    @rs.keyed
    def as_dict(key, records):
        yield {"n": records.num_rows}  # dict without the key column: key added

    @rs.keyed
    def as_pair_dict(key, records):
        yield key, {"n": records.num_rows}

    @rs.keyed
    def as_pair(key, records):
        yield "k-" + key, records.num_rows

    expected = {"as_dict": [{"key": "a", "n": 2}, {"key": "b", "n": 1}]}
    expected["as_pair_dict"] = expected["as_dict"]
    expected["as_pair"] = [{"key": "k-a", "value": 2}, {"key": "k-b", "value": 1}]
    for op in (as_dict, as_pair_dict, as_pair):
        flow, step = _step(op, tbl, key="key")
        p = make_processor(step, flow.key_space, tmp_path / op.name, owned=range(128))
        (out,) = p.process(tbl.to_batches()[0])
        assert sorted(out.to_pylist(), key=repr) == expected[op.name]
        p.close()

    @rs.keyed
    def bad(key, records):
        yield 42

    flow, step = _step(bad, tbl, key="key")
    with pytest.raises(SchemaError, match="must yield dicts or \\(key, value\\) tuples, got int"):
        make_processor(step, flow.key_space, tmp_path / "q", owned=range(128)).process(tbl.to_batches()[0])


@pytest.mark.parametrize("kind", ["map", "keyed"])
def test_heterogeneous_output_records_lose_no_fields(tmp_path: Path, kind) -> None:
    tbl = pa.table({"key": ["a", "b"], "x": [1, 2]})
    if kind == "map":
        op = rs.map(lambda r: {"a": 1} if r["x"] == 1 else {"b": 2}, name="op")
    else:
        op = rs.keyed(lambda key, records: [{"a": 1}, (key, 5)], name="op")
    flow, step = _step(op, tbl, key="key" if kind == "keyed" else None)
    p = make_processor(step, flow.key_space, tmp_path / "p", owned=range(128))
    try:
        outs = p.process(tbl.to_batches()[0])
    except SchemaError:
        return  # refusing inconsistent records loudly is acceptable too
    names = set(pa.Table.from_batches(outs).schema.names)
    assert {"a", "b" if kind == "map" else "value"} <= names


def test_keyed_with_state_namespace(tmp_path: Path) -> None:
    tbl = events(1000, "int", 13, n_keys=40)

    @rs.keyed(state={"n": rs.ValueState(int, default=0), "seqs": rs.ListState(), "by_mod": rs.MapState(0)})
    def multi(key, records, state):
        state.n.value += records.num_rows
        state.seqs.extend(records.column("seq").to_pylist())
        for s in records.column("seq").to_pylist():
            state.by_mod[s % 3] = state.by_mod.get(s % 3) + 1
        return ()

    flow, step = _step(multi, tbl, key="key")
    p = make_processor(step, flow.key_space, tmp_path / "p", owned=range(128))
    for b in tbl.to_batches(max_chunksize=97):
        assert p.process(b) == []
    rows = tbl.to_pylist()
    seqs: dict = defaultdict(list)
    for r in rows:
        seqs[r["key"]].append(r["seq"])
    assert dict(p.states.iter_values("n", "int")) == {k: len(v) for k, v in seqs.items()}
    assert dict(p.states.iter_values("seqs", "int")) == seqs  # per-key arrival order
    vec = p.states.vectorised()
    for k, v in seqs.items():
        assert dict(vec.by_mod.for_key(k, flow.key_space).items()) == dict(Counter(s % 3 for s in v))
    p.close()


def test_key_by_fn_through_partitioner_has_one_key_column(tmp_path: Path) -> None:
    tbl = pa.table({"user": [1, 2, 1, 3], "x": [1, 1, 1, 1]})
    seen_names = []

    @rs.keyed
    def look(key, records):
        seen_names.append(records.schema.names)
        yield key, records.num_rows

    flow = rs.Dataflow("t")
    flow.source(rs.sources.from_table(tbl)).key_by(lambda b: b.column("user")).apply(look)
    step = flow.steps["look"]
    p = make_processor(step, flow.key_space, tmp_path / "p", owned=range(128))
    for _, piece in ByKeyGroup(step.key, flow.key_space, RoutingTable.uniform(128, 1)).split(tbl.to_batches()[0]):
        p.process(piece)
    assert seen_names and all(names.count("_key") == 1 for names in seen_names)


def test_make_processor_unknown_kind() -> None:
    flow, step = _step(rs.map(lambda r: r, name="m"), events(1, "int", 0))
    import dataclasses

    with pytest.raises(ValueError, match="no processor for step kind 'source'"):
        make_processor(dataclasses.replace(step, kind="source"), KS, None)

