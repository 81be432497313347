"""Warm actors for changes to a running job: an inserted step's instances and a moved instance
start in a process that is already up instead of a new one.

A mixin of :class:`raystream.controller.Controller`. A scale-out's warm standbys are named for the
instance each would become (Ray names an actor only when it is created, and a scale-out's
instance keeps the name ``raystream:<job>:<step>:<index>``), but the name of an inserted step is
known only when the insert is asked for. So a job started with
``RuntimeConfig(change_spares=N)`` keeps N warm actors (process started, imports done) under
neutral names, ``raystream:<job>:spare:<n>``; an insert or a move configures them as its new
instances (a move takes one on its target node), and the controller keeps the directory of
which instance runs in which actor (``actor_names`` in ``raystream status --json``, ``actors``
in the change's record). Used spares are refilled ``change_spare_refill_delay_s`` (5 s) after
the change ended, one process at a time (``spare_refills`` in the job's result: when and how
long each start took): a process start still takes CPU from the running job, so it comes
after the change has settled rather than in it, and never two at once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

from raystream.history import RECORDS_KEPT, BoundedHistory

__all__ = ["ChangeSpares", "pick_spares", "spare_actor_name"]


def spare_actor_name(job: str, serial: int) -> str:
    """The neutral name of the ``serial``-th warm spare of job ``job``."""
    return f"raystream:{job}:spare:{serial}"


def pick_spares(nodes: list[str], count: int, node: str | None = None) -> list[int]:
    """Which spares (positions in ``nodes``, each spare's node id) ``count`` new instances take:
    any, oldest first, or only those on ``node`` if given; fewer when there are not enough."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        msg = f"expected a number of instances >= 0, got {count!r}"
        raise ValueError(msg)
    fits = [k for k, n in enumerate(nodes) if node is None or n == node]
    return fits[:count]


class ChangeSpares:
    """Neutral-named warm actors that inserts and moves configure instead of starting one."""

    def _init_spares(self: Any) -> None:
        self._spares: list[tuple[Any, str, str]] = []  # (actor, its name, its node id)
        self._spare_serial = 0
        self._spare_filling = False
        # the newest RECORDS_KEPT refills (len() counts them all)
        self.spare_refills: BoundedHistory = BoundedHistory(RECORDS_KEPT)
        self.actor_names: dict[Any, str] = {}  # instance id -> actor name, where not the usual

    async def _fill_spares(self: Any, delay_s: float = 0.0, why: str = "start") -> None:
        """Start the missing spares, one at a time (each waits for the previous one to be up,
        so a small machine's cores keep running the job), after ``delay_s``."""
        from raystream.runtime.actors import NAMESPACE, InstanceActor

        if delay_s > 0:
            await asyncio.sleep(delay_s)
        if self._spare_filling or self.state != "running":
            return
        self._spare_filling = True
        try:
            if len(self._spares) >= self.config.change_spares:
                return
            origin = self.origin_ns / 1e9
            starts: list[float] = []  # seconds each process took to be up, in order
            self.spare_refills.append(
                {"why": why, "start_s": round(time.time() - origin, 3), "process_starts_s": starts}
            )
            while self.state == "running" and len(self._spares) < self.config.change_spares:
                self._spare_serial += 1
                name = spare_actor_name(self.flow.name, self._spare_serial)
                began = time.monotonic()
                h = InstanceActor.options(
                    name=name,
                    namespace=NAMESPACE,
                    max_concurrency=10_000,
                    scheduling_strategy="SPREAD",
                ).remote(None, self._self)  # the controller's handle now, not at the change
                node = await h.ping.remote()
                if self.state != "running":  # the job ended meanwhile: do not leak it
                    ray.kill(h, no_restart=True)
                    return
                self._spares.append((h, name, node))
                starts.append(round(time.monotonic() - began, 3))
        finally:
            self._spare_filling = False

    def _take_spares(self: Any, count: int, node: str | None = None) -> list[tuple[Any, str, str]]:
        """Up to ``count`` warm spares (on ``node`` if given): (actor, its name, its node id)."""
        picked = pick_spares([n for *_, n in self._spares], count, node)
        taken = [self._spares[k] for k in picked]
        for entry in taken:
            self._spares.remove(entry)
        return taken

    def _refill_spares_later(self: Any, why: str) -> None:
        if self.config.change_spares > len(self._spares):
            delay = self.config.change_spare_refill_delay_s
            asyncio.get_running_loop().create_task(self._fill_spares(delay, why))

    def _spare_handles(self: Any) -> list[Any]:
        spares, self._spares = self._spares, []
        return [h for h, *_ in spares]
