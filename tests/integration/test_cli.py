"""The ``raystream`` command line against a running job, from another process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import ray

import raystream as rs
from tests.integration._helpers import NOT_SCALED_OUT

CLI = str(Path(sys.executable).parent / "raystream")


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def cli_count(batch: rs.KeyedBatch, state) -> pa.RecordBatch:  # noqa: ANN001
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


def _cli(*args: str, cwd: Path, address: str | None = "") -> subprocess.CompletedProcess[str]:
    """Run the CLI with RAY_ADDRESS set to the session's Ray (``address=None``: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if address is not None:
        env["RAY_ADDRESS"] = address or ray.get_runtime_context().gcs_address
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env)


FAILING_JOB = '''
import pyarrow as pa
import raystream as rs


@rs.keyed(state=rs.ValueState(int, default=0))
def explode(key, records, state):
    if key == "boom":
        raise ZeroDivisionError(f"cannot count {key!r}")
    state.value += len(records)
    yield {"count": state.value}


flow = rs.Dataflow("cli-fails", num_key_groups=8)
words = pa.table({"word": ["ok", "fine", "boom", "ok"] * 50})
flow.source(rs.sources.from_table(words)).key_by("word").apply(explode).sink(rs.sinks.collect())
'''


def test_list_and_watch_by_address_and_a_failed_run_exits_1_with_its_traceback(
    tmp_path: Path,
) -> None:
    gcs = ray.get_runtime_context().gcs_address
    job_file = tmp_path / "failing_job.py"
    job_file.write_text(FAILING_JOB)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    failing = subprocess.Popen(  # runs beside the listed job
        [CLI, "run", str(job_file), "--address", gcs],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        flow = rs.Dataflow("cli-listed", num_key_groups=16)
        gen = rs.sources.generator(events=400_000, keys=100, seed=2, rate_eps=40_000)
        flow.source(gen).key_by("key").apply(cli_count, name="count").sink(rs.sinks.collect())
        job = rs.start(flow, parallelism={"count": 2}, **NOT_SCALED_OUT)
        try:
            # --address alone finds the cluster (RAY_ADDRESS unset for these)
            listed = _cli("list", "--address", gcs, cwd=tmp_path, address=None)
            assert listed.returncode == 0, listed.stderr
            assert "cli-listed" in listed.stdout and "count=2" in listed.stdout, listed.stdout
            watched = _cli(
                "status", "cli-listed", "--watch", "--count", "2", "--interval", "0.5",
                "--address", gcs, cwd=tmp_path, address=None,
            )  # fmt: skip
            assert watched.returncode == 0, watched.stderr
            # not a terminal: one table per refresh
            assert watched.stdout.count("job 'cli-listed': running") == 2, watched.stdout
            assert "over the last 0.5 s" in watched.stdout
        finally:
            job.stop()

        out, err = failing.communicate(timeout=120)
    finally:
        if failing.poll() is None:  # a failed assertion above: stop the run it started
            failing.kill()
            failing.wait()
    assert failing.returncode == 1, out + err
    assert "job 'cli-fails' failed in step 'explode', instance 0: ZeroDivisionError" in err, err
    assert "while processing key 'boom'" in err
    assert "Traceback (most recent call last)" in err and "in explode" in err
