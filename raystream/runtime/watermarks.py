"""Event-time watermarks: how a source makes them and how an instance combines them (no Ray).

A watermark ``W`` on a channel promises that the sender will send no more records with
``event_time <= W`` (records that still do are *late*). Watermarks travel in-band on the
channels, like barriers (:class:`raystream.runtime.messages.Watermark`).

* A source instance with an event-time column emits, after a batch that raised its maximum event
  time, ``max event time seen - max_out_of_orderness_ms - 1`` (Flink's bounded out-of-orderness),
  or what the user's ``watermark(batch)`` function returns. After ``watermark_idle_ms`` without
  rows it declares itself idle; at the end of its input it sends :data:`WATERMARK_MAX`.
* An instance tracks the last watermark per input channel. Its watermark is the minimum over the
  live (not ended), active (not idle) channels; a channel that ended counts as +infinity, a
  channel that sent nothing yet as :data:`WATERMARK_MIN`. It forwards only advances, so what it
  sends never moves backwards, also not when a channel is added by a rescale.

Example::

    >>> t = WatermarkTracker([("a", 0), ("a", 1)])
    >>> t.on_watermark(("a", 0), 10), t.on_watermark(("a", 1), 7)
    (None, 7)
    >>> t.on_end(("a", 1))
    10
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raystream.errors import DataflowDefinitionError, SchemaError
from raystream.runtime.messages import ChannelId

__all__ = [
    "WATERMARK_MAX",
    "WATERMARK_MIN",
    "EventTimeSpec",
    "SourceWatermarks",
    "WatermarkTracker",
    "event_time_ms",
]

WATERMARK_MIN = -(2**63)  # no watermark yet
WATERMARK_MAX = 2**63 - 1  # end of input: every event time is behind it


@dataclass(frozen=True)
class EventTimeSpec:
    """How a source reads event time and makes watermarks (``flow.source(..., event_time=)``)."""

    column: str
    max_out_of_orderness_ms: int = 0
    watermark_idle_ms: float | None = None
    watermark: Callable[[pa.RecordBatch], Any] | None = None  # fn(batch) -> int ms

    def __post_init__(self) -> None:
        b = self.max_out_of_orderness_ms
        if not isinstance(b, (int, np.integer)) or isinstance(b, bool) or b < 0:
            msg = f"max_out_of_orderness_ms must be an int >= 0 (milliseconds), got {b!r}"
            raise DataflowDefinitionError(msg)
        idle = self.watermark_idle_ms
        if idle is not None and (
            isinstance(idle, bool) or not isinstance(idle, (int, float)) or idle <= 0
        ):
            msg = f"watermark_idle_ms must be None or a number > 0 (milliseconds), got {idle!r}"
            raise DataflowDefinitionError(msg)
        if self.watermark is not None and not callable(self.watermark):
            msg = f"watermark= expects fn(batch) -> int milliseconds, got {self.watermark!r}"
            raise DataflowDefinitionError(msg)

    def check_schema(self, schema: pa.Schema | None, step: str) -> None:
        """At definition: the column exists and is a timestamp or int64 (if the schema is known)."""
        if schema is None:
            return
        if self.column not in schema.names:
            msg = (
                f"source {step!r}: event_time={self.column!r} names no column; the source has "
                f"columns {schema.names}"
            )
            raise DataflowDefinitionError(msg)
        t = schema.field(self.column).type
        if not (pa.types.is_timestamp(t) or t == pa.int64()):
            msg = (
                f"source {step!r}: event-time column {self.column!r} must be a timestamp or int64 "
                f"(milliseconds), got {t}; cast it (e.g. with a Parquet schema) or pick another"
            )
            raise DataflowDefinitionError(msg)


def event_time_ms(batch: pa.RecordBatch, column: str) -> np.ndarray:
    """The event-time column of ``batch`` as int64 milliseconds (timestamps of any unit)."""
    idx = batch.schema.get_field_index(column)
    if idx < 0:
        msg = (
            f"records have no event-time column {column!r}; they have {batch.schema.names}. "
            "Fix event_time= of the source."
        )
        raise SchemaError(msg)
    col = batch.column(idx)
    if col.null_count:
        msg = (
            f"event-time column {column!r} holds {col.null_count} null(s) in a batch of "
            f"{len(col)} rows; every record needs an event time. Fill them before the source."
        )
        raise SchemaError(msg)
    t = col.type
    if pa.types.is_timestamp(t):
        col = pc.cast(col, pa.timestamp("ms", tz=t.tz), safe=False).cast(pa.int64())
    elif t != pa.int64():
        msg = f"event-time column {column!r} must be a timestamp or int64 (ms), got {t}"
        raise SchemaError(msg)
    return col.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


class SourceWatermarks:
    """The watermark of one source instance: bounded out-of-orderness (or a user function),
    idleness after ``idle_ms`` without rows."""

    def __init__(self, spec: EventTimeSpec, clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.clock = clock
        self.current = WATERMARK_MIN  # the last watermark emitted
        self.max_event_time = WATERMARK_MIN
        self.idle = False
        self._last_rows_at = clock()

    def after_batch(self, batch: pa.RecordBatch, event_ms: np.ndarray) -> int | None:
        """A new watermark to emit after ``batch`` (its event times ``event_ms``), or None."""
        self._last_rows_at = self.clock()
        self.idle = False
        if len(event_ms):
            self.max_event_time = max(self.max_event_time, int(event_ms.max()))
        if self.spec.watermark is not None:
            got = self.spec.watermark(batch)
            if got is None:
                return None
            if isinstance(got, bool) or not isinstance(got, (int, np.integer)):
                msg = f"watermark(batch) must return int milliseconds or None, got {got!r}"
                raise SchemaError(msg)
            candidate = int(got)
        elif self.max_event_time == WATERMARK_MIN:
            return None
        else:
            candidate = self.max_event_time - int(self.spec.max_out_of_orderness_ms) - 1
        if candidate > self.current:
            self.current = candidate
            return candidate
        return None

    def check_idle(self) -> bool:
        """True once, when the source has had no rows for ``watermark_idle_ms``."""
        idle_ms = self.spec.watermark_idle_ms
        if idle_ms is None or self.idle:
            return False
        if (self.clock() - self._last_rows_at) * 1000 >= idle_ms:
            self.idle = True
            return True
        return False


class WatermarkTracker:
    """Per-input-channel watermarks of one instance and their minimum (monotonic)."""

    def __init__(self, channels: Iterable[ChannelId] = ()) -> None:
        self._wm: dict[ChannelId, int] = {}
        self._idle: set[ChannelId] = set()
        self._ended: set[ChannelId] = set()
        self.current = WATERMARK_MIN  # this instance's watermark (never moves backwards)
        for ch in channels:
            self.add(ch)

    def add(self, channel: ChannelId) -> None:
        """A (re)opened input channel: no watermark yet, active, live. The current watermark
        stays where it is; it advances again once the new channel has caught up."""
        self._wm[channel] = WATERMARK_MIN
        self._idle.discard(channel)
        self._ended.discard(channel)

    def remove(self, channel: ChannelId) -> int | None:
        self._wm.pop(channel, None)
        self._idle.discard(channel)
        self._ended.discard(channel)
        return self._advance()

    def on_watermark(self, channel: ChannelId, timestamp_ms: int, idle: bool = False) -> int | None:
        """A watermark (or an idleness mark) arrived; returns the new watermark if it advanced."""
        if channel not in self._wm:
            self.add(channel)
        if idle:
            self._idle.add(channel)
        else:
            self._idle.discard(channel)
        self._wm[channel] = max(self._wm[channel], int(timestamp_ms))
        return self._advance()

    def on_records(self, channel: ChannelId) -> None:
        """Records on an idle channel make it active again (its watermark counts again)."""
        self._idle.discard(channel)

    def on_end(self, channel: ChannelId) -> int | None:
        """The channel ended: it counts as +infinity from now on."""
        if channel not in self._wm:
            self.add(channel)
        self._ended.add(channel)
        return self._advance()

    @property
    def all_idle(self) -> bool:
        """Every live input is idle (then this instance's outputs are idle as well)."""
        live = [c for c in self._wm if c not in self._ended]
        return bool(live) and all(c in self._idle for c in live)

    def combined(self) -> int:
        """Minimum over live, active channels; +infinity if all ended; where it is now if every
        live channel is idle (idle inputs neither hold it back nor move it)."""
        live = [c for c in self._wm if c not in self._ended]
        if not live:
            return WATERMARK_MAX
        active = [self._wm[c] for c in live if c not in self._idle]
        if active:
            return min(active)
        return self.current  # all idle: hold where we are

    def _advance(self) -> int | None:
        w = self.combined()
        if w > self.current:
            self.current = w
            return w
        return None
