"""Per-step actor options and the node chosen for each instance (pure logic, no Ray)."""

from __future__ import annotations

from collections import Counter

import pytest

import raystream as rs
from raystream.errors import ConfigError, DataflowDefinitionError
from raystream.placement import (
    ActorOptions,
    Node,
    PlacementError,
    check_satisfiable,
    choose_nodes,
)


def _nodes(*cpus: float, gpu_on: int | None = None) -> list[Node]:
    out = []
    for i, c in enumerate(cpus):
        total = {"CPU": float(c), "memory": 8e9, f"node:10.0.0.{i}": 1.0}
        if gpu_on == i:
            total["GPU"] = 1.0
        out.append(Node(f"n{i}" + "0" * 8, f"10.0.0.{i}", total, dict(total)))
    return out


def test_default_spreads_a_steps_instances_over_every_node() -> None:
    picks = choose_nodes("count", ActorOptions(), _nodes(2, 2, 2), 6)
    assert Counter(picks) == Counter({n.node_id: 2 for n in _nodes(2, 2, 2)})
    # round robin in the order of the emptiest node: no two neighbours on one node
    assert all(a != b for a, b in zip(picks, picks[1:], strict=False))


def test_a_scale_out_goes_where_the_step_has_fewest_instances() -> None:
    nodes = _nodes(2, 2, 2)
    placed = {nodes[0].node_id: 2, nodes[1].node_id: 1}
    assert choose_nodes("count", ActorOptions(), nodes, 1, step_placed=placed) == [nodes[2].node_id]
    # ties on the step are broken by the job's instances per node
    job = {nodes[1].node_id: 5, nodes[2].node_id: 1}
    got = choose_nodes("count", ActorOptions(), nodes, 1, step_placed={}, job_placed=job)
    assert got == [nodes[0].node_id]


def test_cpu_demand_only_goes_where_there_is_room() -> None:
    nodes = [
        Node("a" * 8, "10.0.0.1", {"CPU": 4.0}, {"CPU": 0.5}),
        Node("b" * 8, "10.0.0.2", {"CPU": 4.0}, {"CPU": 2.0}),
    ]
    opts = ActorOptions.of("count", num_cpus=1)
    assert choose_nodes("count", opts, nodes, 2) == ["b" * 8, "b" * 8]
    with pytest.raises(PlacementError, match=r"no node has room .*'count'.*CPU 1"):
        choose_nodes("count", opts, nodes, 3)


def test_a_resource_no_node_has_is_refused_naming_it() -> None:
    opts = ActorOptions.of("infer", num_gpus=1, resources={"ssd": 1})
    with pytest.raises(PlacementError, match=r"'infer'.*no node of the cluster has GPU 1, ssd 1"):
        check_satisfiable("infer", opts, _nodes(2, 2))
    # a node with a GPU but no ssd: only ssd is missing
    with pytest.raises(PlacementError, match=r"has ssd 1 \("):
        check_satisfiable("infer", opts, _nodes(2, 2, gpu_on=1))
    check_satisfiable("infer", ActorOptions.of("infer", num_gpus=1), _nodes(2, 2, gpu_on=1))


def test_a_user_strategy_is_left_to_ray() -> None:
    opts = ActorOptions.of("count", scheduling_strategy="SPREAD", num_cpus=64)
    assert choose_nodes("count", opts, _nodes(2), 2) == [None, None]
    assert opts.ray_options("n0")["scheduling_strategy"] == "SPREAD"


def test_ray_options_pin_to_the_node_and_carry_the_demand() -> None:
    opts = ActorOptions.of("count", num_cpus=0.5, memory=2**30, resources={"ssd": 1})
    node = "ab" * 28  # a node id: 28 bytes in hex
    got = opts.ray_options(node)
    assert got["num_cpus"] == 0.5 and got["memory"] == 2**30 and got["resources"] == {"ssd": 1.0}
    strategy = got["scheduling_strategy"]
    assert type(strategy).__name__ == "NodeAffinitySchedulingStrategy"
    assert strategy.node_id == node and not strategy.soft
    assert ActorOptions().is_default and not opts.is_default
    assert ActorOptions().ray_options(None) == {"num_cpus": 0.0}


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"num_cpu": 1}, r"unknown actor option\(s\) \['num_cpu'\]"),
        ({"num_cpus": -1}, r"num_cpus must be a number >= 0, got -1"),
        ({"memory": "1G"}, r"memory must be a number >= 0, got '1G'"),
        ({"resources": {"CPU": 1}}, r"'CPU' is not a custom resource"),
        ({"resources": {"ssd": -2}}, r"resources\['ssd'\] must be a number >= 0"),
        ({"resources": ["ssd"]}, r"resources must be a dict"),
        ({"scheduling_strategy": "PACK"}, r"scheduling_strategy must be 'DEFAULT', 'SPREAD'"),
        (
            {"runtime_env": {"env": {"A": "1"}, "pipp": []}},
            r"unknown runtime_env key\(s\) \['env', 'pipp'\]",
        ),
        ({"runtime_env": ["pip"]}, r"runtime_env must be a dict as Ray takes it"),
        ({"runtime_env": {"env_vars": {"A": 1}}}, r"env_vars'\] must be a dict of str -> str"),
    ],
)
def test_bad_options_are_refused_when_the_flow_is_defined(options: dict, match: str) -> None:
    flow = rs.Dataflow("opts")
    events = flow.source(rs.sources.generator(events=10, keys=3))
    with pytest.raises(ConfigError, match=match):
        events.options(**options)


def test_options_reach_the_step_from_a_stream_or_by_name() -> None:
    flow = rs.Dataflow("opts")

    @rs.keyed_batches(state=rs.ValueState(int, default=0))
    def count(batch, state):  # pragma: no cover - never run here
        return batch

    events = flow.source(rs.sources.generator(events=10, keys=3))
    events.key_by("key").apply(count).options(num_cpus=1).sink(rs.sinks.collect(), name="out")
    flow.options("out", resources={"disk": 1})
    assert flow.steps["count"].actor == ActorOptions(num_cpus=1.0)
    assert flow.steps["out"].actor.demand == {"disk": 1.0}
    assert flow.steps["source"].actor.is_default
    with pytest.raises(DataflowDefinitionError, match=r"no step 'nope'"):
        flow.options("nope", num_cpus=1)
    both = events.union(flow.source(rs.sources.generator(events=1, keys=1), name="b"))
    with pytest.raises(DataflowDefinitionError, match=r"not the output of one step"):
        both.options(num_cpus=1)


def test_runtime_env_goes_to_every_actor_of_the_step_and_not_to_standbys() -> None:
    env = {"env_vars": {"RS_TAG": "v2"}, "pip": ["six"]}
    flow = rs.Dataflow("opts")
    flow.source(rs.sources.generator(events=10, keys=3)).options(runtime_env=env)
    opts = flow.steps["source"].actor
    env["env_vars"]["RS_TAG"] = "changed later"  # the step keeps its own copy
    got = opts.ray_options("ab" * 28)
    assert got["runtime_env"] == {"env_vars": {"RS_TAG": "v2"}, "pip": ["six"]}
    got["runtime_env"]["pip"].append("x")  # each actor gets a copy too
    assert opts.ray_options(None)["runtime_env"]["pip"] == ["six"]
    assert not opts.is_default  # a warm standby lacks the environment
    assert ActorOptions.of("s", runtime_env={}).is_default
    assert "runtime_env" not in ActorOptions.of("s", runtime_env=None).ray_options(None)
    hash(opts)  # specs stay hashable


def test_standby_slots_name_the_next_instances_of_each_step_in_turn() -> None:
    """Against the slots enumerated here: indexes from each step's parallelism up, steps in
    turn, skipping held names, at most ``count``."""
    from raystream.placement import standby_slots

    parallelism = {"a": 2, "b": 3}
    held = {("a", 2), ("b", 0), ("b", 4)}  # a standby, a live instance, a retiring one
    got = standby_slots(parallelism, held, 4)
    expected = [
        (s, p + k) for k in range(10) for s, p in parallelism.items() if (s, p + k) not in held
    ][:4]
    assert got == expected == [("b", 3), ("a", 3), ("a", 4), ("b", 5)]
    assert standby_slots(parallelism, held, 0) == []
    assert standby_slots({}, held, 2) == []
    assert len(set(standby_slots({"a": 1}, [], 5))) == 5
