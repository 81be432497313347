"""Partition commit on Ray: an event-time stream over several ``dt=…/hm=…`` minutes goes to a
partitioned Parquet sink (2 instances, checkpoints every 0.3 s) with a partition-time commit
(``$dt $hm:00``, delay 1 min of event time, as q10). A thread watches the folders while the job
runs; each time a ``_SUCCESS`` appears it checks, through DuckDB over the files published at that
moment, that the folder already holds exactly the oracle's rows (DuckDB over the input), and
that the watermark had passed the partition's time plus the delay (visible from outside: the
source's watermark trails the largest event time it emitted by the out-of-orderness bound, and
every row before the checkpoint's barrier is published before the commit). A sink instance is
killed after the first commit: the job recovers from a checkpoint, no success file goes away,
none comes early. At the end every minute has its success file and the output equals the
input."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray

import raystream as rs
from raystream.partition_commit import CommittedPartition, folder_values
from raystream.runtime.actors import NAMESPACE, instance_actor_name

EVENTS = 80_000
RATE = 20_000  # ~4 s of stream
STEP_MS = 6  # event time advances 6 ms per event: 8 minutes of event time
JITTER_MS = 1_500
BOUND_MS = 2_000  # max_out_of_orderness_ms >= JITTER_MS: no row is late
DELAY_MS = 60_000  # q10: one minute, the partitions' length (a shorter delay commits a minute
# while rows of it still come: Flink's partition time is the start of the partition)
T0 = 1_600_000_000_000 - 1_600_000_000_000 % 60_000 + 17_000


def events() -> pa.Table:
    rng = np.random.default_rng(11)
    ts = T0 + np.arange(EVENTS, dtype=np.int64) * STEP_MS + rng.integers(0, JITTER_MS, EVENTS)
    return pa.table(
        {"v": np.arange(EVENTS, dtype=np.int64), "ts": pa.array(ts, pa.timestamp("ms"))}
    )


def partition_columns(batch: pa.RecordBatch) -> pa.RecordBatch:
    ts = batch.column("ts")
    return pa.RecordBatch.from_pydict(
        {
            "v": batch.column("v"),
            "ts": ts,
            "dt": pc.strftime(ts, "%Y-%m-%d"),
            "hm": pc.strftime(ts, "%H:%M"),
        }
    )


def oracle(table: pa.Table) -> dict[str, list[int]]:
    con = duckdb.connect()
    con.register("e", table)
    rows = con.sql(
        "select strftime(ts, '%Y-%m-%d %H:%M') as m, list(v order by v) from e group by m"
    ).fetchall()
    return {m: list(vs) for m, vs in rows}


def published(out: Path) -> tuple[dict[str, list[int]], int]:
    """Per minute, the rows of the visible files; and the largest event time (ms) in them."""
    con = duckdb.connect()
    rows = con.sql(
        f"select dt || ' ' || hm as m, list(v order by v), max(epoch_ms(ts)) from "
        f"read_parquet('{out}/*/*/*.parquet', hive_partitioning=true, "
        "hive_types={'dt': VARCHAR, 'hm': VARCHAR}) group by m"
    ).fetchall()
    return {m: list(vs) for m, vs, _ in rows}, max((int(t) for *_, t in rows), default=0)


def minute_ms(m: str) -> int:
    return int(pc.strptime(pa.array([m]), "%Y-%m-%d %H:%M", "ms").cast(pa.int64())[0].as_py())


class CheckAtCommit:
    """An ``on_commit`` policy (it runs in the controller right after the success file is
    written): reads the folder's published files at that moment and logs, one JSON line per
    commit, whether they hold exactly the oracle's rows, and the largest published event time."""

    def __init__(self, out: Path, expected: dict[str, list[int]], log: Path) -> None:
        self.out, self.expected, self.log = str(out), expected, str(log)

    def commit(self, partition: CommittedPartition) -> None:
        minute = f"{partition.values['dt']} {partition.values['hm']}"
        rows = duckdb.sql(
            f"select list(v order by v) from read_parquet('{partition.path}/*.parquet')"
        ).fetchall()[0][0]
        got, max_ts = published(Path(self.out))
        line = {
            "minute": minute,
            "exact": list(rows or []) == self.expected.get(minute),
            "rows": len(rows or []),
            "max_ts": max_ts,
            "all": got == self.expected,
        }
        with open(self.log, "a") as f:
            f.write(json.dumps(line) + "\n")


class Watcher(threading.Thread):
    """Polls the output folder for success files; checks each one the moment it appears."""

    def __init__(self, out: Path, expected: dict[str, list[int]]) -> None:
        super().__init__(daemon=True)
        self.out, self.expected = out, expected
        self.seen: dict[str, float] = {}  # minute -> when first seen
        self.problems: list[str] = []
        self.first = threading.Event()
        self.stop = threading.Event()
        self.read_retries = 0

    def minutes(self) -> set[str]:
        found = set()
        for p in self.out.glob("*/*/_SUCCESS"):
            v = folder_values(str(p.parent.relative_to(self.out)))
            found.add(f"{v['dt']} {v['hm']}")
        return found

    def check(self) -> None:
        now = self.minutes()
        gone = set(self.seen) - now
        if gone:
            self.problems.append(f"success files removed: {sorted(gone)}")
        new = now - set(self.seen)
        if not new:
            return
        for attempt in range(3):  # a file listed, then gone (a restore cleaning): read again
            try:
                rows, max_ts = published(self.out)
                break
            except duckdb.IOException:
                self.read_retries += 1
                if attempt == 2:
                    raise
        for m in sorted(new):
            self.seen[m] = time.monotonic()
            if rows.get(m) != self.expected.get(m):
                got, want = rows.get(m) or [], self.expected.get(m) or []
                self.problems.append(
                    f"{m}: committed with {len(got)} rows published, oracle has {len(want)}"
                )
            need = minute_ms(m) + DELAY_MS + BOUND_MS
            # the end of input (every row published) commits every folder: the maximal watermark
            if max_ts <= need and rows != self.expected:
                self.problems.append(
                    f"{m}: committed before the watermark passed it + delay (largest published "
                    f"event time {max_ts}, needs > {need})"
                )
        self.first.set()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 - reported by the test
                self.problems.append(f"watcher: {type(e).__name__}: {e}")
            time.sleep(0.03)


def test_partition_commit_while_running_and_across_a_recovery(tmp_path: Path) -> None:
    out = tmp_path / "out"
    table = events()
    expected = oracle(table)
    assert len(expected) >= 8
    commits_log = tmp_path / "commits.jsonl"
    flow = rs.Dataflow("partcommit-rec")
    (
        flow.source(
            rs.sources.from_table(table, rate_eps=RATE),
            event_time="ts",
            max_out_of_orderness_ms=BOUND_MS,
            parallelism=1,
        )
        .apply(rs.map_batches(partition_columns, name="parts"), name="parts")
        .sink(
            rs.sinks.parquet(
                out,
                partition_by=["dt", "hm"],
                partition_commit=rs.sinks.partition_commit(
                    "partition-time",
                    time_pattern="$dt $hm:00",
                    delay_ms=DELAY_MS,
                    on_commit=CheckAtCommit(out, expected, commits_log),
                ),
            ),
            name="out",
            parallelism=2,
        )
    )
    flow.options("out", chain=False)
    watcher = Watcher(out, expected)
    out.mkdir()
    watcher.start()
    job = rs.start(
        flow,
        checkpoint_interval_s=0.3,
        checkpoint_dir=str(tmp_path / "chk"),
        restart_delay_s=0.2,
        linger_ms=10.0,
    )
    try:
        assert watcher.first.wait(60), "no partition committed while the job ran"
        before_kill = set(watcher.seen)
        ray.kill(ray.get_actor(instance_actor_name(job.name, "out", 0), namespace=NAMESPACE))
        result = job.wait(120)
    finally:
        job.cancel()
        watcher.stop.set()
        watcher.join(5)
    watcher.check()  # the last ones (the end of input commits every folder)
    assert result.state == "finished", result.error
    assert [r["instance"][0] for r in result.recoveries] == ["out"]
    assert result.recoveries[0]["checkpoint_id"] is not None  # restored, not started over
    assert watcher.problems == []
    assert set(watcher.seen) == set(expected)
    assert before_kill, "a partition was committed while the job ran, before the kill"
    rows, _ = published(out)
    assert rows == expected
    # at the moment of each commit (in the controller): the folder was complete, and the
    # watermark had passed its minute + delay unless it was the end of input
    commits = [json.loads(line) for line in commits_log.read_text().splitlines()]
    assert {c["minute"] for c in commits} == set(expected)
    assert [c for c in commits if not c["exact"]] == []
    early = [
        c
        for c in commits
        if c["max_ts"] <= minute_ms(c["minute"]) + DELAY_MS + BOUND_MS and not c["all"]
    ]
    assert early == []
    assert sum(not c["all"] for c in commits) >= 3, "commits while the stream ran"
    summary = result.checkpoints.get("partition_commits") or {}
    assert summary.get("errors") == [], summary
    assert not [p for p in out.rglob(".*") if p.is_file()], "hidden files left behind"
