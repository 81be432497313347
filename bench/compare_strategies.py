"""Run the same key-count workload once per migration strategy and compare them.

    python -m bench.compare_strategies --events 2000000 --keys 1000000 --rate 100000 \\
        --rescale 4@8 --out bench/results

writes ``compare.md`` (one row per strategy), ``compare.png`` (p99 latency per 250 ms window over
time for every strategy, the rescale moment marked) and ``compare.json`` (every report). With
``--overhead-events N`` it also runs key-count unthrottled with migration support on and off and
reports both throughputs (the cost of tracking sub-groups for live rescaling).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

import raystream as rs
from bench._report import build_report, write_atomically
from bench.keycount import (
    STEP,
    _connect_ray,
    _parse_rescales,
    _pickle_by_value,
    _run,
    keycount_flow,
)
from raystream.plugins import MIGRATION_STRATEGIES, known

ALL = ["meces", "all_at_once", "fluid", "batched", "lazy", "stop_restart"]


def _one(
    strategy: str | None,
    events: int,
    keys: int,
    zipf: float,
    rate: float,
    parallelism: int,
    rescales: list[tuple[int, float]],
    migration_support: bool = True,
) -> dict[str, Any]:
    source = rs.sources.generator(events=events, keys=keys, zipf=zipf, seed=0, rate_eps=rate)
    flow = keycount_flow(source, "vectorised")
    errors: list[str] = []
    result = _run(
        flow,
        parallelism,
        3600.0,
        rescales if strategy else [],
        strategy or "meces",
        errors,
        migration_support=migration_support,
        linger_ms=5.0,
        # runs without a rescale start no warm standby actors (they would compete for the 2 cores)
        standby_instances=2 if strategy else 0,
    )
    config = {
        "strategy": strategy,
        "events": events,
        "keys": keys,
        "zipf": zipf,
        "rate": rate,
        "parallelism": parallelism,
        "migration_support": migration_support,
    }
    report = build_report(result, step=STEP, config=config)
    report["rescale_errors"] = errors
    return report


def _steady_p99(report: dict[str, Any]) -> float | None:
    """Median of the per-window p99 before the first rescale (after a 1 s warm-up)."""
    start = report["rescales"][0]["start_s"] if report["rescales"] else float("inf")
    vals = sorted(r[3] for r in report["timeline"] if r[3] is not None and 1.0 <= r[0] < start)
    return vals[len(vals) // 2] if vals else None


def _table(reports: dict[str, dict[str, Any]]) -> str:
    head = (
        "| strategy | rescale duration s | moved key groups | moved MB | on-demand fetches | "
        "fetch wait p50/p99 ms | peak latency ms | p99 latency ms (rescale window) | "
        "steady p99 ms | throughput dip | events ok |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for name, rep in reports.items():
        steady = _steady_p99(rep)
        if not rep["rescales"]:
            rows.append(
                f"| {name} | failed: {'; '.join(rep['rescale_errors'])[:120]} | | | | | | | | | |"
            )
            continue
        r = rep["rescales"][0]
        dip = r["throughput_dip"]
        rows.append(
            f"| {name} | {r['duration_s']:.2f} | {r['moved_key_groups']} | {r['moved_bytes'] / 1e6:.2f} | "
            f"{r['on_demand_fetches']} | {r['fetch_wait_ms']['p50']:.1f} / {r['fetch_wait_ms']['p99']:.1f} | "
            f"{r['peak_latency_ms']:.1f} | {r['p99_latency_ms']:.1f} | "
            f"{'-' if steady is None else f'{steady:.1f}'} | {'-' if dip is None else f'{dip:.2f}'} | "
            f"{rep['events_in'] == rep['config']['events']} |"
        )
    return head + "\n".join(rows) + "\n"


def _plot(reports: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.5))
    for name, rep in reports.items():
        rows = [r for r in rep["timeline"] if r[3] is not None]
        ax.plot([r[0] for r in rows], [max(r[3], 0.1) for r in rows], label=name, linewidth=1.3)
        for r in rep["rescales"]:
            ax.axvline(r["start_s"], color="grey", linestyle="--", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("time since start (s); dashed: rescale requested")
    ax.set_ylabel("p99 latency per 250 ms window (ms, log)")
    ax.set_title(title)
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    write_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


@click.command(context_settings={"show_default": True})
@click.option("--events", type=click.IntRange(min=1), default=2_000_000)
@click.option("--keys", type=click.IntRange(min=1), default=1_000_000)
@click.option("--zipf", type=click.FloatRange(min=0), default=1.1)
@click.option("--rate", type=click.FloatRange(min=1), default=100_000.0, help="events/s (fixed)")
@click.option("--parallelism", type=click.IntRange(1, 128), default=2)
@click.option("--rescale", "rescale_at", multiple=True, default=("4@8",), metavar="P@T")
@click.option("--strategies", default=",".join(ALL), help="comma-separated")
@click.option(
    "--overhead-events",
    type=click.IntRange(min=0),
    default=0,
    help="also run this many events unthrottled with migration support on and off",
)
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("bench/results"))
def main(
    events: int,
    keys: int,
    zipf: float,
    rate: float,
    parallelism: int,
    rescale_at: tuple[str, ...],
    strategies: str,
    overhead_events: int,
    out_dir: Path,
) -> None:
    """Same workload, one run per strategy: a Markdown table, a PNG and the JSON reports."""
    names = [s.strip() for s in strategies.split(",") if s.strip()]
    unknown = [n for n in names if n not in known(MIGRATION_STRATEGIES) and ":" not in n]
    if unknown:
        msg = f"unknown strategies {unknown}; known: {sorted(known(MIGRATION_STRATEGIES))}"
        raise click.BadParameter(msg, param_hint="'--strategies'")
    rescales = _parse_rescales(rescale_at, 128)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = _connect_ray()
    try:
        _pickle_by_value()
        reports: dict[str, dict[str, Any]] = {}
        for name in names:
            click.echo(f"running {name} ...", err=True)
            reports[name] = _one(name, events, keys, zipf, rate, parallelism, rescales)
        overhead = {}
        if overhead_events:
            for support in (True, False):
                rep = _one(
                    None, overhead_events, keys, zipf, 0, parallelism, [], migration_support=support
                )
                overhead["on" if support else "off"] = rep["throughput_eps"]
    finally:
        if started:
            import ray

            ray.shutdown()
    title = (
        f"key-count {rate:,.0f} ev/s, {keys:,} keys, Zipf {zipf}, "
        f"{parallelism} -> {' -> '.join(str(p) for p, _ in rescales)}"
    )
    md = f"### {title}\n\n" + _table(reports)
    if overhead:
        md += (
            f"\nUnthrottled, {overhead_events:,} events: {overhead['on']:,.0f} ev/s with migration support, "
            f"{overhead['off']:,.0f} ev/s without ({overhead['on'] / overhead['off'] - 1:+.1%}).\n"
        )
    write_atomically(out_dir / "compare.md", lambda tmp: tmp.write_text(md))
    write_atomically(
        out_dir / "compare.json",
        lambda tmp: tmp.write_text(
            json.dumps({"reports": reports, "overhead": overhead}, indent=1)
        ),
    )
    _plot(reports, out_dir / "compare.png", title)
    click.echo(md)
    if any(r["rescale_errors"] for r in reports.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
