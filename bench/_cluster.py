"""A simulated multi-node Ray cluster for benchmarks (``ray.cluster_utils.Cluster``): N raylets on
this machine, each its own node with its own object store, so state that moves between instances
on different nodes crosses node boundaries as it would between machines (over loopback here)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["instance_nodes", "simulated_cluster"]


@contextmanager
def simulated_cluster(nodes: int, cpus_per_node: float = 1.0) -> Iterator[list[str]]:
    """Start ``nodes`` Ray nodes (a head and ``nodes - 1`` workers, ``cpus_per_node`` logical
    CPUs each), connect this driver to them and yield the node ids; stop everything after."""
    import ray
    from ray.cluster_utils import Cluster

    if nodes < 2:
        msg = f"a simulated cluster needs at least 2 nodes, got {nodes}"
        raise ValueError(msg)
    if ray.is_initialized():
        msg = "Ray is already initialised in this process; a simulated cluster needs its own"
        raise RuntimeError(msg)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": cpus_per_node, "include_dashboard": False},
    )
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=cpus_per_node)
        ray.init(
            address=cluster.address,
            namespace="raystream",
            log_to_driver=True,
            logging_level="warning",
        )
        cluster.wait_for_nodes()
        yield [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


def instance_nodes(status: dict[str, Any], step: str) -> dict[int, str]:
    """The node id each live instance of ``step`` runs on, from ``job.status()``."""
    return {
        int(m["index"]): m["node_id"]
        for m in status["instances"]
        if m.get("step") == step and not m.get("finished")
    }
