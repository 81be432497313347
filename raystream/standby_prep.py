"""Warm standbys prepared for the slot they will take (no Ray here).

A warm standby is an actor named for the next instance of a keyed step (``(step, index)``,
see :func:`raystream.placement.standby_slots`). While it waits, the controller configures it
with the spec that instance would get now (the step's processor, a state folder of its own,
its outputs to the downstream instances as they run) and connects it (its receivers and the
controller). A scale-out that takes it then sends neither ``configure`` nor ``connect``: only
the upstream's ``add_receivers``, the downstream's ``add_inputs`` and the barrier remain.

A preparation is only used when it is exactly what the scale-out would send now: the actor
spec (:func:`same`) and the receivers of each instance in the actor (by actor). Anything the
plan changed since -- a reconfiguration, another rescale, a recovery (new actors downstream),
a different target parallelism (a chained sink's writer count) -- makes them differ, and the
scale-out configures and connects the standby as it would have without a preparation. The
controller prepares a standby again when it sees its preparation no longer matches.

Upstream instances are not told about a prepared standby ahead (they learn of it at the
scale-out): an upstream that ends meanwhile would send it an EndOfStream, and the downstream
steps do not take it as an input ahead either (their barriers would wait for it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Preparation", "handle_key", "mismatch", "prepared_parallelism", "same"]


@dataclass
class Preparation:
    """What a standby (``handle``, for instance ``slot``) was configured and connected with."""

    slot: tuple[str, int]
    handle: Any
    node: str | None
    actor_spec: Any  # an InstanceSpec, or a ChainSpec (steps chained after the keyed one)
    receivers: dict[tuple[str, int], dict[tuple[str, int], Any]]  # instance id -> its connect's
    state_path: str | None
    parallelism: int  # the step's parallelism after the scale-out it was prepared for
    ids: tuple[tuple[str, int], ...] = field(default=())  # the instances in the actor, head first


def handle_key(handle: Any) -> Any:
    """What identifies the actor (and chained instance) a handle reaches: two handles of one
    actor compare equal, handles of a replaced actor (same name, new actor) do not."""
    from raystream.runtime.actors import MemberHandle  # (a plain class; Ray is not started)

    if isinstance(handle, MemberHandle):  # a chained instance's: its chain's actor, its id
        return ("member", handle_key(handle.actor), tuple(handle.iid))
    actor_id = getattr(handle, "_actor_id", None)  # a Ray actor handle
    if actor_id is not None:
        return ("actor", actor_id.hex() if hasattr(actor_id, "hex") else str(actor_id))
    return ("object", id(handle))


def same(a: Any, b: Any) -> bool:
    """Structural equality of specs: dataclasses field by field, containers item by item,
    numpy arrays by value, anything else by identity or ``==`` (False if ``==`` cannot say).

    >>> same({"a": (1, np.arange(3))}, {"a": (1, np.arange(3))})
    True
    >>> same([np.arange(3)], [np.arange(4)])
    False
    """
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return all(
            same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (set, frozenset)):
        return a == b
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))
    try:
        eq = a == b
    except Exception:  # noqa: BLE001 - an object that cannot be compared: not the same
        return False
    return eq if isinstance(eq, bool) else False


def mismatch(
    prep: Preparation,
    handle: Any,
    actor_spec: Any,
    receivers: dict[tuple[str, int], dict[tuple[str, int], Any]],
) -> str | None:
    """Why ``prep`` is not what a scale-out would send the standby ``handle`` now (None: it
    is, and the scale-out skips configure and connect)."""
    if prep.handle is not handle:
        return "another actor"
    if not same(prep.actor_spec, actor_spec):
        return "spec changed"
    if prep.receivers.keys() != receivers.keys():
        return "other instances"
    for iid, now in receivers.items():
        then = prep.receivers[iid]
        if then.keys() != now.keys():
            return f"receivers of {iid} changed"
        if any(handle_key(then[r]) != handle_key(now[r]) for r in now):
            return f"a receiver of {iid} was replaced"
    return None


def prepared_parallelism(slots: list[tuple[str, int]], step: str, parallelism: int) -> int:
    """The parallelism a standby of ``step`` is prepared for: the step with every standby of
    it taken (a scale-out takes the next indexes; the standbys hold them).

    >>> prepared_parallelism([("count", 1), ("count", 2), ("other", 1)], "count", 1)
    3
    """
    mine = [i for s, i in slots if s == step and i >= parallelism]
    return max(mine) + 1 if mine else parallelism + 1
