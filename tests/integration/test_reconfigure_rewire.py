"""A filter put between the source and the count of a running key-count job, and taken out
again: the events it dropped are exactly the even-key events between its two barriers (the
source's offsets when it emitted them), every other event is counted exactly once, per key in
order. Checked against the generator's own rows (``collections.Counter``).
"""

from __future__ import annotations

import collections
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import ray

import raystream as rs

from ._helpers import count_vec, last_counts
from ._rescale_helpers import RUNTIME, UntilGate, generator


@rs.filter
def drop_even(record: dict[str, Any]) -> bool:
    return bool(record["key"] % 2)


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
    flow = rs.Dataflow("rewire", num_key_groups=32, sub_groups=8)
    flow.source(UntilGate(gen, gate)).key_by("key").apply(count_vec, name="count").sink(
        rs.sinks.collect(), name="out"
    )
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
        with pytest.raises(rs.ReconfigurationError, match="stateless operator"):
            job.insert("source", count_vec)
        inserted = job.insert("source", drop_even, name="drop_even")
        assert inserted["actors"] == ["raystream:rewire:drop_even:0:v2"]  # the graph version
        ray.get_actor(inserted["actors"][0], namespace="raystream")
        time.sleep(0.5)
        removed = job.remove("drop_even")
        status = job.status()
    finally:
        Path(gate).touch()
    result = job.wait(timeout_s=120)
    assert result.state == "finished", result.error
    events = int(Path(gate + ".events").read_text())

    start = inserted["source_offsets"]["source/0"]
    end = removed["source_offsets"]["source/0"]
    assert 0 < start < end < events
    keys = _first_keys(gen, events)
    kept = [k for i, k in enumerate(keys) if not (start <= i < end and k % 2 == 0)]
    assert len(kept) < events, "the filter dropped nothing"
    assert last_counts(result.table("out")) == dict(collections.Counter(kept))

    kinds = [r["kind"] for r in status["reconfigurations"]]
    assert kinds == ["insert", "remove"] and status["graph_version"] == 3
    assert [g["step"] for g in status["graph"]] == ["source", "count", "out"]
