"""Changing a running key-count job: replace its count function while a rescale runs (the
replacement queued behind it), then move a hot instance to a new actor, in one job run.

The count operator checks inside the job that every key's records come in order and without a
gap (the generator's per-key ``seq``), old and new function alike, so a record lost, doubled or
reordered by any of the three changes fails the job. After the input ends, checked against the
generator's own rows (``collections.Counter``) and DuckDB:

* every event counted exactly once (last count per key = the oracle's count);
* untagged rows are exactly those with count <= the key's events before the replace barrier (the
  source's offset when it emitted it), tagged rows those after: the old function took every
  record before the barrier, the new one every one after, on every instance;
* one record per change in ``metrics()["reconfigurations"]``, in the order they were asked for,
  with its epoch, and the graph version counts them.

Bad requests against the live job are refused and change nothing (the refusals are unit tests in
tests/unit/test_replace_function.py; here: what needs the controller).
"""

from __future__ import annotations

import os
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
from ._helpers import finished_after_gate, last_counts, oracle_counts
from ._rescale_helpers import RUNTIME, STATE, UntilGate, _count, generator, prefix_counts

STEP = "count"


def count_v1_holding(hold: str) -> Any:
    """The first version, waiting at ``_hold`` before each key: the rescale cannot end while the
    test holds it, so the replacement asked for meanwhile is certainly queued behind it."""

    @rs.keyed(state=STATE)
    def count_v1(key: Any, records: pa.RecordBatch, state: Any) -> Any:
        hold_at(hold)
        for k, row in _count(key, records, state):
            yield k, {**row, "tag": ""}

    return count_v1


@rs.keyed(state=STATE)
def count_v2(key: Any, records: pa.RecordBatch, state: Any) -> Any:
    for k, row in _count(key, records, state):
        yield k, {**row, "tag": "v2"}


@rs.map
def not_keyed(record: dict[str, Any]) -> dict[str, Any]:
    return record


def _wait_for(what: str, check: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.02)


def test_replace_queued_behind_a_rescale_then_move_a_hot_instance(tmp_path: Path) -> None:
    gen = generator("int", skewed=True, seed=13)
    gate = str(tmp_path / "gate")
    hold = str(tmp_path / "hold")
    flow = rs.Dataflow("reconfigure", num_key_groups=32, sub_groups=8)
    (
        flow.source(UntilGate(gen, gate))
        .key_by("key")
        .apply(count_v1_holding(hold), name=STEP)
        .sink(rs.sinks.collect(), name="out")
    )
    job = rs.start(flow, parallelism={STEP: 2}, state_dir=tempfile.mkdtemp(), **RUNTIME)
    try:

        def flowing() -> bool:
            ms = [m for m in job.metrics()["instances"] if m.get("step") == STEP]
            return sum(m["records_in"] for m in ms) > 10_000

        _wait_for("records reaching the count step", flowing)

        # refused before anything changes
        with pytest.raises(rs.ReconfigurationError, match="no such step"):
            job.replace("nope", count_v2)
        with pytest.raises(rs.ReconfigurationError, match="must be @rs.keyed or"):
            job.replace(STEP, not_keyed)
        with pytest.raises(rs.ReconfigurationError, match="no alive node has that id"):
            job.move(STEP, 0, "f" * 56)
        with pytest.raises(rs.ReconfigurationError, match="instances 0..1"):
            job.move(STEP, 5, ray.get_runtime_context().get_node_id())
        assert job.status()["graph_version"] == 1

        with ThreadPoolExecutor(2) as pool:
            # the count instances block at their next key until the replacement is seen
            # waiting in the queue: the rescale cannot end before (the stream flows, so an
            # instance blocks within milliseconds; the test waits until one did)
            with held(hold):
                rescaling = pool.submit(job.rescale, STEP, 3)
                wait_described(job, "the rescale's start", lambda d: d["rescaling"])
                # waits in the queue behind the rescale
                replacing = pool.submit(job.replace, STEP, count_v2)
                wait_described(job, "the replacement queued", lambda d: d["queued_rescales"] == 1)
            rescaled = rescaling.result()
            replaced = replacing.result()
        assert rescaled["to"] == 3
        assert replaced["instances"] == 3, "every instance of the step switched"

        node = ray.get_runtime_context().get_node_id()
        moved = job.move(STEP, 0, node)
        assert moved["moved"]["key_groups"] > 0 and moved["moved"]["bytes"] > 0
        # the new actor's name carries the graph version the move made (1 + rescale, replace)
        assert moved["actors"] == [f"raystream:reconfigure:{STEP}:0:v4"]
        ray.get_actor(moved["actors"][0], namespace="raystream")  # as the dashboard lists it

        metrics = job.metrics()
        status = job.status()
    finally:
        Path(gate).touch()
    result, events = finished_after_gate(job, gate)

    # every event counted exactly once, per key in order (the operator also checked each seq)
    out = result.table("out")
    expected = prefix_counts(gen, events)
    assert last_counts(out) == dict(expected)
    assert oracle_counts(pa.table({"key": list(expected.elements())})) == dict(expected)

    # tags only after the replace barrier, on every key
    offset = replaced["source_offsets"]["source/0"]
    assert 0 < offset < events
    before = prefix_counts(gen, offset)
    keys = out.column("key").to_pylist()
    counts = out.column("count").to_pylist()
    tags = out.column("tag").to_pylist()
    rows = zip(keys, counts, tags, strict=True)
    wrong = [(k, c, t) for k, c, t in rows if (t == "v2") != (c > before[k])]
    assert not wrong, f"rows tagged on the wrong side of the barrier (key, count, tag): {wrong[:5]}"
    assert "v2" in tags and "" in tags

    # one record per change, in order, each with its epoch; the graph version counts them
    recs = metrics["reconfigurations"]
    assert [r["kind"] for r in recs] == ["rescale", "replace", "move"]
    assert recs[1]["epoch"] > max(recs[0]["epochs"]), "the replacement ran after the rescale"
    assert replaced["queued_s"] > 0, "the replacement waited in the queue behind the rescale"
    assert recs[2]["epoch"] > recs[1]["epoch"]
    assert all(r["end_s"] >= r["start_s"] for r in recs)
    assert all(r.get("peak_latency_ms") is not None for r in recs)
    assert status["graph_version"] == 4
    count_row = next(g for g in status["graph"] if g["step"] == STEP)
    assert count_row["function"].endswith("count_v2") and count_row["parallelism"] == 3
    print(  # noqa: T201 - shown with -s: what the changes cost
        {r["kind"]: (round(r["duration_s"], 3), r["moved"], r["peak_latency_ms"]) for r in recs},
        "replace queued",
        round(replaced["queued_s"], 3),
        "s",
        os.getpid(),
    )
