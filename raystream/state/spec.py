"""State declarations (what a keyed operator asks for) and the codecs that store their values.

``ValueState(int, default=0)`` stores one value per key; ``MapState()`` a map per key;
``ListState()`` a list per key. Numeric value states (``int``, ``float``) are stored as fixed
8-byte little-endian values and read back as numpy arrays in the vectorised API; ``bytes`` values
are stored as they are (no pickling: an operator that packs its own values pays nothing more);
anything else is pickled.
"""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np

from raystream.errors import DataflowDefinitionError, StateError

__all__ = [
    "Codec",
    "ListState",
    "MapState",
    "ResidentState",
    "StateSpec",
    "ValueState",
    "codec_for",
]


@dataclass(frozen=True)
class Codec:
    """Encodes values to bytes and back; numeric codecs also work on whole numpy arrays."""

    name: str
    numpy_dtype: str | None  # '<i8' / '<f8' for fixed-width numeric codecs, else None
    raw: bool = False  # bytes stored as they are

    def encode(self, value: Any) -> bytes:
        if self.raw:
            return _raw_bytes(value)
        if self.numpy_dtype is not None:
            return np.asarray(value, dtype=self.numpy_dtype).tobytes()
        return pickle.dumps(value, protocol=5)

    def decode(self, raw: bytes) -> Any:
        if self.raw:
            return bytes(raw)
        if self.numpy_dtype is not None:
            return np.frombuffer(raw, dtype=self.numpy_dtype)[0].item()
        return pickle.loads(raw)

    def encode_many(self, values: Any) -> list[bytes]:
        if self.raw:
            values = list(values)
            if set(map(type, values)) <= {bytes}:  # the common case, checked in C
                return values
            return [_raw_bytes(v) for v in values]
        if self.numpy_dtype is not None:
            arr = np.ascontiguousarray(values, dtype=self.numpy_dtype)
            return arr.view("V8").tolist()
        return [pickle.dumps(v, protocol=5) for v in values]

    def decode_many(self, raws: list[bytes | None], default: Any) -> Any:
        """Decode a multi-get result; missing entries (None) become ``default``."""
        if self.raw:
            return [default if r is None else r for r in raws] if None in raws else list(raws)
        if self.numpy_dtype is not None:
            fill = np.asarray(
                default if default is not None else 0, dtype=self.numpy_dtype
            ).tobytes()
            if None in raws:
                raws = [fill if r is None else r for r in raws]
            joined = bytearray(b"".join(raws))
            return np.frombuffer(joined, self.numpy_dtype)  # writable: callers may update in place
        if default is None or isinstance(default, (bool, int, float, str, bytes)):
            return [pickle.loads(r) if r is not None else default for r in raws]  # immutable
        return [pickle.loads(r) if r is not None else copy.deepcopy(default) for r in raws]


_INT = Codec("int64", "<i8")
_FLOAT = Codec("float64", "<f8")
_PICKLE = Codec("pickle", None)
_BYTES = Codec("bytes", None, raw=True)


def _raw_bytes(value: Any) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    msg = (
        f"a ValueState(bytes) stores bytes, got {type(value).__name__}: {value!r:.80}; encode "
        "the value first, or declare the state as ValueState(object) to have it pickled"
    )
    raise StateError(msg)


def codec_for(dtype: Any) -> Codec:
    if dtype in (int, "int", "int64", np.int64):
        return _INT
    if dtype in (float, "float", "float64", np.float64):
        return _FLOAT
    if dtype in (bytes, "bytes"):
        return _BYTES
    return _PICKLE


@dataclass(frozen=True)
class ValueState:
    """One value per key. ``dtype`` int/float are stored natively (fast, vectorised)."""

    dtype: Any = object
    default: Any = None

    @property
    def codec(self) -> Codec:
        return codec_for(self.dtype)


@dataclass(frozen=True)
class MapState:
    """A map per key (map keys and values are pickled; map keys must be hashable)."""

    default_value: Any = None

    @property
    def codec(self) -> Codec:
        return _PICKLE


@dataclass(frozen=True)
class ListState:
    """A list per key (stored as one value; append is read-modify-write within a batch)."""

    @property
    def codec(self) -> Codec:
        return _PICKLE


@dataclass(frozen=True)
class ResidentState:
    """State an operator keeps in memory in its own form (e.g. columns) for the sub-groups its
    instance holds; RocksDB holds it as one ``bytes`` value per key whenever anything reads or
    copies the state (checkpoints, moves, rescales, a replaced function). ``factory()`` makes
    the per-instance store, a :class:`raystream.state.resident.ResidentStore`; the function gets
    that store as its state handle."""

    factory: Any

    @property
    def codec(self) -> Codec:
        return _BYTES

    @property
    def default(self) -> Any:
        return None


StateSpec = ValueState | MapState | ListState | ResidentState
_SPECS = (ValueState, MapState, ListState, ResidentState)


def check_state_specs(state: Any, step: str) -> dict[str, StateSpec]:
    """Normalise ``state=`` of a keyed operator into ``{name: spec}``.

    ``None`` -> no state; a single spec -> ``{"state": spec}`` (the function gets the handle
    itself); a dict of specs -> a namespace of handles with those names.
    """
    if state is None:
        return {}
    if isinstance(state, _SPECS):
        return {"": state}
    if isinstance(state, dict) and state:
        bad = {
            k: v for k, v in state.items() if not isinstance(v, _SPECS)
        }
        if bad or not all(isinstance(k, str) and k.isidentifier() for k in state):
            msg = (
                f"step {step!r}: state= must map identifier names to ValueState/MapState/"
                f"ListState, got {state!r}"
            )
            raise DataflowDefinitionError(msg)
        if len(state) > 250:
            msg = f"step {step!r}: at most 250 states per operator, got {len(state)}"
            raise DataflowDefinitionError(msg)
        return dict(state)
    msg = (
        f"step {step!r}: state= expects rs.ValueState(...), rs.MapState(), rs.ListState() or a "
        f"dict of them, got {type(state).__name__}: {state!r}"
    )
    raise DataflowDefinitionError(msg)
