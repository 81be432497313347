"""Failures mixed with live changes: a seeded random sequence, per job, of rescales of the keyed
count (out and in), replacements of its function (each tags its output rows with its own
version), an identity map inserted between the source and the count and removed again, and moves
of a count instance, interleaved with kills (``ray.kill``) of a random live instance (source,
count, sink, the inserted map): some while the change is in flight, some right after it returned.
Checkpoints every 0.5 s, an exactly-once Parquet sink.

The oracle is independent of raystream: the generator's own rows (the prefix of its stream the
gated source sent) give, per key, the sequence numbers 0..n-1 and each event's position in the
stream. The count emits one row per record: key, seq, the key's count up to it, and the tag of
the function that counted it. DuckDB reads the committed Parquet files. Checked per job:

* it finishes; every kill was followed by exactly one recovery;
* every event is in the committed output exactly once (no (key, seq) missing or twice) and its
  count is ``seq + 1`` (per key in order, no update lost or applied twice);
* tags: only the first function's and those of replacements that completed; per key the version
  never goes back; every event the source emitted after a completed replacement's barrier is
  counted by it or a later one (a replacement stays in force across recoveries);
* every change either happened (its record, and the graph says so) or was refused with a
  ReconfigurationError / RescaleError that says a failure intervened, and then nothing of it
  shows in the graph.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pytest
import ray

import raystream as rs
from raystream.runtime.actors import NAMESPACE, instance_actor_name

from ._helpers import counts_per_record, generator_prefix
from ._rescale_helpers import UntilGate

STEP = "count"
HOP = "hop"  # the inserted identity map
KEYS = 2_000
RATE_EPS = 25_000
CHECKPOINT_S = 0.5
DEFAULT_SEEDS = (187, 7)  # one job each
# other seeds, to shake out rarities locally: RAYSTREAM_CHAOS_SEEDS=1,2,3
SEEDS = (
    tuple(int(s) for s in os.environ.get("RAYSTREAM_CHAOS_SEEDS", "").split(",") if s.strip())
    or DEFAULT_SEEDS
)
OPS_PER_JOB = 7
# a change the failure interrupted is refused, saying so (raystream.controller, .reconfigurations,
# .rewiring)
WHY_REFUSED = re.compile(
    r"recovers \(or recovered\)|recovered from a failure|it recovered meanwhile"
    r"|failed or recovered|did not pass every instance"
)


def tagged_count(version: int) -> Any:
    """The keyed count, one row per record, every row tagged ``v<version>``."""
    tag = f"v{version}"

    def count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
        before = state.get(batch.keys)
        counts = batch.counts
        state.put(batch.keys, before + counts)
        records = batch.records
        return pa.record_batch(
            {
                "key": records.column("key"),
                "seq": records.column("seq"),
                "count": counts_per_record(before, counts),
                "tag": pa.array([tag] * records.num_rows, pa.string()),
            }
        )

    count.__name__ = count.__qualname__ = f"count_v{version}"  # as the job's graph shows it
    return rs.keyed_batches(state=rs.ValueState(int, default=0))(count)


@rs.map_batches
def hop(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch


# ------------------------------------------------------------------------------------------
# the seeded plan of a job


@dataclass(frozen=True)
class Op:
    kind: str  # rescale | replace | insert | remove | move
    arg: int  # rescale: the target parallelism; move: the routing index; else 0
    kill: str | None  # None, "during" (after delay_s) or "after" (once it returned)
    delay_s: float
    victim: float  # in [0, 1): picks the killed instance among the live ones


def plan(seed: int) -> list[Op]:
    """OPS_PER_JOB changes: an insert is followed by a remove before the end; rescales go out and
    in between 1 and 3; 2 of 3 changes have a kill, half of those while the change runs."""
    rng = np.random.default_rng(seed)
    ops: list[Op] = []
    inserted = False
    width = 2
    for i in range(OPS_PER_JOB):
        left = OPS_PER_JOB - i
        if inserted and left == 1:
            kind = "remove"
        else:
            kinds = ["rescale", "rescale", "replace", "move", "remove" if inserted else "insert"]
            kind = str(rng.choice(kinds))
        arg = 0
        if kind == "rescale":
            arg = int(rng.choice([p for p in (1, 2, 3) if p != width]))
            width = arg
        elif kind == "move":
            arg = int(rng.integers(0, width))
        inserted = (inserted or kind == "insert") and kind != "remove"
        r = rng.uniform()
        kill = None if r < 1 / 3 else ("during" if r < 2 / 3 else "after")
        ops.append(
            Op(kind, arg, kill, round(float(rng.uniform(0.0, 0.3)), 3), float(rng.uniform()))
        )
    return ops


def test_the_plans_mix_every_change_with_kills_during_and_after() -> None:
    ops = [op for s in DEFAULT_SEEDS for op in plan(s)]
    assert {op.kind for op in ops} == {"rescale", "replace", "insert", "remove", "move"}
    assert {(op.kind, op.kill) for op in ops} >= {("rescale", "during"), ("replace", "during")}
    assert sum(op.kill == "after" for op in ops) >= 2
    for s in DEFAULT_SEEDS:
        kinds = [op.kind for op in plan(s)]
        assert kinds.count("insert") == kinds.count("remove")


# ------------------------------------------------------------------------------------------
# driving the job


def _graph(job: rs.Job) -> dict[str, dict[str, Any]]:
    return {g["step"]: g for g in job.status()["graph"]}


def _victims(job: rs.Job) -> list[str]:
    """The actor names of the live instances (moved and inserted ones carry a ``:v<n>`` suffix;
    a step chained to another runs in its actors)."""
    status = job.status()
    names = list(status["actor_names"].values())
    out = []
    for g in status["graph"]:
        if g["chain"] and g["chain"][0] != g["step"]:
            continue  # it runs in the actors of its chain's head (operator chaining)
        for i in range(g["parallelism"] or 1):
            plain = instance_actor_name(job.name, g["step"], i)
            versions = [n for n in names if n.startswith(plain + ":v")]
            out.append(max(versions, key=lambda n: int(n.rsplit(":v", 1)[1]), default=plain))
    return out


def _kill(job: rs.Job, victim: float) -> str:
    names = _victims(job)
    name = names[int(victim * len(names))]
    try:
        actor = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        from ray.util import list_named_actors

        alive = sorted(
            a["name"]
            for a in list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"raystream:{job.name}:")
        )
        status = job.status()
        msg = (
            f"no live actor {name!r} to kill; the job is {status['state']}, its actors: {alive}, "
            f"actor_names {status['actor_names']}, graph {status['graph']}"
        )
        raise AssertionError(msg) from None
    ray.kill(actor)
    return name


def _wait_recovered(job: rs.Job, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        status = job.status()
        if len(status["recoveries"]) >= n and status["state"] == "running":
            return
        if status["state"] not in ("running", "recovering"):
            job.wait(5)  # raises JobFailedError with the cause
            raise AssertionError(f"the job is {status['state']} while recovery {n} was awaited")
        assert time.monotonic() < deadline, f"no recovery {n} within {timeout_s} s"
        time.sleep(0.05)


def _wait_flowing(job: rs.Job, records: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (
        sum(m["records_in"] for m in job.metrics()["instances"] if m.get("step") == STEP) < records
    ):
        assert time.monotonic() < deadline, f"fewer than {records} records reached {STEP!r}"
        time.sleep(0.05)


@dataclass
class Done:
    op: Op
    outcome: Any  # the change's record, or the error that refused it
    graph_before: dict[str, dict[str, Any]]
    graph_after: dict[str, dict[str, Any]]
    killed: str | None
    version: int  # the count function's version the replacement asked for (replace only)


def _change(job: rs.Job, op: Op, version: int, node: str) -> Any:
    try:
        if op.kind == "rescale":
            return job.rescale(STEP, op.arg, "meces")
        if op.kind == "replace":
            return job.replace(STEP, tagged_count(version))
        if op.kind == "insert":
            return job.insert("source", hop, name=HOP, before=STEP)
        if op.kind == "remove":
            return job.remove(HOP)
        return job.move(STEP, op.arg, node)
    except (rs.ReconfigurationError, rs.RescaleError) as e:
        return e


def _run(job: rs.Job, ops: list[Op]) -> tuple[list[Done], int]:
    node = ray.get_runtime_context().get_node_id()
    done: list[Done] = []
    kills = 0
    version = 1
    with ThreadPoolExecutor(1) as pool:
        for op in ops:
            before = _graph(job)
            if op.kind in ("insert", "remove"):  # an insert may have been refused
                op = Op("remove" if HOP in before else "insert", 0, op.kill, op.delay_s, op.victim)
            if op.kind == "move":  # the routing index within the parallelism it has now
                op = Op(
                    op.kind, op.arg % before[STEP]["parallelism"], op.kill, op.delay_s, op.victim
                )
            asked = version + 1 if op.kind == "replace" else version
            killed = None
            if op.kill == "during":
                running = pool.submit(_change, job, op, asked, node)
                time.sleep(op.delay_s)  # lands in different phases of the change, by seed
                killed = _kill(job, op.victim)
                outcome = running.result(timeout=120)
            else:
                outcome = _change(job, op, asked, node)
                if op.kill == "after":
                    killed = _kill(job, op.victim)
            if killed is not None:
                kills += 1
                _wait_recovered(job, kills)
            if op.kind == "replace":  # a refused version's tag is never used again
                version = asked
            done.append(Done(op, outcome, before, _graph(job), killed, asked))
            print(  # noqa: T201 - shown with -s: the sequence as it ran
                f"{job.name}: {op.kind} {op.arg} kill={op.kill} ({killed}) -> "
                f"{outcome if isinstance(outcome, BaseException) else 'done'}"
            )
    return done, kills


# ------------------------------------------------------------------------------------------
# checks


def _check_changes(done: list[Done]) -> None:
    for d in done:
        out, before, after, kind = d.outcome, d.graph_before, d.graph_after, d.op.kind
        where = f"{kind} {d.op} (killed {d.killed})"
        if isinstance(out, BaseException):
            text = str(out)
            assert WHY_REFUSED.search(text), f"{where}: refused without saying why: {text}"
            if kind == "replace":
                assert after[STEP]["function"] == before[STEP]["function"], (where, text)
            elif kind in ("insert", "remove"):
                assert (HOP in after) == (HOP in before), (where, text, list(after))
            continue
        if kind != "rescale":  # a rescale answers with the migration's stats
            assert out["kind"] == kind, (where, out)
        if kind == "rescale":
            assert (out["from"], out["to"]) == (before[STEP]["parallelism"], d.op.arg), where
            assert after[STEP]["parallelism"] == d.op.arg, (where, after[STEP])
        elif kind == "replace":
            assert after[STEP]["function"].endswith(f"count_v{d.version}"), (where, after[STEP])
        elif kind == "insert":
            assert HOP in after and after[STEP]["upstream"] == [HOP], (where, list(after))
        elif kind == "remove":
            assert HOP not in after and after[STEP]["upstream"] == ["source"], (where, after)


def _check_output(out: Path, stream: pa.Table, done: list[Done]) -> None:
    con = duckdb.connect()
    con.register("stream", stream)
    con.execute(f"create view o as select * from read_parquet('{out}/*.parquet')")
    dup = con.sql("select key, seq, count(*) c from o group by 1, 2 having c > 1").fetchall()
    assert dup == [], f"{len(dup)} records published twice, e.g. {dup[:5]}"
    missing = con.sql(
        "select s.key, s.seq from stream s anti join o using (key, seq) order by s.pos"
    ).fetchall()
    assert missing == [], f"{len(missing)} records never published, e.g. {missing[:5]}"
    extra = con.sql("select key, seq from o anti join stream using (key, seq)").fetchall()
    assert extra == [], f"{len(extra)} records published that were never sent: {extra[:5]}"
    wrong = con.sql("select key, seq, count from o where count != seq + 1 limit 5").fetchall()
    assert wrong == [], f"counts that saw an update twice, missed one or came out of order: {wrong}"

    # tags: the first function's and those of completed replacements only
    completed = {1} | {
        d.version
        for d in done
        if d.op.kind == "replace" and not isinstance(d.outcome, BaseException)
    }
    con.execute("create view t as select key, seq, cast(substr(tag, 2) as int) v from o")
    tags = {v for (v,) in con.sql("select distinct v from t").fetchall()}
    assert tags <= completed, f"tags of replacements that never completed: {tags - completed}"
    back = con.sql(
        "select key, seq, v, prev from (select key, seq, v, lag(v) over (partition by key "
        "order by seq) prev from t) where v < prev limit 5"
    ).fetchall()
    assert back == [], f"per key, the function's version went back (key, seq, v, before): {back}"
    for d in done:
        if d.op.kind != "replace" or isinstance(d.outcome, BaseException):
            continue
        offset = d.outcome["source_offsets"]["source/0"]
        stale = con.sql(
            f"select s.pos, t.key, t.seq, t.v from t join stream s using (key, seq) "
            f"where s.pos >= {offset} and t.v < {d.version} order by s.pos limit 5"
        ).fetchall()
        assert stale == [], (
            f"events after the barrier of the replacement by v{d.version} (source offset "
            f"{offset}) counted by an older function (pos, key, seq, version): {stale}"
        )


def _check_no_actor_left(job: str, timeout_s: float = 60.0) -> None:
    """Once the job ended none of its actors is left (none a change started and a recovery
    missed)."""
    from ray.util import list_named_actors

    prefix = f"raystream:{job}:"
    deadline = time.monotonic() + timeout_s
    while True:
        left = [
            a["name"]
            for a in list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)
        ]
        if not left:
            return
        assert time.monotonic() < deadline, f"actors of the ended job still alive: {left}"
        time.sleep(0.1)


@pytest.mark.parametrize("seed", SEEDS)
def test_live_changes_with_kills_are_exactly_once(tmp_path: Path, seed: int) -> None:
    ops = plan(seed)
    gen = rs.sources.generator(
        events=RATE_EPS * 120, keys=KEYS, zipf=1.1, seed=seed % 1000, rate_eps=RATE_EPS
    )
    gate = str(tmp_path / "gate")
    out = tmp_path / "out"
    flow = rs.Dataflow(f"chaos-{seed}", num_key_groups=64, sub_groups=8)
    (
        flow.source(UntilGate(gen, gate))
        .key_by("key")
        .apply(tagged_count(1), name=STEP)
        .sink(rs.sinks.parquet(str(out)), name="out")
    )
    # count (2) and the sink (1) run in their own actors; after a rescale of count to 1 a
    # recovery keeps them so (it keeps the job's chains), and count's instances can still move
    job = rs.start(
        flow,
        parallelism={STEP: 2},
        checkpoint_interval_s=CHECKPOINT_S,
        checkpoint_dir=str(tmp_path / "chk"),
        state_dir=tempfile.mkdtemp(),
        restart_delay_s=0.2,
        restart_attempts=2 * OPS_PER_JOB,  # every kill is one recovery (checked below)
        linger_ms=20.0,
    )
    try:
        _wait_flowing(job, RATE_EPS // 4)
        done, kills = _run(job, ops)
        Path(gate).touch()
        result = job.wait(120)
    except BaseException:
        with contextlib.suppress(Exception):
            job.cancel()
        raise
    print(  # noqa: T201 - shown with -s: what happened
        seed,
        [
            (
                d.op.kind,
                d.op.kill,
                d.killed and d.killed.split(":", 2)[2],
                type(d.outcome).__name__ if isinstance(d.outcome, BaseException) else "ok",
            )
            for d in done
        ],
    )
    assert result.state == "finished", result.error
    assert len(result.recoveries) == kills, result.recoveries
    retried = [r["cause"] for r in result.recoveries if "recovery attempt" in r["cause"]]
    assert not retried, f"recoveries that needed another attempt: {retried}"
    _check_no_actor_left(job.name)
    events = int(Path(gate + ".events").read_text())
    _check_changes(done)
    _check_output(out, generator_prefix(gen, events), done)
