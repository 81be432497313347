"""Typed keyed state over RocksDB: vectorised value state and per-key handles vs python dict oracles."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from raystream.errors import DataflowDefinitionError, StateError
from raystream.keys import KeySpace
from raystream.state.handles import (
    KeyedStates,
    KeySet,
    ListHandle,
    MapHandle,
    StateNamespace,
    ValueHandle,
    VectorValueState,
)
from raystream.state.rocks import RocksStateBackend
from raystream.state.spec import ListState, MapState, ValueState, check_state_specs, codec_for

KS = KeySpace(128, 16)


@pytest.fixture
def backend(tmp_path: Path):
    b = RocksStateBackend(tmp_path / "db")
    yield b
    b.close()


def _keys(kind: str, n: int, rng: np.random.Generator) -> list:
    if kind == "int":
        return rng.choice(np.arange(-50, 50), size=n, replace=False).tolist()
    return [f"k{i}-é" for i in rng.choice(200, size=n, replace=False)]


@pytest.mark.parametrize("kind", ["int", "str"])
@pytest.mark.parametrize(
    ("dtype", "default", "gen"),
    [
        (int, 0, lambda rng, n: rng.integers(-(2**62), 2**62, size=n)),
        (float, 1.5, lambda rng, n: rng.normal(size=n)),
        (object, None, lambda rng, n: [{"v": int(x), "l": [int(x)] * 2} for x in rng.integers(0, 9, n)]),
        (bytes, None, lambda rng, n: [rng.bytes(int(k)) for k in rng.integers(0, 12, n)]),
    ],
    ids=["int", "float", "object", "bytes"],
)
def test_vector_value_state_vs_dict(backend, kind, dtype, default, gen) -> None:
    rng = np.random.default_rng(0)
    st = VectorValueState(backend, 1, ValueState(dtype, default=default), KS)
    oracle: dict = {}
    universe = _keys(kind, 60, rng)
    for _ in range(40):
        keys = rng.choice(len(universe), size=int(rng.integers(1, 20)), replace=False)
        ks = [universe[i] for i in keys]
        op = rng.choice(["get", "put", "put", "delete"])
        if op == "put":
            vals = gen(rng, len(ks))
            st.put(ks if rng.random() < 0.5 else KeySet.of(ks, KS), vals)
            for k, v in zip(ks, list(vals)):
                oracle[k] = v
        elif op == "delete":
            st.delete(ks)
            for k in ks:
                oracle.pop(k, None)
        got = st.get(ks)
        expected = [oracle.get(k, default) for k in ks]
        if dtype in (int, float):
            assert isinstance(got, np.ndarray)
            assert got.dtype == (np.int64 if dtype is int else np.float64)
            np.testing.assert_array_equal(got, np.array(expected, dtype=got.dtype))
        else:
            assert got == expected


def test_vector_value_state_put_length_mismatch(backend) -> None:
    st = VectorValueState(backend, 1, ValueState(int, default=0), KS)
    with pytest.raises(StateError, match="got 2 values for 3 keys"):
        st.put([1, 2, 3], [1, 2])


def test_states_are_isolated_by_state_id_and_key(backend) -> None:
    a = VectorValueState(backend, 1, ValueState(int, default=-1), KS)
    b = VectorValueState(backend, 2, ValueState(int, default=-2), KS)
    a.put([1, 2], [10, 20])
    assert b.get([1, 2]).tolist() == [-2, -2]
    assert a.get([3, 1]).tolist() == [-1, 10]
    # "a" is a prefix of "ab" as bytes: the length prefix keeps them apart
    s = VectorValueState(backend, 3, ValueState(object), KS)
    s.put(["a", "ab"], ["A", "AB"])
    assert s.get(["ab", "a", "abc"]) == ["AB", "A", None]


def test_at_gives_per_key_handle(backend) -> None:
    st = VectorValueState(backend, 1, ValueState(float, default=0.25), KS)
    ks = KeySet.of([7, 8], KS)
    st.put(ks, [3.5, 4.5])
    assert st.at(ks, 1).value == 4.5
    assert st.at(KeySet.of([9], KS), 0).value == 0.25


def test_vector_get_returns_writable_array(backend) -> None:
    st = VectorValueState(backend, 1, ValueState(int, default=0), KS)
    v = st.get([1, 2, 3])
    v += 1
    assert v.tolist() == [1, 1, 1]


def test_codecs_round_trip() -> None:
    for dtype, vals in [(int, [0, -1, 2**63 - 1, -(2**63)]), (float, [0.0, -1.5, 1e300]), (object, [None, (1, "x"), {"a": [1]}]), (bytes, [b"", b"\xff\x00", b"abc"])]:
        c = codec_for(dtype)
        assert [c.decode(c.encode(v)) for v in vals] == vals
        assert [c.decode(b) for b in c.encode_many(vals)] == vals


def test_bytes_state_is_stored_as_it_is(backend) -> None:
    """ValueState(bytes): the RocksDB value is the bytes themselves (no pickle around them);
    bytearray/memoryview are taken as bytes; anything else is refused with a hint."""
    st = VectorValueState(backend, 1, ValueState(bytes), KS)
    ks = KeySet.of([5, 6, 7], KS)
    st.put(ks, [b"\x00ab", bytearray(b"cd"), memoryview(b"")])
    assert backend.multi_get(ks.encoded(1)) == [b"\x00ab", b"cd", b""]
    assert st.get(KeySet.of([7, 8, 5], KS)) == [b"", None, b"\x00ab"]
    with pytest.raises(StateError, match=r"stores bytes, got str.*ValueState\(object\)"):
        st.put([1], ["text"])


# ---- KeyedStates: preload / handles_for / write_back ---------------------------------------------
@pytest.mark.parametrize("kind", ["int", "str"])
def test_keyed_states_value_list_map_vs_oracle(backend, kind) -> None:
    specs = {
        "total": ValueState(int, default=100),
        "last": ValueState(object, default="none"),
        "seen": ListState(),
        "per_tag": MapState(default_value=0),
    }
    states = KeyedStates(backend, specs, KS)
    rng = np.random.default_rng(1)
    universe = _keys(kind, 30, rng)
    o_total: dict = {}
    o_last: dict = {}
    o_seen: dict = {}
    o_tag: dict = {}
    for step in range(25):
        batch = [universe[i] for i in rng.choice(30, size=int(rng.integers(1, 12)), replace=False)]
        ks = KeySet.of(batch, KS)
        pre = states.preload(ks)
        for i, key in enumerate(batch):
            h = states.handles_for(pre, i)
            assert isinstance(h, StateNamespace)
            # reads see the oracle (defaults for new keys)
            assert h.total.value == o_total.get(key, 100)
            assert h.last.value == o_last.get(key, "none")
            assert h.seen.get() == o_seen.get(key, [])
            assert len(h.seen) == len(o_seen.get(key, []))
            assert dict(h.per_tag.items()) == o_tag.get(key, {})
            assert len(h.per_tag) == len(o_tag.get(key, {}))
            # writes
            tag = f"t{rng.integers(4)}"
            action = rng.choice(["inc", "clear_value", "map_del", "map_clear", "list_clear", "noop"])
            if action == "inc":
                h.total.value += step
                o_total[key] = o_total.get(key, 100) + step
                h.last.value = (step, key)
                o_last[key] = (step, key)
                h.seen.append(step)
                o_seen.setdefault(key, []).append(step)
                h.per_tag[tag] = h.per_tag.get(tag) + 1
                o_tag.setdefault(key, {})[tag] = o_tag.get(key, {}).get(tag, 0) + 1
                assert h.per_tag[tag] == o_tag[key][tag]
                assert tag in h.per_tag
            elif action == "clear_value":
                h.total.clear()
                o_total.pop(key, None)
                h.seen.extend([-1, -2])
                o_seen.setdefault(key, []).extend([-1, -2])
            elif action == "map_del" and o_tag.get(key):
                victim = next(iter(o_tag[key]))
                del h.per_tag[victim]
                del o_tag[key][victim]
                assert victim not in h.per_tag
                with pytest.raises(KeyError):
                    h.per_tag[victim]
            elif action == "map_clear":
                h.per_tag.clear()
                o_tag.pop(key, None)
                assert len(h.per_tag) == 0
            elif action == "list_clear":
                h.seen.clear()
                o_seen[key] = []
        states.write_back(ks, pre)
    # final state, read through the vectorised API and iter_values
    keys = list(universe)
    vec = states.vectorised()
    assert vec.total.get(keys).tolist() == [o_total.get(k, 100) for k in keys]
    assert vec.last.get(keys) == [o_last.get(k, "none") for k in keys]
    assert dict(states.iter_values("total", kind)) == o_total
    assert dict(states.iter_values("seen", kind)) == {k: v for k, v in o_seen.items()}
    ks = KeySet.of(keys, KS)
    for i, k in enumerate(keys):
        assert dict(vec.per_tag.at(ks, i).items()) == o_tag.get(k, {})
        assert dict(vec.per_tag.for_key(k, KS).items()) == o_tag.get(k, {})


def test_single_state_gets_the_handle_itself(backend) -> None:
    specs = check_state_specs(ValueState(int, default=7), "s")
    states = KeyedStates(backend, specs, KS)
    ks = KeySet.of([1, 2], KS)
    pre = states.preload(ks)
    h = states.handles_for(pre, 0)
    assert isinstance(h, ValueHandle) and h.value == 7
    h.value = 8
    states.write_back(ks, pre)
    assert isinstance(states.vectorised(), VectorValueState)
    assert states.vectorised().get([1, 2]).tolist() == [8, 7]
    assert dict(states.iter_values("", "int")) == {1: 8}


def test_untouched_handles_are_not_written(backend) -> None:
    states = KeyedStates(backend, {"v": ValueState(int, default=3), "l": ListState()}, KS)
    ks = KeySet.of(["a", "b"], KS)
    pre = states.preload(ks)
    states.handles_for(pre, 0).v.value = 3  # explicitly set, even to the default: written
    states.write_back(ks, pre)
    assert backend.count_rows() == 1
    assert dict(states.iter_values("v", "str")) == {"a": 3}


def test_map_handles_of_neighbouring_keys_are_isolated(backend) -> None:
    states = KeyedStates(backend, {"m": MapState()}, KS)
    ks = KeySet.of(["a", "ab", "b"], KS)
    pre = states.preload(ks)
    hs = [states.handles_for(pre, i).m for i in range(3)]
    assert all(isinstance(h, MapHandle) for h in hs)
    hs[0]["x"] = 1
    hs[1]["x"] = 2
    hs[1][("t", 1)] = [3]
    assert dict(hs[0].items()) == {"x": 1}
    assert dict(hs[1].items()) == {"x": 2, ("t", 1): [3]}
    assert sorted(map(repr, hs[1].keys())) == sorted(map(repr, ["x", ("t", 1)]))
    assert len(hs[2]) == 0 and hs[2].get("x") is None and hs[2].get("x", 5) == 5
    hs[1].clear()
    assert dict(hs[0].items()) == {"x": 1}


def test_list_handle_indexing() -> None:
    h = ListHandle(None)
    assert len(h) == 0 and not h.dirty
    h.extend([1, 2, 3])
    assert h[1] == 2 and list(h) == [1, 2, 3] and h.dirty


def test_mutable_default_is_not_shared_between_keys(backend) -> None:
    spec = ValueState(list, default=[])
    states = KeyedStates(backend, {"": spec}, KS)
    ks = KeySet.of([1, 2], KS)
    pre = states.preload(ks)
    for i, key in enumerate([1, 2]):
        h = states.handles_for(pre, i)
        v = h.value
        v.append(key)
        h.value = v
    states.write_back(ks, pre)
    assert dict(states.iter_values("", "int")) == {1: [1], 2: [2]}
    assert spec.default == []


@pytest.mark.parametrize(
    ("state", "needle"),
    [
        (5, "got int: 5"),
        ({}, "got dict: {}"),
        ({"a": 5}, "got {'a': 5}"),
        ({"not an id": ValueState()}, "identifier"),
        ("value", "got str"),
    ],
)
def test_check_state_specs_rejects(state, needle) -> None:
    with pytest.raises(DataflowDefinitionError) as ei:
        check_state_specs(state, "st")
    assert needle in str(ei.value) and "'st'" in str(ei.value)
