"""What a rescale's controller does not wait for, without Ray (the controller is a plain class):
a rescale the autoscaler decides plans from the autoscaler's own reading (load per sub-group,
backlog) instead of asking busy instances again, and a migration step is over when every instance
reported its part done, even if a busy instance has not answered the call yet."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import raystream as rs
from raystream import controller as controller_module
from raystream.controller import Controller
from raystream.runtime.instance import RuntimeConfig

KEY_GROUPS = 8
SUB_GROUPS = 2


@rs.keyed_batches(name="count", state=rs.ValueState(int, default=0))
def count(batch: rs.KeyedBatch, state: object) -> object:
    return batch.output({"count": batch.counts})


def _controller(tmp_path: Path) -> Controller:
    flow = rs.Dataflow("reading", num_key_groups=KEY_GROUPS, sub_groups=SUB_GROUPS)
    flow.source(rs.sources.generator(events=10, keys=4)).key_by("key").apply(count).sink(
        rs.sinks.collect(), name="out"
    )
    return Controller(flow, {"count": 2}, RuntimeConfig(), str(tmp_path))


def _snaps(c: Controller) -> list[dict[str, object]]:
    """Metrics of every instance as the autoscaler reads them (step, index, backlog, cost)."""
    out = []
    for step, index in c.specs:
        m: dict[str, object] = {"step": step, "index": index}
        if step == "count":
            m.update(backlog_rows=100 * (index + 1), row_cost_s=1e-4)
        if (step, index) in c.plan.sources:
            m.update(lag_rows=50)
        out.append(m)
    return out


def test_a_fresh_reading_gives_the_load_and_backlog_of_every_instance(tmp_path: Path) -> None:
    c = _controller(tmp_path)
    n = KEY_GROUPS * SUB_GROUPS
    loads = {("count", i): np.arange(n, dtype=float) * (i + 1) for i in range(2)}
    c.note_reading(_snaps(c), loads)
    got = c._fresh_reading("count", [0, 1])
    assert got is not None
    heat, backlog = got
    assert [h.tolist() for h in heat] == [loads[("count", i)].tolist() for i in range(2)]
    sources = len(c.plan.sources)
    # 100 + 200 queued, 50 per source behind; 1e-4 s per record spread over 2 instances
    assert backlog["queued_rows"] == 300
    assert backlog["source_lag_rows"] == 50 * sources
    assert backlog["queued_work_s"] == pytest.approx(300 * 1e-4 / 2)
    assert backlog["total_work_s"] == pytest.approx((300 + 50 * sources) * 1e-4 / 2)


def test_a_stale_or_partial_reading_or_one_from_another_epoch_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = _controller(tmp_path)
    n = KEY_GROUPS * SUB_GROUPS
    loads = {("count", i): np.ones(n) for i in range(2)}
    # an instance missing from the loads (it did not answer)
    c.note_reading(_snaps(c), {("count", 0): np.ones(n)})
    assert c._fresh_reading("count", [0, 1]) is None
    # a source missing from the metrics
    c.note_reading([m for m in _snaps(c) if (m["step"], m["index"]) not in c.plan.sources], loads)
    assert c._fresh_reading("count", [0, 1]) is None
    # taken before the step's routing changed
    c.note_reading(_snaps(c), loads)
    assert c._fresh_reading("count", [0, 1]) is not None
    table = c.routing["count"]
    c.routing["count"] = replace(table, epoch=table.epoch + 1)
    assert c._fresh_reading("count", [0, 1]) is None
    c.routing["count"] = table
    # too old
    now = time.monotonic()
    monkeypatch.setattr(
        controller_module.time,
        "monotonic",
        lambda: now + controller_module.READING_MAX_AGE_S + 0.1,
    )
    assert c._fresh_reading("count", [0, 1]) is None


class _Peer:
    """An instance whose ``migration_done`` call answers only when ``answer`` is set."""

    def __init__(self, iid: tuple[str, int]) -> None:
        self.iid = iid
        self.answer: asyncio.Future[dict[str, Any]] | None = None

    @property
    def migration_done(self) -> Any:
        peer = self

        class _Method:
            @staticmethod
            def remote(epoch: int) -> asyncio.Future[dict[str, Any]]:
                peer.answer = asyncio.get_running_loop().create_future()
                return peer.answer

        return _Method()


def test_a_migration_step_ends_when_every_instance_reported_even_if_a_call_is_unanswered(
    tmp_path: Path,
) -> None:
    c = _controller(tmp_path)

    async def go() -> tuple[list[dict[str, Any]], float]:
        peers = {0: _Peer(("count", 0)), 1: _Peer(("count", 1))}
        waiting = asyncio.ensure_future(c._await_migration("count", 2, 7, peers, 2))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        # instance 1 answers its call; instance 0 (busy) does not, but reports its part done
        peers[1].answer.set_result({"instance": ("count", 1), "epoch": 7, "via": "call"})
        await c.on_migration_done({"instance": ["count", 0], "epoch": 7, "via": "report"})
        await c.on_migration_done({"instance": ["count", 0], "epoch": 6, "via": "old epoch"})
        t0 = time.monotonic()
        out = await asyncio.wait_for(waiting, 2.0)
        return out, time.monotonic() - t0

    out, took_s = asyncio.run(go())
    assert [(o["instance"], o["via"]) for o in out] == [
        (["count", 0], "report"),
        (("count", 1), "call"),
    ]
    assert took_s < 0.5
    assert c._migration_reports == {}  # nothing kept after the step


def test_a_step_that_did_not_finish_says_what_the_old_owner_served_and_has_queued() -> None:
    snap = {
        "inputs": 2,
        "eos": 0,
        "barriers_open": {},
        "migration": {
            "epoch": 7,
            "active": True,
            "sealed": True,
            "fenced": True,
            "incoming": 0,
            "outgoing_left": 16,
            "chunks_out": 0,
            "serve_calls_queued": 0,
            "server": "none (no serve call came)",
        },
    }
    text = controller_module._waiting_for(snap, 7)
    assert "16 sub-groups still to hand out" in text
    assert "0 chunks served, 0 serve calls queued, serving loop: none (no serve call came)" in text
    snap["migration"]["outgoing_left"] = 0
    assert "chunks served" not in controller_module._waiting_for(snap, 7)
