"""Bounded, flow-controlled state moves and hot-first serving, on real RocksDB, no Ray.

Two :class:`MigrationEngine`s (an old and a new owner, each with its own RocksDB in tmp_path) are
wired by a fetcher that calls the old owner's ``serve`` in the same event loop, the way the actor
edge does through Ray. Moved state is checked against a dict of what the old owner held; chunk
sizes against ``chunk_bytes``; overlap of calls against ``inflight_chunks``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from raystream.errors import ConfigError, StateError
from raystream.rescale import FetchPolicy
from raystream.runtime.migration import (
    RUNS_PER_CALL,
    DecayingHeat,
    MigrationEngine,
    MigrationTask,
    PrioritySlots,
    contiguous_runs,
)
from raystream.state.layout import encode_one, sub_group_bounds
from raystream.state.rocks import RocksStateBackend

NUM_KEY_GROUPS = 8
SUB_GROUPS = 4


def _rows(kgs: range, per_sub_group: int, value_bytes: int, seed: int) -> dict[bytes, bytes]:
    rng = np.random.default_rng(seed)
    return {
        encode_one(kg, sg, 0, i): rng.bytes(int(rng.integers(1, value_bytes)))
        for kg in kgs
        for sg in range(SUB_GROUPS)
        for i in range(per_sub_group)
    }


def _dump(b: RocksStateBackend) -> dict[bytes, bytes]:
    return dict(b.scan(b"", b"\xff" * 8))


class Pair:
    """An old owner holding every key group and a new owner taking the upper half."""

    def __init__(self, tmp: Path, policy: FetchPolicy, rows: dict[bytes, bytes]) -> None:
        self.old_db = RocksStateBackend(tmp / "old", cache_entries=100_000)
        self.new_db = RocksStateBackend(tmp / "new", cache_entries=100_000)
        self.old_db.write(list(rows), list(rows.values()))  # through the cache: dirty entries
        self.old = MigrationEngine(self.old_db, NUM_KEY_GROUPS, SUB_GROUPS, range(NUM_KEY_GROUPS))
        self.new = MigrationEngine(self.new_db, NUM_KEY_GROUPS, SUB_GROUPS, ())
        self.moving = list(range(NUM_KEY_GROUPS // 2 * SUB_GROUPS, NUM_KEY_GROUPS * SUB_GROUPS))
        self.policy = policy
        self.calls: list[dict[str, Any]] = []  # each serve call: groups, urgent, chunk bytes
        self.in_flight = 0
        self.max_in_flight = 0
        self.delay_s = 0.0

        async def fetch(owner: int, epoch: int, groups: list[int], max_bytes: int, urgent: bool):
            assert owner == 0
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(self.delay_s)  # the round trip
                done, chunks = await self.old.serve(epoch, groups, max_bytes, urgent)
            finally:
                self.in_flight -= 1
            self.calls.append(
                {
                    "groups": list(groups),
                    "done": list(done),
                    "urgent": urgent,
                    "bytes": [c.nbytes for c in chunks],
                }
            )
            return done, chunks

        self.new.fetcher = fetch

    def prepare(self, epoch: int = 1, heat: dict[int, float] | None = None) -> None:
        self.old.prepare(MigrationTask(epoch, self.policy, incoming={}, outgoing=set(self.moving)))
        self.new.prepare(
            MigrationTask(
                epoch,
                self.policy,
                incoming=dict.fromkeys(self.moving, 0),
                outgoing=set(),
                heat=heat or {},
            )
        )

    def close(self) -> None:
        self.old_db.close()
        self.new_db.close()


async def _until(cond: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.001)


def _moved(rows: dict[bytes, bytes], kg_from: int) -> dict[bytes, bytes]:
    lower = sub_group_bounds(kg_from, 0)[0]
    return {k: v for k, v in rows.items() if k >= lower}


@pytest.mark.parametrize(("chunk_bytes", "inflight"), [(3_000, 1), (3_000, 3), (1 << 20, 2)])
def test_state_moves_in_chunks_of_at_most_chunk_bytes_with_bounded_calls_in_flight(
    tmp_path: Path, chunk_bytes: int, inflight: int
) -> None:
    rows = _rows(range(NUM_KEY_GROUPS), per_sub_group=40, value_bytes=200, seed=chunk_bytes)
    policy = FetchPolicy(
        on_demand=False,
        background="all",
        hold="all_moved",
        chunk_bytes=chunk_bytes,
        inflight_chunks=inflight,
        chunk_sub_groups=1 << 20,
    )
    pair = Pair(tmp_path, policy, rows)

    async def go() -> None:
        pair.delay_s = 0.002
        pair.prepare()
        pair.new.activate(1)
        pair.old.activate(1)
        pair.old.seal(1)
        pair.new.seal(1)
        await _until(lambda: pair.new.take_released() == [] and pair.new.task.done.is_set())
        await _until(lambda: pair.old.task.done.is_set())

    asyncio.run(go())
    moved = _moved(rows, NUM_KEY_GROUPS // 2)
    kept = {k: v for k, v in rows.items() if k not in moved}
    assert _dump(pair.new_db) == moved
    assert _dump(pair.old_db) == kept
    # a call's chunk may come as several batches (one per key range read): bounded together
    sizes = [sum(c["bytes"]) for c in pair.calls if c["bytes"]]
    assert max(sizes) <= chunk_bytes
    payload = sum(len(k) + len(v) + 8 for k, v in moved.items())
    if chunk_bytes < payload:  # several chunks, several sub-groups split over chunks
        assert len(sizes) >= payload // chunk_bytes
        split = [c for c in pair.calls if c["bytes"] and c["groups"][0] not in c["done"]]
        assert split, "no sub-group was split over several chunks"
    assert pair.max_in_flight <= inflight  # no slot is kept for on-demand fetches here
    if inflight > 1:
        assert pair.max_in_flight > 1, "the pair's pipeline never held more than one call"
    assert pair.new.task.max_inflight_chunks == pair.max_in_flight
    assert pair.old.task.max_chunk_bytes == max(sizes)
    pair.close()


def test_a_sub_group_larger_than_a_chunk_is_split_and_resumed(tmp_path: Path) -> None:
    rows = _rows(range(NUM_KEY_GROUPS), per_sub_group=50, value_bytes=400, seed=3)
    b = RocksStateBackend(tmp_path / "db", cache_entries=0)
    b.write(list(rows), list(rows.values()))
    want = sorted((k, v) for k, v in rows.items() if k[:3] == sub_group_bounds(5, 2)[0])
    got: list[tuple[bytes, bytes]] = []
    start = None
    chunks = 0
    while True:
        chunk, start = b.export_chunk(5, 2, start, 2_000)
        assert chunk.nbytes <= 2_000
        got += list(zip(chunk.column(0).to_pylist(), chunk.column(1).to_pylist(), strict=True))
        chunks += 1
        if start is None:
            break
    assert got == want and chunks > 1
    # a single row larger than the limit comes alone
    big = encode_one(6, 0, 0, 1)
    b.write_direct([big], [b"x" * 5_000])
    chunk, start = b.export_chunk(6, 0, None, 100)
    assert chunk.num_rows == 1 and start is not None
    with pytest.raises(StateError, match="max_bytes must be >= 1"):
        b.export_chunk(6, 0, None, 0)
    b.close()


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_chunk_bytes_must_be_positive(bad: Any) -> None:
    with pytest.raises(ConfigError, match="chunk_bytes must be an int >= 1"):
        FetchPolicy(chunk_bytes=bad)
    with pytest.raises(ConfigError, match="inflight_chunks must be an int >= 1"):
        FetchPolicy(inflight_chunks=0)


def test_on_demand_requests_are_served_before_queued_background_pulls(tmp_path: Path) -> None:
    """Background pulls queue at the old owner before the seal; an on-demand request comes
    last; after the seal it is served first, and its wait from the seal is recorded."""
    rows = _rows(range(NUM_KEY_GROUPS), per_sub_group=30, value_bytes=100, seed=5)
    policy = FetchPolicy(chunk_bytes=1_000, inflight_chunks=4, fetch_concurrency=4)
    pair = Pair(tmp_path, policy, rows)
    order: list[tuple[bool, list[int]]] = []

    async def go() -> None:
        pair.prepare()
        old = pair.old
        background = [
            asyncio.ensure_future(old.serve(1, [g], 1_000, False)) for g in pair.moving[:6]
        ]
        hot = pair.moving[-1]
        urgent = asyncio.ensure_future(old.serve(1, [hot], 1_000, True))
        for i, f in enumerate(background):
            f.add_done_callback(lambda _, i=i: order.append((False, [pair.moving[i]])))
        urgent.add_done_callback(lambda _: order.append((True, [hot])))
        await asyncio.sleep(0.01)
        assert not urgent.done() and not any(f.done() for f in background), "served unsealed"
        old.activate(1)
        old.seal(1)
        await asyncio.gather(urgent, *background)

    asyncio.run(go())
    assert order[0] == (True, [pair.moving[-1]]), order
    waits = pair.old.task.serve_wait_ms
    # one wait recorded, for the one on-demand request; nothing ran between the seal and its
    # chunk but the scheduler (a loose bound: the machine is shared)
    assert len(waits) == 1 and 0 <= waits[0] < 1_000, waits
    pair.close()


def test_priority_slots_bound_order_and_the_slot_kept_for_urgent_calls() -> None:
    async def go() -> list[str]:
        slots = PrioritySlots(3, reserved=1)
        got: list[str] = []

        async def take(name: str) -> None:
            await slots.acquire(name.startswith("u"))
            got.append(name)

        # background calls get 2 of the 3 slots; the third waits although a slot is free
        tasks = [asyncio.ensure_future(take(n)) for n in ("b1", "b2", "b3", "b4")]
        await asyncio.sleep(0.001)
        assert got == ["b1", "b2"] and slots.used == 2
        # an urgent call takes the kept slot at once
        await take("u1")
        assert got == ["b1", "b2", "u1"] and slots.used == 3
        # more urgent calls wait, but before the background ones queued earlier
        tasks.append(asyncio.ensure_future(take("u2")))
        await asyncio.sleep(0.001)
        slots.release()  # frees one: u2 (urgent first), not b3
        await asyncio.sleep(0.001)
        assert got[-1] == "u2" and slots.used == 3
        slots.release()
        slots.release()  # 1 used: b3 gets one of the background slots, b4 waits
        await asyncio.sleep(0.001)
        assert got[-1] == "b3" and slots.used == 2
        slots.release()
        await asyncio.gather(*tasks)
        assert slots.max_used == 3
        return got

    assert asyncio.run(go()) == ["b1", "b2", "u1", "u2", "b3", "b4"]
    with pytest.raises(StateError, match="reserved"):
        PrioritySlots(1, reserved=1)


def test_heat_is_a_decaying_rate() -> None:
    now = [0.0]
    heat = DecayingHeat(4, half_life_s=2.0, clock=lambda: now[0])
    # sub-group 0: 1000 records/s for 20 s, then silent; sub-group 1: silent, then 100/s
    for _ in range(200):
        now[0] += 0.1
        heat.add(np.zeros(100, dtype=np.int64))
    steady = heat.rate()[0]
    assert abs(steady - 1000) / 1000 < 0.05, steady  # a steady rate reads as that rate
    for _ in range(100):  # 10 s = 5 half-lives
        now[0] += 0.1
        heat.add(np.ones(10, dtype=np.int64))
    rate = heat.rate()
    assert abs(rate[0] - steady * 0.5**5) < 1e-6 * steady
    assert rate[1] > rate[0], "the recently hot sub-group must rank first"
    assert rate[2] == rate[3] == 0
    now[0] += 2.0
    assert abs(heat.rate()[1] - rate[1] / 2) < 1e-9 * rate[1]
    with pytest.raises(StateError, match="half-life"):
        DecayingHeat(4, half_life_s=0)


def test_hot_first_pulls_the_recently_hot_sub_groups_first(tmp_path: Path) -> None:
    rows = _rows(range(NUM_KEY_GROUPS), per_sub_group=5, value_bytes=50, seed=9)
    policy = FetchPolicy(
        on_demand=True,
        background="hot_first",
        chunk_sub_groups=1,
        fetch_concurrency=1,
        inflight_chunks=1,
    )
    pair = Pair(tmp_path, policy, rows)
    moving = pair.moving
    heat = {g: float(i) for i, g in enumerate(moving)}  # the last is the hottest

    async def go() -> None:
        pair.prepare(heat=heat)
        pair.old.activate(1)
        pair.old.seal(1)
        pair.new.activate(1)
        pair.new.seal(1)
        await _until(lambda: pair.new.take_released() == [] and pair.new.task.done.is_set())

    asyncio.run(go())
    served = [c["groups"][0] for c in pair.calls]
    assert served == sorted(moving, key=lambda g: -heat[g])
    pair.close()


def test_the_seal_evicts_only_the_moving_sub_groups_from_the_cache(tmp_path: Path) -> None:
    rows = _rows(range(NUM_KEY_GROUPS), per_sub_group=20, value_bytes=30, seed=11)
    policy = FetchPolicy(chunk_bytes=1 << 20)
    pair = Pair(tmp_path, policy, rows)
    moving_prefixes = {sub_group_bounds(*divmod(g, SUB_GROUPS))[0] for g in pair.moving}

    async def go() -> None:
        pair.prepare()
        pair.old.activate(1)
        pair.old.seal(1)
        await pair.old.serve(1, pair.moving[:1], 1 << 20, True)

    asyncio.run(go())
    cache = pair.old_db._cache  # noqa: SLF001 - what the cache holds is the point here
    staying = {k for k in rows if k[:3] not in moving_prefixes}
    assert set(cache) == staying, "the cache lost entries of sub-groups that stay"
    assert not set(pair.old_db._dirty) - staying  # noqa: SLF001
    # the moving sub-groups not served yet were written to RocksDB before they left the cache
    g = pair.moving[1]
    chunk, rest = pair.old_db.export_chunk(*divmod(g, SUB_GROUPS), None, 1 << 20)
    prefix = sub_group_bounds(*divmod(g, SUB_GROUPS))[0]
    assert rest is None
    assert dict(zip(chunk.column(0).to_pylist(), chunk.column(1).to_pylist(), strict=True)) == {
        k: v for k, v in rows.items() if k[:3] == prefix
    }
    pair.close()


def test_the_cache_is_bounded_in_bytes(tmp_path: Path) -> None:
    b = RocksStateBackend(tmp_path / "db", cache_entries=1 << 30, cache_bytes=100_000)
    oracle: dict[bytes, bytes] = {}
    rng = np.random.default_rng(2)
    for round_ in range(50):
        keys = [encode_one(1, 0, 0, int(i)) for i in rng.integers(0, 3_000, 200)]
        values = [rng.bytes(100) for _ in keys]
        b.write(keys, values)
        oracle.update(zip(keys, values, strict=True))
        assert b.cached_bytes() <= 100_000, round_
    assert b.cached_bytes() > 0
    assert dict(b.scan(b"", b"\xff" * 4)) == oracle
    with pytest.raises(StateError, match="cache_bytes"):
        RocksStateBackend(tmp_path / "x", cache_bytes=0)
    b.close()


def test_buffered_records_are_bounded_in_bytes(tmp_path: Path) -> None:
    """Records of a missing sub-group are buffered; over ``max_pending_bytes`` the engine says
    so (the instance then holds its post-barrier inputs; see test_instance_rescale)."""
    db = RocksStateBackend(tmp_path / "db")
    engine = MigrationEngine(db, NUM_KEY_GROUPS, SUB_GROUPS, (), max_pending_bytes=10_000)
    policy = FetchPolicy(on_demand=False, background="none")
    g = 5
    engine.prepare(MigrationTask(1, policy, incoming={g: 0}, outgoing=set()))

    async def go() -> None:
        engine.activate(1)
        total = 0
        while not engine.over_limit:
            batch = pa.record_batch({"key": np.arange(100), "v": np.ones(100)})
            assert engine.split(batch, np.full(100, g, dtype=np.int64)) is None
            total += batch.nbytes
        assert engine.pending_bytes == total > 10_000
        assert engine.pending_rows == 100 * (total // batch.nbytes)

    asyncio.run(go())
    db.close()


def test_fetch_policy_replace_keeps_validation() -> None:
    p = FetchPolicy()
    assert replace(p, inflight_chunks=3).inflight_chunks == 3
    with pytest.raises(ConfigError):
        replace(p, chunk_bytes=-5)


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 2_000])
def test_an_on_demand_fetch_brings_the_owners_other_sub_groups_hottest_run_first(
    tmp_path: Path, chunk_bytes: int
) -> None:
    """A record of one missing sub-group fetches it first and, in the room left in the same
    chunk, the owner's other sub-groups not asked for yet, by runs of consecutive sub-groups of
    one key group (one RocksDB iterator each), the run with the hottest member first; what does
    not fit follows in background pulls. Every row arrives once, each chunk's rows in key
    order."""
    rows = _rows(range(NUM_KEY_GROUPS), per_sub_group=20, value_bytes=60, seed=13)
    policy = FetchPolicy(
        on_demand=True,
        background="hot_first",
        chunk_bytes=chunk_bytes,
        chunk_sub_groups=1,
        fetch_concurrency=1,
        inflight_chunks=3,
    )
    pair = Pair(tmp_path, policy, rows)
    moving = pair.moving
    rng = np.random.default_rng(chunk_bytes)
    heat = {g: float(h) for g, h in zip(moving, rng.permutation(len(moving)), strict=True)}
    wanted = min(moving, key=lambda g: heat[g])  # the coldest: only its record makes it first
    chunks: list[pa.RecordBatch] = []
    reads: list[tuple[int, int, int]] = []  # the old owner's export_run calls: (kg, first, last)
    export_run = pair.old_db.export_run

    def counted(kg: int, first: int, last: int, *args: Any, **kw: Any) -> Any:
        reads.append((kg, first, last))
        return export_run(kg, first, last, *args, **kw)

    pair.old_db.export_run = counted  # type: ignore[method-assign]

    async def go() -> list[pa.RecordBatch]:
        pair.prepare(heat=heat)
        fetch = pair.new.fetcher

        async def keep(*args: Any) -> Any:
            done, got = await fetch(*args)
            chunks.extend(got)
            return done, got

        pair.new.fetcher = keep
        pair.old.activate(1)
        pair.old.seal(1)
        pair.new.activate(1)
        batch = pa.RecordBatch.from_pydict({"x": [1, 2]})
        assert pair.new.split(batch, np.array([wanted, wanted])) is None
        pair.new.seal(1)
        released: list[pa.RecordBatch] = []
        await _until(
            lambda: released.extend(pair.new.take_released()) or pair.new.task.done.is_set()
        )
        return released

    released = asyncio.run(go())
    assert [b.num_rows for b in released] == [2]  # the buffered record, after its state
    first = pair.calls[0]
    others = sorted((g for g in moving if g != wanted), key=lambda g: -heat[g])
    runs_of_others = [g for r in contiguous_runs(others, SUB_GROUPS) for g in r]
    assert first["urgent"] and first["groups"] == [wanted, *runs_of_others], first
    assert wanted in first["done"]
    if chunk_bytes >= sum(len(k) + len(v) + 8 for k, v in rows.items()):
        assert len(pair.calls) == 1 and sorted(first["done"]) == moving  # one call moved all
        # read with one iterator per key group (and the wanted one's own), not per sub-group
        assert len(reads) <= NUM_KEY_GROUPS // 2 + 2, reads
    else:
        # what did not fit came in background pulls: one sequence of calls per background
        # slot (2: one of the 3 is kept for on-demand fetches), each dealt key-ordered runs
        # (read with one iterator each), hottest run first; every call asks for what is left
        # of its sequence
        assert len(pair.calls) > 1 and not any(c["urgent"] for c in pair.calls[1:])
        pulled = sorted((g for g in moving if g not in first["done"]), key=lambda g: -heat[g])
        runs = contiguous_runs(pulled, SUB_GROUPS, 2 * RUNS_PER_CALL)
        assert all(len(r) <= max(1, len(pulled) // (2 * RUNS_PER_CALL)) for r in runs)
        seqs = [[g for r in runs[i::2] for g in r] for i in range(2)]
        for c in pair.calls[1:]:
            assert any(seq[len(seq) - len(c["groups"]) :] == c["groups"] for seq in seqs), c
    for chunk in chunks:
        keys = chunk.column(0).to_pylist()
        assert keys == sorted(keys), "a chunk's rows must be in key order"
    assert sum(len(c["done"]) for c in pair.calls) == len(moving)
    moved = _moved(rows, NUM_KEY_GROUPS // 2)
    assert _dump(pair.new_db) == moved
    assert _dump(pair.old_db) == {k: v for k, v in rows.items() if k not in moved}
    pair.close()


def test_released_records_come_as_one_batch_in_arrival_order_per_sub_group(
    tmp_path: Path,
) -> None:
    """Records buffered in many small pieces (one per sub-group and batch) are released as few
    batches: every record once, each sub-group's in the order they came."""
    rows = _rows(range(NUM_KEY_GROUPS), per_sub_group=3, value_bytes=20, seed=17)
    policy = FetchPolicy(on_demand=False, background="none", background_after_s=0.05)
    pair = Pair(tmp_path, policy, rows)
    rng = np.random.default_rng(17)
    sent: list[tuple[int, int]] = []  # (sub-group, seq) in arrival order

    async def go() -> list[pa.RecordBatch]:
        pair.prepare()
        pair.old.activate(1)
        pair.old.seal(1)
        pair.new.activate(1)
        for _ in range(12):  # batches of records of random moving sub-groups
            groups = rng.choice(pair.moving, size=int(rng.integers(1, 9)))
            seq = np.arange(len(sent), len(sent) + len(groups))
            sent.extend(zip(groups.tolist(), seq.tolist(), strict=True))
            batch = pa.RecordBatch.from_pydict({"g": groups, "seq": seq})
            assert pair.new.split(batch, groups.astype(np.int64)) is None
        pair.new.seal(1)
        released: list[pa.RecordBatch] = []
        await _until(
            lambda: released.extend(pair.new.take_released()) or pair.new.task.done.is_set()
        )
        return released

    released = asyncio.run(go())
    assert len(released) == 1, [b.num_rows for b in released]
    got = list(zip(*(released[0].column(c).to_pylist() for c in ("g", "seq")), strict=True))
    assert sorted(got) == sorted(sent)
    for g in {g for g, _ in sent}:
        seqs = [s for h, s in got if h == g]
        assert seqs == [s for h, s in sent if h == g], g
    pair.close()


def test_an_old_owner_serves_from_a_loop_in_another_thread_while_its_own_loop_writes(
    tmp_path: Path,
) -> None:
    """The Ray edge serves state on the actor's transfer loop (its own thread): requests made
    before the seal wait for it; chunks are read while the instance's loop goes on writing the
    sub-groups that stay; dropping what went out runs on the instance's loop."""
    import threading

    rows = _rows(range(NUM_KEY_GROUPS), per_sub_group=60, value_bytes=300, seed=21)
    policy = FetchPolicy(chunk_bytes=4_000, inflight_chunks=3)
    pair = Pair(tmp_path, policy, rows)
    transfer = asyncio.new_event_loop()
    server = threading.Thread(target=transfer.run_forever, daemon=True)
    server.start()
    served_on: set[int] = set()
    dropped_on: set[int] = set()
    drop = pair.old_db.drop_sub_group

    def recording_drop(*a: Any, **kw: Any) -> None:
        dropped_on.add(threading.get_ident())
        drop(*a, **kw)

    pair.old_db.drop_sub_group = recording_drop  # type: ignore[method-assign]
    serve = pair.old.serve

    async def on_transfer_loop(epoch: int, groups: list[int], max_bytes: int, urgent: bool):
        served_on.add(threading.get_ident())
        return await serve(epoch, groups, max_bytes, urgent)

    def across(epoch: int, groups: list[int], max_bytes: int, urgent: bool):
        fut = asyncio.run_coroutine_threadsafe(
            on_transfer_loop(epoch, groups, max_bytes, urgent), transfer
        )
        return asyncio.wrap_future(fut)

    pair.old.serve = across  # type: ignore[method-assign]
    staying = [k for k in rows if k < sub_group_bounds(NUM_KEY_GROUPS // 2, 0)[0]]
    written: dict[bytes, bytes] = {}

    async def go() -> int:
        me = threading.get_ident()
        pair.prepare()
        pair.new.activate(1)
        pair.old.activate(1)
        # a record of a moving sub-group asks for it before the old owner sealed
        g = pair.moving[3]
        kg, sg = divmod(g, SUB_GROUPS)
        pair.new.split(pa.record_batch({"x": [1]}), np.array([g]))
        await asyncio.sleep(0.01)
        assert not pair.new.task.arrived, "state went out before the seal"
        pair.old.seal(1)
        pair.new.seal(1)
        writes = 0
        while not (pair.new.task.done.is_set() and pair.old.task.done.is_set()):
            pair.old.give_way(0.01)
            k = staying[writes % len(staying)]
            written[k] = b"w%d" % writes
            pair.old_db.write([k], [written[k]])  # the instance's own records, meanwhile
            writes += 1
            pair.new.take_released()
            await asyncio.sleep(0)
        assert dropped_on == {me}, "sub-groups were dropped off the instance's loop"
        return writes

    try:
        writes = asyncio.run(go())
    finally:
        _stop_transfer_loop(transfer, server)
    assert served_on and threading.get_ident() not in served_on
    assert writes > 0
    moved = _moved(rows, NUM_KEY_GROUPS // 2)
    assert _dump(pair.new_db) == moved
    assert _dump(pair.old_db) == {**{k: v for k, v in rows.items() if k not in moved}, **written}
    assert not pair.old.held[pair.moving].any() and pair.new.held[pair.moving].all()
    assert pair.old.task.chunks_out >= sum(len(k) + len(v) for k, v in moved.items()) // 4_000
    assert pair.old.task.export_s > 0 and pair.new.task.import_s > 0
    assert len(pair.new.task.fetch_rtt_ms) == pair.new.task.fetch_calls
    pair.close()


class _PublishHook(MigrationEngine):
    """An engine that runs ``on_task`` (once) the moment ``prepare`` publishes a new task:
    the point where a serving loop in another thread, polling for the task, can go on."""

    on_task: Any = None

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "task" and value is not None and self.on_task is not None:
            hook, self.on_task = self.on_task, None
            hook()


def test_a_fetch_that_comes_while_the_next_step_is_being_prepared_is_served(
    tmp_path: Path,
) -> None:
    """Two steps of one rescale (fluid: one key group per step). The controller sends a step's
    task beside its barrier without waiting, so a new owner's fetch may reach a busy old owner
    first; the old owner's transfer thread waits for the task and serves the fetch the moment
    it sees it. Here it sees it exactly while the instance's loop is still inside ``prepare``
    (the last step's idle server on the transfer loop): the fetch must still be served."""
    import threading

    rows = _rows(range(NUM_KEY_GROUPS), per_sub_group=20, value_bytes=200, seed=33)
    policy = FetchPolicy(chunk_bytes=4_000, inflight_chunks=2)
    pair = Pair(tmp_path, policy, rows)
    old = _PublishHook(pair.old_db, NUM_KEY_GROUPS, SUB_GROUPS, range(NUM_KEY_GROUPS))
    pair.old = old
    steps = [pair.moving[: len(pair.moving) // 2], pair.moving[len(pair.moving) // 2 :]]
    transfer = asyncio.new_event_loop()
    server = threading.Thread(target=transfer.run_forever, daemon=True)
    server.start()
    published = threading.Event()
    submitted = threading.Event()
    serve = MigrationEngine.serve

    async def on_transfer_loop(epoch: int, groups: list[int], max_bytes: int, urgent: bool):
        while old.task is None or old.task.epoch < epoch:  # the actor waits for the task
            await asyncio.sleep(0.001)
        call = asyncio.ensure_future(serve(old, epoch, groups, max_bytes, urgent))
        await asyncio.sleep(0)  # the request is queued (serve ran up to its first await)
        if published.is_set():
            submitted.set()
        return await call

    def across(epoch: int, groups: list[int], max_bytes: int, urgent: bool):
        fut = asyncio.run_coroutine_threadsafe(
            on_transfer_loop(epoch, groups, max_bytes, urgent), transfer
        )
        return asyncio.wrap_future(fut)

    old.serve = across  # type: ignore[method-assign]

    def step_tasks(epoch: int, moving: list[int]) -> tuple[MigrationTask, MigrationTask]:
        return (
            MigrationTask(epoch, policy, incoming={}, outgoing=set(moving)),
            MigrationTask(epoch, policy, incoming=dict.fromkeys(moving, 0), outgoing=set()),
        )

    async def run_step(epoch: int, moving: list[int], *, late_task: bool) -> None:
        out_task, in_task = step_tasks(epoch, moving)
        pair.new.prepare(in_task)
        pair.new.activate(epoch)
        pair.new.seal(epoch)
        if late_task:  # the fetch is out; the old owner takes its task only now
            await _until(lambda: pair.new.task.fetch_calls > 0)
            await asyncio.sleep(0.02)

            def hold_prepare() -> None:  # the transfer thread goes on at this very point
                published.set()
                assert submitted.wait(5), "the fetch was not submitted"

            old.on_task = hold_prepare
        old.prepare(out_task)
        old.activate(epoch)
        old.seal(epoch)
        deadline = time.monotonic() + 10
        while not (pair.new.task.done.is_set() and old.task.done.is_set()):
            pair.new.take_released()
            assert time.monotonic() < deadline, (
                f"step {epoch} did not finish: new owner {pair.new.stats()}, "
                f"old owner {old.stats()}"
            )
            await asyncio.sleep(0.002)

    async def go() -> None:
        await run_step(1, steps[0], late_task=False)
        await run_step(2, steps[1], late_task=True)

    try:
        asyncio.run(go())
    finally:
        _stop_transfer_loop(transfer, server)
    assert published.is_set() and submitted.is_set()
    moved = _moved(rows, NUM_KEY_GROUPS // 2)
    assert _dump(pair.new_db) == moved
    assert _dump(pair.old_db) == {k: v for k, v in rows.items() if k not in moved}
    pair.close()


def _stop_transfer_loop(transfer: asyncio.AbstractEventLoop, server: Any) -> None:
    """Cancel what still runs on the transfer loop (the idle server of a finished epoch), stop
    the loop and join its thread."""

    async def stop() -> None:
        for t in asyncio.all_tasks():
            if t is not asyncio.current_task():
                t.cancel()

    asyncio.run_coroutine_threadsafe(stop(), transfer).result(5)
    transfer.call_soon_threadsafe(transfer.stop)
    server.join(5)
