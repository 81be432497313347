"""Spark -> raystream ingest rate: Spark tasks (``mapInArrow``) push Arrow batches into a job's
source actors. Reported in rows/s from the start of the Spark job that feeds the source until
every source instance was told the input ended (every row accepted), and in CPU seconds per
million rows (every process of the run: Spark's JVM and Python workers, Ray, the job's actors).

    python -m bench.spark_ingest --rows 5000000 --push-rows 10000 --push-rows 100000
    python -m bench.spark_ingest --rows 5000000 --push-rows 100000 --route --presort both
    python -m bench.spark_ingest --rows 3000000 --push-rows 100000 --keycount --direct both --repeat 3

Each setting runs after a warm-up run (up to 1M rows, per presort mode) in one SparkSession: the
first run starts Spark's Python workers and their Ray connections (seconds, paid once per
session), and the first large one is still slower (the JVM's JIT). The job is
``source -> sink`` (null sink: ingest alone); with ``--route``, ``source -> key_by -> a keyed
step at parallelism 2 that keeps no state`` (ingest and routing by key group alone; it emits one
row per batch, rows and the sum of ``seq``, checked against the input); with ``--keycount``, the
full key-count (RocksDB state). ``--presort on|off|both``: whether Spark tasks sort each push by
key group (the source then only cuts it; see raystream.presort); ``both`` alternates the two.
``--direct on|off|both``: whether presorted pushes go straight to the keyed instances, the
source only handing out sequence numbers (raystream.direct), or through the source instance.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

import raystream as rs

__all__ = ["main"]


MEASURES = (
    "rows_per_s: rows / feed_s, feed_s from the feeder's start (the Spark job is submitted) until "
    "every source instance was told the input ended (every row accepted; the dataflow may still "
    "be working off what its buffers hold). cpu_s: CPU seconds of every process under the bench "
    "(Spark's JVM and Python workers, Ray, the job's actors) from the deploy's end until the job "
    "ended (every row processed). One measured run per line, after warm-up runs in the same "
    "SparkSession; presort alternates off/on when both are measured. 2-core machine. "
    "done_rows_per_s: rows / done_s, done_s from the job's start returning (feeders started) "
    "until job.wait returned (every row counted, final metrics collected). direct: tasks push "
    "rows straight to the keyed instances (the source sequences them); alternated with "
    "through-the-source runs when both are measured."
)


@rs.keyed_batches(name="route")
def route_only(batch: rs.KeyedBatch) -> dict[str, list[int]]:
    """No state: one row per batch (its rows and the sum of their ``seq``) for the check."""
    seq = batch.records.column("seq").to_numpy(zero_copy_only=False)
    return {"rows": [len(batch)], "seq_sum": [int(seq.sum())]}


def _flow(name: str, source: Any, consumer: str) -> rs.Dataflow:
    flow = rs.Dataflow(name, num_key_groups=128)
    stream = flow.source(source, parallelism=1)
    if consumer == "keycount":
        from bench.keycount import count_vectorised

        stream.key_by("key").apply(count_vectorised).sink(rs.sinks.null(), name="out")
    elif consumer == "route":
        stream.key_by("key").apply(route_only).sink(rs.sinks.collect(), name="out")
    else:
        stream.sink(rs.sinks.null(), name="out")
    return flow


def _run_once(
    spark: Any,
    rows: int,
    partitions: int,
    push_rows: int,
    consumer: str,
    keys: int,
    presort: bool,
    direct: bool = True,
) -> dict[str, Any]:
    from bench._cpu import CpuSampler

    df = spark.range(0, rows, numPartitions=partitions).selectExpr(
        f"(id * 2654435761) % {keys} as key", "id as seq"
    )
    source = rs.sources.spark(
        df, push_rows=push_rows, presort_key_groups=presort, direct=direct
    )
    flow = _flow(f"bench-spark-ingest-{push_rows}", source, consumer)
    t0 = time.perf_counter()
    parallelism = {"keycount": {"count": 2}, "route": {"route": 2}}.get(consumer)
    job = rs.start(flow, parallelism=parallelism)
    started = time.perf_counter()
    cpu = CpuSampler()
    cpu.start()  # from the deploy's end: the feed, the dataflow behind it, until the job ended
    result = job.wait(3600)
    done_s = time.perf_counter() - started
    used = cpu.stop()
    wall = time.perf_counter() - t0
    stats = job.feeders[0].stats
    taken = sum(m.get("records_in", 0) for m in result.metrics if m.get("step") == "out")
    if stats["accepted"] != rows:
        msg = f"the source accepted {stats['accepted']:,} rows, expected {rows:,}"
        raise click.ClickException(msg)
    if consumer == "null" and taken != rows:
        msg = f"the sink took {taken:,} rows, expected {rows:,}"
        raise click.ClickException(msg)
    if consumer == "route":
        out = result.table("out")
        got = (sum(out.column("rows").to_pylist()), sum(out.column("seq_sum").to_pylist()))
        want = (rows, rows * (rows - 1) // 2)  # seq is 0 .. rows-1, each once
        if got != want:
            msg = f"the keyed step saw (rows, sum of seq) = {got}, expected {want}"
            raise click.ClickException(msg)
    return {
        "rows": rows,
        "partitions": partitions,
        "push_rows": push_rows,
        "consumer": consumer,
        "presort": presort,
        "direct": direct and presort and consumer != "null",
        "rows_reserved": sum(
            int(m["ingest"].get("rows_reserved", 0)) for m in result.metrics if "ingest" in m
        ),
        "done_s": round(done_s, 3),
        "done_rows_per_s": round(rows / done_s),
        "feed_s": round(stats["seconds"], 3),
        "rows_per_s": round(rows / stats["seconds"]),
        "job_wall_s": round(wall, 3),
        "cpu_s": used["total_s"],
        "cpu_s_per_million_rows": round(float(used["total_s"]) / rows * 1e6, 3),
        "cpu_by_process": used["by_process"],
    }


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--rows", type=click.IntRange(min=1), default=5_000_000, help="Rows Spark generates.")
@click.option(
    "--partitions", type=click.IntRange(min=1), default=2, help="Spark partitions (tasks)."
)
@click.option(
    "--push-rows",
    "push_rows_list",
    type=click.IntRange(min=1),
    multiple=True,
    default=(10_000, 100_000),
    help="Rows per push (Arrow batch) from a Spark task; repeatable.",
)
@click.option("--keycount", is_flag=True, help="Run the key-count (RocksDB) behind the source.")
@click.option(
    "--route",
    is_flag=True,
    help="Key by 'key' into a stateless keyed step at parallelism 2 (ingest and routing alone).",
)
@click.option(
    "--presort",
    type=click.Choice(["on", "off", "both"]),
    default="on",
    help="Spark tasks sort pushes by key group (--route/--keycount); 'both' alternates off, on.",
)
@click.option(
    "--direct",
    "direct_mode",
    type=click.Choice(["on", "off", "both"]),
    default="on",
    help="Presorted pushes go straight to the keyed instances; 'both' alternates off, on.",
)
@click.option("--repeat", type=click.IntRange(min=1), default=1, help="Measured runs per setting.")
@click.option(
    "--keys", type=click.IntRange(min=1), default=100_000, help="Distinct keys (--keycount)."
)
@click.option("--report", type=click.Path(path_type=Path), default=None, help="Write JSON here.")
def main(
    rows: int,
    partitions: int,
    push_rows_list: tuple[int, ...],
    keycount: bool,
    route: bool,
    presort: str,
    direct_mode: str,
    repeat: int,
    keys: int,
    report: Path | None,
) -> None:
    """Spark -> actors ingest rate in rows/s."""
    import ray

    if keycount and route:
        raise click.UsageError("--keycount and --route are two consumers; pick one")
    consumer = "keycount" if keycount else "route" if route else "null"
    sorts = {"on": (True,), "off": (False,), "both": (False, True)}[presort]
    directs = {"on": (True,), "off": (False,), "both": (False, True)}[direct_mode]
    modes = [(s, d) for s in sorts for d in directs if s or not d]
    try:
        spark = rs.spark.session("bench-spark-ingest", arrow_batch_rows=max(push_rows_list))
    except rs.RaystreamError as exc:
        raise click.UsageError(str(exc)) from None
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    if keycount and "bench.keycount" in sys.modules:
        cloudpickle.register_pickle_by_value(sys.modules["bench.keycount"])
    ray.init(address="local", namespace="raystream", include_dashboard=False, log_to_driver=False)
    results = []
    try:
        for push_rows in push_rows_list:
            spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", str(push_rows))
            # warm-up, each mode once: Spark's Python workers, their Ray connections, the JIT
            for sort, direct in modes:
                _run_once(
                    spark, min(rows, 1_000_000), partitions, push_rows, consumer, keys, sort, direct
                )
            for _ in range(repeat):
                for sort, direct in modes:  # alternated: all see the same machine
                    r = _run_once(spark, rows, partitions, push_rows, consumer, keys, sort, direct)
                    results.append(r)
                    click.echo(
                        f"push {push_rows:>7,} rows, {consumer}, presort {'on ' if sort else 'off'}"
                        f", direct {'on ' if r['direct'] else 'off'}"
                        f": {r['rows_per_s']:>12,} rows/s, done {r['done_rows_per_s']:>10,} rows/s"
                        f" ({r['rows']:,} rows in "
                        f"{r['feed_s']:.2f} s, {partitions} Spark tasks), "
                        f"{r['cpu_s_per_million_rows']:.2f} CPU s per million rows"
                    )
    finally:
        ray.shutdown()
        spark.stop()
    if report is not None:
        out = {
            "command": " ".join(["python -m bench.spark_ingest", *sys.argv[1:]]),
            "measures": MEASURES,
            "results": results,
        }
        report.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
