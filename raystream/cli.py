"""``raystream`` command line: run a job file, and status / rescale / stop a running job by name.

    raystream run examples/keycount_job.py --parallelism count=2
    raystream status keycount
    raystream rescale keycount count 4 --strategy meces
    raystream stop keycount
    raystream demo

``status``, ``rescale`` and ``stop`` connect to the Ray cluster in ``RAY_ADDRESS``, else to the one
already running on this machine (``address="auto"``), and find the job's controller by name.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

import click

__all__ = ["main"]


def _connect() -> None:
    import ray

    from raystream.errors import JobNotFoundError
    from raystream.runtime.actors import NAMESPACE

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="error")
    except (ConnectionError, RuntimeError) as e:
        msg = (
            f"cannot reach a Ray cluster at {address!r} ({e}). Start the job first "
            "(`raystream run job.py`, or `ray start --head` and `raystream submit`), or set "
            "RAY_ADDRESS to the cluster's address."
        )
        raise JobNotFoundError(msg) from None


def _parallelism(values: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        step, sep, p = v.partition("=")
        if not sep or not p.isdigit():
            msg = f"--parallelism takes STEP=N (e.g. count=2), got {v!r}"
            raise click.BadParameter(msg)
        out[step] = int(p)
    return out


def _load_flow(path: str, flow_name: str | None) -> Any:
    from raystream.dataflow import Dataflow

    file = Path(path)
    if not file.is_file():
        msg = f"no job file {path!r}; expected a Python file that builds a raystream Dataflow"
        raise click.BadParameter(msg)
    sys.path.insert(0, str(file.parent.resolve()))
    namespace = runpy.run_path(str(file), run_name="__raystream_job__")
    flows = {v.name: v for v in namespace.values() if isinstance(v, Dataflow)}
    if flow_name:
        if flow_name not in flows:
            msg = f"{path} defines dataflows {sorted(flows)}, not {flow_name!r}"
            raise click.BadParameter(msg)
        return flows[flow_name]
    if len(flows) != 1:
        msg = f"{path} must define exactly one Dataflow at module level (found {sorted(flows)}); pick one with --flow"
        raise click.BadParameter(msg)
    return next(iter(flows.values()))


class _RaystreamError(click.ClickException):
    exit_code = 2


class _Group(click.Group):
    """Turns raystream's own errors (also when Ray wraps them) into a one-line message, exit 2."""

    def invoke(self, ctx: click.Context) -> Any:
        from raystream.errors import RaystreamError

        try:
            return super().invoke(ctx)
        except RaystreamError as e:
            lines = [line for line in str(e).strip().splitlines() if line.strip()]
            raise _RaystreamError(lines[-1] if lines else type(e).__name__) from None


@click.group(cls=_Group)
def main() -> None:
    """raystream: elastic, stateful stream processing on Ray."""


@main.command()
@click.argument("job_file")
@click.option("--parallelism", "-p", multiple=True, help="STEP=N, repeatable")
@click.option("--flow", "flow_name", default=None, help="which Dataflow of the file to run")
@click.option(
    "--strategy", default="meces", show_default=True, help="migration strategy for rescales"
)
def run(job_file: str, parallelism: tuple[str, ...], flow_name: str | None, strategy: str) -> None:
    """Run JOB_FILE (a Python file that builds a Dataflow) until its sources are exhausted."""
    import raystream as rs

    flow = _load_flow(job_file, flow_name)
    result = rs.run(flow, parallelism=_parallelism(parallelism) or None, migration=strategy)
    lat = result.latency()
    click.echo(f"job {result.job!r} {result.state} in {result.elapsed_s:.2f} s")
    if lat is not None:
        s = lat.summary()
        click.echo(f"latency p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms, max {s['max_ms']} ms")
    for sink, parts in result.results.items():
        click.echo(f"sink {sink!r}: {parts}"[:400])


@main.command()
@click.argument("job")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def status(job: str, as_json: bool) -> None:
    """Operators, parallelism, rates, backlog and latency of the running JOB."""
    from rich.console import Console
    from rich.table import Table

    import raystream as rs

    _connect()
    st = rs.attach(job).status()
    if as_json:
        click.echo(json.dumps(st, default=str, indent=1))
        return
    table = Table(title=f"job {st['job']!r}: {st['state']}, parallelism {st['parallelism']}")
    for col in (
        "step",
        "index",
        "records in",
        "records out",
        "busy s",
        "rate in/s",
        "backlog",
        "migration",
    ):
        table.add_column(col)
    for m in sorted(st["instances"], key=lambda m: (m.get("step", ""), m.get("index", 0))):
        up = max(m.get("uptime_s", 0.0), 1e-9)
        mig = m.get("migration")
        table.add_row(
            str(m.get("step")),
            str(m.get("index")),
            f"{m.get('records_in', 0):,}",
            f"{m.get('records_out', 0):,}",
            f"{m.get('busy_s', 0):.2f}",
            f"{m.get('records_in', 0) / up:,.0f}",
            str(m.get("backlog", 0)),
            ""
            if not mig
            else ("done" if mig.get("done") else f"{mig.get('arrived')}/{mig.get('incoming')} in"),
        )
    console = Console()
    console.print(table)
    if st.get("latency"):
        lat = st["latency"]
        console.print(
            f"latency p50 {lat['p50_ms']} ms  p99 {lat['p99_ms']} ms  max {lat['max_ms']} ms"
        )


@main.command()
@click.argument("job")
@click.argument("step")
@click.argument("parallelism", type=int)
@click.option(
    "--strategy",
    default=None,
    help="meces (default), all_at_once, fluid, batched, lazy, stop_restart, or module:attr",
)
def rescale(job: str, step: str, parallelism: int, strategy: str | None) -> None:
    """Change the parallelism of keyed STEP of the running JOB to PARALLELISM."""
    import raystream as rs

    _connect()
    stats = rs.attach(job).rescale(step, parallelism, strategy)
    click.echo(
        f"rescaled {step!r} {stats['from']} -> {stats['to']} with {stats['strategy']} in "
        f"{stats['duration_s']:.2f} s: moved {stats['moved_key_groups']} key groups, "
        f"{stats['moved_bytes']:,} bytes, {stats['on_demand_fetches']} on-demand fetches"
    )


@main.command()
@click.argument("job")
def stop(job: str) -> None:
    """Stop the running JOB (its instances are killed; sinks abort their partial files)."""
    import raystream as rs

    _connect()
    result = rs.attach(job).stop()
    click.echo(f"job {result.job!r} {result.state}")


@main.command()
def demo() -> None:
    """Key-count on local Ray with a live rescale, checked against numpy."""
    from raystream.demo import main as demo_main

    demo_main()
