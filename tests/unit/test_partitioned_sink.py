"""The partitioned Parquet sink (``partition_by``) without Ray: splitting batches into Hive-style
folders, two-phase commit across a crash (restore from a pre-commit state, abort), several
instances, the cap on open parts, and bad options. The reader is ``pyarrow.dataset`` with hive
partitioning (and DuckDB's ``hive_partitioning``); the oracle is the input rows, compared as
sorted tuples (every row exactly once)."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pytest

import raystream as rs
from raystream.errors import ConfigError, SchemaError
from raystream.partitioned_sink import split_by_partition

PARTS = pa.schema([("dt", pa.string()), ("hm", pa.string())])


def batch(seed: int, n: int = 500, days: int = 2, minutes: int = 5) -> pa.RecordBatch:
    """Bids-like rows; ``v`` numbers them uniquely across seeds."""
    rng = np.random.default_rng(seed)
    day = rng.integers(0, days, n)
    minute = rng.integers(0, minutes, n)
    return pa.record_batch(
        {
            "v": np.arange(n, dtype=np.int64) + seed * 1_000_000,
            "price": rng.integers(1, 1000, n),
            "dt": [f"2015-07-{15 + d:02d}" for d in day],
            "hm": [f"21:{m:02d}" for m in minute],
        }
    )


def rows_of(batches: list[pa.RecordBatch]) -> list[tuple[Any, ...]]:
    table = pa.Table.from_batches(batches)
    return sorted(
        zip(*(table.column(c).to_pylist() for c in ("v", "price", "dt", "hm")), strict=True)
    )


def read_back(path: Path) -> list[tuple[Any, ...]]:
    """Every visible row of the folder, read as pyarrow.dataset reads a Hive-partitioned one."""
    part = ds.partitioning(PARTS, flavor="hive")
    table = ds.dataset(str(path), format="parquet", partitioning=part).to_table()
    return rows_of(table.to_batches()) if table.num_rows else []


def visible_files(path: Path) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(here, f), path)
        for here, _, files in os.walk(path)
        for f in files
        if f.endswith(".parquet") and not f.startswith(".")
    )


def sink(path: Path, **options: Any) -> Any:
    return rs.sinks.parquet(path, partition_by=["dt", "hm"], **options)


# ---- splitting --------------------------------------------------------------------------


def test_split_groups_rows_by_value_and_keeps_their_order() -> None:
    b = batch(1, n=2000, days=3, minutes=7)
    got = split_by_partition(b, ("dt", "hm"))
    expected: dict[str, list[int]] = {}  # oracle: a plain loop over the rows
    for v, dt, hm in zip(
        b.column("v").to_pylist(),
        b.column("dt").to_pylist(),
        b.column("hm").to_pylist(),
        strict=True,
    ):
        expected.setdefault(f"dt={dt}/hm={hm.replace(':', '%3A')}", []).append(v)
    assert [f for f, _ in got] == list(expected)  # in the order of each folder's first row
    for folder, rows in got:
        assert rows.schema.names == ["v", "price"]
        assert rows.column("v").to_pylist() == expected[folder]


def test_split_names_folders_of_each_supported_type() -> None:
    b = pa.record_batch(
        {
            "s": ["a/b", "", None, "x=y"],
            "i": pa.array([1, -2, None, 3], pa.int16()),
            "b": [True, False, None, True],
            "d": [datetime.date(2015, 7, 15), None, datetime.date(2015, 7, 16), None],
            "v": [0, 1, 2, 3],
        }
    )
    folders = [f for f, _ in split_by_partition(b, ("s", "i", "b", "d"))]
    assert folders == [
        "s=a%2Fb/i=1/b=true/d=2015-07-15",
        "s=__HIVE_DEFAULT_PARTITION__/i=-2/b=false/d=__HIVE_DEFAULT_PARTITION__",
        "s=__HIVE_DEFAULT_PARTITION__/i=__HIVE_DEFAULT_PARTITION__/b=__HIVE_DEFAULT_PARTITION__"
        "/d=2015-07-16",
        "s=x%3Dy/i=3/b=true/d=__HIVE_DEFAULT_PARTITION__",
    ]
    dict_col = pa.record_batch({"s": pa.array(["q", "r", "q"]).dictionary_encode(), "v": [1, 2, 3]})
    assert [(f, r.column("v").to_pylist()) for f, r in split_by_partition(dict_col, ("s",))] == [
        ("s=q", [1, 3]),
        ("s=r", [2]),
    ]


# ---- writing ----------------------------------------------------------------------------


def test_without_checkpoints_every_row_lands_in_its_folder(tmp_path: Path) -> None:
    batches = [batch(s) for s in range(4)]
    w = sink(tmp_path).open(0, 1)
    for b in batches:
        w.write(b)
    result = w.close()
    assert read_back(tmp_path) == rows_of(batches)
    assert result.rows == sum(b.num_rows for b in batches)
    assert sorted(os.path.relpath(p, tmp_path) for p in result.paths) == visible_files(tmp_path)
    # every file is in the folder of its values, without the partition columns
    for rel in visible_files(tmp_path):
        dt, hm, _ = rel.split("/")
        assert dt.startswith("dt=2015-07-") and hm.startswith("hm=21%3A")
    # DuckDB reads the same rows back, the values decoded
    got = duckdb.sql(
        f"SELECT v, price, dt, hm FROM read_parquet('{tmp_path}/**/*.parquet', "
        "hive_partitioning=true, hive_types_autocast=false)"
    ).fetchall()
    assert sorted(got) == rows_of(batches)


def test_open_parts_stay_under_the_cap_and_rows_are_exactly_once(tmp_path: Path) -> None:
    batches = [batch(s, n=300, days=3, minutes=10) for s in range(5)]
    w = sink(tmp_path, max_open_partitions=4).open(0, 1)
    for i, b in enumerate(batches):
        w.write(b)
        assert w.open_partitions <= 4
        if i == 2:
            state = w.pre_commit(1)
            assert w.open_partitions == 0
            assert state["partitions"], "a checkpoint after writes lists its pending parts"
            w.commit(1)
    w.close()
    assert read_back(tmp_path) == rows_of(batches)


def test_restore_publishes_the_checkpoint_and_drops_the_rest(tmp_path: Path) -> None:
    """Crash after checkpoint 2 was pre-committed (not committed), with parts of checkpoint 3
    pending and open parts, some closed by the cap: restoring checkpoint 2 and replaying what
    came after it gives every row exactly once."""
    # after checkpoint 2 come new days: folders that checkpoint 2 does not list
    batches = [batch(s, n=400, days=2 if s < 3 else 4, minutes=6) for s in range(6)]
    first = sink(tmp_path, max_open_partitions=3).open(0, 1)
    first.write(batches[0])
    first.pre_commit(1)
    first.commit(1)
    first.write(batches[1])
    first.write(batches[2])
    state2 = first.pre_commit(2)  # the last complete checkpoint; its commit never ran
    first.write(batches[3])
    first.pre_commit(3)  # pre-committed, the checkpoint never completed
    first.write(batches[4])
    first.abort()  # the crash
    assert read_back(tmp_path) == rows_of(batches[:1])  # only checkpoint 1 is visible

    second = sink(tmp_path, max_open_partitions=3).open(0, 1)
    second.restore(state2)
    assert read_back(tmp_path) == rows_of(batches[:3])
    for b in batches[3:]:  # the sources replay from checkpoint 2
        second.write(b)
    second.close()
    assert read_back(tmp_path) == rows_of(batches)
    hidden = [f for _, _, files in os.walk(tmp_path) for f in files if f.startswith(".")]
    assert hidden == [], f"left behind: {hidden}"


def test_restore_without_a_checkpoint_and_abort_leave_nothing(tmp_path: Path) -> None:
    w = sink(tmp_path, max_open_partitions=2).open(0, 1)
    w.write(batch(1))
    w.pre_commit(1)  # never completed
    w.write(batch(2))
    w.abort()
    again = sink(tmp_path).open(0, 1)
    again.restore(None)
    assert read_back(tmp_path) == []
    assert [f for _, _, files in os.walk(tmp_path) for f in files] == []
    again.write(batch(3))
    again.close()
    assert read_back(tmp_path) == rows_of([batch(3)])


def test_restore_leaves_other_instances_alone(tmp_path: Path) -> None:
    spec = sink(tmp_path)
    writers = [spec.open(i, 3) for i in range(3)]
    batches = [batch(10 + i) for i in range(3)]
    states = []
    for w, b in zip(writers, batches, strict=True):
        w.write(b)
        states.append(w.pre_commit(1))
    for w in writers:
        w.commit(1)
    late = batch(20)
    writers[0].write(late)
    writers[0].abort()
    writers[1].close()
    writers[2].close()
    again = spec.open(0, 3)
    again.restore(states[0])
    again.write(late)
    again.close()
    assert read_back(tmp_path) == rows_of([*batches, late])


def test_rolling_by_size_inside_partitions(tmp_path: Path) -> None:
    batches = [batch(s, n=2000, days=1, minutes=2) for s in range(4)]
    w = sink(tmp_path, max_file_bytes=2_000).open(0, 1)
    for b in batches[:2]:
        w.write(b)
    state = w.pre_commit(1)
    assert all(len(s["pending"]) >= 2 for s in state["partitions"].values())
    w.commit(1)
    for b in batches[2:]:
        w.write(b)
    w.close()
    assert read_back(tmp_path) == rows_of(batches)


def test_remote_filesystem_path(tmp_path: Path) -> None:
    """Through the object-store code path (staging, uploads, listing): a pyarrow filesystem."""
    fs = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    spec = rs.sinks.parquet("out", partition_by=["dt", "hm"], filesystem=fs, max_open_partitions=2)
    batches = [batch(s) for s in range(3)]
    w = spec.open(0, 1)
    w.write(batches[0])
    state, upload = w.pre_commit_deferred(1)
    assert upload is not None
    upload()
    w.write(batches[1])
    w.pre_commit(2)
    w.abort()
    again = spec.open(0, 1)
    again.restore(state)
    again.write(batches[1])
    again.write(batches[2])
    again.close()
    assert read_back(tmp_path / "out") == rows_of(batches)


# ---- bad options ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"partition_by": "dt"}, "list of column names"),
        ({"partition_by": ["dt", "dt"]}, "twice"),
        ({"partition_by": ["a/b"]}, "cannot name a folder"),
        ({"partition_by": ["_dt"]}, "cannot name a folder"),
        ({"partition_by": ["dt"], "max_open_partitions": 0}, "max_open_partitions"),
        (
            {"partition_by": ["dt"], "mode": "upsert", "key": ["v"]},
            "not supported with mode='upsert'",
        ),
    ],
)
def test_bad_partition_options(tmp_path: Path, options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        rs.sinks.parquet(tmp_path, **options)


@pytest.mark.parametrize(
    ("columns", "match"),
    [
        (["day"], r"not in the stream, which has columns \['v', 'price', 'dt', 'hm', 'ts'\]"),
        (["ts"], "has type timestamp.*expected string, integer, boolean or date"),
    ],
)
def test_bad_partition_columns(tmp_path: Path, columns: list[str], match: str) -> None:
    b = batch(1)
    b = b.append_column("ts", pa.array(np.zeros(b.num_rows, "datetime64[ms]")))
    spec = rs.sinks.parquet(tmp_path, partition_by=columns)
    with pytest.raises(SchemaError, match=match):
        spec.check_schema(b.schema)  # what Stream.sink calls when the schema is known
    w = spec.open(0, 1)
    with pytest.raises(SchemaError, match=match):
        w.write(b)
    w.abort()


def test_all_columns_partitioned_is_refused(tmp_path: Path) -> None:
    spec = rs.sinks.parquet(tmp_path, partition_by=["dt", "hm"])
    with pytest.raises(SchemaError, match="at least one more column"):
        spec.check_schema(PARTS)


def test_sink_checks_partition_columns_when_the_flow_is_defined(tmp_path: Path) -> None:
    src = tmp_path / "in.parquet"
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_batches([batch(1)]), src)
    flow = rs.Dataflow("partitioned")
    stream = flow.source(rs.sources.parquet(str(src)))
    with pytest.raises(SchemaError, match="not in the stream"):
        stream.sink(rs.sinks.parquet(tmp_path / "out", partition_by=["day"]))


def test_s3_restore_lists_every_partition_folder() -> None:
    """On S3 (a local moto server): folders are key prefixes, listed recursively by restore;
    a folder the restored checkpoint does not list is cleaned, every row is there once."""
    pytest.importorskip("moto.server")
    from tests._s3 import local_s3_bucket

    with local_s3_bucket("parts") as endpoint:
        uri = f"s3://test:test@parts/out?endpoint_override={endpoint}&scheme=http&region=us-east-1"
        spec = rs.sinks.parquet(uri, partition_by=["dt", "hm"], max_open_partitions=2)
        early = [batch(s, n=200, days=1, minutes=3) for s in range(2)]
        late = [batch(s, n=200, days=3, minutes=3) for s in range(2, 4)]  # new folders
        first = spec.open(0, 1)
        for b in early:
            first.write(b)
        state = first.pre_commit(1)
        first.write(late[0])
        first.pre_commit(2)
        first.abort()
        again = spec.open(0, 1)
        again.restore(state)
        for b in late:
            again.write(b)
        again.close()
        fs, root = pafs.FileSystem.from_uri(uri)
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
        names = [i.path for i in infos if i.type == pafs.FileType.File]
        assert not [n for n in names if n.rsplit("/", 1)[1].startswith(".")], names
        table = ds.dataset(
            root,
            filesystem=fs,
            format="parquet",
            partitioning=ds.partitioning(PARTS, flavor="hive"),
        ).to_table()
        assert rows_of(table.to_batches()) == rows_of([*early, *late])
