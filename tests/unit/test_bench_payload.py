"""The key-count benchmark's large-state pieces (bench/_payload.py): the payload operator and the
prefill, run in one process (run_local) and checked against collections.Counter over the input."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import raystream as rs
from raystream.keys import RoutingTable
from raystream.runtime.local import run_local
from raystream.state.layout import decode_user_key
from raystream.state.rocks import RocksStateBackend

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._latest import latest_counts  # noqa: E402
from bench._payload import COUNT_BYTES, prefill_state  # noqa: E402
from bench.keycount import keycount_flow, main  # noqa: E402


def _input_counts(source: Any) -> Counter:
    reader = source.open(0, 1)
    counts: Counter = Counter()
    while (batch := reader.read(10_000)) is not None:
        counts.update(batch.column("key").to_pylist())
    return counts


@pytest.mark.parametrize("key_type", ["int", "str"])
def test_prefilled_payload_state_counts_exactly(tmp_path: Path, key_type: str) -> None:
    keys, value_bytes, p = 3_000, 48, 2
    source = rs.sources.generator(events=20_000, keys=keys, zipf=1.1, seed=3, key_type=key_type)
    flow = keycount_flow(source, "vectorised", num_key_groups=16, value_bytes=value_bytes)
    filled = prefill_state(tmp_path, flow, "count", p, keys, key_type, value_bytes, sst_rows=500)
    assert filled["rows"] == keys
    out = asyncio.run(run_local(flow, {"count": p}, state_dir=tmp_path))
    oracle = _input_counts(source)
    got = latest_counts(out["latest"])
    assert dict(zip(got["key"].to_pylist(), got["count"].to_pylist(), strict=True)) == oracle

    # every key is in the state of the instance that owns its key group, with its payload
    table = RoutingTable.uniform(16, p)
    seen: dict[object, int] = {}
    for i in range(p):
        db = RocksStateBackend(tmp_path / "count" / str(i), cache_entries=0)
        owned = set(table.key_groups_of(i).tolist())
        for k, v in db.scan(b"", b"\xff\xff"):
            key, _ = decode_user_key(k, key_type)
            raw = v  # a ValueState(bytes) value is stored as it is
            assert len(raw) == COUNT_BYTES + value_bytes
            assert int.from_bytes(k[:2], "big") in owned
            seen[key] = int(np.frombuffer(raw[:COUNT_BYTES], "<i8")[0])
        db.close()
    names = range(keys) if key_type == "int" else (f"k{i}" for i in range(keys))
    assert seen == {k: oracle.get(k, 0) for k in names}


def test_value_bytes_must_be_positive() -> None:
    for bad in ("0", "-5"):
        result = CliRunner().invoke(main, ["--value-bytes", bad, "--events", "10"])
        assert result.exit_code == 2
        assert "--value-bytes" in result.output and f"got {bad}" in result.output


def test_prefill_needs_the_generator(tmp_path: Path) -> None:
    data = tmp_path / "ev.parquet"
    rs.sources.generator(events=10, keys=5).to_parquet(data)
    result = CliRunner().invoke(main, ["--prefill", "--input", str(data)])
    assert result.exit_code == 2
    assert "--prefill" in result.output and "generator" in result.output
