"""Which instance a failure is reported at: a sender whose receiver died names the receiver."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from raystream.root_cause import lost_a_peer, root_cause

SENDER = ("parts", 0)
DEAD = ("out", 0)
OTHER = ("out", 1)
PEER_LOST = {"instance": SENDER, "error": "ActorDiedError: The actor died unexpectedly"}
DIED = {"instance": DEAD, "error": "ActorDiedError: killed by ray.kill", "died": True}


def _done(value: dict[str, Any]) -> asyncio.Future[dict[str, Any]]:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut


def test_what_counts_as_a_lost_peer() -> None:
    assert lost_a_peer(PEER_LOST)
    assert not lost_a_peer(DIED)  # its own death
    assert not lost_a_peer({"error": "ValueError: price column holds 'abc'"})
    assert not lost_a_peer({"error": None})


def test_the_dead_receiver_is_the_cause_when_its_outcome_is_already_in() -> None:
    async def go() -> tuple[Any, Any]:
        pending = {SENDER: _done(PEER_LOST), DEAD: _done(DIED)}
        return await root_cause(SENDER, PEER_LOST, pending, grace_s=5.0)

    t0 = time.monotonic()
    assert asyncio.run(go()) == (DEAD, DIED)
    assert time.monotonic() - t0 < 1.0  # nothing waited


def test_the_dead_receiver_is_the_cause_when_its_outcome_comes_a_moment_later() -> None:
    async def go() -> tuple[Any, Any]:
        loop = asyncio.get_running_loop()
        late = loop.create_future()
        loop.call_later(0.1, late.set_result, DIED)
        other = loop.create_future()  # an instance that runs on and never ends here
        pending = {SENDER: _done(PEER_LOST), OTHER: other, DEAD: late}
        return await root_cause(SENDER, PEER_LOST, pending, grace_s=5.0)

    assert asyncio.run(go()) == (DEAD, DIED)


def test_without_a_dead_actor_the_sender_is_the_cause_after_the_grace() -> None:
    async def go() -> tuple[Any, Any]:
        ended_fine = {"instance": OTHER, "error": None}
        pending = {
            SENDER: _done(PEER_LOST),
            OTHER: _done(ended_fine),
            DEAD: asyncio.get_running_loop().create_future(),
        }
        return await root_cause(SENDER, PEER_LOST, pending, grace_s=0.2)

    t0 = time.monotonic()
    assert asyncio.run(go()) == (SENDER, PEER_LOST)
    assert 0.2 <= time.monotonic() - t0 < 2.0


def test_a_user_error_is_its_own_cause_at_once() -> None:
    user = {"instance": SENDER, "error": "ValueError: bad row"}

    async def go() -> tuple[Any, Any]:
        pending = {SENDER: _done(user), DEAD: _done(DIED)}
        return await root_cause(SENDER, user, pending, grace_s=5.0)

    assert asyncio.run(go()) == (SENDER, user)
