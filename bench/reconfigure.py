"""The latency cost of changing a running key-count job: replace, insert, remove, move.

    python -m bench.reconfigure --rate 100000 --keys 200000 --every 6 \\
        --report bench/results/reconfigure.json

One job: a rate-limited generator -> key-count (``count``, RocksDB state) -> a latest-count sink.
While it runs, one change every ``--every`` seconds, in this order:

1. ``replace``: ``count``'s function by a new function object of the same shape (same state);
2. ``insert``: a stateless pass-through step between the source and ``count``;
3. ``remove``: that step again;
4. ``move``: ``count`` instance 0 to another node (the same node on a one-node cluster: a new
   actor takes its key groups and state all the same).

With ``--inserted keyed`` the inserted step is keyed (``key_by="key"``, two instances, a
ValueState per key counting its records, every record passed on as it came) and is removed with
``state="drop"``: the cost of starting keyed instances with their own routing table and of
ending them.

The stream runs ``--every`` x 5 + 10 s, so the last change's spans end before the input does.
With ``--value-bytes B`` every key keeps B bytes of payload in its state (``bench._payload``):
the state grows to ``keys x (B + 8)`` bytes as keys arrive.

For each change the report has its start, end and duration (the controller's record), what
moved, and the sink latency (per input event, see ``LATENCY_WEIGHTING``) in three spans:
``before`` (the ``--window`` seconds before its start: the steady p99), ``during`` (its start
until 2 s after its end, as ``job.metrics()["reconfigurations"]`` reports it) and ``after``
(``--window`` seconds from 2 s after its end); ``peak_over_steady_p99`` is the peak during the
change over the p99 before it (the target is <= 2). The final counts are compared with numpy's
count of the same seeded generator's stream; if they differ it writes nothing and exits 1.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
import pyarrow as pa

import raystream as rs
from bench._latest import latest_counts
from bench._report import LATENCY_WEIGHTING, write_json
from bench.compare_strategies import count_mismatch, independent_counts
from bench.keycount import SINK, STEP, _connect_ray, _pickle_by_value, keycount_flow

__all__ = ["CHANGES", "change_spans", "new_owner_backlog", "passthrough", "refill_span"]

CHANGES = ("replace", "insert", "remove", "move")
AFTER_S = 2.0  # the "during" span ends this long after a change (as the controller's records)


@rs.keyed_batches(name=STEP, state=rs.ValueState(int, default=0))
def count_v2(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    """The same count as ``bench.keycount.count_vectorised``, as another function."""
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


@rs.map_batches
def passthrough(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The inserted step: every record as it came."""
    return batch


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def keyed_passthrough(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    """The inserted keyed step: counts each key's records in its state, passes them on."""
    state.put(batch.keys, state.get(batch.keys) + batch.counts)
    return batch.records


def _summary(lat: rs.metrics.LatencyRecorder, first: int, last: int) -> dict[str, Any]:
    """Latency over windows ``first..last`` (inclusive) of ``lat``."""
    s = lat.summary_of_windows(first, last)
    w = lat.window_ms / 1000
    return {
        "from_s": round(first * w, 3),
        "to_s": round((last + 1) * w, 3),
        "p50_ms": s["p50_ms"],
        "p99_ms": s["p99_ms"],
        "max_ms": s["max_ms"],
        "events": s["count"],
    }


def change_spans(
    lat: rs.metrics.LatencyRecorder, record: dict[str, Any], window_s: float
) -> dict[str, Any]:
    """Sink latency before, during and after one change (``record``: the controller's), over
    whole latency windows that do not overlap: ``before`` ends with the window before the one
    the change starts in, ``during`` runs to the window holding ``end + 2 s``, ``after`` follows
    it for ``window_s``; ``timeline``: [seconds from the start, p99, max, events] per window."""
    w = lat.window_ms / 1000

    def index(t: float) -> int:
        return int(max(0.0, t) // w)

    start, end = float(record["start_s"]), float(record["end_s"])
    first = index(start)
    settled = index(end + AFTER_S)
    before = _summary(lat, index(start - window_s), first - 1)
    during = _summary(lat, first, settled)
    after = _summary(lat, settled + 1, settled + int(round(window_s / w)))
    steady, peak = before["p99_ms"], during["max_ms"]
    # when the peak came: the start of the window holding it, seconds after the change's start
    maxima = [(lat.summary_of_windows(w_, w_)["max_ms"], w_) for w_ in range(first, settled + 1)]
    top = max(((m, w_) for m, w_ in maxima if m is not None), default=None)
    # the sink latency window by window from 1 s before the change to 2 s after its end: which
    # phase of the change (its record's ``phases_s``) the peak follows
    timeline = []
    for w_ in range(index(start - 1.0), settled + 1):
        s = lat.summary_of_windows(w_, w_)
        if s["count"]:
            timeline.append([round(w_ * w - start, 3), s["p99_ms"], s["max_ms"], s["count"]])
    return {
        "before": before,
        "during": during,
        "after": after,
        "timeline": timeline,
        "peak_over_steady_p99": (round(peak / steady, 2) if peak is not None and steady else None),
        "peak_window_at_s": round(top[1] * w - start, 3) if top else None,
    }


def refill_span(lat: rs.metrics.LatencyRecorder, refill: dict[str, Any]) -> dict[str, Any]:
    """One refill of warm spares (the controller's entry) with the sink latency (p99, max) from
    its start until 1 s after its processes were up (they start one after another)."""
    start = float(refill["start_s"])
    end = start + float(sum(refill["process_starts_s"])) + 1.0
    s = lat.summary_between(start, end)
    return {**refill, "to_s": round(end, 3), "p99_ms": s["p99_ms"], "max_ms": s["max_ms"]}


def new_owner_backlog(
    metrics: list[dict[str, Any]], record: dict[str, Any], origin_s: float
) -> dict[str, Any]:
    """A move's new owner, from its final metrics: when it first ran the records that waited
    for the moved state and when that backlog was done (seconds from the move's start), how
    many rows, and how old the oldest was then (ms since its ingest). Empty for other changes."""
    if record.get("kind") != "move" or not record.get("instance"):
        return {}
    step, index = record["instance"]
    m = next((m for m in metrics if m.get("step") == step and m.get("index") == index), None)
    mig = (m or {}).get("migration") or {}
    if mig.get("first_release_wall") is None:
        return {}
    start = origin_s + float(record["start_s"])

    def since(wall: float | None) -> float | None:
        return None if wall is None else round(wall - start, 3)

    return {
        "new_owner_backlog": {
            "first_release": since(mig["first_release_wall"]),
            "drained": since(mig.get("first_drained_wall")),
            "rows": mig.get("first_release_rows"),
            "oldest_age_ms": mig.get("first_release_age_ms"),
        }
    }


def _drive(
    job: rs.Job,
    every_s: float,
    value_bytes: int | None,
    log: list[Any],
    move_fetch: dict[str, Any] | None = None,
    changes: tuple[str, ...] = CHANGES,
    inserted: str = "stateless",
) -> None:
    """The ``changes``, ``every_s`` apart (the first ``every_s`` after the start)."""
    t0 = time.monotonic()
    # where a move goes, asked now: a status call asks every instance for its metrics, and
    # right before the change it would disturb the steady span the change is compared with
    target = _move_target(job) if "move" in changes else None
    for i, kind in enumerate(changes):
        time.sleep(max(0.0, (i + 1) * every_s - (time.monotonic() - t0)))
        try:
            if kind == "replace":
                if value_bytes is None:
                    new = count_v2
                else:
                    from bench._payload import count_with_payload

                    new = count_with_payload(value_bytes, STEP)
                log.append(job.replace(STEP, new))
            elif kind == "insert" and inserted == "keyed":
                op, keyed = keyed_passthrough, {"key_by": "key", "parallelism": 2}
                log.append(job.insert("source", op, name="passthrough", **keyed))
            elif kind == "insert":
                log.append(job.insert("source", passthrough, name="passthrough"))
            elif kind == "remove":
                state = "drop" if inserted == "keyed" else None
                log.append(job.remove("passthrough", state=state))
            else:
                log.append(job.move(STEP, 0, target, **(move_fetch or {})))
        except Exception as e:  # noqa: BLE001 - reported; the run fails below
            log.append(f"{kind}: {type(e).__name__}: {e}")


def _move_target(job: rs.Job) -> str:
    """Another alive node than the one instance 0 of the counting step runs on (that one if
    there is no other)."""
    import ray

    here = next(
        m.get("node_id")
        for m in job.status()["instances"]
        if m.get("step") == STEP and m.get("index") == 0
    )
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    return next((n for n in nodes if n != here), here)


def _fetch_options(values: tuple[str, ...]) -> dict[str, Any]:
    """``("on_demand=false", "chunk_bytes=1048576")`` as FetchPolicy keyword arguments."""
    out: dict[str, Any] = {}
    for v in values:
        key, sep, raw = v.partition("=")
        if not sep or not key:
            msg = f"expected KEY=VALUE (a FetchPolicy option), got {v!r}"
            raise click.BadParameter(msg, param_hint="'--move-fetch'")
        low = raw.lower()
        if low in ("true", "false"):
            out[key] = low == "true"
        elif raw.lstrip("-").isdigit():
            out[key] = int(raw)
        else:
            try:
                out[key] = float(raw)
            except ValueError:
                out[key] = raw
    return out


@click.command()
@click.option("--rate", type=float, default=100_000, show_default=True, help="events/s")
@click.option("--keys", type=int, default=200_000, show_default=True)
@click.option("--zipf", type=float, default=1.1, show_default=True)
@click.option(
    "--every",
    "every_s",
    type=float,
    default=6.0,
    show_default=True,
    help="seconds between changes (and before the first)",
)
@click.option(
    "--window",
    "window_s",
    type=float,
    default=3.0,
    show_default=True,
    help="seconds of the before/after spans",
)
@click.option("--parallelism", type=int, default=2, show_default=True)
@click.option(
    "--value-bytes",
    type=int,
    default=None,
    help="bytes of payload kept per key (state size = keys x this)",
)
@click.option("--seed", type=int, default=7, show_default=True)
@click.option(
    "--move-fetch",
    multiple=True,
    help="a FetchPolicy option for the move, KEY=VALUE (e.g. on_demand=false, background=all)",
)
@click.option(
    "--changes",
    "change_list",
    default=",".join(CHANGES),
    show_default=True,
    help="which changes, in this order (a comma-separated subset of replace,insert,remove,move)",
)
@click.option(
    "--prefill",
    is_flag=True,
    help="write the state of all --keys keys before the stream starts (with --value-bytes: "
    "keys x (B + 8) bytes from the first second, e.g. 1,000,000 x 1024 B = 1 GB)",
)
@click.option(
    "--inserted",
    type=click.Choice(["stateless", "keyed"]),
    default="stateless",
    show_default=True,
    help="the step inserted and removed: a stateless pass-through or a keyed one",
)
@click.option(
    "--change-spares",
    type=int,
    default=0,
    show_default=True,
    help="RuntimeConfig.change_spares: warm actors an insert or a move configures instead of "
    "starting processes (refilled one at a time after the change)",
)
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(
    rate: float,
    keys: int,
    zipf: float,
    every_s: float,
    window_s: float,
    parallelism: int,
    value_bytes: int | None,
    seed: int,
    move_fetch: tuple[str, ...],
    change_list: str,
    prefill: bool,
    inserted: str,
    change_spares: int,
    report: Path | None,
) -> None:
    if rate <= 0 or keys < 1 or every_s <= window_s or parallelism < 1:
        msg = (
            f"expected --rate > 0, --keys >= 1, --every > --window and --parallelism >= 1; got "
            f"{rate}, {keys}, {every_s} <= {window_s}, {parallelism}"
        )
        raise click.BadParameter(msg)
    fetch = _fetch_options(move_fetch)
    changes = tuple(c.strip() for c in change_list.split(",") if c.strip())
    if not changes or set(changes) - set(CHANGES) or ("remove" in changes) != ("insert" in changes):
        msg = (
            f"expected a comma-separated subset of {','.join(CHANGES)} (insert and remove "
            f"together), got {change_list!r}"
        )
        raise click.BadParameter(msg, param_hint="'--changes'")
    # the stream outlasts the last change's after-span (a move may take seconds)
    duration_s = every_s * (len(changes) + 1) + AFTER_S + window_s + 5.0
    events = int(rate * duration_s)
    gen = rs.sources.generator(events=events, keys=keys, zipf=zipf, seed=seed, rate_eps=rate)
    load_before = [round(x, 2) for x in os.getloadavg()]  # the machine's, 1/5/15 min
    started = _connect_ray()
    _pickle_by_value(("bench.keycount", "bench._latest", "bench._payload", "bench.reconfigure"))
    state_dir = None
    try:
        flow = keycount_flow(gen, "vectorised", value_bytes=value_bytes)
        prefilled = None
        if prefill:
            from bench._payload import prefill_state

            state_dir = tempfile.mkdtemp(prefix="raystream-bench-reconfigure-")
            prefilled = prefill_state(state_dir, flow, STEP, parallelism, keys, "int", value_bytes)
            click.echo(
                f"prefilled {prefilled['rows']:,} keys, {prefilled['bytes'] / 1e6:,.0f} MB of "
                f"state in {prefilled['seconds']:.1f} s"
            )
        job = rs.start(
            flow,
            parallelism={STEP: parallelism},
            linger_ms=10.0,
            change_spares=change_spares,
            **({"state_dir": state_dir} if state_dir else {}),
        )
        log: list[Any] = []
        driver = threading.Thread(
            target=_drive, args=(job, every_s, value_bytes, log, fetch, changes, inserted)
        )
        driver.start()
        driver.join()
        result = job.wait(duration_s + 120)
        errors = [e for e in log if isinstance(e, str)]
        if result.state != "finished" or errors:
            click.echo(f"Error: the job {result.state}; changes failed: {errors}", err=True)
            sys.exit(1)
        parts = [t for t in result.results.get(SINK, []) if t is not None]
        final = latest_counts(pa.concat_tables(parts))
        expected = independent_counts(gen.generate_all().column("key").to_numpy())
        got = (np.asarray(final["key"]), np.asarray(final["count"]))
        wrong = count_mismatch(expected, got)
        if wrong:
            click.echo(
                f"Error: {wrong} keys have another count than the input; not writing", err=True
            )
            sys.exit(1)
        lat = result.latency() or rs.metrics.LatencyRecorder(result.origin_ns)
        origin_s = result.origin_ns / 1e9
        total = lat.summary()
        changes = []
        for rec in log:
            changes.append(
                {
                    "kind": rec["kind"],
                    "step": rec["step"],
                    "start_s": round(rec["start_s"], 3),
                    "end_s": round(rec["end_s"], 3),
                    "duration_s": round(rec["duration_s"], 3),
                    "moved": rec["moved"],
                    **({"phases_s": rec["phases_s"]} if "phases_s" in rec else {}),
                    **{k: rec[k] for k in ("transfer", "files") if k in rec},
                    "change": rec["change"],
                    "graph_version": rec["graph_version"],
                    **change_spans(lat, rec, window_s),
                    **new_owner_backlog(result.metrics, rec, origin_s),
                }
            )
        data = {
            "benchmark": "reconfigure",
            "what": (
                "sink latency of a key-count job around each change of the running job: the "
                f"{window_s:g} s before it (steady), from its start to {AFTER_S:g} s after its "
                f"end (during), and {window_s:g} s from then on (after)"
            ),
            "latency_weighting": LATENCY_WEIGHTING,
            "config": {
                "rate_eps": rate,
                "events": events,
                "keys": keys,
                "zipf": zipf,
                "parallelism": parallelism,
                "value_bytes": value_bytes,
                "every_s": every_s,
                "window_s": window_s,
                "seed": seed,
                "move_fetch": fetch,
                "changes": list(changes),
                "prefilled": prefilled,
                "inserted": inserted,
                "change_spares": change_spares,
                "nodes": len({m.get("node_id") for m in result.metrics if m.get("node_id")}),
                # the machine's load average (1, 5, 15 min) before the job and after it
                "load_average": {
                    "before": load_before,
                    "after": [round(x, 2) for x in os.getloadavg()],
                },
            },
            "exact": True,
            "elapsed_s": round(float(result.elapsed_s), 3),
            "latency_ms": {k: total[f"{k}_ms"] for k in ("p50", "p99", "max")},
            "changes": changes,
            # the warm spares' refills after changes: the sink latency while they started
            "spare_refills": [refill_span(lat, r) for r in result.spare_refills],
            # receivers that held a new owner's channel until they read an old owner's fence:
            # how often, and the longest hold (ms), per instance
            "fence_holds": [
                {"instance": [m["step"], m["index"]], "holds": m["fence_holds"],
                 "hold_ms_max": m.get("fence_hold_ms_max")}
                for m in result.metrics
                if m.get("fence_holds")
            ],  # fmt: skip
        }
        if report is not None:
            write_json(report, data)
        for c in changes:
            click.echo(
                f"{c['kind']:8} {c['duration_s']:6.2f} s  p99 before {c['before']['p99_ms']} ms, "
                f"during {c['during']['p99_ms']} ms (peak {c['during']['max_ms']} ms, "
                f"{c['peak_over_steady_p99']}x), after {c['after']['p99_ms']} ms"
            )
    finally:
        if started:
            import ray

            ray.shutdown()
        if state_dir is not None:
            shutil.rmtree(state_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
