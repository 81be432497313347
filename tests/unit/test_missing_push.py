"""An input channel takes pushes in sequence order, so a push lost on its way would stop the
channel for good, silently. The inbox reports a push that waits for an earlier one that never
came in (and only that: a push waiting behind one that waits for room is backpressure)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pyarrow as pa
import pytest

import raystream.runtime.channels as channels
from raystream.runtime.channels import Inbox

CH = ("source", 0)


def _batch(i: int) -> pa.RecordBatch:
    return pa.record_batch({"x": [i]})


def test_a_push_waiting_for_one_that_never_came_is_reported(
    monkeypatch: Any, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(channels, "MISSING_PUSH_WARN_S", 0.05)

    async def main() -> list[dict[str, Any]]:
        inbox = Inbox(capacity=4)
        inbox.add_channel(CH)
        waiting = asyncio.ensure_future(inbox.put(CH, 1, _batch(1)))  # push 0 is lost
        await asyncio.sleep(0.2)
        assert not waiting.done()
        reports = list(inbox.missing_pushes)
        await inbox.put(CH, 0, _batch(0))  # it comes after all: the channel goes on
        await asyncio.wait_for(waiting, 1.0)
        return reports

    with caplog.at_level(logging.WARNING, logger="raystream.runtime.channels"):
        reports = asyncio.run(main())
    assert reports == [{"channel": CH, "waiting": 1, "missing": 0}]  # once, however long
    assert "push 1 has waited" in caplog.text and "for push 0" in caplog.text


def test_pushes_waiting_for_room_are_not_reported(monkeypatch: Any) -> None:
    monkeypatch.setattr(channels, "MISSING_PUSH_WARN_S", 0.05)

    async def main() -> Inbox:
        inbox = Inbox(capacity=1)
        inbox.add_channel(CH)
        await inbox.put(CH, 0, _batch(0))  # the channel is full
        later = [asyncio.ensure_future(inbox.put(CH, s, _batch(s))) for s in (1, 2)]
        await asyncio.sleep(0.2)  # 1 waits for room, 2 for 1 (which came in)
        assert not any(t.done() for t in later)
        for _ in range(3):
            await asyncio.wait_for(inbox.get(), 1.0)
            await asyncio.sleep(0.01)
        await asyncio.wait_for(asyncio.gather(*later), 1.0)
        return inbox

    inbox = asyncio.run(main())
    assert inbox.missing_pushes == []
