"""Rescales that the end of a bounded job overtakes, and a rescale that does not settle in time.

* The sources ended but a slow keyed step still works through its backlog: a rescale then is
  refused with a RescaleError, and the job still finishes with exact counts (string keys).
* The job ends while a scale-out is still being prepared: the caller gets a RescaleError saying
  so (not a dead controller), and the job's results are exact.
* A migration that does not settle within ``rescale_timeout_s``: the rescale raises a RescaleError
  naming the instances that did not finish and what they wait for; the job fails with that cause.

Oracles: ``collections.Counter`` over the generator's own rows.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import pyarrow as pa
import pytest

import raystream as rs
from tests.integration._gates import wait_described
from tests.integration._rescale_helpers import (
    STEP,
    assert_exact,
    generator,
    live_job,
    prefix_counts,
    source_finished,
)

LAG_EVENTS = 12_000
LAG_KEYS = 400


@rs.keyed_batches(name=STEP, state=rs.ValueState(int, default=0))
def lagging_count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    """Counts per key at about 1 ms per record (however the records are batched): far behind
    an unthrottled source."""
    time.sleep(0.001 * batch.records.num_rows)
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


def _counter(gen: Any) -> collections.Counter[Any]:
    reader = gen.open(0, 1)
    keys: list[Any] = []
    while (batch := reader.read(10_000)) is not None:
        keys.extend(batch.column("key").to_pylist())
    return collections.Counter(keys)


def _status_of(job: rs.Job, step: str) -> list[dict[str, Any]]:
    return [m for m in job.status()["instances"] if m.get("step") == step]


def test_rescale_after_the_sources_ended_is_refused_and_the_job_finishes_exactly() -> None:
    gen = rs.sources.generator(events=LAG_EVENTS, keys=LAG_KEYS, zipf=1.2, seed=3, key_type="str")
    flow = rs.Dataflow("rescale-after-end", num_key_groups=32, sub_groups=8)
    flow.source(gen).key_by("key").apply(lagging_count).sink(rs.sinks.collect(), name="out")
    # deep inboxes and many credits: the source runs seconds ahead of the count step and ends
    job = rs.start(
        flow,
        parallelism={STEP: 2},
        batch_rows=200,
        source_batch_rows=200,
        inbox_capacity=1_000,
        max_inflight=256,
    )
    try:
        deadline = time.monotonic() + 30
        while not source_finished(job.status()):
            assert time.monotonic() < deadline, "the source did not end within 30 s"
            time.sleep(0.02)
        assert not all(m["finished"] for m in _status_of(job, STEP)), (
            "the count step caught up before the rescale: this test needs it behind"
        )
        with pytest.raises(rs.RescaleError) as info:
            job.rescale(STEP, 4, "meces")
        result = job.wait(timeout_s=60)
    except BaseException:
        job.stop()
        raise
    if result.state == "running":
        job.stop()
    # an instance started for the rescale and never told that its input ended kept it running
    assert result.state == "finished", f"the job did not finish: {result.state}"
    assert "before the rescale of 'count' to 4 could start" in str(info.value), str(info.value)
    assert result.rescales == []
    out = pa.concat_tables([t for t in result.results["out"] if t is not None])
    agg = out.group_by("key").aggregate([("count", "max")])
    got = dict(zip(agg["key"].to_pylist(), agg["count_max"].to_pylist(), strict=True))
    expected = _counter(gen)
    assert sum(expected.values()) == LAG_EVENTS
    assert got == dict(expected)
    assert len(result.step_metrics(STEP)) == 2  # no instance was started for the refused rescale


def test_a_job_that_ends_while_a_scale_out_is_prepared_gets_a_rescale_error() -> None:
    gen = generator("str", True, seed=5)
    # no warm standby: the scale-out starts two actor processes (seconds here), and the stream
    # ends (a quarter second after the gate opens) long before they are up
    with live_job("rescale-overtaken", gen, 2, standby_instances=0) as live:
        live.wait_flowing()
        errors: list[BaseException] = []
        returned: list[dict[str, Any]] = []

        def rescale() -> None:
            try:
                returned.append(live.job.rescale(STEP, 4, "meces"))
            except BaseException as e:  # noqa: BLE001 - checked below
                errors.append(e)

        caller = threading.Thread(target=rescale)
        caller.start()
        # the rescale is under way (its turn taken, spawning) when the stream ends; a fixed
        # pause could end the stream before a slow machine's call even reached the controller.
        # Asked of the controller alone (status() waits for every instance's metrics: by its
        # answer the processes could be up and the barrier in)
        wait_described(live.job, "the rescale's start", lambda d: d["rescaling"])
        assert caller.is_alive(), (
            f"the rescale answered before the stream ended: {returned or errors}"
        )
        result, events = live.finish()
        caller.join(timeout=60)
    assert not caller.is_alive(), "the rescale call did not return after the job ended"
    assert not returned, f"the rescale completed although the job ended first: {returned}"
    assert len(errors) == 1 and isinstance(errors[0], rs.RescaleError), errors
    assert "finished" in str(errors[0]) and "before the rescale of 'count' to 4 could start" in str(
        errors[0]
    ), str(errors[0])
    assert result.rescales == []
    out = pa.concat_tables([t for t in result.results["out"] if t is not None])
    assert_exact(out, prefix_counts(gen, events), events)
    # a rescale sent once the job (and so its controller) ended: a RescaleError, not a dead actor
    with pytest.raises(rs.RescaleError, match=r"finished before the rescale of 'count' to 3"):
        live.job.rescale(STEP, 3, "meces")


def test_a_rescale_that_does_not_settle_in_time_fails_the_job_naming_what_waits() -> None:
    # lazy with a long max_lazy_s: a sub-group no record asks for stays with its old owner, so
    # the move cannot settle within a 3 s rescale_timeout_s
    gen = generator("str", False, seed=9, keys=16)
    with live_job("rescale-timeout", gen, 2, rescale_timeout_s=3.0) as live:
        live.wait_flowing()
        t0 = time.monotonic()
        with pytest.raises(rs.RescaleError) as info:
            live.job.rescale(STEP, 3, "lazy", max_lazy_s=600)
        waited = time.monotonic() - t0
        result_error = None
        try:
            live.job.wait(timeout_s=60)
        except rs.JobFailedError as e:
            result_error = e
    msg = str(info.value)
    assert 3.0 <= waited < 30, waited
    assert "did not finish within rescale_timeout_s=3 s" in msg, msg
    assert "('count', 2)" in msg, msg  # the new instance, still waiting for state
    assert "sub-groups in" in msg and "epoch" in msg, msg
    assert result_error is not None, "the job should have failed with the rescale's cause"
    assert "rescale_timeout_s" in str(result_error), str(result_error)
