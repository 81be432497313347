"""The push-ingest buffer: exactly-once by (token, offset), order, backpressure, end and failure.
Plain asyncio, no Ray; the oracle is the list of rows a correct hand-off delivers."""

from __future__ import annotations

import asyncio

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
