"""Order across a move without waiting for downstream (no Ray): an old owner hands out state as
soon as it sealed; an instance that both hands out and takes over sub-groups in one step releases
what it took over only once it sealed itself, so its own fence goes out before its AfterFences
mark (receivers never wait for each other in a circle)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from raystream.rescale import FetchPolicy
from raystream.runtime.migration import MigrationEngine, MigrationTask
from raystream.state.rocks import RocksStateBackend

S = 2  # sub-groups per key group


def _groups(*kgs: int) -> list[int]:
    return [kg * S + s for kg in kgs for s in range(S)]


async def _until(cond: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        await asyncio.sleep(0.001)


def test_an_instance_that_also_hands_out_releases_what_it_took_over_only_once_sealed(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        dbs = [RocksStateBackend(tmp_path / "a"), RocksStateBackend(tmp_path / "b")]
        a = MigrationEngine(dbs[0], 4, S, (0, 1))
        b = MigrationEngine(dbs[1], 4, S, (2, 3))
        engines = {0: a, 1: b}

        def fetcher(me: int) -> Any:
            async def fetch(owner: int, epoch: int, groups: list[int], max_bytes: int, urgent: bool):
                assert owner != me
                return await engines[owner].serve(epoch, groups, max_bytes, urgent)

            return fetch

        a.fetcher, b.fetcher = fetcher(0), fetcher(1)
        policy = FetchPolicy(on_demand=True, background="all")
        try:
            # a swaps key group 1 for b's key group 2
            a.prepare(MigrationTask(1, policy, incoming=dict.fromkeys(_groups(2), 1),
                                    outgoing=set(_groups(1))))  # fmt: skip
            b.prepare(MigrationTask(1, policy, incoming=dict.fromkeys(_groups(1), 0),
                                    outgoing=set(_groups(2))))  # fmt: skip
            assert a.task.hands_out and b.task.hands_out  # type: ignore[union-attr]
            a.activate(1)
            b.activate(1)
            b.seal(1, fence_ms=0.1)  # b sealed: it hands key group 2 out at once
            assert b.task.ready.is_set() and b.task.fence_ms == 0.1  # type: ignore[union-attr]
            await _until(lambda: set(_groups(2)) <= a.task.arrived, "a's take-over")  # type: ignore[union-attr]
            assert a.take_released() == []
            assert not a.held[_groups(2)].any(), "released before a's own seal"
            a.seal(1)
            a.take_released()
            assert a.held[_groups(2)].all()
            await _until(lambda: set(_groups(1)) <= b.task.arrived, "b's take-over")  # type: ignore[union-attr]
            b.take_released()  # b sealed before: released at once
            assert b.held[_groups(1)].all()
        finally:
            for db in dbs:
                db.close()

    asyncio.run(go())


def test_an_old_owner_that_takes_nothing_over_serves_right_after_its_seal(tmp_path: Path) -> None:
    async def go() -> None:
        dbs = [RocksStateBackend(tmp_path / "old"), RocksStateBackend(tmp_path / "new")]
        old = MigrationEngine(dbs[0], 4, S, range(4))
        new = MigrationEngine(dbs[1], 4, S, ())

        async def fetch(owner: int, epoch: int, groups: list[int], max_bytes: int, urgent: bool):
            return await old.serve(epoch, groups, max_bytes, urgent)

        new.fetcher = fetch
        policy = FetchPolicy(on_demand=True, background="all")
        try:
            old.prepare(MigrationTask(1, policy, incoming={}, outgoing=set(_groups(3))))
            new.prepare(MigrationTask(1, policy, incoming=dict.fromkeys(_groups(3), 0),
                                      outgoing=set()))  # fmt: skip
            old.activate(1)
            new.activate(1)
            old.seal(1, fence_ms=2.0)
            assert old.task.fenced.is_set() and old.task.ready.is_set()  # type: ignore[union-attr]
            await _until(lambda: new.task.done.is_set() or (  # type: ignore[union-attr]
                new.take_released() == [] and set(_groups(3)) <= new.task.arrived  # type: ignore[union-attr]
            ), "the take-over")
            new.take_released()  # not sealed itself, but it hands nothing out
            assert new.held[_groups(3)].all()
        finally:
            for db in dbs:
                db.close()

    asyncio.run(go())
