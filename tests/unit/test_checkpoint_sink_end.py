"""A collect sink whose branch finished while the job runs on keeps its rows across a recovery.

The sink instance pre-commits at a checkpoint (its rows go to checkpoint storage), takes more rows
and reaches its end (that end is kept in memory: ``{"in_memory": True}``); a later checkpoint
stores the end (``persist_end``), and the manifest built from it, read back from real checkpoint
storage, restores a new instance of the sink with every row it received, once.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa

import raystream as rs
from raystream.checkpoint.storage import CheckpointStorage
from raystream.checkpointing import build_manifest, restore_specs
from raystream.plan import physical_plan
from raystream.runtime.instance import OperatorInstance, RuntimeConfig
from raystream.runtime.messages import Barrier
from raystream.runtime.snapshots import restore_sink


def _sink_spec(tmp_path: Path, storage: tuple[str, str]):  # type: ignore[no-untyped-def]
    flow = rs.Dataflow("sink-end")
    flow.source(rs.sources.from_table(pa.table({"k": [0]})), name="src").sink(
        rs.sinks.collect(), name="rows"
    )
    config = RuntimeConfig(checkpoint_interval_s=1.0)
    plan = physical_plan(flow, None, config, time.time_ns(), tmp_path / "state")
    return replace(plan.instances[("rows", 0)], storage=storage)


def _batches(rng: np.random.Generator, n: int, start: int) -> list[pa.RecordBatch]:
    out = []
    for i in range(n):
        size = int(rng.integers(1, 50))
        seq = np.arange(start, start + size)
        start += size
        out.append(pa.record_batch({"k": rng.integers(0, 7, size), "seq": seq, "b": [i] * size}))
    return out


def test_an_ended_collect_sinks_rows_survive_a_later_recovery(tmp_path: Path) -> None:
    uri = str(tmp_path / "checkpoints")
    storage = CheckpointStorage(uri, "sink-end")
    spec = _sink_spec(tmp_path, (uri, "sink-end"))
    rng = np.random.default_rng(4)
    before, after = _batches(rng, 12, 0), _batches(rng, 9, 10_000)

    inst = OperatorInstance(spec)
    inst.writer = spec.step.fn.open(0, 1)
    for b in before:
        inst.writer.write(b)
    info: dict = {}
    upload = inst.checkpoints.take(inst, Barrier(3, "checkpoint", {}), info)
    assert upload is not None and "error" not in info
    ack = {"instance": ("rows", 0), **upload()}
    storage.complete(3, build_manifest(
        job="sink-end", checkpoint_id=3, acks=[ack], finished_sources=[], steps={"rows": "sink"},
        parallelism={"rows": 1}, routing={}, num_key_groups=8, sub_groups=1,
    ))  # fmt: skip
    for b in after:  # then its input ends: the rows since checkpoint 3 are kept in memory
        inst.writer.write(b)
    end = inst.checkpoints.end_of_input(inst.writer)
    assert end == {"in_memory": True}

    # a later checkpoint (the sink took no part: it had ended) stores that end
    durable = inst.checkpoints.persist_end(5, "rows/0")
    assert inst.checkpoints.persist_end(5, "rows/0") == durable  # nothing stored twice
    ended = {"instance": ("rows", 0), "sink_state": durable, "final_sink_state": True}
    storage.complete(5, build_manifest(
        job="sink-end", checkpoint_id=5, acks=[ended], finished_sources=[("src", 0)],
        steps={"src": "source", "rows": "sink"}, parallelism={"src": 1, "rows": 1}, routing={},
        num_key_groups=8, sub_groups=1, finished=[("src", 0), ("rows", 0)],
    ))  # fmt: skip

    # recovery: a new instance of the sink starts from the latest checkpoint
    manifest = CheckpointStorage(uri, "sink-end").latest()
    assert manifest is not None and manifest["checkpoint_id"] == 5
    restore = restore_specs(manifest, [("rows", 0)], {}, (uri, "sink-end"))[("rows", 0)]
    again = OperatorInstance(replace(spec, restore=restore))
    again.writer = spec.step.fn.open(0, 1)
    asyncio.run(restore_sink(again))
    got = again.writer.close()

    def rows(batches: list[pa.RecordBatch] | pa.Table) -> Counter[tuple[int, int, int]]:
        t = pa.Table.from_batches(batches) if isinstance(batches, list) else batches
        return Counter(zip(*(t.column(c).to_pylist() for c in ("k", "seq", "b")), strict=True))

    assert got is not None
    assert rows(got) == rows(before + after)
    assert got.num_rows == sum(b.num_rows for b in before + after)
