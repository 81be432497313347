"""Run the same key-count workload several times per migration strategy and compare them.

    python -m bench.compare_strategies --events 2000000 --keys 1000000 --rate 100000 \\
        --rescale 4@8 --repeats 3 --out bench/results

writes ``compare.md`` (one row per strategy: the median and, in brackets, the min-max spread of
each figure over the repeats), ``compare.png`` (p99 latency per 250 ms window over time, for each
strategy its run with the median peak, the rescale request marked) and ``compare.json`` (the
summary and every run's report).

Every run's final counts are compared with an independent count of the generated stream (numpy
over ``generate_all()`` of the same seeded generator, no raystream job involved); if any run's
counts differ, it says which run and how many keys differ, writes nothing and exits 1. It also
exits 1 if a requested rescale failed.

Latency percentiles are weighted per input event; a rescale's figures cover its window from the
request until latency is back within 1.5x the steady p99 for 2 s (see ``bench/_report.py``). With
``--overhead-events N`` it also runs key-count unthrottled with migration support on and off and
reports both throughputs (the cost of tracking sub-groups for live rescaling).
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import click
import numpy as np
import pyarrow as pa

import raystream as rs
from bench._cluster import simulated_cluster
from bench._latest import latest_counts
from bench._report import LATENCY_WEIGHTING, RESCALE_WINDOW, build_report, write_atomically
from bench.keycount import (
    SINK,
    STEP,
    _connect_ray,
    _parse_rescales,
    _pickle_by_value,
    _run,
    keycount_flow,
)
from raystream.plugins import MIGRATION_STRATEGIES, known

__all__ = [
    "FIGURES",
    "aggregate",
    "count_mismatch",
    "exactness_failures",
    "independent_counts",
    "placement_lines",
    "summarise",
]

ALL = ["meces", "all_at_once", "fluid", "batched", "lazy", "stop_restart"]


# --------------------------------------------------------------------------------------------
# exactness: final counts against an independent count of the generated stream


def independent_counts(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct keys (sorted) and how often each occurs, counted with numpy alone."""
    distinct, counts = np.unique(np.asarray(keys), return_counts=True)
    return distinct, counts.astype(np.int64)


def count_mismatch(
    expected: tuple[np.ndarray, np.ndarray], got: tuple[np.ndarray, np.ndarray]
) -> int:
    """How many keys have another count in ``got`` than in ``expected`` (each a pair of distinct
    sorted keys and their counts); a key missing on one side counts 0 there."""
    ek, ec = expected
    gk, gc = got
    if len(np.unique(gk)) != len(gk):
        msg = (
            f"got {len(gk)} count rows for {len(np.unique(gk))} distinct keys; expected one per key"
        )
        raise ValueError(msg)
    keys = np.union1d(ek, gk)
    a = np.zeros(len(keys), np.int64)
    b = np.zeros(len(keys), np.int64)
    a[np.searchsorted(keys, ek)] = ec
    b[np.searchsorted(keys, gk)] = gc
    return int(np.count_nonzero(a != b))


def exactness_failures(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """One message per run whose ``exact`` check failed: which run, how many keys differ."""
    out = []
    for name, reports in runs.items():
        for i, rep in enumerate(reports):
            ex = rep["exact"]
            if ex["keys_differing"]:
                out.append(
                    f"{name} run {i + 1}: {ex['keys_differing']:,} of {ex['keys_expected']:,} keys "
                    "have another final count than an independent count of the generated stream "
                    f"({ex['events_counted']:,} events counted, "
                    f"{ex['events_expected']:,} generated)"
                )
    return out


# --------------------------------------------------------------------------------------------
# aggregation over repeats


def aggregate(values: Sequence[float | None]) -> dict[str, Any]:
    """Median and spread (min, max) of one figure over the repeats. ``None`` (e.g. latency not
    recovered before the run ended, or no rescale) ranks above every number: the median and max
    are None when that many runs have None; ``missing`` counts them."""
    n = len(values)
    nums = sorted(float(v) for v in values if v is not None)
    missing = n - len(nums)
    ranked = nums + [float("inf")] * missing
    if n == 0:
        return {"median": None, "min": None, "max": None, "runs": 0, "missing": 0}
    mid = n // 2
    median = ranked[mid] if n % 2 else (ranked[mid - 1] + ranked[mid]) / 2
    return {
        "median": None if median == float("inf") else median,
        "min": ranked[0] if nums else None,
        "max": None if missing else ranked[-1],
        "runs": n,
        "missing": missing,
    }


def _first_rescale(rep: dict[str, Any]) -> dict[str, Any]:
    return rep["rescales"][0] if rep["rescales"] else {}


def _fetch_wait(q: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda rep: (_first_rescale(rep).get("fetch_wait_ms") or {}).get(q)


def _new_owner_mb_s(rep: dict[str, Any]) -> float | None:
    """The slowest new owner's intake: MB/s from its switch until its last sub-group arrived."""
    rates = (_first_rescale(rep).get("transfer") or {}).get("new_owner_mb_s") or []
    return min(rates) if rates else None


def _pair_mb_s(rep: dict[str, Any]) -> float | None:
    """The median (new owner, old owner) pair's MB/s, from when both could move state until
    the pair's last chunk arrived (:func:`raystream.runtime.migration.pair_rates`)."""
    rates = (_first_rescale(rep).get("transfer") or {}).get("pair_mb_s") or []
    return float(statistics.median(rates)) if rates else None


def _first_served(rep: dict[str, Any]) -> float | None:
    return (_first_rescale(rep).get("on_demand_serve_wait_ms") or {}).get("first")


def _field(name: str, scale: float = 1.0) -> Callable[[dict[str, Any]], float | None]:
    def get(rep: dict[str, Any]) -> float | None:
        v = _first_rescale(rep).get(name)
        return None if v is None else v * scale

    return get


TRANSFER_FIGURES = (
    "MB/s per new owner: the bytes a new owner took in over the time from its switch until "
    "its last incoming sub-group arrived, the slowest new owner of the run; MB/s per pair: the "
    "state bytes a new owner took in from one old owner over the time from when both could "
    "move state (the later of the new owner's switch and the old owner's seal, fence and "
    "eviction) until that pair's last chunk arrived, the median pair of the run; first on-demand "
    "served: the longest, over old owners, from the seal (or the request, if later) until the "
    "chunk of its first on-demand request went out."
)

# (key, column header, digits, getter): the figures of a run's first rescale, and the whole run
FIGURES: list[tuple[str, str, int, Callable[[dict[str, Any]], float | None]]] = [
    ("recovered_s", "recovered s", 2, _field("recovered_s")),
    ("window_peak_latency_ms", "peak latency ms (window)", 0, _field("window_peak_latency_ms")),
    ("window_p99_latency_ms", "p99 latency ms (window)", 0, _field("window_p99_latency_ms")),
    ("steady_p99_ms", "steady p99 ms", 0, _field("steady_p99_ms")),
    ("window_throughput_dip", "throughput dip", 2, _field("window_throughput_dip")),
    ("duration_s", "state moved s", 2, _field("duration_s")),
    ("moved_key_groups", "moved key groups", 0, _field("moved_key_groups")),
    ("moved_mb", "moved MB", 2, _field("moved_bytes", 1e-6)),
    ("on_demand_fetches", "on-demand fetches", 0, _field("on_demand_fetches")),
    ("new_owner_mb_s", "MB/s per new owner (slowest)", 0, _new_owner_mb_s),
    ("pair_mb_s", "MB/s per pair (median)", 0, _pair_mb_s),
    ("max_rss_growth_mb", "max RSS growth MB", 0, _field("max_rss_growth_mb")),
    ("first_served_ms", "first on-demand served ms", 1, _first_served),
    ("fetch_wait_p50_ms", "fetch wait p50 ms", 0, _fetch_wait("p50")),
    ("fetch_wait_p99_ms", "fetch wait p99 ms", 0, _fetch_wait("p99")),
    ("run_p99_ms", "run p99 ms", 0, lambda rep: rep["latency_ms"]["p99"]),
]


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per strategy: every figure's :func:`aggregate` over its runs, and how many runs were
    exact and how many had a failed rescale."""
    out: dict[str, dict[str, Any]] = {}
    for name, reports in runs.items():
        figs = {key: aggregate([get(rep) for rep in reports]) for key, _, _, get in FIGURES}
        out[name] = {
            "figures": figs,
            "runs": len(reports),
            "exact_runs": sum(1 for r in reports if not r["exact"]["keys_differing"]),
            "failed_rescales": sum(len(r["rescale_errors"]) for r in reports),
        }
    return out


def _fmt(agg: dict[str, Any], digits: int) -> str:
    """``median (min–max)``; None shows as "none" (e.g. not recovered before the run ended)."""

    def f(v: float | None) -> str:
        return "none" if v is None else f"{v:,.{digits}f}"

    if agg["runs"] == 0:
        return "-"
    if agg["missing"] == agg["runs"]:
        return f"none ({agg['runs']}/{agg['runs']})"
    if agg["runs"] == 1:
        return f(agg["median"])
    return f"{f(agg['median'])} ({f(agg['min'])}–{f(agg['max'])})"


def table(summary: dict[str, dict[str, Any]]) -> str:
    """The Markdown table: one row per strategy, every figure as ``median (min–max)``."""
    head = ["strategy", *(label for _, label, _, _ in FIGURES), "exact runs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in summary.items():
        cells = [_fmt(s["figures"][key], digits) for key, _, digits, _ in FIGURES]
        exact = f"{s['exact_runs']}/{s['runs']}"
        if s["failed_rescales"]:
            exact += f" ({s['failed_rescales']} rescales failed)"
        lines.append("| " + " | ".join([name, *cells, exact]) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# running


def _one(
    strategy: str | None,
    source: Any,
    parallelism: int,
    rescales: list[tuple[int, float]],
    expected: tuple[np.ndarray, np.ndarray],
    config: dict[str, Any],
    migration_support: bool = True,
    value_bytes: int | None = None,
    prefill: bool = False,
    steady_from_s: float = 1.0,
) -> dict[str, Any]:
    """One run; its report carries ``exact``: the final counts against ``expected``.
    ``value_bytes``/``prefill``: large state, as ``bench.keycount`` makes it."""
    flow = keycount_flow(source, "vectorised", value_bytes=value_bytes)
    state: dict[str, Any] = {}
    if prefill:
        from bench._payload import prefill_state

        state["state_dir"] = tempfile.mkdtemp(prefix="raystream-bench-compare-")
        config = {
            **config,
            "prefilled": prefill_state(
                state["state_dir"], flow, STEP, parallelism, config["keys"], "int", value_bytes
            ),
        }
    errors: list[str] = []
    placements: list[dict[int, str]] = []
    try:
        result = _run(
            flow,
            parallelism,
            3600.0,
            rescales if strategy else [],
            strategy or "meces",
            errors,
            placements=placements,
            migration_support=migration_support,
            linger_ms=5.0,
            # runs without a rescale start no warm standby actors (they would compete for the
            # 2 cores)
            standby_instances=2 if strategy else 0,
            **state,
        )
    finally:
        if state:
            shutil.rmtree(state["state_dir"], ignore_errors=True)
    config = {**config, "strategy": strategy, "migration_support": migration_support}
    report = build_report(result, step=STEP, config=config, steady_from_s=steady_from_s)
    report["rescale_errors"] = errors
    # node of each instance of the keyed step at the start and after each rescale
    report["placements"] = [{str(i): n for i, n in sorted(p.items())} for p in placements]
    parts = [t for t in result.results.get(SINK, []) if t is not None]
    final = latest_counts(pa.concat_tables(parts)) if parts else None
    got = (
        (final["key"].to_numpy(), final["count"].to_numpy().astype(np.int64))
        if final is not None
        else (expected[0][:0], np.zeros(0, np.int64))
    )
    report["exact"] = {
        "keys_expected": len(expected[0]),
        "keys_differing": count_mismatch(expected, got),
        "events_expected": int(expected[1].sum()),
        "events_counted": int(got[1].sum()),
    }
    return report


def placement_lines(runs: dict[str, list[dict[str, Any]]], node_ids: list[str]) -> str:
    """Per strategy (its first run): instances of the keyed step per node at the start and after
    each rescale, nodes in the order of ``node_ids`` (``2/1/1``: two on the first node)."""
    out = ["Instances per node (first run), at the start and after each rescale:", ""]
    for strategy, reps in runs.items():
        steps = []
        for placed in reps[0].get("placements", []):
            per_node = [sum(1 for n in placed.values() if n == node) for node in node_ids]
            steps.append("/".join(str(c) for c in per_node))
        out.append(f"- {strategy}: {' -> '.join(steps) or 'not recorded'}")
    return "\n".join(out) + "\n"


def _shutdown_ray() -> None:
    import ray

    ray.shutdown()


def _representative(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median rescale-window peak (None peaks rank last)."""
    key = _field("window_peak_latency_ms")
    ranked = sorted(reports, key=lambda r: (key(r) is None, key(r) or 0.0))
    return ranked[(len(ranked) - 1) // 2]


def _plot(runs: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.5))
    for name, reports in runs.items():
        rep = _representative(reports)
        rows = [r for r in rep["timeline"] if r[3] is not None]
        ax.plot([r[0] for r in rows], [max(r[3], 0.1) for r in rows], label=name, linewidth=1.3)
        for r in rep["rescales"]:
            ax.axvline(r["start_s"], color="grey", linestyle="--", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("time since start (s); dashed: rescale requested")
    ax.set_ylabel("p99 latency per 250 ms window, per input event (ms, log)")
    ax.set_title(title + " (the median-peak run of each strategy)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    write_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


@click.command(context_settings={"show_default": True})
@click.option("--events", type=click.IntRange(min=1), default=2_000_000)
@click.option("--keys", type=click.IntRange(min=1), default=1_000_000)
@click.option("--zipf", type=click.FloatRange(min=0), default=1.1)
@click.option("--seed", type=click.IntRange(min=0), default=0, help="generator seed")
@click.option("--rate", type=click.FloatRange(min=1), default=100_000.0, help="events/s (fixed)")
@click.option("--parallelism", type=click.IntRange(1, 128), default=2)
@click.option("--rescale", "rescale_at", multiple=True, default=("4@8",), metavar="P@T")
@click.option("--strategies", default=",".join(ALL), help="comma-separated")
@click.option(
    "--repeats", type=click.IntRange(min=1), default=3, help="runs per strategy (median, spread)"
)
@click.option(
    "--overhead-events",
    type=click.IntRange(min=0),
    default=0,
    help="also run this many events unthrottled with migration support on and off",
)
@click.option(
    "--value-bytes",
    type=click.IntRange(min=1),
    default=None,
    help="Give each key's state an N-byte payload every batch rewrites (as bench.keycount).",
)
@click.option("--prefill", is_flag=True, help="Write every key's state before each run starts.")
@click.option(
    "--steady-from",
    "steady_from_s",
    type=click.FloatRange(min=0),
    default=1.0,
    help="The steady span (before the first rescale) starts this many seconds into the run "
    "(later for a prefilled state: it starts cold).",
)
@click.option(
    "--nodes",
    type=click.IntRange(min=1),
    default=1,
    help="Run on a simulated cluster of this many Ray nodes on this machine (1: a plain local "
    "Ray, or RAY_ADDRESS); instances spread over the nodes, so moved state crosses nodes.",
)
@click.option("--name", default="compare", help="Results are written as NAME.{md,json,png}.")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("bench/results"))
def main(
    events: int,
    keys: int,
    zipf: float,
    seed: int,
    rate: float,
    parallelism: int,
    rescale_at: tuple[str, ...],
    strategies: str,
    repeats: int,
    overhead_events: int,
    value_bytes: int | None,
    prefill: bool,
    steady_from_s: float,
    nodes: int,
    name: str,
    out_dir: Path,
) -> None:
    """Same workload, --repeats runs per strategy: a Markdown table, a PNG and the JSON reports."""
    names = [s.strip() for s in strategies.split(",") if s.strip()]
    unknown = [n for n in names if n not in known(MIGRATION_STRATEGIES) and ":" not in n]
    if unknown:
        msg = f"unknown strategies {unknown}; known: {sorted(known(MIGRATION_STRATEGIES))}"
        raise click.BadParameter(msg, param_hint="'--strategies'")
    rescales = _parse_rescales(rescale_at, 128)
    out_dir.mkdir(parents=True, exist_ok=True)

    def source(n: int, eps: float) -> Any:
        return rs.sources.generator(events=n, keys=keys, zipf=zipf, seed=seed, rate_eps=eps)

    def expected_of(src: Any) -> tuple[np.ndarray, np.ndarray]:
        return independent_counts(src.generate_all()["key"].to_numpy())

    workload = source(events, rate)
    expected = expected_of(workload)
    config = {"events": events, "keys": keys, "zipf": zipf, "seed": seed, "rate": rate}
    config["parallelism"] = parallelism
    config.update(value_bytes=value_bytes, prefill=prefill, steady_from_s=steady_from_s)
    config["nodes"] = nodes
    large = {"value_bytes": value_bytes, "prefill": prefill, "steady_from_s": steady_from_s}
    runs: dict[str, list[dict[str, Any]]] = {}
    overhead_runs: dict[str, list[dict[str, Any]]] = {}
    with ExitStack() as ray_session:
        if nodes > 1:
            config["node_ids"] = ray_session.enter_context(simulated_cluster(nodes))
        elif _connect_ray():
            ray_session.callback(_shutdown_ray)
        _pickle_by_value()
        for k in range(repeats):  # round-robin: slow drift of the machine spreads over all
            for strategy in names:
                click.echo(f"running {strategy} ({k + 1}/{repeats}) ...", err=True)
                rep = _one(strategy, workload, parallelism, rescales, expected, config, **large)
                runs.setdefault(strategy, []).append(rep)
        if overhead_events:
            src = source(overhead_events, 0)
            exp = expected_of(src)
            cfg = {**config, "events": overhead_events, "rate": 0}
            for support in (True, False):
                rep = _one(None, src, parallelism, [], exp, cfg, migration_support=support, **large)
                overhead_runs[f"overhead, migration support {'on' if support else 'off'}"] = [rep]
    failures = exactness_failures({**runs, **overhead_runs})
    if failures:
        for f in failures:
            click.echo(f"Error: {f}", err=True)
        click.echo("Error: final counts are not exact; not writing results", err=True)
        sys.exit(1)
    summary = summarise(runs)
    state = f", {value_bytes:,}-byte values" if value_bytes else ""
    state += ", prefilled" if prefill else ""
    title = (
        f"key-count {rate:,.0f} ev/s, {keys:,} keys{state}, Zipf {zipf}, "
        f"{parallelism} -> {' -> '.join(str(p) for p, _ in rescales)}"
        + (f", {nodes} Ray nodes (simulated)" if nodes > 1 else "")
    )
    md = (
        f"### {title}\n\n{repeats} runs per strategy: median (min–max). Latency is weighted "
        f"{LATENCY_WEIGHTING}. A rescale's window lasts {RESCALE_WINDOW}. {TRANSFER_FIGURES}"
        "\n\n" + table(summary)
    )
    if nodes > 1:
        md += "\n" + placement_lines(runs, config["node_ids"])
    overhead = {
        ("on" if "on" in k else "off"): reps[0]["throughput_eps"]
        for k, reps in overhead_runs.items()
    }
    if overhead:
        md += (
            f"\nUnthrottled, {overhead_events:,} events: {overhead['on']:,.0f} ev/s with migration "
            f"support, {overhead['off']:,.0f} ev/s without "
            f"({overhead['on'] / overhead['off'] - 1:+.1%}).\n"
        )
    data = {
        "workload": {**config, "rescale": [f"{p}@{t:g}" for p, t in rescales]},
        "repeats": repeats,
        "latency_weighting": LATENCY_WEIGHTING,
        "rescale_window": RESCALE_WINDOW,
        "figures": {key: label for key, label, _, _ in FIGURES},
        "summary": summary,
        "runs": runs,
        "overhead": overhead,
        "overhead_runs": overhead_runs,
    }
    write_atomically(out_dir / f"{name}.md", lambda tmp: tmp.write_text(md))
    write_atomically(
        out_dir / f"{name}.json", lambda tmp: tmp.write_text(json.dumps(data, indent=1) + "\n")
    )
    _plot(runs, out_dir / f"{name}.png", title)
    click.echo(md)
    if any(r["rescale_errors"] for reps in runs.values() for r in reps):
        sys.exit(1)


if __name__ == "__main__":
    main()
