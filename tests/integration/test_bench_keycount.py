"""The key-count benchmark CLI (``python -m bench.keycount``). Once as users run it (a
subprocess from the repository root), otherwise in-process through click's CliRunner (cheaper on
2 cores). Its output is checked against DuckDB over the same input."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
from click.testing import CliRunner

import raystream as rs
from tests.integration._helpers import assert_counts_equal, oracle_counts

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench_main() -> Any:
    """``bench.keycount.main``. bench/ is not installed: import it with the repository root on
    sys.path for just that import (raystream itself is already imported from its install)."""
    root = str(REPO)
    added = root not in sys.path
    if added:
        sys.path.insert(0, root)
    try:
        return importlib.import_module("bench.keycount").main
    finally:
        if added:
            sys.path.remove(root)


def _bench(
    *args: str, attach: bool = True, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if attach:  # reuse the session's Ray instead of starting a second one on 2 cores
        env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    return subprocess.run(
        [sys.executable, "-m", "bench.keycount", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def _duckdb_counts(parquet: Path) -> dict[Any, int]:
    con = duckdb.connect()
    try:
        rows = con.execute(
            "SELECT key, count(*) FROM read_parquet(?) GROUP BY key", [str(parquet)]
        ).fetchall()
    finally:
        con.close()
    return {k: int(n) for k, n in rows}


def _check_report(report: dict[str, Any], events: int, parallelism: int) -> None:
    for key in (
        "events_in",
        "events_out",
        "elapsed_s",
        "throughput_eps",
        "latency_ms",
        "timeline",
        "parallelism",
        "state_backend",
        "config",
    ):
        assert key in report, f"report lacks {key!r}: {sorted(report)}"
    assert report["events_in"] == events
    assert 0 < report["events_out"] <= events
    assert report["elapsed_s"] > 0
    assert report["throughput_eps"] == pytest.approx(events / report["elapsed_s"], rel=1e-3)
    lat = report["latency_ms"]
    assert set(lat) >= {"p50", "p99", "max"} and 0 <= lat["p50"] <= lat["p99"] <= lat["max"]
    assert report["parallelism"] == parallelism
    assert report["state_backend"] == "rocksdb"
    rows = report["timeline"]
    assert rows and all(len(r) == 5 for r in rows)
    window_s = report.get("window_ms", 250) / 1000
    assert [r[0] for r in rows] == pytest.approx(
        [rows[0][0] + i * window_s for i in range(len(rows))]
    )
    # the windows' throughput adds up to every event the count step took in
    assert sum(r[1] for r in rows) * window_s == pytest.approx(events, rel=1e-6)
    assert any(r[2] is not None for r in rows)


def test_bench_on_a_parquet_input(tmp_path: Path) -> None:
    gen = rs.sources.generator(events=60_000, keys=5_000, zipf=1.1, seed=9, key_type="str")
    events = Path(gen.to_parquet(tmp_path / "events.parquet"))
    out, rep = tmp_path / "counts.parquet", tmp_path / "report.json"

    proc = _bench(
        "--input",
        str(events),
        "--output",
        str(out),
        "--report",
        str(rep),
        "--parallelism",
        "2",
        "--batch-rows",
        "10000",
        "--quiet",
    )

    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "", "--quiet prints nothing"
    counts = pq.read_table(out)
    assert counts.schema.names == ["key", "count"]
    assert counts.schema.field("key").type == pa.string()
    assert counts.num_rows == len(set(counts["key"].to_pylist())), "one row per key"
    got = dict(zip(counts["key"].to_pylist(), counts["count"].to_pylist(), strict=True))
    assert_counts_equal(got, _duckdb_counts(events))
    report = json.loads(rep.read_text())
    _check_report(report, 60_000, 2)
    assert report["config"]["input"] == str(events)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "counts.parquet",
        "events.parquet",
        "report.json",
    ]


def test_bench_generator_per_key_form(bench_main: Any, tmp_path: Path) -> None:
    out, rep = tmp_path / "counts.parquet", tmp_path / "report.json"
    args = {"events": 40_000, "keys": 3_000, "zipf": 1.1, "seed": 4, "hot_key_fraction": 0.3}

    res = CliRunner().invoke(
        bench_main,
        [
            "--events",
            "40000",
            "--keys",
            "3000",
            "--zipf",
            "1.1",
            "--seed",
            "4",
            "--hot-key-fraction",
            "0.3",
            "--form",
            "per-key",
            "--parallelism",
            "3",
            "--batch-rows",
            "8000",
            "--standby-instances",
            "0",
            "--output",
            str(out),
            "--report",
            str(rep),
        ],
    )

    assert res.exit_code == 0, (res.output[-3000:], res.exception)
    assert "throughput" in res.stdout  # the summary
    assert ray.is_initialized(), "the CLI must not shut down a Ray it did not start"
    counts = pq.read_table(out)
    got = dict(zip(counts["key"].to_pylist(), counts["count"].to_pylist(), strict=True))
    assert_counts_equal(got, oracle_counts(rs.sources.generator(**args).generate_all()))
    report = json.loads(rep.read_text())
    _check_report(report, 40_000, 3)
    assert report["config"]["form"] == "per-key"
    assert report["config"]["standby_instances"] == 0


# ------------------------------------------------------------------------------------------
# usage errors: exit code 2, a clear message, nothing written (checked before Ray is used)


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (lambda d: ["--no-such-option"], "No such option '--no-such-option'"),
        (lambda d: ["--input", str(d / "missing.parquet")], "does not exist"),
        (lambda d: ["--input", str(d / "nokey.parquet")], "no column 'key'"),
        (lambda d: ["--input", str(d / "notparquet.parquet")], "not a readable Parquet file"),
        (lambda d: ["--form", "columnar"], "'columnar' is not one of 'vectorised', 'per-key'"),
        (lambda d: ["--parallelism", "0"], "--parallelism"),
        (lambda d: ["--parallelism", "129"], "at most 128"),
        (lambda d: ["--standby-instances", "-1"], "--standby-instances"),
        (lambda d: ["--output", str(d / "nodir" / "counts.parquet")], "does not exist"),
    ],
    ids=[
        "unknown-option",
        "missing-input",
        "no-key-column",
        "not-parquet",
        "bad-form",
        "parallelism-0",
        "parallelism-129",
        "standby-instances-negative",
        "output-dir-missing",
    ],
)
def test_bench_usage_errors(bench_main: Any, tmp_path: Path, make_args: Any, message: str) -> None:
    pq.write_table(pa.table({"user": [1, 2]}), tmp_path / "nokey.parquet")
    (tmp_path / "notparquet.parquet").write_text("key\n1\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    out, rep = tmp_path / "counts.parquet", tmp_path / "report.json"
    args = make_args(tmp_path)
    if "--output" not in args:
        args += ["--output", str(out)]

    res = CliRunner().invoke(bench_main, [*args, "--report", str(rep)], prog_name="keycount")

    assert res.exit_code == 2, (res.exit_code, res.output[-2000:], res.exception)
    assert message in res.stderr, res.stderr
    assert res.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "nothing may be written"


def test_bench_usage_error_as_a_command(tmp_path: Path) -> None:
    """The same through ``python -m bench.keycount``: exit code 2, click's message, no traceback."""
    out = tmp_path / "counts.parquet"
    proc = _bench(
        "--input",
        str(tmp_path / "missing.parquet"),
        "--output",
        str(out),
        "--bogus",
        attach=False,
        timeout_s=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Error: No such option '--bogus'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()
