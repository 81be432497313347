"""The controller keeps the newest checkpoint records, not one per checkpoint for ever: a job
checkpointing every second for a day took 86,400; ``status()`` still counts them all.

Oracle: the records appended (plain Python), and the list the history replaced."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

import raystream as rs
from raystream.controller import Controller
from raystream.errors import ConfigError
from raystream.history import CHECKPOINT_HISTORY, BoundedHistory
from raystream.runtime.instance import RuntimeConfig


@rs.keyed_batches(name="count", state=rs.ValueState(int, default=0))
def count(batch: rs.KeyedBatch, state: object) -> object:
    return batch.output({"count": batch.counts})


def _record(cid: int) -> dict[str, object]:
    return {"checkpoint_id": cid, "at_s": float(cid), "duration_s": 0.1, "source_offsets": {}}


def test_a_day_of_checkpoints_keeps_the_newest_and_counts_all(tmp_path: Path) -> None:
    flow = rs.Dataflow("history", num_key_groups=8, sub_groups=2)
    flow.source(rs.sources.generator(events=10, keys=4)).key_by("key").apply(count).sink(
        rs.sinks.collect(), name="out"
    )
    c = Controller(flow, {"count": 2}, RuntimeConfig(checkpoint_interval_s=1.0), str(tmp_path))
    day = 86_400
    for cid in range(1, day + 1):
        c.checkpoint_stats.append(_record(cid))
    for cid in range(1, 7):
        c.failed_checkpoints.append({"checkpoint_id": cid, "error": "x"})
    summary = c.checkpoint_summary()
    assert summary["completed"] == day and summary["failed"] == 6
    assert summary["last"] == _record(day)
    assert [r["checkpoint_id"] for r in summary["recent"]] == list(range(day - 19, day + 1))
    assert summary["last_failure"]["checkpoint_id"] == 6
    kept = c.checkpoint_stats.kept()
    assert [r["checkpoint_id"] for r in kept] == list(range(day - CHECKPOINT_HISTORY + 1, day + 1))
    # a list of every record: ~6 MB pickled here (a few times that in the controller's memory)
    assert len(pickle.dumps(kept)) < 20_000


def test_the_history_reads_like_the_list_it_replaced() -> None:
    h, everything = BoundedHistory(keep=5), []
    assert not h and len(h) == 0 and h[-3:] == []
    for i in range(12):
        h.append(i)
        everything.append(i)
    assert len(h) == len(everything) and bool(h)
    assert h[-1] == everything[-1] and h[-5] == everything[-5] and h[11] == 11
    assert h[-3:] == everything[-3:] and h[-20:] == everything[-5:]  # what is kept of them
    assert list(h) == everything[-5:]
    assert [x for x in h if x > 8] == [9, 10, 11]
    with pytest.raises(IndexError, match="only the newest 5 are kept"):
        h[0]
    with pytest.raises(ConfigError, match="keep must be an int >= 1"):
        BoundedHistory(keep=0)


def test_an_instance_remembers_the_newest_acknowledged_epochs_only() -> None:
    """One epoch a second for a day: the set of every acknowledged epoch grew ~5 MB a day per
    instance; the newest ACKED_EPOCHS_KEPT answer every question asked (recent epochs)."""
    from raystream.history import ACKED_EPOCHS_KEPT, RecentEpochs

    acked, everything = RecentEpochs(), set()
    for epoch in range(1, 86_401):
        acked.add(epoch)
        everything.add(epoch)
    assert len(acked) == ACKED_EPOCHS_KEPT
    recent = range(86_400 - ACKED_EPOCHS_KEPT + 1, 86_401)
    assert all((e in acked) == (e in everything) for e in recent)
    assert 86_401 not in acked and 1 not in acked
    assert sorted(acked) == list(recent)  # what an instance's outcome lists
    acked.add(86_400)  # acknowledged twice: nothing changes
    assert len(acked) == ACKED_EPOCHS_KEPT and sorted(acked)[-1] == 86_400
