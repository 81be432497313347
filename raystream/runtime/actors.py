"""The Ray edge: the only place ``ray.remote`` is applied.

Operator instances and the controller are plain classes; these thin wrappers make them actors.
Every actor takes ``num_cpus=0`` so a 2-core machine can hold a whole dataflow.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from raystream.runtime.instance import InstanceSpec, OperatorInstance
from raystream.runtime.messages import Barrier, ChannelId

__all__ = ["InstanceActor", "NAMESPACE", "controller_actor_class", "controller_name"]

NAMESPACE = "raystream"


def controller_name(job: str) -> str:
    return f"raystream-controller:{job}"


@ray.remote(num_cpus=0, max_restarts=0)
class InstanceActor:
    """An operator instance as an async Ray actor."""

    def __init__(self, spec: InstanceSpec) -> None:
        self._instance = OperatorInstance(spec)
        self._receivers: dict[ChannelId, Any] = {}
        self._events: list[tuple[str, dict[str, Any]]] = []
        self._controller: Any = None

    async def connect(self, receivers: dict[ChannelId, Any], controller: Any) -> None:
        self._receivers = receivers
        self._controller = controller
        self._instance.connect(self._send, self._report)

    def _send(self, receiver: ChannelId, payload: tuple[ChannelId, int, Any]) -> Any:
        channel, seq, item = payload
        return asyncio.wrap_future(self._receivers[receiver].push.remote(channel, seq, item).future())

    def _report(self, event: str, info: dict[str, Any]) -> None:
        if event == "barrier" and self._controller is not None:
            self._controller.on_barrier.remote(info)

    async def run(self) -> dict[str, Any]:
        """Run the instance to its end; returns its result or its error (never raises)."""
        await self._instance.run()
        inst = self._instance
        return {
            "instance": inst.spec.id,
            "result": inst.result,
            "error": inst.error,
            "metrics": inst.snapshot_metrics(),
        }

    async def push(self, channel: ChannelId, seq: int, item: Any) -> None:
        await self._instance.push(channel, seq, item)

    async def inject_barrier(self, barrier: Barrier) -> None:
        self._instance.inject_barrier(barrier)

    async def metrics(self) -> dict[str, Any]:
        return self._instance.snapshot_metrics()

    async def stop(self) -> None:
        self._instance.stop()

    async def ping(self) -> bool:
        await asyncio.sleep(0)
        return True


_controller_actor: Any = None


def controller_actor_class() -> Any:
    """The controller as an actor class (made on first use: controller.py imports this module)."""
    global _controller_actor
    if _controller_actor is None:
        from raystream.controller import Controller

        _controller_actor = ray.remote(num_cpus=0, max_restarts=0)(Controller)
    return _controller_actor
