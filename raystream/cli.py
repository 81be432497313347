"""``raystream`` command line: run a job file, and list / status / rescale / stop running jobs.

    raystream run examples/keycount_job.py --parallelism count=2
    raystream submit examples/keycount_job.py -p count=2 --address http://127.0.0.1:8265
    raystream list --address 127.0.0.1:6379
    raystream status keycount --watch
    raystream rescale keycount count 4 --strategy meces
    raystream update keycount count mypackage.ops:count_v2
    raystream move keycount count 0 <node id>
    raystream insert keycount source mypackage.ops:drop_test_keys --name drop_test
    raystream remove keycount drop_test
    raystream insert keycount source mypackage.ops:tally --name tally --key-by key
    raystream remove keycount tally --state emit
    raystream state examples/keycount_job.py count --checkpoint-dir /tmp/chk --key 42
    raystream stop keycount
    raystream --version

``list``, ``status``, ``rescale``, ``update``, ``move``, ``insert``, ``remove``, ``stop``,
``cancel`` and ``savepoint`` connect to the Ray
cluster at ``--address`` (its GCS address HOST:PORT), else ``RAY_ADDRESS``, else the one already
running on this machine (``"auto"``), and find a job's controller by name. ``submit`` talks to the
cluster's job server (dashboard, HTTP). ``run`` starts a local Ray unless given ``--address``.

Exit codes: 0 success, 1 the job failed (its error and traceback on stderr), 2 a usage error
(a bad option, an unknown job, an unreachable cluster).
"""

from __future__ import annotations

import json
import runpy
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

__all__ = ["main"]

JOB_FAILED = 1  # exit code: the job failed
USAGE = 2  # exit code: a usage error (click's own, and raystream's other errors)

ADDRESS_HELP = (
    "the Ray cluster's GCS address HOST:PORT (what `ray start --head` prints); default "
    "RAY_ADDRESS, else the cluster running on this machine"
)


def address_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--address", default=None, metavar="HOST:PORT", help=ADDRESS_HELP)(f)


def _connect(address: str | None = None) -> None:
    from raystream.cluster import connect
    from raystream.runtime.actors import NAMESPACE

    connect(address, namespace=NAMESPACE)


def _parallelism(values: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        step, sep, p = v.partition("=")
        if not sep or not p.isdigit():
            msg = f"--parallelism takes STEP=N (e.g. count=2), got {v!r}"
            raise click.BadParameter(msg)
        out[step] = int(p)
    return out


def _load_object(spec: str, what: str = "operator") -> Any:
    """The object at ``module:attr``, importable from the current directory too (as with
    ``python -m`` or ``uvicorn module:app``); refused before connecting when it does not
    import."""
    from raystream.reconfigure import load_object

    here = str(Path.cwd())
    if here not in sys.path:
        sys.path.insert(0, here)
    return load_object(spec, what)


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
        msg = (
            f"{path} must define exactly one Dataflow at module level (found {sorted(flows)}); "
            "pick one with --flow"
        )
        raise click.BadParameter(msg)
    return next(iter(flows.values()))


class _RaystreamError(click.ClickException):
    exit_code = USAGE


class _JobFailed(click.ClickException):
    exit_code = JOB_FAILED


def error_exit(e: BaseException) -> click.ClickException:
    """The CLI's exception for a raystream error: exit 1 with the full message (traceback
    included) for a failed job, exit 2 with the message for anything else. Ray's wrapper of an
    error raised in an actor is unwrapped to the error itself."""
    from raystream.errors import JobFailedError, RaystreamError

    cause = getattr(e, "cause", None)  # ray.exceptions.RayTaskError around ours
    if isinstance(cause, RaystreamError):
        e = cause
    text = str(e).strip() or type(e).__name__
    if isinstance(e, JobFailedError):
        return _JobFailed(text)
    return _RaystreamError(text)


class _Group(click.Group):
    """Turns raystream's own errors (also when Ray wraps them) into a message and an exit code:
    1 for a failed job, 2 for everything else."""

    def invoke(self, ctx: click.Context) -> Any:
        from raystream.errors import RaystreamError

        try:
            return super().invoke(ctx)
        except RaystreamError as e:
            raise error_exit(e) from None


@click.group(cls=_Group)
@click.version_option(package_name="raystream", prog_name="raystream")
def main() -> None:
    """raystream: elastic, stateful stream processing on Ray.

    Exit codes: 0 success, 1 the job failed, 2 a usage error."""


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
@click.option(
    "--chaining/--no-chaining",
    default=True,
    show_default=True,
    help="operator chaining: steps joined by a forward edge at equal parallelism share an actor",
)
@click.option(
    "--address",
    default=None,
    metavar="HOST:PORT",
    help="run on the Ray cluster at this GCS address (this process is the job's driver); "
    "default RAY_ADDRESS, else a new local Ray",
)
@click.option(
    "--progress-interval",
    "progress_s",
    type=float,
    default=2.0,
    show_default=True,
    help="seconds between progress lines on stderr (0: none)",
)
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
    chaining: bool,
    address: str | None,
    progress_s: float,
) -> None:
    """Run JOB_FILE (a Python file that builds a Dataflow) until its sources are exhausted,
    with a progress line every few seconds and a summary at the end. Exits 1 if the job fails
    (its error and traceback on stderr)."""
    import raystream as rs

    if progress_s < 0:
        msg = f"--progress-interval takes seconds >= 0, got {progress_s}"
        raise click.BadParameter(msg)
    flow = _load_flow(job_file, flow_name)
    checkpoints: dict[str, Any] = {}
    if checkpoint_interval_s is not None:
        checkpoints["checkpoint_interval_s"] = checkpoint_interval_s
    if checkpoint_dir is not None:
        checkpoints["checkpoint_dir"] = checkpoint_dir
    if address:  # (without it, rs.start connects to RAY_ADDRESS or starts a local Ray)
        from raystream.cluster import connect
        from raystream.runtime.actors import NAMESPACE

        connect(address, namespace=NAMESPACE, log_to_driver=True)
    job = rs.start(
        flow,
        parallelism=_parallelism(parallelism) or None,
        migration=strategy,
        autoscaler=autoscaler,
        from_checkpoint=from_checkpoint,
        from_savepoint=from_savepoint,
        chaining=chaining,
        **checkpoints,
    )
    result = follow(job, progress_s, Progress())
    for r in result.recoveries:
        click.echo(
            f"recovered t={r['at_s']:.1f}s from checkpoint {r['checkpoint_id']} after "
            f"{r['instance'][0]}/{r['instance'][1]} failed ({r['cause'].splitlines()[0][:120]}): "
            f"down {r['downtime_s']:.2f} s, {r['records_replayed']:,} records replayed"
            f"{_actors_note(r)}"
        )
    if (result.recoveries_total or 0) > len(result.recoveries):
        click.echo(
            f"({result.recoveries_total:,} recoveries in all; the newest "
            f"{len(result.recoveries)} are listed above)"
        )
    ck = result.checkpoints
    if ck.get("completed") or ck.get("failed"):
        click.echo(
            f"checkpoints: {ck['completed']} completed, {ck['failed']} failed ({ck['storage']})"
        )
    for d in result.autoscaling:
        if d.get("to") != d.get("from"):  # a rescale (holds and warnings are in the log)
            click.echo(
                f"autoscaler t={d.get('t_s', 0):.1f}s {d.get('operator', '')} "
                f"{d.get('from')} -> {d.get('to')}: {d.get('reason', '')}"[:300]
            )
    from raystream.status_view import summary_lines

    for line in summary_lines(result):
        click.echo(line)


class Progress:
    """Where ``raystream run`` reports progress: stderr, one line rewritten in place on a
    terminal, plain lines otherwise (a log, ``raystream submit``); events stay on their line."""

    def __init__(self, tty: bool | None = None, write: Callable[[str], None] | None = None):
        self.tty = sys.stderr.isatty() if tty is None else tty
        self._write = write or (lambda text: click.echo(text, nl=False, err=True))
        self._open = False  # a rewritten line is showing

    def line(self, text: str) -> None:
        if self.tty:
            self._write("\r\x1b[2K" + text)
            self._open = True
        else:
            self._write(text + "\n")

    def event(self, text: str) -> None:
        self._write(("\r\x1b[2K" if self._open else "") + text + "\n")
        self._open = False

    def close(self) -> None:
        if self._open:
            self._write("\n")
            self._open = False


def follow(job: Any, interval_s: float, progress: Progress) -> Any:
    """Wait for ``job`` to end, with a progress line every ``interval_s`` (0: none) and an
    event line for each rescale as it happens; returns its ``JobResult``. A failed job raises
    its ``JobFailedError``; Ctrl-C (or any other error) stops the job first."""
    from ray.exceptions import RayActorError

    from raystream.errors import JobFailedError
    from raystream.status_view import progress_line

    started = last_t = time.monotonic()
    previous: dict[str, Any] | None = None
    try:
        while True:
            result = job.wait(interval_s if interval_s > 0 else None)
            if result.state not in ("created", "running", "recovering"):
                return result
            try:
                st = job.status()
            except RayActorError:
                continue  # stopped from elsewhere: the next wait() has its final answer
            now = time.monotonic()
            before = (previous or {}).get("parallelism") or {}
            for step, p in (st.get("parallelism") or {}).items():
                if before.get(step, p) != p:
                    progress.event(
                        f"{now - started:.1f} s  rescaled {step!r} {before[step]} -> {p}"
                    )
            dt = now - last_t if previous is not None else None
            progress.line(progress_line(st, now - started, previous, dt))
            previous, last_t = st, now
    except JobFailedError:
        raise  # the controller already stopped the job
    except BaseException:
        job.stop()
        raise
    finally:
        progress.close()


@main.command()
@click.argument("job")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--watch", "-w", is_flag=True, help="refresh the table until the job ends (Ctrl-C)")
@click.option(
    "--interval",
    "interval_s",
    type=float,
    default=2.0,
    show_default=True,
    help="seconds between refreshes of --watch",
)
@click.option("--count", type=int, default=None, help="--watch: stop after N refreshes")
@address_option
def status(
    job: str,
    as_json: bool,
    watch: bool,
    interval_s: float,
    count: int | None,
    address: str | None,
) -> None:
    """Operators of the running JOB: parallelism, records, rate, busy, backlog, latency,
    migration progress; ``--watch`` keeps the table live (busy % then over the last refresh)."""
    import raystream as rs
    from raystream.status_view import operator_rows

    if interval_s <= 0 or (count is not None and count < 1):
        msg = f"--interval takes seconds > 0 and --count N >= 1, got {interval_s} and {count}"
        raise click.BadParameter(msg)
    _connect(address)
    handle = rs.attach(job)
    st = handle.status()
    if as_json:
        rows = operator_rows(st)
        click.echo(json.dumps({**st, "operators": rows}, default=str, indent=1))
        return
    if not watch:
        _console().print(status_view(st, operator_rows(st)))
        return
    _watch(handle, st, interval_s, count)


def _console() -> Any:
    from rich.console import Console

    return Console(width=max(Console().width, 120))


def _watch(
    handle: Any,
    st: dict[str, Any],
    interval_s: float,
    count: int | None,
    *,
    console: Any = None,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Refresh the status table every ``interval_s`` (live on a terminal, one table per
    refresh otherwise) until the job ends, Ctrl-C, or ``count`` refreshes. ``handle`` has
    ``name`` and ``status()``; ``console`` (a rich Console) and ``sleep`` default to the real
    ones."""
    import ray
    from rich.live import Live

    from raystream.status_view import operator_rows

    console = console if console is not None else _console()
    previous: dict[str, Any] | None = None
    shown = 0
    live = Live(console=console, auto_refresh=False) if console.is_terminal else None
    ended = None
    try:
        if live is not None:
            live.start()
        while True:
            view = status_view(st, operator_rows(st, previous=previous), watching=interval_s)
            if live is not None:
                live.update(view, refresh=True)
            else:
                console.print(view)
            shown += 1
            if count is not None and shown >= count:
                break
            sleep(interval_s)
            previous = st
            try:
                st = handle.status()
            except ray.exceptions.RayActorError:
                ended = f"job {handle.name!r} ended (its controller is gone)"
                break
            if st.get("state") not in ("created", "running", "recovering"):
                ended = f"job {handle.name!r} {st.get('state')}"
                break
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()
    if ended:
        console.print(ended)


def status_view(
    st: dict[str, Any], rows: list[dict[str, Any]], watching: float | None = None
) -> Any:
    """The status of a job as a rich renderable: the operator table and notes below it.
    ``watching``: the refresh interval of ``--watch`` (busy % over it where known)."""
    from rich.console import Group
    from rich.table import Table

    from raystream.status_view import RATE_WINDOW_S

    title = f"job {st['job']!r}: {st['state']}"
    if st.get("rescaling"):
        title += ", rescaling"
    if watching:
        title += f"  ({time.strftime('%H:%M:%S')}, every {watching:g} s)"
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
    recent = any(r.get("busy_recent_pct") is not None for r in rows)
    for r in rows:
        busy = r["busy_recent_pct"] if r.get("busy_recent_pct") is not None else r["busy_pct"]
        table.add_row(
            r["operator"],
            str(r["parallelism"]),
            f"{r['records_in']:,}",
            f"{r['records_out']:,}",
            f"{r['rate_in_per_s']:,.0f}",
            f"{busy:.1f}",
            f"{r['backlog']:,}",
            "" if r["latency_p50_ms"] is None else f"{r['latency_p50_ms']:g}",
            "" if r["latency_p99_ms"] is None else f"{r['latency_p99_ms']:g}",
            r["migration"],
        )
    notes: list[str] = []
    for r in rows:
        if r.get("nodes"):
            notes.append(f"{r['operator']} runs on (node ip/id: instances): {r['nodes']}")
    chains = list(dict.fromkeys(r["chain"] for r in rows if r.get("chain")))
    if chains:
        notes.append(
            "chained (one actor per index, records passed in-process): " + "; ".join(chains)
        )
    busy_note = (
        f"share of time spent processing over the last {watching:g} s"
        if recent and watching
        else "share of time spent processing since the instances started"
    )
    notes.append(
        f"in/s: records in per second over the last {RATE_WINDOW_S:g} s; busy %: {busy_note}; "
        "p50/p99: sink end-to-end latency"
    )
    ck = st.get("checkpoints") or {}
    if ck.get("completed") or ck.get("failed"):
        last = ck.get("last") or {}
        notes.append(
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
        notes.append(f"graph version {st['graph_version']}: {graph}")
    if st.get("actor_names"):  # inserted and moved instances (in warm spares, or versioned)
        names = ", ".join(f"{i} in {n}" for i, n in sorted(st["actor_names"].items()))
        notes.append(f"actors: {names}")
    for c in st.get("reconfigurations") or []:
        peak = c.get("peak_latency_ms")
        moved = ", ".join(f"{k} {v:,}" for k, v in (c.get("moved") or {}).items())
        notes.append(
            f"{c['kind']} {c['step']!r} at epoch {c['epoch']}: t={c['start_s']:.1f}-"
            f"{c['end_s']:.1f}s, {c['change']}; moved: {moved or 'nothing'}"
            + ("" if peak is None else f"; peak latency {peak:g} ms")
        )
    notes.extend(_totals_note(st))
    for r in st.get("recoveries") or []:
        notes.append(
            f"recovery {r['attempt']}: t={r['at_s']:.1f}s {r['instance']} failed; restarted from "
            f"checkpoint {r['checkpoint_id']}, down {r['downtime_s']:.2f} s, "
            f"{r['records_replayed']:,} records replayed{_actors_note(r)}"
        )
    if st.get("latency"):
        lat = st["latency"]
        notes.append(
            f"end-to-end latency (all sinks, whole run): p50 {lat['p50_ms']} ms  "
            f"p99 {lat['p99_ms']} ms  max {lat['max_ms']} ms"
        )
    return Group(table, *notes)


def _totals_note(st: dict[str, Any]) -> list[str]:
    """How many rescales, standby refills and recoveries the job had (every one; the status
    lists the newest recoveries only)."""
    parts = []
    for key, word in (
        ("rescales_total", "rescales"),
        ("standby_refills_total", "standby refills"),
        ("recoveries_total", "recoveries"),
    ):
        if st.get(key):
            parts.append(f"{st[key]:,} {word}")
    if not parts:
        return []
    listed = len(st.get("recoveries") or [])
    shown = (
        f" (the newest {listed} recoveries below)"
        if listed < int(st.get("recoveries_total") or 0)
        else ""
    )
    return [f"so far: {', '.join(parts)}{shown}"]


ACTORS_NAMED = 6  # actors a recovery's line names of those it kept or started (then a count)


def _actors_note(recovery: dict[str, Any]) -> str:
    """The actors a recovery kept (reset in place) and started, for its line in the status."""
    if "actors_kept" not in recovery and "actors_started" not in recovery:
        return ""  # (a record of a version that did not say)

    def named(ids: list[str]) -> str:
        shown = ", ".join(ids[:ACTORS_NAMED])
        more = len(ids) - ACTORS_NAMED
        return f" ({shown}{f', {more} more' if more > 0 else ''})" if ids else ""

    kept = list(recovery.get("actors_kept") or [])
    started = list(recovery.get("actors_started") or [])
    return f"; actors kept {len(kept)}{named(kept)}, started {len(started)}{named(started)}"


@main.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@address_option
def list_jobs(as_json: bool, address: str | None) -> None:
    """The raystream jobs running on the cluster: name, state, parallelism per step."""
    import ray

    import raystream as rs
    from raystream.cluster import gcs_address, running_jobs
    from raystream.errors import JobNotFoundError

    _connect(address)
    jobs = []
    for name in running_jobs():
        try:
            info = ray.get(rs.attach(name).controller.describe.remote())
        except (JobNotFoundError, ray.exceptions.RayActorError):
            continue  # it ended while we listed
        jobs.append(info)
    if as_json:
        click.echo(json.dumps(jobs, default=str, indent=1))
        return
    if not jobs:
        click.echo(f"no raystream jobs running on the Ray cluster at {gcs_address(address)}")
        return
    from rich.table import Table

    table = Table(title=f"raystream jobs on {gcs_address(address)}")
    for header in ("job", "state", "parallelism", "rescaling", "checkpoints"):
        table.add_column(header)
    for j in jobs:
        ck = j.get("checkpoints") or {}
        table.add_row(
            str(j["job"]),
            str(j["state"]),
            " ".join(f"{k}={v}" for k, v in (j.get("parallelism") or {}).items()),
            "yes" if j.get("rescaling") else "",
            f"{ck.get('completed', 0)}" if ck.get("completed") else "",
        )
    _console().print(table)


@main.command()
@click.argument("job")
@click.argument("step")
@click.argument("parallelism", type=int)
@click.option(
    "--strategy",
    default=None,
    help="meces (default), all_at_once, fluid, batched, lazy, stop_restart, or module:attr",
)
@address_option
def rescale(
    job: str, step: str, parallelism: int, strategy: str | None, address: str | None
) -> None:
    """Change the parallelism of keyed STEP of the running JOB to PARALLELISM."""
    import raystream as rs

    _connect(address)
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
@address_option
def update(
    job: str, step: str, operator: str, migrate_state: str | None, address: str | None
) -> None:
    """Replace the function of STEP of the running JOB by OPERATOR (module:attr of an operator
    made with @rs.map, @rs.keyed, ...). It takes over at a barrier; keyed state is kept."""
    import raystream as rs

    op = _load_object(operator)  # refused here, before connecting, when it does not import
    migrate = _load_object(migrate_state, "state migration function") if migrate_state else None
    _connect(address)
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
@address_option
def move(job: str, step: str, index: int, node_id: str, address: str | None) -> None:
    """Move instance INDEX of keyed STEP of the running JOB to the node NODE_ID (Ray node id, as
    `raystream status` shows): a new actor there takes over its key groups, the old one retires."""
    import raystream as rs

    _connect(address)
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
@click.option(
    "--key-by", "key_by", default=None, help="the key column (required for a keyed OPERATOR)"
)
@address_option
def insert(
    job: str,
    after: str,
    operator: str,
    name: str | None,
    parallelism: int,
    before: str | None,
    key_by: str | None,
    address: str | None,
) -> None:
    """Put OPERATOR (module:attr) as a new step after step AFTER of the running JOB; records
    after the barrier go through it. A keyed operator needs --key-by and starts empty."""
    import raystream as rs

    op = _load_object(operator)
    _connect(address)
    rec = rs.attach(job).insert(
        after, op, name=name, parallelism=parallelism, before=before, key_by=key_by
    )
    click.echo(
        f"inserted at epoch {rec['epoch']}: {rec['change']} (graph version "
        f"{rec['graph_version']})"
    )


@main.command()
@click.argument("job")
@click.argument("step")
@click.option(
    "--state",
    type=click.Choice(["drop", "emit"]),
    default=None,
    help="a keyed STEP's state: drop it, or emit each key's final state downstream first",
)
@address_option
def remove(job: str, step: str, state: str | None, address: str | None) -> None:
    """Take STEP out of the running JOB at a barrier (a keyed STEP needs --state)."""
    import raystream as rs

    _connect(address)
    rec = rs.attach(job).remove(step, state=state)
    click.echo(
        f"removed at epoch {rec['epoch']}: {rec['change']} (graph version "
        f"{rec['graph_version']})"
    )


@main.command()
@click.argument("job")
@address_option
def stop(job: str, address: str | None) -> None:
    """Stop the running JOB with a final checkpoint: sinks publish what came before it, and
    `raystream run FILE --from-checkpoint latest` resumes from it. `cancel` stops at once."""
    import raystream as rs

    _connect(address)
    result = rs.attach(job).stop()
    if result is None:  # its driver saw the end first and removed the controller
        click.echo(f"job {job!r} stopped")
        return
    last = result.checkpoints.get("last") or {}
    final = f" after final checkpoint {last['checkpoint_id']}" if last else ""
    click.echo(f"job {result.job!r} {result.state}{final}")


@main.command()
@click.argument("job")
@address_option
def cancel(job: str, address: str | None) -> None:
    """Stop the running JOB at once, without a final checkpoint (unpublished output dropped)."""
    import raystream as rs

    _connect(address)
    result = rs.attach(job).cancel()
    click.echo(f"job {job!r} {'cancelled' if result is None else result.state}")


@main.command()
@click.argument("job")
@click.argument("path")
@address_option
def savepoint(job: str, path: str, address: str | None) -> None:
    """Take a savepoint of the running JOB into PATH (a folder or pyarrow.fs URI); resume with
    `raystream run FILE --from-savepoint PATH` (at any parallelism)."""
    import raystream as rs

    _connect(address)
    sp = rs.attach(job).savepoint(path)
    click.echo(
        f"savepoint of checkpoint {sp['checkpoint_id']} at {sp['savepoint']} "
        f"({sp['duration_s']:.2f} s)"
    )


TIMERS_SHOWN_AS = "pending_timers"  # `raystream state`: the timers' table (and Parquet file)


@main.command("state")
@click.argument("job_file")
@click.argument("step")
@click.option("--flow", "flow_name", default=None, help="which Dataflow of the file")
@click.option(
    "--checkpoint-dir",
    default=None,
    help="the job's checkpoint storage (path or pyarrow.fs URI); default: a job's default",
)
@click.option(
    "--checkpoint", default="latest", show_default=True, help="'latest' or a checkpoint id"
)
@click.option("--savepoint", default=None, help="read this savepoint folder/URI instead")
@click.option("--key", default=None, help="only this key (an int if it reads as one, else str)")
@click.option(
    "--key-type",
    type=click.Choice(["int", "str", "bytes"]),
    default=None,
    help="the step's key type (default: found from the stored keys)",
)
@click.option("--limit", type=int, default=20, show_default=True, help="rows shown per state")
@click.option("--json", "as_json", is_flag=True, help="JSON lines (all rows, no --limit)")
@click.option(
    "--parquet",
    "parquet_dir",
    default=None,
    help="write DIR/<state>.parquet per state (all rows) instead of printing",
)
def state(
    job_file: str,
    step: str,
    flow_name: str | None,
    checkpoint_dir: str | None,
    checkpoint: str,
    savepoint: str | None,
    key: str | None,
    key_type: str | None,
    limit: int,
    as_json: bool,
    parquet_dir: str | None,
) -> None:
    """Show the keyed state STEP of JOB_FILE's dataflow held at a checkpoint (or savepoint),
    without starting the job: one table per declared state (key, value; a map state: key,
    map_key, value), then the pending timers (key, domain, timestamp) if there are any."""
    import raystream as rs

    if limit < 0:
        msg = f"--limit takes rows >= 0, got {limit}"
        raise click.BadParameter(msg)
    if as_json and parquet_dir:
        msg = "pass --json or --parquet, not both"
        raise click.BadParameter(msg)
    flow = _load_flow(job_file, flow_name)
    where: dict[str, Any] = (
        {"savepoint": savepoint}
        if savepoint is not None
        else {"checkpoint_dir": checkpoint_dir, "checkpoint": checkpoint}
    )
    tables = None
    for typed in _key_candidates(key, key_type):
        tables = rs.read_state(flow, step, key=typed, key_type=key_type, **where)
        pending = tables.timers.num_rows if tables.timers is not None else 0
        if typed is None or pending or any(t.num_rows for t in tables.values()):
            break
    assert tables is not None
    shown = dict(tables.items())
    if tables.timers is not None and tables.timers.num_rows:
        shown[TIMERS_SHOWN_AS] = tables.timers
    if parquet_dir:
        import pyarrow.parquet as pq

        Path(parquet_dir).mkdir(parents=True, exist_ok=True)
        for name, table in shown.items():
            pq.write_table(table, str(Path(parquet_dir) / f"{name}.parquet"))
            click.echo(f"{Path(parquet_dir) / name}.parquet: {table.num_rows:,} rows")
        return
    for name, table in shown.items():
        what = "pending timers" if name == TIMERS_SHOWN_AS else f"state {name!r}"
        if as_json:  # a state's row: {"state": name, ...}; a timer's: {"timer": domain, ...}
            for row in table.to_pylist():
                timer = name == TIMERS_SHOWN_AS
                head = {"timer": row.pop(table.column_names[1])} if timer else {"state": name}
                click.echo(json.dumps({**head, **row}, default=_json_value))
            continue
        click.echo(
            f"{what} of step {step!r}, {tables.where}: {table.num_rows:,} rows"
            + (f" (first {limit})" if table.num_rows > limit else "")
        )
        for line in _text_rows(table.slice(0, limit)):
            click.echo(f"  {line}")
    if tables.finished_key_groups and not as_json:
        click.echo(
            f"({len(tables.finished_key_groups)} key groups were held by instances that had "
            "finished: no state)"
        )


def _key_candidates(key: str | None, key_type: str | None) -> list[Any]:
    """The typed keys ``--key`` may mean: its type if given, else an int if it reads as one,
    then the string."""
    if key is None:
        return [None]
    if key_type == "bytes":
        return [key.encode()]
    if key_type == "str":
        return [key]
    try:
        number = int(key)
    except ValueError:
        if key_type == "int":
            msg = f"--key {key!r} is not an int (--key-type int)"
            raise click.BadParameter(msg) from None
        return [key]
    return [number] if key_type == "int" else [number, key]


def _json_value(v: Any) -> Any:
    return v.hex() if isinstance(v, (bytes, bytearray)) else str(v)


def _text_rows(table: Any) -> list[str]:
    """Rows of a small table as aligned text columns (a header line first)."""
    names = table.column_names
    cells = [[_cell(v) for v in table.column(n).to_pylist()] for n in names]
    widths = [max([len(n), *map(len, col)]) for n, col in zip(names, cells, strict=True)]
    lines = ["  ".join(n.ljust(w) for n, w in zip(names, widths, strict=True)).rstrip()]
    for row in zip(*cells, strict=True):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return lines


def _cell(v: Any) -> str:
    if isinstance(v, (bytes, bytearray)):
        text = v.hex()
    else:
        text = repr(v) if isinstance(v, str) else str(v)
    return text if len(text) <= 60 else text[:57] + "..."


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
@click.option(
    "--chaining/--no-chaining",
    default=True,
    show_default=True,
    help="operator chaining (as on `raystream run`)",
)
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
    chaining: bool,
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
    if not chaining:
        run_args.append("--no-chaining")
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
