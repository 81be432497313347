"""``async def`` stateless steps (async I/O): awaited up to ``concurrency`` calls at once per
instance, outputs in the records' order, nothing passes a call in flight (watermarks, the end of
input), a timeout or an error names the record. On the real runtime without Ray
(``raystream.testing.run``); expected values come from DuckDB or plain Python over the input."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import duckdb
import pyarrow as pa
import pytest

import raystream as rs
from raystream import testing
from raystream.dataflow import AsyncCalls, is_async_function
from raystream.reconfigure import check_replacement
from raystream.runtime.async_calls import call_all


class Lookup:
    """A stand-in for a remote service: answers after a delay that varies per key (so calls
    finish out of order), counts the calls in flight."""

    def __init__(self, table: dict[int, str], seed: int = 0) -> None:
        self.table = table
        self.delays = {k: random.Random(seed + k).uniform(0, 0.003) for k in table}
        self.in_flight = 0
        self.peak = 0
        self.calls = 0

    async def get(self, key: int) -> str:
        self.calls += 1
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(self.delays[key])
            return self.table[key]
        finally:
            self.in_flight -= 1


def _events(n: int, keys: int, seed: int = 1) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"seq": i, "key": rng.randrange(keys), "ts": i * 7} for i in range(n)]


def test_an_async_map_equals_the_join_and_keeps_the_records_order() -> None:
    table = {k: f"name-{k * 31 % 97}" for k in range(50)}
    service = Lookup(table)
    events = _events(2_000, 50)

    @rs.map(concurrency=16)
    async def enrich(r: dict) -> dict:
        return {"seq": r["seq"], "key": r["key"], "name": await service.get(r["key"])}

    flow = rs.Dataflow("enrich")
    flow.source(testing.source(events)).apply(enrich).sink(rs.sinks.collect(), name="out")
    got = testing.run(flow, batch_rows=200)["out"]

    ev = pa.Table.from_pylist(events)  # noqa: F841 - read by DuckDB
    names = pa.table({"key": list(table), "name": list(table.values())})  # noqa: F841
    oracle = duckdb.sql(
        "select seq, ev.key, name from ev join names using (key) order by seq"
    ).fetchall()
    assert [tuple(r.values()) for r in got.to_pylist()] == oracle  # order: the input's
    assert service.calls == len(events)  # one call per record, none made twice
    assert 1 < service.peak <= 16  # calls overlapped, never more than asked


def test_async_filter_flat_map_and_map_batches_equal_their_synchronous_twins() -> None:
    events = _events(1_500, 40, seed=3)
    parts: list[int] = []

    @rs.filter(concurrency=4)
    async def even(r: dict) -> bool:
        await asyncio.sleep(0)
        return r["key"] % 2 == 0

    @rs.flat_map(concurrency=8)
    async def twice(r: dict) -> list[dict]:
        await asyncio.sleep(0.0005 * (r["seq"] % 3))
        return [{"seq": r["seq"], "copy": c, "key": r["key"]} for c in range(r["key"] % 3)]

    @rs.map_batches(concurrency=3)
    async def scale(batch: pa.RecordBatch) -> pa.RecordBatch:
        parts.append(batch.num_rows)
        await asyncio.sleep(0.001)
        return batch.append_column("key10", pa.array([k * 10 for k in batch["key"].to_pylist()]))

    flow = rs.Dataflow("async-kinds")
    (
        flow.source(testing.source(events))
        .apply(even)
        .apply(twice)
        .apply(scale)
        .sink(rs.sinks.collect(), name="out")
    )
    got = testing.run(flow, batch_rows=300)["out"].to_pylist()

    want = [
        {"seq": e["seq"], "copy": c, "key": e["key"], "key10": e["key"] * 10}
        for e in events
        if e["key"] % 2 == 0
        for c in range(e["key"] % 3)
    ]
    assert got == want
    assert len(parts) >= 3 and max(parts) - min(parts) <= max(parts) // 2 + 1  # cut in parts


def test_watermarks_wait_for_the_calls_in_flight() -> None:
    """Event-time windows after an async map whose calls finish out of order: a watermark that
    passed a call in flight would make its record late (dropped); every window counts all."""
    events = _events(3_000, 20, seed=5)
    rng = random.Random(9)
    delays = [rng.uniform(0, 0.002) for _ in events]

    @rs.map(concurrency=32)
    async def slow(r: dict) -> dict:
        await asyncio.sleep(delays[r["seq"]])
        return r

    def fire(key: Any, timestamp: int, state: Any, timers: Any) -> Any:
        end = timestamp + 1
        yield {"window_end": end, "count": state[end]}
        del state[end]

    @rs.keyed(state=rs.MapState(), on_timer=fire)
    def per_window(key: Any, records: pa.RecordBatch, state: Any, timers: Any) -> Any:
        for t in records.column("event_time").to_pylist():
            end = t // 1_000 * 1_000 + 1_000
            state[end] = state.get(end, 0) + 1
            timers.register(end - 1)
        return ()

    flow = rs.Dataflow("async-windows", num_key_groups=8, sub_groups=2)
    stream = flow.source(testing.source(events), event_time="ts", max_out_of_orderness_ms=0)
    stream.apply(slow).key_by("key").apply(per_window).sink(rs.sinks.collect(), name="w")
    got = testing.run(flow, parallelism={"per_window": 2}, batch_rows=250)["w"].to_pylist()

    oracle = Counter((e["key"], e["ts"] // 1_000 * 1_000 + 1_000) for e in events)
    assert {(r["key"], r["window_end"]): r["count"] for r in got} == oracle
    assert len(got) == len(oracle)


def test_a_call_that_outlasts_timeout_s_fails_the_job_naming_the_record() -> None:
    @rs.map(concurrency=4, timeout_s=0.05)
    async def hangs_on_seven(r: dict) -> dict:
        if r["x"] == 7:
            await asyncio.sleep(60)
        return r

    flow = rs.Dataflow("async-timeout")
    flow.source(testing.source({"x": list(range(20))})).apply(hangs_on_seven).sink(
        rs.sinks.collect()
    )
    with pytest.raises(rs.JobFailedError) as info:
        testing.run(flow)
    text = str(info.value)
    assert "timeout_s=0.05 s" in text and "while processing record {'x': 7}" in text, text
    assert isinstance(info.value.__cause__, TimeoutError)


def test_a_failing_call_names_its_record_and_stops_the_others() -> None:
    started: list[int] = []
    finished: list[int] = []

    @rs.map(concurrency=8)
    async def fragile(r: dict) -> dict:
        started.append(r["x"])
        if r["x"] == 3:
            raise ValueError("no price for 3")
        await asyncio.sleep(30)  # cancelled when the call for 3 fails
        finished.append(r["x"])
        return r

    flow = rs.Dataflow("async-error")
    flow.source(testing.source({"x": list(range(8))})).apply(fragile).sink(rs.sinks.collect())
    with pytest.raises(rs.JobFailedError, match=r"while processing record \{'x': 3\}") as info:
        testing.run(flow)
    assert isinstance(info.value.__cause__, ValueError)
    assert sorted(started) == list(range(8)) and finished == []


def test_async_map_batches_errors_name_the_rows() -> None:
    @rs.map_batches(concurrency=2)
    async def second_half_fails(batch: pa.RecordBatch) -> pa.RecordBatch:
        if batch["x"][0].as_py() >= 5:
            raise RuntimeError("cannot score")
        return batch

    flow = rs.Dataflow("async-batches-error")
    flow.source(testing.source({"x": list(range(10))})).apply(second_half_fails).sink(
        rs.sinks.collect()
    )
    with pytest.raises(rs.JobFailedError, match=r"while processing rows 5\.\.9 \(of 10\)"):
        testing.run(flow, batch_rows=10)


def test_definition_errors_say_what_was_expected() -> None:
    async def lookup(r: dict) -> dict:
        return r

    with pytest.raises(rs.DataflowDefinitionError, match="keyed takes a synchronous function"):

        @rs.keyed
        async def count(key: Any, records: Any) -> Any:
            return ()

    with pytest.raises(rs.DataflowDefinitionError, match=r"concurrency= is for async def"):
        rs.map(lambda r: r, concurrency=4)
    with pytest.raises(rs.DataflowDefinitionError, match=r"timeout_s= is for async def"):
        rs.filter(lambda r: True, timeout_s=1)
    with pytest.raises(rs.DataflowDefinitionError, match=r"concurrency must be an int >= 1.*0"):
        rs.map(lookup, concurrency=0)
    with pytest.raises(rs.DataflowDefinitionError, match=r"timeout_s must be .* > 0.*-1"):
        rs.map(lookup, timeout_s=-1)

    async def rows(r: dict) -> Any:
        yield r

    with pytest.raises(rs.DataflowDefinitionError, match="is an async generator"):
        rs.flat_map(rows)

    async def fire(key: Any, ts: int, state: Any, timers: Any) -> Any:
        return ()

    with pytest.raises(rs.DataflowDefinitionError, match="on_timer must be a synchronous"):
        rs.keyed(lambda k, r, s, t: (), state=rs.ValueState(int), on_timer=fire)


@pytest.mark.parametrize("kind", ["map", "filter", "flat_map"])
def test_a_synchronous_function_that_returns_a_coroutine_is_told_to_declare_it_async(
    kind: str,
) -> None:
    """A filter would otherwise keep every record (a coroutine is truthy)."""

    async def lookup(r: dict) -> Any:
        return r if kind == "map" else (False if kind == "filter" else [r])

    flow = rs.Dataflow("forgot-async")
    stream = flow.source(testing.source({"x": [1]}))
    getattr(stream, kind)(lambda r: lookup(r)).sink(rs.sinks.collect())
    with pytest.raises(rs.JobFailedError, match=f"{kind} step .*declare the function async def"):
        testing.run(flow)


def test_callable_objects_and_defaults() -> None:
    class Client:
        async def __call__(self, r: dict) -> dict:
            return r

    op = rs.map(Client(), name="client")
    assert op.async_calls == AsyncCalls(concurrency=32, timeout_s=None)
    assert rs.map_batches(Client(), name="b").async_calls == AsyncCalls(1, None)
    assert rs.map(lambda r: r).async_calls is None
    assert is_async_function(Client()) and not is_async_function(lambda r: r)


def test_replacing_a_function_carries_its_async_calls() -> None:
    flow = rs.Dataflow("replace")
    flow.source(testing.source({"x": [1]})).map(lambda r: r, name="m").sink(rs.sinks.collect())

    @rs.map(concurrency=5, timeout_s=2)
    async def m(r: dict) -> dict:
        return r

    new_step, _ = check_replacement(flow.steps["m"], m)
    assert new_step.async_calls == AsyncCalls(5, 2)
    back, _ = check_replacement(new_step, rs.map(lambda r: r, name="m"))
    assert back.async_calls is None


def test_retries_make_failed_and_timed_out_calls_again_with_backoff() -> None:
    """Each record whose x is a multiple of 3 fails twice (an error, then a timeout) before it
    answers: with retries=2 the output is whole and in order; the counts add up."""
    attempts: Counter[int] = Counter()

    async def flaky(r: dict) -> dict:
        attempts[r["x"]] += 1
        if r["x"] % 3 == 0 and attempts[r["x"]] == 1:
            raise ConnectionError(f"refused for {r['x']}")
        if r["x"] % 3 == 0 and attempts[r["x"]] == 2:
            await asyncio.sleep(60)  # times out
        return {"x": r["x"], "attempt": attempts[r["x"]]}

    calls = AsyncCalls(concurrency=4, timeout_s=0.05, retries=2, retry_backoff_s=0.001)
    stats: dict[str, list[int]] = {}
    rows = [{"x": i} for i in range(30)]
    got = asyncio.run(call_all(flaky, rows, calls, "flaky", lambda i: ("record", rows[i]), stats))
    assert got == [{"x": i, "attempt": 3 if i % 3 == 0 else 1} for i in range(30)]
    assert stats == {"calls": [30 + 2 * 10], "retries": [2 * 10]}

    op = rs.map(flaky, concurrency=4, timeout_s=0.05, retries=2, retry_backoff_s=0.001)
    attempts.clear()
    flow = rs.Dataflow("retries")
    flow.source(testing.source(rows)).apply(op).sink(rs.sinks.collect(), name="out")
    assert testing.run(flow, batch_rows=7)["out"].to_pylist() == got


def test_a_call_that_keeps_failing_reports_how_often_it_was_made() -> None:
    @rs.map(retries=2, retry_backoff_s=0)
    async def down(r: dict) -> dict:
        raise ConnectionError("service down")

    flow = rs.Dataflow("down")
    flow.source(testing.source({"x": [1, 2]})).apply(down).sink(rs.sinks.collect())
    with pytest.raises(rs.JobFailedError, match="while processing record") as info:
        testing.run(flow)
    cause = info.value.__cause__
    assert isinstance(cause, ConnectionError)
    assert "(the call was made 3 times: retries=)" in "".join(getattr(cause, "__notes__", []))
    with pytest.raises(rs.DataflowDefinitionError, match=r"retries must be an int >= 0.*-1"):
        rs.map(down.fn, retries=-1)
    with pytest.raises(rs.DataflowDefinitionError, match=r"retry_backoff_s must be .* >= 0"):
        rs.map(down.fn, retries=1, retry_backoff_s=-0.5)
    with pytest.raises(rs.DataflowDefinitionError, match=r"retries= is for async def"):
        rs.map(lambda r: r, retries=1)
