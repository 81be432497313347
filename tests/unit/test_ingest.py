"""The push-ingest buffer: exactly-once by (token, offset), order, backpressure, end and failure.
Plain asyncio, no Ray; the oracle is the list of rows a correct hand-off delivers."""

from __future__ import annotations

import asyncio
import collections
import json
import random

import pyarrow as pa
import pytest

from raystream.errors import ConfigError, SchemaError, SourceError
from raystream.ingest import IngestBuffer, PushSource

SCHEMA = pa.schema([("key", pa.int64()), ("seq", pa.int64())])


def rows(start: int, stop: int) -> pa.RecordBatch:
    return pa.record_batch(
        {"key": list(range(start, stop)), "seq": list(range(start, stop))}, schema=SCHEMA
    )


async def drain(buf: IngestBuffer) -> list[int]:
    out: list[int] = []
    while (b := await buf.read(1000, timeout_s=0.01)) is not None:
        out += b.column("key").to_pylist()
    return out


def test_retry_resends_from_zero_and_only_the_missing_tail_is_taken() -> None:
    async def go() -> tuple[list[int], dict[str, int]]:
        buf = IngestBuffer(SCHEMA, capacity_rows=1000)
        tok = ("q", 0, 3)
        await buf.offer(tok, 0, rows(0, 10))  # attempt 0 delivered 0..20, then died
        await buf.offer(tok, 10, rows(10, 20))
        for start in (0, 10, 20, 30):  # attempt 1 re-sends everything in other-sized pieces
            await buf.offer(tok, start, rows(start, start + 10))
        partial = await buf.offer(tok, 15, rows(15, 45))  # overlapping piece: only 40..45 new
        await buf.end()
        return await drain(buf), partial

    got, partial = asyncio.run(go())
    assert got == list(range(45))
    assert partial == {"accepted": 5, "duplicate": 25}


def test_tokens_are_independent_and_a_replayed_batch_is_skipped() -> None:
    async def go() -> tuple[list[int], IngestBuffer]:
        buf = IngestBuffer(SCHEMA, capacity_rows=1000)
        await buf.offer(("q", 0, 0), 0, rows(0, 5))
        await buf.offer(("q", 1, 0), 0, rows(5, 10))  # next micro-batch, same partition
        await buf.offer(("q", 1, 0), 0, rows(5, 10))  # micro-batch 1 replayed
        await buf.offer(("other", 1, 0), 0, rows(10, 12))  # another stream
        await buf.end()
        return await drain(buf), buf

    got, buf = asyncio.run(go())
    assert got == list(range(12))
    assert buf.stats()["rows_duplicate"] == 5 and buf.stats()["rows_accepted"] == 12


def test_out_of_order_pushes_wait_for_the_rows_before_them() -> None:
    async def go() -> list[int]:
        buf = IngestBuffer(SCHEMA, capacity_rows=1000)
        tok = ("q", 0, 0)
        later = asyncio.ensure_future(buf.offer(tok, 10, rows(10, 20)))
        await asyncio.sleep(0.02)
        assert not later.done()  # rows 0..10 have not arrived yet
        await buf.offer(tok, 0, rows(0, 10))
        await later
        await buf.end()
        return await drain(buf)

    assert asyncio.run(go()) == list(range(20))


def test_a_full_buffer_blocks_the_writer_until_the_reader_takes_rows() -> None:
    async def go() -> tuple[bool, bool, list[int], int]:
        buf = IngestBuffer(SCHEMA, capacity_rows=15)
        await buf.offer(("q", 0, 0), 0, rows(0, 10))
        blocked = asyncio.ensure_future(buf.offer(("q", 0, 1), 0, rows(10, 20)))
        await asyncio.sleep(0.02)
        was_blocked = not blocked.done()
        first = await buf.read(100, timeout_s=0.01)
        await asyncio.wait_for(blocked, 1.0)
        await buf.end()
        return (
            was_blocked,
            blocked.done(),
            first.column("key").to_pylist() + await drain(buf),
            buf.waits,
        )

    was_blocked, done, got, waits = asyncio.run(go())
    assert was_blocked and done and waits == 1
    assert got == list(range(20))


def test_a_batch_larger_than_capacity_enters_an_empty_buffer() -> None:
    async def go() -> list[int]:
        buf = IngestBuffer(SCHEMA, capacity_rows=4)
        await buf.offer(("q", 0, 0), 0, rows(0, 10))
        await buf.end()
        return await drain(buf)

    assert asyncio.run(go()) == list(range(10))


def test_read_respects_max_rows_and_returns_empty_when_idle() -> None:
    async def go() -> tuple[int, list[int], int]:
        buf = IngestBuffer(SCHEMA, capacity_rows=100)
        idle = await buf.read(5, timeout_s=0.01)
        await buf.offer(("q", 0, 0), 0, rows(0, 7))
        await buf.offer(("q", 0, 1), 0, rows(7, 12))
        sizes = []
        while (b := await buf.read(5, timeout_s=0.01)) is not None and b.num_rows:
            sizes.append(b.num_rows)
        return idle.num_rows, sizes, buf.stats()["queued_rows"]

    idle, sizes, queued = asyncio.run(go())
    assert idle == 0 and sizes == [5, 5, 2] and queued == 0


def test_failure_reaches_reader_and_writers() -> None:
    async def go() -> None:
        buf = IngestBuffer(SCHEMA, capacity_rows=100)
        await buf.fail("the Spark job failed: boom")
        with pytest.raises(SourceError, match="boom"):
            await buf.read(10, timeout_s=0.01)
        with pytest.raises(SourceError, match="boom"):
            await buf.offer(("q", 0, 0), 0, rows(0, 1))

    asyncio.run(go())


def test_rows_after_the_end_are_refused_unless_already_taken() -> None:
    async def go() -> None:
        buf = IngestBuffer(SCHEMA, capacity_rows=100)
        await buf.offer(("q", 0, 0), 0, rows(0, 5))
        await buf.end()
        assert (await buf.offer(("q", 0, 0), 0, rows(0, 5)))["duplicate"] == 5
        with pytest.raises(SourceError, match="after the end of input"):
            await buf.offer(("q", 0, 1), 0, rows(5, 6))

    asyncio.run(go())


def test_wrong_columns_are_refused_and_compatible_types_cast() -> None:
    async def go() -> list[int]:
        buf = IngestBuffer(SCHEMA, capacity_rows=100)
        with pytest.raises(SchemaError, match=r"columns \['key'\], expected \['key', 'seq'\]"):
            await buf.offer(("q", 0, 0), 0, pa.record_batch({"key": [1]}))
        with pytest.raises(SchemaError, match="does not cast"):
            await buf.offer(("q", 0, 0), 0, pa.record_batch({"key": ["x"], "seq": [1]}))
        narrow = pa.record_batch(
            {"key": pa.array([7], pa.int32()), "seq": pa.array([1], pa.int32())}
        )
        await buf.offer(("q", 0, 0), 0, narrow)
        await buf.end()
        return await drain(buf)

    assert asyncio.run(go()) == [7]


def test_push_source_spec_checks() -> None:
    with pytest.raises(ConfigError, match="pyarrow.Schema"):
        PushSource("key")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="capacity_rows"):
        PushSource(SCHEMA, 0)
    src = PushSource(SCHEMA)
    assert src.schema() == SCHEMA and src.rate_eps == 0.0 and "key" in src.describe()


def test_pieces_of_committed_micro_batches_are_forgotten_and_late_pushes_stay_duplicates() -> None:
    async def go() -> tuple[list[int], IngestBuffer]:
        buf = IngestBuffer(SCHEMA, capacity_rows=10_000)
        key = 0
        for b in range(50):  # 50 micro-batches of 2 partitions, 3 rows each
            for p in range(2):
                await buf.offer(("q", b, p), 0, rows(key, key + 3))
                key += 3
        late = await buf.offer(("q", 3, 1), 0, rows(999, 1002))  # a zombie push of batch 3
        replay = await buf.offer(("q", 48, 0), 0, rows(276 + 12, 276 + 15))  # batch 48 replayed
        other = await buf.offer(("other", 0, 0), 0, rows(2000, 2001))  # another stream: its own
        await buf.end()
        assert late == {"accepted": 0, "duplicate": 3}
        assert replay == {"accepted": 0, "duplicate": 3}
        assert other == {"accepted": 1, "duplicate": 0}
        return await drain(buf), buf

    got, buf = asyncio.run(go())
    assert got == [*range(300), 2000]
    assert buf.stats()["pieces"] <= 2 * 2 + 1  # batches 48 and 49 of "q", one of "other"


# ---- checkpoints: what went downstream is recorded; a restored buffer takes only the rest ------


_TAGS: dict[tuple[object, ...], int] = {}


def _tag(token: tuple[object, ...]) -> int:
    return _TAGS.setdefault(token, len(_TAGS))


def _piece(token: tuple[object, ...], start: int, stop: int) -> pa.RecordBatch:
    """Rows of one piece, each row naming its (token, offset) so the oracle can count it."""
    tag = _tag(token)
    return pa.record_batch(
        {"key": [tag] * (stop - start), "seq": list(range(start, stop))}, schema=SCHEMA
    )


async def _drain_pairs(buf: IngestBuffer, max_rows: int = 1000) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    while (b := await buf.read(max_rows, timeout_s=0.01)) is not None and b.num_rows:
        out += list(zip(b.column("key").to_pylist(), b.column("seq").to_pylist(), strict=True))
    return out


def test_the_checkpoint_records_rows_taken_not_rows_accepted() -> None:
    async def go() -> tuple[dict[str, object], list[int], list[int]]:
        buf = IngestBuffer(SCHEMA, capacity_rows=1000)
        tok = ("spark:job:src", 0, 2)
        await buf.offer(tok, 0, rows(0, 30))
        first = (await buf.read(12, timeout_s=0.01)).column("seq").to_pylist()  # 12 went on
        state = json.loads(json.dumps(buf.checkpoint_state()))  # as the manifest stores it
        again = IngestBuffer(SCHEMA, capacity_rows=1000)
        again.restore(state)
        for start in (0, 10, 20):  # the writer re-sends the whole piece
            await again.offer(tok, start, rows(start, start + 10))
        await again.end()
        return state, first, await drain(again)

    state, first, rest = asyncio.run(go())
    assert state["pieces"] == [[["spark:job:src", 0, 2], 12]]
    assert first + rest == list(range(30))  # every row once: 0..11 before, 12..29 after


@pytest.mark.parametrize("seed", range(6))
def test_restore_then_full_resend_delivers_every_row_exactly_once(seed: int) -> None:
    """Random writers (retries, overlapping re-sends, several micro-batches of one stream and a
    batch stream), random reads, a checkpoint at a random point; after a restore the writers send
    everything again. Oracle: the rows read before the checkpoint plus those read after it are
    exactly the input, each (piece, offset) once."""
    rng = random.Random(seed)
    batch_tokens = [("spark:j:s", 0, p) for p in range(3)]
    stream_batches = [[("chk", b, p) for p in range(2)] for b in range(4)]
    sizes = {t: rng.randint(0, 40) for t in batch_tokens + sum(stream_batches, [])}

    async def send(buf: IngestBuffer, token: tuple[object, ...]) -> None:
        start = 0
        while start < sizes[token]:
            stop = min(sizes[token], start + rng.randint(1, 15))
            await buf.offer(token, start, _piece(token, start, stop))
            if rng.random() < 0.3:  # a retry re-sends from the start of the piece
                await buf.offer(token, 0, _piece(token, 0, stop))
            start = stop

    async def feed(buf: IngestBuffer, read: list[tuple[int, int]], cut: int | None) -> object:
        """Push everything; read at random moments; return the checkpoint state at step cut."""
        state = None
        steps = [[t] for t in batch_tokens] + stream_batches  # a micro-batch after the last
        for i, group in enumerate(steps):
            for t in group:
                await send(buf, t)
            while rng.random() < 0.6:
                b = await buf.read(rng.randint(1, 25), timeout_s=0.001)
                if b is not None and b.num_rows:
                    read.extend(
                        zip(b.column("key").to_pylist(), b.column("seq").to_pylist(), strict=True)
                    )
            if i == cut:
                state = json.loads(json.dumps(buf.checkpoint_state()))
                read.append((-1, -1))  # the barrier
        return state

    async def go() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        buf = IngestBuffer(SCHEMA, capacity_rows=10_000)
        before: list[tuple[int, int]] = []
        state = await feed(buf, before, cut=rng.randint(0, 6))
        before = before[: before.index((-1, -1))]  # rows after the barrier are lost
        again = IngestBuffer(SCHEMA, capacity_rows=10_000)
        again.restore(state)  # type: ignore[arg-type]
        after: list[tuple[int, int]] = []
        await feed(again, after, cut=None)
        await again.end()
        after += await _drain_pairs(again)
        return before, after

    before, after = asyncio.run(go())
    tokens = batch_tokens + sum(stream_batches, [])
    everything = [(_tag(t), i) for t in tokens for i in range(sizes[t])]
    assert collections.Counter(before + after) == collections.Counter(everything)


def test_a_restore_after_rows_came_in_is_refused_and_a_complete_source_takes_nothing() -> None:
    async def go() -> dict[str, int]:
        buf = IngestBuffer(SCHEMA, capacity_rows=100)
        await buf.offer(("q", 0, 0), 0, rows(0, 5))
        with pytest.raises(SourceError, match="before rows came in"):
            buf.restore({"pieces": [], "newest": []})
        with pytest.raises(SourceError, match="malformed"):
            IngestBuffer(SCHEMA, capacity_rows=100).restore({"pieces": [[7, "x"]]})
        done = IngestBuffer(SCHEMA, capacity_rows=100)
        done.restore_complete()
        out = await done.offer(("q", 0, 0), 0, rows(0, 5))
        assert await done.read(10, timeout_s=0.01) is None
        return out

    assert asyncio.run(go()) == {"accepted": 0, "duplicate": 5}


def test_wait_taken_returns_once_the_reader_took_the_rows() -> None:
    async def go() -> tuple[bool, bool, bool]:
        buf = IngestBuffer(SCHEMA, capacity_rows=100)
        await buf.offer(("s", 0, 0), 0, rows(0, 10))
        early = await buf.wait_taken({("s", 0, 0): 10}, timeout_s=0.05)
        waiter = asyncio.ensure_future(buf.wait_taken({("s", 0, 0): 10, ("s", 0, 1): 0}, 5.0))
        await buf.read(4, timeout_s=0.01)
        await asyncio.sleep(0.01)
        partly = waiter.done()
        await buf.read(100, timeout_s=0.01)
        return early, partly, await waiter

    assert asyncio.run(go()) == (False, False, True)
