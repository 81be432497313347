"""bench.state_reads: the key-count's RocksDB reads recorded and replayed per block size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests._bench import put_bench_on_path

put_bench_on_path()

from bench import state_reads  # noqa: E402


def test_state_reads_replays_the_recorded_misses_per_block_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench" / "results").mkdir(parents=True)
    args = ["--name", "r", "--events", "20000", "--keys", "3000", "--batch-rows", "500",
            "--value-bytes", "64", "--block-bytes", "512,4096", "--repeats", "2"]
    result = CliRunner().invoke(state_reads.main, args)
    assert result.exit_code == 0, result.output
    out = json.loads((tmp_path / "bench" / "results" / "r.json").read_text())
    # every key of the prefilled share is read once at least (the cache starts empty)
    assert out["keys_read"] >= 1 and out["reads"] >= 1
    assert set(out["by_block_bytes"]) == {"512", "4096"}
    for entry in out["by_block_bytes"].values():
        assert len(entry["runs"]["read_cpu_s"]) == 2
        assert entry["us_per_key_read"]["min"] <= entry["us_per_key_read"]["median"]
        # the range read sees the whole prefilled state: 3000 keys split over 2 instances
        assert all(s["bytes"] > 1000 * 64 for s in entry["runs"]["scan"])


def test_bad_block_sizes_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(state_reads.main, ["--block-bytes", "4k"])
    assert result.exit_code == 2
    assert "block sizes in bytes" in result.output and "'4k'" in result.output
