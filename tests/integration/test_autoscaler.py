"""The autoscaler on a real job: real actors, RocksDB state, live rescales.

The keyed step ``count`` costs ``COST_S`` of (sleeping) work per record, so one instance
processes at most ~1/COST_S records per second however many cores the machine has: scaling out
really adds capacity, even on a shared 2-core machine. Results are checked against a DuckDB
oracle over the generator's whole stream.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from raystream.autoscaler import ScalingContext, ScalingDecision

import raystream as rs
from tests.integration._helpers import (
    assert_counts_equal,
    last_counts,
    oracle_counts,
)

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


def check_exact(result: rs.JobResult, source: Any) -> None:
    assert_counts_equal(last_counts(result.table("out")), oracle_counts(source.generate_all()))


def run_or_explain(flow: rs.Dataflow, timeout_s: float = 90, **kwargs: Any) -> rs.JobResult:
    """``rs.run``, but a job still running at the timeout fails the test with what the controller
    and every instance were doing (a stalled rescale shows which instance waits for what)."""
    job = rs.start(flow, **kwargs)
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


def test_ds2_follows_a_4x_rate_step_in_few_decisions_and_stays_exact() -> None:
    step_at_s, high_s = 5.0, 7.0  # the warm standby actors are up before the step
    events = int(LOW_EPS * step_at_s + HIGH_EPS * high_s)
    source = rs.sources.generator(
        events=events, keys=2_000, seed=5, rate_eps=LOW_EPS, rate_schedule=[(step_at_s, HIGH_EPS)]
    )
    result = run_or_explain(
        slow_flow("autoscale-ds2", source),
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
    check_exact(result, source)
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


def test_a_policy_from_this_module_loads_by_import_path_and_bad_answers_are_clamped() -> None:
    source = rs.sources.generator(events=24_000, keys=500, seed=3, rate_eps=8_000)
    result = rs.run(
        slow_flow("autoscale-user-policy", source),
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
        timeout_s=60,
    )
    check_exact(result, source)  # the job kept running and stayed exact
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
