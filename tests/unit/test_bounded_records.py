"""A job that runs for days keeps its controller's records bounded: rescales, standby and spare
refills and recoveries keep the newest ``RECORDS_KEPT`` (the result and the status list them,
newest last) and count every one (``<name>_total``); retired instances' metrics are added up
into running totals instead of being kept, with the totals exactly as before. Without Ray: the
controller is a plain class, its instances stand-ins."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from raystream import change_spares as spares_module
from raystream import controller as controller_module
from raystream import recovery as recovery_module
from raystream import warm_watch as warm_watch_module
from raystream.cli import _actors_note, _totals_note
from raystream.job import JobResult
from raystream.metrics import step_totals, sum_totals
from raystream.status_view import summary_lines
from tests.unit._plain_controller import Call, plain_controller

KEEP = 3


@pytest.fixture
def small_keep(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(controller_module, "RECORDS_KEPT", KEEP)
    monkeypatch.setattr(recovery_module, "RECORDS_KEPT", KEEP)
    monkeypatch.setattr(spares_module, "RECORDS_KEPT", KEEP)
    monkeypatch.setattr(warm_watch_module, "RECORDS_KEPT", KEEP)
    return KEEP


class _Handle:
    def __init__(self, snap: dict[str, Any]) -> None:
        self.metrics = Call(snap)


def _snap(rng: random.Random, step: str, index: int) -> dict[str, Any]:
    return {
        "step": step,
        "index": index,
        "records_in": rng.randrange(10_000),
        "records_out": rng.randrange(10_000),
        "busy_s": rng.random() * 7.3,  # not a short binary fraction: any reordering would show
    }


def test_records_keep_the_newest_and_count_all(tmp_path: Path, small_keep: int) -> None:
    c = plain_controller("bounded-records", tmp_path)
    appended: dict[str, list[dict[str, Any]]] = {}
    for name in ("rescales", "standby_refills", "spare_refills", "recoveries"):
        records = [{"n": i, "kind": name} for i in range(small_keep * 4 + 1)]
        for r in records:
            getattr(c, name).append(r)
        appended[name] = records
    # a standby wave is noted in the newest refill record (as _standby_wave does)
    c.standby_refills[-1].setdefault("waves", []).append([2, 0.5])
    out = c.outcome()
    desc = c.describe()
    for name, records in appended.items():
        assert out[name] == records[-small_keep:], name  # a list, newest last
        assert isinstance(out[name], list)
        assert out[f"{name}_total"] == len(records), name
    assert out["standby_refills"][-1]["waves"] == [[2, 0.5]]
    assert desc["recoveries"] == appended["recoveries"][-small_keep:]
    assert desc["recoveries_total"] == len(appended["recoveries"])
    assert desc["rescales_total"] == len(appended["rescales"])
    assert desc["standby_refills_total"] == len(appended["standby_refills"])
    c.handles = {}
    got = asyncio.run(c.metrics())
    assert got["recoveries"] == appended["recoveries"][-small_keep:]
    assert got["recoveries_total"] == len(appended["recoveries"])


def test_job_result_totals_default_to_the_lists_and_keep_what_the_controller_said() -> None:
    listed = [{"from": 1, "to": 2, "step": "count", "duration_s": 0.5}]
    r = JobResult("j", "finished", 1.0, rescales=listed, recoveries=[{}, {}])
    assert (r.rescales_total, r.recoveries_total, r.standby_refills_total) == (1, 2, 0)
    r = JobResult("j", "finished", 1.0, rescales=listed, rescales_total=250)
    assert r.rescales_total == 250
    lines = summary_lines(r)
    assert "250 rescales; the newest 1:" in lines
    assert any("rescaled 'count' 1 -> 2" in line for line in lines)


def _old_totals(retired: list[dict[str, Any]], live: list[dict[str, Any]]) -> dict[str, Any]:
    """What metrics() computed before retired instances were folded: every retired instance's
    metrics kept, then step_totals over them and the live ones, in that order."""
    return step_totals([*retired, *live])


def test_retired_instances_fold_into_totals_exactly_as_before(
    tmp_path: Path, small_keep: int
) -> None:
    rng = random.Random(0)
    c = plain_controller("bounded-history", tmp_path)
    retired: list[dict[str, Any]] = []
    # an index retired by a scale-in comes back again and again (autoscaling for days)
    for n in range(small_keep * 5):
        iid = ("count", 2 + n % 2)
        snap = _snap(rng, *iid)
        c.outcomes[iid] = {"metrics": snap, "result": None}
        c._retire_outcome(iid)
        retired.append(snap)
    c.outcomes[("out", 0)] = {"metrics": {}, "result": None}  # an ended one without metrics
    c._retire_outcome(("out", 0))
    live = [_snap(rng, s, i) for s, i in c.specs]
    c.handles = {(m["step"], m["index"]): _Handle(m) for m in live}
    got = asyncio.run(c.metrics())
    snaps = [{**m, "attempt": 0} for m in live]
    expected = _old_totals(retired, snaps)
    assert got["attempts"][-1]["totals"] == expected  # exact: the same additions, same order
    # (these inputs tell the orders apart: adding the two sums would differ in busy_s)
    assert sum_totals([step_totals(retired), step_totals(snaps)]) != expected
    assert got["totals"] == expected
    assert got["totals"]["count"]["instances"] == len(retired) + 2
    # the result lists the newest retired instances' metrics (and counts them all)
    out = c.outcome()
    assert out["metrics"] == retired[-(small_keep - 1) :] + [{}]
    assert out["retired_instances_total"] == len(retired) + 1
    assert len(c._history.kept()) == small_keep


def test_a_recovery_keeps_the_failed_attempts_totals_with_every_retired_instance(
    tmp_path: Path, small_keep: int
) -> None:
    rng = random.Random(11)
    c = plain_controller("bounded-failed-attempt", tmp_path)
    retired = []
    for n in range(small_keep * 3):
        iid = ("count", 2 + n % 3)
        c.outcomes[iid] = {"metrics": _snap(rng, *iid)}
        retired.append(c.outcomes[iid]["metrics"])
        c._retire_outcome(iid)
    live = [_snap(rng, s, i) for s, i in c.specs if s != "out"]
    ended = _snap(rng, "out", 0)
    c.outcomes[("out", 0)] = {"metrics": ended}
    c.handles = {(m["step"], m["index"]): _Handle(m) for m in [*live, ended]}
    cause = {"error": "boom", "instance": ["count", 0]}
    asyncio.run(c._keep_attempt_metrics(cause, 0))
    failed = c.failed_attempts[-1]
    before = step_totals([*live, *retired, ended])  # the old order: live, retired, ended
    after = failed["totals"]
    assert after.keys() == before.keys()
    for step, t in before.items():
        for k in ("records_in", "records_out", "instances"):
            assert after[step][k] == t[k], (step, k)
        # the retired are added first now: the sum of floats may differ in the last bits
        assert after[step]["busy_s"] == pytest.approx(t["busy_s"], rel=1e-12, abs=0)
    listed = [m for m in failed["instances"] if m["step"] == "count" and m["index"] >= 2]
    assert listed == [{**m, "attempt": 0} for m in retired[-small_keep:]]
    # the new attempt starts with nothing retired; the failed one's totals stay in the sum
    assert len(c._history) == 0 and c._retired_totals == {}
    c.outcomes = {}
    c._attempt = 1
    c.handles = {}
    got = asyncio.run(c.metrics())
    assert got["totals"] == sum_totals([after, {}])


def test_a_job_that_fails_again_and_again_keeps_the_newest_attempts_and_every_attempts_totals(
    tmp_path: Path, small_keep: int
) -> None:
    """A failure-rate restart strategy restarts for as long as failures stay rare: failed
    attempts are kept like the other records (newest listed, all counted), and the job's totals
    still add up every attempt, also those no longer listed."""
    rng = random.Random(12)
    c = plain_controller("bounded-attempts", tmp_path)
    # the oracle: plain sums of every snapshot of every failed attempt, per step
    want: dict[str, dict[str, float]] = {}
    attempts = small_keep * 3 + 1
    for attempt in range(attempts):
        live = [_snap(rng, s, i) for s, i in c.specs]
        c.handles = {(m["step"], m["index"]): _Handle(m) for m in live}
        c.outcomes = {}
        c._attempt = attempt
        cause = {"error": f"boom {attempt}", "instance": ["count", 0]}
        asyncio.run(c._keep_attempt_metrics(cause, attempt))
        for m in live:
            acc = want.setdefault(m["step"], {"records_in": 0, "records_out": 0, "busy_s": 0.0})
            for k in acc:
                acc[k] += m[k]
    out = c.outcome()
    assert out["failed_attempts_total"] == attempts
    assert [a["attempt"] for a in out["failed_attempts"]] == list(
        range(attempts - small_keep, attempts)
    )
    result = JobResult(
        "j",
        "finished",
        1.0,
        {},
        [],
        0,
        failed_attempts=out["failed_attempts"],
        failed_attempts_total=out["failed_attempts_total"],
    )
    assert result.failed_attempts_total == attempts and len(result.failed_attempts) == small_keep
    c.handles, c.outcomes, c._attempt = {}, {}, attempts
    got = asyncio.run(c.metrics())
    assert got["attempts_total"] == attempts + 1 and len(got["attempts"]) == small_keep + 1
    assert got["totals"].keys() == want.keys()
    for step, t in want.items():
        assert got["totals"][step]["records_in"] == t["records_in"], step
        assert got["totals"][step]["records_out"] == t["records_out"], step
        assert got["totals"][step]["busy_s"] == pytest.approx(t["busy_s"], rel=1e-9), step


def test_warm_actors_dropped_keep_the_newest_and_count_all(tmp_path: Path, small_keep: int) -> None:
    c = plain_controller("bounded-warm-drops", tmp_path)
    drops = [
        {"at_s": float(i), "actor": f"spare:{i}", "why": "dead"} for i in range(small_keep * 2)
    ]
    for d in drops:
        c.warm_actors_dropped.append(d)
    st = c.describe()
    assert st["warm_actors_dropped"] == drops[-small_keep:]
    assert st["warm_actors_dropped_total"] == len(drops)


def test_status_notes_name_the_actors_a_recovery_kept_and_started_and_the_totals() -> None:
    kept = [f"count/{i}" for i in range(8)]
    note = _actors_note({"actors_kept": kept, "actors_started": ["source/0"]})
    assert note == (
        "; actors kept 8 (count/0, count/1, count/2, count/3, count/4, count/5, 2 more), "
        "started 1 (source/0)"
    )
    assert _actors_note({"actors_kept": [], "actors_started": []}) == "; actors kept 0, started 0"
    assert _actors_note({"attempt": 1}) == ""  # a record without them
    st = {
        "rescales_total": 1234,
        "standby_refills_total": 7,
        "recoveries_total": 150,
        "recoveries": [{}] * 100,
    }
    assert _totals_note(st) == [
        "so far: 1,234 rescales, 7 standby refills, 150 recoveries "
        "(the newest 100 recoveries below)"
    ]
    assert _totals_note({"recoveries": []}) == []


def test_changes_keep_the_newest_records_and_settled_latencies(
    tmp_path: Path, small_keep: int
) -> None:
    c = plain_controller("bounded-changes", tmp_path)
    origin = c.origin_ns / 1e9
    n = small_keep * 5
    for i in range(n):
        c._record_reconfiguration(
            "rescale", "count", origin + i, origin + i + 0.5, epochs=[i], moved={}, change=f"#{i}"
        )
        c._settled_latency[i] = (float(i), float(i))  # as if every change's figures settled
    c.handles = {}
    got = asyncio.run(c.metrics())
    assert got["reconfigurations_total"] == n
    assert [r["change"] for r in got["reconfigurations"]] == [
        f"#{i}" for i in range(n - small_keep, n)
    ]
    assert [r["peak_latency_ms"] for r in got["reconfigurations"]] == [
        float(i) for i in range(n - small_keep, n)
    ]
    assert sorted(c._settled_latency) == list(range(n - small_keep, n))  # the others let go
    assert c.graph_version == 1 + n


def test_the_status_view_shows_them() -> None:
    from rich.console import Console

    from raystream import cli

    recovery = {
        "attempt": 1,
        "at_s": 12.5,
        "instance": ["count", 1],
        "checkpoint_id": 4,
        "downtime_s": 1.09,
        "records_replayed": 1200,
        "actors_kept": ["count/0", "out/0"],
        "actors_started": ["count/1"],
    }
    st = {
        "job": "j",
        "state": "running",
        "recoveries": [recovery],
        "recoveries_total": 1,
        "rescales_total": 2,
    }
    console = Console(record=True, width=240)
    console.print(cli.status_view(st, []))
    text = console.export_text()
    assert "so far: 2 rescales, 1 recoveries" in text
    assert (
        "recovery 1: t=12.5s ['count', 1] failed; restarted from checkpoint 4, down 1.09 s, "
        "1,200 records replayed; actors kept 2 (count/0, out/0), started 1 (count/1)"
    ) in text
