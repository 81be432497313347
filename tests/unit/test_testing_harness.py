"""``raystream.testing``: unit-test a dataflow without Ray (these tests double as its docs).

Two tools:

* ``testing.run(flow, parallelism=...)`` runs a whole dataflow in this process, on the real
  runtime (instances, channels, key groups, RocksDB state, watermarks, timers), from in-memory
  input (``testing.source(rows)``) to each sink's rows.
* ``testing.KeyedStepHarness(op, key=..., event_time=...)`` drives one keyed step by hand:
  feed records, advance the watermark or the processing-time clock, read the main and side
  outputs, look at a key's state.

Every expected value below comes from an independent oracle (``collections.Counter`` or plain
Python over the same input), never from raystream itself.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import raystream as rs
from raystream import testing

# ---- the operators under test (what a user writes) ---------------------------------------------


@rs.keyed(state=rs.ValueState(int, default=0))
def count(key: Any, records: pa.RecordBatch, state: Any) -> Any:
    """Running count per key: one output row per key and batch."""
    state.value += len(records)
    yield {"count": state.value}


WINDOW_MS = 1_000


def _flush(key: Any, timestamp: int, state: Any, timers: Any) -> Any:
    """The window ending at ``timestamp + 1`` is complete: emit its count and forget it."""
    end = timestamp + 1
    n = state[end]
    del state[end]
    yield {"window_end": end, "count": n}


@rs.keyed(state=rs.MapState(), on_timer=_flush)
def window_count(key: Any, records: pa.RecordBatch, state: Any, timers: Any) -> Any:
    """Tumbling event-time windows of WINDOW_MS: count per key and window, emitted when the
    watermark passes the window's end."""
    for t in records.column("event_time").to_pylist():
        end = t // WINDOW_MS * WINDOW_MS + WINDOW_MS
        state[end] = state.get(end, 0) + 1
        timers.register(end - 1)
    return ()


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def sum_on_time(batch: rs.KeyedBatch, state: Any) -> rs.Outputs:
    """Vectorised sum of ``v`` per key; records at or behind the watermark go to side output
    ``late`` instead."""
    et = batch.records.column("event_time").to_numpy()
    late = et <= batch.watermark
    v = np.where(late, 0, batch.records.column("v").to_numpy())
    sums = np.bincount(batch.key_index(), weights=v, minlength=len(batch.keys)).astype(np.int64)
    new = state.get(batch.keys) + sums
    state.put(batch.keys, new)
    return rs.Outputs(main=batch.output({"sum": new}), late=batch.records.filter(pa.array(late)))


def _remind(key: Any, timestamp: int, state: Any, timers: Any) -> Any:
    yield {"reminder_at": timestamp, "seen": state.value}


@rs.keyed(state=rs.ValueState(int, default=0), on_timer=_remind)
def remind_later(key: Any, records: pa.RecordBatch, state: Any, timers: Any) -> Any:
    """Processing-time timer: 5 s after a key's first record (on the harness's clock)."""
    if state.value == 0:
        timers.register_processing(int(records.column("at_ms")[0].as_py()) + 5_000)
    state.value += len(records)
    return ()


def _words(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(["apple", "pear", "fig", "kiwi", "plum"]) for _ in range(n)]


# ---- testing.run: a whole dataflow -------------------------------------------------------------


@pytest.mark.parametrize("parallelism", [1, 3])
def test_run_a_whole_dataflow_and_compare_with_counter(parallelism: int) -> None:
    words = _words(500, seed=parallelism)
    flow = rs.Dataflow("wordcount", num_key_groups=16)
    stream = flow.source(testing.source([{"word": w} for w in words]))
    stream.key_by("word").apply(count).sink(rs.sinks.collect(), name="counts")

    out = testing.run(flow, parallelism={"count": parallelism}, batch_rows=50)

    final: dict[str, int] = {}
    for row in out["counts"].to_pylist():  # running counts: the largest is the total
        final[row["word"]] = max(final.get(row["word"], 0), row["count"])
    assert final == Counter(words)
    assert out["counts"].schema.names == ["word", "count"]  # internal columns left out


def test_run_with_event_time_fires_windows_on_watermarks() -> None:
    rng = random.Random(7)
    events = [{"user": rng.choice("abc"), "ts": rng.randrange(0, 5_000)} for _ in range(300)]
    events.sort(key=lambda e: e["ts"])
    flow = rs.Dataflow("windows", num_key_groups=8, sub_groups=2)
    stream = flow.source(testing.source(events), event_time="ts", max_out_of_orderness_ms=0)
    stream.key_by("user").apply(window_count).sink(rs.sinks.collect(), name="windows")

    got = testing.run(flow, parallelism={"window_count": 2}, batch_rows=20)["windows"]

    oracle = Counter((e["user"], e["ts"] // WINDOW_MS * WINDOW_MS + WINDOW_MS) for e in events)
    assert {(r["user"], r["window_end"]): r["count"] for r in got.to_pylist()} == oracle
    assert got.num_rows == len(oracle)  # each window exactly once


def test_a_sink_that_received_nothing_is_an_empty_table() -> None:
    flow = rs.Dataflow("nothing")
    flow.source(testing.source({"x": [1, 2, 3]})).filter(lambda r: False).sink(
        rs.sinks.collect(), name="out"
    )
    assert testing.run(flow)["out"].num_rows == 0


# ---- KeyedStepHarness: one keyed step by hand --------------------------------------------------


def test_harness_counts_and_state_per_key() -> None:
    words = _words(200, seed=3)
    with testing.KeyedStepHarness(count, key="word", num_key_groups=16) as h:
        for i in range(0, len(words), 40):  # five batches
            h.process([{"word": w} for w in words[i : i + 40]])
        expected = Counter(words)
        assert h.state_items() == expected
        for word, n in expected.items():
            assert h.state(word) == n
        assert h.state("never-seen") == 0  # the state's default
        last = {r["word"]: r["count"] for r in h.output.to_pylist()}
        assert last == expected


def test_harness_windows_fire_when_the_watermark_passes_their_end() -> None:
    with testing.KeyedStepHarness(window_count, key="user", event_time="ts") as h:
        assert h.process([{"user": "a", "ts": 100}, {"user": "a", "ts": 900}]).num_rows == 0
        h.process([{"user": "b", "ts": 1_500}, {"user": "a", "ts": 1_200}])
        assert h.state("a") == {1_000: 2, 2_000: 1}
        assert h.pending_timers() == 3

        assert h.advance_watermark(998).num_rows == 0  # the first window ends at 999
        fired = h.advance_watermark(999)
        assert fired.to_pylist() == [{"user": "a", "window_end": 1_000, "count": 2}]
        assert h.state("a") == {2_000: 1}

        rest = h.end_of_input()  # the watermark jumps to +inf: every timer fires
        assert sorted(rest.to_pylist(), key=lambda r: r["user"]) == [
            {"user": "a", "window_end": 2_000, "count": 1},
            {"user": "b", "window_end": 2_000, "count": 1},
        ]
        assert h.pending_timers() == 0
        assert h.output.num_rows == 3


def test_harness_side_output_takes_late_records() -> None:
    rows = [{"key": k, "v": v, "ts": t} for k, v, t in [(1, 5, 10), (2, 7, 20), (1, 1, 30)]]
    with testing.KeyedStepHarness(sum_on_time, event_time="ts") as h:
        h.process(rows)
        h.advance_watermark(25)
        h.process([{"key": 1, "v": 100, "ts": 24}, {"key": 2, "v": 3, "ts": 40}])
        on_time = defaultdict(int)
        for r in rows + [{"key": 2, "v": 3, "ts": 40}]:
            on_time[r["key"]] += r["v"]
        assert h.state_items() == dict(on_time)
        assert h.side_outputs == ["late"]
        assert h.side_output("late").to_pylist() == [{"key": 1, "v": 100, "ts": 24}]


def test_harness_processing_time_timers_follow_its_clock() -> None:
    with testing.KeyedStepHarness(remind_later, key="user") as h:
        h.process([{"user": "a", "at_ms": 10_000}, {"user": "a", "at_ms": 10_001}])
        assert h.advance_processing_time(14_999).num_rows == 0  # the clock starts at 0
        h.process([{"user": "b", "at_ms": 20_000}])
        fired = h.advance_processing_time(15_000)
        assert fired.to_pylist() == [{"user": "a", "reminder_at": 15_000, "seen": 2}]
        h.process([{"user": "a", "at_ms": 16_000}])  # a's timer fired: no new one
        assert h.advance_processing_time(30_000).to_pylist() == [
            {"user": "b", "reminder_at": 25_000, "seen": 1}
        ]
        assert h.pending_timers() == 0 and h.state("a") == 3


# ---- failures: step, instance, key, traceback --------------------------------------------------


@rs.keyed(state=rs.ValueState(int, default=0))
def fragile(key: Any, records: pa.RecordBatch, state: Any) -> Any:
    if key == "boom":
        raise ZeroDivisionError("cannot count 'boom'")
    state.value += len(records)
    yield {"count": state.value}


def test_run_reports_the_failing_step_key_and_traceback() -> None:
    flow = rs.Dataflow("fails")
    words = [{"word": w} for w in ["ok", "fine", "boom", "ok"]]
    flow.source(testing.source(words)).key_by("word").apply(fragile).sink(rs.sinks.collect())
    with pytest.raises(rs.JobFailedError) as info:
        testing.run(flow)
    err = info.value
    text = str(err)
    assert "job 'fails' failed in step 'fragile', instance 0: ZeroDivisionError" in text
    assert "while processing key 'boom'" in text
    assert "Traceback" in text and "in fragile" in text
    assert (err.step, err.index, err.key) == ("fragile", 0, "'boom'")
    assert isinstance(err.__cause__, ZeroDivisionError)


def test_a_map_failure_names_the_record() -> None:
    def parse(r: dict) -> dict:
        return {"price": float(r["price"])}

    flow = rs.Dataflow("parse")
    flow.source(testing.source({"price": ["1.5", "abc"]})).map(parse).sink(rs.sinks.collect())
    with pytest.raises(rs.JobFailedError, match=r"while processing record \{'price': 'abc'\}"):
        testing.run(flow)


def test_harness_failure_names_the_key() -> None:
    with testing.KeyedStepHarness(fragile, key="word") as h:
        h.process([{"word": "ok"}])
        with pytest.raises(rs.JobFailedError, match="while processing key 'boom'") as info:
            h.process([{"word": "boom"}])
        assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_harness_refuses_what_it_cannot_drive() -> None:
    with pytest.raises(rs.ConfigError, match="keyed operator"):
        testing.KeyedStepHarness(rs.map(lambda r: r, name="m"))
    with (
        testing.KeyedStepHarness(count, key="word") as h,
        pytest.raises(rs.ConfigError, match="no state 'nope'"),
    ):
        h.state("a", name="nope")
    with pytest.raises(rs.ConfigError, match="closed"):
        h.process([{"word": "a"}])
