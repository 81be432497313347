"""Run a whole dataflow in one asyncio loop, without Ray (for unit tests of operators).

Every instance is the real :class:`OperatorInstance` with its real channels, barriers,
watermarks and RocksDB state; only the transport differs (a direct call instead of a Ray actor
call; operator chains run as they do in an actor). No rescaling, no controller. Example::

    >>> import asyncio, tempfile, pyarrow as pa, raystream as rs
    >>> flow = rs.Dataflow("local-demo")
    >>> src = rs.sources.from_table(pa.table({"x": [1, 2]}))
    >>> flow.source(src).sink(rs.sinks.collect(), name="out")
    >>> out = asyncio.run(run_local(flow, state_dir=tempfile.mkdtemp()))
    >>> out["out"].column("x").to_pylist()
    [1, 2]
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from raystream.dataflow import Dataflow
from raystream.runtime.chain import Chain, ChainSpec
from raystream.runtime.instance import OperatorInstance, RuntimeConfig
from raystream.runtime.messages import ChannelId

__all__ = ["run_local"]


async def run_local(
    flow: Dataflow,
    parallelism: dict[str, int] | None = None,
    *,
    state_dir: str | Path,
    config: RuntimeConfig | None = None,
    timeout_s: float = 120.0,
) -> dict[str, pa.Table | None]:
    """Run ``flow`` to the end of its input; returns each sink step's rows (all instances)."""
    from raystream.plan import physical_plan

    plan = physical_plan(flow, parallelism, config or RuntimeConfig(), time.time_ns(), state_dir)
    chains = {
        head: Chain(ChainSpec(tuple(plan.instances[i] for i in ids)))
        for head, ids in plan.chains.items()
    }
    chained = {iid: inst for c in chains.values() for iid, inst in c.by_id().items()}
    instances = {
        iid: chained.get(iid) or OperatorInstance(spec) for iid, spec in plan.instances.items()
    }

    def sender(receiver: ChannelId, payload: tuple[ChannelId, int, Any]) -> Any:
        channel, seq, item = payload
        return asyncio.ensure_future(instances[receiver].push(channel, seq, item))

    failures: list[dict[str, Any]] = []
    failed = asyncio.Event()

    def report(event: str, info: dict[str, Any]) -> None:
        if event == "failed":
            failures.append(info)
            failed.set()

    for inst in instances.values():
        inst.connect(sender, report)
    runs = [
        asyncio.ensure_future(chains[iid].run() if iid in chains else inst.run())
        for iid, inst in instances.items()
        if iid in chains or iid not in chained
    ]
    watch = asyncio.ensure_future(failed.wait())
    await asyncio.wait(
        [asyncio.gather(*runs), watch], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
    )
    if not failures and not all(r.done() for r in runs):
        failures.append({"instance": "-", "error": f"no end within {timeout_s} s"})
    watch.cancel()
    if failures:
        for r in runs:
            r.cancel()
        from raystream.errors import JobFailedError

        first = failures[0]
        if first["instance"] == "-":
            msg = f"job {flow.name!r} failed: {first['error']}"
            raise JobFailedError(msg)
        step, index = first["instance"]
        raise JobFailedError.of_instance(
            flow.name,
            step,
            index,
            first["error"],
            context=first.get("context"),
            traceback=first.get("traceback"),
            where="the instance",
        ) from first.get("exception")
    await _commit_partitions(flow, instances)
    out: dict[str, pa.Table | None] = {}
    for iid, inst in sorted(instances.items()):
        if inst.role != "sink":
            continue
        table = inst.result if isinstance(inst.result, pa.Table) else None
        prev = out.get(iid[0])
        if table is None:
            out.setdefault(iid[0], prev)
        elif prev is None:
            out[iid[0]] = table
        else:
            out[iid[0]] = pa.concat_tables([prev, table], promote_options="permissive")
    return out


async def _commit_partitions(flow: Dataflow, instances: dict[ChannelId, Any]) -> None:
    """End of input: a partitioned sink with ``partition_commit`` commits every folder written
    (no checkpoints here: every part was published at the instances' ends)."""
    from raystream.partition_commit import JobPartitionCommits, written_partitions

    commits = JobPartitionCommits(flow.steps)
    if commits:
        results = [(iid[0], inst.result) for iid, inst in instances.items() if inst.role == "sink"]
        await asyncio.to_thread(commits.commit_end, written_partitions(results))
