"""What a recovery redeploys is the graph as it runs (no Ray: the controller's plain class).

A change that a failure interrupts may have left an entry for a step the graph never took (an
insert whose barrier did not pass every instance had already set the new step's parallelism),
or the user's start-time parallelism may name a step removed since. The recovery must plan the
graph as it is, not refuse it ("parallelism given for unknown step(s)") on every attempt until
the restart strategy gives up and the job fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

import raystream as rs
from raystream.controller import Controller
from raystream.keys import RoutingTable
from raystream.runtime.instance import RuntimeConfig
from raystream.step_changes import graph_with_step, graph_without_step, inserted_step


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def count(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    new = state.get(batch.keys) + batch.counts
    state.put(batch.keys, new)
    return batch.output({"count": new})


@rs.map_batches
def hop(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch


def _controller(tmp: Path, parallelism: dict[str, int], with_hop: bool = False) -> Controller:
    flow = rs.Dataflow("recovery-graph", num_key_groups=16, sub_groups=4)
    stream = flow.source(rs.sources.generator(events=100, keys=10))
    if with_hop:
        stream = stream.apply(hop, name="hop")
    stream.key_by("key").apply(count, name="count").sink(rs.sinks.collect(), name="out")
    config = RuntimeConfig(checkpoint_interval_s=1.0, checkpoint_dir=str(tmp / "chk"))
    c = Controller(flow, parallelism, config, str(tmp / "state"))
    c._replan(None, str(tmp / "attempt-0"), fresh=True)
    return c


def test_a_recovery_plans_without_a_step_an_interrupted_insert_never_added(tmp_path: Path) -> None:
    c = _controller(tmp_path, {"count": 2})
    # what an insert sets before its barrier goes out (raystream.rewiring), then the failure
    c.parallelism["hop"] = 1
    c.routing["hop"] = RoutingTable.uniform(16, 1)
    c.state = "recovering"
    c._replan(None, str(tmp_path / "attempt-1"))
    assert c.parallelism == {"source": 1, "count": 2, "out": 1}
    assert sorted(c.plan.instances) == [("count", 0), ("count", 1), ("out", 0), ("source", 0)]
    assert set(c.routing) == {"count"}


def test_a_recovery_plans_without_a_removed_step_the_start_named(tmp_path: Path) -> None:
    c = _controller(tmp_path, {"count": 3, "hop": 2}, with_hop=True)
    assert c.parallelism["hop"] == 2
    # what a remove of "hop" leaves (raystream.rewiring): the graph without it
    for steps in (c.plan.steps, c.flow.steps):
        changed = graph_without_step(steps, "hop")
        steps.clear()
        steps.update(changed)
    c.parallelism.pop("hop")
    c.state = "recovering"
    c._replan(None, str(tmp_path / "attempt-1"))
    assert c.parallelism == {"source": 1, "count": 3, "out": 1}


def test_a_step_inserted_live_stays_in_its_own_actors_when_a_recovery_plans_anew(
    tmp_path: Path,
) -> None:
    """Inserted, ``hop`` runs in its own actor; a recovery plans the graph anew, and with the
    source (parallelism 1, a forward edge) it would chain ``hop`` into the source's actor: then
    ``job.remove("hop")`` is refused ("it runs chained in one actor with ['source']")."""
    c = _controller(tmp_path, {"count": 2})
    new = inserted_step(hop, "hop", "source", 1)
    for steps in (c.plan.steps, c.flow.steps):
        changed = graph_with_step(steps, new, "count")
        steps.clear()
        steps.update(changed)
    c.parallelism["hop"] = 1
    c.state = "recovering"
    c._replan(None, str(tmp_path / "attempt-1"))
    assert ("hop", 0) in c.plan.instances
    assert c.chain_of("hop") == [] and c.chain_of("source") == [], c.plan.chains


def test_a_recovery_keeps_the_chains_the_job_runs_with(tmp_path: Path) -> None:
    """``count`` at 2 and its sink at 1 run in their own actors; a live rescale of ``count`` to 1
    makes their parallelism equal. A recovery that planned chains anew would put the sink into
    count's actor, and from then on ``job.move("count", 0, ...)`` is refused (the sink runs
    chained in its actors). A job that started chained stays chained."""
    c = _controller(tmp_path, {"count": 2})
    assert c.chain_of("count") == [] and c.plan.chains == {}
    c.routing["count"] = RoutingTable.uniform(16, 1)  # what the rescale to 1 left
    c.parallelism["count"] = 1
    c.state = "recovering"
    c._replan(None, str(tmp_path / "attempt-1"))
    assert c.parallelism["count"] == 1 and c.parallelism["out"] == 1
    assert c.plan.chains == {} and c.following == {}, c.plan.chains
    assert c.plan.instances[("count", 0)].outputs[0].partitioning != "local"

    chained = _controller(tmp_path / "chained", {"count": 1})
    assert chained.chain_of("count") == ["count", "out"]
    chained.state = "recovering"
    chained._replan(None, str(tmp_path / "chained" / "attempt-1"))
    assert chained.chain_of("count") == ["count", "out"]
    assert chained.following == {"out": "count"}
