"""Every job in examples/ runs with ``raystream run`` (a subprocess with its own embedded Ray) and
writes Parquet (``RAYSTREAM_OUT``) that is checked against the example's own generator, counted
independently with numpy/pandas."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CLI = str(Path(sys.executable).parent / "raystream")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run_example(name: str, out: Path, *args: str, **env_vars: str) -> tuple[str, Any]:
    """Run ``examples/<name>`` to its end; returns its stdout and its source (the oracle's input),
    built from the file under the same environment variables."""
    job_env = {"RAYSTREAM_OUT": str(out), **env_vars}
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # a fresh local Ray
    env.update(job_env)
    done = subprocess.run(
        [CLI, "run", str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tempfile.gettempdir(),
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    saved = dict(os.environ)
    try:
        os.environ.update(job_env)
        source = runpy.run_path(str(EXAMPLES / name), run_name="oracle")["source"]
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return done.stdout, source


def test_keycount_example_counts_every_key(tmp_path: Path) -> None:
    stdout, source = _run_example(
        "keycount_job.py",
        tmp_path,
        "-p",
        "count=2",
        RAYSTREAM_EVENTS="300000",
        RAYSTREAM_RATE_EPS="0",
    )
    assert "job 'keycount' finished" in stdout, stdout
    got = pq.read_table(tmp_path).to_pandas().groupby("key")["count"].max()
    keys, counts = np.unique(source.generate_all().column("key").to_numpy(), return_counts=True)
    assert int(counts.sum()) == 300_000
    assert got.index.tolist() == keys.tolist() and got.tolist() == counts.tolist()


def test_sessions_example_keeps_per_user_clicks_and_pages(tmp_path: Path) -> None:
    stdout, source = _run_example(
        "sessions_job.py", tmp_path, "-p", "user_stats=2", RAYSTREAM_EVENTS="60000"
    )
    assert "job 'sessions' finished" in stdout, stdout
    events = source.generate_all().to_pandas()
    events["user"] = "u" + (events["key"] % 1000).astype(str)
    events["page"] = events["seq"] % 7
    expected = events.groupby("user").agg(clicks=("page", "size"), pages=("page", "nunique"))
    got = (
        pq.read_table(tmp_path)
        .to_pandas()
        .groupby("user")
        .agg(clicks=("clicks", "max"), pages=("distinct_pages", "max"))
    )
    assert got.index.tolist() == expected.index.tolist()
    assert got["clicks"].tolist() == expected["clicks"].tolist()
    assert got["pages"].tolist() == expected["pages"].tolist()
