"""Rescaling an overloaded keyed step: every strategy, each rescale starting with a backlog.

One job (one source instance, so the generator's per-key ``seq`` is a total order per key) whose
count step costs 150 us per record at 25k events/s: it is overloaded at every parallelism used
here, so its inboxes are full and its source behind when each rescale starts. ``count`` itself
checks that every key's records continue where the key stopped (a record lost, applied twice or
out of order fails the job); the final counts are checked against a ``collections.Counter`` over
the exact prefix of the generator's stream that was sent (``assert_exact``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np
import pyarrow as pa

import raystream as rs

from ._rescale_helpers import (
    STEP,
    LiveJob,
    UntilGate,
    assert_exact,
    generator,
    prefix_counts,
)

COST_S = 150e-6  # per record: 25k events/s is 3.75 instances of work
# few key groups: fluid moves one per step, each step behind its own barrier
NUM_KEY_GROUPS = 8
SUB_GROUPS = 4
# (strategy, parallelism, strategy options): overtaking barriers for all but stop_restart
# (aligned by design)
SEQUENCE: list[tuple[str, int, dict[str, Any]]] = [
    ("meces", 2, {}),
    ("fluid", 1, {}),
    ("batched", 2, {}),
    ("lazy", 1, {"max_lazy_s": 1.0}),
    ("all_at_once", 2, {}),
    ("stop_restart", 1, {}),
]


@rs.keyed_batches(name=STEP, state=rs.ValueState(int, default=0))
def costly_count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    """Count per key at COST_S per record; raise if a key's ``seq`` does not continue its
    count (per key, the generator's seq is 0, 1, 2, ...)."""
    time.sleep(len(batch) * COST_S)
    seen = state.get(batch.keys)
    counts = batch.counts
    rank = np.arange(len(batch)) - np.repeat(batch.offsets[:-1], counts)
    seq = batch.records.column("seq").to_numpy()
    wrong = np.flatnonzero(seq != np.repeat(seen, counts) + rank)
    if len(wrong):
        i = int(wrong[0])
        key = batch.records.column("key")[i].as_py()
        msg = f"per-key order broken for key {key!r}: seq {seq[i]} came at count {seen}"
        raise AssertionError(msg)
    new = seen + counts
    state.put(batch.keys, new)
    last = seq[batch.offsets[1:] - 1]
    return batch.output({"count": new, "seq": last})


def test_every_strategy_rescales_an_overloaded_step_exactly_and_in_order() -> None:
    gen = generator("int", skewed=True, seed=23)
    gate_dir = tempfile.mkdtemp(prefix="rs-gate-")
    gate = os.path.join(gate_dir, "enough")
    flow = rs.Dataflow("backlog", num_key_groups=NUM_KEY_GROUPS, sub_groups=SUB_GROUPS)
    flow.source(UntilGate(gen, gate)).key_by("key").apply(costly_count, name=STEP).sink(
        rs.sinks.collect(), name="out"
    )
    # batches of at most 1,000 rows: 4 queued + 4 in flight per channel = ~1.2 s of work
    job = rs.start(flow, parallelism={STEP: 1}, linger_ms=20.0, batch_rows=1_000)
    try:
        live = LiveJob(job, gate)
        live.wait_flowing(records=5_000)
        stats = []
        for strategy, parallelism, options in SEQUENCE:  # overloaded throughout
            stats.append(live.rescale(parallelism, strategy, **options))
        result, events = live.finish()
    except BaseException:
        with contextlib.suppress(Exception):
            job.stop()
        raise
    finally:
        shutil.rmtree(gate_dir, ignore_errors=True)
    summary = [
        (s["strategy"], s["to"], round(s["duration_s"], 2), s["backlog_at_start"]["queued_rows"])
        + (s["handover_rows"],)
        for s in stats
    ]
    print("rescales (strategy, to, duration_s, queued rows at start, handed over):", summary)
    assert_exact(result.table("out"), prefix_counts(gen, events), events)
    for (strategy, _, _), st in zip(SEQUENCE, stats, strict=True):
        assert st["strategy"] == strategy
        assert st["backlog_at_start"]["queued_rows"] > 0, (strategy, st["backlog_at_start"])
        assert st["switch_s"] is not None and st["sealed_s"] is not None, (strategy, st)
    # queued records went to the new owners with their state (not with the aligned stop_restart)
    handed = {s: st["handover_rows"] for (s, _, _), st in zip(SEQUENCE, stats, strict=True)}
    assert handed["stop_restart"] == 0
    assert sum(handed.values()) > 0, handed
