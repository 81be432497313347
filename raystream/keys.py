"""Keys: stable vectorised hashing, key -> key group -> sub-group, key-group ranges, routing tables.

Contracts (as in Flink's ``KeyGroupRangeAssignment``):

* ``stable_hash`` is the same in every process and on every machine (never Python's salted
  ``hash``): int keys go through the murmur3 64-bit finaliser, strings and binaries through
  xxh3-64 of their UTF-8 bytes.
* ``key_group = hash % num_key_groups``; the number of key groups is fixed for a job's life.
* ``sub_group = (hash >> 32) % sub_groups``: other bits than the key group's, so the sub-groups of
  one key group are evenly filled.
* A :class:`RoutingTable` maps every key group to one operator instance and carries an epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from raystream.errors import ConfigError, NullKeyError, SchemaError

__all__ = [
    "MAX_KEY_GROUPS",
    "MAX_SUB_GROUPS",
    "KeyGroupRange",
    "KeySpace",
    "RoutingTable",
    "key_kind",
    "stable_hash",
    "to_key_array",
]

MAX_KEY_GROUPS = 32768
MAX_SUB_GROUPS = 256  # the sub-group is one byte of the RocksDB key prefix

_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_S32 = np.uint64(32)


def to_key_array(keys: Any, *, column: str = "key") -> pa.Array:
    """Turn keys (Arrow array/chunked array, numpy array or list) into one Arrow array.

    Raises :class:`NullKeyError` for nulls and :class:`SchemaError` for unsupported types.
    """
    try:
        if isinstance(keys, pa.ChunkedArray):
            keys = keys.combine_chunks()
        elif not isinstance(keys, pa.Array):
            keys = pa.array(keys)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        msg = f"key column {column!r} cannot be read as one Arrow type ({e}); keys must all be ints or all strings"
        raise SchemaError(msg) from e
    if keys.null_count:
        msg = (
            f"key column {column!r} holds {keys.null_count} null(s) out of {len(keys)} rows; "
            "every record needs a key. Filter or fill the nulls before key_by."
        )
        raise NullKeyError(msg)
    t = keys.type
    if pa.types.is_integer(t):
        if t == pa.int64():
            return keys
        try:
            return keys.cast(pa.int64())
        except pa.ArrowInvalid as e:
            msg = f"key column {column!r} of type {t} has values outside int64 ({e}); cast or hash them first"
            raise SchemaError(msg) from e
    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return keys.cast(pa.string())
    if pa.types.is_string(t) or pa.types.is_binary(t):
        return keys
    if pa.types.is_large_binary(t):
        return keys.cast(pa.binary())
    if pa.types.is_dictionary(t):
        return to_key_array(keys.cast(t.value_type), column=column)
    msg = (
        f"key column {column!r} has type {t}; expected an integer or string (or binary) type. "
        "Cast the key, e.g. with a map_batches step, before key_by."
    )
    raise SchemaError(msg)


def key_kind(keys: pa.Array) -> str:
    """'int' for int64 keys, 'str' for string keys, 'bytes' for binary keys."""
    t = keys.type
    if t == pa.int64():
        return "int"
    if pa.types.is_string(t):
        return "str"
    return "bytes"


def _fmix64(x: np.ndarray) -> np.ndarray:
    h = x.astype(np.uint64, copy=True)
    h ^= h >> _S33
    h *= _M1
    h ^= h >> _S33
    h *= _M2
    h ^= h >> _S33
    return h


def stable_hash(keys: Any) -> np.ndarray:
    """Stable 64-bit hashes (uint64 numpy array) of int, string or binary keys, vectorised."""
    arr = to_key_array(keys)
    if arr.type == pa.int64():
        ints = arr.to_numpy(zero_copy_only=False).view(np.uint64)
        return _fmix64(ints)
    # Strings / binaries: hash each distinct value once, then take.
    encoded = pc.dictionary_encode(arr)
    dictionary = encoded.dictionary
    if pa.types.is_string(dictionary.type):  # the UTF-8 bytes, as they are (no copy)
        dictionary = dictionary.cast(pa.binary())
    distinct = np.fromiter(
        map(xxhash.xxh3_64_intdigest, dictionary.to_pylist()),  # the loop runs in C
        dtype=np.uint64,
        count=len(dictionary),
    )
    indices = encoded.indices.to_numpy(zero_copy_only=False)
    return distinct[indices]


@dataclass(frozen=True)
class KeySpace:
    """The fixed key-group and sub-group layout of one keyed operator (fixed for a job's life)."""

    num_key_groups: int = 128
    sub_groups: int = 16

    def __post_init__(self) -> None:
        if (
            not isinstance(self.num_key_groups, int)
            or isinstance(self.num_key_groups, bool)
            or not 1 <= self.num_key_groups <= MAX_KEY_GROUPS
        ):
            msg = (
                f"num_key_groups must be an int in [1, {MAX_KEY_GROUPS}], got {self.num_key_groups!r}. "
                "It bounds the maximum parallelism of every keyed operator; 128 is the default."
            )
            raise ConfigError(msg)
        if (
            not isinstance(self.sub_groups, int)
            or isinstance(self.sub_groups, bool)
            or not 1 <= self.sub_groups <= MAX_SUB_GROUPS
        ):
            msg = (
                f"sub_groups must be an int in [1, {MAX_SUB_GROUPS}], got {self.sub_groups!r} "
                "(the sub-group is one byte of the state key prefix)."
            )
            raise ConfigError(msg)

    def key_group(self, hashes: np.ndarray) -> np.ndarray:
        """Key group of each hash, as uint16 (a key group id is < 32768)."""
        n = self.num_key_groups
        if n & (n - 1) == 0:  # a power of two: the low bits (same as %, without a division)
            return (hashes & np.uint64(n - 1)).astype(np.uint16)
        return (hashes % np.uint64(n)).astype(np.uint16)

    def sub_group(self, hashes: np.ndarray) -> np.ndarray:
        """Sub-group of each hash within its key group, as uint8."""
        n = self.sub_groups
        if n & (n - 1) == 0:
            return ((hashes >> _S32) & np.uint64(n - 1)).astype(np.uint8)
        return ((hashes >> _S32) % np.uint64(n)).astype(np.uint8)

    def locate(self, keys: Any) -> tuple[np.ndarray, np.ndarray]:
        """(key_group, sub_group) arrays of the given keys."""
        h = stable_hash(keys)
        return self.key_group(h), self.sub_group(h)

    def global_sub_group(self, key_group: np.ndarray, sub_group: np.ndarray) -> np.ndarray:
        """One int id per (key group, sub-group): ``key_group * sub_groups + sub_group``."""
        return key_group.astype(np.int64) * self.sub_groups + sub_group.astype(np.int64)


@dataclass(frozen=True)
class KeyGroupRange:
    """Key groups ``start .. end`` inclusive, as in Flink (an empty range has end < start)."""

    start: int
    end: int

    def __len__(self) -> int:
        return max(0, self.end - self.start + 1)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(self.start, self.end + 1))

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, (int, np.integer)) and self.start <= key_group <= self.end

    @staticmethod
    def for_operator_index(num_key_groups: int, parallelism: int, index: int) -> KeyGroupRange:
        """Flink's contiguous range of key groups for instance ``index`` of ``parallelism``."""
        _check_parallelism(parallelism, num_key_groups)
        if not 0 <= index < parallelism:
            msg = f"operator index must be in [0, {parallelism}), got {index}"
            raise ConfigError(msg)
        start = (index * num_key_groups + parallelism - 1) // parallelism
        end = ((index + 1) * num_key_groups - 1) // parallelism
        return KeyGroupRange(start, end)


def _check_parallelism(parallelism: int, num_key_groups: int) -> None:
    if not isinstance(parallelism, (int, np.integer)) or isinstance(parallelism, bool):
        msg = f"parallelism must be an int, got {parallelism!r}"
        raise ConfigError(msg)
    if not 1 <= parallelism <= num_key_groups:
        msg = (
            f"parallelism must be in [1, {num_key_groups}] (1 .. the number of key groups), "
            f"got {parallelism}. Raise num_key_groups on the Dataflow for more parallelism."
        )
        raise ConfigError(msg)


@dataclass(frozen=True, eq=False)
class RoutingTable:
    """``owners[key_group] -> instance index``, stamped with an epoch.

    The epoch grows by one with every rescale; a rescale barrier carries the new table.
    """

    epoch: int
    owners: np.ndarray = field(repr=False)
    parallelism: int

    def __post_init__(self) -> None:
        owners = np.asarray(self.owners, dtype=np.int32)
        owners.setflags(write=False)
        object.__setattr__(self, "owners", owners)
        _check_parallelism(self.parallelism, len(owners))
        if len(owners) and (owners.min() < 0 or owners.max() >= self.parallelism):
            msg = (
                f"routing table owners must be in [0, {self.parallelism}), "
                f"got values in [{owners.min()}, {owners.max()}]"
            )
            raise ConfigError(msg)

    @staticmethod
    def uniform(num_key_groups: int, parallelism: int, epoch: int = 0) -> RoutingTable:
        """Flink's assignment: contiguous, near-equal key-group ranges."""
        _check_parallelism(parallelism, num_key_groups)
        kg = np.arange(num_key_groups, dtype=np.int64)
        owners = (kg * parallelism // num_key_groups).astype(np.int32)
        return RoutingTable(epoch=epoch, owners=owners, parallelism=parallelism)

    @property
    def num_key_groups(self) -> int:
        return len(self.owners)

    def owner_of(self, key_groups: np.ndarray) -> np.ndarray:
        """Instance index of each key group (vectorised)."""
        return self.owners[key_groups]

    def key_groups_of(self, instance: int) -> np.ndarray:
        """The key groups instance ``instance`` owns, ascending."""
        return np.flatnonzero(self.owners == instance)

    def moved_key_groups(self, new: RoutingTable) -> np.ndarray:
        """Key groups whose owner differs between this table and ``new``."""
        return np.flatnonzero(self.owners != new.owners)

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "parallelism": self.parallelism,
            "owners": self.owners.tolist(),
        }

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, RoutingTable)
            and self.epoch == other.epoch
            and self.parallelism == other.parallelism
            and np.array_equal(self.owners, other.owners)
        )

    def __hash__(self) -> int:
        return hash((self.epoch, self.parallelism, self.owners.tobytes()))
