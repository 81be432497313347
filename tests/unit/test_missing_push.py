"""An input channel takes pushes in sequence order, so a push lost on its way would stop the
channel for good, silently. The inbox reports a push that waits for an earlier one that never
came in (and only that: a push waiting behind one that waits for room is backpressure); the
check runs with the controller's heartbeats, off the pushes' path."""

from __future__ import annotations

import asyncio
import logging

import pyarrow as pa
import pytest

from raystream.runtime.channels import Inbox

CH = ("source", 0)


def _batch(i: int) -> pa.RecordBatch:
    return pa.record_batch({"x": [i]})


def test_a_push_waiting_for_one_that_never_came_is_reported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> list[list[dict[str, object]]]:
        inbox = Inbox(capacity=4)
        inbox.add_channel(CH)
        waiting = asyncio.ensure_future(inbox.put(CH, 1, _batch(1)))  # push 0 is lost
        await asyncio.sleep(0.05)
        assert not waiting.done()
        seen = [inbox.check_missing_pushes(now, after_s=30.0) for now in (100.0, 129.0)]
        seen += [inbox.check_missing_pushes(now, after_s=30.0) for now in (130.0, 200.0)]
        await inbox.put(CH, 0, _batch(0))  # it comes after all: the channel goes on
        await asyncio.wait_for(waiting, 1.0)
        seen.append(inbox.check_missing_pushes(300.0, after_s=30.0))
        assert inbox.missing_pushes == [{"channel": CH, "waiting": 1, "missing": 0}]
        return seen

    with caplog.at_level(logging.WARNING, logger="raystream.runtime.channels"):
        seen = asyncio.run(main())
    report = {"channel": CH, "waiting": 1, "missing": 0}
    assert seen == [[], [], [report], [], []]  # after 30 s, once however long
    assert "push 1 has waited 30 s for push 0" in caplog.text


def test_pushes_waiting_for_room_are_not_reported() -> None:
    async def main() -> Inbox:
        inbox = Inbox(capacity=1)
        inbox.add_channel(CH)
        await inbox.put(CH, 0, _batch(0))  # the channel is full
        later = [asyncio.ensure_future(inbox.put(CH, s, _batch(s))) for s in (1, 2)]
        await asyncio.sleep(0.05)  # 1 waits for room, 2 for 1 (which came in)
        assert not any(t.done() for t in later)
        for now in (0.0, 100.0, 1000.0):
            assert inbox.check_missing_pushes(now, after_s=30.0) == []
        for _ in range(3):
            await asyncio.wait_for(inbox.get(), 1.0)
            await asyncio.sleep(0.01)
        await asyncio.wait_for(asyncio.gather(*later), 1.0)
        return inbox

    inbox = asyncio.run(main())
    assert inbox.missing_pushes == []
