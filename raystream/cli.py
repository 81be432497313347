"""``raystream`` command line: run a job file, and status / rescale / stop a running job by name.

    raystream run examples/keycount_job.py --parallelism count=2
    raystream submit examples/keycount_job.py -p count=2 --address http://127.0.0.1:8265
    raystream status keycount
    raystream rescale keycount count 4 --strategy meces
    raystream update keycount count mypackage.ops:count_v2
    raystream move keycount count 0 <node id>
    raystream insert keycount source mypackage.ops:drop_test_keys --name drop_test
    raystream remove keycount drop_test
    raystream stop keycount
    raystream demo

``status``, ``rescale``, ``update``, ``move`` and ``stop`` connect to the Ray cluster in
``RAY_ADDRESS`` (its GCS address HOST:PORT), else to the one already running on this machine
(``address="auto"``), and find the job's controller by name. ``submit`` talks to the cluster's
job server (dashboard, HTTP).
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from typing import Any

import click

__all__ = ["main"]


def _connect() -> None:
    from raystream.cluster import connect
    from raystream.runtime.actors import NAMESPACE

    connect(namespace=NAMESPACE)


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
@click.option(
    "--autoscaler",
    default=None,
    help="let the controller choose the keyed steps' parallelism: ds2, threshold, schedule, "
    "fixed, or module:attr (a policy in your job's folder)",
)
@click.option(
    "--checkpoint-interval",
    "checkpoint_interval_s",
    type=float,
    default=None,
    help="take a checkpoint every S seconds and recover from the latest after a failure",
)
@click.option(
    "--checkpoint-dir",
    default=None,
    help="where checkpoints go: a path or a pyarrow.fs URI (s3://, gs://, hdfs://, file://)",
)
@click.option(
    "--from-checkpoint",
    default=None,
    help="resume from this job's checkpoints: 'latest' or a checkpoint id",
)
@click.option("--from-savepoint", default=None, help="resume from a savepoint folder")
def run(
    job_file: str,
    parallelism: tuple[str, ...],
    flow_name: str | None,
    strategy: str,
    autoscaler: str | None,
    checkpoint_interval_s: float | None,
    checkpoint_dir: str | None,
    from_checkpoint: str | None,
    from_savepoint: str | None,
) -> None:
    """Run JOB_FILE (a Python file that builds a Dataflow) until its sources are exhausted."""
    import raystream as rs

    flow = _load_flow(job_file, flow_name)
    checkpoints: dict[str, Any] = {}
    if checkpoint_interval_s is not None:
        checkpoints["checkpoint_interval_s"] = checkpoint_interval_s
    if checkpoint_dir is not None:
        checkpoints["checkpoint_dir"] = checkpoint_dir
    result = rs.run(
        flow,
        parallelism=_parallelism(parallelism) or None,
        migration=strategy,
        autoscaler=autoscaler,
        from_checkpoint=from_checkpoint,
        from_savepoint=from_savepoint,
        **checkpoints,
    )
    for r in result.recoveries:
        click.echo(
            f"recovered t={r['at_s']:.1f}s from checkpoint {r['checkpoint_id']} after "
            f"{r['instance'][0]}/{r['instance'][1]} failed ({r['cause'].splitlines()[0][:120]}): "
            f"down {r['downtime_s']:.2f} s, {r['records_replayed']:,} records replayed"
        )
    ck = result.checkpoints
    if ck.get("completed") or ck.get("failed"):
        click.echo(f"checkpoints: {ck['completed']} completed, {ck['failed']} failed ({ck['storage']})")
    for d in result.autoscaling:
        if d.get("to") != d.get("from"):  # a rescale (holds and warnings are in the log)
            click.echo(
                f"autoscaler t={d.get('t_s', 0):.1f}s {d.get('operator', '')} "
                f"{d.get('from')} -> {d.get('to')}: {d.get('reason', '')}"[:300]
            )
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
    """Operators of the running JOB: parallelism, records, rate, busy, backlog, latency."""
    from rich.console import Console
    from rich.table import Table

    import raystream as rs
    from raystream.status_view import RATE_WINDOW_S, operator_rows

    _connect()
    st = rs.attach(job).status()
    rows = operator_rows(st)
    if as_json:
        click.echo(json.dumps({**st, "operators": rows}, default=str, indent=1))
        return
    title = f"job {st['job']!r}: {st['state']}"
    if st.get("rescaling"):
        title += ", rescaling"
    table = Table(title=title)
    columns = {
        "operator": "operator",
        "parallelism": "parallelism",
        "records_in": "records in",
        "records_out": "records out",
        "rate_in_per_s": "in/s",
        "busy_pct": "busy %",
        "backlog": "backlog",
        "latency_p50_ms": "p50 ms",
        "latency_p99_ms": "p99 ms",
        "migration": "migration",
    }
    for key, header in columns.items():
        table.add_column(header, justify="left" if key in ("operator", "migration") else "right")
    for r in rows:
        table.add_row(
            r["operator"],
            str(r["parallelism"]),
            f"{r['records_in']:,}",
            f"{r['records_out']:,}",
            f"{r['rate_in_per_s']:,.0f}",
            f"{r['busy_pct']:.1f}",
            f"{r['backlog']:,}",
            "" if r["latency_p50_ms"] is None else f"{r['latency_p50_ms']:g}",
            "" if r["latency_p99_ms"] is None else f"{r['latency_p99_ms']:g}",
            r["migration"],
        )
    console = Console(width=max(Console().width, 120))
    console.print(table)
    for r in rows:
        if r["nodes"]:
            console.print(f"{r['operator']} runs on (node ip/id: instances): {r['nodes']}")
    console.print(
        f"in/s: records in per second over the last {RATE_WINDOW_S:g} s; busy %: share of time "
        "spent processing since the instances started; p50/p99: sink end-to-end latency"
    )
    ck = st.get("checkpoints") or {}
    if ck.get("completed") or ck.get("failed"):
        last = ck.get("last") or {}
        console.print(
            f"checkpoints: {ck['completed']} completed, {ck['failed']} failed; last "
            f"{last.get('checkpoint_id')} took {last.get('duration_s', 0):.2f} s "
            f"({last.get('uploaded_bytes', 0):,} bytes uploaded)"
        )
    if st.get("graph_version") is not None:
        graph = ", ".join(
            f"{g['step']} ({g['kind']} {g['function']})"
            for g in st.get("graph") or []
            if g["kind"] not in ("source", "sink")
        )
        console.print(f"graph version {st['graph_version']}: {graph}")
    for c in st.get("reconfigurations") or []:
        peak = c.get("peak_latency_ms")
        moved = ", ".join(f"{k} {v:,}" for k, v in (c.get("moved") or {}).items())
        console.print(
            f"{c['kind']} {c['step']!r} at epoch {c['epoch']}: t={c['start_s']:.1f}-"
            f"{c['end_s']:.1f}s, {c['change']}; moved: {moved or 'nothing'}"
            + ("" if peak is None else f"; peak latency {peak:g} ms")
        )
    for r in st.get("recoveries") or []:
        console.print(
            f"recovery {r['attempt']}: t={r['at_s']:.1f}s {r['instance']} failed; restarted from "
            f"checkpoint {r['checkpoint_id']}, down {r['downtime_s']:.2f} s, "
            f"{r['records_replayed']:,} records replayed"
        )
    if st.get("latency"):
        lat = st["latency"]
        console.print(
            f"end-to-end latency (all sinks, whole run): p50 {lat['p50_ms']} ms  "
            f"p99 {lat['p99_ms']} ms  max {lat['max_ms']} ms"
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
@click.argument("step")
@click.argument("operator")
@click.option(
    "--migrate-state",
    default=None,
    help="module:attr of a function old state value -> new value (a changed state form)",
)
def update(job: str, step: str, operator: str, migrate_state: str | None) -> None:
    """Replace the function of STEP of the running JOB by OPERATOR (module:attr of an operator
    made with @rs.map, @rs.keyed, ...). It takes over at a barrier; keyed state is kept."""
    import raystream as rs
    from raystream.reconfigure import load_object

    op = load_object(operator)  # refused here, before connecting, when it does not import
    migrate = load_object(migrate_state, "state migration function") if migrate_state else None
    _connect()
    rec = rs.attach(job).replace(step, op, migrate_state=migrate)
    click.echo(
        f"replaced the function of {step!r} at epoch {rec['epoch']} in {rec['duration_s']:.2f} s: "
        f"{rec['change']} (graph version {rec['graph_version']}, "
        f"{rec['moved'].get('migrated_state_rows', 0):,} state rows migrated)"
    )


@main.command()
@click.argument("job")
@click.argument("step")
@click.argument("index", type=int)
@click.argument("node_id")
def move(job: str, step: str, index: int, node_id: str) -> None:
    """Move instance INDEX of keyed STEP of the running JOB to the node NODE_ID (Ray node id, as
    `raystream status` shows): a new actor there takes over its key groups, the old one retires."""
    import raystream as rs

    _connect()
    rec = rs.attach(job).move(step, index, node_id)
    moved = rec["moved"]
    click.echo(
        f"moved {step!r}/{index} at epoch {rec['epoch']} in {rec['duration_s']:.2f} s: "
        f"{rec['change']}; {moved['key_groups']} key groups, {moved['bytes']:,} bytes, "
        f"{moved['on_demand_fetches']} on-demand fetches"
    )


@main.command()
@click.argument("job")
@click.argument("after")
@click.argument("operator")
@click.option("--name", default=None, help="name of the new step (default: the operator's)")
@click.option("--parallelism", default=1, show_default=True, type=int)
@click.option("--before", default=None, help="the downstream step, if AFTER feeds several")
def insert(
    job: str, after: str, operator: str, name: str | None, parallelism: int, before: str | None
) -> None:
    """Put the stateless OPERATOR (module:attr) as a new step after step AFTER of the running
    JOB; records after the barrier go through it."""
    import raystream as rs
    from raystream.reconfigure import load_object

    op = load_object(operator)
    _connect()
    rec = rs.attach(job).insert(after, op, name=name, parallelism=parallelism, before=before)
    click.echo(
        f"inserted at epoch {rec['epoch']}: {rec['change']} (graph version "
        f"{rec['graph_version']})"
    )


@main.command()
@click.argument("job")
@click.argument("step")
def remove(job: str, step: str) -> None:
    """Take stateless STEP out of the running JOB at a barrier."""
    import raystream as rs

    _connect()
    rec = rs.attach(job).remove(step)
    click.echo(
        f"removed at epoch {rec['epoch']}: {rec['change']} (graph version "
        f"{rec['graph_version']})"
    )


@main.command()
@click.argument("job")
def stop(job: str) -> None:
    """Stop the running JOB with a final checkpoint: sinks publish what came before it, and
    `raystream run FILE --from-checkpoint latest` resumes from it. `cancel` stops at once."""
    import raystream as rs

    _connect()
    result = rs.attach(job).stop()
    if result is None:  # its driver saw the end first and removed the controller
        click.echo(f"job {job!r} stopped")
        return
    last = result.checkpoints.get("last") or {}
    final = f" after final checkpoint {last['checkpoint_id']}" if last else ""
    click.echo(f"job {result.job!r} {result.state}{final}")


@main.command()
@click.argument("job")
def cancel(job: str) -> None:
    """Stop the running JOB at once, without a final checkpoint (unpublished output dropped)."""
    import raystream as rs

    _connect()
    result = rs.attach(job).cancel()
    click.echo(f"job {job!r} {'cancelled' if result is None else result.state}")


@main.command()
@click.argument("job")
@click.argument("path")
def savepoint(job: str, path: str) -> None:
    """Take a savepoint of the running JOB into PATH (a folder or pyarrow.fs URI); resume with
    `raystream run FILE --from-savepoint PATH` (at any parallelism)."""
    import raystream as rs

    _connect()
    sp = rs.attach(job).savepoint(path)
    click.echo(
        f"savepoint of checkpoint {sp['checkpoint_id']} at {sp['savepoint']} "
        f"({sp['duration_s']:.2f} s)"
    )


def _env_vars(values: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for v in values:
        key, sep, value = v.partition("=")
        if not sep or not key:
            msg = f"--env takes KEY=VALUE (e.g. RAYSTREAM_OUT=/data/out), got {v!r}"
            raise click.BadParameter(msg)
        out[key] = value
    return out


@main.command()
@click.argument("job_file")
@click.option("--parallelism", "-p", multiple=True, help="STEP=N, repeatable")
@click.option(
    "--address",
    default=None,
    help="the cluster's job server (dashboard); default RAY_API_SERVER_ADDRESS, an http:// "
    "RAY_ADDRESS, else http://127.0.0.1:8265",
)
@click.option("--env", "env", multiple=True, help="KEY=VALUE set for the job, repeatable")
@click.option("--strategy", default=None, help="migration strategy for rescales")
@click.option("--autoscaler", default=None, help="ds2, threshold, schedule, fixed or module:attr")
@click.option("--checkpoint-interval", "checkpoint_interval_s", type=float, default=None)
@click.option("--checkpoint-dir", default=None, help="a path or URI the cluster can write")
@click.option("--from-checkpoint", default=None)
@click.option("--from-savepoint", default=None)
@click.option("--no-wait", is_flag=True, help="return once submitted; do not follow the log")
@click.option("--timeout", "timeout_s", type=float, default=None, help="give up waiting after s")
def submit(
    job_file: str,
    parallelism: tuple[str, ...],
    address: str | None,
    env: tuple[str, ...],
    strategy: str | None,
    autoscaler: str | None,
    checkpoint_interval_s: float | None,
    checkpoint_dir: str | None,
    from_checkpoint: str | None,
    from_savepoint: str | None,
    no_wait: bool,
    timeout_s: float | None,
) -> None:
    """Submit JOB_FILE to a running Ray cluster (Ray job submission, token auth) and follow it.

    The job file's folder becomes the job's working directory; the cluster runs
    `python -m raystream run <file>`. Exits non-zero if the job fails.
    """
    from raystream.submit import Submission, check_job_file, dashboard_address, wait_for_job
    from raystream.submit import submit as do_submit

    run_args: list[str] = []
    for flag, value in (
        ("--checkpoint-interval", checkpoint_interval_s),
        ("--checkpoint-dir", checkpoint_dir),
        ("--from-checkpoint", from_checkpoint),
        ("--from-savepoint", from_savepoint),
    ):
        if value is not None:
            run_args += [flag, str(value)]
    sub = Submission(
        check_job_file(job_file),
        _parallelism(parallelism),
        _env_vars(env),
        strategy,
        autoscaler,
        tuple(run_args),
    )
    target = dashboard_address(address)
    client, sid = do_submit(sub, target)
    click.echo(f"submitted {sub.job_file.name} to {target} as Ray job {sid}")
    click.echo(f"  entrypoint: {sub.entrypoint()}  (working dir {sub.working_dir})")
    if no_wait:
        click.echo(f"follow it with: ray job logs --address {target} --follow {sid}")
        return
    status = wait_for_job(client, sid, echo=click.echo, timeout_s=timeout_s)
    click.echo(f"Ray job {sid} {status}")


@main.command()
def demo() -> None:
    """Key-count on local Ray with a live rescale, checked against numpy."""
    from raystream.demo import main as demo_main

    demo_main()
