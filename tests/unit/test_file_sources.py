"""File sources (raystream.files): folders, hive partitions, globs, CSV, JSON lines, splitting
across instances, positions and rewinds, bad input. The oracle is DuckDB reading the same files.
No Ray."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from types import SimpleNamespace

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

import raystream as rs
from raystream.errors import RaystreamError, SchemaError, SourceError
from raystream.runtime import snapshots


def read_all(src: object, index: int = 0, parallelism: int = 1, max_rows: int = 97) -> pa.Table:
    reader = src.open(index, parallelism)  # type: ignore[attr-defined]
    batches = []
    while (b := reader.read(max_rows)) is not None:
        assert 0 < b.num_rows <= max_rows
        batches.append(b)
    reader.close()
    return pa.Table.from_batches(batches, schema=src.schema())  # type: ignore[attr-defined]


def union(src: object, parallelism: int) -> pa.Table:
    return pa.concat_tables(read_all(src, i, parallelism) for i in range(parallelism))


def rows(table: pa.Table, columns: list[str]) -> list[tuple[object, ...]]:
    return sorted(zip(*(table.column(c).to_pylist() for c in columns), strict=True))


def oracle(sql: str, columns: list[str]) -> list[tuple[object, ...]]:
    got = duckdb.sql(sql).to_arrow_table()
    return rows(got, columns)


def hive_tree(root: Path, seed: int = 0) -> int:
    """Parquet files under year=/month= folders (plus files a reader must skip); rows written."""
    rng = np.random.default_rng(seed)
    total = 0
    for year in (2024, 2025):
        for month in (1, 2, 3):
            d = root / f"year={year}" / f"month={month}"
            d.mkdir(parents=True)
            for part in range(2):
                n = int(rng.integers(50, 300))
                ids = np.arange(total, total + n, dtype=np.int64)
                t = pa.table({"id": ids, "v": rng.random(n), "name": [f"n{i}" for i in ids]})
                pq.write_table(t, d / f"part-{part}.parquet", row_group_size=64)
                total += n
    (root / "_SUCCESS").write_text("")
    (root / "year=2024" / ".hidden.parquet").write_bytes(b"not parquet")
    (root / "_tmp").mkdir()
    (root / "_tmp" / "x.parquet").write_bytes(b"not parquet either")
    return total


# --------------------------------------------------------------------------------------------
# Parquet folders, partitions, globs


@pytest.mark.parametrize("parallelism", [1, 2, 5])
def test_recursive_hive_folder_matches_duckdb(tmp_path: Path, parallelism: int) -> None:
    total = hive_tree(tmp_path)
    src = rs.sources.parquet(tmp_path, batch_rows=50)
    assert src.schema().names == ["id", "v", "name", "year", "month"]
    got = union(src, parallelism)
    cols = ["id", "v", "name", "year", "month"]
    want = oracle(
        f"select {', '.join(cols)} from read_parquet('{tmp_path}/*/*/*.parquet', "
        "hive_partitioning=true)",
        cols,
    )
    assert got.num_rows == total == len(want)
    assert rows(got, cols) == want


def test_instances_split_row_groups_exactly_once(tmp_path: Path) -> None:
    hive_tree(tmp_path)
    src = rs.sources.parquet(tmp_path)
    per_instance = [set(range(i, len(src.units), 3)) for i in range(3)]
    ids = [set(read_all(src, i, 3)["id"].to_pylist()) for i in range(3)]
    assert not (ids[0] & ids[1]) and not (ids[0] & ids[2]) and not (ids[1] & ids[2])
    # each instance's rows are exactly the rows of its units, by pyarrow reading them directly
    for i in range(3):
        want: set[int] = set()
        for u in per_instance[i]:
            f, rg, n = src.units[u]
            t = pq.ParquetFile(src.files[f]).read_row_group(rg, columns=["id"])
            assert t.num_rows == n
            want |= set(t["id"].to_pylist())
        assert ids[i] == want


@pytest.mark.parametrize(
    ("pattern", "where"),
    [
        ("**/*.parquet", "year=*/month=*/*.parquet"),
        ("year=2025/*/part-1.parquet", "year=2025/*/part-1.parquet"),
        ("year=202[4]/month=?/*.parquet", "year=2024/month=*/*.parquet"),
    ],
)
def test_globs_match_duckdb(tmp_path: Path, pattern: str, where: str) -> None:
    hive_tree(tmp_path)
    src = rs.sources.parquet(f"{tmp_path}/{pattern}")
    cols = ["id", "year", "month"]
    want = oracle(
        f"select {', '.join(cols)} from read_parquet('{tmp_path}/{where}', hive_partitioning=true)",
        cols,
    )
    assert rows(union(src, 2), cols) == want


def test_partitioning_off_and_typed(tmp_path: Path) -> None:
    import pyarrow.dataset as ds

    hive_tree(tmp_path)
    plain = rs.sources.parquet(tmp_path, partitioning=None)
    assert plain.schema().names == ["id", "v", "name"]
    typed = rs.sources.parquet(
        tmp_path,
        partitioning=ds.partitioning(
            pa.schema([("year", pa.int16()), ("month", pa.string())]), flavor="hive"
        ),
    )
    t = read_all(typed)
    assert t.schema.field("year").type == pa.int16() and t.schema.field("month").type == pa.string()
    assert set(t["month"].to_pylist()) == {"1", "2", "3"}


def test_columns_projection_includes_partition_columns(tmp_path: Path) -> None:
    hive_tree(tmp_path)
    src = rs.sources.parquet(tmp_path, columns=["month", "id"])
    got = union(src, 2)
    assert got.schema.names == ["month", "id"]
    want = oracle(
        f"select month, id from read_parquet('{tmp_path}/*/*/*.parquet', hive_partitioning=true)",
        ["month", "id"],
    )
    assert rows(got, ["month", "id"]) == want


def test_spec_pickles_with_partitions(tmp_path: Path) -> None:
    hive_tree(tmp_path)
    src = rs.sources.parquet(tmp_path)
    again = pickle.loads(pickle.dumps(src))
    assert read_all(again, 1, 2).equals(read_all(src, 1, 2))


# --------------------------------------------------------------------------------------------
# CSV and JSON lines


def write_csv_tree(root: Path) -> None:
    rng = np.random.default_rng(3)
    start = 0
    for region in ("eu", "us"):
        d = root / f"region={region}"
        d.mkdir(parents=True)
        for part in range(3):
            n = int(rng.integers(20, 120))
            t = pa.table(
                {
                    "id": np.arange(start, start + n, dtype=np.int64),
                    "amount": rng.integers(0, 1000, n),
                    "label": [f"x{i % 5}" for i in range(n)],
                }
            )
            pcsv.write_csv(t, d / f"f{part}.csv")
            start += n


@pytest.mark.parametrize("parallelism", [1, 4])
def test_csv_folder_with_partitions_matches_duckdb(tmp_path: Path, parallelism: int) -> None:
    write_csv_tree(tmp_path)
    src = rs.sources.csv(tmp_path, batch_rows=40)
    assert src.schema().names == ["id", "amount", "label", "region"]
    assert len(src.units) == 6  # one unit per file
    cols = ["id", "amount", "label", "region"]
    want = oracle(
        f"select {', '.join(cols)} from read_csv('{tmp_path}/*/*.csv', hive_partitioning=true)",
        cols,
    )
    assert rows(union(src, parallelism), cols) == want


def test_csv_declared_schema(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("id,amount\n1,\n2,5\n")
    (tmp_path / "b.csv").write_text("id,amount\n3,\n")  # amount all empty: inferred as null
    with pytest.raises(SchemaError, match=r"a\.csv.*b\.csv.*amount: int64 vs null.*schema="):
        rs.sources.csv(tmp_path)
    schema = pa.schema([("id", pa.int64()), ("amount", pa.float64())])
    got = read_all(rs.sources.csv(tmp_path, schema=schema))
    assert got.schema == schema
    want = duckdb.sql(
        f"select id, amount::double as amount from read_csv('{tmp_path}/*.csv') order by id"
    ).to_arrow_table()
    assert got.sort_by("id").to_pylist() == want.to_pylist()


def test_json_lines_glob_matches_duckdb(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    for i in range(3):
        n = 40 + i
        keys = rng.integers(0, 9, n)
        lines = [f'{{"key": {int(k)}, "seq": {j}, "tag": "t{i}"}}' for j, k in enumerate(keys)]
        (tmp_path / f"events-{i}.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "notes.txt").write_text("ignored by the glob")
    src = rs.sources.json(f"{tmp_path}/events-*.jsonl")
    cols = ["key", "seq", "tag"]
    want = oracle(
        f"select key, seq, tag from read_json('{tmp_path}/events-*.jsonl', "
        "format='newline_delimited')",
        cols,
    )
    assert rows(union(src, 2), cols) == want


# --------------------------------------------------------------------------------------------
# positions, skips, rewinds


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_skip_then_read_equals_reading_on(tmp_path: Path, fmt: str) -> None:
    if fmt == "parquet":
        hive_tree(tmp_path)
        src = rs.sources.parquet(tmp_path, batch_rows=33)
    else:
        write_csv_tree(tmp_path)
        src = rs.sources.csv(tmp_path, batch_rows=33)
    full = read_all(src, 1, 2)
    for k in (0, 1, 63, 64, 65, 200, full.num_rows - 1, full.num_rows, full.num_rows + 5):
        reader = src.open(1, 2)
        skipped = reader.skip(k)
        assert skipped == min(k, full.num_rows)
        rest = []
        while (b := reader.read(50)) is not None:
            rest.append(b)
        got = pa.Table.from_batches(rest, schema=src.schema())
        assert got.equals(full.slice(min(k, full.num_rows)))


def test_checkpoint_position_rewinds_a_recovering_instance(tmp_path: Path) -> None:
    hive_tree(tmp_path)
    src = rs.sources.parquet(tmp_path, batch_rows=40)
    full = read_all(src, 0, 2)
    # the running instance: read some batches, then a checkpoint barrier records its position
    running = SimpleNamespace(reader=src.open(0, 2), rows_emitted=0)
    for _ in range(7):
        running.rows_emitted += running.reader.read(45).num_rows
    state = snapshots.source_state(running)["source_state"]  # type: ignore[arg-type]
    pos = state["position"]
    assert pos["file"] == src.files[src.units[pos["unit"]][0]]
    assert pos["unit"] % 2 == 0  # one of instance 0's units
    # the recovered instance: a new reader rewound to the checkpoint, then it reads on
    recovered = SimpleNamespace(reader=src.open(0, 2), rows_emitted=0, _source_done=False)
    snapshots.rewind_source(recovered, {"source": state})  # type: ignore[arg-type]
    assert recovered.rows_emitted == state["offset"] == 7 * 45
    assert recovered.reader.position() == pos
    rest = []
    while (b := recovered.reader.read(64)) is not None:
        rest.append(b)
    assert pa.Table.from_batches(rest).equals(full.slice(7 * 45))


def test_recovery_against_a_changed_listing_fails_clearly(tmp_path: Path) -> None:
    hive_tree(tmp_path)
    src = rs.sources.parquet(tmp_path)
    inst = SimpleNamespace(reader=src.open(0, 1), rows_emitted=0)
    inst.rows_emitted = inst.reader.read(10).num_rows
    state = snapshots.source_state(inst)["source_state"]  # type: ignore[arg-type]
    pq.write_table(
        pa.table({"id": [1], "v": [0.5], "name": ["z"]}),
        tmp_path / "year=2024" / "month=1" / "late.parquet",
    )
    again = rs.sources.parquet(tmp_path)
    fresh = SimpleNamespace(reader=again.open(0, 1), rows_emitted=0, _source_done=False)
    with pytest.raises(SourceError, match="lists other files than when the checkpoint"):
        snapshots.rewind_source(fresh, {"source": state})  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# bad input


def test_no_file_matches_a_glob(tmp_path: Path) -> None:
    hive_tree(tmp_path)
    with pytest.raises(SourceError, match=r"no file matches .*year=2030.*Parquet"):
        rs.sources.parquet(f"{tmp_path}/year=2030/**/*.parquet")
    with pytest.raises(SourceError, match=r"no \*\.csv, .* files"):
        rs.sources.csv(tmp_path)


def test_parquet_schemas_differ_in_subfolders(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pq.write_table(pa.table({"id": [1], "v": [1.0]}), tmp_path / "a" / "x.parquet")
    pq.write_table(pa.table({"id": [2]}), tmp_path / "b" / "y.parquet")
    with pytest.raises(
        SchemaError, match=r"a/x\.parquet.*b/y\.parquet.*only in the first: \['v'\]"
    ):
        rs.sources.parquet(tmp_path)


def test_file_damaged_after_listing_names_the_file(tmp_path: Path) -> None:
    write_csv_tree(tmp_path)
    src = rs.sources.csv(tmp_path)
    victim = src.files[-1]
    Path(victim).write_text("id,amount,label\n1,not-a-number,x\n")
    reader = src.open(0, 1)
    with pytest.raises(SourceError, match=rf"cannot read '{victim}' as csv") as info:
        while reader.read(1000) is not None:
            pass
    assert isinstance(info.value, RaystreamError)


def test_unknown_filesystem_scheme(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="cannot open the filesystem of 'nope://x/y'"):
        rs.sources.parquet("nope://x/y")


def test_relative_paths_resolve_against_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pq.write_table(pa.table({"k": [1, 2]}), tmp_path / "r.parquet")
    monkeypatch.chdir(tmp_path)
    src = rs.sources.parquet("r.parquet")
    assert src.files == (os.path.join(str(tmp_path), "r.parquet"),)
    assert read_all(src)["k"].to_pylist() == [1, 2]


def test_each_source_instance_warms_its_reader_before_the_run(tmp_path: Path) -> None:
    """A source with ``warm_up()`` (a file source: its format's imports) gets it called once
    per instance when the instance is built, before any read; the rows are unchanged."""
    import asyncio
    import dataclasses
    import tempfile

    from raystream.runtime.local import run_local

    calls: list[str] = []

    @dataclasses.dataclass(frozen=True)
    class Recorded:
        inner: object

        def schema(self) -> pa.Schema:
            return self.inner.schema()  # type: ignore[attr-defined,no-any-return]

        def open(self, index: int, parallelism: int) -> object:
            calls.append(f"open {index}")
            return self.inner.open(index, parallelism)  # type: ignore[attr-defined]

        @property
        def rate_eps(self) -> float:
            return 0.0

        def describe(self) -> str:
            return "recorded"

        def warm_up(self) -> None:
            calls.append("warm_up")
            self.inner.warm_up()  # type: ignore[attr-defined]

    t = pa.table({"id": np.arange(1000, dtype=np.int64)})
    pq.write_table(t, tmp_path / "t.parquet", row_group_size=100)
    flow = rs.Dataflow("warm")
    flow.source(Recorded(rs.sources.parquet(tmp_path / "t.parquet")), name="src").sink(
        rs.sinks.collect(), name="out"
    )
    out = asyncio.run(run_local(flow, {"src": 2}, state_dir=tempfile.mkdtemp()))
    assert sorted(out["out"].column("id").to_pylist()) == list(range(1000))
    assert calls[:2] == ["warm_up", "warm_up"]
    assert sorted(calls[2:]) == ["open 0", "open 1"]
