"""The autoscaler on a real job: real actors, RocksDB state, live rescales.

The keyed step ``count`` costs ``COST_S`` of (sleeping) work per record, so one instance
processes at most ~1/COST_S records per second however many cores the machine has: scaling out
really adds capacity, even on a shared 2-core machine. Results are checked against a DuckDB
oracle over the prefix of the generator's stream the source sent: the source runs until the
test saw the autoscaler act (a gate file), then a little longer, so the decisions land while
records flow however slow the machine.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
from raystream.autoscaler import ScalingContext, ScalingDecision

import raystream as rs
from tests.integration._helpers import (
    assert_counts_equal,
    generator_prefix,
    last_counts,
    oracle_counts,
    stop_on_error,
)
from tests.integration._rescale_helpers import UntilGate

COST_S = 100e-6  # per record: one instance tops out near 10,000 records/s
LOW_EPS, HIGH_EPS = 6_000, 24_000  # a 4x step: 1 instance is enough, then 3 are needed


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def slow_count(batch: rs.KeyedBatch, state: Any) -> Any:
    time.sleep(float(batch.counts.sum()) * COST_S)  # the per-record cost, off the CPU
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


def slow_flow(name: str, source: Any) -> rs.Dataflow:
    flow = rs.Dataflow(name, num_key_groups=128, sub_groups=16)
    flow.source(source).key_by("key").apply(slow_count, name="count").sink(
        rs.sinks.collect(), name="out"
    )
    return flow


def check_exact(result: rs.JobResult, gen: Any, gate: Path) -> None:
    """The final counts against DuckDB over the events the gated source sent."""
    events = int(Path(f"{gate}.events").read_text())
    expected = oracle_counts(generator_prefix(gen, events))
    assert_counts_equal(last_counts(result.table("out")), expected)


def wait_settled(job: rs.Job, rate_eps: float, quiet_s: float, timeout_s: float = 120) -> None:
    """Until the source runs at ``rate_eps``, the autoscaler scaled out at least once, and for
    ``quiet_s`` (at that rate) no rescale ran or started."""
    deadline = time.monotonic() + timeout_s
    seen: tuple[int, bool, bool] | None = None
    since = time.monotonic()
    while True:
        st = job.status()
        assert st["state"] == "running", f"the job is {st['state']}: {st['autoscaler']}"
        rates = [m.get("target_rate_eps") for m in st["instances"] if m.get("role") == "source"]
        now = (st["rescales_total"], bool(st["rescaling"]), rates == [rate_eps])
        if now != seen:
            seen, since = now, time.monotonic()
        elif now[0] >= 1 and not now[1] and now[2] and time.monotonic() - since >= quiet_s:
            return
        assert time.monotonic() < deadline, (
            f"the autoscaler did not settle at {rate_eps} events/s within {timeout_s} s "
            f"(rescales, rescaling, at the rate: {now}; source rates {rates}): {st['autoscaler']}"
        )
        time.sleep(0.25)


def run_or_explain(
    flow: rs.Dataflow, gate: Path, settle: Any, timeout_s: float = 90, **kwargs: Any
) -> rs.JobResult:
    """``rs.start``, ``settle(job)``, then open the source's ``gate`` and wait for the end; a
    job still running at the timeout fails the test with what the controller and every
    instance were doing (a stalled rescale shows which instance waits for what)."""
    job = rs.start(flow, **kwargs)
    try:
        with stop_on_error(job):
            settle(job)
    finally:
        gate.touch()
    result = job.wait(timeout_s)
    if result.state != "running":
        return result
    st = job.status()
    job.stop()
    instances = [
        {k: v for k, v in i.items() if k not in ("throughput", "latency")} for i in st["instances"]
    ]
    st = {k: v for k, v in st.items() if k != "instances"}
    pytest.fail(f"job still running after {timeout_s} s: {st}; instances: {instances}")


class AskTooMuch:
    """A user's policy, defined here and loaded as '<this module>:AskTooMuch': it asks for more
    instances than allowed and for an operator that does not exist."""

    def decide(self, ctx: ScalingContext) -> ScalingDecision:
        return ScalingDecision(
            {"count": 50, "ghost": 2}, {"count": "test policy: as many as possible"}
        )


def test_ds2_follows_a_4x_rate_step_in_few_decisions_and_stays_exact(tmp_path: Path) -> None:
    step_at_s = 5.0  # the warm standby actors are up before the step
    # the high rate lasts until the autoscaler scaled out and then held for 3.5 s (its window,
    # cooldown and two ticks), then 2 s more
    gen = rs.sources.generator(
        events=int(LOW_EPS * step_at_s + HIGH_EPS * 600),
        keys=2_000,
        seed=5,
        rate_eps=LOW_EPS,
        rate_schedule=[(step_at_s, HIGH_EPS)],
    )
    gate = tmp_path / "settled"
    result = run_or_explain(
        slow_flow("autoscale-ds2", UntilGate(gen, str(gate), after_rows=HIGH_EPS * 2)),
        gate,
        lambda job: wait_settled(job, HIGH_EPS, quiet_s=3.5),
        parallelism={"count": 1},
        autoscaler="ds2",
        autoscaler_config={
            "interval_s": 0.5,
            "window_s": 1.5,
            "cooldown_s": 1.0,
            "stabilization_s": 30.0,  # no scale-in within this short test
            "max_parallelism": 6,
        },
        linger_ms=20.0,
    )
    assert result.state == "finished", result.error
    check_exact(result, gen, gate)
    done = [e for e in result.autoscaling if e["action"] in ("scale_out", "scale_in")]
    assert all(e["result"] == "done" for e in done), done
    assert all(e["policy"] == "ds2" and e["reason"].startswith("ds2:") for e in done), done
    assert 1 <= len(done) <= 3, result.autoscaling
    assert all(e["action"] == "scale_out" for e in done), done
    final = done[-1]["to"]
    # enough instances for the high rate: by the operator's own cost (an oracle independent of
    # the measurements) and by the true rate the autoscaler measured
    assert final >= math.ceil(HIGH_EPS * COST_S), done
    true_rate = done[-1]["signals"]["true_rate_eps"]
    assert true_rate <= 1 / COST_S * 1.05, done  # records per busy second cannot beat the cost
    assert final * true_rate >= HIGH_EPS, done
    assert [r["to"] for r in result.rescales] == [e["to"] for e in done]
    assert result.rescales[-1]["strategy"] == "meces"  # the job's configured migration strategy


def test_a_policy_from_this_module_loads_by_import_path_and_bad_answers_are_clamped(
    tmp_path: Path,
) -> None:
    # the input runs until the scale-out was done (the policy's first answer), then 1 s more
    gen = rs.sources.generator(events=8_000 * 600, keys=500, seed=3, rate_eps=8_000)
    gate = tmp_path / "scaled"
    result = run_or_explain(
        slow_flow("autoscale-user-policy", UntilGate(gen, str(gate), after_rows=8_000)),
        gate,
        lambda job: wait_settled(job, 8_000, quiet_s=0.0),
        timeout_s=60,
        parallelism={"count": 1},
        autoscaler=f"{__name__}:AskTooMuch",
        autoscaler_config={
            "interval_s": 0.5,
            "window_s": 1.0,
            "cooldown_s": 60.0,
            "max_parallelism": 2,
            "strategy": "all_at_once",
        },
        linger_ms=20.0,
    )
    assert result.state == "finished", result.error
    check_exact(result, gen, gate)  # the job kept running and stayed exact
    hist = result.autoscaling
    assert {e["policy"] for e in hist} == {f"{__name__}:AskTooMuch"}
    scaled = [e for e in hist if e["action"] == "scale_out"]
    assert [(e["from"], e["to"], e["proposed"]) for e in scaled] == [(1, 2, 50)], hist
    assert "clamped to 2" in scaled[0]["warnings"][0]
    assert scaled[0]["reason"] == "test policy: as many as possible"
    ghost = [e for e in hist if e["operator"] == "ghost"]
    assert (
        ghost and ghost[0]["action"] == "ignored" and "unknown operator" in ghost[0]["warnings"][0]
    )
    assert [(r["from"], r["to"], r["strategy"]) for r in result.rescales] == [(1, 2, "all_at_once")]
    # after it, the (still clamped) wish equals what runs: held, the warning logged again
    assert all(e["to"] == 2 for e in hist if e["action"] == "hold" and e["operator"] == "count")
