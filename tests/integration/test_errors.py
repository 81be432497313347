"""Bad input and bad options: clear errors, raised early where possible, and nothing
half-written; a failed job releases its name."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raystream as rs
from tests.integration._helpers import (
    NOT_SCALED_OUT,
    HeldAt,
    assert_counts_equal,
    count_vec,
    keycount_flow,
    last_counts,
    oracle_counts,
    stop_on_error,
)


def _write_with_nulls(path: Path, groups: int = 5, rows: int = 10_000) -> pa.Table:
    """``groups`` row groups of int keys; the last one holds a few null keys."""
    with pq.ParquetWriter(path, pa.schema([("key", pa.int64()), ("v", pa.int64())])) as w:
        for g in range(groups):
            keys = pa.array([(i * 7 + g) % 997 for i in range(rows)], pa.int64())
            if g == groups - 1:
                keys = pa.array(
                    [None if i % 1000 == 999 else k for i, k in enumerate(keys.to_pylist())],
                    pa.int64(),
                )
            w.write_table(pa.table({"key": keys, "v": pa.array(range(rows), pa.int64())}))
    return pq.read_table(path)


def _null_key_flow(name: str, source: rs.sources.ParquetSource, out_dir: Path) -> rs.Dataflow:
    flow = rs.Dataflow(name)
    flow.source(source).key_by("key").apply(count_vec, name="count").sink(
        rs.sinks.parquet(out_dir), name="out"
    )
    return flow


def test_missing_key_column_fails_at_key_by(tmp_path: Path) -> None:
    path = tmp_path / "nokey.parquet"
    pq.write_table(pa.table({"user": [1, 2], "amount": [3.0, 4.0]}), path)
    flow = rs.Dataflow("nokey")
    stream = flow.source(rs.sources.parquet(path))
    with pytest.raises(rs.DataflowDefinitionError, match=r"no column 'key'.*\['user', 'amount'\]"):
        stream.key_by("key")


def test_missing_path_is_a_source_error(tmp_path: Path) -> None:
    with pytest.raises(rs.SourceError, match="no such file or directory"):
        rs.sources.parquet(tmp_path / "nope.parquet")


@pytest.mark.parametrize("parallelism", [0, 129, -1, 2.0])
def test_bad_parallelism_is_a_config_error(parallelism: object) -> None:
    flow = keycount_flow("badp", rs.sources.generator(events=10, keys=5))  # 128 key groups
    with pytest.raises(rs.ConfigError, match="parallelism of .*'count'"):
        rs.run(flow, parallelism={"count": parallelism}, timeout_s=10)


@dataclass(frozen=True)
class FailedRun:
    error: str
    out_dir: Path
    left_behind: list[str]  # what the sink directory held right after the failure
    table: pa.Table


@pytest.fixture(scope="module")
def null_key_failure(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> FailedRun:
    """One job whose input has nulls in its last row group (shared by the tests below).
    Rows reach the sink before the nulls are read."""
    tmp = tmp_path_factory.mktemp("nullkeys")
    path = tmp / "nulls.parquet"
    table = _write_with_nulls(path)
    out_dir = tmp / "out"
    # throttled (5 row groups in ~2 s), and stopped short of the last row group (its nulls)
    # until rows reached the sink
    gate = tmp / "reached"
    source = HeldAt(
        rs.sources.parquet(path, batch_rows=2_000, rate_eps=20_000), ((40_000, str(gate)),)
    )
    job = rs.start(
        _null_key_flow("nullkeys", source, out_dir),
        parallelism={"count": 2},
        batch_rows=2_000,
        linger_ms=5.0,
        **NOT_SCALED_OUT,
    )
    with stop_on_error(job):
        deadline = time.monotonic() + 120
        while True:
            m = job.metrics()
            if any(i.get("step") == "out" and i.get("records_in", 0) > 0 for i in m["instances"]):
                break
            assert m["state"] == "running", "the job ended before any row reached the sink"
            assert time.monotonic() < deadline, "no row reached the sink within 120 s"
            time.sleep(0.05)
        gate.touch()
        with pytest.raises(rs.JobFailedError) as info:
            job.wait(60)
    left = sorted(p.name for p in out_dir.iterdir()) if out_dir.exists() else []
    return FailedRun(str(info.value), out_dir, left, table)


def test_null_keys_fail_the_job_and_write_nothing(
    null_key_failure: FailedRun, tmp_path: Path
) -> None:
    """The sink already received rows when the job failed, yet no finished part file appears;
    then the same job name runs again (the failed job's controller was released)."""
    run = null_key_failure
    assert "null" in run.error and "'key'" in run.error, run.error
    finished = [n for n in run.left_behind if n.startswith("part-") and n.endswith(".parquet")]
    assert finished == [], f"a failed job left finished part files: {finished}"

    clean = tmp_path / "clean.parquet"
    pq.write_table(run.table.filter(pa.compute.is_valid(run.table["key"])), clean)
    out_dir = tmp_path / "out"
    flow = _null_key_flow("nullkeys", rs.sources.parquet(clean), out_dir)
    res = rs.run(flow, timeout_s=60, **NOT_SCALED_OUT)
    assert res.state == "finished"
    (written,) = res.results["out"]
    assert written.path == str(out_dir / "part-00000.parquet")
    assert sorted(p.name for p in out_dir.iterdir()) == ["part-00000.parquet"]
    assert_counts_equal(
        last_counts(pq.read_table(written.path)), oracle_counts(pq.read_table(clean))
    )


def test_failed_job_leaves_no_temporary_files(null_key_failure: FailedRun) -> None:
    assert null_key_failure.left_behind == [], (
        f"a failed job left {null_key_failure.left_behind} in the sink directory"
    )


def test_run_raises_job_failed_error(tmp_path: Path) -> None:
    path = tmp_path / "nulls.parquet"
    _write_with_nulls(path, groups=1, rows=2_000)
    flow = _null_key_flow("run-fails", rs.sources.parquet(path), tmp_path / "out")
    with pytest.raises(rs.JobFailedError, match="null"):
        rs.run(flow, timeout_s=60, **NOT_SCALED_OUT)
