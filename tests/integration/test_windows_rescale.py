"""Windows rescaled live while the stream runs: a tumbling and a session window with meces, a
sliding window with every other built-in strategy, moved to another actor (``job.move``) and
given a new function (``job.replace``), several changes one after the other in one job. Window
state (in memory for tumbling and sliding windows, in RocksDB for sessions) and timers move with
their sub-groups; every (key, window) is emitted exactly once with the result DuckDB computes
over the exact prefix of the input that was sent."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time

import pytest
import ray
import raystream.operators as ops
from raystream.operators import windows

import raystream as rs
from tests.integration._rescale_helpers import UntilGate
from tests.integration._window_helpers import (
    OUT_OF_ORDERNESS_MS,
    events,
    session_oracle,
    sliding_oracle,
    tumbling_oracle,
    window_rows,
)

RATE_EPS = 8_000
RUNTIME = {"linger_ms": 10.0, "source_batch_rows": 1_000}


def _records_in(job: rs.Job, step: str) -> int:
    return sum(m["records_in"] for m in job.metrics()["instances"] if m.get("step") == step)


def _wait_records(job: rs.Job, step: str, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _records_in(job, step) < n:
        assert time.monotonic() < deadline, f"fewer than {n} records reached {step!r}"
        time.sleep(0.05)


# each case is one job and its changes, one after the other (a change waits for half a second
# more of input): (parallelism, strategy), or ("move", 0) / ("replace", None)
CASES = [
    ("tumbling", [(3, "meces"), (1, "meces")]),
    ("session", [(3, "meces")]),
    ("sliding", [(3, "all_at_once"), (1, "fluid"), (3, "batched")]),
    ("sliding", [(3, "lazy"), (1, "stop_restart"), ("move", 0), ("replace", None)]),
]


def _case_id(case: tuple[str, list[tuple[object, object]]]) -> str:
    kind, changes = case
    return "-".join(
        [kind, *(str(what if what in ("move", "replace") else how) for what, how in changes)]
    )


@pytest.mark.parametrize(("kind", "changes"), CASES, ids=[_case_id(c) for c in CASES])
def test_window_state_and_timers_move_with_a_live_rescale(
    kind: str, changes: list[tuple[object, object]]
) -> None:
    table = events(RATE_EPS * 60, keys=300, seed=21)  # a minute of input: ended by the gate
    gate_dir = tempfile.mkdtemp(prefix="rs-gate-")
    gate = os.path.join(gate_dir, "enough")
    src = UntilGate(rs.sources.from_table(table, rate_eps=RATE_EPS), gate, after_rows=RATE_EPS)
    agg = [ops.count(), ops.sum("x"), ops.max("x")]
    op = {
        "tumbling": lambda: windows.tumbling(500, agg),
        "sliding": lambda: windows.sliding(1_000, 250, agg),
        "session": lambda: windows.session(1_500, agg),
    }[kind]()
    flow = rs.Dataflow(f"window-rescale-{kind}", num_key_groups=32, sub_groups=4)
    out_stream = (
        flow.source(src, event_time="ts", max_out_of_orderness_ms=OUT_OF_ORDERNESS_MS)
        .key_by("k")
        .apply(op, name="window")
    )
    out_stream.sink(rs.sinks.collect(), name="out")
    out_stream.side_output("late").sink(rs.sinks.collect(), name="late")
    job = rs.start(flow, parallelism={"window": 2}, **RUNTIME)
    try:
        seen = RATE_EPS
        stats = []
        for what, how in changes:
            _wait_records(job, "window", seen)
            fired_before = job.metrics()
            if what == "move":  # an instance to a new actor (files, then the rows since)
                node = ray.get_runtime_context().get_node_id()
                stats.append(job.move("window", int(how), node))
            elif what == "replace":  # the same windows, a new function: the state is kept
                stats.append(job.replace("window", op))
            else:
                stats.append(job.rescale("window", int(what), str(how)))
            seen = _records_in(job, "window") + RATE_EPS // 2
        with open(gate, "w"):
            pass
        result = job.wait(timeout_s=180)
    except BaseException:
        with contextlib.suppress(Exception):
            job.stop()
        raise
    finally:
        with contextlib.suppress(OSError), open(gate + ".events") as f:
            sent = int(f.read())
        shutil.rmtree(gate_dir, ignore_errors=True)
    assert result.state == "finished"
    assert fired_before is not None
    assert all(s for s in stats), stats
    prefix = table.slice(0, sent)
    out = result.table("out")
    if kind == "tumbling":
        got = window_rows(out, "k", "window_start", "count", "x_sum", "x_max")
        expected = tumbling_oracle(prefix, 500)
    elif kind == "sliding":
        got = window_rows(out, "k", "window_start", "count", "x_sum", "x_max")
        expected = sliding_oracle(prefix, 1_000, 250)
    else:
        got = window_rows(out, "k", "window_start", "window_end", "count", "x_sum", "x_max")
        expected = session_oracle(prefix, 1_500)
    late = [r for r in result.results.get("late", []) if r is not None]
    late_rows = sum(t.num_rows for t in late)
    assert late_rows == 0, (
        f"{late_rows} records came out late, but no record is behind the source's watermark: "
        "the rescale let the watermark overtake records"
    )
    assert len(got) == len(set(got)), "a window was emitted twice"
    assert got == expected
    assert sent > RATE_EPS * (len(changes) + 1) // 2, f"only {sent} records were sent"
