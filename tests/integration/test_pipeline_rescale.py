"""Rescaling a keyed operator inside a longer pipeline: map -> keyed -> keyed -> sink.

The middle keyed step scales out with meces, then the last one scales in with all_at_once; the
per-bucket totals (which depend on every upstream count delta arriving exactly once) must equal a
numpy oracle, and CLI-visible status must reflect the new parallelism.
"""

from __future__ import annotations

import collections
import os
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import raystream as rs
import raystream.metrics
from tests.integration._helpers import count_vec, generator_prefix, last_counts
from tests.integration._rescale_helpers import UntilGate, prefix_counts


@rs.map_batches
def tag(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.append_column("bucket", pc.bit_wise_and(batch.column("key"), pa.scalar(7, pa.int64())))


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def count(batch: rs.KeyedBatch, state) -> pa.RecordBatch:  # noqa: ANN001
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new, "delta": batch.counts, "bucket": batch.reduce("bucket", "max")})


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def per_bucket(batch: rs.KeyedBatch, state) -> pa.RecordBatch:  # noqa: ANN001
    new = state.get(batch.keys) + batch.reduce("delta", "sum")
    state.put(batch.keys, new)
    return batch.output({"total": new})


def _wait_counted(job: rs.Job, step: str, records: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    got = 0
    while time.monotonic() < deadline:
        instances = job.metrics()["instances"]
        got = sum(int(m.get("records_in", 0)) for m in instances if m.get("step") == step)
        if got >= records:
            return
        time.sleep(0.05)
    msg = f"{got} records reached {step!r} within {timeout_s} s, expected {records}"
    raise AssertionError(msg)


def test_rescale_keyed_steps_inside_a_pipeline(tmp_path: Path) -> None:
    """The stream runs at 80,000 events/s until both rescales returned (then one more second of
    it), so both happen mid-stream and the scaled-in step still receives afterwards, however
    long the rescales take on the machine."""
    flow = rs.Dataflow("pipeline-rescale", num_key_groups=32, sub_groups=8)
    gen = rs.sources.generator(events=80_000 * 120, keys=20_000, zipf=1.0, seed=2, rate_eps=80_000)
    gate = str(tmp_path / "gate")
    (
        flow.source(UntilGate(gen, gate, after_rows=80_000), parallelism=1)
        .apply(tag)
        .key_by("key")
        .apply(count)
        .key_by("bucket")
        .apply(per_bucket)
        .sink(rs.sinks.collect(), name="out")
    )
    job = rs.start(flow, parallelism={"count": 2, "per_bucket": 2})
    stats: list[dict] = []
    statuses: list[dict] = []

    try:
        _wait_counted(job, "count", 80_000)  # a second of the stream: state to move
        stats.append(job.rescale("count", 3, "meces"))
        statuses.append(job.status())
        stats.append(job.rescale("per_bucket", 1, "all_at_once"))
        statuses.append(job.status())
    finally:
        Path(gate).touch()  # the stream ends a second after the rescales (or a failed one)
    result = job.wait(timeout_s=120)
    assert result.state == "finished", result.error
    events = int(Path(gate + ".events").read_text())

    assert [s["to"] for s in stats] == [3, 1], stats
    assert statuses[0]["parallelism"]["count"] == 3
    assert statuses[1]["parallelism"]["per_bucket"] == 1
    new_instance = [m for m in result.step_metrics("count") if m["index"] == 2]
    assert new_instance and new_instance[0]["records_in"] > 0, "the scale-out happened mid-stream"
    last_window = max(t for m in result.step_metrics("per_bucket") for t, _ in
                      rs.metrics.WindowedCounter.from_snapshot(m["throughput"]).timeline())
    assert last_window > stats[1]["end_s"], "per_bucket kept receiving after its scale-in"
    keys = generator_prefix(gen, events).column("key").to_numpy()
    assert len(keys) == events > 80_000
    buckets, expected = np.unique(keys & 7, return_counts=True)
    out = result.table("out").to_pandas().groupby("bucket")["total"].max()
    assert out.index.tolist() == buckets.tolist()
    assert out.to_numpy().tolist() == expected.tolist()
    counted = sum(m["records_in"] for m in result.step_metrics("count"))
    assert counted == len(keys), "every event reached the count step exactly once"


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def plain_count(batch: rs.KeyedBatch, state) -> pa.RecordBatch:  # noqa: ANN001
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


def test_scale_in_and_out_again_with_a_multi_input_step_before_the_keyed_one() -> None:
    """Instance ids come back after a scale-in (3 -> 2 -> 3 ...); two sources feed one map, so the
    map sees the rescale barrier on one input while records of the other are still coming (the
    case stop-and-restart must align); the keyed step feeds a sink of equal parallelism."""
    flow = rs.Dataflow("reuse-ids", num_key_groups=32, sub_groups=8)
    gen = rs.sources.generator(events=90_000 * 60, keys=20_000, zipf=1.0, seed=5, rate_eps=90_000)
    gate = os.path.join(tempfile.mkdtemp(prefix="rs-gate-"), "enough")
    (
        flow.source(UntilGate(gen, gate, after_rows=45_000), parallelism=2)
        .apply(rs.map_batches(lambda b: b, name="ident"))
        .key_by("key")
        .apply(plain_count, name="count")
        .sink(rs.sinks.collect(), name="out", parallelism=2)
    )
    job = rs.start(flow, parallelism={"count": 3, "ident": 1})
    done: list[dict] = []

    def drive() -> None:
        try:
            for target, strategy in (
                (2, "meces"), (3, "stop_restart"), (2, "stop_restart"), (3, "meces")
            ):  # fmt: skip
                time.sleep(0.6)
                done.append(job.rescale("count", target, strategy))
        finally:
            open(gate, "w").close()  # the stream ends after the rescales (or a failed one)

    t = threading.Thread(target=drive, daemon=True)
    t.start()
    result = job.wait(timeout_s=180)
    t.join(timeout=30)
    assert [(d["from"], d["to"]) for d in done] == [(3, 2), (2, 3), (3, 2), (2, 3)]
    expected: collections.Counter = collections.Counter()
    for index in range(2):
        with open(f"{gate}.events.{index}") as f:
            expected += prefix_counts(gen, int(f.read()), index, 2)
    out = result.table("out").to_pandas().groupby("key")["count"].max()
    assert out.to_dict() == dict(expected)
    shutil.rmtree(os.path.dirname(gate), ignore_errors=True)


@rs.map_batches
def jitter(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Up to 30 ms per batch: the keyed step's two inputs deliver a rescale barrier at different
    times, so an old owner still makes output for a moving key after it switched."""
    time.sleep(random.random() * 0.03)
    return batch


def test_a_moving_keys_outputs_reach_the_sink_in_order_when_the_keyed_step_has_two_inputs(
    tmp_path: Path,
) -> None:
    """The old owner fences its outputs before it hands out state: at the sink (fed by old and new
    owners on different channels) a key's counts must strictly grow across every rescale."""
    gen = rs.sources.generator(events=10_000_000, keys=2_000, zipf=1.1, seed=5, rate_eps=40_000)
    gate = str(tmp_path / "gate")
    flow = rs.Dataflow("two-input-order", num_key_groups=32, sub_groups=8)
    (
        flow.source(UntilGate(gen, gate, after_rows=2_000), parallelism=2)
        .apply(jitter, parallelism=2)
        .key_by("key")
        .apply(count_vec, name="count")
        .sink(rs.sinks.collect(), name="out")
    )
    job = rs.start(flow, parallelism={"count": 2}, linger_ms=40.0)
    try:
        time.sleep(1.0)
        for to in (3, 2, 4):
            job.rescale("count", to)
    finally:
        Path(gate).touch()
    result = job.wait(timeout_s=120)
    assert result.state == "finished", result.error
    expected: collections.Counter[int] = collections.Counter()
    for i in range(2):
        expected += prefix_counts(gen, int(Path(f"{gate}.events.{i}").read_text()), i, 2)
    assert last_counts(result.table("out")) == dict(expected)
    assert [r["to"] for r in result.rescales] == [3, 2, 4]
    assert all(r["fence_ms"] is not None for r in result.rescales), result.rescales
    # resident memory of the moving instances was sampled (a peak at or above the start)
    assert all(
        r["max_rss_peak_mb"] > 0 and r["max_rss_growth_mb"] >= 0 for r in result.rescales
    ), result.rescales
