"""Helpers for the live-rescale integration tests (tests/integration/test_rescale.py).

The operator under test counts per key and checks, inside the job, that every key's records come
in the order the source sent them and without a gap (the generator's ``seq`` is a per-key
0, 1, 2, ... with one source instance). A violation raises in the operator, so the job fails.

The source is a rate-limited generator that runs at full rate until the test says "enough"
(:class:`UntilGate`): the rescales always happen under load and always end before the stream
does, however slow the shared machine is, and the stream is no longer than it needs to be. The
oracle is a ``collections.Counter`` over the exact prefix of the generator's stream that was sent.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

import raystream as rs

STEP = "count"
NUM_KEY_GROUPS = 32
SUB_GROUPS = 8
RATE_EPS = 25_000
# Larger source batches than the default 5 ms linger: fewer per-key Python calls per second on a
# shared 2-core machine, while still many batches (and barriers between them) per second.
RUNTIME = {"linger_ms": 20.0}


STATE = {"count": rs.ValueState(int, default=0), "last": rs.ValueState(int, default=-1)}


@rs.keyed(state=STATE)
def count(key: Any, records: pa.RecordBatch, state: Any) -> Any:
    """Count per key; fail the job if a key's ``seq`` does not continue where it stopped (a
    record out of order, lost, applied twice, or state that started afresh)."""
    yield from _count(key, records, state)


@rs.keyed(state=STATE)
def slow_count(key: Any, records: pa.RecordBatch, state: Any) -> Any:
    """``count`` at about 0.5 ms per key and batch: instances fall behind, so an old owner
    still has records queued from before the rescale barrier when its new owners ask for state."""
    time.sleep(0.0005)
    yield from _count(key, records, state)


def _count(key: Any, records: pa.RecordBatch, state: Any) -> Any:
    seqs = records.column("seq").to_pylist()
    last = state.last.value
    expected = list(range(last + 1, last + 1 + len(seqs)))
    if seqs != expected:
        msg = (
            f"per-key order broken for key {key!r}: state says the last seq was {last} "
            f"(count {state.count.value}), this batch brings {seqs[:8]}"
            f"{'...' if len(seqs) > 8 else ''}; expected {expected[:8]}"
        )
        raise AssertionError(msg)
    state.count.value += len(seqs)
    state.last.value = seqs[-1]
    yield key, {"count": state.count.value, "seq": seqs[-1]}


def keycount_flow(
    name: str, source: Any, *, sub_groups: int = SUB_GROUPS, slow: bool = False
) -> rs.Dataflow:
    flow = rs.Dataflow(name, num_key_groups=NUM_KEY_GROUPS, sub_groups=sub_groups)
    op = slow_count if slow else count
    flow.source(source).key_by("key").apply(op, name=STEP).sink(rs.sinks.collect(), name="out")
    return flow


def generator(
    key_type: str, skewed: bool, seed: int, *, hot_key_fraction: float = 0.5, keys: int = 128
) -> Any:
    """A rate-limited key-count generator, long enough (a minute) never to end by itself here."""
    return rs.sources.generator(
        events=RATE_EPS * 60,
        keys=keys,
        zipf=1.1 if skewed else 0.0,
        seed=seed,
        rate_eps=RATE_EPS,
        key_type=key_type,
        hot_key_fraction=hot_key_fraction if skewed else 0.0,
    )


# ------------------------------------------------------------------------------------------
# a rate-limited generator that ends when the test says so


@dataclass(frozen=True)
class UntilGate:
    """The first events of the rate-limited generator ``gen``: all of them at its rate until the
    file ``gate`` exists, then ``after_rows`` more, then the end. The reader writes how many
    events it sent to ``gate + ".events"`` when it closes.

    Same events, same order, same per-key ``seq`` as ``gen`` (one source instance)."""

    gen: Any
    gate: str
    after_rows: int = RATE_EPS // 4

    def schema(self) -> pa.Schema:
        return self.gen.schema()  # type: ignore[no-any-return]

    @property
    def rate_eps(self) -> float:
        return float(self.gen.rate_eps)

    @property
    def rate_schedule(self) -> Any:
        """The generator's rate steps (``rate_schedule``), kept until the gate and after it."""
        return getattr(self.gen, "rate_schedule", ())

    def describe(self) -> str:
        return f"until_gate({self.gen.describe()}, after_rows={self.after_rows})"

    def open(self, index: int, parallelism: int) -> Any:
        """Several instances: each emits ``after_rows`` more after the gate and writes its count
        to ``gate + ".events.<index>"`` (one instance: ``gate + ".events"``)."""
        return _UntilGateReader(self, self.gen.open(index, parallelism), index, parallelism)


class _UntilGateReader:
    def __init__(self, spec: Any, inner: Any, index: int, parallelism: int) -> None:
        self.spec = spec
        self.inner = inner
        self.emitted = 0
        self.stop_at: int | None = None
        self.suffix = "" if parallelism == 1 else f".{index}"

    def _end_once_gated(self) -> int:
        """Where the input ends, read once the gate exists: ``after_rows`` past here."""
        return self.emitted + self.spec.after_rows  # type: ignore[no-any-return]

    def read(self, max_rows: int) -> pa.RecordBatch | None:
        if self.stop_at is None and os.path.exists(self.spec.gate):
            self.stop_at = self._end_once_gated()
        if self.stop_at is not None:
            max_rows = min(max_rows, self.stop_at - self.emitted)
            if max_rows <= 0:
                return None
        batch = self.inner.read(max_rows)
        if batch is not None:
            self.emitted += batch.num_rows
        return batch

    def close(self) -> None:
        self.inner.close()
        tmp = self.spec.gate + f".events{self.suffix}.tmp"
        with open(tmp, "w") as f:
            f.write(str(self.emitted))
        os.replace(tmp, self.spec.gate + f".events{self.suffix}")


def prefix_counts(
    gen: Any, events: int, index: int = 0, parallelism: int = 1
) -> collections.Counter[Any]:
    """Events per key in the first ``events`` events of ``gen``'s stream (of its instance
    ``index`` of ``parallelism``; the oracle: plain Python over the generator's own rows,
    nothing of raystream's runtime)."""
    reader = gen.open(index, parallelism)
    keys: list[Any] = []
    while len(keys) < events:
        batch = reader.read(min(gen.chunk_rows, events - len(keys)))
        assert batch is not None, f"the generator has fewer than {events} events"
        keys.extend(batch.column("key").to_pylist())
    reader.close()
    return collections.Counter(keys)


# ------------------------------------------------------------------------------------------
# running a job


class LiveJob:
    """A running key-count job over ``UntilGate(gen)``."""

    def __init__(self, job: rs.Job, gate: str) -> None:
        self.job = job
        self.gate = gate

    def wait_flowing(self, records: int = RATE_EPS // 2, timeout_s: float = 120.0) -> None:
        """Wait until ``records`` events reached the count step (state to move, load measured)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (
                sum(m["records_in"] for m in step_metrics(self.job.metrics()["instances"]))
                >= records
            ):
                return
            time.sleep(0.05)
        msg = f"fewer than {records} records reached {STEP!r} within {timeout_s} s"
        raise AssertionError(msg)

    def rescale(
        self, parallelism: int, strategy: Any = None, **strategy_args: Any
    ) -> dict[str, Any]:
        """``job.rescale`` of the count step; also checks the stream still runs afterwards."""
        stats = self.job.rescale(STEP, parallelism, strategy, **strategy_args)
        assert not source_finished(self.job.status()), (
            "the stream ended before the rescale returned"
        )
        return stats

    def finish(self, timeout_s: float = 120) -> tuple[rs.JobResult, int]:
        """Let the stream end, wait for the job; returns its result and the number of events."""
        with open(self.gate, "w"):
            pass
        result = self.job.wait(timeout_s=timeout_s)
        assert result.state == "finished", (
            f"job {self.job.name!r} did not finish in time: {result.state}"
        )
        with open(self.gate + ".events") as f:
            return result, int(f.read())


@contextmanager
def live_job(
    name: str,
    gen: Any,
    parallelism: int,
    *,
    sub_groups: int = SUB_GROUPS,
    slow: bool = False,
    **runtime: Any,
) -> Iterator[LiveJob]:
    """Start the key-count job (``runtime``: RuntimeConfig fields besides ``RUNTIME``); stop it
    if the block fails."""
    gate_dir = tempfile.mkdtemp(prefix="rs-gate-")
    gate = os.path.join(gate_dir, "enough")
    source = UntilGate(gen, gate)
    job = rs.start(
        keycount_flow(name, source, sub_groups=sub_groups, slow=slow),
        parallelism={STEP: parallelism},
        **{**RUNTIME, **runtime},
    )
    try:
        yield LiveJob(job, gate)
    except BaseException:
        with contextlib.suppress(Exception):  # already ended
            job.stop()
        raise
    finally:
        shutil.rmtree(gate_dir, ignore_errors=True)


@dataclass
class RescaleRun:
    """What one job with live rescales left behind."""

    result: rs.JobResult
    events: int
    stats: list[dict[str, Any]]
    status_before: dict[str, Any]
    status_after: list[dict[str, Any]] = field(default_factory=list)  # job.status() after each
    wall_s: float = 0.0


def run_with_rescales(
    name: str,
    gen: Any,
    start_parallelism: int,
    targets: list[int],
    strategy: Any,
    *,
    strategy_args: dict[str, Any] | None = None,
) -> RescaleRun:
    """Start the key-count job, rescale ``count`` to each of ``targets`` in turn (the first once
    the stream is flowing), then let the stream end and wait for the job."""
    t0 = time.monotonic()
    with live_job(name, gen, start_parallelism) as live:
        before = live.job.status()
        live.wait_flowing()
        stats: list[dict[str, Any]] = []
        after: list[dict[str, Any]] = []
        for p in targets:
            stats.append(live.rescale(p, strategy, **(strategy_args or {})))
            after.append(live.job.status())
        result, events = live.finish()
    return RescaleRun(result, events, stats, before, after, time.monotonic() - t0)


# ------------------------------------------------------------------------------------------
# checks


def source_finished(status: dict[str, Any]) -> bool:
    sources = [m for m in status["instances"] if m.get("role") == "source"]
    assert sources, status
    return any(m["finished"] for m in sources)


def final_counts(out: pa.Table) -> dict[Any, dict[str, int]]:
    """Per key: the largest count emitted, the largest seq, how many rows and distinct counts.

    Rows of one key reach the single sink in order only per producing instance (the old and the
    new owner send on different channels), so the final count is the maximum, not the last row.
    """
    agg = out.group_by("key").aggregate(
        [("count", "max"), ("seq", "max"), ("count", "count"), ("count", "count_distinct")]
    )
    return {
        k: {"count": c, "seq": s, "rows": n, "distinct": d}
        for k, c, s, n, d in zip(
            agg["key"].to_pylist(),
            agg["count_max"].to_pylist(),
            agg["seq_max"].to_pylist(),
            agg["count_count"].to_pylist(),
            agg["count_count_distinct"].to_pylist(),
            strict=True,
        )
    }


def assert_exact(out: pa.Table, expected: collections.Counter[Any], events: int) -> None:
    """Exactly once and in order, against the oracle: every key's final count equals its number
    of events, its last seq is count - 1, no count was emitted twice (no record applied twice,
    no state recreated empty), and the final counts sum to the number of events."""
    assert sum(expected.values()) == events
    got = final_counts(out)
    missing = expected.keys() - got.keys()
    extra = got.keys() - expected.keys()
    wrong = {
        k: (got[k]["count"], n) for k, n in expected.items() if k in got and got[k]["count"] != n
    }
    assert not (missing or extra or wrong), (
        f"{len(missing)} key(s) missing (e.g. {sorted(missing, key=str)[:5]}), {len(extra)} "
        f"unexpected (e.g. {sorted(extra, key=str)[:5]}), {len(wrong)} with a wrong final count "
        f"(got, expected), e.g. {dict(list(wrong.items())[:5])}; {len(expected)} keys expected"
    )
    bad_seq = {k: v["seq"] for k, v in got.items() if v["seq"] != v["count"] - 1}
    assert not bad_seq, (
        f"max seq != count - 1 for {len(bad_seq)} keys, e.g. {dict(list(bad_seq.items())[:5])}"
    )
    dup = {k: (v["rows"], v["distinct"]) for k, v in got.items() if v["rows"] != v["distinct"]}
    assert not dup, (
        f"{len(dup)} key(s) emitted the same count twice (rows, distinct counts), e.g. "
        f"{dict(list(dup.items())[:5])}: a record was applied twice or state restarted"
    )
    total = sum(v["count"] for v in got.values())
    assert total == events, f"final counts sum to {total}, expected the {events} events"


def step_metrics(metrics: list[dict[str, Any]], step: str = STEP) -> list[dict[str, Any]]:
    return sorted((m for m in metrics if m.get("step") == step), key=lambda m: m["index"])


def records_between(
    metrics: list[dict[str, Any]], start_s: float, end_s: float, step: str = STEP
) -> int:
    """Records that reached ``step`` in throughput windows lying wholly inside
    ``[start_s, end_s]`` (seconds after the job's origin, the clock of the rescale stats)."""
    n = 0
    for m in step_metrics(metrics, step):
        tp = m["throughput"]
        win = tp["window_ms"] / 1000
        n += sum(
            c
            for w, c in tp["counts"].items()
            if int(w) * win >= start_s and (int(w) + 1) * win <= end_s
        )
    return n
