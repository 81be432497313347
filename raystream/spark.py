"""PySpark ingest: Spark tasks push Arrow batches straight into a running job's source actors.

* :func:`spark` - a batch DataFrame. When the job starts, the driver runs one Spark job over the
  DataFrame whose ``mapInArrow`` tasks connect to the Ray cluster and push their partition's
  batches to source instance ``partition % parallelism``; once the Spark job succeeded, every
  source instance is told the input ended.
* :func:`spark_stream` - a Structured Streaming DataFrame (file stream, rate, any source). Each
  micro-batch is pushed the same way from ``foreachBatch``.

Direct push (the default when the step after the source is ``key_by(column)``): each task
sorts its rows by key group, asks its source instance for sequence numbers (a small call
without data; the source keeps the dedupe table below) and pushes the rows straight to the
keyed step's instances, so no row takes the hop through the source (:mod:`raystream.direct`).
``direct=False`` sends every row through the source instance.

Exactly-once hand-off: each push carries ``(stream, batch id, partition)`` and the row offset
inside that partition; the source's :class:`~raystream.ingest.IngestBuffer` takes every row once,
so a retried task or a replayed micro-batch is not counted twice. Backpressure reaches Spark: a
push waits while the source's buffer is full, so the task waits while the dataflow is behind.

Recovery (jobs with ``checkpoint_interval_s``): a checkpoint records each source's dedupe table
(rows per token that went downstream); the recovered source starts from it. The driver's feeder
watches the job's attempt: the batch feeder runs its Spark job again for each new attempt (the
rows the checkpoint holds are dropped as duplicates), and the streaming feeder lets a
micro-batch go (Spark commits it) only once a completed checkpoint holds all its rows, pushing a
batch that a recovery interrupted again under its batch id. Pushes name their attempt; the
instances of another attempt refuse them.

Example (needs Java)::

    spark = rs.spark.session()
    df = spark.read.parquet("events.parquet")
    flow.source(rs.sources.spark(df)).key_by("key").apply(count).sink(...)
    rs.run(flow)
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from raystream.direct import DirectWriter
from raystream.errors import ConfigError, SchemaError, SourceError
from raystream.ingest import FeedContext, PushSource
from raystream.presort import sort_by_key_group
from raystream.runtime import wire

__all__ = ["SparkSource", "SparkStreamSource", "check_spark", "session", "spark", "spark_stream"]

RESULT_SCHEMA = "partition int, attempt int, rows long, accepted long, duplicate long"


# --------------------------------------------------------------------------------------------
# preconditions and the session helper


def check_spark() -> None:
    """Raise a clear error when PySpark cannot run here (not installed, or no Java)."""
    try:
        import pyspark  # noqa: F401
    except ImportError as e:
        msg = (
            f"PySpark is not importable ({e}); install it with `pip install pyspark==4.3.0` "
            "(or `pip install -e '.[test]'` in a raystream checkout)"
        )
        raise SourceError(msg) from None
    java_home = os.environ.get("JAVA_HOME")
    java = shutil.which("java") or (
        str(Path(java_home) / "bin" / "java")
        if java_home and (Path(java_home) / "bin" / "java").exists()
        else None
    )
    if java is None:
        msg = (
            "Spark needs Java 17+ and none was found (no `java` on PATH, JAVA_HOME unset). "
            "On Debian/Ubuntu: `sudo apt-get install openjdk-17-jre-headless`; on macOS: "
            "`brew install openjdk@17`; or set JAVA_HOME to a JDK 17+."
        )
        raise SourceError(msg)


def session(
    app_name: str = "raystream",
    *,
    master: str = "local[2]",
    arrow_batch_rows: int = 100_000,
    conf: dict[str, str] | None = None,
) -> Any:
    """A SparkSession set up for pushing into raystream: Python workers run this interpreter,
    Arrow batches of ``arrow_batch_rows`` rows, a quiet UI-less local master by default."""
    check_spark()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.appName(app_name)
        .master(master)
        .config("spark.ui.enabled", "false")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", str(arrow_batch_rows))
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.ui.showConsoleProgress", "false")
    )
    for k, v in (conf or {}).items():
        builder = builder.config(k, v)
    spark_session = builder.getOrCreate()
    spark_session.sparkContext.setLogLevel("ERROR")
    return spark_session


def _arrow_schema(df: Any) -> pa.Schema:
    from pyspark.sql.pandas.types import to_arrow_schema

    try:
        timezone = df.sparkSession.conf.get("spark.sql.session.timeZone")
        schema = to_arrow_schema(df.schema, timezone=timezone)
    except Exception as e:  # noqa: BLE001 - a Spark type Arrow cannot hold
        msg = f"cannot push this DataFrame through Arrow ({df.schema.simpleString()}): {e!r}"
        raise SchemaError(msg) from e
    # one string/binary flavour whatever Spark's large-var-types setting: tasks cast to it
    fields = [
        pa.field(f.name, pa.string() if pa.types.is_large_string(f.type) else f.type, f.nullable)
        for f in schema
    ]
    return pa.schema(fields)


def _check_dataframe(df: Any, *, streaming: bool) -> None:
    check_spark()
    from pyspark.sql import DataFrame

    if not isinstance(df, DataFrame):
        msg = f"expected a pyspark.sql.DataFrame, got {type(df).__name__}: {df!r}"
        raise ConfigError(msg)
    if df.isStreaming != streaming:
        want, other = ("spark_stream", "spark") if df.isStreaming else ("spark", "spark_stream")
        msg = (
            f"rs.sources.{other}() got a {'streaming' if df.isStreaming else 'batch'} DataFrame; "
            f"use rs.sources.{want}() for it"
        )
        raise ConfigError(msg)


# --------------------------------------------------------------------------------------------
# what runs inside a Spark task


_RAY_LOCK = threading.Lock()


def _connect(address: str, namespace: str, auth_mode: str | None) -> None:
    """Attach this Spark Python worker to the job's Ray cluster (once per worker process). With
    token auth on, the worker reads the token where Ray keeps it (``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token`` on the executor's machine)."""
    import ray

    if auth_mode and os.environ.get("RAY_AUTH_MODE") != auth_mode:
        os.environ["RAY_AUTH_MODE"] = auth_mode
        from ray._raylet import Config  # Ray caches its config: make it see the mode (as
        # ray.init does when it turns token auth on for a local cluster)

        Config.initialize("")

    with _RAY_LOCK:
        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            if ctx.gcs_address == address and ctx.namespace == namespace:
                return
            ray.shutdown()
        ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="ERROR")
        wire.register()  # pieces of Spark's batches go as their rows only


def _coalesce(batches: Iterator[pa.RecordBatch], rows: int) -> Iterator[pa.RecordBatch]:
    """Re-cut Spark's Arrow batches into pushes of exactly ``rows`` rows (the last may be
    shorter): small ones are joined (a push costs about the same whatever its size), large ones
    sliced (a push never exceeds what the source buffers)."""
    parts: list[pa.RecordBatch] = []
    have = 0
    for b in batches:
        offset = 0
        while offset < b.num_rows:
            take = min(rows - have, b.num_rows - offset)
            parts.append(b.slice(offset, take))
            offset += take
            have += take
            if have == rows:
                yield parts[0] if len(parts) == 1 else pa.concat_batches(parts)
                parts, have = [], 0
    if parts:
        yield parts[0] if len(parts) == 1 else pa.concat_batches(parts)


def _skip_rows(batches: Iterator[pa.RecordBatch], rows: int) -> Iterator[pa.RecordBatch]:
    """``batches`` without their first ``rows`` rows."""
    for b in batches:
        if rows >= b.num_rows:
            rows -= b.num_rows
            continue
        yield b.slice(rows) if rows else b
        rows = 0


def _job_gone(ctx: FeedContext, what: str) -> SourceError:
    """The error a writer gets when the job it pushes into is not there (any more)."""
    import ray

    from raystream.runtime.actors import controller_name

    try:
        controller = ray.get_actor(controller_name(ctx.job), namespace=ctx.namespace)
        st = ray.get(controller.feed_status.remote(), timeout=10)
    except Exception:  # noqa: BLE001 - no controller: the job ended (or never ran)
        st = None
    if st is None or st["state"] in ("finished", "failed", "stopped"):
        how = "has ended" if st is None else f"is {st['state']}"
        cause = f" ({st['error']})" if st and st.get("error") else ""
        msg = (
            f"{what}: job {ctx.job!r} {how}{cause}; a push source takes rows only while its job "
            f"runs. Start the job again (rs.start, or from_checkpoint='latest' to resume from its "
            f"last checkpoint) and push to the new run"
        )
    else:
        msg = (
            f"{what}: job {ctx.job!r} is {st['state']} (attempt {st['attempt']}); its source "
            f"instances are being replaced by a recovery: push again to the new attempt"
        )
    return SourceError(msg)


def source_handle(ctx: FeedContext, index: int) -> Any:
    """Source instance ``index`` of the running job (a named actor); a clear SourceError when
    the job is not running."""
    import ray

    from raystream.runtime.actors import source_actor_name

    name = source_actor_name(ctx.job, ctx.step, index)
    try:
        return ray.get_actor(name, namespace=ctx.namespace)
    except ValueError:
        raise _job_gone(ctx, f"source actor {name!r} is gone") from None


@dataclass(frozen=True)
class _TaskPusher:
    """The ``mapInArrow`` function: pushes one partition to its source instance, returns one
    row of statistics. Pickled by reference to this module, so Spark workers import it.

    ``attempt`` is the job's attempt the feed is for (None: any); a source instance of another
    attempt refuses the push, so a feed the job's recovery replaced fails instead of mixing in.
    The token ``(stream, batch_id, partition)`` and the row offsets are the same whenever the
    partition is computed again (deterministic input), so a re-sent partition is recognised.
    When the step after the source partitions by a key column (``ctx.key_groups``), each push
    is sorted by key group first (a function of its rows: the same when computed again), so
    the source instance only cuts it (:mod:`raystream.presort`)."""

    ctx: FeedContext
    stream: str
    batch_id: int
    schema: pa.Schema
    push_rows: int
    max_inflight: int = 2
    attempt: int | None = None

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import ray
        from pyspark import TaskContext

        task = TaskContext.get()
        partition, attempt = task.partitionId(), task.attemptNumber()
        _connect(self.ctx.ray_address, self.ctx.namespace, self.ctx.auth_mode)
        actor = source_handle(self.ctx, partition % self.ctx.parallelism)
        token = (self.stream, self.batch_id, partition)
        offset = accepted = duplicate = 0
        inflight: list[Any] = []

        def settle(refs: list[Any]) -> None:
            nonlocal accepted, duplicate
            try:
                results = ray.get(refs)
            except ray.exceptions.RayActorError:
                what = f"source instance {partition % self.ctx.parallelism} died during a push"
                raise _job_gone(self.ctx, what) from None
            for r in results:
                accepted += r["accepted"]
                duplicate += r["duplicate"]

        plan = self.ctx.key_groups
        key_space = plan.key_space if plan is not None else None
        writer = None
        if plan is not None and self.ctx.direct:
            index = partition % self.ctx.parallelism

            def gone(what: str) -> SourceError:
                return _job_gone(self.ctx, f"{what} (source instance {index})")

            writer = DirectWriter(actor, token, self.attempt, gone, self.max_inflight)
        # a direct writer's pieces are what a keyed instance processes as one batch: large
        rows = (self.ctx.direct_rows or self.push_rows) if writer is not None else self.push_rows
        if writer is None:
            # a retry starts where the source stands: an attempt that failed mid-partition may
            # have pushed a shorter last piece, and a push sorted by key group cannot be cut
            # where that one ended (a direct writer re-cuts at the source's reservations instead)
            try:
                offset = ray.get(actor.resume_offset.remote(token, self.attempt))
            except ray.exceptions.RayActorError:
                what = f"source instance {partition % self.ctx.parallelism} is gone"
                raise _job_gone(self.ctx, what) from None
            batches = _skip_rows(batches, offset)
            duplicate += offset  # taken by an earlier attempt
        for raw in _coalesce(batches, rows):
            if not raw.schema.equals(self.schema):
                raw = raw.cast(self.schema)
            batch = raw
            if plan is not None:  # the routing's per-row work here, in parallel Spark tasks
                batch = sort_by_key_group(raw, plan.key_column, key_space)  # type: ignore[arg-type]
            if writer is not None:  # the rows go to the keyed step, the source sequences them

                def recut(lo: int, hi: int, raw: pa.RecordBatch = raw) -> pa.RecordBatch:
                    return sort_by_key_group(raw.slice(lo, hi - lo), plan.key_column, key_space)  # type: ignore[arg-type,union-attr]

                got = writer.push(offset, batch, recut)
                if got is not None:
                    accepted += got["accepted"]
                    duplicate += got["duplicate"]
                    offset += batch.num_rows
                    continue
                writer.close()
                writer = None  # this source takes no direct pushes: push rows to it
            inflight.append(actor.ingest.remote(token, offset, batch, self.attempt))
            offset += batch.num_rows
            if len(inflight) >= self.max_inflight:
                done, inflight = ray.wait(inflight, num_returns=1)
                settle(done)
        if writer is not None:
            writer.close()
        settle(inflight)
        yield pa.record_batch(
            {
                "partition": pa.array([partition], pa.int32()),
                "attempt": pa.array([attempt], pa.int32()),
                "rows": pa.array([offset], pa.int64()),
                "accepted": pa.array([accepted], pa.int64()),
                "duplicate": pa.array([duplicate], pa.int64()),
            }
        )


def push_dataframe(
    df: Any,
    ctx: FeedContext,
    *,
    stream: str,
    batch_id: int,
    schema: pa.Schema,
    push_rows: int,
    attempt: int | None = None,
) -> dict[str, Any]:
    """Run one Spark job pushing every partition of ``df``; the per-partition stats summed, and
    ``pieces``: rows per partition."""
    pusher = _TaskPusher(ctx, stream, batch_id, schema, push_rows, attempt=attempt)
    rows = df.mapInArrow(pusher, RESULT_SCHEMA).collect()
    out: dict[str, Any] = {
        "partitions": len(rows),
        "rows": 0,
        "accepted": 0,
        "duplicate": 0,
        "retried": 0,
        "pieces": {},
    }
    for r in rows:
        out["rows"] += r["rows"]
        out["accepted"] += r["accepted"]
        out["duplicate"] += r["duplicate"]
        out["retried"] += int(r["attempt"] > 0)
        out["pieces"][int(r["partition"])] = int(r["rows"])
    return out


# --------------------------------------------------------------------------------------------
# feeders (driver side)

_ENDED = ("finished", "failed", "stopped")


class _FeederBase(threading.Thread):
    """Feeds one push source from the driver, and again after each recovery of the job: the
    recovered source instances hold their checkpoint's dedupe table, so a full re-send delivers
    exactly what came after the checkpoint."""

    # how long a failed feed waits for the job to report a recovery before it counts as a
    # failure of the feed itself (a Spark task sees a killed source before the controller does)
    recovery_grace_s = 10.0
    poll_s = 0.1

    def __init__(self, ctx: FeedContext, df: Any, schema: pa.Schema, push_rows: int) -> None:
        super().__init__(name=f"raystream-feed-{ctx.job}-{ctx.step}", daemon=True)
        self.ctx = ctx
        self.df = df
        self.schema = schema
        self.push_rows = push_rows
        self.error: str | None = None
        self.stats: dict[str, Any] = {
            "rows": 0,
            "accepted": 0,
            "duplicate": 0,
            "batches": 0,
            "feeds": 0,  # feeds started: 1 + one per recovery that needed a re-send
        }
        self._stopping = threading.Event()
        self._controller: Any = None
        self.attempt = 0
        self.recovers = False

    # ---- the job's controller ---------------------------------------------------------------
    def _status(self) -> dict[str, Any] | None:
        """The job's feed status; None once its controller is gone (the job ended)."""
        import ray

        from raystream.runtime.actors import controller_name

        try:
            if self._controller is None:
                self._controller = ray.get_actor(
                    controller_name(self.ctx.job), namespace=self.ctx.namespace
                )
            status: dict[str, Any] = ray.get(self._controller.feed_status.remote(), timeout=30)
            return status
        except Exception:  # noqa: BLE001 - the controller ended with the job
            return None

    def _await(self, attempt: int, timeout_s: float | None) -> dict[str, Any] | None:
        """Wait until a new attempt of the job runs (its status), or the job ended (None), or
        ``timeout_s`` passed with ``attempt`` still running (``{"state": "same"}``)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._stopping.is_set():
            st = self._status()
            if st is None or st["state"] in _ENDED:
                return None
            if st["attempt"] != attempt and st["state"] == "running":
                return st
            late = deadline is not None and time.monotonic() > deadline
            if late and st["attempt"] == attempt and st["state"] == "running":
                return {"state": "same"}
            time.sleep(self.poll_s)
        return None

    # ---- sources --------------------------------------------------------------------------
    def _sources(self) -> list[Any]:
        return [source_handle(self.ctx, i) for i in range(self.ctx.parallelism)]

    def _end_sources(self, attempt: int | None = None) -> None:
        import ray

        ray.get([a.end_ingest.remote(attempt) for a in self._sources()])

    def _fail_sources(self, reason: str) -> None:
        import ray

        self.error = reason
        try:
            ray.get([a.fail_ingest.remote(reason) for a in self._sources()])
        except Exception:  # noqa: BLE001, S110 - the job is already gone
            pass

    # ---- the loop -------------------------------------------------------------------------
    def run(self) -> None:
        t0 = time.perf_counter()
        st = self._status() or {}
        self.attempt = int(st.get("attempt", 0))
        self.recovers = bool(st.get("recovers", False))
        feed = self._feed
        while not self._stopping.is_set():
            self.stats["feeds"] += 1
            failure: Exception | None = None
            try:
                feed(self.attempt if self.recovers else None)
                self.stats["seconds"] = time.perf_counter() - t0  # until the end was sent
            except Exception as e:  # noqa: BLE001 - reported through the job's sources
                failure = e
            if self._stopping.is_set():
                return
            if not self.recovers:
                if failure is not None:
                    self._fail_sources(self._reason(failure))
                return
            if failure is not None:
                st = self._await(self.attempt, self.recovery_grace_s)
                if st is None:
                    return  # the job ended (failed for good, or stopped)
                if st["state"] == "same":  # the feed itself failed: the job recovers (or fails)
                    self._fail_sources(self._reason(failure))
            nxt = self._await(self.attempt, None)
            if nxt is None:
                return  # the job ended
            self.attempt = int(nxt["attempt"])
            self.error = None
            feed = self._refeed

    def _reason(self, e: BaseException) -> str:
        return f"the Spark job feeding {self.ctx.step!r} failed: {_first_line(e)}"

    def _feed(self, attempt: int | None) -> None:
        """Send the whole input to ``attempt`` of the job (None: the job does not recover)."""
        raise NotImplementedError

    def _refeed(self, attempt: int | None) -> None:
        """After a recovery: send what the recovered sources may lack (default: everything)."""
        self._feed(attempt)

    def join(self, timeout_s: float | None = None) -> None:  # type: ignore[override]
        super().join(timeout_s)


class _BatchFeeder(_FeederBase):
    def __init__(self, ctx: FeedContext, df: Any, schema: pa.Schema, push_rows: int) -> None:
        super().__init__(ctx, df, schema, push_rows)
        self.group = f"raystream-{ctx.job}-{ctx.step}-{uuid.uuid4().hex[:8]}"
        # names the input's pieces: the same in every feed of this job (a re-sent partition must
        # carry the token it carried before)
        self.stream = f"spark:{ctx.job}:{ctx.step}"

    def _feed(self, attempt: int | None) -> None:
        sc = self.df.sparkSession.sparkContext
        sc.setJobGroup(self.group, f"raystream job {self.ctx.job!r}: feed {self.ctx.step!r}", True)
        stats = push_dataframe(
            self.df,
            self.ctx,
            stream=self.stream,
            batch_id=0,
            schema=self.schema,
            push_rows=self.push_rows,
            attempt=attempt,
        )
        stats.pop("pieces")
        self.stats.update(stats, batches=1)
        self._end_sources(attempt)

    def stop(self) -> None:
        self._stopping.set()
        try:
            self.df.sparkSession.sparkContext.cancelJobGroup(self.group)
        except Exception:  # noqa: BLE001, S110 - Spark already stopped
            pass


class _StreamFeeder(_FeederBase):
    """Micro-batch by micro-batch through ``foreachBatch``. When the job recovers, a batch is
    only let go (Spark commits it and will not replay it) once a completed checkpoint holds all
    its rows; a batch whose push a recovery broke is pushed again, same batch id."""

    covered_timeout_s = 600.0

    def __init__(self, ctx: FeedContext, source: SparkStreamSource) -> None:
        super().__init__(ctx, source.dataframe, source.arrow_schema, source.push_rows)
        self.source = source
        self.query: Any = None
        self._last_data = time.monotonic()
        self.stats["waited_for_checkpoints_s"] = 0.0

    def _on_batch(self, batch_df: Any, batch_id: int) -> None:
        while True:
            attempt = self.attempt if self.recovers else None
            try:
                stats = push_dataframe(
                    batch_df,
                    self.ctx,
                    stream=self.source.stream_key,
                    batch_id=batch_id,
                    schema=self.schema,
                    push_rows=self.push_rows,
                    attempt=attempt,
                )
                if attempt is not None:
                    self._await_covered(batch_id, stats["pieces"], attempt)
                break
            except Exception:
                if attempt is None or self._stopping.is_set():
                    raise
                st = self._await(attempt, self.recovery_grace_s)
                if st is None or st["state"] == "same":
                    raise  # the job ended, or the push failed by itself: the query fails
                self.attempt = int(st["attempt"])
                self.stats["feeds"] += 1
        for k in ("rows", "accepted", "duplicate"):
            self.stats[k] += stats[k]
        self.stats["batches"] += 1
        if stats["accepted"]:
            self._last_data = time.monotonic()

    def _await_covered(self, batch_id: int, pieces: dict[int, int], attempt: int) -> None:
        """Block until the job's sources emitted every row of the batch and a checkpoint taken
        after that completed: then the batch never needs sending again."""
        import ray

        t0 = time.perf_counter()
        per_instance: dict[int, list[tuple[tuple[Any, ...], int]]] = {}
        for p, n in pieces.items():
            token = (self.source.stream_key, batch_id, p)
            per_instance.setdefault(p % self.ctx.parallelism, []).append((token, n))
        handles = self._sources()
        waits = [
            handles[i].wait_ingested.remote(toks, self.covered_timeout_s, attempt)
            for i, toks in per_instance.items()
        ]
        if not all(ray.get(waits)):
            msg = f"micro-batch {batch_id} was not emitted within {self.covered_timeout_s} s"
            raise SourceError(msg)
        if self._controller is None:
            self._status()
        out = ray.get(
            self._controller.await_checkpoint.remote(attempt, self.covered_timeout_s)
        )
        self.stats["waited_for_checkpoints_s"] += time.perf_counter() - t0
        if not out["ok"]:
            msg = f"no checkpoint covered micro-batch {batch_id} (job {out['state']})"
            raise SourceError(msg)

    def _feed(self, attempt: int | None) -> None:
        src = self.source
        writer = (
            self.df.writeStream.queryName(
                f"raystream_{self.ctx.job}_{self.ctx.step}".replace("-", "_")
            )
            .option("checkpointLocation", src.checkpoint_location)
            .foreachBatch(self._on_batch)
        )
        if src.trigger:
            writer = writer.trigger(**src.trigger)
        self.query = writer.start()
        self._last_data = time.monotonic()
        try:
            while not self._stopping.is_set() and self.query.isActive:
                if src.max_rows is not None and self.stats["accepted"] >= src.max_rows:
                    break
                if (
                    src.idle_timeout_s is not None
                    and time.monotonic() - self._last_data > src.idle_timeout_s
                ):
                    break
                self.query.awaitTermination(0.1)
        finally:
            self.query.stop()
        if self._stopping.is_set():
            return
        exc = self.query.exception()
        if exc is not None:
            raise SourceError(str(exc))
        self._end_sources(self.attempt if self.recovers else None)

    def _refeed(self, attempt: int | None) -> None:
        """Every micro-batch Spark committed is in a completed checkpoint: once the query had
        ended, the recovered sources only need to hear the end again; a query that failed is
        started again from Spark's checkpoint (it replays the batch it had not committed)."""
        if self.query is not None and self.query.exception() is None:
            self._end_sources(attempt)
        else:
            self._feed(attempt)

    def stop(self) -> None:
        self._stopping.set()
        if self.query is not None:
            try:
                self.query.stop()
            except Exception:  # noqa: BLE001, S110 - already stopped
                pass


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # Spark wraps Python errors in long Java traces; the Python error line says the most
    for ln in lines:
        if "Error:" in ln and "Traceback" not in ln and not ln.startswith("\tat "):
            return f"{type(e).__name__}: {ln.strip()}"[:500]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:500]


# --------------------------------------------------------------------------------------------
# the source specs


@dataclass(frozen=True)
class SparkSource(PushSource):
    """A batch DataFrame pushed in by Spark tasks; build it with :func:`spark`. The DataFrame
    stays in the driver (it is not pickled with the dataflow)."""

    dataframe: Any = field(default=None, repr=False, compare=False)
    push_rows: int = 100_000
    # when the step after the source partitions by a key column, tasks sort each push by key
    # group so the source instance only cuts it (raystream.presort)
    presort_key_groups: bool = True
    # ... and send the rows to the keyed instances themselves: the source instance only hands
    # out sequence numbers (raystream.direct)
    direct: bool = True
    # rows per reservation of a direct task (its pieces, one per keyed instance, are what each
    # instance processes as one batch); 0: 2 * push_rows
    direct_rows: int = 0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["dataframe"] = None  # a DataFrame lives in its driver; actors never need it
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def describe(self) -> str:
        return f"Spark DataFrame ({', '.join(self.arrow_schema.names)})"

    def start_feeding(self, ctx: FeedContext) -> _FeederBase:
        """Start pushing (a thread in the driver); ``rs.start`` calls this after the deploy."""
        if self.dataframe is None:
            msg = (
                "this Spark source was unpickled away from its driver; start the job in the "
                "process where the DataFrame was made"
            )
            raise SourceError(msg)
        if not self.presort_key_groups:
            ctx = replace(ctx, key_groups=None)
        ctx = replace(
            ctx,
            direct=self.direct and ctx.key_groups is not None,
            direct_rows=self.direct_rows or 2 * self.push_rows,
        )
        feeder = self._feeder(ctx)
        feeder.start()
        return feeder

    def _feeder(self, ctx: FeedContext) -> _FeederBase:
        return _BatchFeeder(ctx, self.dataframe, self.arrow_schema, self.push_rows)


@dataclass(frozen=True)
class SparkStreamSource(SparkSource):
    """A Structured Streaming DataFrame pushed in micro-batch by micro-batch; see :func:`spark_stream`."""

    checkpoint_location: str = ""
    trigger: dict[str, Any] | None = None
    max_rows: int | None = None
    idle_timeout_s: float | None = None

    @property
    def stream_key(self) -> str:
        """Names the query across restarts (its checkpoint), so replayed batches are known."""
        return str(Path(self.checkpoint_location).resolve())

    def describe(self) -> str:
        return f"Spark Structured Streaming ({', '.join(self.arrow_schema.names)})"

    def _feeder(self, ctx: FeedContext) -> _FeederBase:
        return _StreamFeeder(ctx, self)


def _check_direct_rows(direct_rows: int | None) -> int:
    if direct_rows is None:
        return 0
    if not isinstance(direct_rows, int) or isinstance(direct_rows, bool) or direct_rows < 1:
        msg = f"direct_rows must be None or an int >= 1 (rows a Spark task sequences at once), got {direct_rows!r}"
        raise ConfigError(msg)
    return direct_rows


def _check_common(push_rows: int, capacity_rows: int | None) -> int:
    if not isinstance(push_rows, int) or push_rows < 1:
        msg = f"push_rows must be an int >= 1 (rows per push from a Spark task), got {push_rows!r}"
        raise ConfigError(msg)
    return capacity_rows if capacity_rows is not None else 4 * push_rows


def spark(
    dataframe: Any,
    *,
    push_rows: int = 100_000,
    capacity_rows: int | None = None,
    presort_key_groups: bool = True,
    direct: bool = True,
    direct_rows: int | None = None,
) -> SparkSource:
    """Read a batch Spark DataFrame: its tasks push Arrow batches of up to ``push_rows`` rows into
    the job's source instances, each of which buffers at most ``capacity_rows`` (default
    ``4 * push_rows``) before tasks wait. The job ends once the Spark job finished.

    ``presort_key_groups``: when the step after the source is ``key_by(column)``, each task
    sorts its pushes by key group, so the source instance routes them without hashing
    (raystream.presort); ``False`` leaves the routing's work to the source instance.

    ``direct``: then (presorted, the step after the source is ``key_by(column)``), each task
    sends its rows straight to the keyed step's instances; the source instance only hands out
    sequence numbers and keeps the exactly-once hand-off (raystream.direct; a retried task
    re-sends a failed attempt's reservations under their numbers). ``False``: every row passes
    through the source instance. ``direct_rows`` (default ``2 * push_rows``): rows a
    task sequences at once; each keyed instance gets its share of them as one push (the batch
    it processes), so larger is cheaper per row."""
    _check_dataframe(dataframe, streaming=False)
    capacity = _check_common(push_rows, capacity_rows)
    return SparkSource(
        _arrow_schema(dataframe),
        capacity,
        dataframe,
        push_rows,
        presort_key_groups=bool(presort_key_groups),
        direct=bool(direct),
        direct_rows=_check_direct_rows(direct_rows),
    )


def spark_stream(
    dataframe: Any,
    *,
    checkpoint_location: str,
    trigger: dict[str, Any] | None = None,
    max_rows: int | None = None,
    idle_timeout_s: float | None = None,
    push_rows: int = 100_000,
    capacity_rows: int | None = None,
    presort_key_groups: bool = True,
    direct: bool = True,
    direct_rows: int | None = None,
) -> SparkStreamSource:
    """Read a Structured Streaming DataFrame (file, rate, any source) through ``foreachBatch``.

    ``checkpoint_location`` is Spark's checkpoint and names the stream: a micro-batch Spark
    replays (same location, same batch id) is not counted twice. ``trigger`` goes to
    ``writeStream.trigger(**trigger)``, e.g. ``{"processingTime": "1 second"}``. The input
    ends (and with it the job) after the micro-batch that brought ``max_rows`` rows, or when
    no rows arrived for ``idle_timeout_s`` seconds; without either it runs until stopped.

    When the job checkpoints, ``foreachBatch`` returns only once a completed checkpoint holds
    the micro-batch's rows (so Spark never commits a batch the job could lose): at most one
    micro-batch per checkpoint interval. ``presort_key_groups`` and ``direct`` as in
    :func:`spark`.
    """
    _check_dataframe(dataframe, streaming=True)
    capacity = _check_common(push_rows, capacity_rows)
    if not isinstance(checkpoint_location, (str, os.PathLike)) or not str(checkpoint_location):
        msg = f"checkpoint_location must be a directory path (Spark's checkpoint), got {checkpoint_location!r}"
        raise ConfigError(msg)
    if max_rows is not None and (not isinstance(max_rows, int) or max_rows < 1):
        msg = f"max_rows must be None or an int >= 1, got {max_rows!r}"
        raise ConfigError(msg)
    if idle_timeout_s is not None and (
        not isinstance(idle_timeout_s, (int, float)) or idle_timeout_s <= 0
    ):
        msg = f"idle_timeout_s must be None or a number of seconds > 0, got {idle_timeout_s!r}"
        raise ConfigError(msg)
    if trigger is not None and not isinstance(trigger, dict):
        msg = f"trigger must be a dict of writeStream.trigger() options, e.g. {{'processingTime': '1 second'}}, got {trigger!r}"
        raise ConfigError(msg)
    return SparkStreamSource(
        _arrow_schema(dataframe),
        capacity,
        dataframe,
        push_rows,
        presort_key_groups=bool(presort_key_groups),
        direct=bool(direct),
        direct_rows=_check_direct_rows(direct_rows),
        checkpoint_location=str(checkpoint_location),
        trigger=trigger,
        max_rows=max_rows,
        idle_timeout_s=float(idle_timeout_s) if idle_timeout_s is not None else None,
    )
