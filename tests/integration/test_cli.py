"""The ``raystream`` command line against a running job, from another process: listing and
watching it, and changing it (update, insert, move, remove)."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import ray

import raystream as rs
from tests.integration._helpers import (
    NOT_SCALED_OUT,
    finished_after_gate,
    generator_prefix,
    last_counts,
)
from tests.integration._rescale_helpers import RUNTIME, LiveJob, UntilGate, generator

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
        # ten minutes of input: it still runs after the CLI processes started (a few seconds
        # each, more on a slow machine); the test stops it
        gen = rs.sources.generator(events=40_000 * 600, keys=100, seed=2, rate_eps=40_000)
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


# ---- changing a running job from the command line ----------------------------------------------

OPS = '''
import numpy as np
import raystream as rs


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def count_v2(batch, state):
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new, "version": np.full(len(new), 2)})


@rs.filter
def keep_even(record):
    return record["key"] % 2 == 0
'''


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def count_v1(batch: rs.KeyedBatch, state) -> pa.RecordBatch:  # noqa: ANN001
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new, "version": np.full(len(new), 1)})


def test_update_insert_move_remove_from_the_command_line_count_each_event_once(
    tmp_path: Path,
) -> None:
    """``raystream update``, ``insert``, ``move`` and ``remove`` from another process, with the
    new functions in a module of the current directory (not installed, not on the job's
    path): the replacement takes over at its barrier (per key, version-1 rows up to the key's
    events before it, version 2 after), the filter drops exactly the odd-key events between
    its two barriers, and every other event is counted once (the generator's own rows)."""
    (tmp_path / "cli_ops.py").write_text(OPS)
    gen = generator("int", skewed=False, seed=41, keys=64)
    gate = str(tmp_path / "gate")
    flow = rs.Dataflow("cli-changed", num_key_groups=16, sub_groups=4)
    flow.source(UntilGate(gen, gate)).key_by("key").apply(count_v1, name="count").sink(
        rs.sinks.collect(), name="out"
    )
    job = rs.start(flow, parallelism={"count": 2}, **NOT_SCALED_OUT, **RUNTIME)
    try:
        # records before the first change's barrier (its source offset must be > 0)
        LiveJob(job, gate).wait_flowing(1_000)
        steps = [
            ("update", "cli-changed", "count", "cli_ops:count_v2"),
            ("insert", "cli-changed", "source", "cli_ops:keep_even", "--name", "evens"),
            ("move", "cli-changed", "count", "0", ray.get_runtime_context().get_node_id()),
            ("remove", "cli-changed", "evens"),
        ]
        for args in steps:
            done = _cli(*args, cwd=tmp_path)
            assert done.returncode == 0, (args, done.stdout, done.stderr)
            assert "at epoch" in done.stdout, done.stdout
        recs = job.metrics()["reconfigurations"]
    finally:
        Path(gate).touch()
    result, events = finished_after_gate(job, gate)

    assert [r["kind"] for r in recs] == ["replace", "insert", "move", "remove"]
    replaced, inserted, removed = (recs[i]["source_offsets"]["source/0"] for i in (0, 1, 3))
    assert 0 < replaced <= inserted < removed < events
    keys = generator_prefix(gen, events).column("key").to_pylist()
    kept = [k for i, k in enumerate(keys) if not (inserted <= i < removed and k % 2)]
    assert len(kept) < events, "the filter dropped nothing"
    out = result.table("out")
    assert last_counts(out) == dict(collections.Counter(kept))
    before = collections.Counter(keys[:replaced])
    rows = zip(*(out.column(c).to_pylist() for c in ("key", "count", "version")), strict=True)
    wrong = [(k, c, v) for k, c, v in rows if (v == 2) != (c > before[k])]
    assert not wrong, f"rows on the wrong side of the replace (key, count, version): {wrong[:5]}"
