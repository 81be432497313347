"""Keys: stable hashing, key groups / sub-groups, Flink ranges and routing tables vs independent oracles."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
import xxhash

from raystream.errors import ConfigError, NullKeyError, RaystreamError, SchemaError
from raystream.keys import (
    MAX_KEY_GROUPS,
    MAX_SUB_GROUPS,
    KeyGroupRange,
    KeySpace,
    RoutingTable,
    key_kind,
    stable_hash,
    to_key_array,
)

MASK64 = (1 << 64) - 1


def ref_fmix64(k: int) -> int:
    """MurmurHash3 fmix64 on Python ints (independent of numpy)."""
    h = k & MASK64
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & MASK64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & MASK64
    h ^= h >> 33
    return h


EDGE_INTS = [0, 1, -1, 2, 42, -42, 2**31, -(2**31), 2**62, 2**63 - 1, -(2**63)]


# ---- stable_hash ------------------------------------------------------------------------------
def test_int_hash_matches_reference_fmix64() -> None:
    rng = np.random.default_rng(1)
    keys = EDGE_INTS + rng.integers(-(2**63), 2**63 - 1, size=2000, dtype=np.int64).tolist()
    got = stable_hash(keys)
    assert got.dtype == np.uint64
    assert got.tolist() == [ref_fmix64(k) for k in keys]


def test_fmix64_is_not_identity_and_spreads() -> None:
    # the reference itself: 0 is a fixed point of fmix64, 1 is not
    assert ref_fmix64(0) == 0
    h = stable_hash(np.arange(1, 1001, dtype=np.int64))
    assert len(set(h.tolist())) == 1000
    assert not np.array_equal(h, np.arange(1, 1001, dtype=np.uint64))


def test_string_hash_is_xxh3_of_utf8() -> None:
    keys = ["", "a", "b", "hello", "héllo", "日本語", "🙂", "a" * 1000, "a", "hello", ""]
    got = stable_hash(keys)
    assert got.tolist() == [xxhash.xxh3_64_intdigest(k.encode("utf-8")) for k in keys]


def test_binary_hash_is_xxh3_of_bytes() -> None:
    keys = [b"", b"\x00", b"\xff\xfe", b"abc", b"abc"]
    got = stable_hash(pa.array(keys, pa.binary()))
    assert got.tolist() == [xxhash.xxh3_64_intdigest(k) for k in keys]


@pytest.mark.parametrize(
    "arr",
    [
        pa.array(["x", "y", "x", "zz"], pa.large_string()),
        pa.array(["x", "y", "x", "zz"]).dictionary_encode(),
        pa.chunked_array([["x", "y"], ["x", "zz"]]),
        np.array(["x", "y", "x", "zz"]),
    ],
    ids=["large_string", "dictionary", "chunked", "numpy"],
)
def test_string_representations_hash_alike(arr) -> None:
    expected = [xxhash.xxh3_64_intdigest(s.encode()) for s in ["x", "y", "x", "zz"]]
    assert stable_hash(arr).tolist() == expected


@pytest.mark.parametrize("typ", [pa.int8(), pa.int16(), pa.int32(), pa.uint8(), pa.uint32(), pa.int64()])
def test_int_widths_hash_alike(typ) -> None:
    vals = [0, 1, 5, 100, 127]
    assert stable_hash(pa.array(vals, typ)).tolist() == [ref_fmix64(v) for v in vals]


def test_hash_stable_across_processes_with_different_hash_seeds() -> None:
    keys = ["alpha", "beta", "日本", "", "x" * 50]
    ints = [-5, 0, 7, 2**40]
    code = (
        "import json, sys; from raystream.keys import stable_hash;"
        "ks=json.loads(sys.argv[1]); ints=json.loads(sys.argv[2]);"
        "print(json.dumps([stable_hash(ks).tolist(), stable_hash(ints).tolist(), hash(ks[0])]))"
    )
    outs = []
    for seed in ("1", "987654"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        r = subprocess.run(
            [sys.executable, "-c", code, json.dumps(keys), json.dumps(ints)],
            env=env, capture_output=True, text=True, check=True, cwd="/tmp",
        )
        outs.append(json.loads(r.stdout))
    # the salted builtin hash differs, proving the seeds took effect ...
    assert outs[0][2] != outs[1][2]
    # ... while the stable hashes agree with each other and with this process
    assert outs[0][:2] == outs[1][:2] == [stable_hash(keys).tolist(), stable_hash(ints).tolist()]


# ---- to_key_array ------------------------------------------------------------------------------
def test_to_key_array_normalises_types() -> None:
    assert to_key_array(pa.array([1, 2], pa.int16())).type == pa.int64()
    assert to_key_array(np.array([1, 2], dtype=np.uint32)).type == pa.int64()
    assert to_key_array(pa.array(["a"], pa.large_string())).type == pa.string()
    assert to_key_array(pa.array([b"a"], pa.large_binary())).type == pa.binary()
    assert to_key_array(pa.chunked_array([[1], [2, 3]])).to_pylist() == [1, 2, 3]
    assert key_kind(to_key_array([1])) == "int"
    assert key_kind(to_key_array(["a"])) == "str"
    assert key_kind(to_key_array(pa.array([b"a"]))) == "bytes"


@pytest.mark.parametrize("keys", [[1, None, 3], ["a", None], pa.chunked_array([[1], [None]])])
def test_null_keys_raise_null_key_error(keys) -> None:
    with pytest.raises(NullKeyError) as ei:
        to_key_array(keys, column="user_id")
    msg = str(ei.value)
    assert "'user_id'" in msg and "1 null" in msg
    assert isinstance(ei.value, SchemaError)


@pytest.mark.parametrize(
    ("keys", "typ"),
    [([1.5, 2.5], "double"), ([True, False], "bool"), (pa.array([1, 2], pa.timestamp("ms")), "timestamp")],
)
def test_unsupported_key_types_raise_schema_error(keys, typ) -> None:
    with pytest.raises(SchemaError) as ei:
        to_key_array(keys, column="k")
    assert typ in str(ei.value) and "integer or string" in str(ei.value)


def test_uint64_overflow_is_schema_error() -> None:
    with pytest.raises(SchemaError):
        to_key_array(pa.array([2**63], pa.uint64()))


def test_mixed_python_key_list_is_schema_error() -> None:
    with pytest.raises(RaystreamError):
        to_key_array([1, "a"])


# ---- KeySpace -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, -1, MAX_KEY_GROUPS + 1, 1.5, "128", None])
def test_keyspace_rejects_bad_num_key_groups(n) -> None:
    with pytest.raises(ConfigError) as ei:
        KeySpace(n, 16)
    assert "num_key_groups" in str(ei.value) and repr(n) in str(ei.value)


@pytest.mark.parametrize("s", [0, -3, MAX_SUB_GROUPS + 1, 2.0])
def test_keyspace_rejects_bad_sub_groups(s) -> None:
    with pytest.raises(ConfigError) as ei:
        KeySpace(128, s)
    assert "sub_groups" in str(ei.value) and repr(s) in str(ei.value)


def test_keyspace_rejects_bool() -> None:
    with pytest.raises(ConfigError):
        KeySpace(True, 16)


def test_keyspace_accepts_bounds() -> None:
    for n, s in [(1, 1), (MAX_KEY_GROUPS, MAX_SUB_GROUPS), (128, 16)]:
        ks = KeySpace(n, s)
        kg, sg = ks.locate(np.arange(-500, 500, dtype=np.int64))
        assert kg.dtype == np.uint16 and sg.dtype == np.uint8
        assert kg.max() < n and sg.max() < s


@pytest.mark.parametrize(("n", "s"), [(128, 16), (100, 7), (32768, 256), (1, 32)])
def test_locate_matches_reference(n, s) -> None:
    ks = KeySpace(n, s)
    ints = EDGE_INTS + list(range(-200, 200))
    kg, sg = ks.locate(ints)
    assert kg.tolist() == [ref_fmix64(k) % n for k in ints]
    assert sg.tolist() == [(ref_fmix64(k) >> 32) % s for k in ints]
    strs = [f"user-{i}" for i in range(300)] + ["", "日本"]
    kg, sg = ks.locate(strs)
    hs = [xxhash.xxh3_64_intdigest(x.encode()) for x in strs]
    assert kg.tolist() == [h % n for h in hs]
    assert sg.tolist() == [(h >> 32) % s for h in hs]
    g = ks.global_sub_group(kg, sg)
    assert g.tolist() == [(h % n) * s + (h >> 32) % s for h in hs]


def _chi2(counts: np.ndarray) -> tuple[float, int]:
    expected = counts.sum() / counts.size
    return float(((counts - expected) ** 2 / expected).sum()), counts.size - 1


@pytest.mark.parametrize("kind", ["int", "str"])
def test_key_groups_and_sub_groups_are_balanced_and_independent(kind) -> None:
    ks = KeySpace(128, 16)
    n = 200_000
    keys = np.arange(n, dtype=np.int64) if kind == "int" else [f"k{i}" for i in range(n)]
    kg, sg = ks.locate(keys)
    # joint (key group, sub-group) table: 2048 cells of ~98 keys; chi-square ~ df +- sqrt(2 df)
    joint = np.bincount(ks.global_sub_group(kg, sg), minlength=128 * 16)
    stat, df = _chi2(joint)
    assert stat < df + 6 * np.sqrt(2 * df), (stat, df)
    assert joint.min() > 0
    # within one key group, the sub-groups are evenly filled (other bits than the key group)
    in_kg0 = sg[kg == 0]
    per_sg = np.bincount(in_kg0, minlength=16)
    assert (per_sg > 0).all()
    stat, df = _chi2(per_sg)
    assert stat < df + 6 * np.sqrt(2 * df), (stat, per_sg)


def test_sequential_ints_in_one_key_group_do_not_share_a_sub_group() -> None:
    # a power-of-two key-group count takes the low bits: the sub-group must use others
    ks = KeySpace(256, 256)
    kg, sg = ks.locate(np.arange(1_000_000, dtype=np.int64))
    counts = np.bincount(sg[kg == 3], minlength=256)  # ~15 keys per sub-group
    assert (counts > 0).all()
    stat, df = _chi2(counts)
    assert stat < df + 6 * np.sqrt(2 * df), stat


# ---- KeyGroupRange ------------------------------------------------------------------------------
def flink_range(max_p: int, p: int, i: int) -> tuple[int, int]:
    # org.apache.flink.runtime.state.KeyGroupRangeAssignment.computeKeyGroupRangeForOperatorIndex
    start = ((i * max_p) + p - 1) // p
    end = ((i + 1) * max_p - 1) // p
    return start, end


@pytest.mark.parametrize("n", [1, 7, 128, 1000, 32768])
def test_for_operator_index_partitions_key_groups(n) -> None:
    for p in sorted({min(n, q) for q in (1, 2, 3, 5, 7, 128)} | {n}):
        seen: list[int] = []
        for i in range(p):
            r = KeyGroupRange.for_operator_index(n, p, i)
            assert (r.start, r.end) == flink_range(n, p, i)
            assert len(r) == r.end - r.start + 1 >= 1
            assert list(r) == list(range(r.start, r.end + 1))
            seen.extend(r)
            # sizes differ by at most one
            assert n // p <= len(r) <= -(-n // p)
        assert seen == list(range(n))


def test_for_operator_index_validation() -> None:
    with pytest.raises(ConfigError, match=r"\[0, 4\), got 4"):
        KeyGroupRange.for_operator_index(128, 4, 4)
    with pytest.raises(ConfigError, match=r"\[0, 4\), got -1"):
        KeyGroupRange.for_operator_index(128, 4, -1)
    with pytest.raises(ConfigError, match=r"\[1, 128\].*got 129"):
        KeyGroupRange.for_operator_index(128, 129, 0)
    with pytest.raises(ConfigError, match="got 0"):
        KeyGroupRange.for_operator_index(128, 0, 0)
    with pytest.raises(ConfigError, match="must be an int"):
        KeyGroupRange.for_operator_index(128, True, 0)


def test_key_group_range_container() -> None:
    r = KeyGroupRange(3, 5)
    assert [g for g in range(10) if g in r] == [3, 4, 5]
    assert np.int64(4) in r and np.uint16(5) in r
    assert "4" not in r and 4.0 not in r
    empty = KeyGroupRange(5, 4)
    assert len(empty) == 0 and list(empty) == [] and 5 not in empty


# ---- RoutingTable -------------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "p"), [(128, 1), (128, 3), (128, 128), (10, 4), (32768, 7)])
def test_uniform_table_equals_flink_ranges(n, p) -> None:
    t = RoutingTable.uniform(n, p, epoch=5)
    assert t.epoch == 5 and t.parallelism == p and t.num_key_groups == n
    for i in range(p):
        s, e = flink_range(n, p, i)
        assert t.key_groups_of(i).tolist() == list(range(s, e + 1))
    # Flink's computeOperatorIndexForKeyGroup
    assert t.owners.tolist() == [g * p // n for g in range(n)]


def test_owner_of_vectorised_and_key_groups_of() -> None:
    rng = np.random.default_rng(3)
    owners = rng.integers(0, 5, size=128)
    t = RoutingTable(epoch=1, owners=owners, parallelism=5)
    kgs = rng.integers(0, 128, size=1000).astype(np.uint16)
    assert t.owner_of(kgs).tolist() == [int(owners[g]) for g in kgs]
    for i in range(5):
        assert t.key_groups_of(i).tolist() == [g for g in range(128) if owners[g] == i]
    all_kgs = sorted(g for i in range(5) for g in t.key_groups_of(i).tolist())
    assert all_kgs == list(range(128))


def test_moved_key_groups() -> None:
    a = RoutingTable.uniform(128, 3)
    b = RoutingTable.uniform(128, 4, epoch=1)
    assert a.moved_key_groups(b).tolist() == [g for g in range(128) if g * 3 // 128 != g * 4 // 128]
    assert a.moved_key_groups(a).tolist() == []


def test_routing_table_is_immutable_and_comparable() -> None:
    owners = [0, 1, 1, 0]
    t = RoutingTable(epoch=2, owners=owners, parallelism=2)
    owners[0] = 1  # the table copied its input
    assert t.owners.tolist() == [0, 1, 1, 0]
    with pytest.raises(ValueError):
        t.owners[0] = 1
    same = RoutingTable(epoch=2, owners=np.array([0, 1, 1, 0]), parallelism=2)
    assert t == same and hash(t) == hash(same)
    assert t != RoutingTable(epoch=3, owners=[0, 1, 1, 0], parallelism=2)
    assert t != RoutingTable(epoch=2, owners=[0, 1, 0, 0], parallelism=2)
    assert t.to_dict() == {"epoch": 2, "parallelism": 2, "owners": [0, 1, 1, 0]}


@pytest.mark.parametrize(
    ("owners", "p", "needle"),
    [
        ([0, 1, 2], 2, "got values in [0, 2]"),
        ([0, -1], 2, "got values in [-1, 0]"),
        ([0, 0], 3, "[1, 2]"),  # more instances than key groups
        ([0, 0], 0, "got 0"),
    ],
)
def test_routing_table_validation(owners, p, needle) -> None:
    with pytest.raises(ConfigError) as ei:
        RoutingTable(epoch=0, owners=owners, parallelism=p)
    assert needle in str(ei.value)


def test_uniform_validation() -> None:
    with pytest.raises(ConfigError, match="got 129"):
        RoutingTable.uniform(128, 129)
    with pytest.raises(ConfigError, match="must be an int"):
        RoutingTable.uniform(128, 2.0)  # type: ignore[arg-type]
