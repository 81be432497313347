"""Which instance actors a recovery keeps (their processes live on) and which it replaces.

A recovery rolls every instance back to the latest checkpoint (a global rollback); only the
processes of the instances that can take the new attempt are kept, as Flink redeploys a
failover's tasks into the TaskManagers' existing slots. An actor is kept when

- the job's ``recovery_keeps_actors`` is on,
- it runs under its usual name (an actor with a neutral name, from a change spare or a move,
  is replaced: the new attempt's instance takes the usual name),
- none of its instances died or hung (a heartbeat-killed actor is dead),
- it is not on a node found lost,
- the new plan runs the same set of instances in it (operator chains are kept across
  recoveries; an actor of a chain the new plan cuts differently is replaced).

The caller then asks each kept actor to reset (``InstanceEndpoint.reset``); one that does not
answer in time is replaced too. This module is the pure part of that choice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from raystream.runtime.messages import ChannelId

__all__ = ["ActorChoice", "actor_groups", "choose_kept_actors"]


@dataclass(frozen=True)
class ActorChoice:
    """Actors by the instance id they are named for (a chain's head): kept or replaced."""

    kept: tuple[ChannelId, ...]
    replaced: tuple[ChannelId, ...]
    why: dict[ChannelId, str]  # replaced actor -> why it is not kept


def actor_groups(
    instances: Iterable[ChannelId], chains: Mapping[ChannelId, Iterable[ChannelId]]
) -> dict[ChannelId, frozenset[ChannelId]]:
    """Each actor (by its head's id) with the instances it runs: a chain's head runs its
    chain's instances; an instance in no chain runs alone."""
    members = {m for head, ids in chains.items() for m in list(ids)[1:]}
    out: dict[ChannelId, frozenset[ChannelId]] = {}
    for iid in instances:
        if iid in members:
            continue
        ids = chains.get(iid)
        out[iid] = frozenset(ids) if ids else frozenset({iid})
    return out


def choose_kept_actors(
    old_actors: Mapping[ChannelId, frozenset[ChannelId]],
    new_actors: Mapping[ChannelId, frozenset[ChannelId]],
    *,
    dead: Iterable[ChannelId] = (),
    nodes: Mapping[ChannelId, str | None] | None = None,
    lost_nodes: Iterable[str] = (),
    neutral: Iterable[ChannelId] = (),
    enabled: bool = True,
) -> ActorChoice:
    """``old_actors``/``new_actors``: the failed attempt's actors and the new plan's (see
    :func:`actor_groups`); ``dead``: instances whose actor died or was killed (hung);
    ``nodes``: the node each old actor ran on; ``neutral``: actors under neutral names."""
    dead_ids, lost, neutral_ids = set(dead), set(lost_nodes), set(neutral)
    nodes = nodes or {}
    kept: list[ChannelId] = []
    why: dict[ChannelId, str] = {}
    for head, ids in old_actors.items():
        if not enabled:
            why[head] = "recovery_keeps_actors is off"
        elif head in neutral_ids:
            why[head] = "runs under a neutral name"
        elif ids & dead_ids:
            why[head] = "died"
        elif nodes.get(head) is not None and nodes.get(head) in lost:
            why[head] = "its node was lost"
        elif new_actors.get(head) != ids:
            why[head] = "not in the new plan" if head not in new_actors else "its chain changed"
        else:
            kept.append(head)
    replaced = tuple(h for h in old_actors if h in why)
    return ActorChoice(tuple(kept), replaced, why)
