"""Reading moved state by runs of sub-groups (one RocksDB iterator per key range), on real
RocksDB, no Ray: every chunk checked against the rows written, every row served once."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from raystream.errors import StateError
from raystream.rescale import FetchPolicy
from raystream.runtime.migration import (
    MigrationEngine,
    MigrationTask,
    contiguous_runs,
    pair_rates,
    transfer_summary,
)
from raystream.state.layout import encode_one, sub_group_bounds
from raystream.state.rocks import RocksStateBackend, chunk_payload_bytes

KEY_GROUPS = 4
SUB_GROUPS = 6


def _rows(seed: int, empty: set[tuple[int, int]] = frozenset()) -> dict[bytes, bytes]:  # type: ignore[assignment]
    rng = np.random.default_rng(seed)
    return {
        encode_one(kg, sg, 0, int(i)): rng.bytes(int(rng.integers(0, 300)))
        for kg in range(KEY_GROUPS)
        for sg in range(SUB_GROUPS)
        if (kg, sg) not in empty
        for i in rng.choice(10_000, size=int(rng.integers(1, 40)), replace=False)
    }


def _pairs(chunk: Any) -> list[tuple[bytes, bytes]]:
    return list(zip(chunk.column(0).to_pylist(), chunk.column(1).to_pylist(), strict=True))


def _in(rows: dict[bytes, bytes], kg: int, first: int, last: int) -> list[tuple[bytes, bytes]]:
    lower, upper = sub_group_bounds(kg, first)[0], sub_group_bounds(kg, last)[1]
    return sorted((k, v) for k, v in rows.items() if lower <= k < upper)


@pytest.mark.parametrize("max_bytes", [1, 700, 5_000, 1 << 20])
@pytest.mark.parametrize(("first", "last"), [(0, SUB_GROUPS - 1), (1, 3), (4, 4)])
def test_a_run_is_read_in_bounded_chunks_and_says_which_sub_groups_are_complete(
    tmp_path: Path, max_bytes: int, first: int, last: int
) -> None:
    rows = _rows(max_bytes + first, empty={(2, 2), (2, 3)})
    db = RocksStateBackend(tmp_path / "db", cache_entries=0)
    db.write_direct(list(rows), list(rows.values()))
    want = _in(rows, 2, first, last)
    got: list[tuple[bytes, bytes]] = []
    sg, start, chunks = first, None, 0
    while True:
        chunk, nxt, resume = db.export_run(2, sg, last, start, max_bytes)
        part = _pairs(chunk)
        chunks += 1
        assert chunk.nbytes <= max_bytes or len(part) == 1, (chunk.nbytes, max_bytes)
        assert part == sorted(part), "a chunk's rows are in key order"
        got += part
        assert sg <= nxt <= last + 1
        if resume is None:
            assert nxt == last + 1
            break
        assert resume[:3] == sub_group_bounds(2, nxt)[0], "the resume key is in next_sub_group"
        assert got == [r for r in want if r[0] < resume], "exactly the rows before the resume key"
        # every sub-group before nxt is complete: nothing of them comes later
        assert all(k >= sub_group_bounds(2, nxt)[0] for k, _ in want[len(got) :])
        sg, start = nxt, resume
    assert got == want
    payload = sum(chunk_payload_bytes(k, v) for k, v in want)
    if max_bytes < payload:
        assert chunks > 1
    db.close()


def test_without_alone_a_row_larger_than_the_room_is_left_for_the_next_chunk(
    tmp_path: Path,
) -> None:
    db = RocksStateBackend(tmp_path / "db", cache_entries=0)
    small, big = encode_one(1, 2, 0, 1), encode_one(1, 3, 0, 1)
    db.write_direct([small, big], [b"s" * 10, b"b" * 5_000])
    chunk, nxt, resume = db.export_run(1, 2, 3, None, 100, alone=False)
    assert _pairs(chunk) == [(small, b"s" * 10)] and nxt == 3 and resume == big
    chunk, nxt, resume = db.export_run(1, 3, 3, big, 100, alone=False)
    assert chunk.num_rows == 0 and nxt == 3 and resume == big
    chunk, nxt, resume = db.export_run(1, 3, 3, big, 100)  # alone (the default): it comes
    assert _pairs(chunk) == [(big, b"b" * 5_000)] and nxt == 4 and resume is None
    db.close()


def test_a_run_refuses_a_resume_key_outside_it_and_an_empty_run(tmp_path: Path) -> None:
    db = RocksStateBackend(tmp_path / "db", cache_entries=0)
    with pytest.raises(StateError, match="outside sub-groups 1..2 of key group 0"):
        db.export_run(0, 1, 2, encode_one(0, 3, 0, 5), 100)
    with pytest.raises(StateError, match=r"0 <= first <= last < 256, got 3..2"):
        db.export_run(0, 3, 2, None, 100)
    with pytest.raises(StateError, match="max_bytes must be >= 1"):
        db.export_run(0, 1, 2, None, 0)
    db.close()


def test_contiguous_runs_keep_key_groups_apart_in_key_order_hottest_first() -> None:
    s = 4
    # ranked hottest first: 9 (key group 2) is hottest, then 1 (key group 0), ...
    ranked = [9, 1, 5, 0, 11, 4, 3, 8]
    assert contiguous_runs(ranked, s) == [[8, 9], [0, 1], [4, 5], [11], [3]]
    # runs no longer than len // pieces, split evenly, each ranked by its own best member
    assert contiguous_runs([3, 2, 1, 0], s, pieces=3) == [[3], [2], [1], [0]]
    assert contiguous_runs([7, 2, 1, 0, 3, 4, 5, 6], s, pieces=4) == [[6, 7], [2, 3], [0, 1], [4, 5]]
    assert contiguous_runs([1, 0], s, pieces=5) == [[1], [0]]
    assert contiguous_runs([], s, pieces=2) == []
    # every sub-group once, in runs of one key group, consecutive, at most len // pieces long
    rng = np.random.default_rng(3)
    gs = [int(g) for g in rng.permutation(64)[:40]]
    runs = contiguous_runs(gs, 8, pieces=6)
    assert sorted(g for r in runs for g in r) == sorted(gs)
    assert len(runs) >= 6
    for r in runs:
        assert len({g // 8 for g in r}) == 1 and r == list(range(r[0], r[0] + len(r)))
        assert len(r) <= 40 // 6


def test_a_serve_call_reads_a_key_ordered_run_with_one_read_and_never_repeats_a_row(
    tmp_path: Path,
) -> None:
    """An old owner serves calls of sub-groups of one key group: a key-ordered request is read
    by one ``export_run``; a sub-group already started in an earlier call resumes at its own key
    (it starts a run of its own even when it follows its neighbour in the request). Rows served == rows written, once."""
    rows = _rows(11)
    db = RocksStateBackend(tmp_path / "old", cache_entries=100_000)
    db.write(list(rows), list(rows.values()))  # through the cache: the seal evicts them
    outgoing = {1 * SUB_GROUPS + sg for sg in range(SUB_GROUPS)}
    old = MigrationEngine(db, KEY_GROUPS, SUB_GROUPS, range(KEY_GROUPS))
    reads: list[tuple[int, int, int]] = []
    export_run = db.export_run

    def counting(kg: int, first: int, last: int, *args: Any, **kw: Any) -> Any:
        reads.append((kg, first, last))
        return export_run(kg, first, last, *args, **kw)

    db.export_run = counting  # type: ignore[method-assign]
    policy = FetchPolicy(chunk_bytes=1 << 20)
    g = sorted(outgoing)
    served: list[tuple[bytes, bytes]] = []

    async def go() -> None:
        old.prepare(MigrationTask(1, policy, incoming={}, outgoing=set(outgoing)))
        old.activate(1)
        old.seal(1)
        # sub-group g[3], started: a chunk of about one row
        done, chunks = await old.serve(1, [g[3]], 40)
        assert done == [] and len(chunks) == 1
        served.extend(_pairs(chunks[0]))
        reads.clear()
        # g[0], g[1], g[2] are one run; g[3] starts another at its resume key, g[4], g[5] in it
        done, chunks = await old.serve(1, g, 1 << 20)
        assert done == g
        assert len(chunks) == 2  # one batch per run read, in key order, not copied into one
        for chunk in chunks:
            served.extend(_pairs(chunk))
        keys = [k for k, _ in served[1:]]
        assert keys == sorted(keys)

    asyncio.run(go())
    assert reads == [(1, 0, 2), (1, 3, 5)]
    assert sorted(served) == _in(rows, 1, 0, SUB_GROUPS - 1)
    assert len(served) == len(set(served))
    db.close()


def test_pair_rates_count_from_when_both_could_move_until_the_pairs_last_chunk() -> None:
    """Two steps of three instances: in each, instance 2 takes state from 0 and 1. A pair's
    interval starts at the later of the new owner's switch and the old owner's ready time."""
    step1 = [
        {"ready_wall": 10.5},  # ready after the new owner's switch: counts from here
        {"ready_wall": 9.0},  # ready before it: counts from the switch
        {
            "activated_wall": 10.0,
            "pair_bytes_in": {0: 3_000_000, 1: 2_000_000},
            "pair_last_in_wall": {0: 11.5, 1: 11.0},
        },
    ]
    step2 = [{"ready_wall": 20.0}, {}, {"activated_wall": 20.0, "pair_bytes_in": {0: 0}}]
    rates = pair_rates(step1 + step2, 3)
    assert rates == pytest.approx([3.0, 2.0])  # 3 MB over 1 s, 2 MB over 1 s; empty pair out
    summary = transfer_summary(step1 + step2, 3)
    assert summary["pair_mb_s"] == [3.0, 2.0]
    assert transfer_summary(step1)["pair_mb_s"] == []  # no width: no pairs
