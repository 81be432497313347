"""Watching the warm actors while the job runs: a warm standby or change spare that died, or
whose node was lost, is dropped and replaced before a scale-out, insert or move picks it.

A mixin of :class:`raystream.controller.Controller`. The job's instances are watched by their
``run()`` outcomes and heartbeats (:mod:`raystream.recovery`); warm actors run nothing, so
without this a standby lost with its node was noticed only at the next recovery, and a
scale-out that took it waited for Ray to declare the node dead (~15 s) and failed. Every
``WARM_CHECK_S`` each warm actor is pinged: one that Ray reports dead is dropped; one that does
not answer within ``WARM_PING_S`` is dropped if its node's raylet takes no connection (a lost
node; a slow but live actor is kept). Dropped actors are refilled as after a node loss at a
recovery, and listed in ``warm_actors_dropped`` (``job.status()``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from raystream.history import RECORDS_KEPT, BoundedHistory

__all__ = ["WARM_CHECK_S", "WARM_PING_S", "WarmWatch", "unanswered_on_lost_nodes"]

log = logging.getLogger(__name__)

WARM_CHECK_S = 2.0  # how often the warm actors are pinged
WARM_PING_S = 2.0  # a ping not answered this long asks whether the actor's node is still there


def unanswered_on_lost_nodes(
    answers: list[Any], nodes: list[str], lost: set[str]
) -> tuple[list[int], list[int]]:
    """Which warm actors to drop, from their ping ``answers`` (a node id, or the exception the
    ping raised) and ``nodes`` (each one's node): (those Ray reports dead, those that did not
    answer and whose node is in ``lost``), as positions."""
    dead = [k for k, a in enumerate(answers) if isinstance(a, ray.exceptions.ActorDiedError)]
    silent = [
        k
        for k, a in enumerate(answers)
        if isinstance(a, BaseException) and k not in dead and nodes[k] in lost
    ]
    return dead, silent


class WarmWatch:
    """The controller's watch over its warm standbys and change spares."""

    def _init_warm_watch(self: Any) -> None:
        # the newest RECORDS_KEPT drops (len() counts them all)
        self.warm_actors_dropped: BoundedHistory = BoundedHistory(RECORDS_KEPT)

    async def _watch_warm_actors(self: Any, every_s: float = WARM_CHECK_S) -> None:
        while self.state in ("running", "recovering"):
            await asyncio.sleep(every_s)
            if self.state != "running":
                continue
            try:
                await self._check_warm_actors()
            except Exception as e:  # noqa: BLE001 - the watch never stops the job
                log.debug("job %s: checking the warm actors failed: %s", self.flow.name, e)

    async def _check_warm_actors(self: Any) -> list[str]:
        """Ping every warm actor once; drop (and refill) the dead and the lost. Returns the
        names of the actors dropped."""
        standbys = list(self._standby)  # (actor, node, slot)
        spares = list(self._spares)  # (actor, name, node)
        handles = [e[0] for e in standbys] + [e[0] for e in spares]
        if not handles:
            return []
        nodes = [e[1] for e in standbys] + [e[2] for e in spares]
        answers = await asyncio.gather(
            *(asyncio.wait_for(_result(h.ping.remote()), WARM_PING_S) for h in handles),
            return_exceptions=True,
        )
        silent_nodes = {
            n for n, a in zip(nodes, answers, strict=True) if isinstance(a, BaseException)
        }
        lost = await self._unreachable_nodes(silent_nodes) if silent_nodes else set()
        dead, silent = unanswered_on_lost_nodes(list(answers), nodes, lost)
        why = {k: "died" for k in dead} | {k: "node lost" for k in silent}
        split = len(standbys)
        # not one a scale-out, insert or move took while the pings were out
        order = [
            k
            for k in sorted(why)
            if (standbys[k] in self._standby if k < split else spares[k - split] in self._spares)
        ]
        gone_standbys = [standbys[k] for k in order if k < split]
        gone_spares = [spares[k - split] for k in order if k >= split]
        names = self._drop_warm_entries(gone_standbys, gone_spares, "actor died or node lost")
        at_s = self._now_s()
        for k, name in zip(order, names, strict=True):
            self.warm_actors_dropped.append({"at_s": at_s, "actor": name, "why": why[k]})
        if names:
            log.warning("job %s: warm actors dropped and refilled: %s", self.flow.name, names)
        return names


async def _result(ref: Any) -> Any:
    return await ref
