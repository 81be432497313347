"""Live rescaling end to end: every strategy keeps results exact, and the invariants of
ARCHITECTURE.md section 4 hold, each checked by something that fails if it is broken.

Every job here rescales the keyed step ``count`` while a rate-limited generator runs at full
rate; the stream ends only after the rescales returned (see ``UntilGate`` in
``_rescale_helpers.py``), and results are checked against a ``collections.Counter`` over exactly
the events that were sent. The operator itself checks per-key order (each key's ``seq`` goes on
without a gap) and fails the job otherwise.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pytest
import ray

import raystream as rs
from raystream.migration.strategies import Meces
from raystream.plugins import MIGRATION_STRATEGIES, known
from raystream.rescale import FetchPolicy, MigrationPlan, RescaleContext, steps_moving
from raystream.runtime.actors import NAMESPACE, instance_actor_name
from tests.integration._rescale_helpers import (
    NUM_KEY_GROUPS,
    RUNTIME,
    STEP,
    SUB_GROUPS,
    LiveJob,
    UntilGate,
    assert_exact,
    count,
    generator,
    live_job,
    prefix_counts,
    records_between,
    run_with_rescales,
    source_finished,
    step_metrics,
)

STRATEGIES = ["meces", "all_at_once", "fluid", "batched", "lazy", "stop_restart"]
# pattern -> (start parallelism, successive targets): out and back in; out, then in to a third
# width. (Out and in share a job: every job start costs seconds on a shared 2-core machine.)
PATTERNS = {"2to4to2": (2, [4, 2]), "2to5to3": (2, [5, 3])}
# (key type, skewed): the strategies take turns over the four kinds and the two patterns; every
# strategy also scales out and in again with other key kinds in test_rescale_sequences.py (seeded
# random sequences) and moves state between nodes in test_cluster.py
KEY_KINDS = [("int", False), ("str", True), ("str", False), ("int", True)]
# lazy leaves a sub-group no record asks for with its old owner for max_lazy_s (default 5 s)
STRATEGY_ARGS = {"lazy": {"max_lazy_s": 1.5}}
LIVE_FETCH = {"meces", "all_at_once", "fluid", "batched", "lazy"}  # new owners pull from old ones
ON_DEMAND = {"meces", "lazy"}  # policies that may fetch on demand
# stats of the rescales run by test_rescale_mid_stream_is_exact, per strategy (for checks that
# need no job of their own)
MATRIX_STATS: dict[str, list[dict[str, Any]]] = {}


# meces and all_at_once plan one step that moves everything, like most strategies here; their
# live rescales are also checked by test_rescale_sequences.py, test_cluster.py, the chunked meces
# test below, the recovery tests and every NEXMark rescale run. The matrix keeps the strategies
# whose plans differ (one key group per step, batches, on-demand only, stop-and-restart).
MATRIX = ["fluid", "batched", "lazy", "stop_restart"]


def _cases() -> list[Any]:
    cases = []
    for s, strategy in enumerate(MATRIX):
        pattern = list(PATTERNS)[s % len(PATTERNS)]
        key_type, skewed = KEY_KINDS[s % len(KEY_KINDS)]
        case_id = f"{strategy}-{pattern}-{key_type}-{'hot' if skewed else 'uniform'}"
        cases.append(pytest.param(strategy, pattern, key_type, skewed, id=case_id))
    return cases


def test_the_cases_cover_every_pattern_and_key_kind() -> None:
    cases = [c.values for c in _cases()]
    assert sorted(c[0] for c in cases) == sorted(MATRIX) and set(MATRIX) <= set(STRATEGIES)
    assert {c[1] for c in cases} == set(PATTERNS)
    assert {(c[2], c[3]) for c in cases} == set(KEY_KINDS)
    assert set(known(MIGRATION_STRATEGIES)) >= set(STRATEGIES)


def _check_stats(
    strategy: str, start: int, targets: list[int], stats: list[dict[str, Any]]
) -> None:
    """What each strategy's plan promises, as the returned stats show it."""
    assert [(st["from"], st["to"]) for st in stats] == list(
        zip([start, *targets[:-1]], targets, strict=True)
    )
    for st in stats:
        assert st["strategy"] == strategy
        assert 0 < st["start_s"] < st["end_s"]
        assert st["moved_key_groups"] > 0, st
        assert st["moved_rows"] > 0, f"no state rows moved: {st}"
        if strategy in LIVE_FETCH:
            assert st["moved_bytes"] > 0, f"state moved actor to actor must count its bytes: {st}"
        if strategy == "fluid":  # Megaphone's fluid: one key group per step, one barrier each
            assert st["steps"] == st["moved_key_groups"], st
        elif strategy == "batched":  # batch_size 8
            assert st["steps"] == math.ceil(st["moved_key_groups"] / 8), st
        else:
            assert st["steps"] == 1, st
        if strategy not in ON_DEMAND:  # these policies never fetch on demand
            assert st["on_demand_fetches"] == 0, st
    if strategy == "lazy":  # nothing moves in the background for 1.5 s: records pull state
        assert sum(st["on_demand_fetches"] for st in stats) > 0, stats
    # (Meces races its background pulls against the records; the chunked test below makes the
    # background slow enough that records must win.)
    for a, b in zip(stats, stats[1:], strict=False):
        assert b["start_s"] >= a["end_s"]


def _check_status(
    before: dict[str, Any],
    after: list[dict[str, Any]],
    targets: list[int],
    stats: list[dict[str, Any]],
) -> None:
    """After each rescale: the new parallelism, the routing epoch advanced by one per step,
    nothing queued, and every count instance finished its part of the move: everything it had
    to hand out is handed out, everything it had to receive arrived, no record waits for state."""
    epoch = before["routing_epochs"][STEP]
    for p, st, status in zip(targets, stats, after, strict=True):
        epoch += st["steps"]
        assert status["parallelism"][STEP] == p
        assert status["routing_epochs"][STEP] == epoch, (status["routing_epochs"], st)
        assert status["queued_rescales"] == 0 and not status["rescaling"]
        migrating = [m for m in step_metrics(status["instances"]) if "migration" in m]
        assert len(migrating) >= p, f"instances with a migration task: {migrating}"
        for m in migrating:
            mig = m["migration"]
            assert mig["done"] and mig["outgoing_left"] == 0 and mig["pending_rows"] == 0, (
                m["index"],
                mig,
            )
            assert mig["arrived"] == mig["incoming"], (m["index"], mig)


@pytest.mark.parametrize(("strategy", "pattern", "key_type", "skewed"), _cases())
def test_rescale_mid_stream_is_exact(
    strategy: str, pattern: str, key_type: str, skewed: bool
) -> None:
    start, targets = PATTERNS[pattern]
    gen = generator(key_type, skewed, seed=len(strategy) * 7 + len(pattern))

    run = run_with_rescales(
        f"rescale-{strategy}-{pattern}",
        gen,
        start,
        targets,
        strategy,
        strategy_args=STRATEGY_ARGS.get(strategy),
    )

    res, events = run.result, run.events
    MATRIX_STATS.setdefault(strategy, []).extend(run.stats)
    expected = prefix_counts(gen, events)
    if skewed:  # the case really has a hot key
        assert max(expected.values()) > 0.4 * events
    out = res.table("out")
    assert_exact(out, expected, events)
    counts = step_metrics(res.metrics)
    assert [m["index"] for m in counts] == list(range(max(start, *targets)))
    assert sum(m["records_in"] for m in counts) == events, "records into count: lost or duplicated"
    assert sum(m["records_out"] for m in counts) == out.num_rows
    _check_stats(strategy, start, targets, run.stats)
    _check_status(run.status_before, run.status_after, targets, run.stats)
    assert res.rescales == run.stats
    if strategy != "stop_restart":  # the others keep records flowing while they move state
        first = run.stats[0]
        assert records_between(res.metrics, first["start_s"], first["end_s"]) > 0


def test_stop_restart_reports_the_bytes_it_restored() -> None:
    """Every strategy's stats count the state it moved; stop-and-restart moves it through
    snapshots, and its bytes count as well (uses the stop_restart cases run above)."""
    stats = MATRIX_STATS.get("stop_restart")
    if not stats:
        pytest.skip(
            "needs the stop_restart cases of test_rescale_mid_stream_is_exact in the same run"
        )
    assert all(st["moved_rows"] > 0 for st in stats)
    assert all(st["moved_bytes"] > 0 for st in stats), [st["moved_bytes"] for st in stats]


# ------------------------------------------------------------------------------------------
# a strategy of one's own; a rescale during a rescale


@dataclass(frozen=True)
class Halves:
    """A test-only strategy: move the key groups in two steps (half, then the rest), fetching on
    demand and hottest first. Passed as an object, which Ray ships by value."""

    name: str = "halves"

    def plan(self, ctx: RescaleContext) -> MigrationPlan:
        moved = len(ctx.old.moved_key_groups(ctx.new))
        steps = steps_moving(ctx, max(1, math.ceil(moved / 2)))
        return MigrationPlan(self.name, steps, FetchPolicy(on_demand=True, background="hot_first"))


def test_rescale_during_rescale_is_queued_custom_and_import_path_strategies() -> None:
    """Two rescales sent back to back: the second waits in the queue, then starts from the first's
    result. The first uses a strategy object defined here, the second a built-in one given by
    import path with an argument; both plans are followed step by step. The operator is slow,
    so old owners still hold pre-barrier records when new owners ask for their state (handing it
    out before the barrier passed would lose them or fail the job). Counts stay exact."""
    gen = generator("str", True, seed=5)
    with live_job("rescale-queued", gen, 2, slow=True) as live:
        before = live.job.status()
        live.wait_flowing()
        first = live.job.controller.rescale.remote(STEP, 4, Halves())
        second = live.job.controller.rescale.remote(
            STEP, 3, "raystream.migration.strategies:Batched", batch_size=3
        )
        max_queued = 0
        while len(ray.wait([first, second], num_returns=2, timeout=0.0)[0]) < 2:
            max_queued = max(max_queued, live.job.status()["queued_rescales"])
        halves, batched = ray.get([first, second])
        after = live.job.status()
        assert not source_finished(after)
        res, events = live.finish()
    # Ray starts concurrent calls to an async actor in no guaranteed order, so the controller
    # queues rescales in the order they *arrive*; either may run first, never both at once.
    s1, s2 = sorted([halves, batched], key=lambda s: s["start_s"])
    assert s1["from"] == 2 and s2["from"] == s1["to"], "the second starts from the first's result"
    assert (halves["to"], halves["strategy"]) == (4, "halves")
    assert halves["steps"] == min(2, halves["moved_key_groups"]) or halves["moved_key_groups"] == 0
    assert (batched["to"], batched["strategy"]) == (3, "batched")
    assert batched["steps"] == max(1, math.ceil(batched["moved_key_groups"] / 3))
    assert s2["start_s"] >= s1["end_s"], "the second rescale overlapped the first"
    assert max_queued == 1, "the second rescale was never seen waiting in the queue"
    assert (
        after["routing_epochs"][STEP] == before["routing_epochs"][STEP] + s1["steps"] + s2["steps"]
    )
    assert after["parallelism"][STEP] == s2["to"]
    assert res.rescales == [s1, s2]
    assert_exact(res.table("out"), prefix_counts(gen, events), events)
    assert sum(m["records_in"] for m in step_metrics(res.metrics)) == events


# ------------------------------------------------------------------------------------------
# errors: clear and early, and the job keeps running; then a chunked move under a hot key


def _raises(job: rs.Job, exc: type[BaseException], match: str, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(exc) as info:
        job.rescale(*args, **kwargs)
    text = str(info.value)
    assert match in text, f"{match!r} not in {text!r}"
    return text


def test_bad_rescales_fail_clearly_then_meces_moves_in_bounded_chunks() -> None:
    """Bad requests raise the right error and change nothing. Then Meces with small chunks, one
    fetch at a time, 70 % of the load on one key: state arrives piece by piece (seen while it
    moves), records of missing sub-groups fetch them on demand and wait, nothing waits beyond
    the engine's limit, and the results are exact."""
    gen = generator("str", True, seed=13, hot_key_fraction=0.7)
    samples: list[dict[str, Any]] = []
    stop = threading.Event()

    def sample(job: rs.Job) -> None:
        while not stop.is_set():
            snap = job.metrics()
            samples.extend(
                m["migration"] for m in step_metrics(snap["instances"]) if "migration" in m
            )

    with live_job("rescale-errors", gen, 2, sub_groups=32) as live:
        job = live.job
        before = job.status()
        _raises(job, rs.RescaleError, f"[1, {NUM_KEY_GROUPS}]", STEP, 0)
        _raises(job, rs.RescaleError, f"[1, {NUM_KEY_GROUPS}]", STEP, NUM_KEY_GROUPS + 1)
        for bad in (-1, True, 2.5, "3"):
            _raises(job, rs.RescaleError, "must be an int", STEP, bad)
        _raises(job, rs.RescaleError, "no such step", "nope", 3)
        _raises(job, rs.RescaleError, "source step", "source", 3)
        _raises(job, rs.RescaleError, "sink step", "out", 3)
        text = _raises(
            job, rs.PluginNotFoundError, "unknown migration strategy 'warp'", STEP, 3, "warp"
        )
        assert all(repr(name) in text for name in STRATEGIES), text
        _raises(job, rs.PluginNotFoundError, "cannot load", STEP, 3, "no_such_module_rs:Strategy")
        _raises(job, rs.ConfigError, "chunk_sub_groups", STEP, 3, "meces", chunk_sub_groups=0)
        still = job.status()
        assert still["state"] == "running"
        assert still["parallelism"] == before["parallelism"]
        assert still["routing_epochs"] == before["routing_epochs"]
        assert still["queued_rescales"] == 0 and not still["rescaling"]

        live.wait_flowing()
        sampler = threading.Thread(target=sample, args=(job,), daemon=True)
        sampler.start()
        try:
            stats = live.rescale(
                4, "meces", chunk_sub_groups=2, chunk_bytes=512, fetch_concurrency=1
            )
        finally:
            stop.set()
            sampler.join(timeout=10)
        res, events = live.finish()
    assert (stats["from"], stats["to"], stats["strategy"]) == (2, 4, "meces")
    assert res.rescales == [stats]
    assert_exact(res.table("out"), prefix_counts(gen, events), events)
    assert stats["moved_rows"] > 0 and stats["moved_bytes"] > 0
    assert stats["on_demand_fetches"] > 0, "records of missing sub-groups must fetch them on demand"
    assert stats["fetch_wait_ms"]["count"] > 0, "some records must have waited for their state"
    mid = [m for m in samples if m["active"] and not m["done"] and m["incoming"] > 0]
    assert mid, f"no sample caught the migration in flight ({len(samples)} samples)"
    assert any(0 < m["arrived"] < m["incoming"] for m in mid), (
        "state never seen arriving piece by piece"
    )
    # the engine's byte bound on buffered records (default 64 MiB; one batch may pass it)
    assert max(m["pending_bytes"] for m in samples) <= max(m["max_pending_bytes"] for m in samples)
    # bounded transfer: chunks of at most chunk_bytes, at most meces' inflight_chunks per pair
    assert 0 < stats["max_chunk_bytes"] <= 512, stats
    assert 1 <= stats["max_inflight_chunks"] <= Meces().inflight_chunks, stats
    assert stats["chunks"] * 512 >= stats["moved_bytes"], stats
    serve = stats["on_demand_serve_wait_ms"]
    assert serve["count"] > 0 and serve["first"] is not None and serve["first"] >= 0, serve


# ------------------------------------------------------------------------------------------
# a scale-in, then at once a scale-out that brings the retired instance's index back


@rs.map_batches(name="slow")
def slow_pass(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Passes rows on at about 20 ms a batch: what the count instances send queues here, so a
    retired count instance's last rows and EndOfStream may still be unread when the scale-out
    adds an instance with its index back (tests/unit/test_instance_rescale.py makes that case
    certain on instances without Ray)."""
    time.sleep(0.02)
    return batch


def test_scale_in_then_out_reusing_an_index_wires_the_new_instance_and_stays_exact() -> None:
    gen = generator("int", False, seed=17)
    gate_dir = tempfile.mkdtemp(prefix="rs-gate-")
    gate = os.path.join(gate_dir, "enough")
    flow = rs.Dataflow("rescale-reuse", num_key_groups=NUM_KEY_GROUPS, sub_groups=SUB_GROUPS)
    (
        flow.source(UntilGate(gen, gate))
        .key_by("key")
        .apply(count, name=STEP)
        .apply(slow_pass)
        .options(chain=False)  # its own actor (one instance): the count's output queues there
        .sink(rs.sinks.collect(), name="out")
    )
    job = rs.start(flow, parallelism={STEP: 3}, **RUNTIME)
    try:
        live = LiveJob(job, gate)
        live.wait_flowing()
        down = live.rescale(2, "meces")
        up = live.rescale(3, "meces")
        # the new instance 2 takes records (the stream runs until the gate): read once it did,
        # not at the moment the rescale returned
        deadline = time.monotonic() + 60
        while True:
            status = job.status()
            if any(
                m["index"] == 2 and not m["finished"] and m["records_in"] > 0
                for m in step_metrics(status["instances"])
            ):
                break
            assert time.monotonic() < deadline, "the new instance 2 took no record within 60 s"
            time.sleep(0.05)
        more = live.rescale(4, "meces")  # from a warm standby (named for index 3 when made)
        named = {
            i: ray.get(
                ray.get_actor(instance_actor_name(job.name, STEP, i), namespace=NAMESPACE)
                .metrics.remote()
            )
            for i in (2, 3)
        }
        res, events = live.finish()
    except BaseException:
        job.stop()
        raise
    finally:
        shutil.rmtree(gate_dir, ignore_errors=True)
    assert (down["from"], down["to"], up["from"], up["to"]) == (3, 2, 2, 3)
    assert (more["from"], more["to"]) == (3, 4)
    # instances a scale-out started are found by name like deployed ones: the new index 2 (not
    # the retired one) and index 3, each running when asked
    for i, m in named.items():
        assert (m["step"], m["index"], m["finished"]) == (STEP, i, False)
    assert status["parallelism"][STEP] == 3
    assert_exact(res.table("out"), prefix_counts(gen, events), events)
    counts = step_metrics(res.metrics)
    # instance 2 ran twice: the retired one and the new one, both finished
    assert sorted(m["index"] for m in counts) == [0, 1, 2, 2, 3]
    assert all(m["finished"] for m in counts)
    assert sum(m["records_in"] for m in counts) == events
    live = step_metrics(status["instances"])
    new_two = [m for m in live if m["index"] == 2 and not m["finished"]]
    assert new_two and new_two[0]["records_in"] > 0, "the new instance 2 never processed a record"
