"""The timer service's in-memory copy against a plain-Python model (no Ray): timestamp order,
each timer once, timers written to RocksDB only when needed, restore, and a sub-group's timers
moving between two instances (also when it leaves and comes back)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from raystream.keys import KeySpace
from raystream.runtime.timers import EVENT_TIMERS, PROCESSING_TIMERS, TimerService
from raystream.state.handles import KeySet
from raystream.state.rocks import RocksStateBackend, read_snapshot_key_groups

SPACE = KeySpace(num_key_groups=8, sub_groups=4)
N_GROUPS = SPACE.num_key_groups * SPACE.sub_groups


class Task:
    """What the service reads of a migration task: the sub-groups it brings in."""

    def __init__(self, incoming: set[int]) -> None:
        self.incoming = dict.fromkeys(incoming, 0)


class Instance:
    """A backend, the held flags and the timer service of one keyed instance."""

    def __init__(self, path: Path, held: bool = True) -> None:
        self.backend = RocksStateBackend(path)
        self.held = np.full(N_GROUPS, held)
        self.task: Task | None = None
        self.timers = TimerService(self.backend, SPACE, lambda: self.held, task=lambda: self.task)

    def register(self, keys: list[Any], ts: list[int], *, delete: bool = False) -> None:
        ks = KeySet.of(pa.array(keys), SPACE)
        self.timers.register(EVENT_TIMERS, ks, np.array(ts, np.int64), delete=delete)

    def fire(self, limit: int) -> list[tuple[int, Any]]:
        """(timestamp, key) of every timer taken, in the order taken."""
        due = self.timers.take_due(EVENT_TIMERS, limit)
        if due is None:
            return []
        keys = due.keys.tolist() if isinstance(due.keys, np.ndarray) else list(due.keys)
        return list(zip(due.ts.tolist(), keys, strict=True))

    def stored(self) -> set[tuple[int, bytes]]:
        """Timer keys in RocksDB (after writing the pending ones), as (global sub-group, key)."""
        self.backend.flush_cache()
        out = set()
        for k, _ in self.backend.scan(b"", b"\xff\xff\xff\xff", flush=False):
            if k[3] == EVENT_TIMERS:
                out.add((int.from_bytes(k[:2], "big") * SPACE.sub_groups + k[2], k))
        return out


def group_of(keys: list[Any]) -> np.ndarray:
    kg, sg = SPACE.locate(pa.array(keys))
    return SPACE.global_sub_group(kg, sg)


@pytest.mark.parametrize("key_type", ["int", "str"])
def test_random_register_delete_fire_matches_a_model(tmp_path: Path, key_type: str) -> None:
    """Registrations (with repeats), deletions, flushes and watermarks in random order: every
    timer fires once, at the first watermark at or after it, in timestamp order, and RocksDB
    ends holding exactly the pending ones."""
    inst = Instance(tmp_path / "a")
    rng = np.random.default_rng(3)
    pending: set[tuple[int, Any]] = set()
    fired: list[tuple[int, Any]] = []  # (a timer registered again after it fired fires again)
    watermark = 0
    for step in range(300):
        action = rng.random()
        if action < 0.55:
            raw = rng.integers(0, 60, 25)
            keys: list[Any] = raw.tolist() if key_type == "int" else [f"k{x}" for x in raw]
            ts = (watermark + rng.integers(-3, 40, 25)).tolist()
            inst.register(keys, ts)
            pending |= set(zip(ts, keys, strict=True))
        elif action < 0.65 and pending:
            pick = sorted(pending, key=repr)[: int(rng.integers(1, 6))]
            inst.register([k for _, k in pick], [t for t, _ in pick], delete=True)
            pending -= set(pick)
        elif action < 0.72:
            inst.backend.flush_cache()  # what a snapshot or a move does first
        else:
            watermark += int(rng.integers(0, 12))
            got = inst.fire(watermark)
            ts = [t for t, _ in got]
            assert ts == sorted(ts), f"step {step}: not in timestamp order"
            want = {p for p in pending if p[0] <= watermark}
            assert len(got) == len(set(got)) and set(got) == want, f"step {step}"
            pending -= want
            fired += got
    assert len(fired) > 1000  # the model's timers fired; registering one again may refire it
    stored = inst.stored()
    assert len(stored) == len(pending)
    assert {g for g, _ in stored} == set(group_of([k for _, k in pending]).tolist())
    assert inst.timers.next_due(EVENT_TIMERS) == min(t for t, _ in pending)
    inst.backend.close()


def test_timers_that_fire_before_a_flush_never_reach_rocksdb(tmp_path: Path) -> None:
    inst = Instance(tmp_path / "a")
    inst.register(list(range(100)), [10] * 100)
    assert len(inst.fire(10)) == 100
    inst.register(list(range(5)), [20] * 5)
    assert inst.backend.count_rows() == 5  # the scan wrote the five still pending, only them
    assert sorted(inst.fire(25)) == [(20, k) for k in range(5)]
    assert inst.backend.count_rows() == 0  # written ones are deleted when they fire
    inst.backend.close()


def test_a_restore_fires_exactly_the_timers_of_the_snapshot(tmp_path: Path) -> None:
    inst = Instance(tmp_path / "a")
    keys = list(range(40))
    inst.register(keys, [100 + k for k in keys])
    snap = inst.backend.snapshot(tmp_path / "snap")  # writes the pending timers first
    inst.register([1000, 1001], [50, 60])  # after the snapshot: gone after the restore
    assert inst.fire(105) == [(50, 1000), (60, 1001)] + [(100 + k, k) for k in range(6)]
    fresh = RocksStateBackend(tmp_path / "restored")
    for chunk in read_snapshot_key_groups(snap, range(SPACE.num_key_groups)):
        fresh.import_chunk(chunk)
    inst.backend.destroy()
    inst.backend = fresh
    inst.timers.backend = fresh
    inst.timers.reindex()
    assert inst.timers.next_due(EVENT_TIMERS) == 100
    assert inst.fire(10_000) == [(100 + k, k) for k in keys]
    fresh.close()


def move(src: Instance, dst: Instance, g: int) -> None:
    """What the migration engine does with sub-group ``g``: evict, export, drop, import."""
    kg, sg = divmod(g, SPACE.sub_groups)
    src.backend.evict_sub_groups([(kg, sg)])
    chunk, resume = src.backend.export_chunk(kg, sg, None, 1 << 30)
    assert resume is None
    src.backend.drop_sub_group(kg, sg, evicted=True)
    src.held[g] = False
    dst.backend.import_chunk(chunk)
    dst.held[g] = True


def test_a_sub_groups_timers_move_and_fire_only_at_their_new_owner(tmp_path: Path) -> None:
    a, b = Instance(tmp_path / "a"), Instance(tmp_path / "b", held=False)
    keys = list(range(200))
    a.register(keys, [k % 17 for k in keys])
    a.backend.flush_cache()
    a.register(keys, [50 + k % 13 for k in keys])  # not written yet when the move starts
    groups = group_of(keys)
    g = int(groups[0])
    a.fire(-1)  # the service has seen every held sub-group
    move(a, b, g)
    moved = {k for k, x in zip(keys, groups.tolist(), strict=True) if x == g}
    got_a, got_b = a.fire(1_000), b.fire(1_000)
    assert {k for _, k in got_b} == moved
    assert not {k for _, k in got_a} & moved
    want = {(k % 17, k) for k in keys} | {(50 + k % 13, k) for k in keys}
    assert sorted(got_a + got_b) == sorted(want)
    assert a.stored() == set() and b.stored() == set()
    a.backend.close()
    b.backend.close()


def test_a_sub_group_that_leaves_and_comes_back_is_read_again(tmp_path: Path) -> None:
    """Out to b and back to a between two uses of a's service: a new migration task that
    brings it in makes a read it again, so a fires what b left, not its own old copy."""
    a, b = Instance(tmp_path / "a"), Instance(tmp_path / "b", held=False)
    keys = list(range(100))
    groups = group_of(keys)
    g = int(groups[0])
    mine = [k for k, x in zip(keys, groups.tolist(), strict=True) if x == g]
    a.register(keys, [10] * len(keys))
    a.fire(0)
    move(a, b, g)
    b.task = Task({g})
    assert sorted(b.fire(10)) == [(10, k) for k in sorted(mine)]  # fired at b
    b.register(mine, [30] * len(mine))
    move(b, a, g)
    a.task = Task({g})
    got = a.fire(100)
    assert sorted(got) == sorted([(10, k) for k in keys if k not in mine] + [(30, k) for k in mine])
    a.backend.close()
    b.backend.close()


def test_event_and_processing_timers_are_separate(tmp_path: Path) -> None:
    inst = Instance(tmp_path / "a")
    ks = KeySet.of(pa.array([1, 2]), SPACE)
    inst.timers.register(PROCESSING_TIMERS, ks, np.array([5, 7], np.int64))
    inst.register([1], [6])
    assert inst.timers.next_due(PROCESSING_TIMERS) == 5
    assert inst.fire(100) == [(6, 1)]
    due = inst.timers.take_due(PROCESSING_TIMERS, 100)
    assert due is not None and due.ts.tolist() == [5, 7]
    assert inst.timers.next_due(PROCESSING_TIMERS) is None
    inst.backend.close()


def test_timers_survive_reopening_the_backend(tmp_path: Path) -> None:
    inst = Instance(tmp_path / "a")
    inst.register([3, 4, 5], [9, 8, 7])
    inst.backend.close()  # writes the pending timers
    again = Instance(tmp_path / "a")
    assert again.fire(100) == [(7, 5), (8, 4), (9, 3)]
    again.backend.close()


def test_many_timers_of_one_group_by_timestamp(tmp_path: Path) -> None:
    """Duplicates registered in many batches fire once; per key in time order."""
    inst = Instance(tmp_path / "a")
    per_key: dict[int, list[int]] = defaultdict(list)
    for rep in range(30):
        keys = list(range(50))
        ts = [(k * 7 + rep) % 20 for k in keys]
        inst.register(keys, ts)
        for k, t in zip(keys, ts, strict=True):
            if t not in per_key[k]:
                per_key[k].append(t)
    got = inst.fire(100)
    assert len(got) == sum(len(v) for v in per_key.values())
    seen: dict[int, list[int]] = defaultdict(list)
    for t, k in got:
        seen[k].append(t)
    assert seen == {k: sorted(v) for k, v in per_key.items()}
    inst.backend.close()


def test_a_whole_instances_timers_move_by_its_files_and_the_rows_changed_since(
    tmp_path: Path,
) -> None:
    """A move by files (raystream.runtime.move_files): a checkpoint of a's RocksDB opened as
    b's, then the keys a wrote or deleted after it (tracked) copied over. Timers registered,
    deleted and fired after the checkpoint end up at b exactly as a has them."""
    a = Instance(tmp_path / "a")
    keys = list(range(120))
    a.register(keys, [100 + k for k in keys])
    a.backend.flush_cache()
    a.register(keys[:60], [500 + k for k in keys[:60]])  # pending (not written) at the copy
    copy = a.backend.snapshot_async(tmp_path / "copy")
    a.backend.track_writes()
    copy.result()
    a.register(keys[:10], [100 + k for k in keys[:10]], delete=True)  # deleted after the copy
    a.register([1000, 1001], [700, 710])  # new after the copy
    fired = a.fire(115)  # fired (deleted) after the copy: 10..15
    assert fired == [(100 + k, k) for k in range(10, 16)]
    a.backend._write_pending(None)  # what hand_over_changes does at the seal
    changed = a.backend.take_tracked()
    values = a.backend.multi_get(changed)
    b = Instance(tmp_path / "copy")  # the checkpoint opened as b's RocksDB
    b.backend.write_direct(
        [k for k, v in zip(changed, values, strict=True) if v is not None],
        [v for v in values if v is not None],
        deletes=[k for k, v in zip(changed, values, strict=True) if v is None],
    )
    want = sorted(
        [(100 + k, k) for k in keys[16:]]
        + [(500 + k, k) for k in keys[:60]]
        + [(700, 1000), (710, 1001)]
    )
    assert sorted(b.fire(10_000)) == want
    assert sorted(a.fire(10_000)) == want  # a, unchanged, has the same
    a.backend.close()
    b.backend.close()
