"""RocksDB key layout: ``[key_group u16][sub_group u8][state_id u8][user key]``, big-endian.

One sub-group is one contiguous key range, so it is exported by a range scan and dropped by
``delete_range``. User keys: int64 as 8 bytes big-endian with the sign bit flipped; strings and
binaries as a 4-byte big-endian length then the bytes (self-delimiting, so map entries can follow).
Map-state entries append the pickled map key after the user key.
"""

from __future__ import annotations

import struct

import numpy as np
import pyarrow as pa

__all__ = [
    "PREFIX_LEN",
    "decode_user_key",
    "encode_keys",
    "key_group_bounds",
    "split_prefix",
    "sub_group_bounds",
]

PREFIX_LEN = 4
_SIGN = np.uint64(1 << 63)
_INT_DTYPE = np.dtype([("kg", ">u2"), ("sg", "u1"), ("sid", "u1"), ("k", ">u8")])
_PREFIX = struct.Struct(">HBB")


def encode_keys(
    key_group: np.ndarray, sub_group: np.ndarray, state_id: int, keys: pa.Array
) -> list[bytes]:
    """Encode one state key per row (vectorised for int64 keys)."""
    n = len(keys)
    if keys.type == pa.int64():
        rows = np.empty(n, _INT_DTYPE)
        rows["kg"] = key_group
        rows["sg"] = sub_group
        rows["sid"] = state_id
        rows["k"] = keys.to_numpy(zero_copy_only=False).view(np.uint64) ^ _SIGN
        return rows.view("V12").tolist()
    # strings and binaries: [prefix][length u32 BE][bytes], built in one flat buffer
    raw = keys.cast(pa.binary()) if pa.types.is_string(keys.type) else keys
    offsets = np.frombuffer(raw.buffers()[1], np.int32)[raw.offset : raw.offset + n + 1]
    data = raw.buffers()[2]
    payload = (
        np.frombuffer(data, np.uint8)[offsets[0] : offsets[-1]]
        if data is not None and n
        else np.empty(0, np.uint8)
    )
    lengths = np.diff(offsets).astype(np.int64)
    out_offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths + 8, out=out_offsets[1:])
    out = np.empty(int(out_offsets[-1]), np.uint8)
    head = np.empty((n, 8), np.uint8)
    kg = np.asarray(key_group, dtype=np.uint16)
    head[:, 0] = kg >> 8
    head[:, 1] = kg & 0xFF
    head[:, 2] = np.asarray(sub_group, dtype=np.uint8)
    head[:, 3] = state_id
    head[:, 4:] = lengths.astype(">u4").view(np.uint8).reshape(n, 4)
    out[(out_offsets[:-1, None] + np.arange(8)).ravel()] = head.ravel()
    start = out_offsets[:-1] + 8 - (offsets[:-1] - offsets[0])
    out[np.repeat(start, lengths) + np.arange(len(payload))] = payload
    if out_offsets[-1] >= 1 << 31:  # (a batch of keys over 2 GiB) the slow path
        pack = _PREFIX.pack
        return [
            pack(int(g), int(s), state_id) + len(v).to_bytes(4, "big") + v
            for g, s, v in zip(key_group.tolist(), sub_group.tolist(), raw.to_pylist(), strict=True)
        ]
    built = pa.Array.from_buffers(
        pa.binary(), n, [None, pa.py_buffer(out_offsets.astype(np.int32)), pa.py_buffer(out)]
    )
    return built.to_pylist()  # type: ignore[no-any-return]


def encode_one(key_group: int, sub_group: int, state_id: int, key: object) -> bytes:
    """Encode a single state key (slow path, per key)."""
    head = _PREFIX.pack(key_group, sub_group, state_id)
    if isinstance(key, (int, np.integer)):
        return head + (int(key) & 0xFFFFFFFFFFFFFFFF ^ (1 << 63)).to_bytes(8, "big")
    raw = key.encode() if isinstance(key, str) else bytes(key)  # type: ignore[arg-type]
    return head + len(raw).to_bytes(4, "big") + raw


def split_prefix(raw: bytes) -> tuple[int, int, int]:
    """(key_group, sub_group, state_id) of an encoded state key."""
    return _PREFIX.unpack_from(raw)  # type: ignore[return-value]


def decode_user_key(raw: bytes, kind: str) -> tuple[object, int]:
    """(user key, end offset) of an encoded state key; ``kind`` is 'int', 'str' or 'bytes'."""
    if kind == "int":
        u = int.from_bytes(raw[PREFIX_LEN : PREFIX_LEN + 8], "big") ^ (1 << 63)
        return (u - (1 << 64) if u >= 1 << 63 else u), PREFIX_LEN + 8
    length = int.from_bytes(raw[PREFIX_LEN : PREFIX_LEN + 4], "big")
    end = PREFIX_LEN + 4 + length
    value = raw[PREFIX_LEN + 4 : end]
    return (value.decode() if kind == "str" else value), end


def sub_group_bounds(key_group: int, sub_group: int) -> tuple[bytes, bytes]:
    """[lower, upper) byte bounds of one sub-group's keys."""
    lower = _PREFIX.pack(key_group, sub_group, 0)[:3]
    nxt = key_group * 256 + sub_group + 1
    upper = nxt.to_bytes(3, "big") if nxt < 1 << 24 else b"\xff\xff\xff\xff"
    return lower, upper


def key_group_bounds(key_group: int) -> tuple[bytes, bytes]:
    """[lower, upper) byte bounds of one key group's keys."""
    lower = key_group.to_bytes(2, "big")
    upper = (key_group + 1).to_bytes(2, "big") if key_group + 1 < 1 << 16 else b"\xff\xff\xff"
    return lower, upper
