"""Event time on Ray: windows fired by watermarks and a two-input keyed step, each rescaled
mid-stream with meces (out and in), checked against DuckDB."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

import raystream as rs
from tests.integration._helpers import HeldAt, stop_on_error

WINDOW_MS = 5_000
BOUND_MS = 300
WATERMARK_MAX = 2**63 - 1


def fire(timers: rs.FiredTimers, state: Any) -> pa.RecordBatch:
    sums = state.get(timers.keyset)
    out = [sums[i].pop(int(t) + 1) for i, t in enumerate(timers.timestamps)]
    state.put(timers.keyset, sums)
    return timers.output(
        {"window_end": timers.timestamps + 1, "sum": out, "fired_at": [timers.watermark] * len(out)}
    )


@rs.keyed_batches(state=rs.ValueState(object), on_timer=fire)
def window_sum(batch: rs.KeyedBatch, state: Any) -> None:
    """Tumbling event-time windows; a late record (its window fired already) would be lost and
    the oracle comparison would show it."""
    sums = state.get(batch.keys)
    et = batch.records.column("event_time").to_numpy()
    v = batch.records.column("v").to_numpy()
    idx = batch.key_index()
    ends = et // WINDOW_MS * WINDOW_MS + WINDOW_MS
    late = ends - 1 <= batch.watermark
    for i, e, x in zip(idx[~late].tolist(), ends[~late].tolist(), v[~late].tolist(), strict=True):
        d = sums[i] if sums[i] is not None else {}
        sums[i] = d
        d[e] = d.get(e, 0) + x
    state.put(batch.keys, [d if d is not None else {} for d in sums])
    pairs = np.unique(np.stack([idx[~late], ends[~late] - 1]), axis=1)
    batch.timers.register_at(pairs[0], pairs[1])


def _wait(job: rs.Job, what: str, ok: Any, timeout_s: float = 120.0) -> None:
    """Until ``ok(job.metrics())``; fails after ``timeout_s`` saying what it waited for."""
    deadline = time.monotonic() + timeout_s
    while not ok(m := job.metrics()):
        assert m["state"] == "running", f"the job is {m['state']} while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.05)


def _step_in(
    m: dict[str, Any], step: str, index: int | None = None, key: str = "records_in"
) -> int:
    """``key`` summed over the instances of ``step`` (or only its instance ``index``)."""
    return sum(
        int(i.get(key, 0))
        for i in m["instances"]
        if i.get("step") == step and (index is None or i.get("index") == index)
    )


def _events(n: int, keys: int, seed: int) -> pa.Table:
    """Each half of the table (one per source instance) covers the same event-time range."""
    rng = np.random.default_rng(seed)
    half = n // 2
    i = np.arange(n) % half
    ts_ms = 1_000 + i * 2 + rng.integers(0, BOUND_MS // 2, n)
    return pa.table(
        {
            "key": rng.integers(0, keys, n),
            "v": rng.integers(1, 10, n),
            "ts": pa.array(ts_ms * 1000, pa.timestamp("us")),
        }
    )


def test_event_time_windows_survive_rescales_and_match_duckdb(tmp_path: Path) -> None:
    events = _events(240_000, 300, seed=4)
    # each source instance (120,000 rows) stops short at half its rows until the scale-out
    # returned, and at three quarters until the scale-in returned: both land mid-stream and the
    # added instance sees the watermark pass windows, however slow the machine
    out_gate, in_gate = str(tmp_path / "scaled-out"), str(tmp_path / "scaled-in")
    source = HeldAt(
        rs.sources.from_table(events, rate_eps=40_000), ((60_000, out_gate), (90_000, in_gate))
    )
    flow = rs.Dataflow("et-windows", num_key_groups=32, sub_groups=8)
    (
        flow.source(source, event_time="ts", max_out_of_orderness_ms=BOUND_MS)
        .key_by("key")
        .apply(window_sum)
        .sink(rs.sinks.collect(), name="out")
    )
    job = rs.start(flow, parallelism={"source": 2, "window_sum": 2})
    stats: list[dict] = []
    try:
        with stop_on_error(job):
            _wait(job, "40,000 records in window_sum", lambda m: _step_in(m, "window_sum") > 40_000)
            stats.append(job.rescale("window_sum", 3, "meces"))
            Path(out_gate).touch()
            _wait(  # the added instance fired windows: the watermark passed while it ran
                job,
                "window fired by window_sum/2",
                lambda m: _step_in(m, "window_sum", 2, "records_out") > 0,
            )
            stats.append(job.rescale("window_sum", 2, "meces"))
    finally:
        Path(out_gate).touch()
        Path(in_gate).touch()
    result = job.wait(timeout_s=120)
    assert result.state == "finished", result.error
    assert [s["to"] for s in stats] == [3, 2], stats
    assert all(s["moved_rows"] > 0 for s in stats), "state (and timers) moved both times"
    out = result.table("out")
    con = duckdb.connect()
    con.register("e", events)
    expected = {
        (int(k), int(w)): int(s)
        for k, w, s in con.execute(
            f"""SELECT key, (epoch_ms(ts) // {WINDOW_MS}) * {WINDOW_MS} + {WINDOW_MS} AS w, sum(v)
                FROM e GROUP BY key, w"""
        ).fetchall()
    }
    con.close()
    pairs = list(zip(out["key"].to_pylist(), out["window_end"].to_pylist(), strict=True))
    assert len(pairs) == len(set(pairs)), "a window fired twice"
    got = dict(zip(pairs, out["sum"].to_pylist(), strict=True))
    missing = expected.keys() - got.keys()
    both = expected.keys() & got.keys()
    wrong = {p: (got[p], expected[p]) for p in both if got[p] != expected[p]}
    assert not missing and not wrong and len(got) == len(expected), (
        f"{len(missing)} windows missing, {len(wrong)} wrong e.g. {list(wrong.items())[:3]}"
    )
    fired_at = out["fired_at"].to_numpy()
    assert (fired_at >= out["window_end"].to_numpy() - 1).all(), "a window fired before its time"
    mid = fired_at < WATERMARK_MAX
    assert mid.mean() > 0.8, "windows fire as the watermark passes, not only at the end"
    # the instance added by the scale-out fired windows before it retired (a retiring instance
    # fires none at its end): it caught up with the watermark
    new = [m for m in result.step_metrics("window_sum") if m["index"] == 2]
    assert new and new[0]["records_out"] > 0


@rs.keyed_batches(
    state={"balance": rs.ValueState(int, default=0), "n": rs.ValueState(int, default=0)}
)
def balance(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    col = "amount" if batch.input == 0 else "paid"
    sign = 1 if batch.input == 0 else -1
    new = state.balance.get(batch.keys) + sign * batch.reduce(col, "sum")
    n = state.n.get(batch.keys) + batch.counts
    state.balance.put(batch.keys, new)
    state.n.put(batch.keys, n)
    return batch.output({"balance": new, "n": n})


def test_connected_streams_rescale_under_meces_matches_duckdb(tmp_path: Path) -> None:
    """Deposits (2 source instances) and the union of two payment sources feed one keyed step
    with shared state; it scales out under meces while records flow."""
    rng = np.random.default_rng(9)
    nd, np_ = 160_000, 120_000
    dep = pa.table({"account": rng.integers(0, 3000, nd), "amount": rng.integers(1, 100, nd)})
    pay = pa.table(
        {"acct": rng.integers(0, 3000, np_), "paid": rng.integers(1, 50, np_), "memo": ["m"] * np_}
    )
    # every source instance stops short at half its rows until the scale-out returned
    gate = str(tmp_path / "scaled-out")

    def table(t: pa.Table, rate_eps: int, instances: int = 1) -> HeldAt:
        held = t.num_rows // instances // 2
        return HeldAt(rs.sources.from_table(t, rate_eps=rate_eps), ((held, gate),))

    flow = rs.Dataflow("et-connect", num_key_groups=32, sub_groups=8)
    d = flow.source(table(dep, 40_000, instances=2), name="deposits")
    half = np_ // 2  # the payments come from two sources, unioned
    p = flow.source(table(pay.slice(0, half), 15_000), name="pay_a")
    p = p.union(flow.source(table(pay.slice(half), 15_000), name="pay_b"))
    (
        d.key_by("account")
        .connect(p.key_by("acct"))
        .apply(balance)
        .sink(rs.sinks.collect(), name="out")
    )
    job = rs.start(flow, parallelism={"deposits": 2, "balance": 2})
    stats: list[dict] = []
    try:
        with stop_on_error(job):
            _wait(job, "60,000 records in balance", lambda m: _step_in(m, "balance") >= 60_000)
            stats.append(job.rescale("balance", 3, "meces"))
    finally:
        Path(gate).touch()
    result = job.wait(timeout_s=120)
    assert result.state == "finished", result.error
    assert [s["to"] for s in stats] == [3], stats
    assert stats[0]["moved_rows"] > 0
    out = result.table("out")
    # per account: the row with the most records behind it is the final balance
    con = duckdb.connect()
    con.register("out_t", out.select(["account", "balance", "n"]))
    con.register("dep", dep)
    con.register("pay", pay)
    got = dict(
        con.execute("SELECT account, arg_max(balance, n) FROM out_t GROUP BY account").fetchall()
    )
    dup = con.execute(
        "SELECT count(*) FROM (SELECT account, n FROM out_t GROUP BY account, n"
        " HAVING count(*) > 1)"
    ).fetchone()[0]
    expected = dict(
        con.execute(
            """SELECT k, sum(x) FROM (SELECT account AS k, amount AS x FROM dep
                                      UNION ALL SELECT acct, -paid FROM pay) GROUP BY k"""
        ).fetchall()
    )
    counts = dict(con.execute("SELECT account, max(n) FROM out_t GROUP BY account").fetchall())
    expected_n = dict(
        con.execute(
            "SELECT k, count(*) FROM (SELECT account AS k FROM dep UNION ALL SELECT acct FROM pay)"
            " GROUP BY k"
        ).fetchall()
    )
    con.close()
    assert dup == 0, "a per-key record count was emitted twice (a batch applied twice)"
    assert counts == expected_n
    assert got == expected
    new = [m for m in result.step_metrics("balance") if m["index"] == 2]
    assert new and new[0]["records_in"] > 0, "the scale-out happened mid-stream"
