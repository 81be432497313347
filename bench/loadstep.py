"""Load-step benchmark: the input rate steps up 4x, then back down; the autoscaler follows.

Run it from the repository root::

    python -m bench.loadstep                       # ds2, 5k -> 20k -> 5k events/s
    python -m bench.loadstep --policy threshold --high-s 30

The dataflow is ``generator (rate schedule) -> key_by("key") -> count (keyed, RocksDB) -> sink``.
The count step costs ``--cost-us`` microseconds of *sleeping* work per record, so one instance
processes at most ~1e6/cost records per second whatever the number of cores: scaling out adds
real capacity even on a small machine (a CPU-bound operator on 2 cores could not show that).

Writes ``<out>.json`` (configuration, every autoscaler decision with its reason, every rescale
with its timings from the decision -- routing switch, seal, first on-demand fetch served, done --
and the backlog at the decision, the timeline) and ``<out>.png``: offered and processed rate,
parallelism, and sink p99 latency over time. The final counts are checked against the
generator's own stream (numpy bincount).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
import pyarrow as pa

import raystream as rs
from bench._latency_trace import TracedLatestCountSink, read_trace
from bench._latest import LatestCountSink, latest_counts
from bench.keycount import _connect_ray, _pickle_by_value, _stop
from bench.loadstep_tail import tail_breakdown, trace_weights
from raystream.metrics import WindowedCounter, build_timeline

__all__ = ["loadstep_flow", "main"]

STEP = "count"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "loadstep"
PHASE_END_EPS_S = 1e-6  # a phase ends just before its end time (see the phases' latency)


def slow_count_op(cost_s: float) -> Any:
    @rs.keyed_batches(name=STEP, state=rs.ValueState(int, default=0))
    def count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
        if cost_s > 0:
            time.sleep(float(batch.counts.sum()) * cost_s)  # the per-record cost, off the CPU
        new = state.get(batch.keys) + batch.counts
        state.put(batch.keys, new)
        return batch.output({"count": new})

    return count


def loadstep_flow(source: Any, cost_s: float, trace_dir: Path | None = None) -> rs.Dataflow:
    """``source -> key_by -> count -> latest``; with ``trace_dir`` the sink also writes every
    row's ingest and write time there (``bench._latency_trace``)."""
    flow = rs.Dataflow("bench-loadstep", num_key_groups=128)
    sink = LatestCountSink() if trace_dir is None else TracedLatestCountSink(folder=str(trace_dir))
    flow.source(source).key_by("key").apply(slow_count_op(cost_s), name=STEP).sink(
        sink, name="latest"
    )
    return flow


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _refill_of(r: dict[str, Any], refills: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The standby refill after rescale ``r`` (a scale-out), if any."""
    for f in refills:
        if f.get("step") == r.get("step") and f.get("rescale_start_s") == r.get("start_s"):
            keys = ("after_s", "caught_up", "not_draining", "deadline", "max_wait_s", "waves")
            return {k: f[k] for k in keys if k in f}
    return None


def _rescale_timing(r: dict[str, Any], refills: list[dict[str, Any]]) -> dict[str, Any]:
    """One rescale's timings, in seconds from the request (the autoscaler's decision; the
    controller takes it a few ms later): routing switched at the first instance, last old owner
    sealed, first on-demand chunk served, all state settled; and the backlog then."""
    backlog = r.get("backlog_at_start") or {}
    serve = r.get("on_demand_serve_wait_ms") or {}
    fetch = r.get("fetch_wait_ms") or {}
    return {
        "from": r["from"],
        "to": r["to"],
        "strategy": r["strategy"],
        "start_s": r["start_s"],
        "prepare_phases_s": r.get("prepare_phases_s"),
        "spawn_phases_s": r.get("spawn_phases_s"),
        "move_phases_s": r.get("move_phases_s"),
        "switch_s": r.get("switch_s"),
        "sealed_s": r.get("sealed_s"),
        "first_on_demand_served_s": r.get("first_on_demand_served_s"),
        "done_s": r["duration_s"],
        "serve_wait_p99_ms": serve.get("p99"),
        "fetch_wait_p50_ms": fetch.get("p50"),
        "fetch_wait_p99_ms": fetch.get("p99"),
        "backlog_queued_rows": backlog.get("queued_rows"),
        "backlog_source_lag_rows": backlog.get("source_lag_rows"),
        "backlog_work_s": backlog.get("total_work_s"),
        "handover_rows": r.get("handover_rows", 0),
        # after a scale-out: how long the refill of the warm standbys waited for the catch-up
        "standby_refill": _refill_of(r, refills),
    }


def _parallelism_timeline(start: int, rescales: list[dict[str, Any]]) -> list[tuple[float, int]]:
    """(t_s, parallelism) steps: a rescale counts from the moment it settled."""
    points = [(0.0, start)]
    for r in sorted(rescales, key=lambda r: r["end_s"]):
        points.append((float(r["end_s"]), int(r["to"])))
    return points


def _plot(path: Path, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = report["timeline"]
    t = [row[0] for row in tl]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True)
    ax = axes[0]
    sched = report["offered"]
    ax.step(
        [p[0] for p in sched],
        [p[1] / 1000 for p in sched],
        where="post",
        label="offered (schedule)",
        color="black",
        lw=1.2,
    )
    ax.plot(t, [row[1] / 1000 for row in tl], label="processed by count", color="tab:blue", lw=0.9)
    ax.set_ylabel("k events/s")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[1]
    par = report["parallelism"] + [[t[-1] if t else 0, report["parallelism"][-1][1]]]
    ax.step([p[0] for p in par], [p[1] for p in par], where="post", color="tab:green")
    for r in report["rescales"]:
        ax.axvspan(r["start_s"], r["end_s"], color="tab:orange", alpha=0.3, lw=0)
    ax.set_ylabel("count instances")
    ax.set_ylim(0, max(p[1] for p in par) + 1)
    ax = axes[2]
    ax.plot(t, [row[3] for row in tl], color="tab:red", lw=0.9)
    ax.set_yscale("log")
    ax.set_ylabel("sink p99 latency ms")
    ax.set_xlabel("seconds since the job started (orange: rescale in progress)")
    fig.suptitle(
        f"load step x{report['config']['factor']:g} with autoscaler {report['config']['policy']!r}"
        f" (count costs {report['config']['cost_us']:g} us/record)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option(
    "--low-eps", type=click.FloatRange(min=1), default=5_000, help="Rate before and after the step."
)
@click.option(
    "--factor",
    type=click.FloatRange(min=1),
    default=4.0,
    help="The step: high rate = low x factor.",
)
@click.option(
    "--low-s", type=click.FloatRange(min=1), default=8.0, help="Seconds at the low rate first."
)
@click.option(
    "--high-s", type=click.FloatRange(min=1), default=20.0, help="Seconds at the high rate."
)
@click.option(
    "--after-s", type=click.FloatRange(min=1), default=25.0, help="Seconds at the low rate after."
)
@click.option(
    "--cost-us",
    type=click.FloatRange(min=0),
    default=100.0,
    help="Per-record cost of count (sleep).",
)
@click.option("--keys", type=click.IntRange(min=1), default=20_000, help="Distinct keys.")
@click.option("--policy", default="ds2", help="Autoscaler policy: name or module:attr.")
@click.option(
    "--parallelism", type=click.IntRange(min=1), default=1, help="Initial count instances."
)
@click.option("--max-parallelism", type=click.IntRange(min=1), default=8)
@click.option(
    "--interval-s",
    type=click.FloatRange(min=0.05),
    default=0.25,
    help="Autoscaler sampling (and decision) interval.",
)
@click.option("--window-s", type=click.FloatRange(min=0.1), default=3.0)
@click.option("--cooldown-s", type=click.FloatRange(min=0), default=3.0)
@click.option("--stabilization-s", type=click.FloatRange(min=0), default=6.0)
@click.option("--strategy", default="meces", help="Migration strategy of the rescales.")
@click.option("--linger-ms", type=click.FloatRange(min=1), default=20.0)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=DEFAULT_OUT,
    help="Writes OUT.json and OUT.png.",
)
@click.option(
    "--catch-up-s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="ds2 only: also size for the expected backlog, worked off within this long (the "
    "policy's catch_up_s; default off).",
)
@click.option(
    "--standby-instances",
    type=click.IntRange(min=0),
    default=None,
    help="Warm standby actors the job keeps (default: the runtime's, 2).",
)
@click.option(
    "--trace/--no-trace",
    default=False,
    help="Keep every row's latency (OUT_trace/*.parquet) and break the high phase's tail down "
    "by ingest time (the report's 'tail'; bench.loadstep_tail).",
)
def main(
    low_eps: float,
    factor: float,
    low_s: float,
    high_s: float,
    after_s: float,
    cost_us: float,
    keys: int,
    policy: str,
    parallelism: int,
    max_parallelism: int,
    interval_s: float,
    window_s: float,
    cooldown_s: float,
    stabilization_s: float,
    strategy: str,
    linger_ms: float,
    out: Path,
    catch_up_s: float | None,
    standby_instances: int | None,
    trace: bool,
) -> None:
    """Step the input rate up by FACTOR and back down; record how the autoscaler follows."""
    high = low_eps * factor
    events = int(low_eps * low_s + high * high_s + low_eps * after_s)
    schedule = [(low_s, high), (low_s + high_s, low_eps)]
    source = rs.sources.generator(
        events=events, keys=keys, seed=11, rate_eps=low_eps, rate_schedule=schedule
    )
    trace_dir = out.with_name(out.name + "_trace") if trace else None
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        for old in trace_dir.glob("sink-*.parquet"):
            old.unlink()
    load_at_start = [round(x, 2) for x in os.getloadavg()]  # the machine's, 1/5/15 min
    started_ray = _connect_ray()
    _pickle_by_value(("bench.loadstep", "bench._latest", "bench._latency_trace"))
    try:
        job = rs.start(
            loadstep_flow(source, cost_us / 1e6, trace_dir),
            parallelism={STEP: parallelism},
            migration=strategy,
            linger_ms=linger_ms,
            autoscaler=policy,
            autoscaler_config={
                "interval_s": interval_s,
                "window_s": window_s,
                "cooldown_s": cooldown_s,
                "stabilization_s": stabilization_s,
                "max_parallelism": max_parallelism,
                **({"policy_args": {"catch_up_s": catch_up_s}} if catch_up_s else {}),
            },
            **({} if standby_instances is None else {"standby_instances": standby_instances}),
        )
        try:
            result = job.wait(timeout_s=(low_s + high_s + after_s) * 3 + 60)
        except BaseException:
            _stop(job)
            raise
        if result.state == "running":
            _stop(job)
            raise click.ClickException("the job did not finish in time; it was stopped")
    finally:
        if started_ray:
            import ray

            ray.shutdown()

    # final counts against the generator's stream (numpy, independent of the job)
    # each sink instance keeps the latest count of the keys it saw; a key that moved between
    # instances (the sink is chained to count and follows its rescales) is in several tables:
    # its count is the largest
    final = latest_counts(pa.concat_tables([r for r in result.results["latest"] if r is not None]))
    expected = np.bincount(source.generate_all()["key"].to_numpy(), minlength=keys)
    got = np.zeros(keys, dtype=np.int64)
    got[final["key"].to_numpy()] = final["count"].to_numpy()
    exact = bool(np.array_equal(got, expected))
    seen = np.zeros(keys, dtype=bool)
    seen[final["key"].to_numpy()] = True
    mismatch = {  # where the counts differ (all zero when exact)
        "keys_missing": int(np.sum(~seen & (expected > 0))),
        "keys_low": int(np.sum(seen & (got < expected))),
        "keys_high": int(np.sum(got > expected)),
        "records_missing": int(np.sum(np.maximum(expected - got, 0))),
        "records_extra": int(np.sum(np.maximum(got - expected, 0))),
    }
    if not exact:  # where the wrong keys live: (key group, sub-group) -> keys, records short
        wrong = np.flatnonzero(got != expected)
        kg, sg = rs.Dataflow("k", num_key_groups=128).key_space.locate(pa.array(wrong))
        short = expected[wrong] - got[wrong]
        places: dict[str, list[int]] = {}
        for g, s_, d, want in zip(
            kg.tolist(), sg.tolist(), short.tolist(), expected[wrong], strict=True
        ):
            row = places.setdefault(f"{g}/{s_}", [0, 0, 0])
            row[0] += 1
            row[1] += d
            row[2] += int(want)
        mismatch["by_sub_group"] = places  # "kg/sg": [keys, records short, records expected]
        # each sink instance's table (live ones first, then those a scale-in retired): its rows
        # and how many of the wrong keys it has at their expected count
        tables = []
        for t in result.results["latest"]:
            if t is None:
                tables.append(None)
                continue
            k, c = t["key"].to_numpy(), t["count"].to_numpy()
            right = np.zeros(keys, dtype=bool)
            right[k] = c == expected[k]
            tables.append({"rows": t.num_rows, "wrong_keys_right_here": int(right[wrong].sum())})
        mismatch["sink_tables"] = tables

    counts = [m["throughput"] for m in result.step_metrics(STEP) if m.get("throughput")]
    tput = WindowedCounter.merge_snapshots(counts).timeline() if counts else []
    lat = result.latency()
    timeline = build_timeline(tput, lat.timeline() if lat else [])
    # the schedule starts when the source's first batch went through: align it to the first
    # processed window
    t0 = next((row[0] for row in timeline if row[1] > 0), 0.0)
    offered = [
        (t0, low_eps),
        (t0 + low_s, high),
        (t0 + low_s + high_s, low_eps),
        (t0 + low_s + high_s + after_s, low_eps),
    ]
    phases = {
        "low": (t0 + 2, t0 + low_s),
        "high": (t0 + low_s, t0 + low_s + high_s),
        "after": (t0 + low_s + high_s, t0 + low_s + high_s + after_s),
    }
    decisions = [e for e in result.autoscaling if e["action"] in ("scale_out", "scale_in")]
    report: dict[str, Any] = {
        "config": {
            "policy": policy,
            "low_eps": low_eps,
            "factor": factor,
            "low_s": low_s,
            "high_s": high_s,
            "after_s": after_s,
            "cost_us": cost_us,
            "keys": keys,
            "events": events,
            "interval_s": interval_s,
            "window_s": window_s,
            "cooldown_s": cooldown_s,
            "stabilization_s": stabilization_s,
            "strategy": strategy,
            "linger_ms": linger_ms,
            "initial_parallelism": parallelism,
            "catch_up_s": catch_up_s,
            "standby_instances": standby_instances,
        },
        "machine_load": {"start": load_at_start, "end": [round(x, 2) for x in os.getloadavg()]},
        "exact": exact,
        "mismatch": mismatch,
        "origin_ns": result.origin_ns,
        "elapsed_s": result.elapsed_s,
        "offered": offered,
        "parallelism": [list(p) for p in _parallelism_timeline(parallelism, result.rescales)],
        "rescales": result.rescales,
        "decisions": decisions,
        "autoscaling": result.autoscaling,
        "phases": {
            name: {
                # the latency windows that start in [a, b): the window starting at b (the
                # step, for the low phase) belongs to the next phase
                "latency": lat.summary_between(a, b - PHASE_END_EPS_S) if lat else None,
                "rescales": [
                    (r["from"], r["to"]) for r in result.rescales if a <= r["start_s"] < b
                ],
            }
            for name, (a, b) in phases.items()
        },
        "timeline": timeline,
    }
    refills = getattr(result, "standby_refills", [])
    report["standby_refills"] = refills
    report["per_rescale"] = [_rescale_timing(r, refills) for r in result.rescales]
    high_start = phases["high"][0]
    outs = [r for r in result.rescales if r["to"] > r["from"] and r["start_s"] >= high_start - 1]
    report["reaction_s"] = {
        "first_scale_out_after_step": (outs[0]["start_s"] - high_start) if outs else None,
        "scaled_out_settled_after_step": (outs[-1]["end_s"] - high_start) if outs else None,
    }
    if trace_dir is not None:
        t = read_trace(trace_dir)
        report["tail"] = tail_breakdown(
            t["ingest_ns"].to_numpy(),
            t["written_ns"].to_numpy(),
            t["sink_index"].to_numpy(),
            result.origin_ns,
            report,
            trace_weights(t),
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
    _plot(out.with_suffix(".png"), report)
    click.echo(f"exact: {exact}; elapsed {result.elapsed_s:.1f} s; decisions:")
    if not exact:
        click.echo(f"  counts differ: {mismatch}")
    for e in decisions:
        click.echo(f"  t={e['t_s']:.1f}s {e['operator']} {e['from']} -> {e['to']}: {e['reason']}")
    for name, ph in report["phases"].items():
        lat_ph = ph["latency"] or {}
        click.echo(
            f"  {name}: p99 {lat_ph.get('p99_ms')} ms, max {lat_ph.get('max_ms')} ms, rescales {ph['rescales']}"
        )
    click.echo(f"  reaction: {report['reaction_s']}")
    for r in report["per_rescale"]:
        click.echo(
            f"  rescale {r['from']} -> {r['to']} at t={r['start_s']:.1f}s: switch "
            f"{_fmt(r['switch_s'])} s, sealed {_fmt(r['sealed_s'])} s, first on-demand served "
            f"{_fmt(r['first_on_demand_served_s'])} s, done {_fmt(r['done_s'])} s; on-demand serve "
            f"wait p99 {_fmt(r['serve_wait_p99_ms'])} ms, record wait p50/p99 "
            f"{_fmt(r['fetch_wait_p50_ms'])}/{_fmt(r['fetch_wait_p99_ms'])} ms; backlog "
            f"{r['backlog_queued_rows']} queued + {r['backlog_source_lag_rows']} at the source "
            f"= {_fmt(r['backlog_work_s'])} s of work; handed over {r['handover_rows']} records"
        )
        if r.get("prepare_phases_s"):
            click.echo(f"    preparation (s): {r['prepare_phases_s']}")
        if r.get("spawn_phases_s"):
            click.echo(f"    spawn (s): {r['spawn_phases_s']}")
        if r.get("move_phases_s"):
            logs = ("fetch_log", "serve_log")
            move = {k: v for k, v in r["move_phases_s"].items() if k not in logs}
            click.echo(f"    move (s from the request): {move}")
    tail = report.get("tail")
    if tail and tail.get("buckets"):
        click.echo(
            f"  tail: high p99 {tail['high_p99_ms']} ms ({tail['high_over_low']}x low); top 1 % "
            f"by ingest: "
            + ", ".join(f"{k} {v['top_events']}" for k, v in tail["buckets"].items())
            + f"; above 2x low: {tail['line_2x']['events_above']} events "
            f"(p99 allows {tail['line_2x']['events_allowed_for_p99']})"
        )
    click.echo(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    if not exact:
        raise click.ClickException("final counts differ from the generator's stream")


if __name__ == "__main__":
    main()
