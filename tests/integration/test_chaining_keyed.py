"""Stateless steps chained after a keyed step on Ray: a running count (one row per event: key,
seq, count) -> tag (derives a column) -> filter (keeps even counts), in the actors of the count,
while the job checkpoints, rescales and recovers.

The oracle is plain Python over the generator's own rows: the rows the source sent, counted per
key (collections.Counter); every even count of every key must reach the sink exactly once, with
``count == seq + 1`` (the generator numbers each key's events), and per key in order within each
sink instance.
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
from raystream.runtime.actors import NAMESPACE, instance_actor_name
from tests._chain_ops import parity_tagger

from ._helpers import running_count, stop_on_error, wait_checkpoints
from ._rescale_helpers import UntilGate, prefix_counts

KEYS = 2_000
AFTER_GATE_ROWS = 4_000


@rs.filter
def even(record: dict[str, Any]) -> bool:
    return bool(record["even"])


@rs.keyed_batches(state=rs.ValueState(int, default=0), name="recount")
def recount(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    """Each row the chain sent, with ``n``: how many rows of its key came here up to it."""
    before = state.get(batch.keys)
    counts = batch.counts
    state.put(batch.keys, before + counts)
    rows = batch.records
    rank = np.arange(rows.num_rows) - np.repeat(np.cumsum(counts) - counts, counts)
    columns = {c: rows.column(c) for c in ("key", "seq", "count", "even", "version")}
    columns["n"] = pa.array(np.repeat(before, counts) + rank + 1, pa.int64())
    return pa.record_batch(columns)


def _flow(
    name: str, gen: Any, gate: str, sink_parallelism: int | None, *, keyed_after: bool = False
) -> rs.Dataflow:
    flow = rs.Dataflow(name, num_key_groups=32, sub_groups=8)
    chain = (
        flow.source(UntilGate(gen, gate, after_rows=AFTER_GATE_ROWS))
        .key_by("key")
        .apply(running_count, name="count", parallelism=2)
        .apply(parity_tagger(1, "tag"))
        .apply(even)
    )
    if keyed_after:  # a second keyed step reads the chain's tails by key group
        chain = chain.key_by("key").apply(recount)
    chain.sink(rs.sinks.collect(), name="out", parallelism=sink_parallelism)
    return flow


def _wait(what: str, ok: Any, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.05)


def _check_exact(tables: list[pa.Table], gen: Any, events: int) -> None:
    """Every even count of each key once over all ``tables``, count == seq + 1, and per key
    in order (steps of 2) within each table."""
    expected = prefix_counts(gen, events)
    want = collections.Counter((k, c) for k, n in expected.items() for c in range(2, n + 1, 2))
    got: collections.Counter[tuple[int, int]] = collections.Counter()
    for t in tables:
        assert all(t["even"].to_pylist())
        last: dict[int, int] = {}
        for k, seq, c in zip(
            t["key"].to_pylist(), t["seq"].to_pylist(), t["count"].to_pylist(), strict=True
        ):
            assert c == seq + 1, f"key {k}: count {c} for its event {seq}"
            assert c > last.get(k, 0), f"key {k}: count {c} after {last[k]} in one sink instance"
            last[k] = c
            got[(k, c)] += 1
    twice = [kc for kc, n in got.items() if n > 1]
    assert not twice, f"{len(twice)} rows reached the sink more than once, e.g. {twice[:5]}"
    missing = want - got
    extra = got - want
    assert not missing and not extra, (
        f"{sum(missing.values())} rows missing (e.g. {list(missing)[:5]}), "
        f"{sum(extra.values())} not expected (e.g. {list(extra)[:5]})"
    )


def _sent(job: rs.Job, step: str, index: int) -> int:
    return sum(
        int(m["records_out"])
        for m in job.metrics()["instances"]
        if m.get("step") == step and m.get("index") == index
    )


def test_steps_chained_after_a_keyed_step_follow_its_rescales(tmp_path: Path) -> None:
    """count -> tag -> even chained (one actor per index of count), then a second keyed step,
    recount (at 1, its sink chained to it), that reads every chain's tail by key group. While it
    checkpoints, count scales 2 -> 3, recount 1 -> 2 (the chains' tails get the new receivers),
    tag's function is replaced, count scales 3 -> 1 -> 2: a new chain's tail starts sending to
    recount, retired chains end their tails' outputs (and an index that comes back gets a new
    chain). recount must see every even count of every key once and in order (its own count of
    a key's rows is half the count), and so must the sink, per instance."""
    gen = rs.sources.generator(events=10_000_000, keys=KEYS, zipf=1.1, seed=21, rate_eps=40_000)
    gate = str(tmp_path / "gate")
    flow = _flow("chained_after_keyed", gen, gate, sink_parallelism=None, keyed_after=True)
    job = rs.start(
        flow, checkpoint_interval_s=0.5, checkpoint_dir=str(tmp_path / "chk"), linger_ms=10.0
    )
    try:
        with stop_on_error(job):
            wait_checkpoints(job, 1)
            at_start = job.status()
            to3 = job.rescale("count", 3)
            at3 = job.status()
            wait_checkpoints(job, at3["checkpoints"]["completed"] + 1)
            _wait("rows sent by the new chain's tail even/2", lambda: _sent(job, "even", 2) > 0)
            recount2 = job.rescale("recount", 2)
            # the chained tag's function is replaced at a barrier; chains started later run it
            replaced = job.replace("tag", parity_tagger(2, "tag"))
            to1 = job.rescale("count", 1)
            at1 = job.status()
            # index 1 comes back: the sink takes the new tail once the retired one ended there
            to2 = job.rescale("count", 2)
    finally:
        Path(gate).touch()
    result = job.wait(timeout_s=120)
    assert result.state == "finished", result.error
    assert to3["to"] == 3 and to1["to"] == 1 and to2["to"] == 2 and recount2["to"] == 2
    assert replaced["instances"] == 3
    chains = {g["step"]: g["chain"] for g in at_start["graph"]}
    assert chains["count"] == chains["tag"] == chains["even"] == ["count", "tag", "even"]
    assert chains["recount"] == chains["out"] == ["recount", "out"]
    steps = ("count", "tag", "even", "recount", "out")
    assert [at_start["parallelism"][s] for s in steps] == [2, 2, 2, 1, 1]
    assert [at3["parallelism"][s] for s in steps] == [3, 3, 3, 1, 1]
    assert [at1["parallelism"][s] for s in steps] == [1, 1, 1, 2, 2]
    # the chain of the new index ran: its tail sent rows on
    sent: collections.Counter[int] = collections.Counter()
    for m in result.step_metrics("even"):
        sent[int(m["index"])] += int(m["records_out"])
    assert sent[2] > 0, sent
    # index 1 ran twice (retired by the scale-in to 1, started again by the scale-out to 2)
    assert sorted(int(m["index"]) for m in result.step_metrics("tag")) == [0, 1, 1, 2]
    tables = list(result.results["out"])
    assert len(tables) == 2
    _check_exact(tables, gen, int(Path(f"{gate}.events").read_text()))
    versions: set[int] = set()
    for t in tables:
        # recount saw each key's even counts once and in order: its n-th row has count 2n
        bad = [
            (k, c, n)
            for k, c, n in zip(t["key"].to_pylist(), t["count"].to_pylist(), t["n"].to_pylist(), strict=True)
            if c != 2 * n
        ]
        assert not bad, f"{len(bad)} rows reached recount out of order or not once, e.g. {bad[:5]}"
        # per key, version 2 only after version 1: the barrier passed each chain in order, and
        # the chain that came back at index 1 (after keys had version-2 rows at index 0) ran
        # the new function (a key with no row after the replace keeps version 1)
        latest: dict[int, int] = {}
        for k, v in zip(t["key"].to_pylist(), t["version"].to_pylist(), strict=True):
            assert v >= latest.get(k, 1), f"key {k}: version {v} after {latest[k]}"
            latest[k] = v
        versions.update(t["version"].to_pylist())
    assert versions == {1, 2}


def test_a_keyed_chain_recovers_from_a_killed_actor_and_rescales(tmp_path: Path) -> None:
    """count -> tag -> even -> sink all chained at parallelism 2 (the sink given 2). After a
    checkpoint the actor of the chain at index 1 is killed: the job recovers from its latest
    checkpoint (the chains again at count's parallelism), then count scales out to 3. Every row
    reaches the sinks once over all instances."""
    gen = rs.sources.generator(events=10_000_000, keys=KEYS, zipf=1.1, seed=23, rate_eps=40_000)
    gate = str(tmp_path / "gate")
    flow = _flow("chained_after_keyed_recovery", gen, gate, sink_parallelism=2)
    job = rs.start(
        flow,
        checkpoint_interval_s=0.5,
        checkpoint_dir=str(tmp_path / "chk"),
        restart_delay_s=0.2,
        linger_ms=10.0,
    )
    try:
        with stop_on_error(job):
            wait_checkpoints(job, 1)
            ray.kill(ray.get_actor(instance_actor_name(job.name, "count", 1), namespace=NAMESPACE))
            _wait("a recovery", lambda: job.status()["recoveries"])
            wait_checkpoints(job, job.status()["checkpoints"]["completed"] + 1)
            to3 = job.rescale("count", 3)
            status = job.status()
    finally:
        Path(gate).touch()
    result = job.wait(timeout_s=120)
    assert result.state == "finished", result.error
    assert to3["to"] == 3 and len(result.recoveries) == 1
    cause = tuple(result.recoveries[0]["instance"])
    assert cause in {("count", 1), ("tag", 1), ("even", 1), ("out", 1)}, cause
    chains = {g["step"]: g["chain"] for g in status["graph"]}
    assert chains["tag"] == chains["out"] == ["count", "tag", "even", "out"]
    assert [status["parallelism"][s] for s in ("count", "tag", "even", "out")] == [3, 3, 3, 3]
    tables = result.results["out"]
    assert len(tables) == 3
    _check_exact(list(tables), gen, int(Path(f"{gate}.events").read_text()))
