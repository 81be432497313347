"""The window of a move at its barrier (no Ray): nothing waits there for the old instance.

* A sender switching its channel from a moved instance to the new one does not wait for the old
  instance to acknowledge what it sent (the barrier, its EndOfStream): the old instance's loop is
  busy at its seal, and waiting held every output of the sender, the new instance's barrier too.
  The acknowledgements are still awaited before the sender ends its outputs.
* The old owner of a move by files evicts nothing at its seal: its whole state goes as files and
  the rows changed since, read through its cache, which is then dropped.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa

from raystream.rescale import FetchPolicy
from raystream.runtime.channels import OutputChannel
from raystream.runtime.instance import OperatorInstance
from raystream.runtime.messages import Barrier, EndOfStream
from raystream.runtime.migration import MigrationEngine, MigrationTask
from raystream.runtime.move_files import FILES_POLICY
from raystream.runtime.watermarks import WATERMARK_MIN
from raystream.state.rocks import RocksStateBackend

S = 2  # sub-groups per key group


class _Receiver:
    """Pushes to one receiver; acknowledged only when :meth:`ack` is called (a busy loop)."""

    def __init__(self, acks_at_once: bool) -> None:
        self.items: list[Any] = []
        self.pending: list[asyncio.Future[None]] = []
        self.at_once = acks_at_once

    def send(self, seq_item: tuple[int, Any]) -> asyncio.Future[None]:
        self.items.append(seq_item[1])
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.at_once:
            fut.set_result(None)
        else:
            self.pending.append(fut)
        return fut

    def ack(self) -> None:
        for fut in self.pending:
            if not fut.done():
                fut.set_result(None)


def _channel(receiver: _Receiver) -> OutputChannel:
    return OutputChannel(receiver.send, batch_rows=1024, linger_ms=10.0, max_inflight=4)


def test_a_sender_switches_to_the_new_instance_without_waiting_for_the_old_ones_ack() -> None:
    async def go() -> None:
        old, new, other = _Receiver(False), _Receiver(True), _Receiver(True)
        channels = [_channel(old), _channel(other)]
        channels[0]._pending.append(pa.record_batch({"k": [1, 2]}))  # noqa: SLF001 - buffered rows
        channels[0]._pending_rows = 2  # noqa: SLF001
        sender = SimpleNamespace(
            _retiring=[],
            _unconnected={("count", 9)},
            _wm_sent=WATERMARK_MIN,
            _channel_to=lambda to: _channel(new),
        )
        barrier = Barrier(3, "rescale", {"step": "count", "move": {"index": 0, "to": ("count", 9)}})
        # the old instance never acknowledges here: the switch must not wait for it
        await asyncio.wait_for(
            OperatorInstance._redirect(sender, channels, 0, ("count", 9), barrier),  # noqa: SLF001
            timeout=2.0,
        )
        kinds = [type(i).__name__ for i in old.items]
        assert kinds == ["RecordBatch", "Barrier", "EndOfStream"], (
            f"expected the old channel to get its rows, the barrier and EndOfStream, in that "
            f"order; got {kinds}"
        )
        assert channels[0] is not channels[1] and channels[0]._send == new.send  # noqa: SLF001
        assert ("count", 9) not in sender._unconnected  # noqa: SLF001
        (retiring,) = sender._retiring  # noqa: SLF001
        assert not retiring.done(), "the old channel's acknowledgements were not awaited later"
        # ending the outputs waits for them
        ended = asyncio.ensure_future(OperatorInstance._drain_retired(sender))  # noqa: SLF001
        await asyncio.sleep(0.05)
        assert not ended.done(), "the sender ended its outputs before the old instance acked"
        old.ack()
        await asyncio.wait_for(ended, timeout=2.0)
        assert sender._retiring == []  # noqa: SLF001
        assert isinstance(old.items[-1], EndOfStream)

    asyncio.run(go())


def _filled(path: Path) -> RocksStateBackend:
    db = RocksStateBackend(path)
    # keys of key groups 0..3 (the 2-byte key group and 1-byte sub-group prefix of the state
    # layout); written through the cache, dirty
    keys = [bytes([0, kg, s]) + b"k%03d" % i for kg in range(4) for s in range(S) for i in range(5)]
    db.write(keys, [b"v" * 8] * len(keys))
    return db


def _seal_whole(db: RocksStateBackend, policy: FetchPolicy, by_files: bool) -> MigrationEngine:
    engine = MigrationEngine(db, 4, S, range(4))
    engine.prepare(
        MigrationTask(1, policy, incoming={}, outgoing=set(range(4 * S)), by_files=by_files)
    )
    engine.activate(1)
    engine.seal(1, fence_ms=0.0)
    return engine


def test_the_old_owner_of_a_move_by_files_keeps_its_cache_at_the_seal(tmp_path: Path) -> None:
    async def go() -> None:
        files = _filled(tmp_path / "files")
        rows = _filled(tmp_path / "rows")
        try:
            cached = len(files._cache)  # noqa: SLF001
            assert cached == 40
            engine = _seal_whole(files, FILES_POLICY, by_files=True)
            assert engine.task.ready.is_set()  # type: ignore[union-attr]
            assert len(files._cache) == cached, (  # noqa: SLF001
                f"expected the {cached} cached entries kept at the seal of a move by files, "
                f"{len(files._cache)} are left"  # noqa: SLF001
            )
            # a row-by-row move (the control): its outgoing sub-groups leave the cache
            _seal_whole(rows, FetchPolicy(on_demand=True, background="all"), by_files=False)
            assert len(rows._cache) == 0  # noqa: SLF001
        finally:
            files.close()
            rows.close()

    asyncio.run(go())
