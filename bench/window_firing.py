"""How long one window instance takes to fire: NEXMark q5's window step without Ray.

Run it from the repository root::

    python -m bench.window_firing --events 1000000 --rate 50000 --runs 3 \\
        --report bench/results/window_firing_q5.json

One ``KeyedProcessor`` (real RocksDB state, no Ray, no other process) runs q5's
``windows.sliding(10 s, 2 s, count)`` keyed by auction over the generated bids of the key groups
that instance 0 of ``--parallelism`` instances owns. Bids go in as batches of ``--batch-rows``;
after each batch the watermark moves to the batch's last event time - 1 (the input is in event
time order). A *firing* is an ``on_watermark`` call that emits rows: its wall time is what a
window's close costs the instance (finding the due windows in the in-memory columns, merging
their partials, building the output). ``--checkpoint-every`` also writes the state to RocksDB
(what a checkpoint asks of the window store) every that many batches, timed apart. ``--phases`` also times the parts of a firing (the functions
in :data:`PHASES`, wrapped; the wrapping adds a little). The report gives per run the median, p90 and max over its
firings and the rows they emitted, and the median and min-max of the runs' medians.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
import pyarrow as pa

import raystream as rs
from bench.nexmark.generator import NexmarkConfig, generate
from raystream.operators import count, windows
from raystream.runtime.processors import KeyedProcessor

# (label, module, holder attribute or None, function name): the parts of a firing ``--phases``
# times. The window step calls ``store`` and the WindowTable methods through these names.
PHASES = (
    ("sub-groups here (sync)", "raystream.state.resident", "ResidentStore", "sync"),
    ("take due rows", "raystream.operators.window_columns", "WindowColumns", "_take_due"),
    ("merge partials", "raystream.operators.window_columns", "WindowColumns", "_merge"),
    ("output rows (_rows)", "raystream.operators.windows", None, "_rows"),
)


class PhaseTimer:
    """Wraps the functions of :data:`PHASES` with wall-clock accumulators while active."""

    def __init__(self) -> None:
        self.total: dict[str, float] = dict.fromkeys((p[0] for p in PHASES), 0.0)
        self._undo: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> PhaseTimer:
        import importlib

        for label, module, holder, name in PHASES:
            owner = importlib.import_module(module)
            if holder is not None:
                owner = getattr(owner, holder)
            raw = owner.__dict__[name]
            fn = raw.__func__ if isinstance(raw, staticmethod) else raw
            timed = self._timed(label, fn)
            setattr(owner, name, staticmethod(timed) if isinstance(raw, staticmethod) else timed)
            self._undo.append((owner, name, raw))
        return self

    def _timed(self, label: str, fn: Any) -> Any:
        total = self.total

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total[label] += time.perf_counter() - t0

        return timed

    def __exit__(self, *exc: Any) -> None:
        for owner, name, raw in reversed(self._undo):
            setattr(owner, name, raw)
        self._undo.clear()

    def snapshot(self) -> dict[str, float]:
        return dict(self.total)


def instance_bids(events: int, rate: float, parallelism: int, seed: int = 0) -> tuple[Any, Any]:
    """The q5 window step (a dataflow's step and key space) and the bids (auction, event_time)
    of the key groups instance 0 of ``parallelism`` owns, in event-time order."""
    flow = rs.Dataflow("window_firing")
    src = pa.table({"auction": pa.array([0], pa.int64()), "event_time": pa.array([0], pa.int64())})
    op = windows.sliding(10_000, 2_000, count(name="num"), name="q5")
    flow.source(rs.sources.from_table(src), name="bid").key_by("auction").apply(op, name="q5")
    bid = generate(NexmarkConfig(events=events, rate_eps=rate, seed=seed)).bid
    times = bid.column("dateTime")
    if pa.types.is_timestamp(times.type):
        times = times.cast(pa.timestamp("ms")).cast(pa.int64())
    table = pa.table({"auction": bid.column("auction"), "event_time": times})
    ks = flow.key_space
    kg, _ = ks.locate(table.column("auction").combine_chunks())
    owned = _owned(ks.num_key_groups, parallelism)
    return flow, table.filter(pa.array(np.isin(kg, owned))), owned


def _owned(num_key_groups: int, parallelism: int) -> np.ndarray:
    """Instance 0's key groups: the first of ``parallelism`` equal contiguous ranges."""
    return np.arange(-(-num_key_groups // parallelism))


def run_once(
    flow: Any,
    bids: pa.Table,
    owned: np.ndarray,
    batch_rows: int,
    phases: PhaseTimer | None = None,
    checkpoint_every: int = 0,
) -> dict[str, Any]:
    """Feed ``bids`` to a fresh instance; the wall time and rows of every firing (and, with
    ``phases`` active, the median time per firing of each phase). ``checkpoint_every`` > 0:
    every that many batches the instance writes what it holds in memory to RocksDB, as a
    checkpoint asks it to before the copy (timed apart, not in the firings)."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = KeyedProcessor(flow.steps["q5"], flow.key_space, Path(tmp) / "q5", owned.tolist())
        times = bids.column("event_time").to_numpy()
        firings: list[tuple[float, int]] = []
        per_phase: list[dict[str, float]] = []
        writes: list[float] = []
        rows_out = 0
        t_all = time.perf_counter()
        for i, start in enumerate(range(0, bids.num_rows, batch_rows), 1):
            for b in bids.slice(start, batch_rows).to_batches():
                rows_out += sum(o.num_rows for o in proc.process(b))
            if checkpoint_every and i % checkpoint_every == 0:
                t0 = time.perf_counter()
                proc.backend._write_pending(None)  # noqa: SLF001 - what a checkpoint does first
                writes.append((time.perf_counter() - t0) * 1000)
            wm = int(times[min(start + batch_rows, bids.num_rows) - 1]) - 1
            if wm > proc.watermark:
                before = phases.snapshot() if phases is not None else {}
                t0 = time.perf_counter()
                out = proc.on_watermark(wm)
                took = time.perf_counter() - t0
                n = sum(o.num_rows for o in out)
                if n:
                    firings.append((took * 1000, n))
                    if phases is not None:
                        after = phases.snapshot()
                        per_phase.append({k: (after[k] - before[k]) * 1000 for k in after})
                    rows_out += n
        wall = time.perf_counter() - t_all
        proc.close()
    ms = np.array([f[0] for f in firings])
    rows = np.array([f[1] for f in firings])
    out_phases = {
        k: round(float(np.median([p[k] for p in per_phase])), 2) for k in (per_phase or [{}])[0]
    }
    return {
        "firings": len(firings),
        **({"phase_ms_median": out_phases} if out_phases else {}),
        "firing_ms": {
            "median": round(float(np.median(ms)), 2),
            "p90": round(float(np.percentile(ms, 90)), 2),
            "max": round(float(ms.max()), 2),
        },
        "rows_per_firing_median": int(np.median(rows)),
        **(
            {
                "state_write_ms": {
                    "writes": len(writes),
                    "median": round(float(np.median(writes)), 2),
                    "max": round(float(max(writes)), 2),
                }
            }
            if writes
            else {}
        ),
        "rows_out": rows_out,
        "bids": bids.num_rows,
        "wall_s": round(wall, 3),
        "bids_per_s": round(bids.num_rows / wall),
    }


@click.command()
@click.option("--events", default=1_000_000, show_default=True, help="NEXMark events generated")
@click.option("--rate", default=50_000.0, show_default=True, help="events per event-time second")
@click.option("--parallelism", default=2, show_default=True, help="instances the keys split over")
@click.option("--batch-rows", default=460, show_default=True, help="bids per batch (20 ms)")
@click.option("--runs", default=3, show_default=True)
@click.option("--phases", is_flag=True, help="also time the parts of a firing (wrapped calls)")
@click.option(
    "--checkpoint-every",
    default=0,
    show_default=True,
    help="batches between writes of the in-memory state to RocksDB (0: none)",
)
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(
    events: int,
    rate: float,
    parallelism: int,
    batch_rows: int,
    runs: int,
    phases: bool,
    checkpoint_every: int,
    report: Path | None,
) -> None:
    flow, bids, owned = instance_bids(events, rate, parallelism)
    results = []
    for _ in range(runs):
        if phases:
            with PhaseTimer() as timer:
                results.append(run_once(flow, bids, owned, batch_rows, timer, checkpoint_every))
        else:
            results.append(run_once(flow, bids, owned, batch_rows, None, checkpoint_every))
    medians = [r["firing_ms"]["median"] for r in results]
    out = {
        "benchmark": "window_firing",
        "definition": (
            "wall time of one on_watermark call of the q5 window instance that emits rows "
            "(one window closing), no Ray; median/p90/max over the firings of a run"
        ),
        "config": {
            "events": events,
            "rate_eps": rate,
            "parallelism": parallelism,
            "batch_rows": batch_rows,
            "runs": runs,
            "phases": phases,
            "checkpoint_every": checkpoint_every,
        },
        "runs": results,
        "firing_ms_median_of_runs": round(statistics.median(medians), 2),
        "firing_ms_median_range": [min(medians), max(medians)],
    }
    for i, r in enumerate(results, 1):
        f = r["firing_ms"]
        click.echo(
            f"run {i}: {r['firings']} firings of ~{r['rows_per_firing_median']:,} rows: "
            f"median {f['median']} ms, p90 {f['p90']} ms, max {f['max']} ms; "
            f"{r['bids_per_s']:,} bids/s"
        )
        if "state_write_ms" in r:
            w = r["state_write_ms"]
            click.echo(f"    {w['writes']} state writes: median {w['median']} ms, max {w['max']} ms")
        for label, v in r.get("phase_ms_median", {}).items():
            click.echo(f"    {label}: {v} ms")
    click.echo(
        f"firing: median of run medians {out['firing_ms_median_of_runs']} ms "
        f"(range {min(medians)}-{max(medians)})"
    )
    if report is not None:
        from bench._report import write_json

        write_json(report, out)


if __name__ == "__main__":
    main()
