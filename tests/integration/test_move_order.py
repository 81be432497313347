"""Per-key order downstream of a keyed step whose instances move, with a slow step after it.

A key-count step emits, per key and batch, the key's new count and the records it added; one
slow stateless instance reads what every count instance sends and passes it to the sink. The
slow step keeps a backlog, so when an instance of the count step is moved (a new actor) or the
step is rescaled (existing instances take over key groups), the old owner's last outputs are still
queued at the slow step when the new owner sends its first: the slow step must read the old
owner's outputs of a moving key first. Neither owner waits for the other; the slow step holds the
new owner's channel until it has read the old owner's fence (raystream.runtime.channels).

The oracle, per key in the order the sink received the rows: each count is the previous one plus
the records the row says it added (no output read out of order, lost or doubled), and the last
count is the key's events in the generator's own stream (plain Python, nothing of raystream).
"""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import ray

import raystream as rs

from ._helpers import finished_after_gate
from ._rescale_helpers import RUNTIME, UntilGate, prefix_counts

STEP = "count"
# per row at the slow step (batches queued at it are read as one: a cost per batch would not do):
# slower than the count step's output, so a backlog stays in front of it
SLOW_S_PER_ROW = 0.001


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def count_added(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new, "added": batch.counts})


@rs.map_batches
def slow(batch: pa.RecordBatch) -> pa.RecordBatch:
    time.sleep(SLOW_S_PER_ROW * batch.num_rows)
    return batch


def _flow(name: str, gen: Any, gate: str) -> rs.Dataflow:
    flow = rs.Dataflow(name, num_key_groups=32, sub_groups=8)
    (
        flow.source(UntilGate(gen, gate, after_rows=5_000))
        .key_by("key")
        .apply(count_added, name=STEP)
        .apply(slow, name="slow", parallelism=1)
        .sink(rs.sinks.collect(), name="out")
    )
    flow.options("slow", chain=False)  # its own actor: fed by every count instance
    return flow


def check_order_and_counts(out: pa.Table, expected: collections.Counter[Any]) -> None:
    """Per key, in the order received: count == previous count + added; last count == events."""
    df = out.select(["key", "count", "added"]).to_pandas()
    assert (df["added"] > 0).all()
    running = df.groupby("key", sort=False)["added"].cumsum()
    bad = np.flatnonzero(running.to_numpy() != df["count"].to_numpy())
    if bad.size:
        row = int(bad[0])
        key = df["key"].iloc[row]
        seq = df.loc[df["key"] == key, ["count", "added"]].to_numpy().tolist()
        msg = (
            f"key {key!r}: row {row} says count {df['count'].iloc[row]} but the rows before it "
            f"(in the order the sink got them) add up to {running.iloc[row]}; its rows "
            f"(count, added): {seq[:20]}"
        )
        raise AssertionError(msg)
    last = df.groupby("key")["count"].last().to_dict()
    assert last == dict(expected), "every event counted exactly once"


def _gen(seed: int) -> Any:
    return rs.sources.generator(
        events=20_000 * 120, keys=500, zipf=1.1, seed=seed, rate_eps=20_000
    )


def test_moved_instances_outputs_stay_in_order_behind_a_slow_step(tmp_path: Path) -> None:
    gen = _gen(11)
    gate = str(tmp_path / "gate")
    job = rs.start(_flow("move-order", gen, gate), parallelism={STEP: 2}, **RUNTIME)
    moves = []
    try:
        time.sleep(2.0)
        node = ray.get_runtime_context().get_node_id()
        for index in (0, 1, 0):
            moves.append(job.move(STEP, index, node))
            time.sleep(0.5)
    finally:
        Path(gate).touch()
    result, events = finished_after_gate(job, gate)
    assert [m["kind"] for m in moves] == ["move"] * 3
    check_order_and_counts(result.table("out"), prefix_counts(gen, events))
    slow_metrics = result.step_metrics("slow")
    # the slow step held a new owner's channel for an old owner's fence at least once: the
    # case this test is about happened
    assert sum(m.get("fence_holds", 0) for m in slow_metrics) >= 1, slow_metrics


def test_rescaled_steps_outputs_stay_in_order_behind_a_slow_step(tmp_path: Path) -> None:
    gen = _gen(12)
    gate = str(tmp_path / "gate")
    job = rs.start(_flow("rescale-order", gen, gate), parallelism={STEP: 2}, **RUNTIME)
    done = []
    try:
        time.sleep(2.0)
        for to in (3, 2, 3):
            done.append(job.rescale(STEP, to, "meces"))
            time.sleep(0.5)
    finally:
        Path(gate).touch()
    result, events = finished_after_gate(job, gate)
    assert [d["to"] for d in done] == [3, 2, 3]
    check_order_and_counts(result.table("out"), prefix_counts(gen, events))
    slow_metrics = result.step_metrics("slow")
    assert sum(m.get("fence_holds", 0) for m in slow_metrics) >= 1, slow_metrics
