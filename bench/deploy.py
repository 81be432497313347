"""Start-up and recovery time of a key-count job, split into phases.

Run it from the repository root (on a quiet machine; it starts a local Ray)::

    python -m bench.deploy --runs 3 --report bench/results/deploy.json

Two cases, each ``--runs`` times on one Ray (started once, as a test session does):

* ``deploy``: ``rs.start`` of ``source -> key_by -> count (p=2, RocksDB) -> sink`` (4 instance
  actors) until the sink's first write. Phases (seconds after the ``rs.start`` call, wall clock):
  the controller actor's process started, its ``import raystream`` began, its constructor ran;
  the deploy began, every instance actor answered (created, imports done, constructed: RocksDB
  opened), the instances were wired, their loops started; ``rs.start`` returned; the first
  output. Per instance actor: process spawned (after the deploy asked for it), Python + Ray
  worker boot, ``import raystream``, the constructor (``pandas`` import, ``OperatorInstance``).
* ``recovery``: the same dataflow over 1M keys at 100k events/s with a checkpoint every 0.5 s;
  ``ray.kill`` of ``count/0`` after the first checkpoint. ``downtime_s`` is the controller's
  (failure noticed -> new attempt running, from ``result.recoveries``) with its phases; the
  bench adds the kill -> noticed delay and ``processing_again_s``: kill -> the sink's first
  write of the new attempt. The final counts are checked against a numpy oracle (``exact``).

Figures are medians over the runs (each run's figures are in ``runs``). ``--option NAME=VALUE``
passes a RuntimeConfig option to both cases (e.g. ``standby_instances=0``); ``--ray-init`` extra
``ray.init`` arguments for the local Ray it starts. Committed results: ``deploy_before.json``
(restart delay before the new deploy), ``deploy_delay_overlap.json`` (delay from the failure),
``deploy_no_standby.json`` (the same with ``--option standby_instances=0``),
``deploy_keep_actors.json`` (a recovery resets the live actors in place and starts a process
only for the killed one; ``--option recovery_keeps_actors=False`` replaces every process).
"""

from __future__ import annotations

import ast
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
import pyarrow as pa

import raystream as rs
from bench._latest import LatestCountSink, _LatestWriter
from bench._report import write_json
from bench.keycount import _pickle_by_value, count_vectorised

__all__ = ["main"]

JOB = "bench-keycount"


@dataclass(frozen=True)
class TimedLatestSink(LatestCountSink):
    """The latest count per key; the table ``close()`` returns carries the wall-clock time of
    this writer's first write (schema metadata ``first_write_at``)."""

    def open(self, index: int, parallelism: int) -> _TimedWriter:
        return _TimedWriter(self.min_compact_rows)


class _TimedWriter(_LatestWriter):
    first_write_at: float | None = None

    def write(self, batch: pa.RecordBatch) -> None:
        if self.first_write_at is None:
            self.first_write_at = time.time()
        super().write(batch)

    def close(self) -> pa.Table | None:
        table = super().close()
        if table is None:
            return None
        return table.replace_schema_metadata({"first_write_at": repr(self.first_write_at)})


def _flow(events: int, keys: int, rate: float) -> tuple[rs.Dataflow, Any]:
    """``source -> key_by("key") -> count (RocksDB) -> latest`` (as bench.keycount's)."""
    source = rs.sources.generator(events=events, keys=keys, zipf=1.1, seed=0, rate_eps=rate)
    flow = rs.Dataflow(JOB, num_key_groups=128)
    stream = flow.source(source).key_by("key").apply(count_vectorised)
    stream.sink(TimedLatestSink(), name="latest")
    return flow, source


def _exact(result: rs.JobResult, source: Any) -> bool:
    """The final count of every key equals the oracle's (numpy over the whole stream)."""
    want_keys, want_counts = np.unique(source.generate_all()["key"].to_numpy(), return_counts=True)
    got = result.table("latest").sort_by("key")
    return bool(
        np.array_equal(got["key"].to_numpy(), want_keys)
        and np.array_equal(got["count"].to_numpy(), want_counts)
    )


def _first_write(result: rs.JobResult) -> float | None:
    marks = [
        float(t.schema.metadata[b"first_write_at"])
        for t in result.results.get("latest", [])
        if isinstance(t, pa.Table) and t.schema.metadata and b"first_write_at" in t.schema.metadata
    ]
    marks = [m for m in marks if m == m]  # a writer that never wrote has None -> nan
    return min(marks) if marks else None


def _instance_startups(job: rs.Job, parallelism: dict[str, int]) -> list[dict[str, Any]]:
    """The start-up marks of every deployed instance actor (standbys excluded)."""
    import ray

    from raystream.runtime.actors import NAMESPACE

    out = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"] if isinstance(entry, dict) else entry
        parts = name.split(":")
        if len(parts) != 4 or parts[1] != job.name:
            continue
        step, index = parts[2], int(parts[3])
        if index >= parallelism.get(step, 1):
            continue
        try:
            marks = ray.get(ray.get_actor(name, namespace=NAMESPACE).startup.remote(), timeout=10)
        except Exception:  # noqa: BLE001, S112 - it ended meanwhile
            continue
        out.append({"instance": f"{step}/{index}", **marks})
    return out


def _actor_phases(marks: dict[str, Any], asked_at: float) -> dict[str, float | None]:
    def gap(a: str | float | None, b: str | None) -> float | None:
        x = marks.get(a) if isinstance(a, str) else a
        y = marks.get(b) if b else None
        return None if x is None or y is None else round(y - x, 3)

    return {
        "spawn_s": gap(asked_at, "process_started_at"),
        "boot_s": gap("process_started_at", "raystream_import_at"),
        "import_s": gap("raystream_import_at", "runtime_loaded_at"),
        "to_init_s": gap("runtime_loaded_at", "init_at"),
        "init_s": gap("init_at", "init_done_at"),
        "pandas_s": marks.get("pandas_s"),
        "instance_s": marks.get("instance_s"),
        "restore_s": marks.get("restore_s"),
    }


def _deploy_case(events: int, keys: int, rate: float, **options: Any) -> dict[str, Any]:
    import ray

    flow, source = _flow(events, keys, rate)
    par = {"count": 2}
    t0 = time.time()
    job = rs.start(flow, parallelism=par, **options)
    returned = time.time()
    desc = ray.get(job.controller.describe.remote())
    startups = _instance_startups(job, {**desc["parallelism"]})
    result = job.wait(timeout_s=120)
    first = _first_write(result)
    deploy = desc["deploys"][0]
    ctl = deploy.get("controller") or {}

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 3)

    actors = {
        m["instance"]: _actor_phases(m, deploy["placed_at"])
        for m in sorted(startups, key=lambda m: m["instance"])
    }
    return {
        "exact": _exact(result, source),
        "first_output_s": rel(first),
        "start_returned_s": rel(returned),
        "marks_s": {
            "controller_process_started": rel(ctl.get("process_started_at")),
            "controller_import_began": rel(ctl.get("raystream_import_at")),
            "controller_constructed": rel(ctl.get("init_at")),
            "deploy_began": rel(deploy["deploy_at"]),
            "placed": rel(deploy["placed_at"]),
            "actors_ready": rel(deploy["actors_ready_at"]),
            "connected": rel(deploy["connected_at"]),
            "running": rel(deploy["running_at"]),
        },
        "phases_s": {
            "controller_actor": rel(deploy["deploy_at"]),
            "instance_actors": round(deploy["actors_ready_at"] - deploy["placed_at"], 3),
            "wiring": round(deploy["connected_at"] - deploy["actors_ready_at"], 3),
            "loops": round(deploy["running_at"] - deploy["connected_at"], 3),
            "to_first_output": None if first is None else round(first - deploy["running_at"], 3),
        },
        "actors": actors,
    }


def _recovery_case(
    events: int, keys: int, rate: float, kill_after_s: float, **options: Any
) -> dict[str, Any]:
    import ray

    from raystream.runtime.actors import NAMESPACE, instance_actor_name

    flow, source = _flow(events, keys, rate)
    options = {"checkpoint_interval_s": 0.5, **options}
    job = rs.start(flow, parallelism={"count": 2}, **options)
    started = time.time()
    while True:
        done = ray.get(job.controller.describe.remote())["checkpoints"]["completed"]
        if done >= 1 and time.time() - started >= kill_after_s:
            break
        if time.time() - started > 60:
            job.stop()
            msg = "no checkpoint completed within 60 s"
            raise RuntimeError(msg)
        time.sleep(0.05)
    victim = ray.get_actor(instance_actor_name(job.name, "count", 0), namespace=NAMESPACE)
    killed_at = time.time()
    ray.kill(victim)
    startups: list[dict[str, Any]] = []
    placed_at: float | None = None
    while time.time() - killed_at < 60:
        desc = ray.get(job.controller.describe.remote())
        if desc["recoveries"] and desc["state"] == "running":
            time.sleep(1.0)  # the restore runs in the new instances' loops
            startups = _instance_startups(job, desc["parallelism"])
            placed_at = desc["deploys"][-1]["placed_at"]  # the recovery's deploy
            break
        time.sleep(0.05)
    result = job.wait(timeout_s=120)
    if not result.recoveries:
        msg = f"the job did not recover: {result.state}"
        raise RuntimeError(msg)
    rec = result.recoveries[0]
    first = _first_write(result)
    deployed = rec.get("phases", {}).get("deploy", {})
    return {
        "exact": _exact(result, source),
        "downtime_s": round(rec["downtime_s"], 3),
        "noticed_s": round(rec["failed_at"] - killed_at, 3) if "failed_at" in rec else None,
        "processing_again_s": None if first is None else round(first - killed_at, 3),
        "records_replayed": rec["records_replayed"],
        "phases_s": {k: v for k, v in rec.get("phases", {}).items() if k != "deploy"},
        "deploy_phases_s": deployed,
        # the actors the recovery kept (reset in place) and those it started (a new process)
        "actors_kept": rec.get("actors_kept"),
        "actors_started": rec.get("actors_started"),
        "actors": {
            m["instance"]: _actor_phases(m, placed_at)
            for m in sorted(startups, key=lambda m: m["instance"])
            if m["instance"] in rec.get("actors_started", [m["instance"]])
        },
    }


def _connect(extra: dict[str, Any]) -> bool:
    """A local Ray as ``raystream.job.ensure_ray`` starts it (``RAY_ADDRESS``: that cluster),
    with ``extra`` ray.init arguments; True if this process started it."""
    import os

    import ray

    from raystream.job import ensure_ray

    if ray.is_initialized():
        return False
    if extra and not os.environ.get("RAY_ADDRESS"):
        ray.init(address="local", namespace="raystream", include_dashboard=False, **extra)
    else:
        ensure_ray()
    return not os.environ.get("RAY_ADDRESS")


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-key median over runs (nested dicts too; non-numbers from the first run)."""
    out: dict[str, Any] = {}
    for key, first in runs[0].items():
        values = [r.get(key) for r in runs]
        if isinstance(first, dict):
            out[key] = _median([v if isinstance(v, dict) else {} for v in values])
        elif isinstance(first, bool):
            out[key] = all(values)
        elif isinstance(first, (int, float)):
            nums = [v for v in values if isinstance(v, (int, float))]
            out[key] = round(statistics.median(nums), 3) if nums else None
        else:
            out[key] = first
    return out


@click.command()
@click.option("--runs", default=3, show_default=True, help="Runs of each case.")
@click.option("--cases", default="deploy,recovery", show_default=True)
@click.option("--report", type=click.Path(path_type=Path), default=None)
@click.option("--label", default="", help="What this run measures (kept in the report).")
@click.option(
    "--option",
    "options",
    multiple=True,
    help="A RuntimeConfig option for rs.start, NAME=VALUE (Python literal), e.g. "
    "standby_instances=0 (repeatable).",
)
@click.option(
    "--ray-init",
    "ray_init",
    default="",
    help="Extra ray.init arguments as a Python dict literal (for a local Ray this starts).",
)
def main(
    runs: int, cases: str, report: Path | None, label: str, options: tuple[str, ...], ray_init: str
) -> None:
    """Time ``rs.start`` to first output and a recovery, split into phases."""
    import ray

    _pickle_by_value(("bench.keycount", "bench._latest", "bench.deploy"))
    started_ray = _connect(ast.literal_eval(ray_init) if ray_init else {})
    config = {k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in options)}
    out: dict[str, Any] = {
        "benchmark": "deploy",
        "label": label,
        "runs": runs,
        "options": config,
        "ray_init": ray_init,
    }
    try:
        for case in cases.split(","):
            results = []
            for i in range(runs):
                if case == "deploy":
                    r = _deploy_case(events=300_000, keys=10_000, rate=100_000, **config)
                elif case == "recovery":
                    r = _recovery_case(1_000_000, 1_000_000, 100_000, 2.0, **config)
                else:
                    msg = f"unknown case {case!r}; expected deploy or recovery"
                    raise click.BadParameter(msg, param_hint="'--cases'")
                print(f"{case} run {i}: {r}", file=sys.stderr)
                results.append(r)
            out[case] = {"median": _median(results), "runs": results}
    finally:
        if started_ray:
            ray.shutdown()
    out["environment"] = {"ray": ray.__version__, "python": sys.version.split()[0]}
    if report is not None:
        write_json(report, out)
    print(out)


if __name__ == "__main__":
    main()
