"""Key-count end to end: final counts equal a DuckDB oracle over the same input, and per-key
order is kept (the per-key ``seq`` of the generator arrives strictly increasing, without gaps)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import raystream as rs
from tests.integration._helpers import (
    COUNT_COLUMN,
    NOT_SCALED_OUT,
    assert_counts_equal,
    count_vec,
    keycount_flow,
    last_counts,
    oracle_counts,
    step_metrics,
)

EVENTS = 100_000
# small batches: many batches per key and instance, so counts build up across batches
SMALL_BATCHES = {
    "batch_rows": 10_000,
    "source_batch_rows": 10_000,
    "linger_ms": 5.0,
    **NOT_SCALED_OUT,
}

# A pairwise-covering selection over parallelism {1, 2, 4} x key type {int, str} x distribution
# {uniform, hot} x input {generator, parquet} x form {vectorised, per-key}: every pair of values
# of any two dimensions occurs in at least one case (6 cases instead of 48), plus one case with
# two source instances and plain Zipf 1.1.
CASES = [
    # parallelism, key_type, distribution, input, form, source parallelism
    (1, "int", "uniform", "generator", "vectorised", 1),
    (2, "str", "hot", "generator", "vectorised", 1),
    (4, "int", "hot", "parquet", "vectorised", 1),
    (4, "str", "uniform", "generator", "per-key", 1),
    (2, "int", "uniform", "parquet", "per-key", 1),
    (1, "str", "hot", "parquet", "per-key", 1),
    (2, "int", "zipf", "generator", "vectorised", 2),
]
DISTRIBUTIONS = {
    "uniform": {"zipf": 0.0, "keys": 5_000},
    "hot": {"zipf": 1.1, "keys": 20_000, "hot_key_fraction": 0.5},
    "zipf": {"zipf": 1.1, "keys": 50_000},
}


def _id(case: tuple[Any, ...]) -> str:
    p, kt, dist, inp, form, sp = case
    return f"p{p}-{kt}-{dist}-{inp}-{form}" + (f"-src{sp}" if sp > 1 else "")


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_final_counts_equal_oracle(case: tuple[Any, ...], tmp_path: Any) -> None:
    parallelism, key_type, dist, inp, form, source_parallelism = case
    events_n = EVENTS if form == "vectorised" else EVENTS // 2  # per-key calls Python per key
    gen = rs.sources.generator(events=events_n, seed=11, key_type=key_type, **DISTRIBUTIONS[dist])
    events = gen.generate_all()
    if inp == "parquet":
        source: Any = rs.sources.parquet(gen.to_parquet(tmp_path / "events.parquet"))
    else:
        source = gen
    expected = oracle_counts(events)
    if dist == "hot":  # the input is what the case claims: one key carries about half
        assert max(expected.values()) >= 0.45 * events_n
    flow = keycount_flow(f"kc-{_id(case)}", source, form, parallelism=source_parallelism)

    res = rs.run(flow, parallelism={"count": parallelism}, timeout_s=120, **SMALL_BATCHES)

    assert res.state == "finished"
    out = res.table("out")
    assert out.schema.field("key").type == (pa.int64() if key_type == "int" else pa.string())
    assert_counts_equal(last_counts(out, COUNT_COLUMN[form]), expected)
    counts = step_metrics(res.metrics, "count")
    assert len(counts) == parallelism
    assert sum(m["records_in"] for m in counts) == events_n  # exactly once into the count step
    assert sum(m["records_out"] for m in counts) == out.num_rows
    if parallelism > 1 and dist == "uniform":  # key groups spread the work over every instance
        assert all(m["records_in"] > 0.1 * events_n / parallelism for m in counts)


# ------------------------------------------------------------------------------------------
# per-key order


@rs.keyed(
    state={"count": rs.ValueState(int, default=0), "last_seq": rs.ValueState(int, default=-1)}
)
def ordered_count(key: Any, records: pa.RecordBatch, state: Any) -> Any:
    """Counts, and fails the job unless this key's ``seq`` continues exactly where it stopped:
    strictly increasing, no gap (no record lost), no repeat (none duplicated)."""
    seq = records.column("seq").to_numpy()
    want = state.last_seq.value + 1 + np.arange(len(seq))
    if not np.array_equal(seq, want):
        msg = f"key {key!r}: seq out of order: got {seq[:5]}..., expected {want[:5]}..."
        raise AssertionError(msg)
    state.last_seq.value = int(seq[-1])
    state.count.value += len(seq)
    yield key, {"count": state.count.value, "last_seq": state.last_seq.value}


def _ordered_flow(name: str, source: Any) -> rs.Dataflow:
    flow = rs.Dataflow(name)
    flow.source(source).key_by("key").apply(ordered_count).sink(rs.sinks.collect(), name="out")
    return flow


def test_per_key_order_is_kept() -> None:
    gen = rs.sources.generator(events=EVENTS, keys=2_000, zipf=1.1, seed=3, hot_key_fraction=0.2)
    flow = _ordered_flow("order", gen)  # one source instance: seq is per key over the stream

    res = rs.run(
        flow,
        parallelism={"ordered_count": 2},
        timeout_s=120,
        batch_rows=2_000,
        source_batch_rows=2_000,
        linger_ms=2.0,
        **NOT_SCALED_OUT,
    )

    out = res.table("out")
    expected = oracle_counts(gen.generate_all())
    assert_counts_equal(last_counts(out, "count"), expected)
    assert_counts_equal(last_counts(out, "last_seq"), {k: n - 1 for k, n in expected.items()})
    hot = max(expected, key=expected.__getitem__)
    assert out.filter(pa.compute.equal(out["key"], hot)).num_rows >= 10, (
        "the hot key must span many batches for the order check to mean something"
    )


def test_order_check_fails_the_job_on_disorder() -> None:
    """The order check above really fires: the same key with seq going backwards fails the job."""
    table = pa.table(
        {"key": pa.array([7] * 4, pa.int64()), "seq": pa.array([0, 1, 3, 2], pa.int64())}
    )
    flow = _ordered_flow("order-broken", rs.sources.from_table(table))
    # not rs.run: see test_errors.py::test_run_raises_job_failed_error
    job = rs.start(flow, **NOT_SCALED_OUT)
    with pytest.raises(rs.JobFailedError, match="seq out of order"):
        job.wait(60)


# ------------------------------------------------------------------------------------------
# stateless steps around the keyed one


@rs.map_batches
def drop_multiples(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Drops keys that are multiples of ``RS_DROP_MOD``, a variable only the step's
    ``runtime_env`` sets (the test process and the other actors do not have it)."""
    mod = os.environ.get("RS_DROP_MOD")
    if mod is None:
        msg = "RS_DROP_MOD is not set in this actor: the step's runtime_env did not reach it"
        raise KeyError(msg)
    keys = batch.column("key").to_numpy()
    return batch.filter(pa.array(keys % int(mod) != 0))


def test_stateless_steps_in_a_flow() -> None:
    """A map step between source and count, with a runtime_env of its own (env_vars)."""
    assert "RS_DROP_MOD" not in os.environ
    gen = rs.sources.generator(events=20_000, keys=500, zipf=1.1, seed=4)
    flow = rs.Dataflow("stateless")
    (
        flow.source(gen)
        .apply(drop_multiples)
        .options(runtime_env={"env_vars": {"RS_DROP_MOD": "7"}})
        .key_by("key")
        .apply(count_vec, name="count")
        .sink(rs.sinks.collect(), name="out")
    )
    job = rs.start(flow, parallelism={"count": 2}, **NOT_SCALED_OUT)
    res = job.wait(60)
    expected = {k: n for k, n in oracle_counts(gen.generate_all()).items() if k % 7 != 0}
    assert_counts_equal(last_counts(res.table("out")), expected)
