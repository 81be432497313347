"""In-band control events that travel on every channel between record batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AfterFences",
    "Barrier",
    "ChannelId",
    "EndOfStream",
    "Fence",
    "RowsThenWatermark",
    "Watermark",
]

# A channel is one (sender instance -> receiver instance) edge: ("step", index) of the sender.
ChannelId = tuple[str, int]


@dataclass(frozen=True)
class Barrier:
    """A barrier injected by the sources and forwarded once seen on every input channel.

    ``kind`` says what the barrier does: ``"checkpoint"`` (aligned: a channel that delivered it is
    held until all have) or ``"rescale"`` (never blocks a channel; carries the new routing tables).
    """

    epoch: int
    kind: str = "checkpoint"
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EndOfStream:
    """The sender has no more records for this channel."""


@dataclass(frozen=True)
class Fence:
    """An old owner's mark on each of its output channels when it seals at rescale (or move)
    ``epoch``: every output it made for a sub-group it hands out came before it. It takes no room
    and is acknowledged as soon as it is queued; the receiver notes when it has read up to it."""

    epoch: int = 0


@dataclass(frozen=True)
class AfterFences:
    """A new owner's mark on each of its output channels before its first output made from state
    it took over at ``epoch``: the receiver reads nothing more of this channel until it has read
    the :class:`Fence` of ``epoch`` on the channel of each old owner in ``senders`` (instance
    indexes; the channel is the sending step's instance at that index) that is one of its inputs
    and has not ended. So a receiver fed by both reads the old owner's last outputs for a moving
    key before the new owner's first, and the old owner hands out its state without waiting for
    downstream to read them."""

    epoch: int
    senders: tuple[int, ...]


@dataclass(frozen=True)
class Watermark:
    """The sender will send no more records with ``event_time <= timestamp_ms`` on this channel.

    ``idle=True``: the sender has no input for a while; receivers leave this channel out of their
    minimum until it sends records or a watermark again. The end of input is
    ``Watermark(WATERMARK_MAX)`` (:mod:`raystream.runtime.watermarks`) before ``EndOfStream``.
    """

    timestamp_ms: int
    idle: bool = False


@dataclass(frozen=True)
class RowsThenWatermark:
    """One push carrying a record batch and the watermark that follows it on the channel (a
    sender's buffered rows flushed for a watermark): one call instead of two. The receiver queues
    them as two items, the batch first."""

    batch: Any
    watermark: Watermark
