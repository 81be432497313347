"""Operator chaining: which steps run together in one actor. No Ray here.

Two steps chain (as Flink chains operators) when records go from one to the other over a
forward edge: the upstream step is a source or a stateless step, the downstream step a stateless
step or a sink, both have the same parallelism and the same actor options, the downstream step
reads only the main output of that one step, and the upstream step feeds no other step. A chain
is then one actor per index: its head reads the inputs (or the source), every step after it
gets the batches its predecessor emits by a direct call (the same Arrow batch, no copy, no
serialisation), and the tail sends to the next actors; so the key partitioning before a keyed
step is computed by the chain that ends there. A keyed step is never in the middle or at the end
of a chain: its input is a hash edge.

Chaining is on by default; ``flow.options(step, chain=False)`` (or ``stream.options(chain=False)``)
keeps a step out of every chain, ``rs.run(..., chaining=False)`` turns it off for a job::

    flow.source(src).map(parse).filter(valid).key_by("k").apply(count).sink(out)
    # chains at equal parallelism: source -> parse -> valid; count and the sink run alone
"""

from __future__ import annotations

from dataclasses import replace

from raystream.dataflow import Step
from raystream.runtime.instance import InstanceSpec, OutputSpec
from raystream.runtime.messages import ChannelId

__all__ = ["chain_instances", "not_chained_because", "plan_chains"]

_STATELESS = ("map", "filter", "flat_map", "map_batches")


def not_chained_because(up: Step, down: Step, steps: dict[str, Step]) -> str | None:
    """Why ``down`` does not run in the actor of ``up`` (None: it does). ``steps`` is the
    whole graph with parallelism filled in (:meth:`raystream.Dataflow.with_parallelism`)."""
    if down.kind not in (*_STATELESS, "sink"):
        return f"{down.name!r} is a {down.kind} step (its input is a hash edge)"
    if up.kind not in (*_STATELESS, "source"):
        return f"{up.name!r} is a {up.kind} step (its output follows its rescales)"
    if down.upstream != (up.name,):
        return f"{down.name!r} reads several steps {list(down.upstream)}"
    if any(down.ports):
        return f"{down.name!r} reads a side output of {up.name!r}"
    consumers = [s.name for s in steps.values() if up.name in s.upstream]
    if consumers != [down.name]:
        return f"{up.name!r} feeds several steps {consumers}"
    if (up.parallelism or 1) != (down.parallelism or 1):
        return (
            f"parallelism differs ({up.name!r}: {up.parallelism or 1}, "
            f"{down.name!r}: {down.parallelism or 1})"
        )
    if not up.chain or not down.chain:
        off = up.name if not up.chain else down.name
        return f"chaining is off for {off!r} (chain=False)"
    if up.actor != down.actor:
        return f"{up.name!r} and {down.name!r} have different actor options"
    return None


def plan_chains(steps: dict[str, Step], *, enabled: bool = True) -> list[tuple[str, ...]]:
    """Every chain of two or more steps, head first, in the order of ``steps`` (which lists
    each step after its upstream steps). ``enabled=False``: none."""
    if not enabled:
        return []
    chain_of: dict[str, list[str]] = {}
    chains: list[list[str]] = []
    for name, step in steps.items():
        if len(step.upstream) == 1 and step.upstream[0] in steps:
            up = steps[step.upstream[0]]
            if not_chained_because(up, step, steps) is None:
                chain = chain_of[up.name]
                chain.append(name)
                chain_of[name] = chain
                continue
        chain_of[name] = [name]
        chains.append(chain_of[name])
    return [tuple(c) for c in chains if len(c) > 1]


def chain_instances(
    instances: dict[ChannelId, InstanceSpec], chains: list[tuple[str, ...]]
) -> tuple[dict[ChannelId, InstanceSpec], dict[ChannelId, tuple[ChannelId, ...]]]:
    """The instance specs with every edge inside a chain made ``local`` (one receiver: the next
    step's instance of the same index, in the same actor), and the chained instances per
    actor: head id -> the ids of the chain at that index, head first."""
    specs = dict(instances)
    groups: dict[ChannelId, tuple[ChannelId, ...]] = {}
    for chain in chains:
        indexes = sorted(i for s, i in instances if s == chain[0])
        for i in indexes:
            ids = tuple((s, i) for s in chain)
            for here, there in zip(ids, ids[1:], strict=False):
                out = OutputSpec(
                    step=there[0], parallelism=1, partitioning="local", receivers=(there,)
                )
                specs[here] = replace(specs[here], outputs=(out,))
                specs[there] = replace(specs[there], inputs=(here,))
            groups[ids[0]] = ids
    return specs, groups
