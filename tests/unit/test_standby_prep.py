"""Warm standbys prepared for their slot (raystream.standby_prep), without Ray: the controller
configures and connects a standby ahead with exactly what a scale-out would send, keeps it while
nothing changed, and prepares it again (or the scale-out falls back to configuring it) when the
plan changed under it: a recovery, a rescale downstream, a replaced downstream actor, another
target parallelism."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

import raystream as rs
from raystream.controller import Controller
from raystream.keys import RoutingTable
from raystream.runtime.actors import MemberHandle
from raystream.runtime.instance import RuntimeConfig
from raystream.standby_prep import Preparation, handle_key, mismatch, prepared_parallelism, same

KEY_GROUPS = 8
SLOT = ("count", 2)


@rs.keyed_batches(name="count", state=rs.ValueState(int, default=0))
def count(batch: rs.KeyedBatch, state: object) -> object:
    return batch.output({"count": batch.counts})


class _Calls:
    """A fake actor: every ``h.method.remote(*args)`` is recorded and answers at once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        actor = self

        class _Method:
            @staticmethod
            def remote(*args: Any) -> Any:
                actor.calls.append((method, args))
                return _done(None)

        return _Method()

    def names(self) -> list[str]:
        return [m for m, _ in self.calls]


async def _done(value: Any) -> Any:
    return value


def _controller(tmp_path: Path, chained: bool) -> Controller:
    flow = rs.Dataflow("prep", num_key_groups=KEY_GROUPS, sub_groups=2)
    flow.source(rs.sources.generator(events=10, keys=4)).key_by("key").apply(count).sink(
        rs.sinks.null(), name="out"
    )
    parallelism = {"count": 2, "out": 2 if chained else 1}
    c = Controller(flow, parallelism, RuntimeConfig(), str(tmp_path))
    assert bool(c.following) is chained, c.following
    for iid in c.specs:  # the deployed instances' actors
        c.handles[iid] = _Calls(f"{iid}")
    c._self = _Calls("controller")
    c.state = "running"
    return c


def _prepare(c: Controller) -> None:
    asyncio.run(c._prepare_standbys())


def test_a_standby_is_configured_and_connected_for_its_slot_once_while_nothing_changes(
    tmp_path: Path,
) -> None:
    c = _controller(tmp_path, chained=True)
    standby = _Calls("standby")
    c._standby = [(standby, "node-a", SLOT)]
    _prepare(c)
    # configured with the spec of instance 2 of a 3-wide step, each of its 2 instances connected
    assert standby.names() == ["configure", "connect", "call_member"], standby.calls
    actor_spec = standby.calls[0][1][0]
    assert [s.id for s in actor_spec.specs] == [("count", 2), ("out", 2)]
    assert actor_spec.specs[1].step.parallelism == 3
    assert actor_spec.specs[0].inputs == (("source", 0),)
    prep = c._prepared[SLOT]
    assert prep.node == "node-a" and prep.parallelism == 3
    assert "standby" in Path(prep.state_path).name
    # nothing changed: nothing sent again
    _prepare(c)
    assert len(standby.calls) == 3
    # what a 1->3 scale-out would send now is exactly that: it skips configure and connect
    ahead, receivers = c._slot_actor_spec("count", 2, 3, prep.state_path, standby)
    assert mismatch(prep, standby, ahead, receivers) is None


def test_a_recovery_between_preparing_and_using_invalidates_the_preparation(
    tmp_path: Path,
) -> None:
    c = _controller(tmp_path, chained=True)
    standby = _Calls("standby")
    c._standby = [(standby, "node-a", SLOT)]
    _prepare(c)
    first = c._prepared[SLOT]
    # a recovery redeploys every instance with the next attempt number
    for iid, spec in list(c.specs.items()):
        c.specs[iid] = replace(spec, attempt=spec.attempt + 1)
    ahead, receivers = c._slot_actor_spec("count", 2, 3, first.state_path, standby)
    assert mismatch(first, standby, ahead, receivers) == "spec changed"
    _prepare(c)  # prepared again, in a new state folder (the old instance holds the first)
    assert standby.names() == ["configure", "connect", "call_member"] * 2
    again = c._prepared[SLOT]
    assert again.state_path != first.state_path
    assert again.actor_spec.specs[0].attempt == first.actor_spec.specs[0].attempt + 1


def test_a_rescale_downstream_or_a_replaced_downstream_actor_invalidates_it(
    tmp_path: Path,
) -> None:
    c = _controller(tmp_path, chained=False)  # count -> out over a channel (out: 1 instance)
    standby = _Calls("standby")
    c._standby = [(standby, "node-a", SLOT)]
    _prepare(c)
    prep = c._prepared[SLOT]
    assert standby.names() == ["configure", "connect"]
    assert set(standby.calls[1][1][0]) == {("out", 0)}
    # the downstream actor was replaced (a recovery or a move): same id, another actor
    c.handles[("out", 0)] = _Calls("out-0-again")
    ahead, receivers = c._slot_actor_spec("count", 2, 3, prep.state_path, standby)
    assert mismatch(prep, standby, ahead, receivers) == "a receiver of ('count', 2) was replaced"
    _prepare(c)
    assert standby.names() == ["configure", "connect"] * 2
    assert standby.calls[3][1][0][("out", 0)] is c.handles[("out", 0)]
    # the upstream step gained an instance (its inputs change)
    prep = c._prepared[SLOT]
    c.specs[("source", 1)] = replace(c.specs[("source", 0)], index=1)
    ahead, receivers = c._slot_actor_spec("count", 2, 3, prep.state_path, standby)
    assert mismatch(prep, standby, ahead, receivers) == "spec changed"
    assert ahead.inputs == (("source", 0), ("source", 1))


def test_another_target_parallelism_or_another_actor_is_not_used(tmp_path: Path) -> None:
    c = _controller(tmp_path, chained=True)
    standby = _Calls("standby")
    c._standby = [(standby, "node-a", SLOT)]
    _prepare(c)
    prep = c._prepared[SLOT]
    # prepared for 1 more (slot 2 of a 2-wide step: 3); a scale-out to 4 gives the chained sink
    # another parallelism: configured again at the scale-out
    ahead, receivers = c._slot_actor_spec("count", 2, 4, prep.state_path, standby)
    assert mismatch(prep, standby, ahead, receivers) == "spec changed"
    other = _Calls("other")
    ahead, receivers = c._slot_actor_spec("count", 2, 3, prep.state_path, other)
    assert mismatch(prep, other, ahead, receivers) == "another actor"


def test_no_preparation_during_a_change_or_for_a_slot_a_scale_out_takes(tmp_path: Path) -> None:
    c = _controller(tmp_path, chained=True)
    standby = _Calls("standby")
    c._standby = [(standby, "node-a", SLOT)]

    async def locked() -> None:
        async with c._rescale_lock:
            await c._prepare_standbys()

    asyncio.run(locked())
    c._spawning.add(SLOT)
    _prepare(c)
    assert standby.calls == [] and SLOT not in c._prepared
    c._spawning.clear()
    c.parallelism["count"] = 3  # the slot is an instance now (its standby was taken)
    _prepare(c)
    assert standby.calls == []
    # a preparation whose standby left the pool is forgotten
    c.parallelism["count"] = 2
    _prepare(c)
    assert SLOT in c._prepared
    c._standby = []
    _prepare(c)
    assert SLOT not in c._prepared


def test_specs_compare_by_structure_and_handles_by_actor() -> None:
    table = RoutingTable.uniform(KEY_GROUPS, 2)
    assert same({"t": table, "x": (1, "a")}, {"t": RoutingTable.uniform(KEY_GROUPS, 2), "x": (1, "a")})
    assert not same(table, RoutingTable.uniform(KEY_GROUPS, 3))
    assert not same(np.arange(3), np.arange(3).astype(float))
    a = _Calls("a")
    assert handle_key(MemberHandle(a, ("out", 1))) == handle_key(MemberHandle(a, ("out", 1)))
    assert handle_key(MemberHandle(a, ("out", 1))) != handle_key(MemberHandle(a, ("out", 2)))
    assert handle_key(a) != handle_key(_Calls("a"))
    assert prepared_parallelism([("count", 1), ("count", 2)], "count", 1) == 3
    assert prepared_parallelism([("count", 0)], "count", 2) == 3  # no next slot held: one more
    prep = Preparation(SLOT, a, None, "spec", {}, None, 3)
    assert mismatch(prep, a, "spec", {}) is None


def test_a_scale_in_leaves_its_refill_to_a_deferred_refill_of_the_same_step(
    tmp_path: Path,
) -> None:
    c = _controller(tmp_path, chained=True)
    fills: list[str] = []

    async def fill(delay_s: float = 0.0, *, in_waves: bool = False) -> None:
        fills.append("fill")

    c._fill_standby = fill  # type: ignore[method-assign]

    async def scale_ins() -> None:
        c._refill_waiting["count"] += 1  # ds2's refill after 1 -> 4 waits for the load to go
        c._refill_after_scale_in("count")
        await asyncio.sleep(0)
        assert fills == []
        c._refill_waiting["count"] -= 1
        c._refill_after_scale_in("count")
        await asyncio.sleep(0)
        assert fills == ["fill"]

    asyncio.run(scale_ins())


def test_a_standby_is_prepared_for_the_policys_next_scale_out_when_it_plans_one(
    tmp_path: Path,
) -> None:
    from types import SimpleNamespace

    c = _controller(tmp_path, chained=True)
    # threshold doubles: from 2 the next scale-out asks for 4 (slots 2 and 3); three standbys
    # are pooled, the one for slot 4 is beyond it (prepared for every standby taken: 5)
    c.autoscaler = SimpleNamespace(next_parallelism=lambda op: 4)  # type: ignore[assignment]
    pool = {i: _Calls(f"s{i}") for i in (2, 3, 4)}
    c._standby = [(h, "node-a", ("count", i)) for i, h in pool.items()]
    _prepare(c)
    widths = {i: c._prepared[("count", i)].actor_spec.specs[1].step.parallelism for i in pool}
    assert widths == {2: 4, 3: 4, 4: 5}
