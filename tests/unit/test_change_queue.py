"""The queue every change of a running job goes through (rescale, replace, insert, remove, move):
one at a time, in the order asked; each change's record says how long it waited (``queued_s``),
and a change given up while it waits leaves the queue as it found it. The controller here is a
plain class (no Ray); the changes are stand-ins that hold their turn."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from ._plain_controller import plain_controller


def test_changes_take_turns_in_order_and_records_say_how_long_they_waited(
    tmp_path: Path,
) -> None:
    ctl = plain_controller("queue", tmp_path)
    order: list[str] = []

    async def change(name: str, hold_s: float) -> dict[str, object]:
        async with ctl._change_turn() as waited:
            order.append(f"{name} in")
            seen.append(ctl._queued)  # changes still waiting behind this one
            await asyncio.sleep(hold_s)
            t = time.monotonic()
            record = ctl._record_reconfiguration(
                "replace", "count", t, t, epochs=[1], moved={}, change=name
            )
            order.append("done")
            assert record["queued_s"] == round(waited, 3)
            return record

    async def main() -> list[dict[str, object]]:
        first = asyncio.ensure_future(change("a", 0.2))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(change("b", 0.0))
        third = asyncio.ensure_future(change("c", 0.0))
        await asyncio.sleep(0.05)
        assert ctl._queued == 2 and ctl.describe()["queued_rescales"] == 2
        return list(await asyncio.gather(first, second, third))

    seen: list[int] = []
    a, b, c = asyncio.run(main())
    assert order == ["a in", "done", "b in", "done", "c in", "done"]
    assert seen == [0, 1, 0]
    assert a["queued_s"] < 0.05 <= 0.15 <= b["queued_s"] <= c["queued_s"]
    assert ctl._queued == 0 and ctl._turn_queued_s is None
    # a record made outside a turn (none) has no queued_s
    t = time.monotonic()
    rec = ctl._record_reconfiguration("move", "count", t, t, epochs=[2], moved={}, change="x")
    assert "queued_s" not in rec


def test_a_change_given_up_while_it_waits_leaves_the_queue_as_it_was(tmp_path: Path) -> None:
    ctl = plain_controller("queuecancel", tmp_path)

    async def main() -> None:
        release = asyncio.Event()

        async def holder() -> None:
            async with ctl._change_turn():
                await release.wait()

        async def waiter() -> None:
            async with ctl._change_turn():
                raise AssertionError("a cancelled change never takes its turn")

        held = asyncio.ensure_future(holder())
        await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(waiter())
        await asyncio.sleep(0.01)
        assert ctl._queued == 1
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert ctl._queued == 0, "the cancelled change still counted as queued"
        release.set()
        await held
        assert ctl._queued == 0 and not ctl._rescale_lock.locked()

    asyncio.run(main())
