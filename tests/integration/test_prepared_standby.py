"""Scale-outs that take warm standbys prepared for their slot (raystream.standby_prep): the
controller configures and connects each standby ahead; a scale-out whose preparation still
matches sends neither. A reconfiguration between preparing and using the standbys (a step
inserted after the keyed step: its outputs change) must not leave a stale wiring: the standbys
are prepared again, or the scale-out configures them as without a preparation.

Oracle: ``collections.Counter`` over the exact prefix of the generator's stream that was sent;
the operator itself fails the job if a key's records come out of order, twice or not at all.
"""

from __future__ import annotations

import time

import pyarrow as pa
import ray

import raystream as rs
from raystream.runtime.actors import NAMESPACE, instance_actor_name
from tests.integration._rescale_helpers import (
    STEP,
    assert_exact,
    generator,
    live_job,
    prefix_counts,
)

PREPARED_WITHIN_S = 60.0


@rs.map_batches
def passthrough(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch


def _wait_prepared(job: rs.Job, slots: set[str]) -> None:
    deadline = time.monotonic() + PREPARED_WITHIN_S
    have: list[str] = []
    while time.monotonic() < deadline:
        have = job.status()["prepared_standbys"]
        if slots <= set(have):
            return
        time.sleep(0.1)
    msg = f"standbys {sorted(slots)} not prepared within {PREPARED_WITHIN_S:g} s (prepared: {have})"
    raise AssertionError(msg)


def _wait_dropped(job: rs.Job, name: str) -> None:
    deadline = time.monotonic() + PREPARED_WITHIN_S
    dropped: list[dict[str, object]] = []
    while time.monotonic() < deadline:
        dropped = job.status()["warm_actors_dropped"]
        if any(d["actor"] == name and d["why"] == "died" for d in dropped):
            return
        time.sleep(0.1)
    msg = f"the killed standby {name} was not dropped within {PREPARED_WITHIN_S:g} s: {dropped}"
    raise AssertionError(msg)


def _out(result: rs.JobResult) -> pa.Table:
    return pa.concat_tables([t for t in result.results["out"] if t is not None])


def test_a_scale_out_takes_prepared_standbys_and_counts_exactly() -> None:
    gen = generator("int", True, seed=11)
    with live_job(
        "prepared-standby",
        gen,
        1,
        standby_instances=2,
        standby_delay_s=0.0,
        standby_before_sources=True,
    ) as live:
        # the first deploy started the standbys beside the job's actors and ran the sources
        # only once they were up (standby_before_sources): none starts beside the first events
        status = live.job.status()
        (deploy,) = status["deploys"]
        assert sorted(status["standbys"]) == [f"{STEP}/1", f"{STEP}/2"], status["standbys"]
        assert deploy["placed_at"] <= deploy["standbys_ready_at"] <= deploy["running_at"], deploy
        live.wait_flowing()
        _wait_prepared(live.job, {f"{STEP}/1", f"{STEP}/2"})
        first = live.rescale(3)
        # ... and the refill's standbys are prepared for the next slots: used by 3 -> 5
        _wait_prepared(live.job, {f"{STEP}/3", f"{STEP}/4"})
        # a warm standby that dies while the job runs is dropped and replaced before the
        # scale-out could take it (raystream.warm_watch)
        name = instance_actor_name(live.job.name, STEP, 4)
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        _wait_dropped(live.job, name)
        _wait_prepared(live.job, {f"{STEP}/3", f"{STEP}/4"})
        second = live.rescale(5)
        result, events = live.finish()
    assert first["spawn_phases_s"]["prepared_standbys"] == 2, first["spawn_phases_s"]
    assert first["spawn_phases_s"]["cold_started"] == 0
    assert second["spawn_phases_s"]["prepared_standbys"] == 2, second["spawn_phases_s"]
    assert_exact(_out(result), prefix_counts(gen, events), events)


def test_a_step_inserted_between_preparing_and_using_the_standbys_is_wired_to() -> None:
    gen = generator("str", True, seed=12)
    # (not chained: the sink gets its own actor, so a step can go in between)
    with live_job(
        "prepared-then-insert", gen, 1, standby_instances=2, standby_delay_s=0.0, chaining=False
    ) as live:
        live.wait_flowing()
        _wait_prepared(live.job, {f"{STEP}/1", f"{STEP}/2"})
        inserted = live.job.insert(STEP, passthrough, name="pass")
        # at once: the preparations made before the insert may or may not be made again yet
        grown = live.rescale(3)
        result, events = live.finish()
    assert inserted["change"].startswith(f"{STEP} -> pass"), inserted
    phases = grown["spawn_phases_s"]
    assert phases["cold_started"] == 0, phases
    assert_exact(_out(result), prefix_counts(gen, events), events)
    # every row the count step sent after the insert went through "pass", the new instances'
    # too (a stale preparation would have wired them past it, straight to the sink)
    new_out = sum(
        int(m["records_out"]) for m in result.step_metrics(STEP) if int(m["index"]) in (1, 2)
    )
    through = sum(int(m["records_in"]) for m in result.step_metrics("pass"))
    assert new_out > 0, "the new instances counted nothing"
    assert through >= new_out, (through, new_out)
