"""bench.state_read on a small state: every timed read is exact, and the report's fields."""

from __future__ import annotations

from pathlib import Path

from bench.state_read import run_kind


def test_small_state_reads_exactly(tmp_path: Path) -> None:
    for kind in ("int", "str"):
        res = run_kind(kind, 3_000, 2, 1, 2, tmp_path / kind)
        assert res["exact"] is True
        assert res["keys"] == 3_000 and len(res["runs"]) == 1
        assert res["one_key_s"]["median"] > 0 and res["rows_per_s"]["median"] > 0
