"""Logical graph -> physical graph: instances, channels, partitioning, routing tables. No Ray."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from raystream.chaining import (
    chain_instances,
    Edges,
    follower_parallelism,
    plan_chains,
    steps_following,
)
from raystream.dataflow import Dataflow, Step
from raystream.keys import RoutingTable
from raystream.runtime.instance import InstanceSpec, OutputSpec, RuntimeConfig
from raystream.runtime.messages import ChannelId

__all__ = ["PhysicalPlan", "physical_plan"]


@dataclass(frozen=True)
class PhysicalPlan:
    job: str
    steps: dict[str, Step]
    instances: dict[ChannelId, InstanceSpec]
    routing: dict[str, RoutingTable]  # keyed step -> its routing table
    # operator chains: head instance -> the instances in its actor, head first (2 or more)
    chains: dict[ChannelId, tuple[ChannelId, ...]] = field(default_factory=dict)

    def actor_of(self, iid: ChannelId) -> ChannelId:
        """The instance whose actor runs ``iid`` (its chain's head; itself if not chained)."""
        for head, ids in self.chains.items():
            if iid in ids:
                return head
        return iid

    def of_step(self, step: str) -> list[InstanceSpec]:
        return sorted(
            (s for s in self.instances.values() if s.step.name == step), key=lambda s: s.index
        )

    @property
    def sources(self) -> list[ChannelId]:
        return [i for i, s in self.instances.items() if s.step.kind == "source"]

    @property
    def sinks(self) -> list[ChannelId]:
        return [i for i, s in self.instances.items() if s.step.kind == "sink"]


def _partitioning(up: Step, down: Step, following: dict[str, str] | None = None) -> str:
    if down.is_keyed:
        return "key_group"
    if up.parallelism == down.parallelism and not up.is_keyed and up.name not in (following or {}):
        # a keyed step's parallelism changes on rescale, and so does that of the steps chained
        # after it (raystream.chaining): their outputs never forward 1:1 (inside a chain,
        # chain_instances makes each edge local)
        return "forward"
    return "rebalance"


def physical_plan(
    flow: Dataflow,
    parallelism: dict[str, int] | None,
    config: RuntimeConfig,
    origin_ns: int,
    state_dir: str | Path,
    routing: dict[str, RoutingTable] | None = None,
    chained: Edges | None = None,
) -> PhysicalPlan:
    """``routing``: tables to start keyed steps with instead of uniform ones (a restore from a
    checkpoint); their parallelism must be the step's. ``chained``: only these step edges may
    chain (a recovery keeps the job's chains: a live rescale may have made neighbours' parallelism
    equal, and chaining them then would change the actors a later change addresses)."""
    steps = flow.with_parallelism(
        follower_parallelism(flow.steps, parallelism, enabled=config.chaining)
    )
    following = steps_following(steps, enabled=config.chaining, allowed=chained)
    ks = flow.key_space
    given = routing or {}
    routing = {
        name: given.get(name) or RoutingTable.uniform(ks.num_key_groups, s.parallelism or 1)
        for name, s in steps.items()
        if s.is_keyed
    }
    for name, table in routing.items():
        assert table.parallelism == steps[name].parallelism, (name, table, steps[name])
    downstream: dict[str, list[Step]] = {n: [] for n in steps}
    for s in steps.values():
        for up in s.upstream:
            downstream[up].append(s)
    instances: dict[ChannelId, InstanceSpec] = {}
    for name, step in steps.items():
        p = step.parallelism or 1
        outputs = tuple(
            OutputSpec(
                step=d.name,
                parallelism=d.parallelism or 1,
                partitioning=_partitioning(step, d, following),
                key=d.key_for(name),
                port=d.port_for(name),
                routing=routing.get(d.name),
            )
            for d in downstream[name]
        )
        inputs: list[ChannelId] = []
        for up in step.upstream:
            up_step = steps[up]
            part = _partitioning(up_step, step, following)
            for j in range(up_step.parallelism or 1):
                # forward: only the same index sends; rebalance / key_group: every sender
                if part == "forward" and j >= p:
                    continue
                inputs.append((up, j))
        for i in range(p):
            my_inputs = tuple(
                ch
                for ch in inputs
                if _partitioning(steps[ch[0]], step, following) != "forward" or ch[1] == i
            )
            owned: tuple[int, ...] = ()
            state_path = None
            if step.is_keyed:
                owned = tuple(int(g) for g in routing[name].key_groups_of(i))
                state_path = str(Path(state_dir) / name / f"{i}")
            instances[(name, i)] = InstanceSpec(
                job=flow.name,
                step=step,
                index=i,
                key_space=ks,
                inputs=my_inputs,
                outputs=outputs,
                config=config,
                origin_ns=origin_ns,
                state_path=state_path,
                owned_key_groups=owned,
                source_parallelism=p if step.kind == "source" else 1,
            )
    chains_of_steps = plan_chains(steps, enabled=config.chaining, allowed=chained)
    instances, chains = chain_instances(instances, chains_of_steps)
    return PhysicalPlan(flow.name, steps, instances, routing, chains)
