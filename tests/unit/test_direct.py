"""Direct push without Ray: the source's reservation table (IngestBuffer.reserve), its
sequencer on real output channels, and the keyed inbox dropping a re-sent sequence number.
The oracle is the list of rows (and their order per channel) a correct hand-off delivers."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from raystream.direct import DirectSequencer, Route, cut, rows_of
from raystream.errors import SourceError
from raystream.ingest import IngestBuffer
from raystream.keys import KeySpace, RoutingTable
from raystream.presort import sort_by_key_group, take_key_groups
from raystream.runtime.channels import Inbox, OutputChannel
from raystream.runtime.messages import Barrier

SCHEMA = pa.schema([("key", pa.int64())])
TOKEN = ("q", 0, 1)


def seqs(n: int) -> Any:
    """An allocate() handing out consecutive sequence numbers (as one output channel would)."""
    counter = iter(range(10**9))

    def allocate() -> dict[str, Any]:
        return {"pieces": [(("count", 0), next(counter), [(0, n)])]}

    return allocate


def test_a_reservation_is_taken_once_and_a_retry_gets_the_same_sequence_numbers() -> None:
    async def go() -> list[dict[str, Any]]:
        buf = IngestBuffer(SCHEMA, capacity_rows=10)
        alloc = seqs(100)
        out = [await buf.reserve(TOKEN, 0, 100, alloc), await buf.reserve(TOKEN, 100, 100, alloc)]
        out.append(await buf.reserve(TOKEN, 0, 100, alloc))  # the writer died and was retried
        out.append(await buf.reserve(TOKEN, 200, 100, alloc))  # its first new push
        return out + [buf.stats(), buf.checkpoint_state()]

    first, second, again, third, stats, state = asyncio.run(go())
    assert [first["status"], second["status"], again["status"], third["status"]] == [
        "ok", "ok", "again", "ok"
    ]  # fmt: skip
    assert again["pieces"] == first["pieces"]  # the same sequence numbers, the same rows
    assert [p[1] for p in (first["pieces"][0], second["pieces"][0], third["pieces"][0])] == [
        0, 1, 2
    ]  # fmt: skip
    assert stats["rows_reserved"] == stats["rows_accepted"] == 300
    assert stats["rows_duplicate"] == 100 and stats["reservations_again"] == 1
    # a checkpoint taken now holds the reserved rows (they count as taken downstream)
    assert state["pieces"] == [[list(TOKEN), 300]]


def test_after_a_recovery_the_checkpointed_rows_are_dropped_and_the_rest_reserved() -> None:
    async def go() -> list[str]:
        old = IngestBuffer(SCHEMA, capacity_rows=10)
        alloc = seqs(50)
        await old.reserve(TOKEN, 0, 50, alloc)
        state = old.checkpoint_state()  # the checkpoint holds rows 0..50
        await old.reserve(TOKEN, 50, 50, alloc)  # reserved after it: lost with the attempt
        new = IngestBuffer(SCHEMA, capacity_rows=10)
        new.restore(state)
        alloc = seqs(50)
        return [(await new.reserve(TOKEN, o, 50, alloc))["status"] for o in (0, 50, 100)]

    assert asyncio.run(go()) == ["drop", "ok", "ok"]


def test_reservations_wait_for_earlier_rows_and_refuse_overlaps_and_late_rows() -> None:
    async def go() -> tuple[list[int], str, str]:
        buf = IngestBuffer(SCHEMA, capacity_rows=10, order_wait_s=5)
        order: list[int] = []

        def alloc_for(offset: int) -> Any:
            def allocate() -> dict[str, Any]:
                order.append(offset)
                return {"pieces": []}

            return allocate

        later = asyncio.create_task(buf.reserve(TOKEN, 10, 10, alloc_for(10)))
        await asyncio.sleep(0.01)
        assert not later.done()  # rows 0..10 first
        await buf.reserve(TOKEN, 0, 10, alloc_for(0))
        await asyncio.wait_for(later, 5)
        with pytest.raises(SourceError, match=r"overlap rows this source took up to 20") as e1:
            await buf.reserve(TOKEN, 15, 10, alloc_for(15))
        await buf.end()
        with pytest.raises(SourceError, match="after the end of input") as e2:
            await buf.reserve(TOKEN, 20, 10, alloc_for(20))
        return order, str(e1.value), str(e2.value)

    order, _, _ = asyncio.run(go())
    assert order == [0, 10]


def test_an_allocation_that_says_retry_records_nothing() -> None:
    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        buf = IngestBuffer(SCHEMA, capacity_rows=10)
        busy = await buf.reserve(TOKEN, 0, 10, lambda: "retry")
        return busy, await buf.reserve(TOKEN, 0, 10, seqs(10))

    busy, ok = asyncio.run(go())
    assert busy == {"status": "retry"} and ok["status"] == "ok"


def test_the_inbox_drops_a_sequence_number_it_already_took() -> None:
    async def go() -> tuple[list[Any], int]:
        inbox = Inbox(capacity=1)
        ch = ("source", 0)
        await inbox.put(ch, 0, "a")
        # seq 1 twice while the channel is full (a retried writer re-sends while the first
        # copy still waits for room), then seq 0 again after it was taken
        first = asyncio.create_task(inbox.put(ch, 1, "b"))
        again = asyncio.create_task(inbox.put(ch, 1, "b"))
        late = asyncio.create_task(inbox.put(ch, 0, "a"))
        got = []
        for _ in range(2):
            item = await asyncio.wait_for(inbox.get(), 5)
            assert item is not None
            got.append(item[1])
            await asyncio.sleep(0.01)
        await asyncio.wait_for(asyncio.gather(first, again, late), 5)
        await inbox.put(ch, 2, "c")
        item = await asyncio.wait_for(inbox.get(), 5)
        assert item is not None
        got.append(item[1])
        assert inbox.get_nowait() is None
        return got, inbox.duplicate_pushes

    got, dups = asyncio.run(go())
    assert got == ["a", "b", "c"] and dups == 2


class _Wire:
    """Output channels to keyed inboxes in this process: what a sender pushes goes to the
    receiver's inbox under the sender's channel id."""

    def __init__(self, parallelism: int, sender: tuple[str, int]) -> None:
        self.inboxes = [Inbox(capacity=1000) for _ in range(parallelism)]
        self.sender = sender
        self.channels = []
        for i in range(parallelism):
            c = OutputChannel(self._send(i), batch_rows=1000, linger_ms=1000, max_inflight=4)
            c.receiver = ("count", i)
            self.channels.append(c)

    def _send(self, i: int) -> Any:
        def send(seq_item: tuple[int, Any]) -> Any:
            seq, item = seq_item
            return asyncio.ensure_future(self.inboxes[i].put(self.sender, seq, item))

        return send


def _keys(batch: pa.RecordBatch) -> list[int]:
    return batch.column("key").to_pylist()


def test_reserved_pieces_sit_between_the_sources_own_pushes_in_sequence_order() -> None:
    """Writers reserve and push pieces themselves (one retried after dying past its
    reservation), the source forwards a barrier in between and buffers rows of its own: each
    receiver reads every row once, the rows reserved before the barrier before it."""
    ks = KeySpace(num_key_groups=32)
    table = RoutingTable.uniform(32, 2)
    sender = ("source", 0)

    async def go() -> tuple[list[list[Any]], dict[str, Any]]:
        wire = _Wire(2, sender)
        buf = IngestBuffer(SCHEMA, capacity_rows=10_000)
        reserved: list[int] = []
        seq = DirectSequencer(
            buf, sender, lambda: (table, wire.channels), lambda n, ev: reserved.append(n)
        )
        route = Route.of(seq.route())
        sent: list[tuple[int, pa.RecordBatch]] = []

        async def write(offset: int, keys: np.ndarray, deliver: bool = True) -> str:
            b = sort_by_key_group(pa.record_batch({"key": keys}), "key", ks)
            rest, kg = take_key_groups(b)
            pieces = cut(kg, route)
            ans = await seq.reserve(TOKEN, offset, rest.num_rows, route.version, pieces)
            if ans["status"] in ("ok", "again") and deliver:
                for (rid, s, ranges) in ans["pieces"]:
                    part = rows_of(rest, ranges)
                    sent.append((s, part))
                    await wire.inboxes[rid[1]].put(sender, s, part)
            return ans["status"]

        keys = np.arange(300) * 7 % 101
        assert await write(0, keys[:100]) == "ok"
        assert await write(100, keys[100:200], deliver=False) == "ok"  # the writer dies here
        # the source's checkpoint barrier: later sequence numbers than both reservations
        seq.hold(reroute=False)
        for c in wire.channels:
            await c.push(Barrier(epoch=1, kind="checkpoint"))
        seq.release()
        assert await write(0, keys[:100]) == "again"  # the retry: the same numbers again
        assert await write(100, keys[100:200]) == "again"
        assert await write(200, keys[200:]) == "ok"
        await asyncio.sleep(0.05)
        out = []
        for inbox in wire.inboxes:
            items = []
            while (got := inbox.get_nowait()) is not None:
                items.append(got[1])
            out.append(items)
        return out, {"reserved": reserved, "dups": [i.duplicate_pushes for i in wire.inboxes]}

    out, info = asyncio.run(go())
    keys = (np.arange(300) * 7 % 101).tolist()
    owner = {k: int(table.owners[ks.key_group(np.array([hash_key(k)], np.uint64))[0]]) for k in set(keys)}
    for i, items in enumerate(out):
        barrier_at = next(n for n, x in enumerate(items) if isinstance(x, Barrier))
        before = [k for x in items[:barrier_at] for k in _keys(x)]
        after = [k for x in items[barrier_at + 1 :] for k in _keys(x)]
        want_before = [k for k in keys[:200] if owner[k] == i]
        want_after = [k for k in keys[200:] if owner[k] == i]
        assert sorted(before) == sorted(want_before), i
        assert sorted(after) == sorted(want_after), i
    assert info["reserved"] == [100, 100, 100]
    assert sum(info["dups"]) >= 1  # the retry re-sent the first push's pieces: dropped


def hash_key(k: int) -> int:
    from raystream.keys import stable_hash, to_key_array

    return int(stable_hash(to_key_array(pa.array([k], pa.int64()), column="key"))[0])


def test_a_stale_route_is_answered_with_the_new_one_and_a_held_source_waits() -> None:
    table = RoutingTable.uniform(16, 2)
    sender = ("source", 0)

    async def go() -> tuple[str, str, bool]:
        wire = _Wire(2, sender)
        buf = IngestBuffer(SCHEMA, capacity_rows=10)
        seq = DirectSequencer(buf, sender, lambda: (table, wire.channels), lambda n, ev: None)
        seq.hold(reroute=True)  # a rescale barrier is going out
        waiting = asyncio.create_task(seq.reserve(TOKEN, 0, 5, 0, [(0, [(0, 5)])]))
        await asyncio.sleep(0.01)
        held = not waiting.done()
        seq.release()
        stale = await asyncio.wait_for(waiting, 5)
        fresh = await seq.reserve(TOKEN, 0, 5, stale["version"], [(0, [(0, 5)])])
        return stale["status"], fresh["status"], held

    assert asyncio.run(go()) == ("reroute", "ok", True)


def test_rows_the_source_buffered_itself_go_out_before_a_reservation() -> None:
    table = RoutingTable.uniform(16, 1)
    sender = ("source", 0)

    async def go() -> list[Any]:
        wire = _Wire(1, sender)
        buf = IngestBuffer(SCHEMA, capacity_rows=10)
        seq = DirectSequencer(buf, sender, lambda: (table, wire.channels), lambda n, ev: None)
        await wire.channels[0].add(pa.record_batch({"key": [1, 2]}))  # buffered, not sent
        ans = await seq.reserve(TOKEN, 0, 3, 0, [(0, [(0, 3)])])
        await wire.inboxes[0].put(sender, ans["pieces"][0][1], pa.record_batch({"key": [3, 4, 5]}))
        await asyncio.sleep(0.01)
        got = []
        while (item := wire.inboxes[0].get_nowait()) is not None:
            got += _keys(item[1])
        return got

    assert asyncio.run(go()) == [1, 2, 3, 4, 5]


def test_a_retry_longer_than_a_failed_attempts_last_reservation_is_split_there() -> None:
    """Attempt 0 reserved rows 0..20 and a shorter last piece 20..30 (its input ended early as
    it failed); the retry cuts 20..40: it is told to send 20..30 under the old reservation (the
    same sequence numbers), then 30..40 is new."""

    async def go() -> list[dict[str, Any]]:
        buf = IngestBuffer(SCHEMA, capacity_rows=10)
        out = [await buf.reserve(TOKEN, 0, 20, seqs(20)), await buf.reserve(TOKEN, 20, 10, seqs(10))]
        out.append(await buf.reserve(TOKEN, 20, 20, seqs(20)))  # the retry's cut
        out.append(await buf.reserve(TOKEN, 20, 10, seqs(10)))  # its first part: the same again
        out.append(await buf.reserve(TOKEN, 30, 10, seqs(10)))  # the rest: new rows
        return out + [buf.stats()]

    *answers, stats = asyncio.run(go())
    assert [a["status"] for a in answers] == ["ok", "ok", "split", "again", "ok"]
    assert answers[2]["rows"] == 10
    assert answers[3]["pieces"] == answers[1]["pieces"]
    assert stats["rows_accepted"] == 40 and stats["reservations_split"] == 1


def test_a_sorted_push_that_partly_overlaps_is_refused_and_a_writer_resumes_where_the_source_stands() -> None:
    """Rows sorted by key group are not in row order: cutting off the rows already taken would
    take the wrong ones (the old behaviour counted some twice and lost others). A retried writer
    asks where to start instead."""
    space = KeySpace(num_key_groups=16)

    async def go() -> tuple[int, int, dict[str, Any]]:
        buf = IngestBuffer(SCHEMA, capacity_rows=1_000)
        keys = pa.record_batch({"key": pa.array(np.arange(40) % 7, pa.int64())})
        await buf.offer(TOKEN, 0, sort_by_key_group(keys.slice(0, 25), "key", space))
        start = buf.resume_offset(TOKEN)
        with pytest.raises(SourceError, match="sorted by key group"):
            await buf.offer(TOKEN, 20, sort_by_key_group(keys.slice(20, 20), "key", space))
        await buf.offer(TOKEN, start, sort_by_key_group(keys.slice(start), "key", space))
        return start, buf.resume_offset(("q", 0, 2)), buf.stats()

    start, other, stats = asyncio.run(go())
    assert start == 25 and other == 0
    assert stats["rows_accepted"] == 40 and stats["rows_duplicate"] == 0
