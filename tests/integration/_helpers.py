"""Operators under test and independent oracles (DuckDB) for the integration tests."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import raystream as rs

# ------------------------------------------------------------------------------------------
# jobs no test scales out

# A job with a keyed step keeps ``standby_instances`` warm actors for its scale-outs (two by
# default): each is a process start (~1 CPU-s) beside the job's own on the suite's two cores.
# Jobs that are never scaled out (no rescale, no autoscaler) run without them; every test that
# scales out keeps the default, so the standbys' paths stay tested there.
NOT_SCALED_OUT: dict[str, Any] = {"standby_instances": 0}


# ------------------------------------------------------------------------------------------
# the key-count operator, in both forms


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def count_vec(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


@rs.keyed(state=rs.ValueState(int, default=0))
def count_pk(key: Any, records: pa.RecordBatch, state: Any) -> Any:
    state.value += len(records)
    yield key, state.value  # -> columns key, value


COUNT_OPS = {"vectorised": count_vec, "per-key": count_pk}


def counts_per_record(before: np.ndarray, counts: np.ndarray) -> pa.Array:
    """A keyed batch's running count per record (records grouped by key, ``counts`` per key):
    each key's count before the batch plus the record's rank within its key, from 1."""
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    rank = np.arange(int(counts.sum())) - starts
    return pa.array(np.repeat(before, counts) + rank + 1, pa.int64())


def generator_prefix(gen: Any, events: int) -> pa.Table:
    """The first ``events`` events of a generator source, read from its own reader: key, seq
    and position in the stream (the oracle of jobs whose input it is)."""
    reader = gen.open(0, 1)
    keys, seqs, n = [], [], 0
    while n < events:
        batch = reader.read(min(gen.chunk_rows, events - n))
        assert batch is not None, f"the generator has fewer than {events} events"
        keys.append(batch.column("key").to_numpy())
        seqs.append(batch.column("seq").to_numpy())
        n += batch.num_rows
    reader.close()
    return pa.table({"key": np.concatenate(keys), "seq": np.concatenate(seqs), "pos": np.arange(n)})


def running_count_carrying(*carried: str) -> Any:
    """A keyed step with one output row per record: its key, its seq, the ``carried`` columns and
    the count of its key up to it (the recovery tests' oracle checks every row)."""

    @rs.keyed_batches(state=rs.ValueState(int, default=0), name="running_count")
    def running_count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
        before = state.get(batch.keys)
        counts = batch.counts
        state.put(batch.keys, before + counts)
        records = batch.records
        columns = {name: records.column(name) for name in ("key", "seq", *carried)}
        columns["count"] = counts_per_record(before, counts)
        return pa.record_batch(columns)

    return running_count


running_count = running_count_carrying()
COUNT_COLUMN = {"vectorised": "count", "per-key": "value"}


def keycount_flow(
    name: str, source: Any, form: str = "vectorised", **source_kw: Any
) -> rs.Dataflow:
    flow = rs.Dataflow(name, num_key_groups=128, sub_groups=16)
    (
        flow.source(source, **source_kw)
        .key_by("key")
        .apply(COUNT_OPS[form], name="count")
        .sink(rs.sinks.collect(), name="out")
    )
    return flow


# ------------------------------------------------------------------------------------------
# oracles


def oracle_counts(events: pa.Table, key: str = "key") -> dict[Any, int]:
    """Events per key, by DuckDB (independent of raystream and of pyarrow's group_by)."""
    con = duckdb.connect()
    try:
        con.register("events", events.select([key]))
        rows = con.execute(f'SELECT "{key}", count(*) FROM events GROUP BY "{key}"').fetchall()
    finally:
        con.close()
    return {k: int(n) for k, n in rows}


def last_counts(out: pa.Table, count_col: str = "count", key: str = "key") -> dict[Any, int]:
    """The last count emitted per key (in the order the sink received them), after checking that
    per key the emitted counts strictly grow (no update lost or replayed out of order)."""
    n = out.num_rows
    if n == 0:
        return {}
    t = pa.table({"k": out[key], "c": out[count_col], "i": pa.array(np.arange(n))})
    s = t.take(pc.sort_indices(t, sort_keys=[("k", "ascending"), ("i", "ascending")]))
    k = s["k"].combine_chunks()
    c = s["c"].to_numpy()
    same = pc.equal(k.slice(1), k.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(same & (c[1:] <= c[:-1]))
    assert bad.size == 0, (
        f"per key, emitted counts must strictly grow; key {k[int(bad[0])].as_py()!r} went "
        f"{c[bad[0]]} -> {c[bad[0] + 1]}"
    )
    last = np.append(~same, True)
    return dict(zip(k.filter(pa.array(last)).to_pylist(), c[last].tolist(), strict=True))


def assert_counts_equal(got: dict[Any, int], expected: dict[Any, int]) -> None:
    missing = expected.keys() - got.keys()
    extra = got.keys() - expected.keys()
    wrong = {
        k: (got[k], expected[k]) for k in expected.keys() & got.keys() if got[k] != expected[k]
    }
    assert not (missing or extra or wrong), (
        f"{len(missing)} key(s) missing (e.g. {sorted(missing, key=str)[:5]}), "
        f"{len(extra)} unexpected (e.g. {sorted(extra, key=str)[:5]}), "
        f"{len(wrong)} wrong (got, expected) e.g. {dict(list(wrong.items())[:5])}; "
        f"{len(expected)} keys expected"
    )


def step_metrics(metrics: list[dict[str, Any]], step: str) -> list[dict[str, Any]]:
    return sorted((m for m in metrics if m.get("step") == step), key=lambda m: m["index"])


@contextmanager
def stop_on_error(job: rs.Job) -> Iterator[None]:
    """Stop ``job`` if the block fails. (Not after a normal end: once ``wait()`` returned a
    finished job its controller is gone, and ``Job.stop()`` would raise ActorDiedError.)"""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):  # already ended
            job.stop()
        raise


# ------------------------------------------------------------------------------------------
# a sink that keeps every batch as it came


@dataclass
class _BatchesWriter:
    batches: list[pa.RecordBatch] = field(default_factory=list)

    def write(self, batch: pa.RecordBatch) -> None:
        self.batches.append(batch)

    def close(self) -> list[pa.RecordBatch]:
        return self.batches

    def abort(self) -> None:
        self.batches = []


@dataclass(frozen=True)
class Batches:
    """A sink whose instances return the batches they got, in order (raw events, counts and
    final-state rows differ in schema, so no one table holds them)."""

    def open(self, index: int, parallelism: int) -> _BatchesWriter:
        return _BatchesWriter()

    def describe(self) -> str:
        return "batches()"


def wait_checkpoints(job: rs.Job, n: int, timeout_s: float = 120) -> None:
    """Wait until the job completed ``n`` checkpoints (fails after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while job.status()["checkpoints"]["completed"] < n:
        assert time.monotonic() < deadline, f"no {n} checkpoints: {job.status()['checkpoints']}"
        time.sleep(0.05)


def finished_after_gate(job: rs.Job, gate: str, timeout_s: float = 120) -> tuple[rs.JobResult, int]:
    """Once the gate file the job's gated source waits at exists: the job's result (checked
    finished) and the number of events that source sent (it writes ``<gate>.events``)."""
    result = job.wait(timeout_s=timeout_s)
    assert result.state == "finished", result.error
    return result, int(Path(gate + ".events").read_text())


# ------------------------------------------------------------------------------------------
# a finite source held at given rows until the test opens a gate


@dataclass(frozen=True)
class HeldAt:
    """The rows of the finite source ``source`` (same rows, same order, same pace), but each
    instance stops short at every ``(rows, gate)`` of ``holds`` until the file ``gate`` exists:
    at ``rows`` of its own rows it creeps on, one row per ``creep_s`` (the source's loop takes
    its turns between reads: barriers, metrics and changes go on). Once the test opened the gate
    after its action, the rest comes at the source's pace. So an input of fixed rows (a table,
    files, the oracle's input) outlasts whatever the test does before it opens the gate, however
    slow the machine, and the oracle stays the whole input.

    Rows are counted per instance (a table source's instance ``i`` of ``P`` reads its own
    slice). A rewind (recovery) goes past the checkpointed rows without stopping at a hold."""

    source: Any
    holds: tuple[tuple[int, str], ...]
    creep_s: float = 0.005

    def schema(self) -> pa.Schema:
        return self.source.schema()  # type: ignore[no-any-return]

    @property
    def rate_eps(self) -> float:
        return float(getattr(self.source, "rate_eps", 0) or 0)

    @property
    def rate_schedule(self) -> Any:
        return getattr(self.source, "rate_schedule", ())

    def describe(self) -> str:
        return f"held_at({self.source.describe()}, at={[r for r, _ in self.holds]})"

    def open(self, index: int, parallelism: int) -> Any:
        return _HeldReader(self, self.source.open(index, parallelism))


class _HeldReader:
    def __init__(self, spec: HeldAt, inner: Any) -> None:
        self.spec = spec
        self.inner = inner
        self.emitted = 0

    def read(self, max_rows: int) -> pa.RecordBatch | None:
        for at, gate in self.spec.holds:
            if Path(gate).exists():
                continue
            if self.emitted >= at:  # held: one row at a time, slowly
                time.sleep(self.spec.creep_s)
                max_rows = 1
                break
            max_rows = min(max_rows, at - self.emitted)  # no further than the hold
        batch = self.inner.read(max_rows)
        if batch is not None:
            self.emitted += batch.num_rows
        return batch

    def skip(self, rows: int) -> int:
        """A rewind: past ``rows`` rows of the inner reader, holds or not."""
        inner_skip = getattr(self.inner, "skip", None)
        if callable(inner_skip):
            skipped = int(inner_skip(rows))
        else:
            skipped = 0
            while skipped < rows:
                batch = self.inner.read(min(65_536, rows - skipped))
                if batch is None:
                    break
                skipped += batch.num_rows
        self.emitted += skipped
        return skipped

    def __getattr__(self, name: str) -> Any:
        # a file source's position() and check_position(); nothing the inner reader lacks
        if name in ("inner", "spec", "emitted"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def close(self) -> None:
        self.inner.close()
