"""Key-count benchmark: count events per key with RocksDB keyed state; report throughput, latency.

Run it from the repository root::

    python -m bench.keycount --events 2000000 --keys 1000000 --zipf 1.1 --parallelism 2
    python -m bench.keycount --rate 100000 --events 1000000 --report report.json
    python -m bench.keycount --input events.parquet --output counts.parquet
    python -m bench.keycount --source spark --input events.parquet
    python -m bench.keycount --source spark-stream --input incoming/ --events 1000000
    python -m bench.keycount --keys 1000000 --value-bytes 1024 --prefill --rate 50000

``--value-bytes N`` gives every key's state an N-byte payload that each batch rewrites (state
size: keys x N); ``--prefill`` writes the state of all ``--keys`` keys (count 0) into the count
instances' RocksDB before the job starts (SST files, ingested), so 1M keys x 1 KB is ~1 GB of
state from the first second. ``--warmup S`` adds ``latency_steady_ms``: latency over what reached
the sink after S seconds (a prefilled state starts cold: the first seconds read it from disk).

The dataflow is ``source -> key_by("key") -> count (keyed, RocksDB) -> sink`` (``--pre-map``: a
stateless ``project`` step after the source, at ``--source-parallelism``; ``--post-map``: a
stateless ``parity`` step after the count, at the count's parallelism); the sink keeps the
latest count per key (bounded memory). Throughput is what the count step took in per second of
the job's run; latency is how old a record's oldest input was when its count reached the sink.
With ``--output`` the final counts (``key``, ``count``, one row per key) are written atomically,
and only when the job succeeded. Bad options or input exit with code 2 and write nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import raystream as rs
from bench._cpu import CpuSampler
from bench._latest import LatestCountSink, latest_counts
from bench._report import build_report, print_summary, write_atomically, write_json

__all__ = ["count_per_key", "count_vectorised", "keycount_flow", "main"]

STEP = "count"
SINK = "latest"
PROJECT = "project"
PARITY = "parity"


@rs.keyed_batches(name=STEP, state=rs.ValueState(int, default=0))
def count_vectorised(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    """All keys of a batch at once: one multi-get, one WriteBatch."""
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


@rs.keyed(name=STEP, state=rs.ValueState(int, default=0))
def count_per_key(key: Any, records: pa.RecordBatch, state: Any) -> Any:
    """One call per key and batch (the simple form)."""
    state.value += len(records)
    yield key, {"count": state.value}


FORMS = {"vectorised": count_vectorised, "per-key": count_per_key}


@rs.map_batches(name=PROJECT)
def project(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Keep the columns the count needs (the key and the record times): a stateless step."""
    return batch.drop_columns([n for n in batch.schema.names if n == "seq"])


@rs.map_batches(name=PARITY)
def parity(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Derive a column from the count (whether it is even): a stateless step after the count."""
    return batch.append_column("even", pc.equal(pc.bit_wise_and(batch["count"], 1), 0))


def keycount_flow(
    source: Any,
    form: str,
    num_key_groups: int = 128,
    value_bytes: int | None = None,
    source_parallelism: int = 1,
    pre_map: bool = False,
    sink_parallelism: int = 1,
    post_map_parallelism: int | None = None,
) -> rs.Dataflow:
    """``source -> key_by -> count -> sink``; ``pre_map``: ``source -> project -> key_by ...``
    with ``project`` at the source's parallelism (chained to it unless chaining is off);
    ``post_map_parallelism``: ``... count -> parity -> sink`` with ``parity`` at that
    parallelism (at the count's: chained to it unless chaining is off); ``sink_parallelism``
    equal to the count's: the sink runs chained in the count's actors."""
    from bench._payload import count_with_payload

    op = FORMS[form] if value_bytes is None else count_with_payload(value_bytes, STEP)
    flow = rs.Dataflow("bench-keycount", num_key_groups=num_key_groups)
    stream = flow.source(source, parallelism=source_parallelism)
    if pre_map:
        stream = stream.apply(project, parallelism=source_parallelism)
    counted = stream.key_by("key").apply(op)
    if post_map_parallelism is not None:
        counted = counted.apply(parity, parallelism=post_map_parallelism)
    counted.sink(LatestCountSink(), name=SINK, parallelism=sink_parallelism)
    return flow


# --------------------------------------------------------------------------------------------
# option checks (before anything runs or is written)


def _check_input(path: Path) -> pa.Schema:
    """The input's schema; a click error (exit 2) unless Parquet with an int/string ``key``."""
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        msg = f"{str(path)!r} is not a readable Parquet file ({exc})"
        raise click.BadParameter(msg, param_hint="'--input'") from None
    if "key" not in schema.names:
        msg = (
            f"{str(path)!r} has no column 'key' (columns: {schema.names}); expected a column "
            "'key' of integers or strings"
        )
        raise click.BadParameter(msg, param_hint="'--input'")
    t = schema.field("key").type
    if not (pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)):
        msg = f"column 'key' of {str(path)!r} has type {t}; expected an integer or string type"
        raise click.BadParameter(msg, param_hint="'--input'")
    return schema


def _check_writable(path: Path | None, option: str) -> None:
    if path is None:
        return
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        msg = f"{str(path)!r} is a directory; expected a file path"
        raise click.BadParameter(msg, param_hint=f"'{option}'")
    if not parent.is_dir():
        msg = f"directory {str(parent)!r} does not exist; create it first"
        raise click.BadParameter(msg, param_hint=f"'{option}'")
    if not os.access(parent, os.W_OK):
        msg = f"directory {str(parent)!r} is not writable"
        raise click.BadParameter(msg, param_hint=f"'{option}'")


def _connect_ray() -> bool:
    """Connect to Ray (``RAY_ADDRESS`` if set, else a new local one); True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS") or "local"
    kwargs: dict[str, Any] = {
        "namespace": "raystream",
        "log_to_driver": True,
        "logging_level": "warning",
    }
    if address == "local":
        kwargs["include_dashboard"] = False
    ray.init(address=address, **kwargs)
    return True


def _pickle_by_value(
    modules: tuple[str, ...] = ("bench.keycount", "bench._latest", "bench._payload"),
) -> None:
    """Ray workers need not import ``bench`` (it is not installed): ship our code by value."""
    from ray import cloudpickle

    for name in modules:
        module = sys.modules.get(name)
        if module is not None:
            cloudpickle.register_pickle_by_value(module)


def _parse_rescales(values: tuple[str, ...], num_key_groups: int) -> list[tuple[int, float]]:
    out = []
    for v in values:
        p, sep, t = v.partition("@")
        try:
            target, at = int(p), float(t)
        except ValueError:
            target, at = -1, -1.0
        if not sep or at < 0 or not 1 <= target <= num_key_groups:
            msg = (
                f"expected P@T: parallelism P in [1, {num_key_groups}] at T >= 0 seconds after the "
                f"start, e.g. 4@5; got {v!r}"
            )
            raise click.BadParameter(msg, param_hint="'--rescale'")
        out.append((target, at))
    return sorted(out, key=lambda r: r[1])


def _parse_kills(values: tuple[str, ...]) -> list[tuple[str, int, float]]:
    out = []
    for v in values:
        where, sep, t = v.partition("@")
        step, colon, index = where.partition(":")
        try:
            i, at = int(index), float(t)
        except ValueError:
            i, at = -1, -1.0
        if not sep or not colon or not step or i < 0 or at < 0:
            msg = f"expected STEP:INDEX@T, e.g. count:0@5 (kill count/0 5 s after the start); got {v!r}"
            raise click.BadParameter(msg, param_hint="'--kill'")
        out.append((step, i, at))
    return sorted(out, key=lambda k: k[2])


def _kill(job: rs.Job, step: str, index: int) -> None:
    """Kill an instance with Ray's own API, by its actor name."""
    import ray

    from raystream.runtime.actors import NAMESPACE, instance_actor_name

    ray.kill(ray.get_actor(instance_actor_name(job.name, step, index), namespace=NAMESPACE))


def _run(
    flow: rs.Dataflow,
    parallelism: int,
    timeout_s: float,
    rescales: list[tuple[int, float]] = (),  # type: ignore[assignment]
    strategy: str = "meces",
    errors: list[str] | None = None,
    kills: list[tuple[str, int, float]] = (),  # type: ignore[assignment]
    killed_at_ns: list[int] | None = None,
    placements: list[dict[int, str]] | None = None,
    **config: Any,
) -> rs.JobResult:
    """Start, rescale at the given times (P@T, T seconds after the start) and kill instances
    (STEP:INDEX@T), wait, stop if still running. Rescale and kill failures go to ``errors``.
    ``placements``: gets the node of each instance of STEP at the start and after each rescale."""
    job = rs.start(flow, parallelism={STEP: parallelism}, migration=strategy, **config)
    errors = errors if errors is not None else []

    def placed() -> None:
        if placements is not None:
            from bench._cluster import instance_nodes

            placements.append(instance_nodes(job.status(), STEP))

    def drive() -> None:
        t0 = time.monotonic()
        placed()
        for target, at in rescales:
            time.sleep(max(0.0, at - (time.monotonic() - t0)))
            try:
                job.rescale(STEP, target, strategy)
                placed()
            except Exception as e:  # noqa: BLE001 - reported, the job keeps running
                errors.append(f"rescale to {target} at {at} s: {e}")

    def kill() -> None:
        t0 = time.monotonic()
        for step, index, at in kills:
            time.sleep(max(0.0, at - (time.monotonic() - t0)))
            try:
                _kill(job, step, index)
                if killed_at_ns is not None:
                    killed_at_ns.append(time.time_ns())
            except Exception as e:  # noqa: BLE001 - e.g. no such instance (any more)
                errors.append(f"kill {step}:{index} at {at} s: {e}")

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    if kills:
        threading.Thread(target=kill, daemon=True).start()
    try:
        result = job.wait(timeout_s)
        driver.join(timeout=60)
    except rs.RaystreamError:
        raise
    except BaseException:
        _stop(job)
        raise
    if result.state == "running":
        _stop(job)
        msg = f"the job did not finish within {timeout_s} s (--timeout); it was stopped"
        raise rs.JobFailedError(msg)
    return result


def _processing_again(
    report: dict[str, Any], result: rs.JobResult, killed_at_ns: list[int]
) -> list[dict[str, Any]]:
    """Per kill: when it happened (s after the job's origin) and how long until the count step
    processed records again, i.e. the end of the first timeline window with count throughput
    that starts after the recovery's new instances were deployed (at_s of the recovery)."""
    step_s = report["window_ms"] / 1000
    out = []
    for at_ns in killed_at_ns:
        kill_s = (at_ns - result.origin_ns) / 1e9
        entry: dict[str, Any] = {"kill_s": round(kill_s, 3), "processing_again_s": None}
        later = [r for r in result.recoveries if r["at_s"] >= kill_s]
        if later:
            deployed = later[0]["at_s"]
            entry["deployed_s"] = round(deployed - kill_s, 3)
            resumed = [row[0] for row in report["timeline"] if row[0] >= deployed and row[1] > 0]
            if resumed:
                entry["processing_again_s"] = round(resumed[0] + step_s - kill_s, 3)
        out.append(entry)
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(float(x), 3)


def _stop(job: rs.Job) -> None:
    with contextlib.suppress(Exception):  # the job already ended
        job.stop()


# --------------------------------------------------------------------------------------------
# the command


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--events", type=click.IntRange(min=1), default=1_000_000, help="Events to generate.")
@click.option(
    "--keys", type=click.IntRange(min=1), default=1_000_000, help="Distinct keys of the generator."
)
@click.option(
    "--zipf",
    type=click.FloatRange(min=0),
    default=1.1,
    help="Zipf exponent of key popularity (0 = uniform).",
)
@click.option("--seed", type=int, default=0, help="Generator seed.")
@click.option(
    "--rate",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Source rate in events/s (0 = unthrottled).",
)
@click.option(
    "--parallelism",
    type=click.IntRange(min=1),
    default=2,
    help="Instances of the keyed count step.",
)
@click.option(
    "--key-type", type=click.Choice(["int", "str"]), default="int", help="Generator key type."
)
@click.option(
    "--hot-key-fraction",
    type=click.FloatRange(0, 1),
    default=0.0,
    help="Share of events that go to one hot key.",
)
@click.option(
    "--input",
    "input_path",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="Parquet file with a 'key' column (int or string); replaces the generator. With "
    "--source spark-stream: the directory to watch for new Parquet files.",
)
@click.option(
    "--source",
    "source_kind",
    type=click.Choice(["auto", "generator", "parquet", "spark", "spark-stream"]),
    default="auto",
    help="Where events come from; auto = parquet with --input, else the generator. spark reads "
    "--input through a Spark DataFrame whose tasks push into the job; spark-stream watches the "
    "--input directory with Structured Streaming until --events rows arrived or --idle-timeout.",
)
@click.option(
    "--idle-timeout",
    "idle_timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    help="spark-stream: end the input after this many seconds without new rows.",
)
@click.option(
    "--output",
    type=click.Path(path_type=Path),
    default=None,
    help="Write the final counts (key, count) to this Parquet file.",
)
@click.option(
    "--report", type=click.Path(path_type=Path), default=None, help="Write a JSON report here."
)
@click.option(
    "--batch-rows",
    type=click.IntRange(min=1),
    default=100_000,
    help="Rows per batch (source reads and channel batches).",
)
@click.option(
    "--linger-ms",
    type=click.FloatRange(min=0),
    default=5.0,
    help="Longest a partial batch waits before it is sent.",
)
@click.option(
    "--form",
    type=click.Choice(["vectorised", "per-key"]),
    default="vectorised",
    help="Operator form: @rs.keyed_batches or @rs.keyed.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=1),
    default=3600.0,
    help="Give up (and stop the job) after this many seconds.",
)
@click.option(
    "--rescale",
    "rescale_at",
    multiple=True,
    metavar="P@T",
    help="Rescale the count step to parallelism P at T seconds after the start (repeatable).",
)
@click.option(
    "--strategy",
    default="meces",
    help="Migration strategy: meces, all_at_once, fluid, batched, lazy, stop_restart or module:attr.",
)
@click.option(
    "--source-parallelism",
    type=click.IntRange(min=1),
    default=1,
    help="Instances of the source (and of --pre-map's step).",
)
@click.option(
    "--pre-map",
    is_flag=True,
    help="Put a stateless step (project: drop the seq column) between the source and the count.",
)
@click.option(
    "--post-map",
    is_flag=True,
    help="Put a stateless step (parity: derive a column from the count) between the count and "
    "the sink, at --parallelism (chained to the count unless chaining is off).",
)
@click.option(
    "--sink-parallelism",
    type=click.IntRange(min=1),
    default=1,
    help="Instances of the sink; at --parallelism the sink runs chained in the count's actors.",
)
@click.option(
    "--chaining/--no-chaining",
    default=True,
    help="Operator chaining: the source and the steps after it at its parallelism share an "
    "actor, and so do the count and a sink at its parallelism.",
)
@click.option(
    "--migration-support/--no-migration-support",
    default=True,
    help="Off: no per-sub-group tracking (to measure its cost); rescales are refused.",
)
@click.option(
    "--standby-instances",
    type=click.IntRange(min=0),
    default=None,
    help="Warm standby actors the job keeps for scale-outs (default: RuntimeConfig's, 2); 0 "
    "separates their one-time start-up from the per-batch cost of migration support.",
)
@click.option(
    "--standbys-before-sources/--standbys-after-start",
    default=True,
    help="Start the warm standbys with the job's actors, the sources once they are up (the "
    "benchmark's default; RuntimeConfig(standby_before_sources=True)), or beside the running "
    "job (the library's default).",
)
@click.option(
    "--checkpoint-interval",
    "checkpoint_interval_s",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Checkpoint every S seconds (0: off); failures then recover from the latest.",
)
@click.option("--checkpoint-dir", default=None, help="Checkpoint storage (path or URI).")
@click.option(
    "--kill",
    "kill_at",
    multiple=True,
    metavar="STEP:INDEX@T",
    help="Kill instance INDEX of STEP (ray.kill) T seconds after the start (repeatable).",
)
@click.option(
    "--value-bytes",
    type=int,
    default=None,
    help="Give each key's state an N-byte payload that every batch rewrites (state: keys x N).",
)
@click.option(
    "--prefill",
    is_flag=True,
    help="Write the state of all --keys keys into the count instances before the job starts.",
)
@click.option(
    "--warmup",
    "warmup_s",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Also report latency over what reached the sink after this many seconds of the job "
    "(latency_steady_ms), leaving out a cold start.",
)
@click.option("--quiet", "-q", is_flag=True, help="Print nothing on success.")
def main(
    events: int,
    keys: int,
    zipf: float,
    seed: int,
    rate: float,
    parallelism: int,
    key_type: str,
    hot_key_fraction: float,
    input_path: Path | None,
    source_kind: str,
    idle_timeout_s: float,
    output: Path | None,
    report: Path | None,
    batch_rows: int,
    linger_ms: float,
    form: str,
    timeout_s: float,
    rescale_at: tuple[str, ...],
    strategy: str,
    source_parallelism: int,
    pre_map: bool,
    post_map: bool,
    sink_parallelism: int,
    chaining: bool,
    migration_support: bool,
    standby_instances: int | None,
    standbys_before_sources: bool,
    checkpoint_interval_s: float,
    checkpoint_dir: str | None,
    kill_at: tuple[str, ...],
    value_bytes: int | None,
    prefill: bool,
    warmup_s: float,
    quiet: bool,
) -> None:
    """Key-count on raystream: events per key, counted in RocksDB keyed state."""
    num_key_groups = 128
    if parallelism > num_key_groups:
        msg = f"at most {num_key_groups} (the number of key groups), got {parallelism}"
        raise click.BadParameter(msg, param_hint="'--parallelism'")
    rescales = _parse_rescales(rescale_at, num_key_groups)
    kills = _parse_kills(kill_at)
    if value_bytes is not None and value_bytes <= 0:
        msg = f"expected a payload size in bytes > 0 (e.g. 1024), got {value_bytes}"
        raise click.BadParameter(msg, param_hint="'--value-bytes'")
    if value_bytes is not None and form != "vectorised":
        msg = "--value-bytes works with --form vectorised only"
        raise click.BadParameter(msg, param_hint="'--form'")
    if kills and not checkpoint_interval_s:
        click.echo("warning: --kill without --checkpoint-interval fails the job", err=True)
    from raystream.errors import PluginNotFoundError
    from raystream.plugins import MIGRATION_STRATEGIES, load

    try:
        load(MIGRATION_STRATEGIES, strategy)
    except PluginNotFoundError as exc:
        raise click.BadParameter(str(exc), param_hint="'--strategy'") from None
    if rescales and not migration_support:
        msg = "--rescale needs migration support; drop --no-migration-support"
        raise click.BadParameter(msg, param_hint="'--rescale'")
    _check_writable(output, "--output")
    _check_writable(report, "--report")
    if source_kind == "auto":
        source_kind = "parquet" if input_path is not None else "generator"
    if prefill and source_kind != "generator":
        msg = (
            f"--prefill writes the state of the generator's --keys keys; it needs the generator "
            f"source, not {source_kind} (drop --input/--source or --prefill)"
        )
        raise click.BadParameter(msg, param_hint="'--prefill'")
    spark_session = None
    if source_kind in ("spark", "spark-stream"):
        source, spark_session = _spark_source(source_kind, input_path, events, idle_timeout_s, batch_rows)
    elif source_kind == "parquet":
        if input_path is None or input_path.is_dir():
            msg = "--source parquet needs --input PATH.parquet (a file)"
            raise click.BadParameter(msg, param_hint="'--input'")
        _check_input(input_path)
        try:
            source: Any = rs.sources.parquet(input_path, batch_rows=batch_rows, rate_eps=rate)
        except rs.RaystreamError as exc:
            raise click.BadParameter(str(exc), param_hint="'--input'") from None
    else:
        source = rs.sources.generator(
            events=events,
            keys=keys,
            zipf=zipf,
            seed=seed,
            rate_eps=rate,
            key_type=key_type,
            hot_key_fraction=hot_key_fraction,
        )
    config = {
        "events": events,
        "keys": keys,
        "zipf": zipf,
        "seed": seed,
        "rate": rate,
        "parallelism": parallelism,
        "key_type": key_type,
        "hot_key_fraction": hot_key_fraction,
        "input": str(input_path) if input_path else None,
        "source_kind": source_kind,
        "output": str(output) if output else None,
        "batch_rows": batch_rows,
        "linger_ms": linger_ms,
        "form": form,
        "source": source.describe(),
        "num_key_groups": num_key_groups,
        "rescale": [f"{p}@{t:g}" for p, t in rescales],
        "strategy": strategy,
        "migration_support": migration_support,
        "standby_instances": standby_instances,
        "standbys_before_sources": standbys_before_sources,
        "source_parallelism": source_parallelism,
        "pre_map": pre_map,
        "post_map": post_map,
        "sink_parallelism": sink_parallelism,
        "chaining": chaining,
        "checkpoint_interval_s": checkpoint_interval_s,
        "kill": [f"{s}:{i}@{t:g}" for s, i, t in kills],
        "value_bytes": value_bytes,
        "prefill": prefill,
        "warmup_s": warmup_s,
    }
    flow = keycount_flow(
        source,
        form,
        num_key_groups,
        value_bytes,
        source_parallelism,
        pre_map,
        sink_parallelism,
        post_map_parallelism=parallelism if post_map else None,
    )
    state_dir = None
    if prefill:
        import tempfile

        from bench._payload import prefill_state

        state_dir = tempfile.mkdtemp(prefix="raystream-bench-keycount-")
        filled = prefill_state(state_dir, flow, STEP, parallelism, keys, key_type, value_bytes)
        config["prefilled"] = filled
        if not quiet:
            click.echo(
                f"prefilled {filled['rows']:,} keys, {filled['bytes'] / 1e6:,.0f} MB of state "
                f"in {filled['seconds']:.1f} s"
            )

    started_ray = _connect_ray()
    try:
        _pickle_by_value()
        cpu = CpuSampler()
        cpu.start()
        t0 = time.perf_counter()
        rescale_errors: list[str] = []
        killed_at_ns: list[int] = []
        try:
            result = _run(
                flow,
                parallelism,
                timeout_s,
                rescales,
                strategy,
                rescale_errors,
                kills,
                killed_at_ns,
                checkpoint_interval_s=checkpoint_interval_s,
                **({"checkpoint_dir": checkpoint_dir} if checkpoint_dir else {}),
                **({"state_dir": state_dir} if state_dir else {}),
                migration_support=migration_support,
                **({} if standby_instances is None else {"standby_instances": standby_instances}),
                standby_before_sources=standbys_before_sources,
                chaining=chaining,
                batch_rows=batch_rows,
                source_batch_rows=batch_rows,
                linger_ms=linger_ms,
            )
        except rs.RaystreamError as exc:
            click.echo(f"Error: the key-count job failed: {exc}", err=True)
            sys.exit(1)
        wall_s = time.perf_counter() - t0
        cpu_used = cpu.stop()
        parts = [t for t in result.results.get(SINK, []) if t is not None]
        final = latest_counts(pa.concat_tables(parts)) if parts else None
        keys_out = final.num_rows if final is not None else 0
        data = build_report(
            result,
            step=STEP,
            config=config,
            extra={
                "keys_out": keys_out,
                "wall_s": round(wall_s, 3),
                "rescale_errors": rescale_errors,
                "recoveries": result.recoveries,
                "kills": [],
                "checkpoints": result.checkpoints,
                "cpu_s": cpu_used,
            },
        )
        if data["events_in"]:
            data["cpu_s_per_m_events"] = round(
                float(cpu_used["total_s"]) / data["events_in"] * 1e6, 3  # type: ignore[arg-type]
            )
        data["kills"] = _processing_again(data, result, killed_at_ns)
        if warmup_s > 0:
            steady = (result.latency() or rs.metrics.LatencyRecorder(0)).summary_between(
                warmup_s, 1e9
            )
            data["latency_steady_ms"] = {
                "from_s": warmup_s,
                "p50": _round(steady["p50_ms"]),
                "p99": _round(steady["p99_ms"]),
                "max": _round(steady["max_ms"]),
                "records": steady["count"],
            }
        total = int(np.asarray(final["count"]).sum()) if final is not None else 0
        # every event counted once, and every count reported; after a recovery the count step's
        # last attempt took in only what was replayed, so the whole input is the reference
        expected = events if result.recoveries and source_kind == "generator" else data["events_in"]
        if total != expected:
            click.echo(
                f"Error: the final counts add up to {total:,}, but {expected:,} events were "
                "counted in; not writing results",
                err=True,
            )
            sys.exit(1)
        data["exact"] = True
        if output is not None:
            table = (
                final
                if final is not None
                else pa.table({"key": pa.array([], pa.int64()), "count": pa.array([], pa.int64())})
            )
            write_atomically(output, lambda tmp: pq.write_table(table, tmp))
        if report is not None:
            write_json(report, data)
        if not quiet:
            print_summary(data)
    finally:
        if started_ray:
            import ray

            ray.shutdown()
        if state_dir is not None:  # the prefilled state (rs.start leaves a given state_dir)
            shutil.rmtree(state_dir, ignore_errors=True)
        if spark_session is not None:
            spark_session.stop()
        if source_kind == "spark-stream":  # Spark's checkpoint of this run (a temp dir)
            shutil.rmtree(source.checkpoint_location, ignore_errors=True)


def _spark_source(
    kind: str, input_path: Path | None, events: int, idle_timeout_s: float, batch_rows: int
) -> tuple[Any, Any]:
    """A Spark (batch or streaming) source over ``--input`` and the session it runs in."""
    import tempfile

    if input_path is None:
        msg = f"--source {kind} needs --input ({'a Parquet file or directory' if kind == 'spark' else 'a directory to watch'})"
        raise click.BadParameter(msg, param_hint="'--input'")
    if kind == "spark-stream" and not input_path.is_dir():
        msg = f"--source spark-stream watches a directory; {str(input_path)!r} is a file"
        raise click.BadParameter(msg, param_hint="'--input'")
    files = sorted(input_path.glob("*.parquet")) if input_path.is_dir() else [input_path]
    if kind == "spark" and not files:
        msg = f"{str(input_path)!r} holds no *.parquet files"
        raise click.BadParameter(msg, param_hint="'--input'")
    schema = _check_input(files[0]) if files else pa.schema([("key", pa.int64()), ("seq", pa.int64())])
    try:
        spark = rs.spark.session("bench-keycount", arrow_batch_rows=batch_rows)
    except rs.RaystreamError as exc:
        raise click.UsageError(str(exc)) from None
    from pyspark.sql.pandas.types import from_arrow_schema

    if kind == "spark":
        df = spark.read.parquet(str(input_path))
        return rs.sources.spark(df, push_rows=batch_rows), spark
    sdf = spark.readStream.schema(from_arrow_schema(schema)).parquet(str(input_path))
    checkpoint = tempfile.mkdtemp(prefix="raystream-bench-stream-")
    source = rs.sources.spark_stream(
        sdf,
        checkpoint_location=checkpoint,
        max_rows=events,
        idle_timeout_s=idle_timeout_s,
        push_rows=batch_rows,
    )
    return source, spark


if __name__ == "__main__":
    main()
