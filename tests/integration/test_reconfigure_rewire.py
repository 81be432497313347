"""A filter put between the source and the count of a running key-count job, and taken out
again: the events it dropped are exactly the even-key events between its two barriers (the
source's offsets when it emitted them), every other event is counted exactly once, per key in
order. The insert waits in the queue behind a rescale of count and the removal behind a move of
one of its instances. Checked against the generator's own rows (``collections.Counter``).
"""

from __future__ import annotations

import collections
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import ray

import raystream as rs

from ._gates import held, wait_described
from ._gates import hold as hold_at
from ._helpers import Batches, count_vec, finished_after_gate, last_counts
from ._rescale_helpers import RUNTIME, UntilGate, generator


@rs.filter
def drop_even(record: dict[str, Any]) -> bool:
    return bool(record["key"] % 2)


def _count_holding(hold: str) -> Any:
    """``count_vec`` that first waits at ``_hold``: a change of the step cannot end while the
    test holds it, so a change asked for meanwhile is certainly queued behind it."""

    @rs.keyed_batches(state=rs.ValueState(int, default=0), name="count_vec")
    def count_vec(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
        hold_at(hold)
        new = state.get(batch.keys) + batch.counts
        state.put(batch.keys, new)
        return batch.output({"count": new})

    return count_vec


def _records_in(job: rs.Job, step: str) -> int:
    return sum(m["records_in"] for m in job.metrics()["instances"] if m.get("step") == step)


def _first_keys(gen: Any, events: int) -> list[int]:
    reader = gen.open(0, 1)
    keys: list[int] = []
    while len(keys) < events:
        batch = reader.read(min(gen.chunk_rows, events - len(keys)))
        assert batch is not None
        keys.extend(batch.column("key").to_pylist())
    reader.close()
    return keys


def test_filter_inserted_then_removed_drops_exactly_the_events_between_its_barriers(
    tmp_path: Path,
) -> None:
    gen = generator("int", skewed=False, seed=17)
    gate = str(tmp_path / "gate")
    hold = str(tmp_path / "hold")
    flow = rs.Dataflow("rewire", num_key_groups=32, sub_groups=8)
    flow.source(UntilGate(gen, gate)).key_by("key").apply(
        _count_holding(hold), name="count"
    ).sink(rs.sinks.collect(), name="out")
    job = rs.start(flow, parallelism={"count": 2}, state_dir=tempfile.mkdtemp(), **RUNTIME)
    try:
        deadline = time.monotonic() + 30
        while _records_in(job, "count") < 5_000:
            assert time.monotonic() < deadline, "no records reached count"
            time.sleep(0.02)
        with pytest.raises(rs.ReconfigurationError, match="it is a sink"):
            job.insert("out", drop_even)
        with pytest.raises(rs.ReconfigurationError, match="it is a keyed_batches step"):
            job.remove("count")
        with pytest.raises(rs.ReconfigurationError, match="needs key_by="):
            job.insert("source", count_vec)
        with ThreadPoolExecutor(2) as pool:
            # the insert waits in the queue behind a rescale of count, the removal behind a
            # move of one of count's instances: each first change cannot end while count is
            # held, and the hold ends once the second one is seen waiting
            with held(hold):
                rescaling = pool.submit(job.rescale, "count", 3)
                wait_described(job, "the rescale's start", lambda d: d["rescaling"])
                inserting = pool.submit(job.insert, "source", drop_even, name="drop_even")
                wait_described(job, "the insert queued", lambda d: d["queued_rescales"] == 1)
            rescaled = rescaling.result()
            inserted = inserting.result()
            # the graph version: 1 + the rescale + the insert
            assert inserted["actors"] == ["raystream:rewire:drop_even:0:v3"]
            ray.get_actor(inserted["actors"][0], namespace="raystream")
            time.sleep(0.5)
            node = ray.get_runtime_context().get_node_id()
            with held(hold):
                moving = pool.submit(job.move, "count", 0, node)
                wait_described(job, "the move's start", lambda d: d["rescaling"])
                removing = pool.submit(job.remove, "drop_even")
                wait_described(job, "the removal queued", lambda d: d["queued_rescales"] == 1)
            moved = moving.result()
            removed = removing.result()
        status = job.status()
    finally:
        Path(gate).touch()
    result, events = finished_after_gate(job, gate)

    start = inserted["source_offsets"]["source/0"]
    end = removed["source_offsets"]["source/0"]
    assert 0 < start < end < events
    keys = _first_keys(gen, events)
    kept = [k for i, k in enumerate(keys) if not (start <= i < end and k % 2 == 0)]
    assert len(kept) < events, "the filter dropped nothing"
    assert last_counts(result.table("out")) == dict(collections.Counter(kept))

    recs = status["reconfigurations"]
    assert [r["kind"] for r in recs] == ["rescale", "insert", "move", "remove"]
    assert status["graph_version"] == 5
    assert [g["step"] for g in status["graph"]] == ["source", "count", "out"]
    # each waited for the change before it, and ran after it (epochs grow in queue order)
    assert inserted["queued_s"] > 0 and removed["queued_s"] > 0
    assert recs[1]["epoch"] > max(recs[0]["epochs"]) and recs[3]["epoch"] > recs[2]["epoch"]
    assert rescaled["to"] == 3 and moved["moved"]["key_groups"] > 0


# ---- a keyed step inserted, rescaled and removed (its state emitted, then dropped) ------------


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def tally(batch: rs.KeyedBatch, state: Any) -> Any:
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"tally": new})


def _per_key_last(batches: list[pa.RecordBatch], column: str) -> dict[int, int]:
    """The last value of ``column`` per key, checking that per key it strictly grows."""
    last: dict[int, int] = {}
    for b in batches:
        for k, c in zip(b["key"].to_pylist(), b[column].to_pylist(), strict=True):
            assert c > last.get(k, 0), f"key {k}: {column} {c} after {last.get(k)}"
            last[k] = c
    return last


def test_keyed_count_inserted_rescaled_removed_counts_exactly_between_its_barriers(
    tmp_path: Path,
) -> None:
    gen = generator("int", skewed=True, seed=29)
    gate = str(tmp_path / "gate")
    flow = rs.Dataflow("keyedrewire", num_key_groups=32, sub_groups=8)
    flow.source(UntilGate(gen, gate)).sink(Batches(), name="out")
    job = rs.start(flow, state_dir=tempfile.mkdtemp(), chaining=False, **RUNTIME)
    try:
        deadline = time.monotonic() + 30
        while _records_in(job, "out") < 2_000:
            assert time.monotonic() < deadline, "no records reached out"
            time.sleep(0.02)
        with pytest.raises(rs.ReconfigurationError, match="needs key_by="):
            job.insert("source", count_vec, name="count")
        inserted = job.insert("source", count_vec, name="count", key_by="key")
        time.sleep(0.2)
        rescaled = job.rescale("count", 2)
        time.sleep(0.2)
        with pytest.raises(rs.ReconfigurationError, match="say what happens to it"):
            job.remove("count")
        emitted = job.remove("count", state="emit")
        # under the removed step's name again: new actors and state folders, a new routing table
        again = job.insert("source", tally, name="count", key_by="key")
        time.sleep(0.2)
        dropped = job.remove("count", state="drop")
        status = job.status()
    finally:
        Path(gate).touch()
    result, events = finished_after_gate(job, gate)

    b1, b2 = inserted["source_offsets"]["source/0"], emitted["source_offsets"]["source/0"]
    b3, b4 = again["source_offsets"]["source/0"], dropped["source_offsets"]["source/0"]
    assert 0 < b1 < b2 <= b3 < b4 < events
    keys = _first_keys(gen, events)
    batches = [b for part in result.results["out"] for b in part]
    raw = [b for b in batches if "seq" in b.schema.names]
    counts = [b for b in batches if "count" in b.schema.names]
    tallies = [b for b in batches if "tally" in b.schema.names]
    final = [b for b in batches if "state" in b.schema.names]
    assert len(raw) + len(counts) + len(tallies) + len(final) == len(batches)
    # raw events: exactly those outside the two steps' barriers, each once
    outside = [k for i, k in enumerate(keys) if i < b1 or b2 <= i < b3 or i >= b4]
    assert collections.Counter(k for b in raw for k in b["key"].to_pylist()) == (
        collections.Counter(outside)
    )
    # the inserted count started empty and counted each event between its barriers once,
    # across its rescale; its final state per key is that count
    between = dict(collections.Counter(keys[b1:b2]))
    assert _per_key_last(counts, "count") == between
    state_rows = [
        (k, v)
        for b in final
        for k, v in zip(b["key"].to_pylist(), b["state"].to_pylist(), strict=True)
    ]
    assert len(state_rows) == len(between) and dict(state_rows) == between
    # the second one: counted between its barriers; its state dropped (no rows)
    assert _per_key_last(tallies, "tally") == dict(collections.Counter(keys[b3:b4]))

    assert (rescaled["from"], rescaled["to"]) == (1, 2) and rescaled["moved_key_groups"] > 0
    kinds = [(r["kind"], r["step"]) for r in status["reconfigurations"]]
    assert [k for k in kinds if k[0] != "rescale"] == [
        ("insert", "count"),
        ("remove", "count"),
        ("insert", "count"),
        ("remove", "count"),
    ]
    assert [r.get("state") for r in status["reconfigurations"] if r["kind"] == "remove"] == [
        "emit",
        "drop",
    ]
    assert [g["step"] for g in status["graph"]] == ["source", "out"]
