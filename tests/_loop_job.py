"""A job's instances in one event loop, without Ray: each instance's sends go straight to the
receiver's ``push``. The unit tests of rescale races build on it (they add the controller's part
of a scale-out themselves)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from raystream.plan import PhysicalPlan
from raystream.runtime.instance import OperatorInstance


class LoopJob:
    """The instances of ``plan`` in the running event loop; ``finish_s``: how long
    :meth:`finish` waits for every instance to end (a hang fails the test)."""

    def __init__(self, plan: PhysicalPlan, state_dir: Path, finish_s: float) -> None:
        self.plan = plan
        self.state_dir = state_dir
        self.finish_s = finish_s
        self.instances: dict[Any, OperatorInstance] = {}
        self.runs: dict[Any, asyncio.Task[None]] = {}
        for iid, spec in plan.instances.items():
            self._add(iid, OperatorInstance(spec))

    def _add(self, iid: Any, inst: OperatorInstance) -> None:
        self.instances[iid] = inst
        inst.connect(self._send, lambda event, info: None)

    def _send(self, receiver: Any, payload: tuple[Any, int, Any]) -> Any:
        channel, seq, item = payload
        return asyncio.ensure_future(self.instances[receiver].push(channel, seq, item))

    def run(self, iid: Any) -> None:
        self.runs[iid] = asyncio.get_running_loop().create_task(self.instances[iid].run())

    async def finish(self) -> None:
        """Every instance ends (a new one that nobody sends to would wait forever), without an
        error."""
        runs = list(self.runs.values())
        _, pending = await asyncio.wait(runs, timeout=self.finish_s)
        waiting = [iid for iid, t in self.runs.items() if t in pending]
        for t in pending:
            t.cancel()
        assert not waiting, f"instances {waiting} did not finish within {self.finish_s} s"
        errors = {iid: inst.error for iid, inst in self.instances.items() if inst.error}
        assert not errors, errors
