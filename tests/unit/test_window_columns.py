"""Tumbling and sliding windows kept in memory as columns (operators.window_columns) on real
keyed processors (RocksDB, no Ray), against a plain-dict oracle: random batches and watermarks,
RocksDB contents after flushes and evictions, snapshot and restore, a swapped backend, a
replaced function, sub-groups moved out and back, and a move's catch-up changes. Each check
needs one of the store's hooks to pass."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from raystream.operators import count, sum, windows
from raystream.operators.window_logic import WindowTable

import raystream as rs
from raystream.runtime import move_files
from raystream.runtime.outputs import port_of
from raystream.runtime.processors import KeyedProcessor
from raystream.state.layout import decode_user_key

KGS, SGS = 4, 4
SIZE, SLIDE = 400, 100


def _flow(op: Any) -> rs.Dataflow:
    flow = rs.Dataflow("t", num_key_groups=KGS, sub_groups=SGS)
    src = pa.table({"k": [1], "event_time": [0], "x": [0]})
    flow.source(rs.sources.from_table(src), name="a").key_by("k").apply(op, name="w")
    return flow


def _op(kind: str, lateness: int) -> Any:
    agg = [count(), sum("x", name="total")]
    if kind == "tumbling":
        return windows.tumbling(SIZE, agg, allowed_lateness_ms=lateness)
    return windows.sliding(SIZE, SLIDE, agg, allowed_lateness_ms=lateness)


def _proc(tmp: Path, name: str, flow: rs.Dataflow, owned: Any = range(KGS)) -> KeyedProcessor:
    return KeyedProcessor(flow.steps["w"], flow.key_space, tmp / name, owned)


class Oracle:
    """Windows as a dict (key, start) -> [count, total, fired]; what must be emitted."""

    def __init__(self, kind: str, lateness: int) -> None:
        self.slide = SIZE if kind == "tumbling" else SLIDE
        self.lateness = lateness
        self.open: dict[tuple[Any, int], list[int]] = {}
        self.emitted: list[tuple[Any, int, int, int]] = []
        self.late = 0

    def batch(self, keys: list[Any], times: list[int], xs: list[int], wm: int) -> None:
        updated = []
        for k, t, x in zip(keys, times, xs, strict=True):
            last = t - t % self.slide
            for s in range(last, t - SIZE, -self.slide):
                end = s + SIZE
                if end - 1 + self.lateness <= wm:
                    self.late += 1
                    continue
                w = self.open.setdefault((k, s), [0, 0, 0])
                w[0] += 1
                w[1] += x
                if end - 1 <= wm and (k, s) not in updated:  # allowed late: emitted again
                    updated.append((k, s))
        for k, s in updated:
            w = self.open[(k, s)]
            w[2] = 1
            self.emitted.append((k, s, w[0], w[1]))

    def watermark(self, wm: int) -> None:
        for (k, s), w in list(self.open.items()):
            end = s + SIZE
            if not w[2] and end - 1 <= wm:
                w[2] = 1
                self.emitted.append((k, s, w[0], w[1]))
            if end - 1 + self.lateness <= wm:
                del self.open[(k, s)]


def _rows(outs: list[pa.RecordBatch]) -> list[tuple[Any, int, int, int]]:
    got = []
    for b in outs:
        if port_of(b)[0]:
            continue
        d = b.to_pydict()
        got += list(zip(d["k"], d["window_start"], d["count"], d["total"], strict=True))
    return got


def _late_rows(outs: list[pa.RecordBatch]) -> int:
    return int(np.sum([b.num_rows for b in outs if port_of(b)[0] == "late"]))


def _stored(proc: KeyedProcessor, kind: str, groups: Any = None) -> dict[Any, list[int]]:
    """The windows in RocksDB (read past the cache), as the oracle holds them."""
    out: dict[Any, list[int]] = {}
    s = proc.key_space.sub_groups
    for g in range(KGS * SGS) if groups is None else groups:
        chunk, _ = proc.backend.export_chunk(g // s, g % s, None, 1 << 30)
        for k, v in zip(chunk.column(0).to_pylist(), chunk.column(1).to_pylist(), strict=True):
            if k[3] != 1:
                continue
            key = decode_user_key(k, kind)[0]
            t = WindowTable.from_state([v])
            for i in range(len(t)):
                w = [int(t.parts["0.n"][i]), int(t.parts["1.v"][i]), int(t.fired[i])]
                out[(key, int(t.start[i]))] = w
    return out


def _group_of(proc: KeyedProcessor, keys: list[Any]) -> np.ndarray:
    ks = rs.KeySet.of(keys, proc.key_space)
    return proc.key_space.global_sub_group(ks.key_group, ks.sub_group).astype(np.int64)


def _batch(rng: np.random.Generator, clock: int, key_kind: str) -> tuple[list, list, list]:
    n = int(rng.integers(1, 60))
    ks = rng.integers(0, 40, n)
    keys = ks.tolist() if key_kind == "int" else [f"k{v}" for v in ks.tolist()]
    times = (clock - rng.integers(0, 300, n)).tolist()
    xs = rng.integers(-5, 50, n).tolist()
    return keys, times, xs


def _table(keys: list, times: list, xs: list) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(
        {"k": keys, "event_time": pa.array(times, pa.int64()), "x": pa.array(xs, pa.int64())}
    )


CASES = [
    ("tumbling", 0, "int"),
    ("sliding", 0, "int"),
    ("sliding", 0, "str"),
    ("sliding", 250, "int"),
    ("tumbling", 150, "str"),
]


@pytest.mark.parametrize(("kind", "lateness", "key_kind"), CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_batches_watermarks_flushes_and_evictions_match_a_dict(
    tmp_path: Path, kind: str, lateness: int, key_kind: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    flow = _flow(_op(kind, lateness))
    proc = _proc(tmp_path, "p", flow)
    oracle = Oracle(kind, lateness)
    outs: list[pa.RecordBatch] = []
    clock = 1000
    for _ in range(300):
        op = rng.random()
        if op < 0.6:
            keys, times, xs = _batch(rng, clock, key_kind)
            oracle.batch(keys, times, xs, proc.watermark)
            outs += proc.process(_table(keys, times, xs))
            clock += int(rng.integers(0, 40))
        elif op < 0.85:
            wm = clock - int(rng.integers(100, 250))
            if wm > proc.watermark:
                oracle.watermark(wm)
                outs += proc.on_watermark(wm)
        elif op < 0.93:  # evicted for an export: RocksDB holds exactly their windows
            groups = rng.choice(KGS * SGS, int(rng.integers(1, 5)), replace=False).tolist()
            s = SGS
            proc.backend.evict_sub_groups([divmod(g, s) for g in groups])
            want = {
                w: v
                for w, v in oracle.open.items()
                if int(_group_of(proc, [w[0]])[0]) in groups
            }
            assert _stored(proc, key_kind, groups) == want
        else:  # the whole DB read (flush): RocksDB holds every open window
            proc.backend.flush_cache()
            assert _stored(proc, key_kind) == oracle.open
    oracle.watermark(clock + 10 * SIZE)
    outs += proc.on_watermark(clock + 10 * SIZE)
    assert Counter(_rows(outs)) == Counter(oracle.emitted)
    assert _late_rows(outs) == oracle.late
    proc.backend.flush_cache()
    assert _stored(proc, key_kind) == {} == oracle.open
    proc.close()


def _script(seed: int, steps: int, key_kind: str) -> list[tuple[str, Any]]:
    rng = np.random.default_rng(seed)
    clock, wm, script = 1000, -1, []
    for _ in range(steps):
        if rng.random() < 0.65:
            script.append(("batch", _batch(rng, clock, key_kind)))
            clock += int(rng.integers(0, 40))
        else:
            nxt = clock - int(rng.integers(100, 250))
            if nxt > wm:
                wm = nxt
                script.append(("wm", wm))
    return script


def _play(procs: Any, script: list[tuple[str, Any]]) -> list[pa.RecordBatch]:
    """Run ``script`` on one processor, or on several (records go to the one holding their
    sub-group: ``procs`` is a function of the batch giving (processor, rows) pairs)."""
    outs: list[pa.RecordBatch] = []
    for what, arg in script:
        if what == "batch":
            for proc, rows in procs(_table(*arg)):
                outs += proc.process(rows)
        else:
            for proc in procs(None):
                outs += proc.on_watermark(arg)
    return outs


def _single(proc: KeyedProcessor) -> Any:
    return lambda b: [proc] if b is None else [(proc, b)]


@pytest.mark.parametrize(("kind", "lateness", "key_kind"), CASES)
def test_restore_of_a_snapshot_and_a_swapped_backend_replay_exactly(
    tmp_path: Path, kind: str, lateness: int, key_kind: str
) -> None:
    flow = _flow(_op(kind, lateness))
    script = _script(7, 260, key_kind)
    cut = len(script) // 2
    proc = _proc(tmp_path, "p", flow)
    _play(_single(proc), script[:cut])
    wm = proc.watermark
    snap = proc.backend.snapshot(tmp_path / "snap")  # the windows in memory must be in it
    after = _rows(_play(_single(proc), script[cut:]))
    assert after  # windows fired after the cut
    # a fresh instance restored from the snapshot sees the same rest of the input
    fresh = _proc(tmp_path, "q", flow)
    fresh.backend.restore_key_groups(snap, range(KGS))
    fresh.watermark = wm
    assert Counter(_rows(_play(_single(fresh), script[cut:]))) == Counter(after)
    # the first instance swaps its backend for the snapshot (stop-and-restart) and replays
    new = proc.fresh_backend(tmp_path / "p2")
    new.restore_key_groups(snap, range(KGS))
    proc.swap_backend(new, list(range(KGS)))
    proc.watermark = wm
    assert Counter(_rows(_play(_single(proc), script[cut:]))) == Counter(after)
    proc.close()
    fresh.close()


def test_a_replaced_function_keeps_the_windows(tmp_path: Path) -> None:
    flow = _flow(_op("sliding", 0))
    script = _script(3, 240, "int")
    cut = len(script) // 2
    ref = _proc(tmp_path, "ref", flow)
    want = Counter(_rows(_play(_single(ref), script)))
    proc = _proc(tmp_path, "p", flow)
    got = _rows(_play(_single(proc), script[:cut]))
    proc.replace_step(flow.steps["w"], {})
    got += _rows(_play(_single(proc), script[cut:]))
    assert Counter(got) == want
    ref.close()
    proc.close()


def _move(src: KeyedProcessor, dst: KeyedProcessor, g: int, *, task: bool) -> None:
    """Sub-group ``g`` from ``src`` to ``dst`` as a migration does: evict, export, drop, import.
    ``task``: ``dst`` runs a migration task that lists it as incoming."""
    kg, sg = divmod(g, SGS)
    src.backend.evict_sub_groups([(kg, sg)])
    chunk, rest = src.backend.export_chunk(kg, sg, None, 1 << 30)
    assert rest is None
    src.engine.held[g] = False
    src.backend.drop_sub_group(kg, sg, evicted=True)
    dst.backend.import_chunk(chunk)
    dst.engine.held[g] = True
    if task:
        dst.engine.task = SimpleNamespace(incoming={g}, outgoing=set(), active=False)
    dst.watermark = max(dst.watermark, src.watermark)


@pytest.mark.parametrize(("kind", "lateness"), [("sliding", 0), ("tumbling", 150)])
def test_sub_groups_moved_out_and_back_keep_every_window(
    tmp_path: Path, kind: str, lateness: int
) -> None:
    """A and B split the sub-groups as they move between them. One moves A -> B, gets records
    there and comes straight back with no call on A in between: A learns it from the new task's
    incoming sub-groups (as the timers do). Rows out equal one instance's on the same input."""
    flow = _flow(_op(kind, lateness))
    script = _script(11, 400, "int")
    played: list[tuple[str, Any]] = []  # everything A and B got, in order
    a = _proc(tmp_path, "a", flow)
    b = _proc(tmp_path, "b", flow, owned=())

    def route(batch: pa.RecordBatch | None) -> Any:
        if batch is None:
            return [a, b]
        g = _group_of(a, batch.column("k").to_pylist())
        out = []
        for proc in (a, b):
            mine = proc.engine.held[g]
            if mine.any():
                out.append((proc, batch.filter(pa.array(mine))))
        return out

    outs: list[pa.RecordBatch] = []
    rng = np.random.default_rng(5)
    moved: list[int] = []
    for i in range(0, len(script), 40):
        outs += _play(route, script[i : i + 40])
        played += script[i : i + 40]
        g = int(rng.choice(np.flatnonzero(a.engine.held)))
        _move(a, b, g, task=True)  # out and straight back
        keys = [k for k in range(40) if int(_group_of(a, [k])[0]) == g][:3]
        if keys:  # B adds to the windows meanwhile
            t = [max(a.watermark, b.watermark) + 50] * len(keys)
            outs += b.process(_table(keys, t, [7] * len(keys)))
            played.append(("batch", (keys, t, [7] * len(keys))))
        _move(b, a, g, task=True)
        if moved and rng.random() < 0.5:
            _move(b, a, moved.pop(), task=True)
        else:
            g = int(rng.choice(np.flatnonzero(a.engine.held)))
            _move(a, b, g, task=True)
            moved.append(g)
    outs += _play(route, [("wm", 10**9)])
    played.append(("wm", 10**9))
    ref = _proc(tmp_path, "ref", flow)
    want = Counter(_rows(_play(_single(ref), played)))
    assert Counter(_rows(outs)) == want
    for p in (ref, a, b):
        p.close()


def test_move_catch_up_changes_carry_the_windows_held_in_memory(tmp_path: Path) -> None:
    """A move copies the files (snapshot + tracked writes), then sends the changes in catch-up
    rounds: the snapshot plus the changes equals the instance's state."""
    flow = _flow(_op("sliding", 0))
    script = _script(13, 200, "int")
    proc = _proc(tmp_path, "p", flow)
    _play(_single(proc), script[:80])
    snap = proc.backend.snapshot(tmp_path / "snap")
    proc.backend.track_writes()
    _play(_single(proc), script[80:])
    changes = move_files.take_changes(SimpleNamespace(processor=proc))
    copy_ = _proc(tmp_path, "copy", flow)
    copy_.backend.restore_key_groups(snap, range(KGS))
    copy_.backend.import_chunk(changes)
    proc.backend.flush_cache()
    assert _stored(copy_, "int") == _stored(proc, "int")
    assert _stored(proc, "int")  # windows were open
    proc.close()
    copy_.close()


def test_outgoing_sub_groups_do_not_fire(tmp_path: Path) -> None:
    """During a rescale the windows of sub-groups handed out fire at their new owner only."""
    flow = _flow(_op("tumbling", 0))
    proc = _proc(tmp_path, "p", flow)
    keys = list(range(40))
    proc.process(_table(keys, [10] * 40, [1] * 40))
    g = _group_of(proc, keys)
    out_g = int(g[0])
    pairs = list(zip(keys, g.tolist(), strict=True))
    proc.engine.task = SimpleNamespace(incoming=set(), outgoing={out_g}, active=True)
    rows = _rows(proc.on_watermark(SIZE))
    assert sorted(r[0] for r in rows) == sorted(k for k, x in pairs if x != out_g)
    proc.engine.task = None
    rows = _rows(proc.on_watermark(SIZE + 1))
    assert sorted(r[0] for r in rows) == sorted(k for k, x in pairs if x == out_g)
    proc.close()


def test_oracle_copy_is_independent() -> None:  # the oracle itself: updates are by value
    o = Oracle("tumbling", 0)
    o.batch([1], [5], [2], -1)
    c = copy.deepcopy(o.open)
    o.batch([1], [6], [3], -1)
    assert c[(1, 0)] == [1, 2, 0] and o.open[(1, 0)] == [2, 5, 0]
