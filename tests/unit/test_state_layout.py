"""RocksDB key layout: vectorised encoding, range bounds of sub-groups / key groups, decoding."""

from __future__ import annotations

import struct

import numpy as np
import pyarrow as pa
import pytest

from raystream.state.layout import (
    PREFIX_LEN,
    decode_user_key,
    encode_keys,
    encode_one,
    key_group_bounds,
    split_prefix,
    sub_group_bounds,
)

INTS = [0, 1, -1, 255, 256, -256, 2**31, -(2**31), 2**63 - 1, -(2**63), 123456789]
STRS = ["", "a", "ab", "é", "日本語", "🙂x", "\x00", "\xff", "a" * 300]


def ref_encode(kg: int, sg: int, sid: int, key: object) -> bytes:
    """The documented layout, written independently with struct."""
    head = struct.pack(">HBB", kg, sg, sid)
    if isinstance(key, int):
        return head + struct.pack(">Q", (key + (1 << 63)) % (1 << 64))  # sign bit flipped
    raw = key.encode("utf-8") if isinstance(key, str) else key
    return head + struct.pack(">I", len(raw)) + raw


def _groups(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    kg = rng.integers(0, 32768, size=n).astype(np.uint16)
    sg = rng.integers(0, 256, size=n).astype(np.uint8)
    kg[:4] = [0, 32767, 0, 32767]
    sg[:4] = [0, 255, 255, 0]
    return kg, sg


@pytest.mark.parametrize("sid", [0, 1, 7, 255])
def test_encode_keys_int_matches_encode_one_and_reference(sid) -> None:
    rng = np.random.default_rng(sid)
    keys = INTS + rng.integers(-(2**63), 2**63 - 1, size=500, dtype=np.int64).tolist()
    kg, sg = _groups(len(keys), rng)
    got = encode_keys(kg, sg, sid, pa.array(keys, pa.int64()))
    assert all(isinstance(b, bytes) and len(b) == PREFIX_LEN + 8 for b in got)
    assert got == [encode_one(int(g), int(s), sid, k) for g, s, k in zip(kg, sg, keys)]
    assert got == [ref_encode(int(g), int(s), sid, k) for g, s, k in zip(kg, sg, keys)]


@pytest.mark.parametrize("sid", [1, 200])
def test_encode_keys_str_and_bytes_match_encode_one_and_reference(sid) -> None:
    rng = np.random.default_rng(sid)
    keys = STRS + [f"user-{i}" for i in range(200)]
    kg, sg = _groups(len(keys), rng)
    got = encode_keys(kg, sg, sid, pa.array(keys, pa.string()))
    assert got == [encode_one(int(g), int(s), sid, k) for g, s, k in zip(kg, sg, keys)]
    assert got == [ref_encode(int(g), int(s), sid, k) for g, s, k in zip(kg, sg, keys)]
    bkeys = [k.encode() for k in keys]
    gotb = encode_keys(kg, sg, sid, pa.array(bkeys, pa.binary()))
    assert gotb == got  # same bytes, same layout
    assert gotb == [encode_one(int(g), int(s), sid, k) for g, s, k in zip(kg, sg, bkeys)]


def test_int_encoding_preserves_signed_order_within_a_prefix() -> None:
    keys = sorted(set(INTS + list(range(-300, 300, 7))))
    enc = [encode_one(9, 3, 1, k) for k in keys]
    assert enc == sorted(enc)


@pytest.mark.parametrize("kind", ["int", "str", "bytes"])
def test_decode_round_trip(kind) -> None:
    keys: list = {"int": INTS, "str": STRS, "bytes": [s.encode() for s in STRS]}[kind]
    for i, k in enumerate(keys):
        kg, sg, sid = (i * 977) % 32768, (i * 31) % 256, (i * 7) % 256
        raw = encode_one(kg, sg, sid, k)
        tail = b"mapkey-suffix"
        key, end = decode_user_key(raw + tail, kind)
        assert key == k and type(key) is type(k)
        assert (raw + tail)[end:] == tail  # self-delimiting: map entries can follow
        assert split_prefix(raw) == (kg, sg, sid)


def test_decode_negative_ints_from_vectorised_encoding() -> None:
    keys = [-(2**63), -12345, -1]
    enc = encode_keys(np.zeros(3, np.uint16), np.zeros(3, np.uint8), 1, pa.array(keys, pa.int64()))
    assert [decode_user_key(e, "int")[0] for e in enc] == keys


def _pad(b: bytes) -> bytes:
    return b.ljust(PREFIX_LEN, b"\x00")


EDGE_GROUPS = [(0, 0), (0, 1), (0, 255), (1, 0), (127, 15), (32767, 0), (32767, 254), (32767, 255), (255, 255)]


def _neighbourhood(kg: int, sg: int) -> list[tuple[int, int]]:
    out = []
    for dk in (-1, 0, 1):
        for ds in (-1, 0, 1):
            g, s = kg + dk, sg + ds
            if 0 <= g <= 32767 and 0 <= s <= 255:
                out.append((g, s))
    # also wrap-around neighbours: last sub-group of the previous / first of the next key group
    out += [(g, s) for g, s in [(kg - 1, 255), (kg + 1, 0), (kg, 0), (kg, 255)] if 0 <= g <= 32767]
    return out


@pytest.mark.parametrize(("kg", "sg"), EDGE_GROUPS)
def test_sub_group_bounds_contain_exactly_that_sub_group(kg, sg) -> None:
    lower, upper = sub_group_bounds(kg, sg)
    assert lower < upper
    rng = np.random.default_rng(kg * 256 + sg)
    ints = INTS + rng.integers(-(2**63), 2**63 - 1, size=20, dtype=np.int64).tolist()
    for g, s in _neighbourhood(kg, sg):
        for sid in (0, 1, 128, 255):
            for k in ints + STRS:
                raw = ref_encode(g, s, sid, k)
                inside = lower <= raw < upper
                assert inside == ((g, s) == (kg, sg)), (g, s, sid, k)


@pytest.mark.parametrize("kg", [0, 1, 127, 255, 256, 32766, 32767])
def test_key_group_bounds_contain_exactly_that_key_group(kg) -> None:
    lower, upper = key_group_bounds(kg)
    for g in {max(kg - 1, 0), kg, min(kg + 1, 32767)}:
        for s in (0, 1, 254, 255):
            for sid in (0, 255):
                for k in INTS + STRS:
                    raw = ref_encode(g, s, sid, k)
                    assert (lower <= raw < upper) == (g == kg)
    # each of its sub-group ranges lies inside (compared as 4-byte prefixes: every state key has
    # at least PREFIX_LEN bytes, so b"\x00\x80" and b"\x00\x80\x00" bound the same keys)
    for s in range(256):
        sl, su = sub_group_bounds(kg, s)
        assert _pad(lower) <= _pad(sl) and _pad(su) <= _pad(upper)


def test_sub_group_ranges_tile_the_key_group() -> None:
    kg = 4242
    bounds = [sub_group_bounds(kg, s) for s in range(256)]
    lower, upper = key_group_bounds(kg)
    assert _pad(bounds[0][0]) == _pad(lower)
    for (_, u), (l2, _) in zip(bounds, bounds[1:]):
        assert u == l2
    assert _pad(bounds[-1][1]) == _pad(upper)


@pytest.mark.parametrize("kind", ["str", "bytes"])
def test_encode_keys_of_sliced_arrays_with_empty_and_long_keys(kind) -> None:
    rng = np.random.default_rng(9)
    words = ["", "a", "é✓😀", "x" * 300] + [f"user-{i}-é" for i in range(500)]
    values = [words[i] for i in rng.integers(0, len(words), 800)]
    arr = pa.array(values) if kind == "str" else pa.array([v.encode() for v in values])
    for sl in (arr, arr.slice(7, 500), arr.slice(0, 0), arr.slice(799, 1)):
        kg = rng.integers(0, 32768, len(sl)).astype(np.uint16)
        sg = rng.integers(0, 256, len(sl)).astype(np.uint8)
        expected = [encode_one(int(g), int(s), 3, v) for g, s, v in zip(kg, sg, sl.to_pylist())]
        assert encode_keys(kg, sg, 3, sl) == expected
