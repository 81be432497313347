"""Keyed helpers: drop duplicates per key within a time span, keep a running top-n per key.

Example::

    import raystream as rs
    from raystream.operators import keyed

    unique = events.key_by("event_id").apply(keyed.dedupe(within_ms=10 * 60_000))
    best = scores.key_by("game").apply(keyed.top_n(3, by="score"))
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
from raystream.operators._support import EVENT_TIME, check_name, register, store, times_ms
from raystream.operators.join_logic import Buffers
from raystream.operators.window_logic import check_positive_ms

import raystream as rs
from raystream.errors import DataflowDefinitionError

__all__ = ["dedupe", "top_n"]

_NONE = np.iinfo(np.int64).min  # no live entry


def dedupe(
    within_ms: int, *, time_column: str = EVENT_TIME, name: str | None = None
) -> rs.Operator:
    """Pass the first record of a key; drop the key's further records until the watermark
    passes ``time + within_ms`` of the record that passed (then the next one passes again).
    Typical: key by an event id to drop redeliveries. Vectorised: per batch, only a key's
    first record can pass, and only if the key has no live entry.

    Example::

        >>> events.key_by("event_id").apply(dedupe(within_ms=3_600_000))
    """
    where = f"dedupe({within_ms!r})"
    within = check_positive_ms(within_ms, "within_ms (how long a key is remembered)", where)
    step = check_name(name, where) or "dedupe"

    def fire(timers: Any, state: Any) -> None:
        expiry = state.get(timers.keyset)
        gone = (expiry != _NONE) & (expiry <= timers.watermark)
        if gone.any():
            state.delete(timers.keyset.take(np.flatnonzero(gone)))

    @rs.keyed_batches(name=step, state=rs.ValueState(int, default=_NONE), on_timer=fire)
    def dedupe_step(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch | None:
        expiry = state.get(batch.keys)
        live = (expiry != _NONE) & (expiry > batch.watermark)
        passing = np.flatnonzero(~live)
        if not len(passing):
            return None
        first = batch.offsets[:-1][passing]
        t = times_ms(batch.records, time_column, where)[first]
        keys = batch.keys.take(passing)
        state.put(keys, t + within)
        register(batch.timers, passing, t + within)
        return batch.records.take(pa.array(first))

    return dedupe_step


def top_n(n: int, by: str, *, largest: bool = True, name: str | None = None) -> rs.Operator:
    """The running top ``n`` records of every key by column ``by`` (``largest=False``: the
    smallest). When a batch changes a key's top, the key's whole top is emitted again, with a
    ``rank`` column (0 = best): read the output as upserts by (key, rank). Ties keep the record
    that came first.

    Example::

        >>> scores.key_by("game").apply(top_n(3, by="score"))   # game, rank, score, player, ...
    """
    where = f"top_n({n!r}, by={by!r})"
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        msg = f"{where}: n must be an int >= 1, got {n!r}"
        raise DataflowDefinitionError(msg)
    if not isinstance(by, str) or not by:
        msg = f"{where}: by must be a column name, got {by!r}"
        raise DataflowDefinitionError(msg)
    step = check_name(name, where) or "top_n"

    @rs.keyed_batches(name=step, state=rs.ValueState(object))
    def top_step(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch | None:
        nk = len(batch.keys)
        kept = Buffers(state.get(batch.keys))
        old = len(kept)
        rows = batch.records.replace_schema_metadata(None)
        if kept.records is not None and old:
            rows = pa.concat_batches([kept.records.select(rows.schema.names), rows])
        key = np.concatenate([kept.key, batch.key_index()])
        v = rows.column(by).to_numpy(zero_copy_only=False)
        order = np.lexsort((np.arange(len(key)), -v if largest else v, key))
        sk = key[order]
        starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
        rank = np.arange(len(sk)) - np.repeat(starts, np.diff(np.append(starts, len(sk))))
        top = order[rank < n]
        changed = np.zeros(nk, bool)
        changed[key[top[top >= old]]] = True
        top_rows = rows.take(pa.array(top))
        new = Buffers([None] * nk)
        store(state, batch.keys, new.values(nk, top_rows, key[top], batch.key_column))
        emit = np.flatnonzero(changed[key[top]])
        if not len(emit):
            return None
        out = top_rows.take(pa.array(emit))
        return out.append_column("rank", pa.array(rank[rank < n][emit], pa.int64()))

    return top_step
