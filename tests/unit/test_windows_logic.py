"""Window logic (raystream.operators.window_logic) against brute-force Python oracles.

A small driver plays the runtime's part with plain dicts: per key the stored windows, a set of
(key, time) timers fired when the watermark (max time seen minus a delay) passes them, and a
final watermark of +infinity. Inputs are random, out of order, with some records far behind
(late)."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from raystream.operators import aggregations as A
from raystream.operators.aggregations import Rows
from raystream.operators.window_logic import (
    FixedWindows,
    SessionWindows,
    _session_ids,
    sliding_assign,
    tumbling_starts,
)

END = np.iinfo(np.int64).max


# ------------------------------------------------------------------------------------------
# assignment


def test_tumbling_starts_vs_floor_division() -> None:
    rng = np.random.default_rng(0)
    t = rng.integers(-(10**12), 10**12, 5000)
    for size, offset in ((1, 0), (7, 0), (60_000, 0), (60_000, 13_000), (86_400_000, -5)):
        got = tumbling_starts(t, size, offset)
        exp = [offset + ((x - offset) // size) * size for x in t.tolist()]
        assert got.tolist() == exp


@pytest.mark.parametrize(
    ("size", "slide", "offset"), [(30, 10, 0), (25, 10, 0), (10, 10, 3), (7, 3, 1), (100, 1, 0)]
)
def test_sliding_assign_vs_brute_force(size, slide, offset) -> None:
    rng = np.random.default_rng(size * slide)
    t = rng.integers(-500, 500, 300)
    rec, start = sliding_assign(t, size, slide, offset)
    got = sorted(zip(rec.tolist(), start.tolist(), strict=True))
    exp = sorted(
        (i, s)
        for i, x in enumerate(t.tolist())
        for s in range(x - size - slide, x + 1)
        if (s - offset) % slide == 0 and s <= x < s + size
    )
    assert got == exp


def test_session_ids_vs_sorted_scan() -> None:
    rng = np.random.default_rng(1)
    key = rng.integers(0, 8, 600)
    start = rng.integers(0, 5000, 600)
    end = start + rng.integers(1, 60, 600)
    ids = _session_ids(key, start, end)
    for k in range(8):
        rows = sorted(
            (s, e, i) for i, (kk, s, e) in enumerate(zip(key, start, end, strict=True)) if kk == k
        )
        cur_end = -math.inf
        cur_id = None
        for s, e, i in rows:
            if s >= cur_end:  # a new session
                assert ids[i] not in set(ids[key != k]), "ids must differ across keys"
                cur_id = ids[i]
            assert ids[i] == cur_id
            cur_end = max(cur_end, e)
        assert len({ids[i] for _, _, i in rows}) == sum(
            1
            for j, (s, _, _) in enumerate(rows)
            if s >= max([-math.inf] + [r[1] for r in rows[:j]])
        )


# ------------------------------------------------------------------------------------------
# the driver


def make_events(seed: int, n: int, keys: int, late_fraction: float) -> list[tuple[Any, int, int]]:
    """(key, time, x) in arrival order: a clock moving forward with jitter; some far behind."""
    rng = np.random.default_rng(seed)
    clock = np.cumsum(rng.integers(0, 40, n))
    jitter = rng.integers(0, 300, n)
    far = rng.random(n) < late_fraction
    t = (clock - jitter - far * rng.integers(1000, 5000, n)) // 10 * 10  # coarse: ties happen
    k = rng.integers(0, keys, n)
    key = [f"k{v}" if v % 2 else int(v) for v in k.tolist()]  # mixed: the driver never compares
    return [(key[i], int(t[i]), int(rng.integers(-50, 50))) for i in range(n)]


class Driver:
    """The runtime's part in plain Python: state per key, timers, watermark = max seen - delay."""

    def __init__(self, logic: Any, delay: int) -> None:
        self.logic = logic
        self.delay = delay
        self.state: dict[Any, Any] = {}
        self.timers: set[tuple[Any, int]] = set()
        self.watermark: int | None = None
        self.max_seen: int | None = None
        self.emitted: list[tuple[Any, int, int, dict[str, Any], int]] = []  # + wm at emission
        self.late: list[tuple[int, int, int]] = []  # (record id, window start, window end)

    def _take(self, keys: list[Any], res: Any) -> None:
        for k, v in zip(keys, res.state, strict=True):
            if v is None:
                self.state.pop(k, None)
            else:
                self.state[k] = v
        out = self.logic.agg.result(res.emit.parts) if len(res.emit) else {}
        for j in range(len(res.emit)):
            row = {name: (out[name][j]) for name in out}
            key = keys[int(res.emit.key[j])]
            wm = self.watermark
            self.emitted.append((key, int(res.emit.start[j]), int(res.emit.end[j]), row, wm))
        for k, ts in zip(res.timer_key.tolist(), res.timer_ts.tolist(), strict=True):
            self.timers.add((keys[k], ts))

    def advance(self, wm: int) -> None:
        if self.watermark is not None and wm <= self.watermark:
            return
        self.watermark = wm
        due = {kt for kt in self.timers if kt[1] <= wm}
        self.timers -= due
        keys = list(dict.fromkeys(k for k, _ in due))
        if keys:
            self._take(keys, self.logic.on_timer([self.state.get(k) for k in keys], wm))

    def batch(self, events: list[tuple[int, Any, int, int]]) -> None:
        """events: (record id, key, time, x)."""
        keys = list(dict.fromkeys(e[1] for e in events))
        pos = {k: i for i, k in enumerate(keys)}
        key_index = np.array([pos[e[1]] for e in events], np.int64)
        times = np.array([e[2] for e in events], np.int64)
        rows = Rows(pa.record_batch({"x": [e[3] for e in events], "id": [e[0] for e in events]}))
        res = self.logic.on_batch(
            key_index, times, rows, [self.state.get(k) for k in keys], self.watermark
        )
        ids = [e[0] for e in events]
        self.late += [
            (ids[r], s, e)
            for r, s, e in zip(
                res.late_record.tolist(),
                res.late_start.tolist(),
                res.late_end.tolist(),
                strict=True,
            )
        ]
        self._take(keys, res)

    def run(self, events: list[tuple[Any, int, int]], seed: int) -> list[int | None]:
        """Feed events in random-sized batches; returns the watermark each record saw."""
        rng = np.random.default_rng(seed)
        seen: list[int | None] = []
        i = 0
        while i < len(events):
            n = int(rng.integers(1, 60))
            chunk = [(i + j, *events[i + j]) for j in range(min(n, len(events) - i))]
            self.batch(chunk)
            seen += [self.watermark] * len(chunk)
            self.max_seen = max([self.max_seen or -(2**62)] + [e[2] for e in chunk])
            self.advance(self.max_seen - self.delay)
            i += len(chunk)
        self.advance(END)
        return seen


def _agg():
    return A.as_aggregation([A.count(), A.sum("x"), A.min("x"), A.top_k("x", 2)], "test")


def _summary(xs: list[int]) -> dict[str, Any]:
    return {
        "count": len(xs),
        "x_sum": sum(xs),
        "x_min": min(xs),
        "x_top_k": sorted(xs, reverse=True)[:2],
    }


def _row(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "count": int(row["count"]),
        "x_sum": int(row["x_sum"]),
        "x_min": int(row["x_min"]),
        "x_top_k": list(row["x_top_k"]),
    }


# ------------------------------------------------------------------------------------------
# tumbling and sliding


@pytest.mark.parametrize(
    ("size", "slide", "lateness", "seed"),
    [(100, 100, 0, 1), (100, 100, 250, 2), (300, 100, 0, 3), (250, 100, 120, 4), (100, 30, 0, 5)],
)
def test_fixed_windows_vs_per_record_oracle(size, slide, lateness, seed) -> None:
    events = make_events(seed, 3000, keys=12, late_fraction=0.05)
    logic = FixedWindows(_agg(), lateness, size, slide)
    d = Driver(logic, delay=201)  # watermarks end in 9, as window ends - 1 do: boundaries hit
    seen = d.run(events, seed)

    # oracle: every (record, window) pair by brute force; late iff end - 1 + lateness <= the
    # watermark when the record arrived
    windows: dict[tuple[Any, int], list[int]] = defaultdict(list)
    late = []
    for rid, ((key, t, x), wm) in enumerate(zip(events, seen, strict=True)):
        for s in range(t - size - slide, t + 1):
            if s % slide or not (s <= t < s + size):
                continue
            if wm is not None and s + size - 1 + lateness <= wm:
                late.append((rid, s, s + size))
            else:
                windows[(key, s)].append(x)
    assert late, "the input must have late records"
    assert sorted(d.late) == sorted(late)

    last: dict[tuple[Any, int], dict[str, Any]] = {}
    per_window = Counter()
    for key, s, e, row, wm in d.emitted:
        assert e == s + size
        assert wm is not None and e - 1 <= wm, f"window {(key, s, e)} emitted early at {wm}"
        last[(key, s)] = _row(row)
        per_window[(key, s)] += 1
    assert set(last) == set(windows)
    for kw, xs in windows.items():
        assert last[kw] == _summary(xs), kw
    if lateness == 0:
        assert set(per_window.values()) == {1}, "without lateness every window fires once"
    else:
        assert max(per_window.values()) > 1, "late-but-allowed records must re-emit"
    assert not d.state, "every window must be cleaned up after the final watermark"
    assert not d.timers


# ------------------------------------------------------------------------------------------
# sessions


def _sessions_scan(times_x: list[tuple[int, int]], gap: int) -> list[tuple[int, int, list[int]]]:
    """Sorted scan: a new session when a time is at or past the current session's end."""
    out: list[tuple[int, int, list[int]]] = []
    for t, x in sorted(times_x):
        if out and t < out[-1][1]:
            s, e, xs = out[-1]
            out[-1] = (s, max(e, t + gap), [*xs, x])
        else:
            out.append((t, t + gap, [x]))
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sessions_without_late_records_vs_sorted_scan(seed) -> None:
    events = make_events(seed, 2500, keys=9, late_fraction=0.0)  # jitter < delay: none late
    gap = 150
    d = Driver(SessionWindows(_agg(), 0, gap), delay=400)
    d.run(events, seed)
    assert not d.late
    by_key: dict[Any, list[tuple[int, int]]] = defaultdict(list)
    for key, t, x in events:
        by_key[key].append((t, x))
    expected = sorted(
        (repr(k), s, e, tuple(sorted(xs)))
        for k, v in by_key.items()
        for s, e, xs in _sessions_scan(v, gap)
    )
    got_rows = {(repr(k), s, e): _row(r) for k, s, e, r, _ in d.emitted}
    assert len(got_rows) == len(d.emitted), "a session was emitted twice"
    assert sorted(got_rows) == [x[:3] for x in expected]
    for k, s, e, xs in expected:
        assert got_rows[(k, s, e)] == _summary(list(xs))
    # merging happened: some session holds records that arrived out of order across batches
    assert any(len(xs) > 3 for *_, xs in expected)
    assert not d.state and not d.timers


@pytest.mark.parametrize(("lateness", "seed"), [(0, 7), (300, 8)])
def test_sessions_with_late_records_vs_python_model(lateness, seed) -> None:
    events = make_events(seed, 2500, keys=9, late_fraction=0.06)
    gap = 120
    delay = 201
    d = Driver(SessionWindows(_agg(), lateness, gap), delay=delay)
    batches: list[list[int]] = []
    orig_batch = d.batch

    def record_batch(chunk):
        batches.append([c[0] for c in chunk])
        orig_batch(chunk)

    d.batch = record_batch  # type: ignore[method-assign]
    d.run(events, seed)

    # the model: plain lists, replaying the same batches and watermarks
    sessions: dict[Any, list[list[Any]]] = defaultdict(list)  # [start, end, xs, fired]
    emitted: list[tuple[Any, int, int, tuple[int, ...]]] = []
    late: list[int] = []

    def advance(w):
        for k, ss in sessions.items():
            keep = []
            for s in ss:
                if not s[3] and s[1] - 1 <= w:
                    s[3] = True
                    emitted.append((repr(k), s[0], s[1], tuple(sorted(s[2]))))
                if s[1] - 1 + lateness > w:
                    keep.append(s)
            ss[:] = keep

    wm = None
    max_seen = None
    for ids in batches:
        if wm is not None:
            advance(wm)
        by_key: dict[Any, list[list[Any]]] = defaultdict(list)
        for i in ids:
            k, t, x = events[i]
            by_key[k].append([t, t + gap, [x], False, [i]])
        for k, new in by_key.items():
            items = [[s[0], s[1], s[2], s[3], []] for s in sessions[k]] + new
            items.sort(key=lambda it: it[0])
            merged: list[list[Any]] = []
            for it in items:
                if merged and it[0] < merged[-1][1]:
                    m = merged[-1]
                    m[1] = max(m[1], it[1])
                    m[2] = m[2] + it[2]
                    m[4] = m[4] + it[4]
                else:
                    merged.append([it[0], it[1], list(it[2]), it[3] and not it[4], list(it[4])])
            out = []
            for m in merged:
                if m[4] and wm is not None and m[1] - 1 + lateness <= wm:
                    late.extend(m[4])
                    continue
                if m[4]:
                    m[3] = wm is not None and m[1] - 1 <= wm
                    if m[3]:
                        emitted.append((repr(k), m[0], m[1], tuple(sorted(m[2]))))
                out.append(m[:4])
            sessions[k] = out
        max_seen = max(
            [max_seen if max_seen is not None else -(2**62)] + [events[i][1] for i in ids]
        )
        new_wm = max_seen - delay
        if wm is None or new_wm > wm:
            wm = new_wm
    advance(END)

    assert late, "the input must have late records"
    assert sorted(r for r, _, _ in d.late) == sorted(late)
    got = sorted((repr(k), s, e, _row(r)["count"], _row(r)["x_sum"]) for k, s, e, r, _ in d.emitted)
    exp = sorted((k, s, e, len(xs), sum(xs)) for k, s, e, xs in emitted)
    assert got == exp
    if lateness:
        assert len(exp) > len({x[:2] for x in exp}), "allowed lateness must re-emit some session"
    assert not d.state and not d.timers


# ------------------------------------------------------------------------------------------
# stored values


@pytest.mark.parametrize("objects", [False, True], ids=["packed", "objects"])
def test_window_table_state_round_trip(objects: bool) -> None:
    """to_state/from_state keep every window of every key (bytes values: packed records, or a
    pickled dict when a partial holds objects); keys without windows store None; values of two
    layouts read together."""
    from raystream.operators.window_logic import WindowTable

    rng = np.random.default_rng(3)
    n_keys, n = 40, 300
    key = rng.integers(0, n_keys, n)
    parts: dict[str, np.ndarray] = {"c": rng.integers(-9, 9, n), "s": rng.normal(size=n)}
    if objects:
        obj = np.empty(n, object)
        obj[:] = [[int(x)] for x in rng.integers(0, 5, n)]
        parts["top"] = obj
    table = WindowTable(key, rng.integers(0, 10**12, n), rng.integers(0, 10**12, n),
                        rng.random(n) < 0.5, parts)  # fmt: skip
    values = table.to_state(n_keys)
    assert all(v is None or isinstance(v, bytes) for v in values)
    assert [v is not None for v in values] == [k in set(key.tolist()) for k in range(n_keys)]
    back = WindowTable.from_state(values)

    def rows(t: WindowTable) -> list[tuple[Any, ...]]:
        cols = [t.key, t.start, t.end, t.fired, *(t.parts[p] for p in sorted(t.parts))]
        return sorted(tuple(map(repr, r)) for r in zip(*[c.tolist() for c in cols], strict=True))

    assert rows(back) == rows(table)
    other_parts = {"c": np.array([7], np.int32), "s": np.array([0.5])}  # c: another dtype
    if objects:
        other_parts["top"] = parts["top"][:1]
    other = WindowTable(np.array([0]), np.array([1]), np.array([2]), np.array([True]), other_parts)
    mixed = [*values, other.to_state(1)[0]]
    both = WindowTable.from_state(mixed)
    assert len(both) == n + 1
    assert both.key.max() == n_keys
