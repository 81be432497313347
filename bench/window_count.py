"""Tumbling-window count benchmark: events per second through ``operators.windows.tumbling``.

Run it from the repository root::

    python -m bench.window_count --events 2000000 --keys 10000 --parallelism 2

The dataflow is ``from_table (event_time="ts") -> key_by("key") -> tumbling(window, count())
-> collect``; event times advance ``--eps-event`` events per event-time second with out-of-order
jitter, so windows fire all along the stream. ``--baseline`` runs the plain vectorised key count
(one RocksDB value per key, no windows, no timers) over the same input for comparison. The
output is checked against numpy (every (key, window) count once).
"""

from __future__ import annotations

import time
from typing import Any

import click
import numpy as np
import pyarrow as pa

import raystream as rs
from raystream.operators import count, windows


@rs.keyed_batches(name="window", state=rs.ValueState(int, default=0))
def key_count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


def make_events(n: int, keys: int, eps_event: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    ts = (np.arange(n) * 1000 // eps_event).astype(np.int64) - rng.integers(0, 500, n)
    return pa.table({"key": rng.integers(0, keys, n).astype(np.int64), "ts": ts})


def run(table: pa.Table, op: Any, parallelism: int, name: str) -> tuple[float, pa.Table]:
    flow = rs.Dataflow(name, num_key_groups=128, sub_groups=16)
    (
        flow.source(rs.sources.from_table(table), event_time="ts", max_out_of_orderness_ms=500)
        .key_by("key")
        .apply(op, name="window")
        .sink(rs.sinks.collect(), name="out")
    )
    t0 = time.monotonic()
    result = rs.run(flow, parallelism={"window": parallelism}, timeout_s=600)
    wall = time.monotonic() - t0
    return wall, result.table("out")


@click.command()
@click.option("--events", default=2_000_000, show_default=True)
@click.option("--keys", default=10_000, show_default=True)
@click.option("--window-ms", default=10_000, show_default=True)
@click.option("--eps-event", default=100_000, show_default=True, help="events per event-time s")
@click.option("--parallelism", default=2, show_default=True)
@click.option("--baseline/--no-baseline", default=False)
def main(
    events: int, keys: int, window_ms: int, eps_event: int, parallelism: int, baseline: bool
) -> None:
    table = make_events(events, keys, eps_event, seed=1)
    wall, out = run(table, windows.tumbling(window_ms, count()), parallelism, "bench-window")
    ts = table["ts"].to_numpy()
    pairs = np.unique(
        np.stack([table["key"].to_numpy(), ts - np.mod(ts, window_ms)]), axis=1, return_counts=True
    )
    got = np.stack([out["key"].to_numpy(), out["window_start"].to_numpy()])
    order = np.lexsort((got[1], got[0]))
    assert out.num_rows == pairs[0].shape[1], "one row per (key, window)"
    assert (got[:, order] == pairs[0]).all() and (out["count"].to_numpy()[order] == pairs[1]).all()
    print(
        f"tumbling({window_ms}) count, p={parallelism}: {events} events, {keys} keys, "
        f"{out.num_rows} windows in {wall:.1f} s wall = {events / wall:,.0f} events/s "
        "(job start to end, incl. deploy)"
    )
    if baseline:
        bwall, _ = run(table, key_count, parallelism, "bench-keycount")
        print(f"plain key count, p={parallelism}: {bwall:.1f} s = {events / bwall:,.0f} events/s")


if __name__ == "__main__":
    main()
