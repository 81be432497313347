"""The small example jobs (examples/files_job.py, examples/custom_io_job.py) run in-process
through ``run_local`` (real instances, RocksDB state, no Ray); their output is checked against
DuckDB / numpy over the same input. ``raystream run`` of job files is covered in tests/e2e."""

from __future__ import annotations

import asyncio
import os
import runpy
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow.csv as pcsv
import pytest

from raystream.runtime.local import run_local

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str, monkeypatch: pytest.MonkeyPatch, **env: str) -> dict[str, Any]:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return runpy.run_path(str(EXAMPLES / name), run_name="example")


def test_files_job_totals_per_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    job = load(
        "files_job.py",
        monkeypatch,
        RAYSTREAM_EVENTS="30000",
        RAYSTREAM_OUT=str(out),
        RAYSTREAM_MAX_FILE_BYTES="3000",
    )
    data = job["source_path"]
    asyncio.run(run_local(job["flow"], {"totals": 2}, state_dir=tmp_path / "state"))
    assert len(list(out.glob("part-*.parquet"))) > 1  # the sink rolled its parts
    got = duckdb.sql(
        f"select key, max(total) as total, max(day) as day from read_parquet('{out}/*.parquet') "
        "group by key order by key"
    ).fetchall()
    want = duckdb.sql(
        f"select key, sum(amount) as total, max(day) as day from read_parquet('{data}/*/*.parquet',"
        " hive_partitioning=true) group by key order by key"
    ).fetchall()
    assert got == want


def test_custom_source_and_sink_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    job = load("custom_io_job.py", monkeypatch, RAYSTREAM_EVENTS="25000", RAYSTREAM_OUT=str(out))
    source = job["source"]
    asyncio.run(run_local(job["flow"], {"hottest": 2}, state_dir=tmp_path / "state"))
    files = sorted(os.listdir(out))
    assert files == ["part-00000.csv"]  # one sink instance, nothing hidden left behind
    got = pcsv.read_csv(out / files[0]).to_pandas().groupby("sensor")["max_fahrenheit"].max()
    # the oracle: every reading of the source, straight from its own chunk function
    n = np.arange(source.rows)
    celsius = 20 + 10 * np.sin(n / 1000.0) + (n * 7919 % 101) / 10.0
    want = np.full(source.sensors, -np.inf)
    np.maximum.at(want, n % source.sensors, celsius * 1.8 + 32)
    assert got.index.tolist() == list(range(source.sensors))
    np.testing.assert_allclose(got.to_numpy(), want, rtol=1e-12)
