"""Channels: inbox ordering / capacity / round robin, output batching and credits, partitioners."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from raystream.dataflow import KeySpec
from raystream.errors import NullKeyError, SchemaError
from raystream.keys import KeySpace, RoutingTable
from raystream.runtime.channels import (
    ByKeyGroup,
    Forward,
    Inbox,
    OutputChannel,
    Rebalance,
    materialise_key,
)
from raystream.runtime.messages import (
    AfterFences,
    EndOfStream,
    Fence,
    RowsThenWatermark,
    Watermark,
)

A, B, C = ("up", 0), ("up", 1), ("up", 2)


async def settle(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


# ---- Inbox -----------------------------------------------------------------------------------------
def test_out_of_order_pushes_are_delivered_in_sequence_order() -> None:
    async def main() -> list:
        inbox = Inbox(capacity=100)
        seqs = list(range(50))
        random.Random(4).shuffle(seqs)
        tasks = [asyncio.create_task(inbox.put(A, s, f"item{s}")) for s in seqs]
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        return [(await inbox.get())[1] for _ in range(50)]

    assert asyncio.run(main()) == [f"item{s}" for s in range(50)]


def test_channel_never_holds_more_than_capacity() -> None:
    async def main() -> None:
        inbox = Inbox(capacity=3)
        tasks = [asyncio.create_task(inbox.put(A, s, s)) for s in range(10)]
        await settle()
        assert inbox.depth() == 3
        assert sum(t.done() for t in tasks) == 3  # the other puts are blocked (no ack yet)
        got = []
        while len(got) < 10:
            ch, item = await asyncio.wait_for(inbox.get(), 5)
            assert ch == A
            got.append(item)
            await settle()
            assert inbox.depth() <= 3
        assert got == list(range(10))
        assert all(t.done() for t in tasks)
        assert inbox.max_depth_seen == 3

    asyncio.run(main())


def test_round_robin_across_channels() -> None:
    async def main() -> list:
        inbox = Inbox(capacity=10)
        for ch, n in ((A, 4), (B, 2), (C, 3)):
            for s in range(n):
                await inbox.put(ch, s, (ch[1], s))
        return [(await inbox.get())[1] for _ in range(9)]

    got = asyncio.run(main())
    assert got == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (0, 2), (2, 2), (0, 3)]


NEW = ("up", 9)  # a new owner's channel (another instance index after a move)


def drain_now(inbox: Inbox) -> list:
    """Every item the reader can take now, in the order it takes them."""
    got = []
    while (item := inbox.get_nowait()) is not None:
        got.append(item)
    return got


def test_a_new_owners_channel_is_held_until_the_old_owners_fence_is_read() -> None:
    """Per-key order across a move at a receiver fed by both owners: what the new owner sends
    after its AfterFences mark is read only after everything the old owner sent before its
    fence, whatever the round robin would pick; neither mark waits for the reader."""

    async def main() -> None:
        inbox = Inbox(capacity=10)
        for ch in (A, B, NEW):
            inbox.add_channel(ch)
        await inbox.put(NEW, 0, AfterFences(5, (0,)))  # queued at once, like the fence
        await inbox.put(NEW, 1, "n0")
        await inbox.put(NEW, 2, "n1")
        for seq, item in enumerate(["a0", "a1", Fence(5), "a2"]):
            await inbox.put(A, seq, item)
        await inbox.put(B, 0, "b0")
        assert await inbox.get() == (A, "a0")
        assert inbox.held(NEW)
        inbox.unblock_all()  # an aligned barrier's unblocking does not release it
        got = [await inbox.get(), await inbox.get()]
        assert got == [(B, "b0"), (A, "a1")]  # NEW skipped: still held
        assert inbox.held(NEW)
        rest = drain_now(inbox)  # the reader is back: a1 was processed, the fence is passed
        assert not inbox.held(NEW)
        assert sorted(rest) == [(A, "a2"), (NEW, "n0"), (NEW, "n1")]
        assert [i for c, i in rest if c == NEW] == ["n0", "n1"]
        assert inbox.holds == 1 and inbox.hold_ms_max >= 0

    asyncio.run(main())


def test_after_fences_holds_only_for_fences_still_to_be_read_on_live_inputs() -> None:
    async def main() -> None:
        inbox = Inbox(capacity=10)
        for ch in (A, B, NEW):
            inbox.add_channel(ch)
        # A's fence of epoch 5 was read before the mark came: nothing to wait for
        await inbox.put(A, 0, Fence(5))
        await inbox.put(NEW, 0, AfterFences(5, (0,)))
        await inbox.put(NEW, 1, "n0")
        assert drain_now(inbox) == [(NEW, "n0")]
        # an old owner that is no input here (index 7), or the channel itself: nothing
        await inbox.put(NEW, 2, AfterFences(6, (7, 9)))
        await inbox.put(NEW, 3, "n1")
        assert drain_now(inbox) == [(NEW, "n1")]
        # an older fence does not stand for a newer epoch's: B's 4 < 6
        await inbox.put(B, 0, Fence(4))
        await inbox.put(NEW, 4, AfterFences(6, (1,)))
        await inbox.put(NEW, 5, "n2")
        assert drain_now(inbox) == [] and inbox.held(NEW)
        # the old owner ends (its EndOfStream read): nothing more of it can come
        await inbox.put(B, 1, "b0")
        await inbox.put(B, 2, EndOfStream())
        assert drain_now(inbox) == [(B, "b0"), (B, EndOfStream()), (NEW, "n2")]
        # an ended old owner is not waited for at a later epoch either
        await inbox.put(NEW, 6, AfterFences(7, (1,)))
        await inbox.put(NEW, 7, "n3")
        assert drain_now(inbox) == [(NEW, "n3")]

    asyncio.run(main())


def test_a_held_channel_waits_for_every_old_owner_it_names() -> None:
    async def main() -> None:
        inbox = Inbox(capacity=10)
        for ch in (A, B, NEW):
            inbox.add_channel(ch)
        await inbox.put(NEW, 0, AfterFences(3, (0, 1)))
        await inbox.put(NEW, 1, "n0")
        await inbox.put(A, 0, Fence(3))
        assert drain_now(inbox) == [] and inbox.held(NEW)  # B's fence still to come
        await inbox.put(B, 0, "b0")
        await inbox.put(B, 1, Fence(3))
        assert drain_now(inbox) == [(B, "b0"), (NEW, "n0")]

    asyncio.run(main())


def test_an_output_channel_mark_goes_after_its_buffered_rows_without_waiting() -> None:
    async def main() -> None:
        inbox = Inbox(capacity=10)

        def send(seq_item: tuple) -> asyncio.Future:
            seq, item = seq_item
            return asyncio.ensure_future(inbox.put(A, seq, item))

        out = OutputChannel(send, batch_rows=1000, linger_ms=10_000, max_inflight=4)
        await out.add(batch(0, 5))  # buffered (linger): the fence flushes it first
        await out.mark(Fence(2))
        await settle()
        assert out.idle  # queued at the receiver, nothing read yet: acknowledged all the same
        ch, got = await inbox.get()
        assert ch == A and got.num_rows == 5
        assert inbox.get_nowait() is None and inbox.depth() == 0  # the fence passed

    asyncio.run(main())


def test_removing_or_reopening_an_old_owners_channel() -> None:
    async def main() -> None:
        inbox = Inbox(capacity=2)
        for ch in (A, B, NEW):
            inbox.add_channel(ch)
        await inbox.put(NEW, 0, AfterFences(5, (0,)))
        await inbox.put(NEW, 1, "n0")
        assert drain_now(inbox) == [] and inbox.held(NEW)
        inbox.remove_channel(A)  # gone: nothing of it to wait for
        assert drain_now(inbox) == [(NEW, "n0")]
        # a channel id that comes back is another instance: its fences are still to come
        await inbox.put(B, 0, Fence(6))
        assert drain_now(inbox) == []
        inbox.reset_channel(B)
        await inbox.put(NEW, 2, AfterFences(6, (1,)))
        await inbox.put(NEW, 3, "n1")
        assert drain_now(inbox) == [] and inbox.held(NEW)

    asyncio.run(main())


def test_block_and_unblock_all() -> None:
    async def main() -> None:
        inbox = Inbox(capacity=10)
        for s in range(3):
            await inbox.put(A, s, ("a", s))
            await inbox.put(B, s, ("b", s))
        inbox.block(A)
        got = [(await inbox.get())[1] for _ in range(3)]
        assert got == [("b", 0), ("b", 1), ("b", 2)]
        assert await inbox.get(timeout_s=0.05) is None  # A is held
        assert inbox.depth() == 3
        # a get waiting on a blocked inbox wakes on unblock_all
        waiter = asyncio.create_task(inbox.get())
        await settle()
        assert not waiter.done()
        inbox.unblock_all()
        assert (await asyncio.wait_for(waiter, 1))[1] == ("a", 0)

    asyncio.run(main())


def test_get_wakes_on_put_and_times_out() -> None:
    async def main() -> None:
        inbox = Inbox(capacity=2)
        inbox.add_channel(A)
        t0 = time.monotonic()
        assert await inbox.get(timeout_s=0.05) is None
        assert time.monotonic() - t0 >= 0.04
        waiter = asyncio.create_task(inbox.get(timeout_s=5))
        await settle()
        await inbox.put(A, 0, "x")
        assert await asyncio.wait_for(waiter, 1) == (A, "x")

    asyncio.run(main())


def test_remove_channel() -> None:
    async def main() -> None:
        inbox = Inbox(capacity=2)
        await inbox.put(A, 0, "x")
        inbox.add_channel(B)
        with pytest.raises(RuntimeError, match="1 unread"):
            inbox.remove_channel(A)
        inbox.remove_channel(B)
        assert inbox.channels == [A]

    asyncio.run(main())


# ---- OutputChannel -------------------------------------------------------------------------------
class FakeReceiver:
    """send((seq, item)) records the push at once and returns a future the test completes."""

    def __init__(self, auto_ack: bool = False) -> None:
        self.sent: list[tuple[int, object]] = []
        self.acks: list[asyncio.Future] = []
        self.auto_ack = auto_ack

    def send(self, payload):
        self.sent.append(payload)
        fut = asyncio.get_running_loop().create_future()
        if self.auto_ack:
            fut.set_result(None)
        self.acks.append(fut)
        return fut

    def unacked(self) -> int:
        return sum(not f.done() for f in self.acks)


def batch(start: int, n: int) -> pa.RecordBatch:
    return pa.record_batch({"x": pa.array(range(start, start + n), pa.int64())})


def test_batches_ship_at_batch_rows() -> None:
    async def main() -> FakeReceiver:
        r = FakeReceiver(auto_ack=True)
        out = OutputChannel(r.send, batch_rows=10, linger_ms=10_000, max_inflight=4)
        for i in range(0, 30, 3):  # 10 batches of 3 rows
            await out.add(batch(i, 3))
        await out.add(pa.record_batch({"x": pa.array([], pa.int64())}))  # ignored
        assert out.deadline is not None  # 30 rows: 3 pushes of 12 rows, 6 left
        await out.drain()
        assert out.deadline is None
        assert out.rows_sent == 30 and out.batches_sent == 3
        return r

    r = asyncio.run(main())
    assert [s for s, _ in r.sent] == [0, 1, 2]
    assert [b.num_rows for _, b in r.sent] == [12, 12, 6]
    assert pa.concat_arrays([b.column("x") for _, b in r.sent]).to_pylist() == list(range(30))


def test_linger_deadline() -> None:
    async def main() -> None:
        r = FakeReceiver(auto_ack=True)
        out = OutputChannel(r.send, batch_rows=1000, linger_ms=50, max_inflight=2)
        assert out.deadline is None
        t0 = time.monotonic()
        await out.add(batch(0, 5))
        t1 = time.monotonic()
        await out.add(batch(5, 5))  # the deadline is set by the first buffered row
        assert t0 + 0.05 <= out.deadline <= t1 + 0.05
        assert r.sent == []
        await out.flush()
        assert [b.num_rows for _, b in r.sent] == [10]
        assert out.deadline is None
        await out.flush()  # nothing buffered: no push
        assert len(r.sent) == 1

    asyncio.run(main())


def test_never_more_than_max_inflight_unacknowledged() -> None:
    async def main() -> None:
        r = FakeReceiver()
        out = OutputChannel(r.send, batch_rows=1, linger_ms=0, max_inflight=3)
        producer = asyncio.create_task(_produce(out, 10))
        await settle()
        assert len(r.sent) == 3 and r.unacked() == 3 and not producer.done()
        # ack out of order: the sender waits for the oldest push first
        r.acks[2].set_result(None)
        await settle()
        assert len(r.sent) == 3
        r.acks[0].set_result(None)
        await settle()
        assert len(r.sent) == 4
        for _ in range(200):
            assert r.unacked() <= 3
            pending = [f for f in r.acks if not f.done()]
            if producer.done() and not pending:
                break
            if pending:
                pending[0].set_result(None)
            await settle()
        assert producer.done()
        assert [s for s, _ in r.sent] == list(range(10))
        assert out.max_inflight_seen <= 3

    asyncio.run(main())


async def _produce(out: OutputChannel, n: int) -> None:
    for i in range(n):
        await out.add(batch(i, 1))


def test_drain_waits_for_all_acks() -> None:
    async def main() -> None:
        r = FakeReceiver()
        out = OutputChannel(r.send, batch_rows=100, linger_ms=0, max_inflight=5)
        await out.push("control")
        await out.add(batch(0, 3))
        drain = asyncio.create_task(out.drain())
        await settle()
        assert len(r.sent) == 2 and not drain.done()  # flushed, but acks are missing
        r.acks[1].set_result(None)
        await settle()
        assert not drain.done()
        r.acks[0].set_result(None)
        await asyncio.wait_for(drain, 1)
        assert r.sent[0] == (0, "control") and r.sent[1][0] == 1

    asyncio.run(main())


def test_concat_with_different_but_compatible_schemas() -> None:
    async def main() -> FakeReceiver:
        r = FakeReceiver(auto_ack=True)
        out = OutputChannel(r.send, batch_rows=4, linger_ms=0, max_inflight=2)
        await out.add(pa.record_batch({"x": [1, 2]}))
        await out.add(pa.record_batch({"x": [3, 4], "y": ["a", "b"]}))
        await out.drain()
        return r

    r = asyncio.run(main())
    (_, b), = r.sent
    assert b.to_pydict() == {"x": [1, 2, 3, 4], "y": [None, None, "a", "b"]}


# ---- partitioners ------------------------------------------------------------------------------
def test_forward_and_rebalance() -> None:
    b = batch(0, 3)
    assert Forward(2).split(b) == [(2, b)]
    rb = Rebalance(3, start=4)
    assert [rb.split(b)[0][0] for _ in range(7)] == [1, 2, 0, 1, 2, 0, 1]


def _events(n: int, kind: str, seed: int) -> pa.RecordBatch:
    rng = np.random.default_rng(seed)
    raw = rng.integers(-500, 500, size=n)
    keys = raw.tolist() if kind == "int" else [f"u{x}" for x in raw]
    return pa.record_batch({"key": keys, "seq": np.arange(n, dtype=np.int64)})


@pytest.mark.parametrize("kind", ["int", "str"])
@pytest.mark.parametrize("table", ["uniform", "random"])
def test_by_key_group_split(kind, table) -> None:
    ks = KeySpace(128, 16)
    if table == "uniform":
        rt = RoutingTable.uniform(128, 5)
    else:
        rt = RoutingTable(3, np.random.default_rng(9).integers(0, 7, size=128), 7)
    b = _events(3000, kind, 1)
    parts = ByKeyGroup(KeySpec(column="key"), ks, rt).split(b)
    receivers = [r for r, _ in parts]
    assert len(receivers) == len(set(receivers))
    key_list = b.column("key").to_pylist()
    kg, _ = ks.locate(key_list)
    oracle_dest = {k: int(rt.owners[g]) for k, g in zip(key_list, kg.tolist())}
    seen = Counter()
    per_key_seq: dict = defaultdict(list)
    for r, piece in parts:
        assert piece.schema == b.schema
        for row in piece.to_pylist():
            assert oracle_dest[row["key"]] == r
            seen[(row["key"], row["seq"])] += 1
            per_key_seq[row["key"]].append(row["seq"])
    assert seen == Counter(zip(key_list, b.column("seq").to_pylist()))
    for seqs in per_key_seq.values():
        assert seqs == sorted(seqs)  # per-key relative order preserved


def test_by_key_group_single_receiver_shortcuts() -> None:
    ks = KeySpace(128, 16)
    b = _events(100, "int", 2)
    assert ByKeyGroup(KeySpec(column="key"), ks, RoutingTable.uniform(128, 1)).split(b) == [(0, b)]
    owners = np.full(128, 2)
    parts = ByKeyGroup(KeySpec(column="key"), ks, RoutingTable(0, owners, 4)).split(b)
    assert [r for r, _ in parts] == [2] and parts[0][1].equals(b)


def test_by_key_group_empty_batch() -> None:
    b = pa.record_batch({"key": pa.array([], pa.int64())})
    assert ByKeyGroup(KeySpec(column="key"), KeySpace(), RoutingTable.uniform(128, 4)).split(b) == []


# ---- materialise_key ------------------------------------------------------------------------------
def test_materialise_key_by_column() -> None:
    b = pa.record_batch({"user": pa.array([3, 1, 2], pa.int32()), "v": [1, 2, 3]})
    out, keys = materialise_key(b, KeySpec(column="user"))
    assert out is b and keys.type == pa.int64() and keys.to_pylist() == [3, 1, 2]


def test_materialise_key_by_vectorised_fn() -> None:
    b = pa.record_batch({"a": ["x", "y"], "b": ["1", "2"]})
    out, keys = materialise_key(b, KeySpec(fn=lambda bt: pc.binary_join_element_wise(bt["a"], bt["b"], "-")))
    assert keys.to_pylist() == ["x-1", "y-2"]
    assert out.schema.names == ["a", "b", "_key"] and out.column("_key").to_pylist() == ["x-1", "y-2"]


def test_materialise_key_per_record_fn() -> None:
    b = pa.record_batch({"a": [1, 2, 3]})
    out, keys = materialise_key(b, KeySpec(fn=lambda r: r["a"] * 10, per_record=True))
    assert keys.to_pylist() == [10, 20, 30] and out.column("_key").to_pylist() == [10, 20, 30]


def test_materialise_key_errors() -> None:
    b = pa.record_batch({"a": [1, None, 3]})
    with pytest.raises(SchemaError) as ei:
        materialise_key(b, KeySpec(column="user"))
    assert "'user'" in str(ei.value) and "['a']" in str(ei.value)
    with pytest.raises(NullKeyError, match="'a' holds 1 null"):
        materialise_key(b, KeySpec(column="a"))
    with pytest.raises(NullKeyError):
        materialise_key(b, KeySpec(fn=lambda r: r["a"], per_record=True))
    with pytest.raises(SchemaError, match="returned 2 keys for a batch of 3 rows"):
        materialise_key(b, KeySpec(fn=lambda bt: pa.array([1, 2])))
    with pytest.raises(SchemaError, match="type double"):
        materialise_key(pa.record_batch({"a": [1.5]}), KeySpec(column="a"))


# ---- adaptive batching --------------------------------------------------------------------------
def test_adaptive_sends_small_batches_at_once_while_nothing_is_in_flight() -> None:
    async def main() -> None:
        r = FakeReceiver()
        out = OutputChannel(r.send, batch_rows=800, linger_ms=10_000, max_inflight=4, adaptive=True)
        await out.add(batch(0, 5))  # small, nothing in flight: goes at once
        assert [b.num_rows for _, b in r.sent] == [5] and out.deadline is None
        await out.add(batch(5, 5))  # the first push is not acknowledged: waits (linger)
        await out.add(batch(10, 5))
        assert len(r.sent) == 1 and out.deadline is not None
        r.acks[0].set_result(None)
        await out.add(batch(15, 5))  # acknowledged: the 15 rows buffered go as one push
        assert [b.num_rows for _, b in r.sent] == [5, 15] and out.deadline is None
        r.acks[1].set_result(None)
        await out.add(batch(20, 100))  # 100 rows = batch_rows / 8: large, gathers as before
        assert len(r.sent) == 2 and out.deadline is not None
        await out.add(batch(120, 700))  # 800 rows: batch_rows reached
        assert [b.num_rows for _, b in r.sent] == [5, 15, 800]
        got = pa.concat_arrays([b.column("x") for _, b in r.sent]).to_pylist()
        assert got == list(range(820))  # nothing lost, order kept

    asyncio.run(main())


def test_without_adaptive_small_batches_wait_for_linger() -> None:
    async def main() -> None:
        r = FakeReceiver(auto_ack=True)
        out = OutputChannel(r.send, batch_rows=800, linger_ms=10_000, max_inflight=4)
        await out.add(batch(0, 5))
        assert r.sent == [] and out.deadline is not None

    asyncio.run(main())


def test_take_batches_joins_queued_batches_up_to_max_rows_and_stops_at_other_items() -> None:
    async def main() -> None:
        inbox = Inbox(capacity=10)
        items = [batch(0, 3), batch(3, 3), batch(6, 3), "barrier", batch(9, 3)]
        for seq, item in enumerate(items):
            await inbox.put(A, seq, item)
        await inbox.put(B, 0, batch(100, 3))
        ch, first = await inbox.get()
        assert ch == A and first.num_rows == 3
        more = inbox.take_batches(A, 3)  # room for one more batch of 3 rows
        assert [b.column("x").to_pylist() for b in more] == [[3, 4, 5]]
        more = inbox.take_batches(A, 100)  # stops at the barrier
        assert [b.column("x").to_pylist() for b in more] == [[6, 7, 8]]
        assert inbox.take_batches(A, 100) == []  # a barrier is next
        inbox.block(B)
        assert inbox.take_batches(B, 100) == []  # blocked channels give nothing
        assert inbox.take_batches(("up", 9), 100) == []  # unknown channel
        got = [(await inbox.get())[1] for _ in range(2)]
        assert got[0] == "barrier" and got[1].column("x").to_pylist() == [9, 10, 11]
        assert inbox.depth() == 1  # B's batch, still queued

    asyncio.run(main())


def test_a_watermark_after_buffered_rows_goes_in_their_push() -> None:
    """Buffered rows and the watermark after them: one push; the inbox queues the batch, then
    the watermark, in that push's turn. Without buffered rows the watermark goes alone."""

    async def main() -> tuple[FakeReceiver, list[object]]:
        r = FakeReceiver(auto_ack=True)
        out = OutputChannel(r.send, batch_rows=100, linger_ms=10_000, max_inflight=4)
        await out.add(batch(0, 5))
        await out.add(batch(5, 3))
        await out.send_watermark(Watermark(7))
        await out.send_watermark(Watermark(9))  # nothing buffered: alone
        await out.drain()
        assert out.rows_sent == 8 and out.batches_sent == 2
        inbox = Inbox(capacity=1)
        for seq, item in reversed(r.sent):  # out of order, as Ray may deliver them
            asyncio.get_running_loop().create_task(inbox.put(A, seq, item))
        got = []
        while len(got) < 3:
            await asyncio.sleep(0)
            item = inbox.get_nowait()
            if item is not None:
                got.append(item[1])
        return r, got

    r, got = asyncio.run(main())
    assert [type(item) for _, item in r.sent] == [RowsThenWatermark, Watermark]
    assert isinstance(got[0], pa.RecordBatch) and got[0].column("x").to_pylist() == list(range(8))
    assert got[1:] == [Watermark(7), Watermark(9)]


def test_rows_with_their_watermark_take_one_slot_and_keep_the_bound() -> None:
    """A push of rows with the watermark after them queues both (batch first); the watermark is
    not counted as a queued item, so ``max_depth_seen`` stays within ``capacity`` batches."""
    import pyarrow as pa

    from raystream.runtime.messages import RowsThenWatermark, Watermark

    async def main() -> None:
        inbox = Inbox(capacity=2)
        batch = pa.record_batch({"k": [1, 2]})
        tasks = [
            asyncio.create_task(inbox.put(A, s, RowsThenWatermark(batch, Watermark(s))))
            for s in range(5)
        ]
        await settle()
        assert 1 <= sum(t.done() for t in tasks) < 5  # the rest wait for room
        got = []
        while len(got) < 10:
            _, item = await asyncio.wait_for(inbox.get(), 5)
            got.append(item)
            await settle()
        assert [type(x).__name__ for x in got] == ["RecordBatch", "Watermark"] * 5
        assert inbox.max_depth_seen <= 2

    asyncio.run(main())
