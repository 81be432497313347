"""The watch over warm standbys and change spares, without Ray (the controller is a plain class;
handles are stand-ins): a warm actor Ray reports dead, or one that does not answer on a node
whose raylet is gone, is dropped, stopped and refilled; a slow one on a live node is kept."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import ray

from raystream import controller as controller_module
from raystream import warm_watch
from raystream.controller import Controller
from raystream.runtime.instance import RuntimeConfig
from tests.unit._plain_controller import plain_controller


class _Ping:
    def __init__(self, how: str, node: str) -> None:
        self.how, self.node = how, node

    def remote(self) -> Any:
        async def reply() -> str:
            if self.how == "dead":
                raise ray.exceptions.ActorDiedError()
            if self.how == "silent":
                await asyncio.Event().wait()
            return self.node

        return reply()


class _Warm:
    def __init__(self, how: str, node: str) -> None:
        self.ping = _Ping(how, node)
        self.how = how


def _controller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Controller, dict]:
    c = plain_controller("warmwatch", tmp_path, RuntimeConfig(change_spares=2))
    c.state = "running"
    seen: dict[str, list[Any]] = {"killed": [], "standby_fills": [], "spare_refills": []}
    monkeypatch.setattr(warm_watch, "WARM_PING_S", 0.2)
    monkeypatch.setattr(controller_module.ray, "kill", lambda h, **_: seen["killed"].append(h))

    async def fill_standby(*_: Any, **__: Any) -> None:
        seen["standby_fills"].append(1)

    async def unreachable(among: set[str]) -> set[str]:
        return {n for n in among if n == "gone"}

    monkeypatch.setattr(c, "_fill_standby", fill_standby)
    monkeypatch.setattr(c, "_refill_spares_later", lambda why: seen["spare_refills"].append(why))
    monkeypatch.setattr(c, "_unreachable_nodes", unreachable)
    return c, seen


def test_dead_and_lost_warm_actors_are_dropped_and_refilled_slow_ones_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c, seen = _controller(tmp_path, monkeypatch)
    up, dead, lost, slow = (
        _Warm("ok", "n1"),
        _Warm("dead", "n1"),
        _Warm("silent", "gone"),
        _Warm("silent", "n2"),
    )
    c._standby = [
        (up, "n1", ("count", 2)),
        (dead, "n1", ("count", 3)),
        (lost, "gone", ("count", 4)),
    ]
    spare_lost = _Warm("silent", "gone")
    c._spares = [
        (slow, "raystream:warmwatch:spare:1", "n2"),
        (spare_lost, "raystream:warmwatch:spare:2", "gone"),
    ]

    async def run() -> list[str]:
        names = await c._check_warm_actors()
        await asyncio.sleep(0)  # the refill task runs
        return names

    c._prepared = {("count", 3): object(), ("count", 2): object()}
    names = asyncio.run(run())
    assert set(c._prepared) == {("count", 2)}  # the dropped standby's preparation went with it
    assert names == [
        "raystream:warmwatch:count:3",
        "raystream:warmwatch:count:4",
        "raystream:warmwatch:spare:2",
    ]
    assert [e[0] for e in c._standby] == [up]
    assert [e[0] for e in c._spares] == [slow]
    assert seen["killed"] == [dead, lost, spare_lost]
    assert seen["standby_fills"] == [1]
    assert len(seen["spare_refills"]) == 1
    assert [(d["actor"], d["why"]) for d in c.warm_actors_dropped] == [
        ("raystream:warmwatch:count:3", "died"),
        ("raystream:warmwatch:count:4", "node lost"),
        ("raystream:warmwatch:spare:2", "node lost"),
    ]
    assert c.describe()["warm_actors_dropped"] == c.warm_actors_dropped.kept()
    assert c.describe()["warm_actors_dropped_total"] == 3


def test_a_warm_actor_taken_while_it_was_pinged_is_not_dropped_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c, seen = _controller(tmp_path, monkeypatch)
    dead = _Warm("dead", "n1")
    entry = (dead, "n1", ("count", 2))
    c._standby = [entry]

    async def run() -> list[str]:
        check = asyncio.ensure_future(c._check_warm_actors())
        await asyncio.sleep(0)
        c._standby.remove(entry)  # a scale-out took it meanwhile
        return await check

    assert asyncio.run(run()) == []
    assert seen["killed"] == []
    assert seen["standby_fills"] == []
