"""Keyed state really lives in RocksDB: an aligned checkpoint taken mid-stream holds exactly the
counts of the events before the barrier, and a fresh processor restored from it, fed the rest of
the stream, ends with the counts of the whole stream."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

import raystream as rs
from raystream.checkpoint.storage import CheckpointStorage
from raystream.runtime.processors import make_processor
from raystream.state.handles import KeyedStates
from raystream.state.rocks import RocksStateBackend
from tests.integration._helpers import (
    NOT_SCALED_OUT,
    HeldAt,
    assert_counts_equal,
    keycount_flow,
    last_counts,
    oracle_counts,
    step_metrics,
    stop_on_error,
)

EVENTS = 300_000
RATE_EPS = 100_000  # ~3 s of stream


def _wait_for(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _count_step_in(job: rs.Job) -> int:
    insts = job.metrics()["instances"]
    return sum(m.get("records_in", 0) for m in insts if m.get("step") == "count")


def _state_counts(backend: RocksStateBackend, flow: rs.Dataflow) -> dict[Any, int]:
    states = KeyedStates(backend, flow.steps["count"].state, flow.key_space)
    return dict(states.iter_values("", "int"))


def test_checkpoint_holds_the_prefix_and_restores(tmp_path: Path) -> None:
    gen = rs.sources.generator(events=EVENTS, keys=20_000, zipf=1.1, seed=5, rate_eps=RATE_EPS)
    events = gen.generate_all()
    # the source stops short at half the stream until the checkpoint returned: its barrier falls
    # mid-stream however long the checkpoint takes to reach the source
    gate = tmp_path / "checkpointed"
    flow = keycount_flow("ckpt", HeldAt(gen, ((EVENTS // 2, str(gate)),)))
    key_space = flow.key_space
    chk = tmp_path / "chk"
    job = rs.start(
        flow,
        parallelism={"count": 2},
        batch_rows=10_000,
        linger_ms=10.0,
        checkpoint_dir=str(chk),
        **NOT_SCALED_OUT,
    )
    try:
        with stop_on_error(job):
            _wait_for(lambda: _count_step_in(job) >= 30_000, 120, "records to reach the count step")
            reply = job.checkpoint()
    finally:
        gate.touch()
    with stop_on_error(job):
        result = job.wait(120)

    # -- the reply and the manifest: where the barrier was, which states hold which key groups --
    assert list(reply["source_offsets"]) == ["source/0"]
    offset = reply["source_offsets"]["source/0"]
    assert 30_000 <= offset < EVENTS, "the barrier must fall mid-stream"
    assert reply["uploaded_bytes"] > 0
    storage = CheckpointStorage(str(chk), flow.name)
    manifest = storage.load(reply["checkpoint_id"])
    states = {k: e for k, e in manifest["instances"].items() if "state" in e}
    assert sorted(states) == ["count/0", "count/1"]
    groups = [set(e["key_groups"]) for e in states.values()]
    assert set().union(*groups) == set(range(key_space.num_key_groups))
    assert sum(len(g) for g in groups) == key_space.num_key_groups  # disjoint
    snaps = {}
    for name, e in states.items():
        path = storage.materialize_state(e["state"], str(tmp_path / "local" / name))
        snaps[name] = {"path": path, "key_groups": e["key_groups"]}

    # -- each snapshot, restored into a fresh backend, holds the prefix counts of its groups --
    prefix_expected = oracle_counts(events.slice(0, offset))
    # ... and read as a table (rs.read_state: every instance's key groups, as of the manifest)
    read = rs.read_state(flow, "count", checkpoint_dir=str(chk), checkpoint=reply["checkpoint_id"])
    table = read["state"]
    assert table.num_rows == len(prefix_expected)
    got_read = dict(zip(*(table.column(c).to_pylist() for c in ("key", "value")), strict=True))
    assert_counts_equal(got_read, prefix_expected)
    union: dict[Any, int] = {}
    for i, (name, snap) in enumerate(sorted(snaps.items())):
        backend = RocksStateBackend(tmp_path / "verify" / str(i))
        try:
            rows = backend.restore_key_groups(snap["path"], snap["key_groups"])
            got = _state_counts(backend, flow)
        finally:
            backend.destroy()
        assert rows == len(got)
        if got:
            kg, _ = key_space.locate(pa.array(list(got), pa.int64()))
            assert set(kg.tolist()) <= set(snap["key_groups"]), f"{name} holds foreign key groups"
        expected_here = {
            k: n
            for k, n in prefix_expected.items()
            if int(key_space.locate(pa.array([k], pa.int64()))[0][0]) in set(snap["key_groups"])
        }
        assert_counts_equal(got, expected_here)
        assert not union.keys() & got.keys()
        union.update(got)
    assert_counts_equal(union, prefix_expected)

    # -- a fresh processor restored from the snapshots, fed the rest, ends with the full counts -
    full_expected = oracle_counts(events)
    proc = make_processor(
        flow.steps["count"], key_space, tmp_path / "restored", range(key_space.num_key_groups)
    )
    try:
        for snap in snaps.values():
            proc.backend.restore_key_groups(snap["path"], snap["key_groups"])
        outs = []
        rest = events.slice(offset)
        for batch in rest.to_batches(max_chunksize=25_000):
            outs.extend(proc.process(batch))
        assert_counts_equal(_state_counts(proc.backend, flow), full_expected)
        emitted = last_counts(pa.Table.from_batches(outs))
        rest_keys = set(oracle_counts(rest))
        assert_counts_equal(emitted, {k: full_expected[k] for k in rest_keys})
    finally:
        proc.close()

    # -- and the job itself, undisturbed by the checkpoint, ends with the full counts ---------
    assert result.state == "finished"
    assert_counts_equal(last_counts(result.table("out")), full_expected)
    assert sum(m["records_in"] for m in step_metrics(result.metrics, "count")) == EVENTS
    assert np.isfinite(result.elapsed_s) and result.elapsed_s >= 0.5 * EVENTS / RATE_EPS
