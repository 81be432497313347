"""Soak benchmark: a checkpointed job left running; does anything grow with time?

Run it from the repository root::

    python -m bench.soak --minutes 10 --rescale-every-s 0 --report bench/results/soak.json
    python -m bench.soak --minutes 3                               # rescaled every minute

The same command on another checkout (e.g. before a change) measures that checkout's code: put
its ``raystream`` and ``operators`` beside a copy of ``bench/`` in a folder and run from there
(``controller_code`` in the report says which ``raystream`` the job's actors imported)::

    git archive <commit> raystream operators | tar -x -C /tmp/before && cp -r bench /tmp/before
    cd /tmp/before && python -m bench.soak --minutes 10 --rescale-every-s 0 --report ...

The dataflow is ``source -> key_by("key") -> count (keyed running count, RocksDB) ->
key_by("key") -> window (tumbling 1 s event-time windows: count and max of the running count,
timers and window state) -> Parquet (exactly once, a part per checkpoint)``, checkpointed every
``--checkpoint-s`` seconds, at ``--rate`` events/s for ``--minutes``. Every
``--rescale-every-s`` seconds the count step is rescaled 2 -> 3 -> 2 -> ... (0: never).

Every ``--sample-s`` seconds a sample records: the RSS of every instance actor and of the
controller (``/proc/<pid>/status`` of the actor's process, asked through the actor, so one
machine), the RocksDB folders' size per step, how long ``job.status()`` took and its pickled
size, the last checkpoint's duration and sizes, and the sinks' p99 latency over the interval
since the previous sample. At the end: exactness (the Parquet output against DuckDB over the
source's events, regenerated in this process) and each series' growth per hour: the
least-squares slope over the second half of the run (the first half warms caches, fills the
state of the key space and the standbys).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import duckdb
import numpy as np
import pyarrow as pa

import raystream as rs
from bench._report import imported_from, write_json
from raystream.operators import count as count_agg
from raystream.operators import max as max_agg
from raystream.operators import windows

__all__ = ["SoakSource", "growth_per_hour", "main", "soak_events", "soak_flow"]

COUNT = "count"
WINDOW = "window"
SINK = "out"
WINDOW_MS = 1_000
KEY_MIX = np.uint64(0x9E3779B97F4A7C15)


# --------------------------------------------------------------------------------------------
# the input: a deterministic stream a position at a time (the oracle regenerates it)


def soak_events(start: int, stop: int, keys: int, events_per_ms: int, seed: int) -> pa.RecordBatch:
    """Events ``start .. stop-1``: ``key`` a hash of the position (uniform over ``keys``),
    ``ts`` the event time in ms, ``events_per_ms`` events per ms (in order: nothing is late)."""
    pos = np.arange(start, stop, dtype=np.uint64)
    with np.errstate(over="ignore"):
        mixed = (pos + np.uint64(seed)) * KEY_MIX
        mixed ^= mixed >> np.uint64(29)
    key = (mixed % np.uint64(keys)).astype(np.int64)
    ts = (pos // np.uint64(events_per_ms)).astype(np.int64)
    return pa.record_batch({"key": key, "ts": ts})


class _SoakReader:
    def __init__(self, spec: SoakSource) -> None:
        self._spec = spec
        self._pos = 0

    def read(self, max_rows: int) -> pa.RecordBatch | None:
        s = self._spec
        if self._pos >= s.events:
            return None
        stop = min(s.events, self._pos + max_rows)
        batch = soak_events(self._pos, stop, s.keys, s.events_per_ms, s.seed)
        self._pos = stop
        return batch

    def close(self) -> None:
        self._pos = self._spec.events


@dataclass(frozen=True)
class SoakSource:
    """``events`` events of :func:`soak_events` at ``rate_eps``; one instance (parallelism 1)."""

    events: int
    keys: int
    rate_eps: float
    events_per_ms: int
    seed: int = 0

    def schema(self) -> pa.Schema:
        return pa.schema([("key", pa.int64()), ("ts", pa.int64())])

    def open(self, index: int, parallelism: int) -> _SoakReader:
        if parallelism != 1:
            msg = f"the soak source runs at parallelism 1, got {parallelism}"
            raise rs.ConfigError(msg)
        return _SoakReader(self)

    def describe(self) -> str:
        return (
            f"soak(events={self.events}, keys={self.keys}, rate_eps={self.rate_eps}, "
            f"events_per_ms={self.events_per_ms}, seed={self.seed})"
        )


@rs.keyed_batches(name=COUNT, state=rs.ValueState(int, default=0))
def running_count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    """One row per record: its key, event time and its key's count up to it (RocksDB state)."""
    before = state.get(batch.keys)
    counts = batch.counts
    state.put(batch.keys, before + counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    rank = np.arange(int(counts.sum())) - starts
    records = batch.records
    return pa.record_batch(
        {
            "key": records.column("key"),
            "ts": records.column("ts"),
            "running": pa.array(np.repeat(before, counts) + rank + 1, pa.int64()),
        }
    )


def soak_flow(source: SoakSource, out_dir: str, name: str = "bench-soak") -> rs.Dataflow:
    flow = rs.Dataflow(name, num_key_groups=64, sub_groups=8)
    (
        flow.source(source, event_time="ts", max_out_of_orderness_ms=0)
        .key_by("key")
        .apply(running_count)
        .key_by("key")
        .apply(
            windows.tumbling(WINDOW_MS, [count_agg(), max_agg("running")], time_column="ts"),
            name=WINDOW,
        )
        .sink(rs.sinks.parquet(out_dir), name=SINK)
    )
    return flow


# --------------------------------------------------------------------------------------------
# the oracle


def check_exact(source: SoakSource, out_dir: str) -> dict[str, Any]:
    """The Parquet output against DuckDB over the regenerated input: one row per (key, window),
    its count, and the key's running count at the window's end (its max). Mismatches counted."""
    events = pa.Table.from_batches(
        [
            soak_events(
                a, min(a + 1_000_000, source.events), source.keys, source.events_per_ms, source.seed
            )
            for a in range(0, source.events, 1_000_000)
        ]
    )
    con = duckdb.connect()
    try:
        con.register("ev", events)
        con.execute(
            f"""CREATE TABLE expected AS
                SELECT key, ws, c, sum(c) OVER (PARTITION BY key ORDER BY ws) AS running
                FROM (SELECT key, (ts // {WINDOW_MS}) * {WINDOW_MS} AS ws, count(*) AS c
                      FROM ev GROUP BY key, ws)"""
        )
        out_glob = os.path.join(out_dir, "*.parquet")
        con.execute(
            f"""CREATE TABLE got AS SELECT key, window_start AS ws, "count" AS c,
                "running_max" AS running FROM read_parquet('{out_glob}')"""
        )
        rows_got = con.execute("SELECT count(*) FROM got").fetchone()[0]
        rows_expected = con.execute("SELECT count(*) FROM expected").fetchone()[0]
        duplicates = con.execute(
            "SELECT count(*) FROM (SELECT key, ws FROM got GROUP BY key, ws HAVING count(*) > 1)"
        ).fetchone()[0]
        missing = con.execute(
            "SELECT count(*) FROM (SELECT * FROM expected EXCEPT SELECT * FROM got)"
        ).fetchone()[0]
        unexpected = con.execute(
            "SELECT count(*) FROM (SELECT * FROM got EXCEPT SELECT * FROM expected)"
        ).fetchone()[0]
    finally:
        con.close()
    return {
        "exact": rows_got == rows_expected and not (duplicates or missing or unexpected),
        "rows_expected": int(rows_expected),
        "rows_got": int(rows_got),
        "duplicate_windows": int(duplicates),
        "missing_rows": int(missing),
        "unexpected_rows": int(unexpected),
        "oracle": "DuckDB over the regenerated input: per (key, 1 s window) count(*) and the "
        "running sum of those counts (the key's running count at the window's end)",
    }


# --------------------------------------------------------------------------------------------
# sampling


def _rss_of_actor(handle: Any) -> int | None:
    import ray

    def rss(_self: Any) -> int | None:
        try:
            with open(f"/proc/{os.getpid()}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    try:
        return ray.get(handle.__ray_call__.remote(rss), timeout=10)
    except Exception:  # noqa: BLE001 - the actor is gone (a rescale retired it)
        return None


def _code_of_actor(handle: Any) -> str | None:
    """Where the actor imported raystream from (which checkout ran)."""
    import ray

    def where(_self: Any) -> str:
        import raystream

        return os.path.dirname(raystream.__file__)

    try:
        return ray.get(handle.__ray_call__.remote(where), timeout=10)
    except Exception:  # noqa: BLE001
        return None


def _actor(name: str) -> Any:
    import ray

    from raystream.runtime.actors import NAMESPACE

    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, f)).st_size
    return total


def file_kind(name: str) -> str:
    """What a file of a state folder is: ``sst``, ``LOG`` (RocksDB's info log, rolled ones
    too), ``MANIFEST``, ``OPTIONS`` or ``other``."""
    if name.endswith(".sst"):
        return "sst"
    for kind in ("LOG", "MANIFEST", "OPTIONS"):
        if name.startswith(kind):
            return kind
    return "other"


def rocksdb_bytes(state_dir: Path, steps: tuple[str, ...]) -> dict[str, Any]:
    """Bytes of the state folders of each of ``steps`` (``<state_dir>/.../<step>/<index>``, every
    attempt's and every rescale's folders), their ``total`` and ``by_kind`` (:func:`file_kind`)."""
    out: dict[str, Any] = dict.fromkeys(steps, 0)
    kinds: dict[str, int] = {}
    for root, _, files in os.walk(state_dir):
        parts = Path(root).relative_to(state_dir).parts
        step = next((p for p in parts if p in out), None)
        for f in files:
            with contextlib.suppress(OSError):
                size = os.stat(os.path.join(root, f)).st_size
                if step is not None:
                    out[step] += size
                    kinds[file_kind(f)] = kinds.get(file_kind(f), 0) + size
    out["total"] = sum(out[s] for s in steps)
    out["by_kind"] = kinds
    return out


def p99_between(snapshots: list[dict[str, Any]], start_s: float, end_s: float) -> float | None:
    """p99 (ms) of the sinks' latency windows starting in ``[start_s, end_s)`` (seconds since the
    job's origin, which every instance shares), decoding only those windows (a merge of whole
    snapshots would cost the sampler more the longer the run)."""
    from hdrh.histogram import HdrHistogram

    from raystream.metrics import LATENCY_HIGHEST_US

    h = HdrHistogram(1, LATENCY_HIGHEST_US, 3)
    for snap in snapshots:
        step_s = snap["window_ms"] / 1000
        for w, encoded in snap["windows"].items():
            if start_s <= int(w) * step_s < end_s:
                h.add(HdrHistogram.decode(encoded))
    if h.get_total_count() == 0:
        return None
    return h.get_value_at_percentile(99.0) / 1000


def take_sample(
    job: rs.Job, t0: float, state_dir: Path, last_t_s: float | None, checkpoint_dir: Path
) -> dict[str, Any]:
    from raystream.runtime.actors import controller_name, instance_actor_name

    at = time.monotonic() - t0
    c0 = time.perf_counter()
    status = job.status()
    status_ms = (time.perf_counter() - c0) * 1000
    status_bytes = len(pickle.dumps(status))
    names = status.get("actor_names") or {}
    rss: dict[str, float] = {}
    for m in status.get("instances", []):
        if m.get("finished") or m.get("step") is None:
            continue
        iid = f"{m['step']}/{m['index']}"
        handle = _actor(names.get(iid) or instance_actor_name(job.name, m["step"], m["index"]))
        got = _rss_of_actor(handle) if handle is not None else None
        if got is not None:
            rss[iid] = round(got / 2**20, 2)
    ctrl = _actor(controller_name(job.name))
    ctrl_rss = _rss_of_actor(ctrl) if ctrl is not None else None
    rocks = rocksdb_bytes(state_dir, (COUNT, WINDOW))
    ck = status.get("checkpoints") or {}
    last = ck.get("last") or {}
    p99 = None
    lat = [m["latency"] for m in status.get("instances", []) if m.get("latency")]
    if lat and last_t_s is not None:
        since = (time.time_ns() - lat[0]["origin_ns"]) / 1e9
        p99 = p99_between(lat, max(0.0, since - (at - last_t_s)), since)
    return {
        "t_s": round(at, 2),
        "status_ms": round(status_ms, 2),
        "status_bytes": status_bytes,
        "controller_rss_mb": None if ctrl_rss is None else round(ctrl_rss / 2**20, 2),
        "instance_rss_mb": rss,
        "rocksdb_bytes": rocks,
        "parallelism": dict(status.get("parallelism") or {}),
        "checkpoints_completed": ck.get("completed"),
        "checkpoint_duration_s": last.get("duration_s"),
        "checkpoint_uploaded_bytes": last.get("uploaded_bytes"),
        "checkpoint_referenced_bytes": last.get("referenced_bytes"),
        "p99_ms": p99,
        # the source's rows behind its schedule (the job keeps up: stays small)
        "source_lag_rows": sum(
            int(m.get("lag_rows", 0))
            for m in status.get("instances", [])
            if m.get("step") == "source"
        ),
        "recoveries": status.get("recoveries_total", len(status.get("recoveries") or [])),
        # every file under the checkpoint folder (retained checkpoints and shared state files)
        "checkpoint_dir_bytes": _dir_bytes(checkpoint_dir),
    }


# --------------------------------------------------------------------------------------------
# growth


def growth_per_hour(t_s: list[float], values: list[float | None], from_s: float) -> dict[str, Any]:
    """Least-squares slope per hour of ``values`` over the samples at or after ``from_s``
    (None values left out), with the first and last of them; slope None with < 3 points.

    Example::

        >>> growth_per_hour([0, 60, 120, 180], [1.0, 2.0, 3.0, 4.0], from_s=60)["per_hour"]
        60.0
    """
    pts = [(t, v) for t, v in zip(t_s, values, strict=True) if t >= from_s and v is not None]
    if len(pts) < 3:
        return {"per_hour": None, "points": len(pts), "first": None, "last": None}
    t = np.array([p[0] for p in pts], dtype=np.float64) / 3600.0
    y = np.array([p[1] for p in pts], dtype=np.float64)
    slope = float(np.polyfit(t, y, 1)[0])
    return {
        "per_hour": round(slope, 3),
        "points": len(pts),
        "first": round(float(y[0]), 3),
        "last": round(float(y[-1]), 3),
    }


def summarize_growth(samples: list[dict[str, Any]], from_s: float) -> dict[str, Any]:
    t = [s["t_s"] for s in samples]
    out: dict[str, Any] = {}
    for key, unit in (
        ("controller_rss_mb", "MB"),
        ("status_ms", "ms"),
        ("status_bytes", "bytes"),
        ("checkpoint_duration_s", "s"),
        ("checkpoint_referenced_bytes", "bytes"),
        ("checkpoint_dir_bytes", "bytes"),
        ("p99_ms", "ms"),
    ):
        out[key] = {**growth_per_hour(t, [s.get(key) for s in samples], from_s), "unit": unit}
    instances = sorted({i for s in samples for i in s["instance_rss_mb"]})
    out["instance_rss_mb"] = {
        i: {
            **growth_per_hour(t, [s["instance_rss_mb"].get(i) for s in samples], from_s),
            "unit": "MB",
        }
        for i in instances
    }
    steps = sorted({k for s in samples for k in s["rocksdb_bytes"] if k != "by_kind"})
    out["rocksdb_bytes"] = {
        k: {
            **growth_per_hour(t, [s["rocksdb_bytes"].get(k) for s in samples], from_s),
            "unit": "bytes",
        }
        for k in steps
    }
    kinds = sorted({k for s in samples for k in s["rocksdb_bytes"].get("by_kind", {})})
    out["rocksdb_bytes_by_kind"] = {
        k: {
            **growth_per_hour(
                t, [s["rocksdb_bytes"].get("by_kind", {}).get(k) for s in samples], from_s
            ),
            "unit": "bytes",
        }
        for k in kinds
    }
    return out


# --------------------------------------------------------------------------------------------
# the command


def _pickle_by_value() -> None:
    from ray import cloudpickle

    module = sys.modules.get("bench.soak")
    if module is not None:
        cloudpickle.register_pickle_by_value(module)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option(
    "--minutes", type=click.FloatRange(min=0.5), default=10.0, help="How long the input lasts."
)
@click.option(
    "--rate",
    type=click.FloatRange(min=1),
    default=5_000.0,
    help="Events per second. Two cores run this job at ~6-9k events/s while it is sampled: at "
    "10k its source falls behind (source_lag_rows), which a soak need not mind.",
)
@click.option("--keys", type=click.IntRange(min=1), default=2_000, help="Distinct keys.")
@click.option("--events-per-ms", type=click.IntRange(min=1), default=20, help="Event-time density.")
@click.option("--parallelism", type=click.IntRange(min=1), default=2, help="Count and window.")
@click.option("--checkpoint-s", type=click.FloatRange(min=0.1), default=1.0)
@click.option("--sample-s", type=click.FloatRange(min=1), default=10.0)
@click.option(
    "--rescale-every-s",
    type=click.FloatRange(min=0),
    default=60.0,
    help="Rescale the count step to parallelism+1 and back, alternately (0: never).",
)
@click.option("--seed", type=int, default=0)
@click.option(
    "--metrics-windows-retained-s",
    "retained_s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="RuntimeConfig.metrics_windows_retained_s (not given: the default, 900 s); a value "
    "below the run's length shows the per-window metrics reach their bound within the run.",
)
@click.option("--report", type=click.Path(path_type=Path), default=None, help="Write JSON here.")
def main(
    minutes: float,
    rate: float,
    keys: int,
    events_per_ms: int,
    parallelism: int,
    checkpoint_s: float,
    sample_s: float,
    rescale_every_s: float,
    seed: int,
    retained_s: float | None,
    report: Path | None,
) -> None:
    import ray

    from raystream.runtime.actors import controller_name

    events = int(rate * minutes * 60)
    source = SoakSource(events, keys, rate, events_per_ms, seed)
    work = Path(tempfile.mkdtemp(prefix="rs-soak-"))
    out_dir, state_dir, ck_dir = work / "out", work / "state", work / "checkpoints"
    out_dir.mkdir()
    ray.init(namespace="raystream", include_dashboard=False, logging_level="warning")
    _pickle_by_value()
    samples: list[dict[str, Any]] = []
    errors: list[str] = []
    rescales: list[dict[str, Any]] = []
    code = None
    try:
        flow = soak_flow(source, str(out_dir))
        job = rs.start(
            flow,
            parallelism={COUNT: parallelism, WINDOW: parallelism, SINK: parallelism},
            state_dir=str(state_dir),
            checkpoint_interval_s=checkpoint_s,
            checkpoint_dir=str(ck_dir),
            **({} if retained_s is None else {"metrics_windows_retained_s": retained_s}),
        )
        t0 = time.monotonic()
        ctrl = _actor(controller_name(job.name))
        code = _code_of_actor(ctrl) if ctrl is not None else None
        done = threading.Event()

        def rescaler() -> None:
            target = parallelism + 1
            while rescale_every_s > 0 and not done.wait(rescale_every_s):
                at = time.monotonic() - t0
                try:
                    r = job.rescale(COUNT, target)
                    rescales.append(
                        {"at_s": round(at, 2), "to": target, "duration_s": r.get("duration_s")}
                    )
                except Exception as e:  # noqa: BLE001 - reported; the run goes on
                    errors.append(f"rescale to {target} at {at:.1f} s: {e}")
                    if job.status().get("state") != "running":
                        return
                target = parallelism if target != parallelism else parallelism + 1

        th = threading.Thread(target=rescaler, daemon=True)
        th.start()
        last_t: float | None = None
        failure: str | None = None
        while True:
            try:
                result = job.wait(max(0.0, sample_s - ((time.monotonic() - t0) % sample_s)))
            except rs.RaystreamError as e:  # the job failed: reported, no exactness
                failure, result = str(e), None
                break
            if result.state != "running":
                break
            try:
                s = take_sample(job, t0, state_dir, last_t, ck_dir)
            except Exception as e:  # noqa: BLE001 - the job ended meanwhile
                errors.append(f"sample at {time.monotonic() - t0:.1f} s: {e}")
                continue
            last_t = s["t_s"]
            samples.append(s)
            print(
                f"{s['t_s']:7.1f} s  status {s['status_ms']:7.1f} ms {s['status_bytes']:>10,} B  "
                f"controller {s['controller_rss_mb']} MB  instances {s['instance_rss_mb']}  "
                f"ckpt {s['checkpoint_duration_s']}  p99 {s['p99_ms']}  lag {s['source_lag_rows']}",
                flush=True,
            )
        done.set()
        th.join(timeout=120)
        elapsed = time.monotonic() - t0
        state = "failed" if result is None else result.state
        exact = check_exact(source, str(out_dir)) if state == "finished" else {"exact": False}
        data = {
            "benchmark": "soak",
            "what": (
                "a checkpointed job (running count in RocksDB -> 1 s tumbling event-time window "
                "-> exactly-once Parquet) at a fixed rate; samples every sample_s; growth = "
                "least-squares slope per hour over the samples of the run's second half"
            ),
            "state": state,
            "failure": failure,
            "elapsed_s": round(elapsed, 2),
            "events": events,
            "config": {
                "minutes": minutes,
                "rate": rate,
                "keys": keys,
                "events_per_ms": events_per_ms,
                "parallelism": parallelism,
                "checkpoint_s": checkpoint_s,
                "sample_s": sample_s,
                "rescale_every_s": rescale_every_s,
                "seed": seed,
                "metrics_windows_retained_s": retained_s,
            },
            "code": imported_from(rs),
            "controller_code": code,
            "growth_from_s": round(elapsed / 2, 1),
            "growth": summarize_growth(samples, elapsed / 2),
            "rescales": rescales,
            "errors": errors,
            **exact,
            "samples": samples,
        }
        print(
            f"state {state}, exact {data.get('exact')}, {len(rescales)} rescales, "
            f"{len(errors)} errors"
        )
        for k, v in data["growth"].items():
            print(f"  {k}: {v}")
        if report is not None:
            write_json(report, data)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
