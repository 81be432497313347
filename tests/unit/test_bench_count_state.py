"""bench.count_state: the count step's CPU without Ray, its counts checked against np.unique."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests._bench import put_bench_on_path

put_bench_on_path()

from bench import count_state  # noqa: E402


def test_count_state_writes_runs_with_exact_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench" / "results").mkdir(parents=True)
    args = ["--name", "t", "--events", "60000", "--keys", "5000", "--batch-rows", "7000", "--repeats", "2"]
    result = CliRunner().invoke(count_state.main, args)
    assert result.exit_code == 0, result.output
    out = json.loads((tmp_path / "bench" / "results" / "t.json").read_text())
    assert len(out["runs"]) == 2
    for run in out["runs"]:
        assert run["wrong_counts"] == 0
        assert run["events"] > 0 and run["batches"] >= run["events"] // 7000
        assert run["cpu_s_per_m_events"] > 0
    assert out["cpu_s_per_m_events"]["min"] <= out["cpu_s_per_m_events"]["median"]


def test_a_wrong_count_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a count step that drops the first record of every batch is caught."""
    from raystream.runtime import processors

    real = processors.KeyedProcessor.process

    def lossy(self, batch, **kw):  # noqa: ANN001, ANN003, ANN202
        return real(self, batch.slice(1), **kw)

    monkeypatch.setattr(processors.KeyedProcessor, "process", lossy)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench" / "results").mkdir(parents=True)
    args = ["--name", "t", "--events", "30000", "--keys", "500", "--repeats", "1"]
    result = CliRunner().invoke(count_state.main, args)
    assert result.exit_code == 1
    assert json.loads((tmp_path / "bench" / "results" / "t.json").read_text())["runs"][0]["wrong_counts"] > 0


def test_payload_counts_over_a_prefilled_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--value-bytes --prefill: the payload count over instance 0's prefilled keys; the counts
    (the values' first 8 bytes) are checked, and every value still has its whole payload."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench" / "results").mkdir(parents=True)
    args = ["--name", "p", "--events", "20000", "--keys", "3000", "--batch-rows", "700",
            "--repeats", "1", "--value-bytes", "64", "--prefill"]
    result = CliRunner().invoke(count_state.main, args)
    assert result.exit_code == 0, result.output
    out = json.loads((tmp_path / "bench" / "results" / "p.json").read_text())
    assert out["config"]["value_bytes"] == 64 and out["config"]["prefill"] is True
    assert out["runs"][0]["wrong_counts"] == 0 and out["runs"][0]["events"] > 0
