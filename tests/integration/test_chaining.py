"""A chained job on Ray: source -> map -> filter (one actor per index) -> keyed count -> sink.

While it runs, checkpoints are taken (barriers through each chain, the collect sink
pre-committing), the actor of one chain is killed (the job recovers from its latest
checkpoint), then the count scales out (the chains' tails get the new receivers). The final
count per key must equal a collections.Counter of the generated keys the filter keeps, and
status must show the chain with metrics per step.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import ray

import raystream as rs
from raystream.runtime.actors import NAMESPACE, instance_actor_name

from ._helpers import count_vec, last_counts
from ._rescale_helpers import UntilGate, prefix_counts

KEYS = 2_000
AFTER_GATE_ROWS = 2_000  # rows each source instance reads once the test opens the gate


def _expected(gen: Any, gate: str) -> collections.Counter[int]:
    """Odd keys of the rows each source instance read (the first rows of its share)."""
    total: collections.Counter[int] = collections.Counter()
    for i in range(2):
        total += prefix_counts(gen, int(Path(f"{gate}.events.{i}").read_text()), i, 2)
    return collections.Counter({k: n for k, n in total.items() if k % 2 == 1})


@rs.map_batches
def tag(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.append_column("odd", pc.equal(pc.bit_wise_and(batch["key"], 1), 1))


@rs.filter
def odd(record: dict[str, Any]) -> bool:
    return bool(record["odd"])


def _wait(what: str, ok: Any, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.05)


def _records_in(job: rs.Job, step: str, index: int) -> int:
    return sum(
        int(m["records_in"])
        for m in job.metrics()["instances"]
        if m.get("step") == step and m.get("index") == index
    )


def test_chained_job_checkpoints_recovers_and_rescales(tmp_path: Path) -> None:
    gen = rs.sources.generator(events=10_000_000, keys=KEYS, zipf=1.1, seed=5, rate_eps=40_000)
    gate = str(tmp_path / "gate")
    flow = rs.Dataflow("chained", num_key_groups=32, sub_groups=8)
    (
        flow.source(UntilGate(gen, gate, after_rows=AFTER_GATE_ROWS), parallelism=2)
        .apply(tag, parallelism=2)
        .apply(odd, parallelism=2)
        .key_by("key")
        .apply(count_vec, name="count")
        .sink(rs.sinks.collect(), name="out")
    )
    job = rs.start(
        flow,
        parallelism={"count": 2},
        checkpoint_interval_s=0.5,
        checkpoint_dir=str(tmp_path / "chk"),
        restart_delay_s=0.2,
        linger_ms=10.0,
    )
    try:
        _wait("a checkpoint", lambda: job.status()["checkpoints"]["completed"] >= 1)
        ray.kill(ray.get_actor(instance_actor_name(job.name, "source", 1), namespace=NAMESPACE))
        _wait("a recovery", lambda: job.status()["recoveries"])
        rescale = job.rescale("count", 3)
        status = job.status()
    finally:
        Path(gate).touch()
    result = job.wait(timeout_s=120)
    assert result.state == "finished", result.error
    chains = {g["step"]: g["chain"] for g in status["graph"]}
    assert chains["tag"] == chains["odd"] == ["source", "tag", "odd"] and chains["count"] == []
    assert status["parallelism"]["count"] == 3 and rescale["to"] == 3

    # metrics per step, not per actor (the attempt after the recovery, which ran to the end;
    # the count's records in are what the filters sent, kept and handed over in the rescale)
    def total(step: str, key: str) -> int:
        return sum(int(m[key]) for m in result.step_metrics(step))

    emitted = total("source", "records_out")
    assert emitted > 0 and total("tag", "records_in") == total("tag", "records_out") == emitted
    assert total("odd", "records_in") == emitted > total("odd", "records_out") > 0
    # one recovery, caused by the killed chain (any of its instances reports the dead actor)
    assert len(result.recoveries) == 1
    cause = tuple(result.recoveries[0]["instance"])
    assert cause in {("source", 1), ("tag", 1), ("odd", 1)}, cause
    assert last_counts(result.table("out")) == dict(_expected(gen, gate))


def _count_version(version: int) -> Any:
    @rs.keyed_batches(state=rs.ValueState(int, default=0))
    def count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
        new = state.get(batch.keys) + batch.counts
        state.put(batch.keys, new)
        return batch.output({"count": new, "version": pa.array([version] * len(new))})

    return count


def test_a_sink_chained_to_a_keyed_step_follows_its_rescales(tmp_path: Path) -> None:
    """count -> collect sink at parallelism 2, chained (one actor per index of count). While it
    checkpoints, count scales out to 3 (a new chain actor with a new sink instance), its
    function is replaced (the barrier passes each chain: keyed state kept), and it scales back
    in to 2 (the retired sink's end is recorded and published by a checkpoint). Every sink
    instance's counts grow strictly per key and its versions never go back, no count is emitted
    twice across instances, and the last count per key equals a collections.Counter of the
    events the source read."""
    gen = rs.sources.generator(events=10_000_000, keys=KEYS, zipf=1.1, seed=9, rate_eps=40_000)
    gate = str(tmp_path / "gate")
    flow = rs.Dataflow("chained_sink", num_key_groups=32, sub_groups=8)
    flow.source(UntilGate(gen, gate, after_rows=AFTER_GATE_ROWS)).key_by("key").apply(
        _count_version(1), name="count", parallelism=2
    ).sink(rs.sinks.collect(), name="out", parallelism=2)
    job = rs.start(
        flow,
        checkpoint_interval_s=0.5,
        checkpoint_dir=str(tmp_path / "chk"),
        linger_ms=10.0,
    )
    try:
        _wait("a checkpoint", lambda: job.status()["checkpoints"]["completed"] >= 1)
        out3 = job.rescale("count", 3)
        status = job.status()
        done = job.status()["checkpoints"]["completed"]
        _wait("a checkpoint at 3", lambda: job.status()["checkpoints"]["completed"] > done)
        _wait("rows at the new sink instance out/2", lambda: _records_in(job, "out", 2) > 0)
        job.replace("count", _count_version(2))
        back = job.rescale("count", 2)
    finally:
        Path(gate).touch()
    result = job.wait(timeout_s=120)
    assert result.state == "finished", result.error
    assert out3["to"] == 3 and back["to"] == 2
    chains = {g["step"]: g["chain"] for g in status["graph"]}
    assert chains["count"] == chains["out"] == ["count", "out"]
    assert status["parallelism"]["out"] == 3
    # three sink instances: the two live ones, then the one the scale-in retired
    tables = result.results["out"]
    assert len(tables) == 3
    seen: dict[int, set[int]] = collections.defaultdict(set)
    versions: set[int] = set()
    for t in tables:
        for k, c in zip(t["key"].to_pylist(), t["count"].to_pylist(), strict=True):
            assert c not in seen[k], f"key {k}: count {c} emitted by two sink instances"
            seen[k].add(c)
        last_counts(t)  # per instance, per key strictly growing
        # the replacement took over at its barrier: per key, version 2 only after version 1
        latest: dict[int, int] = {}
        for k, v in zip(t["key"].to_pylist(), t["version"].to_pylist(), strict=True):
            assert v >= latest.get(k, 1), f"key {k}: version {v} after {latest[k]}"
            latest[k] = v
        versions.update(latest.values())
    assert versions == {1, 2}
    expected = prefix_counts(gen, int(Path(f"{gate}.events").read_text()))
    assert {k: max(v) for k, v in seen.items()} == dict(expected)
    # sink records in per instance: the retired instance wrote rows, the new one too
    by_index = {int(m["index"]): int(m["records_in"]) for m in result.step_metrics("out")}
    assert by_index.get(2, 0) > 0
