"""Running a dataflow: ``rs.run`` (blocking) and ``rs.start`` (returns a :class:`Job`)."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import ray

from raystream.dataflow import Dataflow
from raystream.errors import (
    ConfigError,
    JobFailedError,
    JobNotFoundError,
    RaystreamError,
    RescaleError,
)
from raystream.ingest import FeedContext
from raystream.metrics import LatencyRecorder
from raystream.placement import controller_options
from raystream.presort import plan_for
from raystream.runtime import wire
from raystream.runtime.actors import NAMESPACE, controller_actor_class, controller_name
from raystream.runtime.instance import RuntimeConfig

__all__ = ["Job", "JobResult", "attach", "ensure_ray", "run", "start"]


def ensure_ray() -> None:
    """Connect to Ray: the cluster in ``RAY_ADDRESS`` (as under ``ray job submit``), else a new
    embedded local one (never silently attaching to a cluster that happens to run here)."""
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS") or "local"
        kwargs: dict[str, Any] = {"namespace": NAMESPACE, "log_to_driver": True}
        if address == "local":
            kwargs["include_dashboard"] = False
        ray.init(address=address, **kwargs)
    wire.register()  # batches this process sends (push writers) go as their rows only


@dataclass
class JobResult:
    """What a finished job left: sink results, per-instance metrics, latency."""

    job: str
    state: str
    elapsed_s: float
    results: dict[str, list[Any]] = field(default_factory=dict)  # sink step -> per instance
    metrics: list[dict[str, Any]] = field(default_factory=list)
    origin_ns: int = 0
    rescales: list[dict[str, Any]] = field(default_factory=list)
    autoscaling: list[dict[str, Any]] = field(default_factory=list)  # the autoscaler's decisions
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # cause, checkpoint, downtime
    checkpoints: dict[str, Any] = field(default_factory=dict)  # completed, failed, last
    # attempts a recovery replaced: cause, each instance's last metrics, totals per step (the
    # newest RECORDS_KEPT; failed_attempts_total counts them all)
    failed_attempts: list[dict[str, Any]] = field(default_factory=list)
    # after each scale-out, when the warm standbys it used were refilled (raystream.standby_pacing)
    standby_refills: list[dict[str, Any]] = field(default_factory=list)
    # after each change that used warm spares (RuntimeConfig.change_spares), their refill
    spare_refills: list[dict[str, Any]] = field(default_factory=list)
    # rescales, recoveries, standby and spare refills list the newest RECORDS_KEPT (100, see
    # raystream.history: a job that rescales every few minutes for days has thousands); these
    # count them all (None: the list's length)
    rescales_total: int | None = None
    recoveries_total: int | None = None
    standby_refills_total: int | None = None
    spare_refills_total: int | None = None
    failed_attempts_total: int | None = None
    # instances retired by a change (their index came back): ``metrics`` lists the newest
    # RECORDS_KEPT of them
    retired_instances_total: int = 0

    def __post_init__(self) -> None:
        for name in (
            "rescales",
            "recoveries",
            "standby_refills",
            "spare_refills",
            "failed_attempts",
        ):
            if getattr(self, f"{name}_total") is None:
                setattr(self, f"{name}_total", len(getattr(self, name)))

    def table(self, sink: str | None = None) -> pa.Table:
        """The rows a collect sink received, as one table (all instances)."""
        sink = sink or self._only_sink()
        parts = [r for r in self.results.get(sink, []) if isinstance(r, pa.Table)]
        if not parts:
            msg = f"sink {sink!r} returned no table (is it rs.sinks.collect()?); sinks: {list(self.results)}"
            raise ConfigError(msg)
        return pa.concat_tables(parts, promote_options="permissive")

    def _only_sink(self) -> str:
        if len(self.results) != 1:
            msg = f"this job has sinks {list(self.results)}; pass the name: result.table('name')"
            raise ConfigError(msg)
        return next(iter(self.results))

    def latency(self) -> LatencyRecorder | None:
        snaps = [m["latency"] for m in self.metrics if m.get("latency")]
        return LatencyRecorder.merge_snapshots(snaps) if snaps else None

    def step_metrics(self, step: str) -> list[dict[str, Any]]:
        return [m for m in self.metrics if m.get("step") == step]


class Job:
    """A running job, driven through its named controller actor."""

    def __init__(self, name: str, controller: Any, feeders: list[Any] | None = None) -> None:
        self.name = name
        self.controller = controller
        self.feeders: list[Any] = list(feeders or [])  # driver-side writers (Spark) of this process
        self._ended: str | None = None  # the final state wait()/stop() saw (controller then ends)
        self._final: Any = None  # a wait() for the end, kept in flight across timed waits

    def __repr__(self) -> str:
        return f"Job({self.name!r})"

    def wait(self, timeout_s: float | None = None) -> JobResult:
        """The job's result once it ended; after ``timeout_s`` its state so far. A wait for the
        end stays in flight between timed calls, so the final answer reaches this process even
        if another one stops the job (and its controller) in between."""
        if self._final is None:
            self._final = self.controller.wait.remote(None)
        ready, _ = ray.wait([self._final], timeout=timeout_s)
        if ready:
            out = ray.get(self._final)
        else:
            try:
                out = ray.get(self.controller.wait.remote(0.0))
            except ray.exceptions.RayActorError:
                out = ray.get(self._final)  # it ended and went meanwhile: its answer is here
        if out["state"] not in ("created", "running", "recovering"):
            self._ended = out["state"]
        if out["state"] not in ("running", "recovering"):
            self._end_feeders(stop=out["state"] != "finished")
        return _result(out, self)

    def _end_feeders(self, *, stop: bool) -> None:
        """The job ended: stop (failed, stopped) or join (finished) the feeders this process runs."""
        for f in self.feeders:
            if stop:
                f.stop()
            f.join(30.0)

    def status(self) -> dict[str, Any]:
        return ray.get(self.controller.status.remote())  # type: ignore[no-any-return]

    def metrics(self) -> dict[str, Any]:
        return ray.get(self.controller.metrics.remote())  # type: ignore[no-any-return]

    def checkpoint(self) -> dict[str, Any]:
        """Take a checkpoint now (after a running rescale); returns its id, duration and bytes."""
        return ray.get(self.controller.checkpoint.remote())  # type: ignore[no-any-return]

    def savepoint(self, path: str) -> dict[str, Any]:
        """Take a checkpoint and copy it to ``path`` (a local path or pyarrow.fs URI) as a
        self-contained savepoint; ``rs.start(flow, from_savepoint=path)`` resumes from it, at any
        parallelism."""
        return ray.get(self.controller.savepoint.remote(str(path)))  # type: ignore[no-any-return]

    def rescale(
        self, step: str, parallelism: int, strategy: Any = None, **strategy_args: Any
    ) -> dict[str, Any]:
        """Change the parallelism of keyed step ``step`` now; returns the migration's stats once
        all state settled (see ``migration/`` for strategies: meces, all_at_once, fluid, batched,
        lazy, stop_restart, or a ``"module:attr"`` of your own)."""
        try:
            return ray.get(  # type: ignore[no-any-return]
                self.controller.rescale.remote(step, parallelism, strategy, **strategy_args)
            )
        except ray.exceptions.RayActorError as e:
            if self._ended is None:
                raise
            # the job ended meanwhile (wait() or stop() in another thread) and so did its
            # controller, before this rescale was answered
            msg = (
                f"job {self.name!r} {self._ended} before the rescale of {step!r} to {parallelism} "
                "was answered, and its controller has ended; a job that ended cannot be rescaled"
            )
            raise RescaleError(msg) from e

    def replace(
        self,
        step: str,
        operator: Any,
        *,
        migrate_state: Any = None,
        key: str | None = None,
    ) -> dict[str, Any]:
        """Replace the function of operator step ``step`` by ``operator`` (made with the step's
        decorator kind; a keyed step takes @rs.keyed or @rs.keyed_batches) while the job runs.
        The new function takes over at a barrier: every record before it went through the old
        function, every record after it goes through the new one, on every instance; keyed state
        is kept. ``migrate_state``: a function old value -> new value (or a dict of them per
        state name) for a state whose stored form changes. ``key``: if given, must be the step's
        key column. A function that does not fit is refused (ReconfigurationError) before
        anything changes. Returns the change's record (see ``metrics()["reconfigurations"]``)."""
        return ray.get(  # type: ignore[no-any-return]
            self.controller.replace_function.remote(step, operator, migrate_state, key)
        )

    def move(self, step: str, index: int, node_id: str, **fetch: Any) -> dict[str, Any]:
        """Move instance ``index`` of keyed step ``step`` to the node ``node_id`` (a Ray node id;
        ``raystream status`` shows where each instance runs): a new actor there takes over the
        instance's key groups, then the old actor retires. By default (``transfer="files"``)
        the old actor's RocksDB goes whole before the switch (a checkpoint: hard links, renamed
        into place on the same node, pulled file by file from another) and at the switch only
        the rows written since; ``transfer="rows"`` moves rows sub-group by sub-group, on demand
        first and the rest hottest first as in a rescale, with FetchPolicy options in ``fetch``
        (chunk_bytes, ...). An unknown step, index or node is refused (ReconfigurationError)
        before anything changes. Returns the change's record (see
        ``metrics()["reconfigurations"]``; ``files``: what the files took)."""
        return ray.get(  # type: ignore[no-any-return]
            self.controller.move.remote(step, index, node_id, fetch)
        )

    def insert(
        self,
        after: str,
        operator: Any,
        *,
        name: str | None = None,
        parallelism: int = 1,
        before: str | None = None,
        key_by: str | Callable[..., Any] | None = None,
    ) -> dict[str, Any]:
        """Put ``operator`` as a new step between step ``after`` and its downstream step
        ``before`` (its only one if None) while the job runs: records before the barrier go the
        old way, records after it through the new step. A stateless operator (@rs.map,
        @rs.filter, @rs.flat_map, @rs.map_batches) goes in as it is; a keyed one (@rs.keyed,
        @rs.keyed_batches) needs ``key_by`` (a column, or a function of a RecordBatch) and
        starts with empty state; it then rescales, moves, checkpoints and recovers like any
        keyed step. Returns the change's record (``source_offsets``: where each source emitted
        the barrier; ``checkpoint_after`` with checkpoints on)."""
        return ray.get(  # type: ignore[no-any-return]
            self.controller.insert.remote(after, operator, name, parallelism, before, key_by)
        )

    def remove(self, step: str, *, state: str | None = None) -> dict[str, Any]:
        """Take step ``step`` out while the job runs: its upstream step sends to its downstream
        step again from a barrier on. A keyed step needs ``state``: ``"drop"`` drops its state;
        ``"emit"`` fires its timers (as at end of input) and then sends each key's final state
        downstream as one record (the key column and one column per state: ``state`` for a
        single unnamed state) before its instances end. Returns the change's record."""
        return ray.get(self.controller.remove.remote(step, state))  # type: ignore[no-any-return]

    def stop(self, *, checkpoint: bool = True) -> JobResult | None:
        """Stop the job: first a final checkpoint (sinks publish what came before it; the job can
        resume from it with ``from_checkpoint="latest"``), then every instance ends.
        ``checkpoint=False`` is :meth:`cancel`. None if the job had already ended."""
        self._end_feeders(stop=True)
        self._ended = self._ended or "stopped"
        try:
            out = ray.get(self.controller.stop.remote(checkpoint))
        except ray.exceptions.RayActorError:
            return None
        return _result(out, self, raise_on_error=False)

    def cancel(self) -> JobResult | None:
        """Stop at once, without a final checkpoint: what sinks had not published is dropped."""
        return self.stop(checkpoint=False)


def _result(out: dict[str, Any], job: Job, *, raise_on_error: bool = True) -> JobResult:
    try:
        if out["state"] == "failed" and raise_on_error:
            err = out["error"]
            step, index = err["instance"]
            raise JobFailedError.of_instance(
                out["job"],
                step,
                index,
                err["error"],
                context=err.get("context"),
                traceback=err.get("traceback"),
            )
        results: dict[str, list[Any]] = {}
        for (step, _index), res in sorted(out["results"].items()):
            results.setdefault(step, []).append(res)
        # sink instances a scale-in retired (chained to a keyed step), after the live ones
        for step, res in out.get("retired_results", []):
            results.setdefault(step, []).append(res)
        return JobResult(
            out["job"],
            out["state"],
            out["elapsed_s"],
            results,
            out["metrics"],
            out["origin_ns"],
            out.get("rescales", []),
            out.get("autoscaling", []),
            out.get("recoveries", []),
            out.get("checkpoints", {}),
            out.get("failed_attempts", []),
            out.get("standby_refills", []),
            out.get("spare_refills", []),
            rescales_total=out.get("rescales_total"),
            recoveries_total=out.get("recoveries_total"),
            standby_refills_total=out.get("standby_refills_total"),
            spare_refills_total=out.get("spare_refills_total"),
            failed_attempts_total=out.get("failed_attempts_total"),
            retired_instances_total=out.get("retired_instances_total", 0),
        )
    finally:
        if out["state"] in ("finished", "failed", "stopped"):
            _kill_controller(job)


def _kill_controller(job: Job) -> None:
    try:
        ray.kill(job.controller, no_restart=True)
    except Exception:  # noqa: BLE001, S110 - already gone
        pass


def start(
    flow: Dataflow,
    *,
    parallelism: dict[str, int] | None = None,
    config: RuntimeConfig | None = None,
    state_dir: str | None = None,
    autoscaler: Any = None,
    autoscaler_config: Any = None,
    from_checkpoint: str | int | None = None,
    from_savepoint: str | None = None,
    **config_overrides: Any,
) -> Job:
    """Deploy ``flow`` on Ray and return at once with a :class:`Job`.

    ``autoscaler`` (``"ds2"``, ``"threshold"``, ``"schedule"``, ``"fixed"``, ``"module:attr"`` or
    a policy object) lets the controller choose the parallelism of keyed steps; bounds, cooldown
    and the rest go in ``autoscaler_config`` (see :class:`raystream.autoscaler.AutoscalerConfig`).

    Checkpoints: ``checkpoint_interval_s=10`` (with ``checkpoint_dir``, ``checkpoints_retained``,
    ``restart_attempts``, ``restart_delay_s``, ``restart_failure_rate``, ``heartbeat_timeout_s``)
    takes aligned checkpoints and recovers the job from the latest after a failure.
    ``from_checkpoint="latest"`` (or a checkpoint id) resumes from the job's own checkpoints,
    ``from_savepoint=path`` from a savepoint; ``parallelism`` may differ from theirs.

    ``chaining=False`` runs every step in its own actors (operator chaining is on by default:
    see :mod:`raystream.chaining`; ``flow.options(step, chain=False)`` for one step). The
    stateless steps after a keyed step (given no parallelism, they take its parallelism) and a
    sink given its parallelism run in that step's actors and follow its rescales.
    """
    if not isinstance(flow, Dataflow):
        msg = f"expected a raystream Dataflow, got {type(flow).__name__}: {flow!r}"
        raise ConfigError(msg)
    if config is None:
        config = RuntimeConfig(**config_overrides)
    elif config_overrides:
        msg = f"pass either config= or keyword options, not both (got {sorted(config_overrides)})"
        raise ConfigError(msg)
    steps = flow.with_parallelism(parallelism)  # validate here, in the caller's process
    scaling = _autoscaler_spec(steps, autoscaler, autoscaler_config)
    if scaling is not None and not config.migration_support:
        msg = "an autoscaler needs migration_support=True (it rescales the running job); drop migration_support=False or the autoscaler"
        raise ConfigError(msg)
    ensure_ray()
    cleanup = state_dir is None
    base = state_dir or tempfile.mkdtemp(
        prefix=f"raystream-{re.sub(r'[^A-Za-z0-9_-]', '_', flow.name)}-"
    )
    name = controller_name(flow.name)
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        pass
    else:
        msg = f"a job named {flow.name!r} is already running; stop it first or use another name"
        raise ConfigError(msg)
    controller = (
        controller_actor_class()
        .options(
            name=name,
            namespace=NAMESPACE,
            max_concurrency=1000,
            **controller_options(_driver_node()),
        )
        .remote(
            flow,
            parallelism,
            config,
            base,
            cleanup_state=cleanup,
            autoscaler=scaling,
            restore_from=_restore_from(from_checkpoint, from_savepoint),
            parallelism_given=tuple(parallelism or {}),
        )
    )
    try:
        ray.get(controller.start.remote(controller))
    except ray.exceptions.RayTaskError as e:
        _kill_controller(Job(flow.name, controller))
        cause = e.cause if isinstance(e.cause, RaystreamError) else None
        if cause is not None:  # e.g. a checkpoint to restore from that does not fit
            raise cause from None
        raise
    job = Job(flow.name, controller)
    try:
        job.feeders = _start_feeders(flow, parallelism)
    except BaseException:
        job.stop()
        raise
    return job


def _driver_node() -> str | None:
    """The Ray node this driver runs on (None if Ray cannot say, e.g. through Ray Client)."""
    try:
        return str(ray.get_runtime_context().get_node_id()) or None
    except Exception:  # noqa: BLE001 - no node of its own: the controller goes where Ray puts it
        return None


def _restore_from(checkpoint: str | int | None, savepoint: str | None) -> tuple[str, str] | None:
    if checkpoint is not None and savepoint is not None:
        msg = "pass from_checkpoint or from_savepoint, not both"
        raise ConfigError(msg)
    if savepoint is not None:
        return ("savepoint", str(savepoint))
    if checkpoint is not None:
        return ("checkpoint", str(checkpoint))
    return None


def _autoscaler_spec(steps: dict[str, Any], policy: Any, config: Any) -> Any:
    """(policy object, label, AutoscalerConfig), checked in the caller's process; None: off."""
    if policy is None:
        if config is not None:
            msg = "autoscaler_config was given without autoscaler=; name a policy, e.g. 'ds2'"
            raise ConfigError(msg)
        return None
    from raystream.autoscaler.guard import AutoscalerConfig
    from raystream.autoscaling import resolve_policy

    cfg = AutoscalerConfig.of(config)
    cfg.check_operators({n: s.kind for n, s in steps.items() if s.is_keyed})
    obj, label = resolve_policy(policy, cfg)
    return obj, label, cfg


def _start_feeders(flow: Dataflow, parallelism: dict[str, int] | None) -> list[Any]:
    """Sources fed from this process (Spark DataFrames) start feeding once the job is deployed."""
    steps = flow.with_parallelism(parallelism)
    address = ray.get_runtime_context().gcs_address
    feeders = []
    for step in steps.values():
        if step.kind == "source" and hasattr(step.fn, "start_feeding"):
            ctx = FeedContext(
                flow.name,
                step.name,
                step.parallelism or 1,
                address,
                NAMESPACE,
                os.environ.get("RAY_AUTH_MODE"),  # ray.init turns token auth on by default
                plan_for(steps, step.name, flow.key_space),
            )
            feeders.append(step.fn.start_feeding(ctx))
    return feeders


def run(flow: Dataflow, *, timeout_s: float | None = None, **kwargs: Any) -> JobResult:
    """Run ``flow`` to its end (all sources exhausted) and return what the sinks produced."""
    job = start(flow, **kwargs)
    try:
        result = job.wait(timeout_s)
    except JobFailedError:
        raise  # the controller already stopped the job and is gone
    except BaseException:
        job.stop()
        raise
    if result.state in ("running", "recovering"):
        job.stop()
        msg = f"job {flow.name!r} did not finish within {timeout_s} s; it was stopped"
        raise JobFailedError(msg)
    return result


def attach(name: str) -> Job:
    """The running job ``name`` (from any process connected to the same Ray cluster)."""
    ensure_ray()
    try:
        controller = ray.get_actor(controller_name(name), namespace=NAMESPACE)
    except ValueError:
        from raystream.cluster import running_jobs

        jobs = running_jobs()
        listed = ", ".join(repr(j) for j in jobs) if jobs else "none"
        msg = (
            f"no running job named {name!r} on this Ray cluster (namespace {NAMESPACE!r}); "
            f"running raystream jobs: {listed}"
        )
        raise JobNotFoundError(msg) from None
    return Job(name, controller)
