"""Each key's final state as records: what a keyed step removed with ``state="emit"`` sends on.

Pure (RocksDB through :class:`raystream.state.rocks.RocksStateBackend`, no Ray). One row per key
that has any declared state: the key (under the step's key column) and one column per declared
state (``state`` for the single state of ``state=rs.ValueState(...)``, else the state's name).
A value or list state the key never wrote is its default (None for a list); a map state is a list
of ``{"key": map key, "value": value}`` entries in stored order. Timers are not state rows: the
step fires them before (as at the end of its input).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from raystream.errors import SchemaError
from raystream.state.layout import PREFIX_LEN, decode_user_key
from raystream.state.spec import MapState, StateSpec, ValueState

__all__ = ["FINAL_STATE_CHUNK_ROWS", "final_state_batches", "state_columns"]

FINAL_STATE_CHUNK_ROWS = 10_000  # keys per emitted batch


def state_columns(states: dict[str, StateSpec], key_column: str) -> dict[str, str]:
    """The output column of each declared state: ``state`` for the unnamed single state, else
    its name (``state_<name>`` where that is the key column)."""
    out = {}
    for name in states:
        col = name or "state"
        out[name] = f"state_{col}" if col == key_column else col
    return out


def _infer_kind(raw: bytes, spec: StateSpec) -> str:
    """The user key's encoding of a stored row, for an instance that never saw the key type
    (its state arrived by a rescale): int64 keys are 8 bytes, strings and binaries a 4-byte
    length then the bytes; a map state row then holds a pickle (which starts with 0x80)."""
    body = raw[PREFIX_LEN:]
    if isinstance(spec, MapState):
        if body[8:9] == b"\x80" and int.from_bytes(body[:4], "big") + 4 != 8:
            return "int"
    elif len(body) == 8 and int.from_bytes(body[:4], "big") != 4:
        return "int"
    end = 4 + int.from_bytes(body[:4], "big")
    try:
        body[4:end].decode()
    except UnicodeDecodeError:
        return "bytes"
    return "str"


def _rows(
    backend: Any, states: dict[str, StateSpec], key_kind: str | None, held: Any, sub_groups: int
) -> Iterator[tuple[Any, str, Any]]:
    """(user key, state name, value or (map key, value)) in stored order."""
    names = {i + 1: name for i, name in enumerate(states)}
    kind = key_kind
    for raw, value in backend.scan(b"", b"\xff\xff\xff\xff"):
        name = names.get(raw[3]) if len(raw) > PREFIX_LEN else None
        if name is None:  # timers, or ids no declared state uses
            continue
        if held is not None and not held[int.from_bytes(raw[:2], "big") * sub_groups + raw[2]]:
            continue  # a sub-group this instance no longer owns
        spec = states[name]
        kind = kind or _infer_kind(raw, spec)
        key, end = decode_user_key(raw, kind)
        if isinstance(spec, MapState):
            yield key, name, (pickle.loads(raw[end:]), pickle.loads(value))
        else:
            yield key, name, spec.codec.decode(value)


def _default(spec: StateSpec) -> Any:
    return spec.default if isinstance(spec, ValueState) else None


def final_state_batches(
    backend: Any,
    states: dict[str, StateSpec],
    key_column: str,
    key_kind: str | None,
    *,
    held: Any = None,
    sub_groups: int = 0,
    chunk_rows: int = FINAL_STATE_CHUNK_ROWS,
) -> list[pa.RecordBatch]:
    """Every key's state in ``backend`` as record batches of at most ``chunk_rows`` rows (see the
    module doc). ``key_kind``: 'int', 'str' or 'bytes' as the step saw its keys; None infers it
    from the stored keys. ``held``: a bool mask per global sub-group (``key_group *
    sub_groups + sub_group``); rows of other sub-groups are left out."""
    if not states:
        return []
    columns = state_columns(states, key_column)
    per_key: dict[Any, dict[str, Any]] = {}
    for key, name, value in _rows(backend, states, key_kind, held, sub_groups):
        entry = per_key.setdefault(key, {})
        if isinstance(states[name], MapState):
            entry.setdefault(name, []).append({"key": value[0], "value": value[1]})
        else:
            entry[name] = value
    keys = list(per_key)
    if not keys:
        return []
    data: dict[str, list[Any]] = {key_column: keys}
    for name, spec in states.items():
        fill = [] if isinstance(spec, MapState) else _default(spec)
        data[columns[name]] = [per_key[k].get(name, fill) for k in keys]
    try:  # one table: one schema for every batch (a state's type is inferred over all keys)
        table = pa.Table.from_pydict(data)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        first = {c: v[0] for c, v in data.items()}
        msg = (
            f"the final state of the removed step cannot be put in one Arrow table ({e}); "
            f"first key's row: {first!r}. Expected values of one type per state; remove the "
            "step with state='drop', or first replace its function with one whose state values "
            "Arrow can hold (job.replace(..., migrate_state=...))"
        )
        raise SchemaError(msg) from e
    return table.combine_chunks().to_batches(max_chunksize=chunk_rows)
