"""Changes that take warm spares (``RuntimeConfig(change_spares=2)``): a keyed count inserted
into a running job starts in two spare actors (no new process), one of its instances is then
moved into a refilled spare, and it is removed with its state emitted. Each event between its
two barriers is counted exactly once (``collections.Counter`` over the generator's rows), every
event outside them passes uncounted, and the controller's directory names the actors.
"""

from __future__ import annotations

import collections
import tempfile
import time
from pathlib import Path

import ray

import raystream as rs

from ._helpers import Batches, count_vec, finished_after_gate
from ._rescale_helpers import RUNTIME, UntilGate, generator
from .test_reconfigure_rewire import _first_keys, _per_key_last, _records_in


def _wait_spares(job: rs.Job, n: int, timeout_s: float = 60.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while len(names := job.status()["change_spares"]) < n:
        assert time.monotonic() < deadline, f"expected {n} warm spares, have {names}"
        time.sleep(0.05)
    return names


def _wait_records(job: rs.Job, step: str, n: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (got := _records_in(job, step)) < n:
        assert time.monotonic() < deadline, f"{got} records reached {step!r}, waited for {n}"
        time.sleep(0.02)


def test_keyed_insert_and_move_take_warm_spares_and_count_exactly(tmp_path: Path) -> None:
    gen = generator("int", skewed=True, seed=31)
    gate = str(tmp_path / "gate")
    flow = rs.Dataflow("spares", num_key_groups=32, sub_groups=8)
    flow.source(UntilGate(gen, gate)).sink(Batches(), name="out")
    job = rs.start(
        flow,
        state_dir=tempfile.mkdtemp(),
        chaining=False,
        change_spares=2,
        change_spare_refill_delay_s=0.2,
        **RUNTIME,
    )
    try:
        _wait_records(job, "out", 2_000)
        spares = _wait_spares(job, 2)
        inserted = job.insert("source", count_vec, name="count", key_by="key", parallelism=2)
        assert inserted["spares_used"] == 2 and sorted(inserted["actors"]) == sorted(spares)
        for name in inserted["actors"]:  # the actors are found by the names the record gives
            ray.get_actor(name, namespace="raystream")
        names = job.status()["actor_names"]
        assert sorted(names) == ["count/0", "count/1"], names
        assert sorted(names.values()) == sorted(spares)
        refilled = _wait_spares(job, 1)  # refilled one at a time after the change
        node = ray.get_runtime_context().get_node_id()
        moved = job.move("count", 0, node)
        assert moved["spares_used"] == 1 and moved["actors"] == [refilled[0]], moved
        # records counted after the move: the remove's barrier comes after the insert's
        _wait_records(job, "count", _records_in(job, "count") + 2_000)
        emitted = job.remove("count", state="emit")
        status = job.status()
    finally:
        Path(gate).touch()
    result, events = finished_after_gate(job, gate)

    b1, b2 = inserted["source_offsets"]["source/0"], emitted["source_offsets"]["source/0"]
    assert 0 < b1 < b2 < events
    keys = _first_keys(gen, events)
    batches = [b for part in result.results["out"] for b in part]
    raw = [b for b in batches if "seq" in b.schema.names]
    counts = [b for b in batches if "count" in b.schema.names]
    final = [b for b in batches if "state" in b.schema.names]
    assert len(raw) + len(counts) + len(final) == len(batches)
    outside = [k for i, k in enumerate(keys) if i < b1 or i >= b2]
    assert collections.Counter(k for b in raw for k in b["key"].to_pylist()) == (
        collections.Counter(outside)
    )
    between = dict(collections.Counter(keys[b1:b2]))
    assert _per_key_last(counts, "count") == between  # across the move too
    state_rows = [
        (k, v)
        for b in final
        for k, v in zip(b["key"].to_pylist(), b["state"].to_pylist(), strict=True)
    ]
    assert dict(state_rows) == between and len(state_rows) == len(between)

    assert status["actor_names"] == {}  # the step is gone
    refills = result.spare_refills
    assert [r["why"] for r in refills][:2] == ["start", "insert 'count'"], refills
    assert all(len(r["process_starts_s"]) >= 1 for r in refills[:1]), refills
