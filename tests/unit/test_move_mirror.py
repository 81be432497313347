"""A move by files mirrors the old instance's writes to the new one (no Ray, real RocksDB).

After the old instance's checkpoint and its catch-up rounds, every write it makes reaches the
new instance in pushes (:class:`raystream.runtime.move_files.Mirror`), written there in the
order of their numbers even when a push overtakes an earlier one, and those that come before
the answer that started the mirror is written wait for it. The oracle is the old instance's own log of writes: at the seal, the new
instance's state equals the old one's, every key got a subsequence of the values written to it
(each write at most once, in the order made), and nothing written before the last push is left
for the hand-over at the seal.
"""

from __future__ import annotations

import asyncio
import random
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from raystream.errors import StateError
from raystream.runtime.move_files import (
    FilesTakeOver,
    copy_files,
    mirror_from_now,
    take_changes,
)
from raystream.state.rocks import RocksStateBackend

KEYS = [f"k{i:03d}".encode() for i in range(120)]
EVERY_S = 0.002


class _Processor:
    """What a move by files uses of a keyed processor: its backend, a fresh one, a swap."""

    def __init__(self, backend: RocksStateBackend) -> None:
        self.backend = backend

    def fresh_backend(self, path: str | Path) -> RocksStateBackend:
        return RocksStateBackend(path)

    def swap_backend(self, fresh: RocksStateBackend, key_groups: list[int]) -> None:
        self.backend.close()
        self.backend = fresh


def _instance(name: str, backend: RocksStateBackend) -> Any:
    engine = SimpleNamespace(task=None, sub_groups=1, held=np.ones(4, dtype=bool))
    spec = SimpleNamespace(id=("count", name), state_path=str(backend.path))
    return SimpleNamespace(spec=spec, processor=_Processor(backend), engine=engine)


def _subsequence(applied: list[bytes | None], written: list[bytes | None]) -> bool:
    """``applied`` is ``written`` with some values left out (each value once, in order)."""
    it = iter(written)
    return all(any(w == a for w in it) for a in applied)


def test_writes_after_the_checkpoint_reach_the_new_instance_once_in_order_none_left_at_seal(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        old_backend = RocksStateBackend(tmp_path / "old")
        old_backend.write(KEYS, [b"start" for _ in KEYS])
        old = _instance("old", old_backend)
        new = _instance("new", RocksStateBackend(tmp_path / "new-empty"))
        take = FilesTakeOver(new, 1)
        applied: dict[bytes, list[bytes | None]] = {}
        apply = take._apply  # noqa: SLF001 - logged: what the new instance writes, in order

        def logged(changes: pa.RecordBatch) -> None:
            for k, v in zip(changes.column(0).to_pylist(), changes.column(1).to_pylist()):
                applied.setdefault(k, []).append(v)
            apply(changes)

        take._apply = logged  # type: ignore[method-assign]
        arrived: list[int] = []
        early: list[int] = []  # pushes that came before the answer that started the mirror

        async def send(number: int, changes: pa.RecordBatch) -> None:
            # even pushes take longer on their way: the next one overtakes them
            await asyncio.sleep(0.006 if number % 2 == 0 else 0.0)
            arrived.append(number)
            if not take._opened:  # noqa: SLF001
                early.append(number)
            take.mirrored(number, changes)

        # the oracle: every write the old instance makes after the checkpoint, per key
        written: dict[bytes, list[bytes | None]] = {}
        rng = random.Random(3)
        wrote_last = asyncio.Event()

        async def write() -> None:
            for version in range(300):
                keys = sorted(set(rng.sample(KEYS, 6)))
                gone = [k for k in rng.sample(KEYS, 2) if k not in keys] if version % 7 == 0 else []
                values = [b"%s:%d" % (k, version) for k in keys]
                old_backend.write(keys, values, deletes=gone)
                for k, v in zip(keys, values, strict=True):
                    written.setdefault(k, []).append(v)
                for k in gone:
                    written.setdefault(k, []).append(None)
                await asyncio.sleep(0.0005)
            wrote_last.set()

        copied: dict[str, Any] = {}

        async def copy() -> dict[str, Any]:
            copied.update(await copy_files(old, 1))
            writer.append(asyncio.ensure_future(write()))  # from the checkpoint's moment on
            return copied

        async def take_round() -> pa.RecordBatch:
            await asyncio.sleep(0.01)
            return take_changes(old)

        async def start_mirror() -> pa.RecordBatch:
            changes = mirror_from_now(old, 1, send, every_s=EVERY_S)
            await asyncio.sleep(0.03)  # pushes come before this answer is written: they wait
            return changes

        writer: list[asyncio.Task[None]] = []

        async def no_read(*_: Any) -> bytes:
            raise AssertionError("same node: the files are renamed, not read")

        async def release(directory: str) -> None:
            shutil.rmtree(directory)

        await take.begin(True, copy, no_read, release)
        rounds = await take.catch_up(take_round, start_mirror, rounds=2, small_bytes=1)
        assert len(rounds["catch_up_bytes"]) == 3 and all(rounds["catch_up_bytes"][:2])
        assert early, "no push came before the answer that started the mirror"
        await wrote_last.wait()
        await asyncio.sleep(EVERY_S * 10)  # the mirror pushes what was written last
        # the seal: the mirror stops; what is left goes in the hand-over
        mirror = old.move_mirror
        pushed = mirror.stop()
        left = take_changes(old)
        assert left.num_rows == 0, f"{left.num_rows} rows written before the last push were left"
        await take._mirrored_up_to(pushed)  # noqa: SLF001 - the hand-over's wait
        take._apply(left)  # noqa: SLF001
        assert pushed > 5 and mirror.stats()["mirror_pushes"] == pushed
        assert arrived != sorted(arrived), "no push overtook an earlier one"
        assert take.applied == pushed

        # the new instance's state is the old one's at the seal
        now_new = take.inst.processor.backend
        assert now_new.multi_get(KEYS) == old_backend.multi_get(KEYS)
        # each write at most once, in the order made; the last write of each key arrived
        assert set(applied) == set(written)
        for k, values in applied.items():
            assert _subsequence(values, written[k]), f"{k!r}: {values} not in order of {written[k]}"
            assert values[-1] == written[k][-1]
        old_backend.close()
        now_new.close()

    asyncio.run(go())


def test_a_push_of_another_move_or_twice_is_refused(tmp_path: Path) -> None:
    async def go() -> None:
        new = _instance("new", RocksStateBackend(tmp_path / "new"))
        take = FilesTakeOver(new, 4)
        rows = pa.RecordBatch.from_arrays(
            [pa.array([b"a"], pa.binary()), pa.array([b"1"], pa.binary())], names=["key", "value"]
        )
        take.mirrored(2, rows)  # before the files are open: waits
        with pytest.raises(StateError, match="push 2 of move epoch 4 twice"):
            take.mirrored(2, rows)
        with pytest.raises(StateError, match="pushes up to 2 of move epoch 4; pushes up to 0"):
            await asyncio.wait_for(_short_wait(take, 2), 5)
        new.processor.backend.close()

    asyncio.run(go())


async def _short_wait(take: FilesTakeOver, number: int) -> None:
    import raystream.runtime.move_files as mf

    saved, mf.MIRROR_WAIT_S = mf.MIRROR_WAIT_S, 0.05
    try:
        await take._mirrored_up_to(number)  # noqa: SLF001
    finally:
        mf.MIRROR_WAIT_S = saved
