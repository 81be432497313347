"""Pushes sorted by key group in the writer (raystream.presort): the source only cuts them.

No Ray, no Spark. Oracles: numpy over the keys (which owner each row's key group has in the
routing table in force), the partitioner's own hashing path on the unsorted rows, and
collections.Counter for exactly-once through the ingest buffer across a routing change, a retried
writer and a recovery from the buffer's checkpoint state."""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pyarrow as pa
import pytest

import raystream as rs
from raystream.dataflow import KeySpec
from raystream.errors import NullKeyError
from raystream.ingest import IngestBuffer
from raystream.keys import KeySpace, RoutingTable, stable_hash
from raystream.presort import (
    KEY_GROUP_COLUMN,
    KeyGroupPlan,
    owner_runs,
    plan_for,
    sort_by_key_group,
    split_by_owner,
    take_key_groups,
)
from raystream.runtime.channels import ByKeyGroup, Forward, Rebalance

KS = KeySpace(num_key_groups=64)


def batch_of(keys: np.ndarray, start: int = 0) -> pa.RecordBatch:
    return pa.record_batch(
        {"key": pa.array(keys, pa.int64()), "seq": pa.array(np.arange(start, start + len(keys)))}
    )


def zipf_keys(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).zipf(1.3, n).astype(np.int64) % 5_000


def shuffled_table(parallelism: int, seed: int, epoch: int = 1) -> RoutingTable:
    """Owners as a rescale may leave them: not contiguous ranges."""
    owners = np.random.default_rng(seed).integers(0, parallelism, KS.num_key_groups)
    owners[:parallelism] = np.arange(parallelism)  # every instance owns a key group
    return RoutingTable(epoch=epoch, owners=owners, parallelism=parallelism)


def per_receiver(pieces: list[tuple[int, pa.RecordBatch]]) -> dict[int, list[tuple[int, int]]]:
    out: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    for r, piece in pieces:
        assert KEY_GROUP_COLUMN not in piece.schema.names
        keys, seqs = piece.column("key").to_pylist(), piece.column("seq").to_pylist()
        out[r] += list(zip(keys, seqs, strict=True))
    return dict(out)


def test_a_sorted_push_holds_the_same_rows_by_key_group_and_keeps_each_keys_order() -> None:
    keys = zipf_keys(20_000, seed=1)
    out = sort_by_key_group(batch_of(keys), "key", KS)
    kg = out.column(KEY_GROUP_COLUMN).to_numpy()
    got_keys = out.column("key").to_numpy()
    assert out.schema.field(KEY_GROUP_COLUMN).type == pa.uint16()
    np.testing.assert_array_equal(kg, KS.key_group(stable_hash(got_keys)))  # numpy oracle
    assert (np.diff(kg.astype(np.int64)) >= 0).all()
    assert sorted(out.column("seq").to_pylist()) == list(range(len(keys)))  # a permutation
    seq = out.column("seq").to_numpy()
    for k in np.unique(keys)[:200]:  # stable: a key's rows in their arrival order
        s = seq[got_keys == k]
        assert (np.diff(s) > 0).all()


@pytest.mark.parametrize("parallelism", [1, 2, 3, 7])
@pytest.mark.parametrize("uniform", [True, False])
def test_cutting_a_sorted_push_routes_every_row_as_hashing_it_would(
    parallelism: int, uniform: bool
) -> None:
    keys = zipf_keys(30_000, seed=parallelism)
    table = (
        RoutingTable.uniform(KS.num_key_groups, parallelism)
        if uniform
        else shuffled_table(parallelism, seed=parallelism)
    )
    plain = batch_of(keys)
    hashed = ByKeyGroup(KeySpec("key"), KS, table).split(plain)
    presorted = ByKeyGroup(KeySpec("key"), KS, table).split(sort_by_key_group(plain, "key", KS))
    want = per_receiver(hashed)
    got = per_receiver(presorted)
    assert set(got) == set(want)
    owner = table.owners[KS.key_group(stable_hash(keys))]  # numpy oracle of each row's owner
    for r, rows in got.items():
        assert collections.Counter(rows) == collections.Counter(want[r])
        assert sorted(s for _, s in rows) == np.flatnonzero(owner == r).tolist()
        by_key: dict[int, list[int]] = collections.defaultdict(list)
        for k, s in rows:
            by_key[k].append(s)
        assert all(v == sorted(v) for v in by_key.values())  # per-key order kept
    if uniform:  # contiguous owners: one zero-copy slice per receiver
        assert len(presorted) == len(got)


def test_a_batch_of_many_sorted_pushes_is_still_routed_exactly() -> None:
    table = shuffled_table(3, seed=5)
    parts = [
        sort_by_key_group(batch_of(zipf_keys(2_000, s), 2_000 * s), "key", KS) for s in range(12)
    ]
    joined = pa.concat_batches(parts)
    rest, kg = take_key_groups(joined)
    assert kg is not None and len(owner_runs(kg, table)) > 8 * 3  # the sort-by-owner path
    got = per_receiver(split_by_owner(rest, kg, table))
    owner = table.owners[kg]
    for r in range(3):
        assert [s for _, s in got[r]] == rest.column("seq").to_numpy()[owner == r].tolist()


def test_key_groups_for_another_key_or_key_space_are_ignored_and_always_stripped() -> None:
    keys = zipf_keys(5_000, seed=9)
    presorted = sort_by_key_group(batch_of(keys), "key", KS)
    assert take_key_groups(presorted, "seq")[1] is None
    assert take_key_groups(presorted, "key", KeySpace(num_key_groups=32))[1] is None
    assert take_key_groups(presorted, "key", KS)[1] is not None
    # a partitioner for another key space hashes itself, and still routes every row right
    other = KeySpace(num_key_groups=32)
    table = RoutingTable.uniform(32, 2)
    got = per_receiver(ByKeyGroup(KeySpec("key"), other, table).split(presorted))
    owner = table.owners[other.key_group(stable_hash(presorted.column("key")))]
    for r in (0, 1):
        assert sorted(s for _, s in got[r]) == sorted(
            presorted.column("seq").to_numpy()[owner == r].tolist()
        )
    for part in (Forward(0), Rebalance(2)):  # forward/rebalance outputs never show the column
        ((_, piece),) = part.split(presorted)
        assert piece.schema.names == ["key", "seq"]


def test_a_null_key_fails_in_the_writer_as_key_by_would() -> None:
    bad = pa.record_batch({"key": pa.array([1, None, 3], pa.int64()), "seq": [0, 1, 2]})
    with pytest.raises(NullKeyError, match="null"):
        sort_by_key_group(bad, "key", KS)


def test_string_keys_sort_by_the_same_key_groups_as_the_partitioner() -> None:
    words = np.array([f"user-{i % 700}" for i in range(7_000)], dtype=object)
    b = pa.record_batch({"key": pa.array(words), "seq": pa.array(np.arange(len(words)))})
    out = sort_by_key_group(b, "key", KS)
    want = KS.key_group(stable_hash(out.column("key")))
    np.testing.assert_array_equal(out.column(KEY_GROUP_COLUMN).to_numpy(), want)


def test_exactly_once_through_the_buffer_with_a_retry_a_rescale_and_a_recovery() -> None:
    """A writer pushes sorted pushes of two partitions; one partition's task fails and is retried
    (re-sends from offset 0); the routing table changes between reads (a rescale); the source
    recovers from the buffer's checkpoint state taken mid-way and the writers re-send everything.
    Per key, what the receivers got adds up to the input exactly (Counter oracle)."""
    n, push = 40_000, 3_000
    inputs = {p: zipf_keys(n, seed=20 + p) for p in (0, 1)}
    schema = pa.schema([("key", pa.int64()), ("seq", pa.int64())])

    def pushes(p: int) -> list[tuple[int, pa.RecordBatch]]:
        keys = inputs[p]
        return [
            (o, sort_by_key_group(batch_of(keys[o : o + push], p * n + o), "key", KS))
            for o in range(0, n, push)
        ]

    tables = [RoutingTable.uniform(64, 2), shuffled_table(3, seed=4, epoch=1)]
    delivered: collections.Counter[int] = collections.Counter()
    seen: collections.Counter[int] = collections.Counter()  # every (seq) delivered, once

    def route(batch: pa.RecordBatch, table: RoutingTable) -> None:
        for _, piece in ByKeyGroup(KeySpec("key"), KS, table).split(batch):
            delivered.update(piece.column("key").to_pylist())
            seen.update(piece.column("seq").to_pylist())

    async def first_attempt() -> dict[str, object]:
        buf = IngestBuffer(schema, capacity_rows=10**6)
        for o, b in pushes(0)[:5]:  # partition 0's task dies after 5 pushes ...
            await buf.offer(("s", 0, 0), o, b)
        for o, b in pushes(0):  # ... and its retry re-sends the whole partition
            await buf.offer(("s", 0, 0), o, b)
        for o, b in pushes(1)[:4]:
            await buf.offer(("s", 0, 1), o, b)
        reads = 0
        while (b := await buf.read(2_500, timeout_s=0.01)) is not None and b.num_rows:
            route(b, tables[reads % 2])  # a rescale between reads: another routing table
            reads += 1
        return buf.checkpoint_state()  # the checkpoint: what went downstream

    async def recovered(state: dict[str, object]) -> None:
        buf = IngestBuffer(schema, capacity_rows=10**6)
        buf.restore(state)
        for p in (0, 1):  # the feed re-sends everything to the recovered source
            for o, b in pushes(p):
                await buf.offer(("s", 0, p), o, b)
        await buf.end()
        while (b := await buf.read(4_000, timeout_s=0.01)) is not None:
            route(b, tables[1])
        st = buf.stats()
        assert st["rows_presorted"] == st["rows_accepted"] > 0, st  # every push came sorted

    asyncio.run(recovered(asyncio.run(first_attempt())))
    oracle = collections.Counter(np.concatenate([inputs[0], inputs[1]]).tolist())
    assert delivered == oracle
    assert set(seen.values()) == {1} and len(seen) == 2 * n


def test_writers_sort_only_when_every_reader_of_the_source_is_keyed_by_one_column() -> None:
    @rs.keyed_batches(name="count", state=rs.ValueState(int, default=0))
    def count(batch: rs.KeyedBatch, state: object) -> pa.RecordBatch:
        return batch.output({"count": batch.counts})

    schema = pa.schema([("key", pa.int64()), ("seq", pa.int64())])

    def flow(shape: str) -> rs.Dataflow:
        f = rs.Dataflow(f"presort-{shape}", num_key_groups=32)
        s = f.source(rs.sources.push(schema), name="src")
        if shape == "column":
            s.key_by("key").apply(count).sink(rs.sinks.collect())
        elif shape == "fn":
            s.key_by(lambda b: b.column("key")).apply(count).sink(rs.sinks.collect())
        else:
            s.sink(rs.sinks.collect())
        return f

    got = {
        shape: plan_for(flow(shape).with_parallelism(None), "src", KeySpace(32))
        for shape in ("column", "fn", "sink")
    }
    assert got == {"column": KeyGroupPlan("key", 32, 16), "fn": None, "sink": None}
