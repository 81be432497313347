"""A key-count job on a simulated 3-node Ray cluster (``ray.cluster_utils.Cluster``).

Run as a script by ``test_cluster.py`` (its own Ray, apart from the test session's): prints one
JSON line with where the instances ran after each step, the rescale stats, and whether the final
counts equal the oracle (``collections.Counter`` over the generator's own rows).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))  # the repository: bench's cluster helpers

import _rescale_helpers as h  # noqa: E402
import ray  # noqa: E402
from ray import cloudpickle  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import raystream as rs  # noqa: E402
from bench._cluster import instance_nodes  # noqa: E402
from raystream.runtime.actors import NAMESPACE  # noqa: E402

cloudpickle.register_pickle_by_value(h)

# every strategy moves state once, between instances spread over the three nodes
SEQUENCE = [
    (4, "meces"),
    (2, "stop_restart"),
    (5, "all_at_once"),
    (3, "fluid"),
    (6, "batched"),
    (3, "lazy"),
]


def _where(status: dict[str, Any]) -> dict[str, str]:
    """The node of each live instance of the rescaled step, by index (a JSON object's keys)."""
    return {str(i): node for i, node in instance_nodes(status, h.STEP).items()}


def _named(actor: str) -> bool:
    """An actor of that name is alive in raystream's namespace (as the dashboard lists it)."""
    try:
        ray.get_actor(actor, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def main() -> None:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False},
    )
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        cluster.wait_for_nodes()
        out: dict[str, Any] = {"nodes": [n["NodeID"] for n in ray.nodes() if n["Alive"]]}

        # a step that asks for more than any node has is refused before anything starts
        flow = h.keycount_flow("cluster-too-big", h.generator("int", False, seed=1))
        flow.options(h.STEP, num_cpus=2)
        try:
            rs.start(flow, parallelism={h.STEP: 2})
            out["refused"] = None
        except rs.PlacementError as e:
            out["refused"] = str(e)

        gen = h.generator("str", True, seed=3)
        with h.live_job("cluster-keycount", gen, 3) as live:
            out["placed"] = [_where(live.job.status())]
            live.wait_flowing()
            out["stats"] = []
            for parallelism, strategy in SEQUENCE:
                out["stats"].append(live.rescale(parallelism, strategy))
                out["placed"].append(_where(live.job.status()))
            # instance 0 moves to another node while the stream runs (its state goes across)
            before = live.job.status()
            source_node = _where(before)["0"]
            target = next(n for n in out["nodes"] if n != source_node)
            moved = live.job.move(h.STEP, 0, target)
            out["move"] = {
                "from": source_node,
                "to": target,
                "node_id": moved["node_id"],
                "instance": moved["instance"],
                "key_groups": moved["moved"]["key_groups"],
                "duration_s": moved["duration_s"],
                "actors": moved["actors"],
                "graph_version_before": before["graph_version"],
                "placed": _where(live.job.status()),
                "named": [_named(a) for a in moved["actors"]],
                "transfer": moved.get("transfer"),
                "files": moved.get("files"),
            }
            result, events = live.finish()
        expected = h.prefix_counts(gen, events)
        h.assert_exact(result.table("out"), expected, events)  # raises: the script fails
        out["events"] = events
        out["keys"] = len(expected)
        out["records_in"] = sum(m["records_in"] for m in h.step_metrics(result.metrics))
        out["hot_share"] = max(expected.values()) / max(1, events)
        print(json.dumps(out, default=str))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
