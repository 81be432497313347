"""The ``raystream`` command line against a running job, from another process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import ray

import raystream as rs

CLI = str(Path(sys.executable).parent / "raystream")


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def cli_count(batch: rs.KeyedBatch, state) -> pa.RecordBatch:  # noqa: ANN001
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env)


def test_status_rescale_and_unknown_job_from_another_process(tmp_path: Path) -> None:
    flow = rs.Dataflow("cli-job", num_key_groups=32)
    gen = rs.sources.generator(events=1_200_000, keys=5_000, zipf=1.0, seed=4, rate_eps=80_000)
    flow.source(gen).key_by("key").apply(cli_count, name="count").sink(rs.sinks.collect(), name="out")
    job = rs.start(flow, parallelism={"count": 2})
    time.sleep(1.0)

    status = _cli("status", "cli-job", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert "count" in status.stdout and "source" in status.stdout, status.stdout

    rescaled = _cli("rescale", "cli-job", "count", "3", "--strategy", "meces", cwd=tmp_path)
    assert rescaled.returncode == 0, rescaled.stderr
    assert "rescaled 'count' 2 -> 3 with meces" in rescaled.stdout, rescaled.stdout

    bad = _cli("rescale", "cli-job", "count", "0", cwd=tmp_path)
    assert bad.returncode != 0 and "parallelism" in (bad.stderr + bad.stdout)

    missing = _cli("status", "no-such-job", cwd=tmp_path)
    assert missing.returncode == 2 and "no running job named 'no-such-job'" in missing.stderr

    result = job.wait(timeout_s=120)
    assert job.status is not None
    keys, expected = np.unique(gen.generate_all().column("key").to_numpy(), return_counts=True)
    out = result.table("out").to_pandas().groupby("key")["count"].max()
    assert out.index.tolist() == keys.tolist() and out.to_numpy().tolist() == expected.tolist()
    assert [(r["from"], r["to"]) for r in result.rescales] == [(2, 3)]
