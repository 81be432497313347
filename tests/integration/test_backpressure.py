"""Credit-based backpressure: a slow step holds at most ``max_inflight`` unacknowledged pushes per
channel and ``inbox_capacity`` queued batches per input, and slows the source down to its pace;
the counts still match the oracle."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

import raystream as rs
from tests.integration._helpers import (
    NOT_SCALED_OUT,
    assert_counts_equal,
    count_vec,
    last_counts,
    oracle_counts,
    step_metrics,
)

SLEEP_S = 0.05
MAX_INFLIGHT = 2
INBOX_CAPACITY = 2
CONFIG = {
    **NOT_SCALED_OUT,
    "max_inflight": MAX_INFLIGHT,
    "inbox_capacity": INBOX_CAPACITY,
    "batch_rows": 2_000,
    "source_batch_rows": 2_000,
    "linger_ms": 5.0,
}


# A keyed step without state rather than @rs.map_batches, which cannot end a job yet (see
# test_keycount.py::test_stateless_steps_in_a_flow). With parallelism 1 it gets whole batches.
@rs.keyed_batches
def slow(batch: rs.KeyedBatch) -> pa.RecordBatch:
    time.sleep(SLEEP_S)
    return batch.records


@dataclass(frozen=True)
class SlowCollect:
    """A sink whose writer takes SLEEP_S per batch; close() returns every row as a table."""

    def open(self, index: int, parallelism: int) -> Any:
        return _SlowWriter()

    def describe(self) -> str:
        return "slow_collect()"


class _SlowWriter:
    def __init__(self) -> None:
        self.batches: list[pa.RecordBatch] = []

    def write(self, batch: pa.RecordBatch) -> None:
        time.sleep(SLEEP_S)
        self.batches.append(batch)

    def close(self) -> pa.Table:
        return pa.Table.from_batches(self.batches)

    def abort(self) -> None:
        self.batches = []


def _check_bounds(metrics: list[dict[str, Any]]) -> None:
    for m in metrics:
        where = f"{m['step']}[{m['index']}]"
        assert m["max_inflight_seen"] <= MAX_INFLIGHT, (
            f"{where}: {m['max_inflight_seen']} in flight"
        )
        assert m["max_backlog_seen"] <= INBOX_CAPACITY, f"{where}: {m['max_backlog_seen']} queued"
    # the bounds were actually reached somewhere (otherwise the test proves nothing)
    assert max(m["max_inflight_seen"] for m in metrics) == MAX_INFLIGHT
    assert max(m["max_backlog_seen"] for m in metrics) == INBOX_CAPACITY


def test_slow_step_after_the_source_throttles_it() -> None:
    events = 80_000  # 40 source batches of 2,000 rows: the slow step sleeps 40 x 50 ms = 2 s
    gen = rs.sources.generator(events=events, keys=1_000, zipf=0.0, seed=1)
    flow = rs.Dataflow("bp-step")
    (
        flow.source(gen)
        .key_by("key")
        .apply(slow)
        .key_by("key")
        .apply(count_vec, name="count")
        .sink(rs.sinks.collect(), name="out")
    )

    res = rs.run(flow, parallelism={"count": 2, "slow": 1}, timeout_s=120, **CONFIG)

    _check_bounds(res.metrics)
    (slow_m,) = step_metrics(res.metrics, "slow")
    total_sleep = slow_m["batches_in"] * SLEEP_S
    # One call per source batch: the step's cost is per call, so batches are not sliced. While
    # every batch has the same size an instance cannot split its cost into fixed and per-record
    # parts; one batch slowed by a loaded machine may then be sliced once, which teaches it the
    # fixed part and slicing stops (runaway slicing, the bug this guards against, made 116-127).
    source_batches = events // CONFIG["source_batch_rows"]
    assert source_batches <= slow_m["batches_in"] <= source_batches + 2, slow_m["batches_in"]
    assert res.elapsed_s >= total_sleep
    # The source may run ahead of the slow step by at most max_inflight + inbox_capacity
    # batches: it cannot have finished before the slow step processed all but those.
    (src_m,) = step_metrics(res.metrics, "source")
    ahead = MAX_INFLIGHT + INBOX_CAPACITY
    assert src_m["uptime_s"] >= (slow_m["batches_in"] - ahead) * SLEEP_S
    assert_counts_equal(last_counts(res.table("out")), oracle_counts(gen.generate_all()))


def test_slow_sink_throttles_the_source_through_the_keyed_step() -> None:
    events = 80_000
    gen = rs.sources.generator(events=events, keys=1_000, zipf=0.0, seed=2)
    flow = rs.Dataflow("bp-sink")
    flow.source(gen).key_by("key").apply(count_vec, name="count").sink(SlowCollect(), name="out")

    # batch_rows 500: every count output (~630 distinct keys of a 2,000-row batch) ships at once
    res = rs.run(flow, parallelism={"count": 2}, timeout_s=120, **{**CONFIG, "batch_rows": 500})

    _check_bounds(res.metrics)
    (sink_m,) = step_metrics(res.metrics, "out")
    total_sleep = sink_m["batches_in"] * SLEEP_S
    assert total_sleep >= 1.5, "the sink must be the bottleneck for long enough"
    assert res.elapsed_s >= total_sleep
    # Between source and sink at most (max_inflight + inbox_capacity) batches per channel can
    # wait (plus one in the hands of each count instance), and every batch waiting before the
    # count step becomes at most one sink batch: the source cannot finish much before the sink.
    (src_m,) = step_metrics(res.metrics, "source")
    n_channels = 2 * 2  # source -> count[0,1], count[0,1] -> sink
    slack = (n_channels * (MAX_INFLIGHT + INBOX_CAPACITY) + 2) * SLEEP_S
    assert src_m["uptime_s"] >= total_sleep - slack
    assert_counts_equal(last_counts(res.table("out")), oracle_counts(gen.generate_all()))
