"""Data-plane benchmark matrix: key-count throughput, latency and CPU per event, with and without
migration support, repeated; median and min-max per case.

Run it from the repository root, alone on the machine (each run starts its own local Ray)::

    python -m bench.dataplane --name dataplane --repeats 3

Cases (each with migration support on and off, the two runs of a pair back to back, their order
alternating between repeats; ``--compare chaining``: operator chaining on and off instead):

* ``gen_p1``, ``gen_p2``: the generator (6M events, 1M int keys, Zipf 1.1), unthrottled, p=1, 2;
* ``parquet_p1``, ``parquet_p2``: a Parquet file (5M events, 100k string keys, Zipf 1.1, written
  once from the generator), unthrottled;
* ``gen_p2_map``, ``rate_100k_map`` (not in the default set): ``gen_p2`` and ``rate_100k`` with
  a stateless step (``project``) after the source, both at p=2; chained, each source instance
  and its ``project`` share one actor and the key partitioning runs there. Chaining vs not::

      python -m bench.dataplane --name dataplane_chaining --compare chaining \
          --case gen_p2_map --case rate_100k_map

* ``gen_p2_sink``, ``rate_100k_sink`` (not in the default set): ``gen_p2`` and ``rate_100k``
  with the sink at the count's parallelism (2); chained, each count instance and its sink
  instance share one actor (the count's output is not sent between actors). Chaining vs not::

      python -m bench.dataplane --name dataplane_chained_sink --compare chaining \
          --case gen_p2_sink --case rate_100k_sink

* ``gen_p2_post_map``, ``rate_100k_post_map`` (not in the default set): ``gen_p2_sink`` and
  ``rate_100k_sink`` with a stateless step (``parity``: derives a column from the count) between
  the count and the sink, all three at p=2; chained, each count instance, its ``parity`` and its
  sink instance share one actor. Chaining vs not::

      python -m bench.dataplane --name dataplane_chained_post_map --compare chaining \
          --case gen_p2_post_map --case rate_100k_post_map

* ``gen_p2_no_standby`` (not in the default set): ``gen_p2`` with ``--standby-instances 0``:
  the job with migration support starts no warm standby actors, so the pair shows the per-batch
  cost of migration support alone::

      python -m bench.dataplane --name support_gen --case gen_p2 --case gen_p2_no_standby

* ``long_rate_100k_sink`` (not in the default set): ``rate_100k_sink`` for 24 s (warm-up 8 s):
  the sink's own upkeep (it compacts its table as it grows) shows only in a run this long;
* ``rate_10k``, ``rate_100k``, ``rate_500k``: the generator at that many events/s (open loop,
  10 s of input), p=2: latency weighted per input event, over the whole run and after the
  first 4 s (``latency_steady_ms``: with migration support a job starts its two warm standby
  actors in its first seconds, a one-time cost on 2 cores).

Every run is a ``python -m bench.keycount ... --report`` subprocess whose counts are checked
against the events counted in (it exits 1 otherwise, and so does this). CPU seconds are those of
the whole process tree (driver, Ray's own processes, the job's actors) from the job's start to
its end, per million events counted.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from bench._report import LATENCY_WEIGHTING, write_json

__all__ = ["CASES", "main"]

PARQUET_EVENTS = 5_000_000
PARQUET_KEYS = 100_000
RATE_SECONDS = 10
RATE_WARMUP_S = 4
STEADY_SKIP_S = 1.0

# 24 s at 100k events/s, the first 8 s (the warm standbys starting) left out of the latency
_LONG_RATE_100K = ["--rate", "100000", "--events", "2400000", "--parallelism", "2", "--warmup", "8"]

CASES: dict[str, list[str]] = {
    "gen_p1": ["--events", "6000000", "--parallelism", "1"],
    "gen_p2": ["--events", "6000000", "--parallelism", "2"],
    # gen_p2 without warm standby actors: what migration support costs per batch, without the
    # one-time start of the two standbys a job with it keeps (not in the default set)
    "gen_p2_no_standby": ["--events", "6000000", "--parallelism", "2", "--standby-instances", "0"],
    # gen_p2 with the standbys starting beside the running job (RuntimeConfig's default)
    "gen_p2_standby_after": ["--events", "6000000", "--parallelism", "2", "--standbys-after-start"],
    "parquet_p1": ["--parallelism", "1"],
    "parquet_p2": ["--parallelism", "2"],
    **{
        f"rate_{r // 1000}k": [
            "--rate",
            str(r),
            "--events",
            str(r * RATE_SECONDS),
            "--parallelism",
            "2",
            "--warmup",
            str(RATE_WARMUP_S),
        ]
        for r in (10_000, 100_000, 500_000)
    },
    # a stateless step after the source, both at p=2: what operator chaining changes
    "gen_p2_map": [
        "--events",
        "6000000",
        "--parallelism",
        "2",
        "--source-parallelism",
        "2",
        "--pre-map",
    ],
    "rate_100k_map": [
        "--rate",
        "100000",
        "--events",
        str(100_000 * RATE_SECONDS),
        "--parallelism",
        "2",
        "--warmup",
        str(RATE_WARMUP_S),
        "--source-parallelism",
        "2",
        "--pre-map",
    ],
    # the sink at the count's parallelism: chained to it (one actor per count instance) or not
    "gen_p2_sink": ["--events", "6000000", "--parallelism", "2", "--sink-parallelism", "2"],
    "rate_100k_sink": [
        "--rate",
        "100000",
        "--events",
        str(100_000 * RATE_SECONDS),
        "--parallelism",
        "2",
        "--warmup",
        str(RATE_WARMUP_S),
        "--sink-parallelism",
        "2",
    ],
    # a stateless step after the count, and the sink, both at the count's parallelism: chained
    # to it (one actor per count instance) or not
    "gen_p2_post_map": [
        "--events",
        "6000000",
        "--parallelism",
        "2",
        "--sink-parallelism",
        "2",
        "--post-map",
    ],
    "rate_100k_post_map": [
        "--rate",
        "100000",
        "--events",
        str(100_000 * RATE_SECONDS),
        "--parallelism",
        "2",
        "--warmup",
        str(RATE_WARMUP_S),
        "--sink-parallelism",
        "2",
        "--post-map",
    ],
    # long runs for the cost of migration support in steady state (after its one-time start)
    "long_gen_p2": ["--events", "24000000", "--parallelism", "2"],
    "long_rate_100k": _LONG_RATE_100K,
    # 24 s at 100k events/s with the sink chained to the count: the sink's own upkeep (it
    # compacts its table as it grows) shows in a run this long
    "long_rate_100k_sink": [*_LONG_RATE_100K, "--sink-parallelism", "2"],
}
# seconds of a run left out of steady throughput (long runs: after the warm standby actors,
# which a job with migration support starts in its first seconds, are up)
STEADY_SKIP = {"long_gen_p2": 8.0}
DEFAULT_CASES = [
    c
    for c in CASES
    if not c.startswith("long_") and not c.endswith(("_map", "_sink", "_no_standby"))
]
# what a pair of runs compares: (key, flags) of the first and of the second run of each pair
PAIRS: dict[str, tuple[tuple[str, list[str]], tuple[str, list[str]]]] = {
    "migration-support": (
        ("with_support", ["--migration-support"]),
        ("without_support", ["--no-migration-support"]),
    ),
    "chaining": (("chained", ["--chaining"]), ("unchained", ["--no-chaining"])),
}


def _parquet_input(cache: Path) -> Path:
    """The Parquet input (written once, kept in ``cache``)."""
    import raystream as rs

    path = cache / f"keycount_{PARQUET_EVENTS}_{PARQUET_KEYS}_str.parquet"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        gen = rs.sources.generator(
            events=PARQUET_EVENTS, keys=PARQUET_KEYS, zipf=1.1, seed=0, key_type="str"
        )
        tmp = path.with_suffix(".tmp")
        gen.to_parquet(tmp)
        tmp.rename(path)
    return path


def _run(
    args: list[str], flags: list[str], extra: list[str], keep: Path | None = None
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="raystream-dataplane-") as d:
        report = keep if keep is not None else Path(d) / "report.json"
        cmd = [sys.executable, "-m", "bench.keycount", *args, *extra, "-q", "--report", str(report)]
        cmd += flags
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            msg = f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
            raise click.ClickException(msg)
        return json.loads(report.read_text())


def _steady_eps(timeline: list[list[float]], skip_s: float = STEADY_SKIP_S) -> float | None:
    """Mean events/s of the 250 ms windows after the first ``skip_s`` seconds with events,
    leaving out the last window (the end of input): throughput without the start-up."""
    busy = [row for row in timeline if row[1]]
    if not busy:
        return None
    rows = [row[1] for row in busy[:-1] if row[0] >= busy[0][0] + skip_s]
    return round(statistics.fmean(rows), 1) if len(rows) >= 4 else None


def _figures(r: dict[str, Any], case: str) -> dict[str, Any]:
    steady = r.get("latency_steady_ms") or {}
    return {
        "throughput_eps": r["throughput_eps"],
        "steady_throughput_eps": _steady_eps(r["timeline"], STEADY_SKIP.get(case, STEADY_SKIP_S)),
        "p50_ms": r["latency_ms"]["p50"],
        "p99_ms": r["latency_ms"]["p99"],
        "steady_p50_ms": steady.get("p50"),
        "steady_p99_ms": steady.get("p99"),
        "cpu_s_per_m_events": r.get("cpu_s_per_m_events"),
        "events_in": r["events_in"],
        "elapsed_s": r["elapsed_s"],
        # the benchmark's wall time around the job (rs.start's deploy included) less elapsed_s
        "start_s": round(r["wall_s"] - r["elapsed_s"], 3) if r.get("wall_s") else None,
        # events over that whole wall time (what a user waiting for rs.run sees)
        "throughput_incl_start_eps": round(r["events_in"] / r["wall_s"], 1)
        if r.get("wall_s")
        else None,
    }


def _spread(values: list[float | None]) -> dict[str, float | None]:
    xs = [v for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(xs), 3), "min": min(xs), "max": max(xs)}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = runs[0].keys() - {"events_in", "elapsed_s"}
    return {k: _spread([r[k] for r in runs]) for k in sorted(keys)}


def _neg(x: float | None) -> float | None:
    return None if x is None else round(-x, 1)


def _cost(
    with_: dict[str, Any], without: dict[str, Any], metric: str, higher_is_better: bool
) -> float | None:
    """What migration support costs, in % of the median without it (positive: it costs):
    throughput lost, or latency added."""
    a, b = with_[metric]["median"], without[metric]["median"]
    if not a or not b:
        return None
    return round(((1 - a / b) if higher_is_better else (a / b - 1)) * 100, 1)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--name", default="dataplane", show_default=True, help="Writes bench/results/NAME.json."
)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option(
    "--case",
    "cases",
    multiple=True,
    type=click.Choice(list(CASES)),
    help="Only these cases (repeatable; default all but the long_* ones).",
)
@click.option(
    "--cache",
    type=click.Path(path_type=Path),
    default=Path(tempfile.gettempdir()) / "raystream-bench-cache",
    show_default=True,
    help="Where the Parquet input is written once.",
)
@click.option(
    "--keep-reports",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Also keep every run's own report (timeline included) in this directory.",
)
@click.option("--label", default="", help="Free text stored in the result (e.g. the commit).")
@click.option(
    "--compare",
    type=click.Choice(list(PAIRS)),
    default="migration-support",
    show_default=True,
    help="What each pair of runs differs in: migration support on/off, or chaining on/off.",
)
def main(
    name: str,
    repeats: int,
    cases: tuple[str, ...],
    cache: Path,
    keep_reports: Path | None,
    label: str,
    compare: str,
) -> None:
    """Key-count data-plane matrix; writes bench/results/NAME.json."""
    chosen = list(cases) or DEFAULT_CASES
    parquet = _parquet_input(cache) if any(c.startswith("parquet") for c in chosen) else None
    pair = PAIRS[compare]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        c: {key: [] for key, _ in pair} for c in chosen
    }
    t0 = time.time()
    for rep in range(repeats):
        for case in chosen:
            extra = ["--input", str(parquet)] if case.startswith("parquet") else []
            order = list(pair) if (rep % 2 == 0) else list(reversed(pair))
            for key, flags in order:
                keep = None
                if keep_reports is not None:
                    keep_reports.mkdir(parents=True, exist_ok=True)
                    keep = keep_reports / f"{name}_{case}_{key}_{rep + 1}.json"
                r = _run(CASES[case], flags, extra, keep)
                runs[case][key].append(_figures(r, case))
                f = runs[case][key][-1]
                click.echo(
                    f"[{time.time() - t0:6.0f}s] {case:<11} {key:<15} rep {rep + 1}: "
                    f"{f['throughput_eps']:>11,.0f} ev/s (steady {f['steady_throughput_eps']})  "
                    f"p99 {f['p99_ms']} ms  steady p99 {f['steady_p99_ms']} ms  "
                    f"{f['cpu_s_per_m_events']} CPU-s/M"
                )
        _write(name, label, chosen, runs, t0, done=rep + 1, compare=compare)  # kept if one fails
    click.echo(f"wrote bench/results/{name}.json")


def _write(
    name: str,
    label: str,
    chosen: list[str],
    runs: dict[str, dict[str, list[dict[str, Any]]]],
    t0: float,
    done: int,
    compare: str = "migration-support",
) -> None:
    first, second = (key for key, _ in PAIRS[compare])
    out: dict[str, Any] = {
        "benchmark": "dataplane",
        "compare": compare,
        "pair": {key: " ".join(flags) for key, flags in PAIRS[compare]},
        "label": label,
        "repeats": done,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "wall_s": round(time.time() - t0, 1),
        "cpus": os.cpu_count(),
        "latency_weighting": LATENCY_WEIGHTING,
        "throughput": "events into the count step per second of the job's run (all instances)",
        "steady_throughput": (
            f"mean events/s of the 250 ms windows after the first {STEADY_SKIP_S:g} s with "
            f"events ({', '.join(f'{c}: {v:g} s' for c, v in STEADY_SKIP.items())}), the last "
            "window left out (no start-up: with migration support a job also starts its warm "
            "standby actors in its first seconds)"
        ),
        "cpu": "CPU seconds of the whole process tree (driver, Ray, actors) per million events",
        "cases": {
            c: " ".join(CASES[c]) + (" --input <parquet>" if c.startswith("parquet") else "")
            for c in chosen
        },
        "results": {},
    }
    for case in chosen:
        res: dict[str, Any] = {}
        for key in (first, second):
            res[key] = {"summary": _summary(runs[case][key]), "runs": runs[case][key]}
        w = res[first]["summary"]
        wo = res[second]["summary"]
        if compare == "chaining":  # what chaining gains against the same job unchained
            res["chaining_gain_pct"] = {
                "throughput": _neg(_cost(w, wo, "throughput_eps", True)),
                "steady_throughput": _neg(_cost(w, wo, "steady_throughput_eps", True)),
                "p99": _neg(_cost(w, wo, "p99_ms", False)),
                "cpu_per_event": _neg(_cost(w, wo, "cpu_s_per_m_events", False)),
            }
            out["results"][case] = res
            continue
        res["support_cost_pct"] = {
            "throughput": _cost(w, wo, "throughput_eps", True),
            "steady_throughput": _cost(w, wo, "steady_throughput_eps", True),
            "p99": _cost(w, wo, "p99_ms", False),
            "steady_p99": _cost(w, wo, "steady_p99_ms", False),
        }
        out["results"][case] = res
    path = Path("bench/results") / f"{name}.json"
    write_json(path, out)


if __name__ == "__main__":
    main()
