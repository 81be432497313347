"""A key-count job on a simulated 3-node Ray cluster (``ray.cluster_utils.Cluster``).

Run as a script by ``test_cluster.py`` (its own Ray, apart from the test session's): prints one
JSON line (its last line starting with ``{``) with where the instances ran after each step, the rescale stats, and whether the final
counts equal the oracle (``collections.Counter`` over the generator's own rows).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))  # the repository: bench's cluster helpers

import _helpers as hh  # noqa: E402
import _rescale_helpers as h  # noqa: E402
import duckdb  # noqa: E402
import pyarrow as pa  # noqa: E402
import ray  # noqa: E402
from ray import cloudpickle  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import raystream as rs  # noqa: E402
from bench._cluster import instance_nodes  # noqa: E402
from raystream.runtime.actors import NAMESPACE  # noqa: E402

cloudpickle.register_pickle_by_value(h)
cloudpickle.register_pickle_by_value(hh)

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


def _output_check(out: Path, stream: pa.Table) -> dict[str, Any]:
    """The committed Parquet output against the generator's rows, by DuckDB: records published
    twice, never published, never sent, and counts that are not ``seq + 1`` (per key in order)."""
    con = duckdb.connect()
    con.register("stream", stream)
    con.execute(f"create view o as select * from read_parquet('{out}/*.parquet')")
    return {
        "rows": con.sql("select count(*) from o").fetchall()[0][0],
        "twice": con.sql(
            "select key, seq, count(*) c from o group by 1, 2 having c > 1 limit 5"
        ).fetchall(),
        "missing": con.sql(
            "select key, seq from stream anti join o using (key, seq) limit 5"
        ).fetchall(),
        "extra": con.sql(
            "select key, seq from o anti join stream using (key, seq) limit 5"
        ).fetchall(),
        "out_of_order": con.sql(
            "select key, seq, count from o where count != seq + 1 limit 5"
        ).fetchall(),
    }


def _left(job: str, timeout_s: float = 60.0) -> list[str]:
    """The job's named actors still alive (waits up to ``timeout_s`` for them to go)."""
    from ray.util import list_named_actors

    deadline = time.monotonic() + timeout_s
    while True:
        left = [
            a["name"]
            for a in list_named_actors(all_namespaces=True)
            if a["name"].startswith((f"raystream:{job}:", f"raystream-controller:{job}"))
        ]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def lose_a_node(cluster: Cluster) -> dict[str, Any]:
    """A checkpointed key count with an exactly-once Parquet sink, its count instances spread
    over the three nodes; a worker node that holds one of them is killed (its raylet and
    every process on it, as a machine that dies) while records flow. The job recovers on the two
    nodes left; the output is checked against the generator's rows."""
    began = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="rs-nodeloss-"))
    gate, out = str(tmp / "gate"), tmp / "out"
    gen = rs.sources.generator(
        events=h.RATE_EPS * 120, keys=2_000, zipf=1.1, seed=5, rate_eps=h.RATE_EPS
    )
    flow = rs.Dataflow("cluster-nodeloss", num_key_groups=h.NUM_KEY_GROUPS, sub_groups=8)
    (
        flow.source(h.UntilGate(gen, gate))
        .key_by("key")
        .apply(hh.running_count, name=h.STEP)
        .sink(rs.sinks.parquet(str(out)), name="out")
    )
    job = rs.start(
        flow,
        parallelism={h.STEP: 3},
        checkpoint_interval_s=0.5,
        checkpoint_dir=str(tmp / "chk"),  # a shared filesystem here: every node sees it
        state_dir=str(tmp / "state"),
        restart_delay_s=0.2,
        **h.RUNTIME,
    )
    report: dict[str, Any] = {"started_s": time.monotonic() - began}
    try:
        h.LiveJob(job, gate).wait_flowing(h.RATE_EPS // 4)
        hh.wait_checkpoints(job, 1)
        before = job.status()
        report["placed_before"] = _where(before)
        report["controller_node"] = ray.get_runtime_context().get_node_id()  # pinned here
        workers = {n.node_id: n for n in cluster.worker_nodes}  # not the head: the driver's
        lost = next(n for _, n in sorted(report["placed_before"].items()) if n in workers)
        victim = workers[lost]
        report["lost_node"] = lost
        report["lost_instances"] = sorted(
            f"{m['step']}/{m['index']}" for m in before["instances"] if m["node_id"] == lost
        )
        t0 = time.monotonic()
        report["lost_at_s"] = t0 - began
        cluster.remove_node(victim, allow_graceful=False)
        deadline = t0 + 60
        while True:
            status = ray.get(job.controller.describe.remote())
            if status["recoveries"] and status["state"] == "running":
                break
            assert status["state"] in ("running", "recovering"), status["state"]
            assert time.monotonic() < deadline, "no recovery within 60 s of the node loss"
            time.sleep(0.05)
        report["recovered_after_s"] = time.monotonic() - t0
        after = job.status()
        report["placed_after"] = _where(after)
        report["nodes_after"] = sorted({m["node_id"] for m in after["instances"]})
        h.LiveJob(job, gate).wait_flowing(after_records(after) + h.RATE_EPS // 4)
        Path(gate).touch()
        report["gate_at_s"] = time.monotonic() - began
        result = job.wait(120)
        report["finished_at_s"] = time.monotonic() - began
    except BaseException:
        job.cancel()
        raise
    report["state"] = result.state
    report["recoveries"] = [
        {
            k: r.get(k)
            for k in (
                "instance",
                "cause",
                "node",
                "lost_nodes",
                "warm_actors_lost",
                "downtime_s",
                "phases",
            )
        }
        for r in result.recoveries
    ]
    events = int(Path(gate + ".events").read_text())
    report["events"] = events
    report["output"] = _output_check(out, hh.generator_prefix(gen, events))
    report["left"] = _left(flow.name)
    report["elapsed_s"] = time.monotonic() - began
    return report


def after_records(status: dict[str, Any]) -> int:
    """Records the count step took so far in the running attempt."""
    return int(sum(m["records_in"] for m in status["instances"] if m.get("step") == h.STEP))


def main() -> None:
    began = time.monotonic()
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
        out["before_nodeloss_s"] = time.monotonic() - began
        out["nodeloss"] = lose_a_node(cluster)
        print(json.dumps(out, default=str))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
