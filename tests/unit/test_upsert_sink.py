"""parquet(path, mode="upsert"): the final table read back (``rs.read_upsert`` and the documented
DuckDB query) equals an independent replay of the changelog in a Python dict, with and without
the two-phase commit (a failure between checkpoints, restore, replay), and in a dataflow run in
one process (``run_local``) whose updating operator keeps a per-key version."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pytest

import raystream as rs
from raystream.runtime.local import run_local
from raystream.upsert import final_table_sql


def changelog(n_ops: int, n_keys: int, seed: int) -> tuple[pa.Table, dict[int, tuple[str, int]]]:
    """Random Flink-style changes (+I, -U/+U, -D) with a per-key version, and the final table
    (key -> (name, value)) from replaying them in a dict."""
    rnd = random.Random(seed)
    live: dict[int, tuple[str, int]] = {}
    version = dict.fromkeys(range(n_keys), 0)
    rows: dict[str, list[Any]] = {"k": [], "name": [], "v": [], "op": [], "ver": []}

    def emit(k: int, row: tuple[str, int], op: str) -> None:
        version[k] += 1
        for col, val in zip(
            ("k", "name", "v", "op", "ver"), (k, *row, op, version[k]), strict=True
        ):
            rows[col].append(val)

    for _ in range(n_ops):
        k = rnd.randrange(n_keys)
        new = (f"n{rnd.randrange(1000)}", rnd.randrange(-50, 50))
        if k not in live:
            emit(k, new, "+I")
            live[k] = new
        elif rnd.random() < 0.25:
            emit(k, live.pop(k), "-D")
        else:
            emit(k, live[k], "-U")
            emit(k, new, "+U")
            live[k] = new
    return pa.table(rows), live


def as_dict(table: pa.Table) -> dict[int, tuple[str, int]]:
    d = table.to_pydict()
    return {k: (n, v) for k, n, v in zip(d["k"], d["name"], d["v"], strict=True)}


def duckdb_final(path: Path, key: list[str]) -> pa.Table:
    return duckdb.sql(final_table_sql(str(path), key)).to_arrow_table()


def test_final_table_equals_the_replayed_changelog(tmp_path: Path) -> None:
    log, want = changelog(3000, 200, seed=1)
    sink = rs.sinks.parquet(tmp_path, mode="upsert", key=["k"], kind_column="op")
    w = sink.open(0, 1)
    for batch in log.drop_columns(["ver"]).to_batches(max_chunksize=97):
        w.write(batch)
    w.close()
    got = rs.read_upsert(tmp_path)
    assert got.column_names == ["k", "name", "v"]
    assert as_dict(got) == want
    assert got.column("k").to_pylist() == sorted(want)
    assert as_dict(duckdb_final(tmp_path, ["k"])) == want


def test_order_by_a_version_across_instances_in_any_arrival_order(tmp_path: Path) -> None:
    """Changes spread over 3 instances and shuffled: the version column orders them."""
    log, want = changelog(2000, 100, seed=2)
    log = log.take(pa.array(np.random.default_rng(3).permutation(log.num_rows)))
    sink = rs.sinks.parquet(tmp_path, mode="upsert", key=["k"], order_by="ver", kind_column="op")
    writers = [sink.open(i, 3) for i in range(3)]
    for j, batch in enumerate(log.to_batches(max_chunksize=50)):
        writers[j % 3].write(batch)
    for w in writers:
        w.close()
    assert as_dict(rs.read_upsert(tmp_path)) == want
    assert as_dict(duckdb_final(tmp_path, ["k"])) == want


def test_two_phase_commit_failure_restore_and_replay(tmp_path: Path) -> None:
    """Checkpoint 1 committed, checkpoint 2 pre-committed but never completed, a failure; the
    restored writer (state of checkpoint 1) gets the rows after checkpoint 1 again: the final
    table equals the changelog's, and the uncommitted rows left no trace."""
    log, want = changelog(1500, 80, seed=4)
    log = log.drop_columns(["ver"])
    batches = log.to_batches(max_chunksize=100)
    sink = rs.sinks.parquet(tmp_path, mode="upsert", key=["k"], kind_column="op")
    w = sink.open(0, 1)
    for b in batches[:5]:
        w.write(b)
    state1 = w.pre_commit(1)
    w.commit(1)
    for b in batches[5:9]:
        w.write(b)
    w.pre_commit(2)  # never completed
    for b in batches[9:11]:
        w.write(b)
    w.abort()
    w = sink.open(0, 1)
    w.restore(state1)
    for b in batches[5:]:  # the sources replay from checkpoint 1
        w.write(b)
    w.close()
    assert as_dict(rs.read_upsert(tmp_path)) == want
    assert as_dict(duckdb_final(tmp_path, ["k"])) == want
    seq = duckdb.sql(f"SELECT _seq FROM read_parquet('{tmp_path}/*.parquet')").fetchnumpy()
    assert np.array_equal(np.sort(seq["_seq"]), np.arange(len(seq["_seq"])))  # no gap, no twin


_TOTAL = {"total": rs.ValueState(int, default=0), "version": rs.ValueState(int, default=0)}


@rs.keyed_batches(name="running_total", state=_TOTAL)
def running_total(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    """Per key, the sum of its values so far and a version, one row per key and batch."""
    v = batch.records.column("v").to_numpy()
    total = state.total.get(batch.keys) + np.add.reduceat(v, batch.offsets[:-1])
    version = state.version.get(batch.keys) + 1
    state.total.put(batch.keys, total)
    state.version.put(batch.keys, version)
    return batch.output({"total": total, "version": version})


@pytest.mark.parametrize(("sink_parallelism", "order_by"), [(1, None), (2, "version")])
def test_dataflow_updating_sums_read_back(
    tmp_path: Path, sink_parallelism: int, order_by: str | None
) -> None:
    rng = np.random.default_rng(5)
    data = pa.table({"k": rng.integers(0, 300, 20_000), "v": rng.integers(-9, 10, 20_000)})
    flow = rs.Dataflow("upsert-sums")
    totals = flow.source(rs.sources.from_table(data)).key_by("k").apply(running_total)
    out = tmp_path / "out"
    sink = rs.sinks.parquet(out, mode="upsert", key=["k"], order_by=order_by)
    totals.sink(sink, name="totals", parallelism=sink_parallelism)
    config = rs.RuntimeConfig(batch_rows=700, source_batch_rows=700)
    asyncio.run(run_local(flow, {"running_total": 3}, state_dir=str(tmp_path), config=config))
    want = duckdb.sql(
        "SELECT k, sum(v)::BIGINT AS total FROM data GROUP BY k ORDER BY k"
    ).to_arrow_table()
    got = rs.read_upsert(out).select(["k", "total"])
    assert got.equals(want)
    assert duckdb_final(out, ["k"]).select(["k", "total"]).sort_by("k").equals(want)


def test_bad_specs_and_rows_are_refused(tmp_path: Path) -> None:
    with pytest.raises(rs.ConfigError, match="non-empty list"):
        rs.sinks.parquet(tmp_path, mode="upsert")
    with pytest.raises(rs.ConfigError, match="'append' or 'upsert'"):
        rs.sinks.parquet(tmp_path, mode="retract", key=["k"])
    with pytest.raises(rs.ConfigError, match="mode='upsert'"):
        rs.sinks.parquet(tmp_path, key=["k"])
    with pytest.raises(rs.ConfigError, match="written by the upsert sink"):
        rs.sinks.parquet(tmp_path, mode="upsert", key=["_seq"])
    with pytest.raises(rs.ConfigError, match="parallelism 1"):
        rs.sinks.parquet(tmp_path, mode="upsert", key=["k"]).open(0, 2)
    w = rs.sinks.parquet(tmp_path, mode="upsert", key=["k"], kind_column="op").open(0, 1)
    with pytest.raises(rs.SchemaError, match=r"no column \['op'\]"):
        w.write(pa.record_batch({"k": [1]}))
    with pytest.raises(rs.SchemaError, match=r"values \['\+X'\]"):
        w.write(pa.record_batch({"k": [1, 2], "op": ["+I", "+X"]}))
    w.abort()
    w = rs.sinks.parquet(tmp_path, mode="upsert", key=["k"], order_by="ver").open(0, 2)
    with pytest.raises(rs.SchemaError, match="integer or timestamp"):
        w.write(pa.record_batch({"k": [1], "ver": [1.5]}))
    w.abort()
    (tmp_path / "empty").mkdir()
    assert rs.read_upsert(tmp_path / "empty").num_columns == 0  # nothing published
    plain = rs.sinks.parquet(tmp_path / "plain").open(0, 1)
    plain.write(pa.record_batch({"k": [1]}))
    plain.close()
    with pytest.raises(rs.SchemaError, match="no upsert key"):
        rs.read_upsert(tmp_path / "plain")
    with pytest.raises(rs.SchemaError, match="_change"):
        rs.read_upsert(tmp_path / "plain", key=["k"])
