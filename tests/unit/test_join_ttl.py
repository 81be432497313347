"""join(state_ttl_ms=...) on a real keyed processor (RocksDB state and processing-time timers,
no Ray) with a controlled wall clock, against a plain-Python replay of the rule: a side's rows of
a key are kept while that side gets a record of the key at least every ``ttl`` ms."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from raystream.operators import joins

import raystream as rs
from raystream.errors import DataflowDefinitionError
from raystream.runtime.processors import KeyedProcessor

TTL = 60


def _processor(tmp: Path, op: Any) -> KeyedProcessor:
    flow = rs.Dataflow("t", num_key_groups=8, sub_groups=4)
    src = pa.table({"k": [1], "x": [0]})
    a = flow.source(rs.sources.from_table(src), name="a").key_by("k")
    b = flow.source(rs.sources.from_table(src), name="b").key_by("k")
    a.connect(b).apply(op, name="op")
    return KeyedProcessor(flow.steps["op"], flow.key_space, tmp / "op", range(8))


def _batches(seed: int) -> list[tuple[int, int, pa.RecordBatch]]:
    """(clock ms, input, records): one input per batch, the clock advancing 0-40 ms a batch."""
    rng = np.random.default_rng(seed)
    out, clock, rid = [], 1_000_000, 0
    for _ in range(150):
        clock += int(rng.integers(0, 41))
        m = int(rng.integers(1, 6))
        keys = rng.integers(0, 6, m)
        batch = pa.record_batch({"k": keys, "id": np.arange(rid, rid + m)})
        rid += m
        out.append((clock, int(rng.integers(0, 2)), batch))
    return out


def _expected(
    batches: list[tuple[int, int, pa.RecordBatch]], ttl: int | None, keep: str = "all"
) -> list[Any]:
    """Replay: per (side, key) the buffered ids and the time of the side's last record
    (``keep="latest"``: a batch's last record of a key replaces the side's row)."""
    buf: dict[tuple[int, int], list[int]] = defaultdict(list)
    last: dict[tuple[int, int], int] = {}
    pairs = []
    for now, side, batch in batches:
        rows = list(zip(batch["k"].to_pylist(), batch["id"].to_pylist(), strict=True))
        if keep == "latest":
            rows = list(dict(rows).items())  # the last id of each key
        for k, rid in rows:
            for s in (side, 1 - side):  # expired rows are gone before this record counts
                if ttl is not None and (s, k) in last and last[s, k] + ttl <= now:
                    buf.pop((s, k), None)
                    del last[s, k]
            for other in buf.get((1 - side, k), []):
                pairs.append((rid, other) if side == 0 else (other, rid))
            if keep == "latest":
                buf[side, k] = [rid]
            else:
                buf[side, k].append(rid)
            last[side, k] = now
    return sorted(pairs)


@pytest.mark.parametrize(("keep", "ttl"), [("all", None), ("all", TTL), ("latest", TTL)])
def test_join_state_ttl_vs_replay(
    tmp_path: Path, monkeypatch: Any, keep: str, ttl: int | None
) -> None:
    batches = _batches(seed=3)
    proc = _processor(tmp_path, joins.join(keep=keep, state_ttl_ms=ttl))
    got = []
    for now, side, batch in batches:
        monkeypatch.setattr(joins, "_now_ms", lambda now=now: now)
        outs = proc.process(batch, input=side)
        outs += proc.fire_processing(now)
        for o in outs:
            got += zip(o["id_left"].to_pylist(), o["id_right"].to_pylist(), strict=True)
    want = _expected(batches, ttl, keep)
    assert want and sorted(got) == want
    if ttl is not None:
        assert len(want) < len(_expected(batches, None, keep))  # the TTL dropped some matches
        end = batches[-1][0] + ttl
        monkeypatch.setattr(joins, "_now_ms", lambda: end)
        proc.fire_processing(end)
        for side in ("left", "right", "touched"):
            assert not list(proc.states.iter_values(side, "int")), f"{side} state not expired"
    proc.close()


def test_state_ttl_must_be_positive() -> None:
    with pytest.raises(DataflowDefinitionError, match="state_ttl_ms"):
        joins.join(state_ttl_ms=0)
