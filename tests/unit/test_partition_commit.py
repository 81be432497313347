"""Partition commit (``partition_commit=`` of a partitioned Parquet sink) without Ray: the policy
object and its errors, parsing partition times, the committer's triggers, and the controller's
side (:class:`JobPartitionCommits`) driven by real partitioned sink writers through simulated
checkpoints. The oracle for "a committed folder is complete" is DuckDB over the whole input,
compared with DuckDB over the files published at the moment of the commit."""

from __future__ import annotations

import asyncio
import datetime
import os
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest

import raystream as rs
from raystream.dataflow import Step
from raystream.errors import ConfigError
from raystream.partition_commit import (
    CommittedPartition,
    JobPartitionCommits,
    PartitionTimeError,
    folder_values,
    written_partitions,
)

Q10 = {"time_pattern": "$dt $hm:00", "delay_ms": 60_000}
MINUTE = 60_000
T0 = 1_600_000_000_000 - 1_600_000_000_000 % MINUTE  # 2020-09-13 12:26:00 UTC


def utc_ms(text: str) -> int:
    stamp = datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S")
    return int(stamp.replace(tzinfo=datetime.UTC).timestamp() * 1000)


# ---- the policy object -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("folder", "expected"),
    [
        ("dt=2020-09-13/hm=12%3A26", "2020-09-13 12:26:00"),
        ("dt=2020-12-31/hm=23%3A59", "2020-12-31 23:59:00"),
        ("dt=2021-01-01/hm=00%3A00", "2021-01-01 00:00:00"),
    ],
)
def test_partition_time_of_q10_folders(folder: str, expected: str) -> None:
    pc = rs.sinks.partition_commit("partition-time", **Q10)
    assert pc.partition_time_ms(folder, ("dt", "hm")) == utc_ms(expected)


def test_partition_time_default_pattern_format_and_zone() -> None:
    # no pattern: the first partition column (Flink's default), a date alone is its midnight
    pc = rs.sinks.partition_commit()
    assert pc.partition_time_ms("dt=2015-07-15/h=3", ("dt", "h")) == utc_ms("2015-07-15 00:00:00")
    # another format, a number column, a time zone (UTC+2 in July)
    pc = rs.sinks.partition_commit(
        time_pattern="$day-$h", time_format="%Y%m%d-%H", time_zone="Europe/Berlin"
    )
    got = pc.partition_time_ms("day=20150715/h=3", ("day", "h"))
    assert got == utc_ms("2015-07-15 01:00:00")


def test_folder_values_decode_escapes_and_default() -> None:
    assert folder_values("dt=2020-09-13/hm=12%3A26") == {"dt": "2020-09-13", "hm": "12:26"}
    assert folder_values("dt=__HIVE_DEFAULT_PARTITION__") == {"dt": None}


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"trigger": "watermark"}, "trigger must be one of"),
        ({"delay_ms": -1}, "delay_ms must be an int >= 0"),
        ({"delay_ms": 1.5}, "delay_ms must be an int >= 0"),
        ({"delay_ms": True}, "delay_ms must be an int >= 0"),
        ({"time_pattern": "dt hm"}, "naming partition columns as $column"),
        ({"trigger": "process-time", "time_pattern": "$dt"}, "time_pattern is for"),
        ({"time_zone": "Mars/Olympus"}, "not a known time zone"),
        ({"success_file": "a/b"}, "success_file must be a file name"),
        ({"success_file": None}, "no policy"),
        ({"on_commit": 3}, "on_commit must be a function"),
    ],
)
def test_bad_policy_options(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("$", r"\$").replace("(", r"\(")):
        rs.sinks.partition_commit(**kwargs)


def test_pattern_must_name_partition_columns(tmp_path: Path) -> None:
    pc = rs.sinks.partition_commit(time_pattern="$dt $hour:00")
    with pytest.raises(ConfigError, match=r"names \['\$hour'\].*partition_by \['dt', 'hm'\]"):
        rs.sinks.parquet(tmp_path, partition_by=["dt", "hm"], partition_commit=pc)
    with pytest.raises(ConfigError, match="partition_commit needs partition_by"):
        rs.sinks.parquet(tmp_path, partition_commit=rs.sinks.partition_commit())
    with pytest.raises(ConfigError, match="expects rs.sinks.partition_commit"):
        rs.sinks.parquet(tmp_path, partition_by=["dt"], partition_commit="success-file")  # type: ignore[arg-type]
    sink = rs.sinks.parquet(
        tmp_path, partition_by=["dt", "hm"], partition_commit=rs.sinks.partition_commit(**Q10)
    )
    assert "time_pattern='$dt $hm:00', delay_ms=60000" in sink.describe()


def test_a_value_that_does_not_parse_is_reported_and_committed_at_the_end() -> None:
    pc = rs.sinks.partition_commit(**Q10)
    with pytest.raises(PartitionTimeError, match=r"'2020-09-13 1226:00'.*'%Y-%m-%d %H:%M:%S'"):
        pc.partition_time_ms("dt=2020-09-13/hm=1226", ("dt", "hm"))
    c = pc.committer(("dt", "hm"))
    bad = ["dt=2020-09-13/hm=1226", "dt=2020-09-13/hm=__HIVE_DEFAULT_PARTITION__"]
    good = "dt=2020-09-13/hm=12%3A26"
    c.add([*bad, good], now_ms=0)
    assert len(c.errors) == 2
    assert "partition folder 'dt=2020-09-13/hm=1226'" in c.errors[0]
    assert "'2020-09-13 1226:00'" in c.errors[0] and "end of input only" in c.errors[0]
    assert "column 'hm' is null" in c.errors[1]
    assert c.due(2**62, now_ms=0) == [good]  # never by the watermark
    assert c.end_of_input() == sorted(bad)


# ---- the committer's triggers --------------------------------------------------------------


def test_partition_time_trigger_is_strictly_after_time_plus_delay() -> None:
    c = rs.sinks.partition_commit(**Q10).committer(("dt", "hm"))
    a, b = "dt=2020-09-13/hm=12%3A26", "dt=2020-09-13/hm=12%3A27"
    c.add([a, b], now_ms=0)
    assert c.due(None, now_ms=0) == []  # no watermark yet
    assert c.due(T0 + MINUTE, now_ms=0) == []  # = time + delay: not yet (Flink: >)
    assert c.due(T0 + MINUTE + 1, now_ms=0) == [a]
    assert c.due(T0 + MINUTE + 1, now_ms=0) == []  # committed once
    c.add([a], now_ms=0)  # late rows: committed again at once
    assert c.due(T0 + 2 * MINUTE + 1, now_ms=0) == [a, b]
    assert c.pending == {}


def test_process_time_trigger() -> None:
    c = rs.sinks.partition_commit("process-time", delay_ms=1000).committer(("dt",))
    c.add(["dt=x"], now_ms=5000)
    c.add(["dt=x", "dt=y"], now_ms=5500)  # x keeps its first sighting
    assert c.due(None, now_ms=6000) == []
    assert c.due(None, now_ms=6001) == ["dt=x"]
    assert c.due(None, now_ms=6501) == ["dt=y"]
    now = rs.sinks.partition_commit("process-time").committer(("dt",))
    now.add(["dt=z"], now_ms=7)
    assert now.due(None, now_ms=7) == ["dt=z"]  # delay 0: at the first checkpoint


def test_snapshot_and_restore() -> None:
    c = rs.sinks.partition_commit(**Q10).committer(("dt", "hm"))
    c.add(["dt=2020-09-13/hm=12%3A26", "dt=2020-09-13/hm=1226"], now_ms=3)
    again = rs.sinks.partition_commit(**Q10).committer(("dt", "hm"))
    again.restore(c.snapshot())
    assert again.pending == c.pending
    assert again.due(2**62, now_ms=0) == ["dt=2020-09-13/hm=12%3A26"]
    assert len(again.errors) == 1


# ---- the controller's side, with real sink writers -------------------------------------------


def bids(seed: int, n: int, start_ms: int, span_ms: int, jitter_ms: int) -> pa.Table:
    """Rows with event times ``start..start+span`` in arrival order, out of order by up to
    ``jitter_ms``, and their q10 partition columns."""
    rng = np.random.default_rng(seed)
    ts = start_ms + np.sort(rng.integers(0, span_ms, n)) - rng.integers(0, jitter_ms, n)
    stamps = pa.array(ts, pa.timestamp("ms", tz="UTC"))
    return pa.table(
        {
            "v": np.arange(n, dtype=np.int64) + seed * 10_000_000,
            "ts": ts,
            "dt": pa.compute.strftime(stamps, "%Y-%m-%d"),
            "hm": pa.compute.strftime(stamps, "%H:%M"),
        }
    )


def published(root: Path) -> dict[str, list[tuple[int, int]]]:
    """The rows of every folder, read from the visible files (DuckDB, hive partitioning)."""
    if not list(root.rglob("*.parquet")):
        return {}
    rows = duckdb.sql(
        f"select dt, hm, v, ts from read_parquet('{root}/**/*.parquet', hive_partitioning=true) "
        "order by v"
    ).fetchall()
    out: dict[str, list[tuple[int, int]]] = {}
    for dt, hm, v, ts in rows:
        out.setdefault(f"{dt} {hm}", []).append((v, ts))
    return out


def oracle(table: pa.Table) -> dict[str, list[tuple[int, int]]]:
    rows = duckdb.sql(
        "select dt, hm, v, ts from table_ order by v", connection=_with(table)
    ).fetchall()
    out: dict[str, list[tuple[int, int]]] = {}
    for dt, hm, v, ts in rows:
        out.setdefault(f"{dt} {hm}", []).append((v, ts))
    return out


def _with(table: pa.Table) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    con.register("table_", table)
    return con


def success_folders(root: Path) -> set[str]:
    return {
        str(p.parent.relative_to(root)) for p in root.rglob("_SUCCESS")
    }


def key_of(folder: str) -> str:
    values = folder_values(folder)
    return f"{values['dt']} {values['hm']}"


def test_commits_after_checkpoints_only_complete_folders(tmp_path: Path) -> None:
    """Two sink instances, one behind the other (its watermark lags 3 minutes): a folder gets
    its success file only after a completed checkpoint published its parts and the minimum
    watermark passed its minute + delay; at that moment the published files hold exactly the
    oracle's rows of the folder (no row of it comes later). Every folder is committed at the
    end. A committer that took the maximum watermark, or committed before publishing, fails."""
    root = tmp_path / "out"
    sink = rs.sinks.parquet(
        root, partition_by=["dt", "hm"], partition_commit=rs.sinks.partition_commit(**Q10)
    )
    steps = {"out": Step("out", "sink", sink)}
    commits = JobPartitionCommits(steps)
    commits.restore(None)
    jitter = 20_000
    inputs = [
        bids(1, 6000, T0, 12 * MINUTE, jitter),
        bids(2, 6000, T0 - 3 * MINUTE, 12 * MINUTE, jitter),  # behind
    ]
    expected = oracle(pa.concat_tables(inputs))
    writers = [sink.open(i, 2) for i in range(2)]
    marks = [None, None]
    chunks = 40
    history = []
    for cid in range(1, chunks + 1):
        acks = []
        for i, (w, table) in enumerate(zip(writers, inputs, strict=True)):
            part = table.slice((cid - 1) * len(table) // chunks, len(table) // chunks)
            for b in part.to_batches():
                w.write(b)
            # bounded out-of-orderness: no row behind max seen - jitter comes later
            high = int(pa.compute.max(part["ts"]).as_py()) - jitter
            marks[i] = high if marks[i] is None else max(marks[i], high)
            acks.append({"instance": ("out", i), "sink_state": w.pre_commit(cid),
                         "watermark_ms": marks[i]})
        wm = commits.add_acks(acks, now=0)
        assert wm == {"out": min(marks)}
        before = success_folders(root)
        for w in writers:
            w.commit(cid)
        # a failed publish would skip this: the controller commits only when all published
        committed = commits.commit_due(wm, now=0)
        now_visible = published(root)
        for _, folder in committed:
            key = key_of(folder)
            assert now_visible.get(key) == expected[key], folder
            t = utc_ms(key + ":00")
            assert min(marks) > t + MINUTE, (folder, min(marks), t)
        history.append((cid, before, committed))
    results = [w.close() for w in writers]
    assert sum(len(c) for _, _, c in history) > 5  # commits happened while "running"
    done = commits.commit_end(written_partitions([("out", r) for r in results]))
    assert done
    final = published(root)
    assert final == expected
    assert {key_of(f) for f in success_folders(root)} == set(expected)


def test_min_watermark_ignores_ended_instances_and_waits_for_none(tmp_path: Path) -> None:
    sink = rs.sinks.parquet(
        tmp_path, partition_by=["dt", "hm"], partition_commit=rs.sinks.partition_commit(**Q10)
    )
    commits = JobPartitionCommits({"out": Step("out", "sink", sink)})
    acks = [
        {"instance": ("out", 0), "watermark_ms": 50},
        {"instance": ("out", 1), "watermark_ms": 10},
        {"instance": ("out", 2), "sink_state": {"partitions": {}}, "final_sink_state": True},
        {"instance": ("other", 0), "watermark_ms": 0},
    ]
    assert commits.add_acks(acks, now=0) == {"out": 10}
    acks.append({"instance": ("out", 3), "watermark_ms": None})
    assert commits.add_acks(acks, now=0) == {"out": None}


class Recorder:
    def __init__(self) -> None:
        self.seen: list[CommittedPartition] = []

    def commit(self, partition: CommittedPartition) -> None:
        self.seen.append(partition)


def test_policy_errors_are_retried_and_reported(tmp_path: Path) -> None:
    calls: list[str] = []

    def flaky(p: CommittedPartition) -> None:
        calls.append(p.folder)
        if len(calls) == 1:
            raise OSError("store down")

    sink = rs.sinks.parquet(
        tmp_path,
        partition_by=["dt"],
        partition_commit=rs.sinks.partition_commit("process-time", on_commit=flaky),
    )
    commits = JobPartitionCommits({"out": Step("out", "sink", sink)})
    (tmp_path / "dt=a").mkdir()
    commits.add_acks([{"instance": ("out", 0), "sink_state": {"partitions": {"dt=a": {}}}}], 0)
    assert commits.commit_due({}, now=0) == []
    assert "committing partition 'dt=a' failed: OSError: store down" in commits.errors[0]
    assert (tmp_path / "dt=a" / "_SUCCESS").exists()  # the success file came first
    assert commits.commit_due({}, now=0) == [("out", "dt=a")]
    assert calls == ["dt=a", "dt=a"]


def test_run_local_commits_every_folder_at_the_end(tmp_path: Path) -> None:
    """Without checkpoints (run_local): every folder written gets its success file at the end,
    and a user policy sees each folder with its decoded values."""
    out = tmp_path / "out"
    recorder = Recorder()
    table = bids(7, 3000, T0, 5 * MINUTE, 1000)
    flow = rs.Dataflow("pc-local")
    sink = rs.sinks.parquet(
        out,
        partition_by=["dt", "hm"],
        partition_commit=rs.sinks.partition_commit(**Q10, on_commit=recorder),
    )
    flow.source(rs.sources.from_table(table)).sink(sink, name="out")
    from raystream.runtime.local import run_local

    asyncio.run(run_local(flow, {"out": 2}, state_dir=str(tmp_path / "state")))
    expected = oracle(table)
    assert {key_of(f) for f in success_folders(out)} == set(expected)
    assert sorted(f"{p.values['dt']} {p.values['hm']}" for p in recorder.seen) == sorted(expected)
    assert all(os.path.isdir(p.path) for p in recorder.seen)
    assert published(out) == expected


def test_success_files_on_s3() -> None:
    """The same pyarrow.fs filesystem as the sink: success files are objects on S3 (moto)."""
    pytest.importorskip("moto.server")
    from tests._s3 import local_s3_bucket

    with local_s3_bucket("commits") as endpoint:
        uri = (
            f"s3://test:test@commits/out?endpoint_override={endpoint}&scheme=http"
            "&region=us-east-1"
        )
        sink = rs.sinks.parquet(
            uri, partition_by=["dt", "hm"], partition_commit=rs.sinks.partition_commit(**Q10)
        )
        table = bids(3, 800, T0, 3 * MINUTE, 1000)
        w = sink.open(0, 1)
        for b in table.to_batches():
            w.write(b)
        state = w.pre_commit(1)
        commits = JobPartitionCommits({"out": Step("out", "sink", sink)})
        wm = commits.add_acks(
            [{"instance": ("out", 0), "sink_state": state, "watermark_ms": T0 + MINUTE + 1}],
            now=0,
        )
        w.commit(1)
        due = ["dt=2020-09-13/hm=12%3A25", "dt=2020-09-13/hm=12%3A26"]  # not 12:27, 12:28
        assert commits.commit_due(wm, now=0) == [("out", f) for f in due]
        w.close()
        fs, root = pafs.FileSystem.from_uri(uri)
        names = sorted(
            i.path[len(root) + 1 :]
            for i in fs.get_file_info(pafs.FileSelector(root, recursive=True))
            if i.base_name == "_SUCCESS"
        )
        assert names == [f"{f}/_SUCCESS" for f in due]
