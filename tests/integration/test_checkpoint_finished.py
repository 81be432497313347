"""Checkpoints after part of a dataflow finished (as Flink since FLIP-147).

One job, two branches from two sources:

- ``short``: a finite source that ends within a second, feeding its own keyed step and sink
  (a whole branch that finishes) and, shifted to keys of its own, a union with
- ``long``: a rate-limited source that runs for seconds, into one keyed step and sink.

After ``short`` ended, checkpoints must still complete (the finished instances' part is
recorded as finished, barriers flow through the live part). An instance of the live branch is
then killed; the job recovers from a checkpoint taken after ``short`` ended: the finished part
comes back as finished (its source does not replay, its sink's output is published once) and the
committed output of both sinks holds every input record exactly once, checked with DuckDB
against the generators' streams; so does the table of a ``collect()`` sink on the finished
branch (its rows, kept in memory at its end, are stored by the next checkpoint).

The checkpoints go to an object store: ``s3://`` on a local S3 server (moto's
ThreadedMotoServer on 127.0.0.1, endpoint and credentials in the URI), so upload, manifest,
retention and the restore of every instance run through ``pyarrow.fs`` S3 from the actors. The
live branch's Parquet sink writes to the same bucket (pending parts as hidden objects, published
by a copy at each checkpoint's commit); its visible objects are what the oracle checks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pytest
import ray

import raystream as rs
from raystream.runtime.actors import NAMESPACE, instance_actor_name
from tests._s3 import local_s3_bucket
from tests.integration._helpers import NOT_SCALED_OUT, HeldAt, running_count_carrying

KEYS = 2_000
SHIFT = 1_000_000  # keys of the short source in the union: apart from the long source's
SHORT = dict(events=20_000, keys=KEYS, zipf=1.1, seed=5)
LONG = dict(events=180_000, keys=KEYS, zipf=1.1, seed=6)
LONG_RATE = 30_000  # ~6 s of stream


running_count = running_count_carrying()


def shift_keys(batch: pa.RecordBatch) -> pa.RecordBatch:
    keys = pc.add(batch.column("key"), pa.scalar(SHIFT, batch.schema.field("key").type))
    return batch.set_column(batch.schema.get_field_index("key"), "key", keys)


@pytest.fixture
def s3_endpoint() -> Iterator[str]:
    """A bucket ``checkpoints`` on a local S3 server; yields its endpoint."""
    with local_s3_bucket("checkpoints") as endpoint:
        yield endpoint


def _s3(endpoint: str, folder: str) -> str:
    return f"s3://test:test@checkpoints/{folder}?endpoint_override={endpoint}&scheme=http"


def _download_visible(uri: str, local: Path) -> None:
    """The objects a reader of ``uri/*.parquet`` reads (not hidden), copied to ``local``."""
    fs, root = pafs.FileSystem.from_uri(uri)
    local.mkdir(parents=True)
    for info in fs.get_file_info(pafs.FileSelector(root)):
        if info.base_name.endswith(".parquet") and not info.base_name.startswith((".", "_")):
            pafs.copy_files(
                info.path,
                str(local / info.base_name),
                source_filesystem=fs,
                destination_filesystem=pafs.LocalFileSystem(),
            )


def _flow(name: str, out: Path, out_u: str, gate: str) -> rs.Dataflow:
    """The long source stops short at two thirds of its stream until the file ``gate`` exists
    (the test opens it once the job recovered: the kill lands while it runs)."""
    flow = rs.Dataflow(name, num_key_groups=32, sub_groups=4)
    short = flow.source(rs.sources.generator(**SHORT), name="short")
    held = ((LONG["events"] * 2 // 3, gate),)
    long = flow.source(
        HeldAt(rs.sources.generator(**LONG, rate_eps=LONG_RATE), held), name="long"
    )
    short.key_by("key").apply(running_count, name="count_a").sink(
        rs.sinks.parquet(str(out / "a")), name="out_a"
    )
    short.sink(rs.sinks.collect(), name="rows_a")  # a finished branch ending in collect()
    (
        short.map_batches(shift_keys, name="shift")
        .union(long)
        .key_by("key")
        .apply(running_count, name="count_u")
        .sink(rs.sinks.parquet(out_u), name="out_u")
    )
    return flow


def _per_key(spec: dict[str, Any], shift: int = 0) -> dict[int, int]:
    keys = rs.sources.generator(**spec).generate_all().column("key").to_numpy() + shift
    uniq, counts = np.unique(keys, return_counts=True)
    return dict(zip(uniq.tolist(), counts.tolist(), strict=True))


def _assert_exactly_once(folder: Path, expected: dict[int, int]) -> None:
    con = duckdb.connect()
    files = f"{folder}/*.parquet"
    dup = con.sql(
        f"select key, seq, count(*) c from read_parquet('{files}') group by 1, 2 having c > 1"
    ).fetchall()
    assert dup == [], f"{folder.name}: records published twice: {dup[:5]} ({len(dup)} in all)"
    wrong = con.sql(
        f"select key, seq, count from read_parquet('{files}') where count != seq + 1 limit 5"
    ).fetchall()
    assert wrong == [], f"{folder.name}: counts that saw an update twice or missed one: {wrong}"
    got = dict(con.sql(f"select key, count(*) from read_parquet('{files}') group by 1").fetchall())
    assert got == expected, f"{folder.name}: {len(set(got.items()) ^ set(expected.items()))} differ"


def test_checkpoints_complete_after_a_branch_finished_and_recovery_restores_it(
    tmp_path: Path, s3_endpoint: str
) -> None:
    out, out_u = tmp_path / "out", _s3(s3_endpoint, "out/u")
    gate = tmp_path / "recovered"
    job = rs.start(
        _flow("chk-finished", out, out_u, str(gate)),
        parallelism={"count_a": 2, "count_u": 2},
        checkpoint_interval_s=0.3,
        checkpoint_dir=_s3(s3_endpoint, "jobs"),
        restart_delay_s=0.2,
        batch_rows=5_000,
        linger_ms=10.0,
        **NOT_SCALED_OUT,
    )
    try:
        deadline = time.monotonic() + 120
        finished_at = None
        while True:  # the short branch ends, then two checkpoints complete after that
            assert time.monotonic() < deadline, job.status()["checkpoints"]
            status = job.status()
            done = {(m["step"], m["index"]) for m in status["instances"] if m.get("finished")}
            if finished_at is None and {("short", 0), ("count_a", 0), ("out_a", 0), ("rows_a", 0)} <= done:
                finished_at = status["checkpoints"]["completed"]
            if finished_at is not None and status["checkpoints"]["completed"] >= finished_at + 2:
                break
            time.sleep(0.05)
        before_kill = job.status()["checkpoints"]
        last = before_kill["last"]
        assert before_kill["failed"] == 0, before_kill["last_failure"]  # none after the end
        # the finished branch's output is published by the first checkpoint that records it as
        # finished, while the job runs on (as Flink's final checkpoint of a finished task)
        assert job.status()["state"] == "running"
        _assert_exactly_once(out / "a", _per_key(SHORT))
        assert last["source_offsets"]["short/0"] is None  # recorded as finished
        assert last["source_offsets"]["long/0"] > 0
        (long_src,) = [m for m in job.status()["instances"] if m["step"] == "long"]
        assert not long_src["finished"], f"the long source ended before the kill: {long_src}"
        ray.kill(ray.get_actor(instance_actor_name(job.name, "count_u", 1), namespace=NAMESPACE))
        while True:  # the recovered attempt runs
            live = job.metrics()
            if len(live["attempts"]) == 2 and live["state"] == "running":
                break
            assert time.monotonic() < deadline + 120, live["recoveries"]
            time.sleep(0.05)
        gate.touch()
        result = job.wait(120)
    finally:
        gate.touch()
        job.cancel()
    assert result.state == "finished", result.error
    assert len(result.recoveries) == 1, result.recoveries
    rec = result.recoveries[0]
    assert rec["checkpoint_id"] >= last["checkpoint_id"]
    assert result.checkpoints["storage"].startswith("s3://***@checkpoints/jobs")
    # what the failed attempt did is kept: the short source ended in it, so over both attempts
    # its records add up to its stream once; the killed instance did not report
    assert [a["attempt"] for a in live["attempts"]] == [0, 1]
    assert live["attempts"][0]["totals"]["short"]["records_out"] == SHORT["events"]
    assert live["totals"]["short"]["records_out"] == SHORT["events"]
    assert live["totals"]["count_a"]["records_in"] == SHORT["events"]
    (failed,) = result.failed_attempts
    assert failed["attempt"] == 0 and "count_u/1" in failed["unreported"]
    assert {(m["step"], m["index"]) for m in failed["instances"]} >= {("short", 0), ("long", 0)}
    assert all(m["attempt"] == 0 for m in failed["instances"])
    long_out = sum(m["records_out"] for m in failed["instances"] if m["step"] == "long")
    long_out += sum(m["records_out"] for m in result.metrics if m.get("step") == "long")
    assert long_out >= LONG["events"] + rec["records_replayed"]  # replayed rows ran twice
    _assert_exactly_once(out / "a", _per_key(SHORT))
    expected = _per_key(LONG)
    expected.update(_per_key(SHORT, SHIFT))
    published = [p for r in result.results["out_u"] if r is not None for p in r.paths]
    assert published and all(p.startswith("s3://checkpoints/out/u/part-") for p in published)
    _download_visible(out_u, out / "u")
    _assert_exactly_once(out / "u", expected)
    # the rows the finished branch's collect sink gathered before the recovery come back once
    rows = result.table("rows_a").select(["key", "seq"])
    want = rs.sources.generator(**SHORT).generate_all().select(["key", "seq"])
    con = duckdb.connect()
    con.register("got", rows)
    con.register("want", want)
    for a, b in (("got", "want"), ("want", "got")):
        extra = con.sql(f"select * from {a} except all select * from {b}").fetchall()
        assert extra == [], f"rows_a: {len(extra)} rows of {a} are not in {b}"
    assert rows.num_rows == SHORT["events"]
