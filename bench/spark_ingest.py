"""Spark -> raystream ingest rate: Spark tasks (``mapInArrow``) push Arrow batches into a job's
source actors. Reported in rows/s from the start of the Spark job that feeds the source until
every source instance was told the input ended (every row accepted).

    python -m bench.spark_ingest --rows 5000000 --push-rows 10000 --push-rows 100000

Each setting runs twice in one SparkSession and reports the second run: the first starts Spark's
Python workers and their Ray connections (seconds, paid once per session). The job is
``source -> sink`` (null sink: ingest alone) or, with ``--keycount``, the full key-count.
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


def _flow(name: str, source: Any, keycount: bool) -> rs.Dataflow:
    flow = rs.Dataflow(name, num_key_groups=128)
    stream = flow.source(source, parallelism=1)
    if keycount:
        from bench.keycount import count_vectorised

        stream = stream.key_by("key").apply(count_vectorised)
    stream.sink(rs.sinks.null(), name="out")
    return flow


def _run_once(
    spark: Any, rows: int, partitions: int, push_rows: int, keycount: bool, keys: int
) -> dict[str, Any]:
    df = spark.range(0, rows, numPartitions=partitions).selectExpr(
        f"(id * 2654435761) % {keys} as key", "id as seq"
    )
    flow = _flow(
        f"bench-spark-ingest-{push_rows}", rs.sources.spark(df, push_rows=push_rows), keycount
    )
    t0 = time.perf_counter()
    job = rs.start(flow, parallelism={"count": 2} if keycount else None)
    result = job.wait(3600)
    wall = time.perf_counter() - t0
    stats = job.feeders[0].stats
    taken = sum(m.get("records_in", 0) for m in result.metrics if m.get("step") == "out")
    if stats["accepted"] != rows:
        msg = f"the source accepted {stats['accepted']:,} rows, expected {rows:,}"
        raise click.ClickException(msg)
    if not keycount and taken != rows:
        msg = f"the sink took {taken:,} rows, expected {rows:,}"
        raise click.ClickException(msg)
    return {
        "rows": rows,
        "partitions": partitions,
        "push_rows": push_rows,
        "keycount": keycount,
        "feed_s": round(stats["seconds"], 3),
        "rows_per_s": round(rows / stats["seconds"]),
        "job_wall_s": round(wall, 3),
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
    "--keys", type=click.IntRange(min=1), default=100_000, help="Distinct keys (--keycount)."
)
@click.option("--report", type=click.Path(path_type=Path), default=None, help="Write JSON here.")
def main(
    rows: int,
    partitions: int,
    push_rows_list: tuple[int, ...],
    keycount: bool,
    keys: int,
    report: Path | None,
) -> None:
    """Spark -> actors ingest rate in rows/s."""
    import ray

    try:
        spark = rs.spark.session("bench-spark-ingest", arrow_batch_rows=max(push_rows_list))
    except rs.RaystreamError as exc:
        raise click.UsageError(str(exc)) from None
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(
        sys.modules["bench.keycount"]
        if keycount and "bench.keycount" in sys.modules
        else sys.modules[__name__]
    )
    ray.init(address="local", namespace="raystream", include_dashboard=False, log_to_driver=False)
    results = []
    try:
        for push_rows in push_rows_list:
            spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", str(push_rows))
            _run_once(spark, min(rows, 200_000), partitions, push_rows, keycount, keys)  # warm-up
            r = _run_once(spark, rows, partitions, push_rows, keycount, keys)
            results.append(r)
            click.echo(
                f"push {push_rows:>7,} rows: {r['rows_per_s']:>12,} rows/s "
                f"({r['rows']:,} rows in {r['feed_s']:.2f} s, {partitions} Spark tasks"
                f"{', key-count behind' if keycount else ', null sink'})"
            )
    finally:
        ray.shutdown()
        spark.stop()
    if report is not None:
        report.write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=1))


if __name__ == "__main__":
    main()
