"""Which instance a failure started at (no Ray here).

When an actor dies, the instances that send to it fail too: their next push raises Ray's
actor-died error. The controller reads outcomes as they come, and a sender's may come first;
the job's error (and a recovery's record) must then name the instance that died, not the one
that could no longer reach it. So an outcome whose error is a lost peer waits a moment
(``grace_s``) for an outcome of an actor that died itself, and that one is the cause.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from raystream.runtime.messages import ChannelId

__all__ = ["PEER_LOSS_GRACE_S", "lost_a_peer", "root_cause"]

# how long a sender's "my receiver died" outcome waits for the dead actor's own outcome (Ray
# reports both within tens of milliseconds; a user error waits for nothing)
PEER_LOSS_GRACE_S = 1.0
# Ray's errors for a call to an actor that died or cannot be reached
_PEER_ERRORS = ("ActorDiedError", "RayActorError", "ActorUnavailableError")


def lost_a_peer(outcome: dict[str, Any]) -> bool:
    """The instance ran and failed because an actor it called died (not a death of its own)."""
    error = outcome.get("error") or ""
    return not outcome.get("died") and error.startswith(_PEER_ERRORS)


async def root_cause(
    iid: ChannelId,
    outcome: dict[str, Any],
    pending: dict[ChannelId, asyncio.Future[dict[str, Any]]],
    grace_s: float = PEER_LOSS_GRACE_S,
) -> tuple[ChannelId, dict[str, Any]]:
    """The failed instance to report for ``outcome`` of ``iid``: itself, unless it lost a peer
    and another instance's outcome (in ``pending``, done or within ``grace_s``) says that
    instance's actor died; then that one."""
    if not lost_a_peer(outcome):
        return iid, outcome
    others = {i: f for i, f in pending.items() if i != iid}
    deadline = time.monotonic() + grace_s
    while True:
        for i, fut in others.items():
            if fut.done() and not fut.cancelled() and fut.result().get("died"):
                return i, fut.result()
        left = [f for f in others.values() if not f.done()]
        wait_s = deadline - time.monotonic()
        if not left or wait_s <= 0:
            return iid, outcome
        await asyncio.wait(left, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
