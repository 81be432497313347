"""Operator chaining: which steps run together in one actor. No Ray here.

Two steps chain (as Flink chains operators) when records go from one to the other over a
forward edge: the upstream step is a source, a stateless step or a keyed step, the downstream
step a stateless step or a sink, both have the same parallelism and the same actor options, the
downstream step reads only the main output of that one step, and the upstream step feeds no
other step. A chain is then one actor per index: its head reads the inputs (or the source),
every step after it gets the batches its predecessor emits by a direct call (the same Arrow
batch, no copy, no serialisation), and the tail sends to the next actors; so the key
partitioning before a keyed step is computed by the chain that ends there. A keyed step is never
in the middle or at the end of a chain: its input is a hash edge.

A keyed step heads a chain with the stateless steps after it (``map``, ``filter``, ``flat_map``,
``map_batches``) and the sink after those, as far as each edge is forward. As in Flink, where a
chain has one parallelism, those steps then follow the keyed step's parallelism through its
rescales, restores and recoveries (:func:`steps_following`): a scale-out starts new chain
actors (their sinks open new writers, their tails send to the next steps, which take them as new
inputs), a scale-in ends the retired instances' followers as at the end of input (a sink
pre-commits, published by the checkpoint that records it; a tail ends its outputs).

Parallelism of a follower (:func:`follower_parallelism`): a stateless step given no parallelism
(neither on the step nor in ``parallelism={...}``) that would chain after a keyed step, or after
such a follower, takes that step's parallelism, so ``.apply(count, parallelism=2).map(fmt)``
chains ``fmt`` to ``count``; where it would not chain (chaining off, ``chain=False``, other actor
options, a fan-out) it keeps the default 1, as before (an unchained keyed -> stateless edge is
a rebalance, which would mix a key's records across instances). A sink's default parallelism
stays 1, so a job that does not ask keeps its one sink instance and its output as before; give
the sink the keyed step's parallelism to chain it (``.sink(out, parallelism=2)`` or
``parallelism={"out": 2}``).

Chaining is on by default; ``flow.options(step, chain=False)`` (or ``stream.options(chain=False)``)
keeps a step out of every chain, ``rs.run(..., chaining=False)`` turns it off for a job::

    flow.source(src).map(parse).filter(valid).key_by("k").apply(count).sink(out)
    # chains at equal parallelism: source -> parse -> valid; count -> out (both 1)
    ... .apply(count, parallelism=2).map(fmt).sink(out, parallelism=2)
    # ... and count -> fmt -> out (one actor per index of count; fmt and out follow its rescales)
"""

from __future__ import annotations

from dataclasses import replace

from raystream.dataflow import Step
from raystream.runtime.instance import InstanceSpec, OutputSpec
from raystream.runtime.messages import ChannelId

Edges = frozenset[tuple[str, str]]  # (upstream step, downstream step) edges

__all__ = [
    "chain_instances",
    "follow_keyed",
    "follower_parallelism",
    "not_chained_because",
    "plan_chains",
    "steps_following",
]

_STATELESS = ("map", "filter", "flat_map", "map_batches")


def not_chained_because(up: Step, down: Step, steps: dict[str, Step]) -> str | None:
    """Why ``down`` does not run in the actor of ``up`` (None: it does). ``steps`` is the
    whole graph with parallelism filled in (:meth:`raystream.Dataflow.with_parallelism`)."""
    if down.kind not in (*_STATELESS, "sink"):
        return f"{down.name!r} is a {down.kind} step (its input is a hash edge)"
    if up.kind not in (*_STATELESS, "source") and not up.is_keyed:
        return f"{up.name!r} is a {up.kind} step: nothing chains after it"
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


def plan_chains(
    steps: dict[str, Step], *, enabled: bool = True, allowed: Edges | None = None
) -> list[tuple[str, ...]]:
    """Every chain of two or more steps, head first, in the order of ``steps`` (which lists
    each step after its upstream steps). ``enabled=False``: none. ``allowed``: only these
    (upstream, downstream) edges may chain (a recovery keeps the chains the job ran with)."""
    if not enabled:
        return []
    chain_of: dict[str, list[str]] = {}
    chains: list[list[str]] = []
    for name, step in steps.items():
        if len(step.upstream) == 1 and step.upstream[0] in steps:
            up = steps[step.upstream[0]]
            if (allowed is None or (up.name, name) in allowed) and not_chained_because(
                up, step, steps
            ) is None:
                chain = chain_of[up.name]
                chain.append(name)
                chain_of[name] = chain
                continue
        chain_of[name] = [name]
        chains.append(chain_of[name])
    return [tuple(c) for c in chains if len(c) > 1]


def chain_edges(chains: dict[ChannelId, tuple[ChannelId, ...]]) -> Edges:
    """The (upstream, downstream) step edges inside the chains of a plan (head id -> ids)."""
    return frozenset(
        (a[0], b[0]) for ids in chains.values() for a, b in zip(ids, ids[1:], strict=False)
    )


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


def steps_following(
    steps: dict[str, Step], *, enabled: bool = True, allowed: Edges | None = None
) -> dict[str, str]:
    """The steps chained after a keyed step (follower -> keyed step), in chain order: their
    parallelism is the keyed step's from then on (it changes with each rescale, restore or
    recovery). ``allowed``: as for :func:`plan_chains`."""
    return {
        member: c[0]
        for c in plan_chains(steps, enabled=enabled, allowed=allowed)
        if steps[c[0]].is_keyed
        for member in c[1:]
    }


def follower_parallelism(
    flow_steps: dict[str, Step], parallelism: dict[str, int] | None, *, enabled: bool = True
) -> dict[str, int]:
    """``parallelism`` (the user's, by step) plus the parallelism of every stateless step given
    none that chains after a keyed step (or after such a follower) at that step's parallelism.
    ``flow_steps``: the dataflow's steps as defined (``parallelism`` None where not given),
    upstream steps first. Other steps keep their defaults (:meth:`Dataflow.with_parallelism`)."""
    given = dict(parallelism or {})
    if not enabled:
        return given
    steps = {
        n: replace(s, parallelism=given.get(n, s.parallelism or 1)) for n, s in flow_steps.items()
    }
    followers: set[str] = set()
    for name, step in flow_steps.items():
        if len(step.upstream) != 1 or step.upstream[0] not in steps:
            continue
        up = steps[step.upstream[0]]
        if not (up.is_keyed or up.name in followers):
            continue
        if step.kind in _STATELESS and step.parallelism is None and name not in given:
            trial = replace(steps[name], parallelism=up.parallelism)
            if not_chained_because(up, trial, {**steps, name: trial}) is None:
                steps[name] = trial
                given[name] = up.parallelism or 1
        if not_chained_because(up, steps[name], steps) is None:
            followers.add(name)
    return given


def follow_keyed(parallelism: dict[str, int], following: dict[str, str]) -> dict[str, int]:
    """``parallelism`` with every follower at its keyed step's parallelism (when given)."""
    out = dict(parallelism)
    for step, keyed in following.items():
        if keyed in out:
            out[step] = out[keyed]
    return out
