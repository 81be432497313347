"""Per-run figures of moves and rescales, before and after a change of the seal, as one JSON file.

For ``bench.reconfigure`` reports of a move (``--moves LABEL=GLOB``), per run: the steady p99 (the
window before the move), the peak (the largest latency from the move's start until 2 s after its
end) and their ratio, the old owner's wait for its fence after it had read the changed rows
(``files.fence_wait_ms``), the p50 wait of the moved instance's records for their state
(``phases_s.record_wait_ms``) and the milliseconds from the old owner's seal to the last state's
arrival. For ``bench.compare_strategies`` reports (``--rescales LABEL=GLOB``, one strategy), per
run: the peak in the rescale window (until latency is back, or the end of the run), the peak from
the request until 2 s after the state settled (the change itself; the window may run on for
seconds), the steady p99, the longest fence (``fence_ms``) and the seconds the state took. Every
latency is the sink's, weighted per input event. Each figure: its runs, median, min and max.

    python -m bench.fence_summary --moves "before=bench/results/reconfigure_100mb_move_fence_base_run*.json" \\
        --moves "after=bench/results/reconfigure_100mb_move_fence_run*.json" \\
        --rescales "before=bench/results/compare_fence_base_meces*.json" \\
        --rescales "after=bench/results/compare_fence_meces*.json" \\
        --report bench/results/fence_summary.json
"""

from __future__ import annotations

import glob
import json
import statistics
from pathlib import Path
from typing import Any

import click

NEAR_S = 2.0  # the change itself: from its request until this long after its state settled


def _spread(values: list[float | None]) -> dict[str, Any]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"runs": values, "median": None, "min": None, "max": None}
    return {
        "runs": values,
        "median": round(statistics.median(vals), 2),
        "min": round(min(vals), 2),
        "max": round(max(vals), 2),
    }


def _files(pattern: str) -> list[str]:
    files = sorted(glob.glob(pattern))
    if not files:
        msg = f"no report matches {pattern!r}"
        raise click.BadParameter(msg)
    return files


def move_figures(files: list[str]) -> dict[str, Any]:
    rows: dict[str, list[Any]] = {
        k: []
        for k in (
            "steady_p99_ms",
            "peak_ms",
            "peak_over_steady_p99",
            "fence_wait_ms",
            "record_wait_p50_ms",
            "seal_to_arrived_ms",
        )
    }
    exact = 0
    for f in files:
        data = json.loads(Path(f).read_text())
        exact += bool(data.get("exact"))
        (move,) = [c for c in data["changes"] if c["kind"] == "move"]
        phases = move.get("phases_s", {})
        rows["steady_p99_ms"].append(move["before"]["p99_ms"])
        rows["peak_ms"].append(move["during"]["max_ms"])
        rows["peak_over_steady_p99"].append(move["peak_over_steady_p99"])
        rows["fence_wait_ms"].append(move.get("files", {}).get("fence_wait_ms"))
        rows["record_wait_p50_ms"].append((phases.get("record_wait_ms") or {}).get("p50"))
        sealed, arrived = phases.get("sealed"), phases.get("all_arrived")
        rows["seal_to_arrived_ms"].append(
            None if sealed is None or arrived is None else round((arrived - sealed) * 1000, 1)
        )
    out = {k: _spread(v) for k, v in rows.items()}
    out["files"] = files
    out["exact_runs"] = f"{exact}/{len(files)}"
    out["within_2x"] = f"{sum(r <= 2.0 for r in rows['peak_over_steady_p99'])}/{len(files)}"
    return out


def rescale_figures(files: list[str]) -> dict[str, Any]:
    rows: dict[str, list[Any]] = {
        k: []
        for k in (
            "window_peak_ms",
            "change_peak_ms",
            "steady_p99_ms",
            "fence_ms",
            "state_moved_s",
        )
    }
    exact = runs = 0
    for f in files:
        data = json.loads(Path(f).read_text())
        for strategy_runs in data["runs"].values():
            for run in strategy_runs:
                runs += 1
                exact += not (run.get("exact") or {}).get("keys_differing", 1)
                r = run["rescales"][0]
                t0, t1 = r["start_s"], r["end_s"] + NEAR_S
                near = [w[4] for w in run["timeline"] if t0 <= w[0] + 0.25 and w[0] < t1]
                rows["window_peak_ms"].append(r.get("window_peak_latency_ms"))
                rows["change_peak_ms"].append(max(near) if near else None)
                rows["steady_p99_ms"].append(r.get("steady_p99_ms"))
                rows["fence_ms"].append(r.get("fence_ms"))
                rows["state_moved_s"].append(r.get("duration_s"))
    out = {k: _spread(v) for k, v in rows.items()}
    out["files"] = files
    out["exact_runs"] = f"{exact}/{runs}"
    return out


def _labelled(values: tuple[str, ...]) -> list[tuple[str, str]]:
    out = []
    for v in values:
        label, sep, pattern = v.partition("=")
        if not sep or not label or not pattern:
            msg = f"expected LABEL=GLOB, got {v!r}"
            raise click.BadParameter(msg)
        out.append((label, pattern))
    return out


@click.command()
@click.option("--moves", multiple=True, help="LABEL=GLOB of bench.reconfigure reports (a move)")
@click.option("--rescales", multiple=True, help="LABEL=GLOB of bench.compare_strategies reports")
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), required=True)
def main(moves: tuple[str, ...], rescales: tuple[str, ...], report: Path) -> None:
    data = {
        "what": __doc__.split("\n\n")[0].strip() if __doc__ else "",
        "moves": {label: move_figures(_files(p)) for label, p in _labelled(moves)},
        "rescales": {label: rescale_figures(_files(p)) for label, p in _labelled(rescales)},
    }
    report.write_text(json.dumps(data, indent=1) + "\n")
    for kind in ("moves", "rescales"):
        for label, figs in data[kind].items():
            line = ", ".join(
                f"{k} {v['median']} ({v['min']}-{v['max']})"
                for k, v in figs.items()
                if isinstance(v, dict)
            )
            click.echo(f"{kind} {label}: {line}; exact {figs['exact_runs']}")


if __name__ == "__main__":
    main()
