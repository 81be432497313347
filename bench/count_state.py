"""CPU of the key-count step alone, without Ray: one ``KeyedProcessor`` over real batches.

Run it from the repository root::

    python -m bench.count_state --name count_state --repeats 3

The generator's events (``--events``, ``--keys``, Zipf ``--zipf``) are split as a job at
parallelism ``--instances`` splits them (by key group, in contiguous ranges) and instance 0's share
is cut into ``--batch-rows`` batches, as its input channel would deliver them
(``--cache-entries``: the write-back cache's bound; under the share's distinct keys it evicts).
Each repeat makes a new RocksDB in a temporary folder, builds the batches first (not timed), then times
``KeyedProcessor.process`` over all of them plus the final write of the write-back cache
(``flush_cache``): process CPU seconds, and per million events; and each batch's wall time
(median and max per run). The counts are then read back
through the state and checked against ``np.unique`` over the same events (exit 1 if any differs).

Writes ``bench/results/NAME.json`` with every run, the median and min-max, and which
``raystream`` was imported (its folder), so the same command against an older checkout gives
the comparison.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
import pyarrow as pa

import raystream as rs
from bench._report import imported_from
from bench._payload import COUNT_BYTES, prefill_state
from bench.keycount import keycount_flow
from raystream.runtime.processors import KeyedProcessor
from raystream.state.handles import KeySet

__all__ = ["main", "run_once"]


def _share(
    events: int,
    keys: int,
    zipf: float,
    instances: int,
    batch_rows: int,
    value_bytes: int | None = None,
) -> Any:
    """The flow, the count step, its key space, instance 0's key groups and its batches."""
    gen = rs.sources.generator(events=events, keys=keys, zipf=zipf, seed=0)
    flow = keycount_flow(gen, "vectorised", value_bytes=value_bytes)
    step, ks = flow.steps["count"], flow.key_space
    groups = ks.num_key_groups // instances  # instance 0 holds key groups [0, groups)
    reader = gen.open(0, 1)
    parts = []
    while (b := reader.read(100_000)) is not None:
        kg, _ = ks.locate(b.column("key"))
        parts.append(b.filter(pa.array(kg < groups)))
    table = pa.Table.from_batches(parts).combine_chunks()
    owned = [g * ks.sub_groups + s for g in range(groups) for s in range(ks.sub_groups)]
    batches = table.to_batches(max_chunksize=batch_rows)
    return flow, step, ks, owned, batches, table.column("key")


def _counts(got: Any, value_bytes: int | None) -> np.ndarray:
    """The counts read back: an int state's array as it is; a payload state's values (8-byte
    little-endian count, then ``value_bytes`` of payload) decoded from their first 8 bytes,
    -1 for a value that is missing or not that long (so it counts as wrong)."""
    if isinstance(got, np.ndarray):
        return got
    width = COUNT_BYTES + (value_bytes or 0)
    return np.array(
        [
            int.from_bytes(v[:COUNT_BYTES], "little") if v is not None and len(v) == width else -1
            for v in got
        ],
        np.int64,
    )


def run_once(
    share: Any,
    folder: Path,
    cache_entries: int = 500_000,
    cache_bytes: int = 64 << 20,
    prefilled: Path | None = None,
    value_bytes: int | None = None,
) -> dict[str, Any]:
    """One timed pass; ``prefilled``: a RocksDB folder copied in as instance 0's state first;
    ``value_bytes``: the payload each value must carry (the check)."""
    _, step, ks, owned, batches, keys = share
    path = folder / "count" / "0"
    if prefilled is not None:
        shutil.copytree(prefilled, path)
    proc = KeyedProcessor(
        step, ks, path, owned, track=True, cache_entries=cache_entries, cache_bytes=cache_bytes
    )
    try:
        events = sum(b.num_rows for b in batches)
        batch_s = np.empty(len(batches))
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for i, b in enumerate(batches):
            t0 = time.perf_counter()
            proc.process(b)
            batch_s[i] = time.perf_counter() - t0
        proc.backend.flush_cache()
        cpu = time.process_time() - cpu0
        wall = time.perf_counter() - wall0
        db_reads = getattr(proc.backend, "db_reads", None)  # (older checkouts do not count)
        distinct, expected = np.unique(keys.to_numpy(), return_counts=True)
        state = proc.states.vectorised()
        got = _counts(state.get(KeySet.of(pa.array(distinct), ks)), value_bytes)
        wrong = int((got != expected).sum())
    finally:
        proc.backend.close()
    return {
        "events": events,
        "batches": len(batches),
        "cpu_s": round(cpu, 4),
        "wall_s": round(wall, 4),
        "cpu_s_per_m_events": round(cpu / events * 1e6, 4),
        # wall time of one batch's process (a write to RocksDB inside it shows here)
        "batch_ms_median": round(float(np.median(batch_s)) * 1e3, 2),
        "batch_ms_max": round(float(batch_s.max()) * 1e3, 2),
        # keys read from RocksDB (write-back cache misses) per event
        "db_reads_per_event": None if db_reads is None else round(db_reads / events, 4),
        "keys": len(distinct),
        "wrong_counts": wrong,
    }


@click.command()
@click.option("--name", default="count_state", show_default=True, help="bench/results/NAME.json")
@click.option("--events", default=6_000_000, show_default=True)
@click.option("--keys", default=1_000_000, show_default=True)
@click.option("--zipf", default=1.1, show_default=True)
@click.option("--instances", default=2, show_default=True, help="parallelism the share is of")
@click.option("--batch-rows", default=100_000, show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option(
    "--cache-entries",
    default=500_000,
    show_default=True,
    help="the write-back cache's bound (RuntimeConfig.state_cache_entries); under the share's "
    "distinct keys, the cache evicts",
)
@click.option(
    "--cache-bytes",
    type=click.IntRange(min=1),
    default=64 << 20,
    show_default=True,
    help="the write-back cache's bound in bytes of keys and values "
    "(RuntimeConfig.state_cache_bytes)",
)
@click.option(
    "--value-bytes",
    type=click.IntRange(min=1),
    default=None,
    help="each key's state: an 8-byte count and this many bytes of payload, all read and "
    "rewritten per batch (bench._payload.count_with_payload); default: the int count",
)
@click.option(
    "--prefill",
    is_flag=True,
    help="write instance 0's state for all --keys keys first (count 0: bench._payload."
    "prefill_state), once, and copy it in before each repeat (not timed)",
)
def main(
    name: str,
    events: int,
    keys: int,
    zipf: float,
    instances: int,
    batch_rows: int,
    repeats: int,
    cache_entries: int,
    cache_bytes: int,
    value_bytes: int | None,
    prefill: bool,
) -> None:
    """Time the count step over instance 0's share of the generator's events."""
    share = _share(events, keys, zipf, instances, batch_rows, value_bytes)
    runs = []
    with tempfile.TemporaryDirectory(prefix="raystream-count-prefill-") as template:
        filled = None
        if prefill:
            t0 = time.perf_counter()
            info = prefill_state(
                template, share[0], "count", instances, keys, "int", value_bytes, instances=[0]
            )
            filled = Path(template) / "count" / "0"
            click.echo(
                f"prefilled {info['rows']:,} keys, {info['bytes'] / 1e6:,.0f} MB "
                f"in {time.perf_counter() - t0:.1f} s"
            )
        for i in range(repeats):
            with tempfile.TemporaryDirectory(prefix="raystream-count-state-") as tmp:
                run = run_once(share, Path(tmp), cache_entries, cache_bytes, filled, value_bytes)
            runs.append(run)
        click.echo(
            f"rep {i + 1}: {run['cpu_s_per_m_events']:.3f} CPU-s per M events "
            f"({run['events']:,} events, {run['batches']} batches, {run['keys']:,} keys, "
            f"{run['wrong_counts']} wrong counts; {run['db_reads_per_event']} RocksDB reads per "
            f"event; batch median {run['batch_ms_median']} ms, "
            f"max {run['batch_ms_max']} ms)"
        )
    per_m = [r["cpu_s_per_m_events"] for r in runs]
    out = {
        "benchmark": "count_state",
        "measures": "process CPU seconds of KeyedProcessor.process over instance 0's batches "
        "plus the final flush of the write-back cache, per million events",
        "raystream": imported_from(rs),
        "config": {
            "events": events,
            "keys": keys,
            "zipf": zipf,
            "instances": instances,
            "batch_rows": batch_rows,
            "cache_entries": cache_entries,
            "cache_bytes": cache_bytes,
            "value_bytes": value_bytes,
            "prefill": prefill,
        },
        "cpu_s_per_m_events": {
            "median": statistics.median(per_m),
            "min": min(per_m),
            "max": max(per_m),
        },
        "runs": runs,
    }
    path = Path("bench/results") / f"{name}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    click.echo(f"median {out['cpu_s_per_m_events']['median']:.3f} CPU-s per M events; wrote {path}")
    if any(r["wrong_counts"] for r in runs):
        click.echo("counts differ from np.unique over the events", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
