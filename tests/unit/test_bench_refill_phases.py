"""bench.refill_phases: a rescale's latency hump split into the move and the standby refill;
hand-made timelines, hand-computed expectations."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from tests._bench import put_bench_on_path

put_bench_on_path()

from bench.refill_phases import main, phases, summarize  # noqa: E402


def _run(refill: bool = True) -> dict[str, Any]:
    # 250 ms windows from 0 to 12 s: p99 30 before, 300 over the move (5.0-5.5 s), 200 while
    # the refill starts (6.0-8.0 s: 0.5 s after the end, waves of 1.5 and 0.5 s), 60 after
    timeline = []
    for i in range(48):
        t = i * 0.25
        p99 = 30.0
        if 5.0 <= t <= 5.5:
            p99 = 300.0
        elif 6.0 <= t <= 8.0:
            p99 = 200.0 if t != 7.0 else 450.0
        elif t > 8.0:
            p99 = 60.0
        timeline.append([t, 25_000, p99 / 2, p99, p99 * 1.1])
    run: dict[str, Any] = {
        "window_ms": 250,
        "timeline": timeline,
        "rescales": [{"start_s": 5.0, "end_s": 5.5}],
        "standby_refills": [],
    }
    if refill:
        run["standby_refills"] = [{"after_s": 0.5, "waves": [[1, 1.5], [1, 0.5]]}]
    return run


def test_the_move_and_the_refill_are_told_apart() -> None:
    got = phases(_run())
    assert got["before_median_ms"] == 30.0
    assert got["move_max_ms"] == 300.0  # 4.75 s (30) to 5.75 s (30) around 5.0-5.5 (300)
    assert got["refill_s"] == 2.0
    assert got["refill_median_ms"] == 200.0 and got["refill_max_ms"] == 450.0
    assert got["after_refill_median_ms"] == 60.0


def test_a_run_without_a_refill_has_only_the_move() -> None:
    got = phases(_run(refill=False))
    assert got["move_max_ms"] == 300.0
    assert got["refill_s"] is None and got["refill_median_ms"] is None


def test_summary_and_command_over_compare_reports(tmp_path: Path) -> None:
    assert summarize([{"a": 1.0, "b": None}, {"a": 3.0, "b": None}, {"a": 2.0, "b": None}]) == {
        "a": {"median": 2.0, "min": 1.0, "max": 3.0},
        "b": None,
    }
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"runs": {"meces": [_run(), _run()]}}))
    out = tmp_path / "o.json"
    res = CliRunner().invoke(main, [str(report), "--out", str(out)])
    assert res.exit_code == 0, res.output
    got = json.loads(out.read_text())
    assert len(got["runs"]) == 2 and got["summary"]["refill_max_ms"]["median"] == 450.0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rescales": [], "timeline": []}))
    res = CliRunner().invoke(main, [str(bad), "--out", str(out)])
    assert res.exit_code != 0 and "has no rescale" in res.output
