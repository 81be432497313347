"""``python -m bench.nexmark``: run one NEXMark query on raystream; report events/s and latency.

Examples (from the repository root)::

    python -m bench.nexmark --query q1 --events 2000000 --rate 100000 --parallelism 2
    python -m bench.nexmark --query q0 --input data/ --output out/ --report q0.json
    python -m bench.nexmark --generate data/ --events 10000000     # only write the Parquet files

Input: ``--input DIR`` with ``person.parquet``, ``auction.parquet``, ``bid.parquet`` (as
:func:`bench.nexmark.generator.write_parquet` writes them), or ``--events N --rate EPS`` to
generate them first into a temporary folder (``--rate`` is the event-time rate: ``dateTime``
advances by ``1/EPS`` s per event). Each table the query reads is one source replaying its file
in order (= ``dateTime`` order); ``--replay-rate`` throttles the replay in wall-clock time (each
table at its share of the rate), else it runs as fast as the job takes it.

``--output DIR`` writes the result under ``DIR/<query>/`` as Parquet: append-only queries
stream their rows into part files (one per sink instance); updating queries (q4, q5, q9) stream
their changes through ``rs.sinks.parquet(..., mode="upsert", key=<the result's key>,
order_by="_version")``, and ``rs.read_upsert(DIR/<query>)`` (or the DuckDB query of
:mod:`raystream.upsert`) gives the final result. ``--check`` compares the final result with the
DuckDB oracle (the whole result is then collected in memory); q12, whose windows follow the
wall clock, is checked by :func:`bench.nexmark.processing_time.check` instead.

The report: events/s, sink latency (``now - ingest_ts`` of the oldest input row behind an
output) and, for windowed queries, ``watermark_lag_ms`` (:mod:`bench.nexmark.lag`): per window
result, its arrival at the sink minus the wall-clock time at which the window closed at the
sources.
"""

from __future__ import annotations

import shlex
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import pyarrow as pa
import pyarrow.parquet as pq

import raystream as rs
from bench.nexmark import generator, oracle, processing_time
from bench.nexmark.lag import LAG_SINK, WindowEndSink, watermark_lag
from bench.nexmark.queries import (
    KIND,
    QUERIES,
    SINK,
    VERSION,
    build_flow,
    final_result,
    result_rows,
)

__all__ = ["main", "run_query"]


@dataclass(frozen=True)
class PartFileSink:
    """Instance ``i`` writes its rows as the query's result columns (its ``finish`` applied, the
    runtime's columns dropped) to ``{path}/part-{i:05d}.parquet``, atomically; for append-only
    queries. A query with ``partition_by`` (q10) writes Hive-style folders
    ``{path}/dt=.../hm=.../part-*.parquet`` instead, and commits each folder as the query's
    ``partition_commit`` says (q10: a ``_SUCCESS`` file once the watermark passed the minute
    plus one minute; every folder at the end of input). ``close()`` returns the inner writer's
    :class:`raystream.sinks.WrittenFile` (its ``rows``: the rows written)."""

    path: str
    query: str

    # what the job's partition committer reads from a sink (as from rs.sinks.parquet)
    @property
    def partition_by(self) -> tuple[str, ...]:
        return QUERIES[self.query].partition_by

    @property
    def partition_commit(self) -> Any:
        return QUERIES[self.query].partition_commit

    filesystem = None

    def open(self, index: int, parallelism: int) -> Any:
        inner = rs.sinks.parquet(
            self.path, partition_by=self.partition_by, partition_commit=self.partition_commit
        ).open(index, parallelism)
        return _ResultRows(inner, self.query)

    def describe(self) -> str:
        return f"nexmark_parts({self.path!r}, {self.query})"


class _ResultRows:
    def __init__(self, inner: Any, query: str) -> None:
        self._inner = inner
        self._finish = QUERIES[query].finish
        self._schema = oracle.SCHEMA[query]
        self.rows = 0

    def write(self, batch: pa.RecordBatch) -> None:
        table = pa.Table.from_batches([batch])
        if self._finish is not None:
            table = self._finish(table)
        table = table.select(self._schema.names).cast(self._schema)
        for part in table.to_batches():
            self._inner.write(part)
        self.rows += table.num_rows

    def close(self) -> Any:
        return self._inner.close()

    def __getattr__(self, name: str) -> Any:
        # two-phase commit (pre_commit, commit, restore, ...) is the inner Parquet writer's
        if name.startswith("__") or name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def abort(self) -> None:
        self._inner.abort()


@dataclass(frozen=True)
class UpsertResultSink:
    """The changes of an updating query as the result's columns (its ``finish`` applied) plus
    ``_version`` (and ``_kind``), into ``rs.sinks.parquet(path, mode="upsert", key=<the
    result's key>, order_by="_version")``. ``close()`` returns the inner writer's result."""

    path: str
    query: str

    def _inner(self) -> Any:
        spec = QUERIES[self.query]
        return rs.sinks.parquet(
            self.path,
            mode="upsert",
            key=spec.key,
            order_by=VERSION,
            kind_column=KIND if spec.deletes else None,
        )

    def open(self, index: int, parallelism: int) -> Any:
        return _ChangeRows(self._inner().open(index, parallelism), self.query)

    def describe(self) -> str:
        return f"nexmark_changes({self._inner().describe()}, {self.query})"


class _ChangeRows:
    def __init__(self, inner: Any, query: str) -> None:
        self._inner = inner
        self._query = query
        schema = oracle.SCHEMA[query]
        extra = [pa.field(VERSION, pa.int64())]
        if QUERIES[query].deletes:
            extra.append(pa.field(KIND, pa.string()))
        self._schema = pa.schema([*schema, *extra])

    def write(self, batch: pa.RecordBatch) -> None:
        table = result_rows(self._query, pa.Table.from_batches([batch]))
        table = table.select(self._schema.names).cast(self._schema)
        for part in table.to_batches():
            self._inner.write(part)

    def close(self) -> Any:
        return self._inner.close()

    def abort(self) -> None:
        self._inner.abort()


def _pickle_by_value() -> None:
    """Ray workers need not import ``bench`` (it is not installed): ship it by value."""
    from ray import cloudpickle

    for name in (
        "bench.nexmark.queries",
        "bench.nexmark.cli",
        "bench.nexmark.oracle",
        "bench.nexmark.lag",
        "bench.nexmark.columns",
        "bench.nexmark.projections",
        "bench.nexmark.daily",
        "bench.nexmark.ranking",
        "bench.nexmark.category_join",
        "bench.nexmark.side_input",
        "bench.nexmark.seller_average",
    ):
        module = sys.modules.get(name)
        if module is not None:
            cloudpickle.register_pickle_by_value(module)


def table_sources(
    directory: Path,
    tables: tuple[str, ...],
    *,
    batch_rows: int,
    replay_rate_eps: float = 0.0,
    columns: dict[str, tuple[str, ...]] | None = None,
) -> dict[str, Any]:
    """One Parquet source per table; with a replay rate, each at its share (1:3:46 of 50);
    ``columns``: per table the columns to read (the others are not read)."""
    share = {"person": 1 / 50, "auction": 3 / 50, "bid": 46 / 50}
    return {
        t: rs.sources.parquet(
            directory / f"{t}.parquet",
            batch_rows=batch_rows,
            rate_eps=replay_rate_eps * share[t],
            columns=(columns or {}).get(t),
        )
        for t in tables
    }


def run_query(
    query: str,
    sources: dict[str, Any],
    *,
    parallelism: int,
    sink: Any = None,
    rescales: list[tuple[int, float]] = (),  # type: ignore[assignment]
    strategy: str = "meces",
    timeout_s: float = 600.0,
    max_out_of_orderness_ms: int = 0,
    errors: list[str] | None = None,
    extra_sinks: dict[str, Any] | None = None,
    source_parallelism: int = 1,
    **config: Any,
) -> rs.JobResult:
    """Build, start, rescale the query's step at the given times (P@T), wait; a job still
    running at the timeout is stopped and raises. ``source_parallelism``: instances of each
    table's source (each reads a share of the file's row groups)."""
    sink = sink if sink is not None else rs.sinks.collect()
    flow, spec = build_flow(
        query,
        sources,
        sink,
        max_out_of_orderness_ms=max_out_of_orderness_ms,
        extra_sinks=extra_sinks,
    )
    steps = {spec.step: parallelism, **{t: source_parallelism for t in spec.tables}}
    job = rs.start(flow, parallelism=steps, migration=strategy, **config)
    errors = errors if errors is not None else []

    def drive() -> None:
        t0 = time.monotonic()
        for target, at in rescales:
            time.sleep(max(0.0, at - (time.monotonic() - t0)))
            try:
                job.rescale(spec.step, target, strategy)
            except Exception as e:  # noqa: BLE001 - reported, the job keeps running
                errors.append(f"rescale to {target} at {at} s: {e}")

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    try:
        result = job.wait(timeout_s)
        driver.join(timeout=60)
    except rs.RaystreamError:
        raise
    except BaseException:
        job.stop()
        raise
    if result.state == "running":
        job.stop()
        msg = f"{query} did not finish within {timeout_s} s; it was stopped"
        raise rs.JobFailedError(msg)
    return result


def build_report(
    result: rs.JobResult, query: str, sources: tuple[str, ...], config: dict[str, Any]
) -> dict[str, Any]:
    """events/s (records the sources emitted per second of the run), sink latency, timeline."""
    from bench._report import build_report as keycount_report

    spec = QUERIES[query]
    base = keycount_report(result, step=spec.step, config=config)
    events = sum(int(m.get("records_out", 0)) for t in sources for m in result.step_metrics(t))
    elapsed = float(result.elapsed_s)
    # the query's own sink only (a second sink on the result stream would count rows twice)
    snaps = [m["latency"] for m in result.step_metrics(SINK) if m.get("latency")]
    if snaps:
        from raystream.metrics import LatencyRecorder

        summary = LatencyRecorder.merge_snapshots(snaps).summary()
        base["latency_ms"] = {
            k: None if summary[f"{k}_ms"] is None else round(float(summary[f"{k}_ms"]), 3)
            for k in ("p50", "p99", "max")
        }
        base["latency_records"] = summary["count"]
    base.update(active_rate(result, spec.step, events))
    lag = watermark_lag(result, sources) if spec.windowed else None
    if lag is not None:
        base["watermark_lag_ms"] = lag
    base.update(
        {
            "benchmark": f"nexmark-{query}",
            "query": query,
            "events": events,
            "throughput_eps": round(events / elapsed, 1) if elapsed > 0 else 0.0,
            "step": spec.step,
            "step_records_in": base.pop("events_in"),
            "step_records_out": base.pop("events_out"),
        }
    )
    return base


def active_rate(result: rs.JobResult, step: str, events: int) -> dict[str, Any]:
    """events/s over the span in which the query's step received records: from the start of
    the first 250 ms throughput window with a record into the step to the end of the last one
    (deploy and shutdown left out; resolution one window, so the span is at most one window
    too long at each end and the rate errs low)."""
    from raystream.metrics import WindowedCounter

    snaps = [m["throughput"] for m in result.step_metrics(step) if m.get("throughput")]
    timeline = WindowedCounter.merge_snapshots(snaps).timeline() if snaps else []
    if not timeline:
        return {}
    window_s = WindowedCounter.merge_snapshots(snaps).window_ms / 1000
    span = timeline[-1][0] - timeline[0][0] + window_s
    return {
        "active_span_s": round(span, 3),
        "active_throughput_eps": round(events / span, 1),
        "active_definition": (
            "events the sources emitted / span from the start of the first to the end of the "
            f"last {window_s * 1000:g} ms window in which step {step!r} received records"
        ),
    }


def _parse_rescales(values: tuple[str, ...], num_key_groups: int) -> list[tuple[int, float]]:
    from bench.keycount import _parse_rescales as parse

    return parse(values, num_key_groups)


def _connect_ray() -> bool:
    from bench.keycount import _connect_ray as connect

    return connect()


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option(
    "--query",
    type=click.Choice(sorted({*oracle.QUERIES, *QUERIES}, key=lambda q: int(q[1:]))),
    default="q0",
)
@click.option("--events", type=click.IntRange(min=1), default=1_000_000, help="Events to generate.")
@click.option(
    "--rate",
    type=click.FloatRange(min=0, min_open=True),
    default=10_000.0,
    help="Event-time rate of the generator (events per second of dateTime).",
)
@click.option("--seed", type=int, default=0)
@click.option(
    "--input",
    "input_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Directory with person/auction/bid.parquet; replaces the generator.",
)
@click.option(
    "--generate",
    "generate_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Only generate the Parquet files into this directory (and report rows/s).",
)
@click.option("--parallelism", type=click.IntRange(min=1), default=2)
@click.option(
    "--source-parallelism",
    type=click.IntRange(min=1),
    default=1,
    help="Instances of each table's source (each reads a share of the row groups); at the "
    "query's parallelism a stateless query's step runs in the source's actors (chained).",
)
@click.option(
    "--rescale", "rescale_at", multiple=True, metavar="P@T", help="Rescale at T s (keyed queries)."
)
@click.option("--strategy", default="meces", help="Migration strategy of rescales.")
@click.option(
    "--replay-rate",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Wall-clock replay rate in events/s over all tables (0: as fast as possible).",
)
@click.option("--output", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option(
    "--check",
    is_flag=True,
    help="Compare the final result with the DuckDB oracle (q12: check its invariants).",
)
@click.option("--batch-rows", type=click.IntRange(min=1), default=65_536)
@click.option("--linger-ms", type=click.FloatRange(min=0), default=5.0)
@click.option(
    "--checkpoint-interval",
    "checkpoint_interval_s",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Seconds between checkpoints (0: none). With checkpoints the Parquet output is "
    "published by each checkpoint, and q10 commits its minute folders while it runs.",
)
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=3600.0)
@click.option("--quiet", "-q", is_flag=True)
def main(
    query: str,
    events: int,
    rate: float,
    seed: int,
    input_dir: Path | None,
    generate_dir: Path | None,
    parallelism: int,
    source_parallelism: int,
    rescale_at: tuple[str, ...],
    strategy: str,
    replay_rate: float,
    output: Path | None,
    report: Path | None,
    check: bool,
    batch_rows: int,
    linger_ms: float,
    checkpoint_interval_s: float,
    timeout_s: float,
    quiet: bool,
) -> None:
    """One NEXMark query on raystream."""
    config_gen = generator.NexmarkConfig(events=events, rate_eps=rate, seed=seed)
    if generate_dir is not None:
        t0 = time.perf_counter()
        generator.write_parquet(config_gen, generate_dir)
        dt = time.perf_counter() - t0
        click.echo(
            f"{events:,} events in {dt:.2f} s: {events / dt:,.0f} events/s -> {generate_dir}"
        )
        return
    if query not in QUERIES:
        msg = f"{query} has an oracle but no raystream dataflow yet; built: {sorted(QUERIES)}"
        raise click.BadParameter(msg, param_hint="'--query'")
    spec = QUERIES[query]
    if parallelism > 128:
        raise click.BadParameter(
            "at most 128 (the number of key groups)", param_hint="'--parallelism'"
        )
    rescales = _parse_rescales(rescale_at, 128)
    from raystream.errors import PluginNotFoundError
    from raystream.plugins import MIGRATION_STRATEGIES, load

    try:
        load(MIGRATION_STRATEGIES, strategy)
    except PluginNotFoundError as exc:
        raise click.BadParameter(str(exc), param_hint="'--strategy'") from None
    if rescales and not spec.keyed:
        msg = f"{query} has no keyed step to rescale (only keyed steps rescale)"
        raise click.BadParameter(msg, param_hint="'--rescale'")
    if input_dir is not None:
        missing = [t for t in spec.tables if not (input_dir / f"{t}.parquet").is_file()]
        missing += [f for f in spec.side_inputs if not (input_dir / f"{f}.csv").is_file()]
        if missing:
            names = [f"{t}.csv" if t in spec.side_inputs else f"{t}.parquet" for t in missing]
            msg = f"{str(input_dir)!r} has no {', '.join(names)}"
            raise click.BadParameter(msg, param_hint="'--input'")
    tmp: str | None = None
    started_ray = False
    try:
        if input_dir is None:
            tmp = tempfile.mkdtemp(prefix="raystream-nexmark-")
            t0 = time.perf_counter()
            generator.write_parquet(config_gen, tmp)
            gen_s = time.perf_counter() - t0
            data = Path(tmp)
        else:
            gen_s = None
            data = input_dir
        sources = table_sources(
            data,
            spec.tables,
            batch_rows=batch_rows,
            replay_rate_eps=replay_rate,
            columns=dict(spec.columns),
        )
        sources.update({f: data / f"{f}.csv" for f in spec.side_inputs})
        written: Any = None
        if output is None and spec.partition_by:  # q10: the files are the query's point
            tmp = tmp or tempfile.mkdtemp(prefix="raystream-nexmark-")
            output = Path(tmp) / "output"
        if output is not None:
            make = UpsertResultSink if spec.updating else PartFileSink
            written = make(str(output / query), query)
        extra: dict[str, Any] = {}
        if check:
            sink: Any = rs.sinks.collect()
            if written is not None:
                extra["output"] = written
        else:
            sink = written if written is not None else rs.sinks.null()
        if spec.windowed:
            extra[LAG_SINK] = WindowEndSink(query)
        started_ray = _connect_ray()
        _pickle_by_value()
        errors: list[str] = []
        try:
            result = run_query(
                query,
                sources,
                parallelism=parallelism,
                sink=sink,
                rescales=rescales,
                strategy=strategy,
                timeout_s=timeout_s,
                errors=errors,
                extra_sinks=extra,
                source_parallelism=source_parallelism,
                batch_rows=batch_rows,
                source_batch_rows=batch_rows,
                linger_ms=linger_ms,
                **(
                    {
                        "checkpoint_interval_s": checkpoint_interval_s,
                        "checkpoint_dir": str(Path(tmp or tempfile.mkdtemp()) / "checkpoints"),
                    }
                    if checkpoint_interval_s > 0
                    else {}
                ),
            )
        except rs.RaystreamError as exc:
            click.echo(f"Error: {query} failed: {exc}", err=True)
            sys.exit(1)
        config = {
            "query": query,
            "input": str(input_dir) if input_dir else None,
            "events": events if input_dir is None else None,
            "rate": rate if input_dir is None else None,
            "seed": seed,
            "parallelism": parallelism,
            "source_parallelism": source_parallelism,
            "rescale": [f"{p}@{t:g}" for p, t in rescales],
            "strategy": strategy,
            "replay_rate": replay_rate,
            "batch_rows": batch_rows,
            "linger_ms": linger_ms,
            "checkpoint_interval_s": checkpoint_interval_s,
        }
        data_report = build_report(result, query, spec.tables, config)
        data_report["command"] = " ".join(
            ["python -m bench.nexmark", *(shlex.quote(a) for a in sys.argv[1:])]
        )
        data_report["rescale_errors"] = errors
        if result.checkpoints.get("partition_commits") is not None:
            data_report["partition_commits_job"] = result.checkpoints["partition_commits"]
            data_report["checkpoints_completed"] = result.checkpoints.get("completed")
        if gen_s is not None:
            data_report["generator_events_per_s"] = round(events / gen_s, 1)
        if check and spec.processing_time:
            final = final_result(query, result.table(SINK))
            data_report["result_rows"] = final.num_rows
            checks = processing_time.check(final, data)
            data_report["q12_checks"] = checks
            if not checks["ok"]:
                click.echo(f"Error: {query} breaks its invariants: {checks['broken']}", err=True)
        elif check:
            final = final_result(query, result.table(SINK))
            data_report["result_rows"] = final.num_rows
            want = oracle.run(query, data)
            ok = final.equals(want)
            if spec.partition_by:  # the folders read back (hive partitioning) too
                files = oracle.read_partitioned(query, output / query, spec.partition_by)
                data_report["output_rows"] = files.num_rows
                ok = ok and files.equals(want)
                if spec.partition_commit is not None:  # every folder of the result committed
                    commits = oracle.check_committed(output / query, want, spec.partition_by)
                    data_report["partition_commits"] = commits
                    ok = ok and commits["ok"]
            data_report["oracle_equal"] = ok
            if not ok:
                click.echo(
                    f"Error: {query} result ({final.num_rows} rows) differs from the DuckDB "
                    f"oracle ({want.num_rows} rows)",
                    err=True,
                )
        elif output is not None:
            out = output / query
            if spec.updating:
                data_report["result_rows"] = rs.read_upsert(out).num_rows
            elif spec.partition_by and out.is_dir():
                files = oracle.read_partitioned(query, out, spec.partition_by)
                data_report["result_rows"] = files.num_rows
            elif out.is_dir():
                data_report["result_rows"] = pq.read_table(out).num_rows
        if report is not None:
            from bench._report import write_json

            write_json(report, data_report)
        if not quiet:
            _print(data_report)
        passed = data_report.get("oracle_equal", data_report.get("q12_checks", {}).get("ok"))
        if check and not passed:
            sys.exit(1)
    finally:
        if started_ray:
            import ray

            ray.shutdown()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _print(r: dict[str, Any]) -> None:
    lat = r["latency_ms"]
    lines = [
        f"{r['query']}: {r['events']:,} events in {r['elapsed_s']:.2f} s = "
        f"{r['throughput_eps']:,.0f} events/s (parallelism {r['parallelism']})",
        f"latency p50 {lat['p50']} ms, p99 {lat['p99']} ms, max {lat['max']} ms",
    ]
    if r.get("active_throughput_eps"):
        lines.insert(
            1,
            f"while the {r['step']} step received records ({r['active_span_s']:.2f} s): "
            f"{r['active_throughput_eps']:,.0f} events/s",
        )
    wl = r.get("watermark_lag_ms")
    if wl and wl.get("p99") is not None:
        lines.append(
            f"watermark lag (window closed -> result at the sink) p50 {wl['p50']} ms, "
            f"p99 {wl['p99']} ms, max {wl['max']} ms over {wl['rows']:,} rows"
        )
    if "result_rows" in r:
        lines.append(f"result rows: {r['result_rows']:,}")
    checks = r.get("q12_checks")
    if checks is not None:
        lines.append(
            f"windows add up to every bidder's bids, aligned, none twice, none early: "
            f"{checks['ok']} ({checks['bids_counted']:,} of {checks['bids']:,} bids counted; "
            f"{checks['flushed_at_end']:,} windows flushed at the end of input)"
        )
        if checks.get("fire_delay_ms"):
            d = checks["fire_delay_ms"]
            lines.append(
                f"fire delay (fired_at - window end) p50 {d['p50']} ms, p99 {d['p99']} ms, "
                f"max {d['max']} ms"
            )
    elif "oracle_equal" in r:
        lines.append(f"equal to the DuckDB oracle: {r['oracle_equal']}")
    if "generator_events_per_s" in r:
        lines.append(f"generator: {r['generator_events_per_s']:,.0f} events/s")
    for e in r.get("rescale_errors", []):
        lines.append(f"rescale failed: {e}")
    click.echo("\n".join(lines))


if __name__ == "__main__":
    main()
