"""Typed access to keyed state: vectorised for whole batches, and per key.

The runtime groups each batch by key into a :class:`KeySet` (distinct keys with their key groups
and sub-groups, computed once). ``VectorValueState.get(keys)`` is one RocksDB multi-get on sorted
keys; ``put`` one WriteBatch. Per-key handles (``ValueHandle``, ``MapHandle``, ``ListHandle``) are
what the per-key operator form sees.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from raystream.errors import StateError
from raystream.keys import KeySpace
from raystream.state.layout import decode_user_key, encode_keys, encode_one
from raystream.state.rocks import RocksStateBackend
from raystream.state.resident import Residency
from raystream.state.spec import Codec, ListState, MapState, ResidentState, StateSpec, ValueState

__all__ = ["KeySet", "ListHandle", "MapHandle", "StateNamespace", "ValueHandle", "VectorValueState"]


@dataclass
class KeySet:
    """Distinct keys with their key groups and sub-groups; encodings are cached per state id."""

    keys: pa.Array
    key_group: np.ndarray
    sub_group: np.ndarray
    _encoded: dict[int, list[bytes]] = field(default_factory=dict, repr=False)

    @staticmethod
    def of(keys: Any, key_space: KeySpace) -> KeySet:
        from raystream.keys import to_key_array

        arr = to_key_array(keys)
        kg, sg = key_space.locate(arr)
        return KeySet(arr, kg, sg)

    def __len__(self) -> int:
        return len(self.keys)

    def encoded(self, state_id: int) -> list[bytes]:
        enc = self._encoded.get(state_id)
        if enc is None:
            enc = encode_keys(self.key_group, self.sub_group, state_id, self.keys)
            self._encoded[state_id] = enc
        return enc

    def take(self, index: np.ndarray) -> KeySet:
        return KeySet(self.keys.take(pa.array(index)), self.key_group[index], self.sub_group[index])


class VectorValueState:
    """A value state read and written for many keys at once."""

    def __init__(
        self,
        backend: RocksStateBackend,
        state_id: int,
        spec: ValueState | ListState,
        key_space: KeySpace,
    ) -> None:
        self._backend = backend
        self._state_id = state_id
        self._codec: Codec = spec.codec
        self._default = spec.default if isinstance(spec, ValueState) else None
        self._key_space = key_space

    def _keyset(self, keys: KeySet | Any) -> KeySet:
        return keys if isinstance(keys, KeySet) else KeySet.of(keys, self._key_space)

    def get(self, keys: KeySet | Any) -> Any:
        """Values of ``keys`` (numpy array for int/float states, else a list); missing -> default."""
        ks = self._keyset(keys)
        raws = self._backend.multi_get(ks.encoded(self._state_id))
        return self._codec.decode_many(raws, self._default)

    def put(self, keys: KeySet | Any, values: Any) -> None:
        ks = self._keyset(keys)
        if len(values) != len(ks):
            msg = f"put() got {len(values)} values for {len(ks)} keys; pass one value per key"
            raise StateError(msg)
        self._backend.write(ks.encoded(self._state_id), self._codec.encode_many(values))

    def delete(self, keys: KeySet | Any) -> None:
        ks = self._keyset(keys)
        self._backend.write([], [], deletes=ks.encoded(self._state_id))

    def at(self, keys: KeySet, i: int) -> ValueHandle:
        """A per-key handle for the i-th key of ``keys`` (reads it now)."""
        raw = self._backend.get(keys.encoded(self._state_id)[i])
        value = self._codec.decode(raw) if raw is not None else copy.deepcopy(self._default)
        return ValueHandle(value)


class ValueHandle:
    """``state.value`` of one key."""

    __slots__ = ("_value", "dirty", "deleted")

    def __init__(self, value: Any) -> None:
        self._value = value
        self.dirty = False
        self.deleted = False

    @property
    def value(self) -> Any:
        return self._value

    @value.setter
    def value(self, v: Any) -> None:
        self._value = v
        self.dirty = True
        self.deleted = False

    def clear(self) -> None:
        self._value = None
        self.dirty = True
        self.deleted = True

    def __repr__(self) -> str:
        return f"ValueHandle({self._value!r})"


class ListHandle:
    """The list state of one key: append/extend/clear, iterate, len, index."""

    __slots__ = ("items", "dirty")

    def __init__(self, items: list[Any] | None) -> None:
        self.items = list(items) if items else []
        self.dirty = False

    def append(self, item: Any) -> None:
        self.items.append(item)
        self.dirty = True

    def extend(self, items: Any) -> None:
        self.items.extend(items)
        self.dirty = True

    def clear(self) -> None:
        self.items = []
        self.dirty = True

    def get(self) -> list[Any]:
        return list(self.items)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


class MapHandle:
    """The map state of one key, read and written straight through to RocksDB."""

    __slots__ = ("_backend", "_prefix", "_default")

    def __init__(self, backend: RocksStateBackend, prefix: bytes, default: Any) -> None:
        self._backend = backend
        self._prefix = prefix
        self._default = default

    def _k(self, map_key: Any) -> bytes:
        return self._prefix + pickle.dumps(map_key, protocol=5)

    def get(self, map_key: Any, default: Any = None) -> Any:
        raw = self._backend.get(self._k(map_key))
        if raw is None:
            return default if default is not None else self._default
        return pickle.loads(raw)

    def __getitem__(self, map_key: Any) -> Any:
        raw = self._backend.get(self._k(map_key))
        if raw is None:
            raise KeyError(map_key)
        return pickle.loads(raw)

    def __setitem__(self, map_key: Any, value: Any) -> None:
        self._backend.write([self._k(map_key)], [pickle.dumps(value, protocol=5)])

    def put(self, map_key: Any, value: Any) -> None:
        self[map_key] = value

    def __delitem__(self, map_key: Any) -> None:
        self._backend.write([], [], deletes=[self._k(map_key)])

    def __contains__(self, map_key: Any) -> bool:
        return self._backend.get(self._k(map_key)) is not None

    def items(self) -> Iterator[tuple[Any, Any]]:
        n = len(self._prefix)
        for k, v in self._backend.scan_prefix(self._prefix):
            yield pickle.loads(k[n:]), pickle.loads(v)

    def keys(self) -> Iterator[Any]:
        return (k for k, _ in self.items())

    def values(self) -> Iterator[Any]:
        return (v for _, v in self.items())

    def __len__(self) -> int:
        return sum(1 for _ in self._backend.scan_prefix(self._prefix))

    def clear(self) -> None:
        keys = [k for k, _ in self._backend.scan_prefix(self._prefix)]
        self._backend.write([], [], deletes=keys)


class StateNamespace:
    """``state.<name>`` handles when an operator declares a dict of states."""

    def __init__(self, handles: dict[str, Any]) -> None:
        self.__dict__.update(handles)

    def __repr__(self) -> str:
        return f"StateNamespace({', '.join(self.__dict__)})"


class KeyedStates:
    """All declared states of one keyed operator instance over its RocksDB backend."""

    def __init__(
        self,
        backend: RocksStateBackend,
        specs: dict[str, StateSpec],
        key_space: KeySpace,
        residency: Residency | None = None,
    ) -> None:
        self.backend = backend
        self.key_space = key_space
        self.specs = specs
        # state id 0 is reserved; declared states get 1, 2, ... (at most 250) in declaration
        # order; timers use 253 and 254 (raystream.runtime.timers)
        self.ids = {name: i + 1 for i, name in enumerate(specs)}
        # states kept in memory by the operator (ResidentState): one store per instance
        self.resident: dict[str, Any] = {}
        for name, spec in specs.items():
            if isinstance(spec, ResidentState):
                store = spec.factory()
                store.bind(
                    backend, self.ids[name], key_space, residency or Residency.everything(key_space)
                )
                self.resident[name] = store

    def on_watermark(self, watermark: int) -> list[Any]:
        """The instance's watermark advanced: what each resident state emits (its
        ``on_watermark(watermark)``; the batches it returns, in state order)."""
        outs: list[Any] = []
        for store in self.resident.values():
            out = store.on_watermark(watermark)
            if out is not None:
                outs.append(out)
        return outs

    def release(self, *, write: bool = True) -> None:
        """Write every resident state to RocksDB (unless ``write=False``: the backend is
        dropped) and stop them: their step's function or the backend is replaced, and a new
        KeyedStates loads them again from RocksDB."""
        for store in self.resident.values():
            if write:
                store.write(self.backend, None)
            store.detach()

    def vectorised(self) -> Any:
        """Handles for the vectorised form: value/list states as VectorValueState, maps per key."""
        handles: dict[str, Any] = {}
        for name, spec in self.specs.items():
            sid = self.ids[name]
            if isinstance(spec, MapState):
                handles[name] = _VectorMapAccess(self.backend, sid, spec)
            elif isinstance(spec, ResidentState):
                handles[name] = self.resident[name]
            else:
                handles[name] = VectorValueState(self.backend, sid, spec, self.key_space)
        return _single_or_namespace(handles)

    def preload(self, keys: KeySet) -> dict[str, Any]:
        """Per-key handles for every key of ``keys``: name -> list of handles (one per key)."""
        out: dict[str, Any] = {}
        for name, spec in self.specs.items():
            sid = self.ids[name]
            if isinstance(spec, ResidentState):
                msg = (
                    f"state {name!r} is a ResidentState, which the vectorised form "
                    "(@rs.keyed_batches) uses; the per-key form (@rs.keyed) needs ValueState, "
                    "ListState or MapState"
                )
                raise StateError(msg)
            if isinstance(spec, ValueState):
                vals = VectorValueState(self.backend, sid, spec, self.key_space).get(keys)
                if isinstance(vals, np.ndarray):
                    vals = vals.tolist()
                out[name] = [ValueHandle(v) for v in vals]
            elif isinstance(spec, ListState):
                vals = VectorValueState(self.backend, sid, spec, self.key_space).get(keys)
                out[name] = [ListHandle(v) for v in vals]
            else:
                out[name] = [
                    MapHandle(self.backend, p, spec.default_value) for p in keys.encoded(sid)
                ]
        return out

    def handles_for(self, preloaded: dict[str, Any], i: int) -> Any:
        return _single_or_namespace({name: hs[i] for name, hs in preloaded.items()})

    def write_back(self, keys: KeySet, preloaded: dict[str, Any]) -> None:
        """Write every changed value/list handle back in one WriteBatch."""
        put_k: list[bytes] = []
        put_v: list[bytes] = []
        dels: list[bytes] = []
        for name, spec in self.specs.items():
            if isinstance(spec, (MapState, ResidentState)):
                continue
            enc = keys.encoded(self.ids[name])
            codec = spec.codec
            for i, h in enumerate(preloaded[name]):
                if not h.dirty:
                    continue
                if isinstance(h, ValueHandle):
                    if h.deleted:
                        dels.append(enc[i])
                    else:
                        put_k.append(enc[i])
                        put_v.append(codec.encode(h.value))
                else:
                    put_k.append(enc[i])
                    put_v.append(codec.encode(h.items))
        self.backend.write(put_k, put_v, deletes=dels)

    def iter_values(self, name: str, kind: str) -> Iterator[tuple[Any, Any]]:
        """(key, value) of every key held for value state ``name`` (for inspection and tests)."""
        sid = self.ids[name]
        codec = self.specs[name].codec
        for kg in range(self.key_space.num_key_groups):
            for k, v in self.backend.scan_prefix(kg.to_bytes(2, "big")):
                if k[3] == sid:
                    key, _ = decode_user_key(k, kind)
                    yield key, codec.decode(v)


class _VectorMapAccess:
    """Map state in the vectorised form: ``state.at(keys, i)`` gives one key's MapHandle."""

    def __init__(self, backend: RocksStateBackend, state_id: int, spec: MapState) -> None:
        self._backend = backend
        self._sid = state_id
        self._spec = spec

    def at(self, keys: KeySet, i: int) -> MapHandle:
        return MapHandle(self._backend, keys.encoded(self._sid)[i], self._spec.default_value)

    def for_key(self, key: Any, key_space: KeySpace) -> MapHandle:
        ks = KeySet.of([key], key_space)
        return MapHandle(
            self._backend,
            encode_one(int(ks.key_group[0]), int(ks.sub_group[0]), self._sid, key),
            self._spec.default_value,
        )


def _single_or_namespace(handles: dict[str, Any]) -> Any:
    if list(handles) == [""]:
        return handles[""]
    if not handles:
        return None
    return StateNamespace(handles)
