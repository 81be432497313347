"""Fault injection: instances are killed with Ray's own API (``ray.kill`` on the named actor)
in steady state, during a checkpoint, during a live rescale, at sources and sinks, twice in a
row; the job recovers from its latest checkpoint and the *committed* output (the Parquet files a
reader sees) must hold every input record exactly once with the right running count.

The oracle is independent of raystream: the generator's stream says, per key, which sequence
numbers exist (0..n-1); the operator emits one row per record with the count of its key so far,
which must be ``seq + 1``. DuckDB reads the published files: no (key, seq) twice, none missing,
no count wrong. A duplicate update of state shows as a wrong count; a lost or doubled output row
as a missing or repeated (key, seq).

The jobs that are killed, stopped or saved from outside read the generator until the test says
where the input ends (``_gates.EndAtGate``, opened once the job recovered): the action lands
while the input flows however long the checkpoints and recoveries before it take, and the oracle
is the prefix of the generator's stream that was sent.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pytest
import ray

import raystream as rs
from raystream.runtime.actors import NAMESPACE, instance_actor_name
from tests.integration._gates import EndAtGate, end_after_checkpoint, events_sent, open_gate
from tests.integration._helpers import (
    NOT_SCALED_OUT,
    generator_prefix,
    running_count_carrying,
    wait_checkpoints,
)

KEYS = 3_000


running_count = running_count_carrying()


LONG = 24_000_000  # events of a gated stream: it ends where the test says, long before


def _gen(events: int, rate_eps: float) -> Any:
    return rs.sources.generator(events=events, keys=KEYS, zipf=1.1, seed=11, rate_eps=rate_eps)


def _flow(name: str, out: Path, events: int, rate_eps: float, sources: int = 1) -> rs.Dataflow:
    return _flow_of(name, out, _gen(events, rate_eps), sources)


def _gated_flow(name: str, out: Path, gate: str, rate_eps: float) -> rs.Dataflow:
    """The job over the generator at ``rate_eps`` until the test opens ``gate``."""
    return _flow_of(name, out, EndAtGate(_gen(LONG, rate_eps), gate))


def _flow_of(name: str, out: Path, source: Any, sources: int = 1) -> rs.Dataflow:
    flow = rs.Dataflow(name, num_key_groups=64, sub_groups=8)
    (
        flow.source(source, parallelism=sources)
        .key_by("key")
        .apply(running_count, name="count")
        .sink(rs.sinks.parquet(str(out)), name="out")
    )
    return flow


def _start(flow: rs.Dataflow, tmp: Path, *, scaled_out: bool = False, **kw: Any) -> rs.Job:
    """``scaled_out``: the test scales the job out (it keeps the default warm standbys)."""
    opts = {
        "parallelism": {"count": 2},
        "checkpoint_interval_s": 0.5,
        "checkpoint_dir": str(tmp / "chk"),
        "restart_delay_s": 0.2,
        "batch_rows": 5_000,
        "linger_ms": 10.0,
    }
    if not scaled_out:
        opts.update(NOT_SCALED_OUT)
    opts.update(kw)
    return rs.start(flow, **opts)


def _kill(job: rs.Job, step: str, index: int) -> None:
    ray.kill(ray.get_actor(instance_actor_name(job.name, step, index), namespace=NAMESPACE))


def _end_input(job: rs.Job, gate: str, recoveries: int) -> None:
    """Once the job recovered ``recoveries`` times and runs: the gated input ends one second of
    events past the newest checkpoint (a reader rewinding to it is never cut short)."""
    _wait_recovered(job, recoveries)
    open_gate(gate, end_after_checkpoint(job.status(), RATE))


def _expected_prefix(events: int) -> dict[int, int]:
    """Records per key of the first ``events`` events of a gated stream."""
    keys = generator_prefix(_gen(LONG, 0), events).column("key").to_numpy()
    uniq, counts = np.unique(keys, return_counts=True)
    return dict(zip(uniq.tolist(), counts.tolist(), strict=True))


def _expected(events: int, sources: int = 1) -> dict[int, int]:
    """Records per key of the generated stream (each source instance generates its share)."""
    gen = rs.sources.generator(events=events, keys=KEYS, zipf=1.1, seed=11)
    keys = gen.generate_all().column("key").to_numpy()
    uniq, counts = np.unique(keys, return_counts=True)
    return dict(zip(uniq.tolist(), counts.tolist(), strict=True))


def assert_exactly_once(out: Path, events: int, expected: dict[int, int] | None = None) -> None:
    con = duckdb.connect()
    files = f"{out}/*.parquet"
    dup = con.sql(
        f"select key, seq, count(*) c from read_parquet('{files}') group by 1, 2 having c > 1"
    ).fetchall()
    assert dup == [], f"records published twice: {dup[:5]} ({len(dup)} in all)"
    wrong = con.sql(
        f"select key, seq, count from read_parquet('{files}') where count != seq + 1 limit 5"
    ).fetchall()
    assert wrong == [], f"counts that saw an update twice or missed one: {wrong}"
    per_key = dict(
        con.sql(f"select key, count(*) from read_parquet('{files}') group by 1").fetchall()
    )
    expected = _expected(events) if expected is None else expected
    missing = {k: n for k, n in expected.items() if per_key.get(k, 0) != n}
    some = list(missing.items())[:5]
    assert not missing, f"{len(missing)} keys with records missing, e.g. {some}"
    assert sum(per_key.values()) == events
    gaps = con.sql(
        f"select key from read_parquet('{files}') group by key having max(seq) + 1 != count(*)"
    ).fetchall()
    assert gaps == []


def _check_recovered(result: rs.JobResult, n: int, what: str) -> None:
    assert result.state == "finished"
    assert len(result.recoveries) >= n, result.recoveries
    for r in result.recoveries:
        assert what in str(r["instance"]) or what == "*", r
        assert r["downtime_s"] < 30
        assert r["records_replayed"] >= 0
        # the restart delay (0.2 s, from the failure) passes before the new loops start; the
        # recorded phases are consecutive parts of the downtime
        phases = dict(r["phases"])
        deploy = phases.pop("deploy")
        assert r["downtime_s"] >= 0.2 - 0.01, r
        assert sum(phases.values()) <= r["downtime_s"] + 0.01, r
        parts = ("placement_s", "actors_s", "wiring_s", "loops_s")
        assert sum(deploy[k] for k in parts) <= phases["deploy_s"] + 0.01, r
        assert deploy["actors_s"] > 0 and deploy["loops_s"] >= deploy["delay_left_s"], r


RATE = 40_000  # events/s of the generated input


def _actor_ids(job: rs.Job) -> dict[str, str]:
    """The job's instance actors by name (an operator chain's: its head's) -> Ray actor id."""
    ids = {}
    for step in ("source", "count", "out"):
        for index in range(2):
            name = instance_actor_name(job.name, step, index)
            try:
                ids[name] = ray.get_actor(name, namespace=NAMESPACE)._actor_id.hex()
            except ValueError:  # a chained instance, or no such index
                pass
    return ids


def _wait_recovered(job: rs.Job, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = job.status()
        if len(st["recoveries"]) >= n and st["state"] == "running":
            return
        time.sleep(0.1)
    raise AssertionError(f"no recovery {n} within {timeout_s} s")


def test_kill_a_keyed_instance_in_steady_state(tmp_path: Path) -> None:
    """Only the killed actor gets a new process: the others are reset in place (their Ray
    actor ids stay), and the output is still exactly once."""
    out, gate = tmp_path / "out", str(tmp_path / "gate")
    job = _start(_gated_flow("rec-steady", out, gate, RATE), tmp_path)
    try:
        wait_checkpoints(job, 2)
        before = _actor_ids(job)
        killed = instance_actor_name(job.name, "count", 0)
        _kill(job, "count", 0)
        _wait_recovered(job, 1)
        after = _actor_ids(job)
        _end_input(job, gate, 1)
        result = job.wait(120)
    finally:
        job.cancel()
    _check_recovered(result, 1, "count")
    rec = result.recoveries[0]
    assert rec["checkpoint_id"] is not None
    assert rec["records_replayed"] > 0
    events = events_sent(gate)
    assert_exactly_once(out, events, _expected_prefix(events))
    assert result.checkpoints["completed"] >= 2
    assert set(after) == set(before) and killed in before, (before, after)
    assert after[killed] != before[killed]
    assert {n: i for n, i in after.items() if n != killed} == {
        n: i for n, i in before.items() if n != killed
    }
    assert rec["actors_started"] == ["count/0"], rec
    assert len(rec["actors_kept"]) == len(before) - 1 and "count/0" not in rec["actors_kept"]


def test_a_user_error_recovers_in_the_same_processes(tmp_path: Path) -> None:
    """A user function that raises (once) leaves its process alive: the recovery resets every
    actor in place and starts none; the output is exactly once."""
    marker = tmp_path / "raised-once"
    seen = [0]  # rows this process saw (~1 s of the stream, past the first checkpoints)

    @rs.map_batches
    def fail_once(batch: pa.RecordBatch) -> pa.RecordBatch:
        seen[0] += batch.num_rows
        if not marker.exists() and seen[0] > 40_000:
            marker.write_text("x")
            raise ValueError("a bad record, once")
        return batch

    out = tmp_path / "out"
    events = 100_000
    gen = rs.sources.generator(events=events, keys=KEYS, zipf=1.1, seed=11, rate_eps=40_000)
    flow = rs.Dataflow("rec-user-error", num_key_groups=64, sub_groups=8)
    (
        flow.source(gen)
        .apply(fail_once, name="check")
        .key_by("key")
        .apply(running_count, name="count")
        .sink(rs.sinks.parquet(str(out)), name="out")
    )
    job = _start(flow, tmp_path)
    try:
        result = job.wait(120)
    finally:
        job.cancel()
    _check_recovered(result, 1, "check")
    rec = result.recoveries[0]
    assert "a bad record, once" in rec["cause"]
    assert rec["actors_started"] == [], rec
    assert len(rec["actors_kept"]) >= 3, rec
    assert_exactly_once(out, events)



def test_kill_during_a_checkpoint(tmp_path: Path) -> None:
    out, gate = tmp_path / "out", str(tmp_path / "gate")
    job = _start(
        _gated_flow("rec-during-chk", out, gate, RATE), tmp_path, checkpoint_interval_s=30.0
    )
    try:
        wait_checkpoints(job, 0)
        time.sleep(1.0)
        job.checkpoint()  # one complete checkpoint to go back to
        errors: list[BaseException] = []

        def take() -> None:
            try:
                job.checkpoint()
            except BaseException as e:  # noqa: BLE001 - expected: the checkpoint is interrupted
                errors.append(e)

        t = threading.Thread(target=take)
        t.start()
        time.sleep(0.01)
        _kill(job, "count", 1)
        t.join(60)
        _end_input(job, gate, 1)
        result = job.wait(120)
    finally:
        job.cancel()
    _check_recovered(result, 1, "count")
    events = events_sent(gate)
    assert_exactly_once(out, events, _expected_prefix(events))


@pytest.mark.parametrize("delay_s", [0.0, 0.15, 0.6])
def test_kill_during_a_meces_rescale(tmp_path: Path, delay_s: float) -> None:
    """0 s: before the old owners are sealed; 0.15 s: while on-demand fetches run; 0.6 s: while
    background pulls run or just after (the phase a kill lands in varies with the machine). The
    delay counts from the rescale's start (its turn taken): a kill before it, on a machine slow
    to start the call, made it wait behind the recovery and run after it (told 3, recovered 2)."""
    out, gate = tmp_path / "out", str(tmp_path / "gate")
    flow = _gated_flow(f"rec-rescale-{int(delay_s * 100)}", out, gate, RATE)
    job = _start(flow, tmp_path, scaled_out=True)
    try:
        wait_checkpoints(job, 2)
        ref = job.controller.rescale.remote("count", 3, "meces")
        deadline = time.monotonic() + 60
        while not job.status()["rescaling"] and not ray.wait([ref], timeout=0)[0]:
            assert time.monotonic() < deadline, "the rescale did not start within 60 s"
            time.sleep(0.01)
        time.sleep(delay_s)
        _kill(job, "count", 0)
        try:
            ray.get(ref, timeout=120)
            told = 3  # it completed before the failure was noticed
        except rs.RescaleError as e:  # the failure interrupted it: the error says where to
            told = _parallelism_told(str(e))
        _end_input(job, gate, 1)
        result = job.wait(120)
    finally:
        job.cancel()
    _check_recovered(result, 1, "count")
    # the job recovered at the parallelism the rescale's caller was told
    assert result.recoveries[0]["parallelism"]["count"] == told
    events = events_sent(gate)
    assert_exactly_once(out, events, _expected_prefix(events))


def _parallelism_told(message: str) -> int:
    """The parallelism an interrupted rescale's error says the job recovers at (2: it waited
    and never started)."""
    if "while the rescale" in message and "waited" in message:
        return 2
    found = re.search(
        r"recovers \(or recovered\) from its latest checkpoint with 'count' at "
        r"parallelism (\d+)",
        message,
    )
    assert found, f"unexpected rescale error: {message}"
    return int(found.group(1))


def test_kill_a_source_then_a_sink(tmp_path: Path) -> None:
    out, gate = tmp_path / "out", str(tmp_path / "gate")
    job = _start(_gated_flow("rec-src-sink", out, gate, RATE), tmp_path)
    try:
        wait_checkpoints(job, 2)
        _kill(job, "source", 0)
        deadline = time.monotonic() + 60
        while not job.status()["recoveries"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        n = job.status()["checkpoints"]["completed"]
        wait_checkpoints(job, n + 2)
        _kill(job, "out", 0)
        _end_input(job, gate, 2)
        result = job.wait(120)
    finally:
        job.cancel()
    _check_recovered(result, 2, "*")
    assert [r["instance"][0] for r in result.recoveries] == ["source", "out"]
    events = events_sent(gate)
    assert_exactly_once(out, events, _expected_prefix(events))


def test_two_instances_killed_one_after_the_other(tmp_path: Path) -> None:
    out, gate = tmp_path / "out", str(tmp_path / "gate")
    job = _start(_gated_flow("rec-twice", out, gate, RATE), tmp_path)
    try:
        wait_checkpoints(job, 2)
        _kill(job, "count", 0)
        time.sleep(0.3)  # the second dies while the first recovery runs or just after
        try:
            _kill(job, "count", 1)
        except ValueError:
            pass  # already replaced by the recovery (a new actor under that name comes later)
        # a checkpoint completes only while the job runs: after it, no recovery of those kills
        # is still to come, and the input's end lies past it
        _wait_recovered(job, 1)
        wait_checkpoints(job, job.status()["checkpoints"]["completed"] + 1)
        _end_input(job, gate, 1)
        result = job.wait(120)
    finally:
        job.cancel()
    _check_recovered(result, 1, "count")
    events = events_sent(gate)
    assert_exactly_once(out, events, _expected_prefix(events))


def test_restart_strategy_gives_up_with_the_cause(tmp_path: Path) -> None:
    out = tmp_path / "out"  # the input never ends by itself: the kill lands while it flows
    job = _start(
        _gated_flow("rec-giveup", out, str(tmp_path / "gate"), RATE), tmp_path, restart_attempts=0
    )
    try:
        wait_checkpoints(job, 1)
        _kill(job, "count", 1)
        with pytest.raises(rs.JobFailedError, match=r"(?s)count.*not recovered: 0 of 0"):
            job.wait(120)
    finally:
        job.cancel()


def test_stop_takes_a_final_checkpoint_and_the_job_resumes_from_it(tmp_path: Path) -> None:
    """stop = final checkpoint + publish; a new run from_checkpoint="latest" (at another
    parallelism) continues where it stopped: together, every record exactly once."""
    out, gate = tmp_path / "out", str(tmp_path / "gate")
    flow = _gated_flow("rec-resume", out, gate, 50_000)  # runs until stopped
    job = _start(flow, tmp_path, checkpoint_interval_s=0.0)
    time.sleep(1.5)
    assert job.wait(0.01).state == "running"  # this handle's wait for the end is now in flight
    stopped = rs.attach(flow.name).stop()  # another handle stops it (as `raystream stop` does)
    assert stopped is not None and stopped.state == "stopped"
    # the first handle's wait gets the same answer (the stopping handle removes the controller
    # right after its own: it must not go before the waiting one's answer)
    seen = job.wait(30)
    assert seen.state == "stopped" and seen.checkpoints["last"] == stopped.checkpoints["last"]
    assert stopped.checkpoints["completed"] == 1
    offset = next(iter(stopped.checkpoints["last"]["source_offsets"].values()))
    assert offset > 0
    con = duckdb.connect()
    published = con.sql(f"select count(*) from read_parquet('{out}/*.parquet')").fetchall()
    assert published[0][0] == offset  # exactly what came before it

    events = offset + 50_000  # the resumed run goes one second of events further, then ends
    open_gate(gate, events)
    job2 = _start(
        _gated_flow("rec-resume", out, gate, 50_000),
        tmp_path,
        parallelism={"count": 3},
        checkpoint_interval_s=0.0,
        from_checkpoint="latest",
    )
    result = job2.wait(120)
    assert result.checkpoints["restored_from"]["kind"] == "checkpoint"
    assert events_sent(gate) == events
    assert_exactly_once(out, events, _expected_prefix(events))


def test_savepoint_restores_at_another_parallelism(tmp_path: Path) -> None:
    out, gate = tmp_path / "out", str(tmp_path / "gate")
    flow = _gated_flow("rec-savepoint", out, gate, 50_000)  # runs until cancelled
    job = _start(flow, tmp_path, checkpoint_interval_s=0.0)
    time.sleep(1.0)
    sp = job.savepoint(str(tmp_path / "sp"))
    job.cancel()  # whatever came after the savepoint is dropped: never published
    assert Path(sp["savepoint"]).exists()
    offset = next(iter(sp["source_offsets"].values()))
    assert offset > 0, sp
    events = offset + 50_000  # the restored run goes 50,000 events further, then ends
    open_gate(gate, events)
    job2 = _start(
        _gated_flow("rec-savepoint", out, gate, 0),
        tmp_path,
        parallelism={"count": 4},
        checkpoint_interval_s=0.0,
        from_savepoint=str(tmp_path / "sp"),
    )
    result = job2.wait(120)
    assert result.state == "finished"
    assert events_sent(gate) == events
    assert_exactly_once(out, events, _expected_prefix(events))


def test_incompatible_or_missing_restore_points_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(rs.CheckpointError, match="is a file"):
        _start(_flow("rec-badchk", out, 1000, 0), tmp_path, checkpoint_dir=str(tmp_path / "a-file"))
    with pytest.raises(rs.CheckpointError, match="no complete checkpoint"):
        _start(_flow("rec-none", out, 1000, 0), tmp_path, from_checkpoint="latest")
    gated = _gated_flow("rec-compat", out, str(tmp_path / "gate"), 50_000)  # until cancelled
    job = _start(gated, tmp_path, checkpoint_interval_s=0.0)
    time.sleep(0.8)
    job.savepoint(str(tmp_path / "sp"))
    job.cancel()
    other = rs.Dataflow("rec-compat", num_key_groups=32, sub_groups=8)
    gen = rs.sources.generator(events=1000, keys=10)
    other.source(gen).key_by("key").apply(running_count, name="counter").sink(
        rs.sinks.parquet(str(tmp_path / "o2")), name="out"
    )
    with pytest.raises(rs.CheckpointError, match=r"(?s)counter.*num_key_groups was 64"):
        _start(other, tmp_path, parallelism={"counter": 2}, from_savepoint=str(tmp_path / "sp"))


def test_a_hung_instance_is_killed_and_the_job_recovers(tmp_path: Path) -> None:
    """An operator whose event loop blocks (here: once, on its first batch) answers no
    heartbeat; after heartbeat_timeout_s it is killed and the job recovers, exactly once."""
    marker = tmp_path / "stalled-once"

    @rs.map_batches
    def stall_once(batch: pa.RecordBatch) -> pa.RecordBatch:
        if not marker.exists():
            marker.write_text("x")
            time.sleep(60)  # blocks the actor's event loop
        return batch

    out = tmp_path / "out"
    events = 100_000
    gen = rs.sources.generator(events=events, keys=KEYS, zipf=1.1, seed=11, rate_eps=40_000)
    flow = rs.Dataflow("rec-hung", num_key_groups=64, sub_groups=8)
    (
        flow.source(gen)
        .apply(stall_once, name="stall")
        # its own actor: chained, the source's heartbeat (same actor) goes unanswered too, and
        # which of the two the controller finds late first is a matter of milliseconds
        .options(chain=False)
        .key_by("key")
        .apply(running_count, name="count")
        .sink(rs.sinks.parquet(str(out)), name="out")
    )
    job = _start(flow, tmp_path, heartbeat_timeout_s=2.0)
    try:
        result = job.wait(120)
    finally:
        job.cancel()
    _check_recovered(result, 1, "stall")
    assert "answered no heartbeat" in result.recoveries[0]["cause"]
    assert_exactly_once(out, events)


def test_a_user_error_reaches_the_caller_with_its_traceback(tmp_path: Path) -> None:
    @rs.map_batches
    def broken_parser(batch: pa.RecordBatch) -> pa.RecordBatch:
        raise ValueError("price column holds 'abc'")

    gen = rs.sources.generator(events=10_000, keys=10)
    flow = rs.Dataflow("rec-traceback")
    flow.source(gen).apply(broken_parser, name="parse").sink(rs.sinks.collect(), name="out")
    with pytest.raises(rs.JobFailedError) as info:
        rs.run(flow, timeout_s=60)
    text = str(info.value)
    assert "step 'parse', instance 0: ValueError: price column holds 'abc'" in text
    assert "Traceback" in text and "in broken_parser" in text
    assert info.value.step == "parse"  # type: ignore[attr-defined]
