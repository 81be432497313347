"""In-band control events that travel on every channel between record batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Barrier", "ChannelId", "EndOfStream"]

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
