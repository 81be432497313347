"""Migration strategies: the Protocol every strategy plugin implements, and what it returns.

A strategy is small and pure: it plans *what moves when* (a list of steps, each with its own
rescale barrier and routing table) and *how* the new owners fetch (a :class:`FetchPolicy`). The
migration engine in the operator instances and the controller do the moving.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from raystream.errors import ConfigError
from raystream.keys import RoutingTable

__all__ = [
    "FetchPolicy",
    "MigrationPlan",
    "MigrationStrategy",
    "RescaleContext",
    "steps_moving",
]


@dataclass(frozen=True)
class FetchPolicy:
    """How new owners get the sub-groups they are assigned.

    * ``on_demand``: a record of a missing sub-group triggers a fetch of that sub-group at once.
    * ``background``: ``"hot_first"`` pulls the rest hottest first; ``"all"`` pulls everything at
      once; ``"none"`` pulls nothing in the background (until ``background_after_s``).
    * ``hold``: ``"sub_group"`` holds back only the records of sub-groups not here yet;
      ``"all_moved"`` holds every record of a moved sub-group until all moved state arrived.
    * ``chunk_bytes``: a sub-group travels in chunks of at most this many bytes (keys, values
      and offsets of the Arrow chunk; a single larger row travels alone), one call each;
      ``inflight_chunks``: calls outstanding per (new owner, old owner) pair, on-demand ones
      first and, with ``on_demand``, one slot kept for them (background pulls use the others);
      so at most ``inflight_chunks * chunk_bytes`` of state is in flight per pair.
    * ``pause_sources`` / ``full_restore``: stop-and-restart: sources pause, every instance
      snapshots, the new instances restore all their key groups from the snapshots, sources
      resume. Like Flink's stop-with-savepoint and restore, every key group of every new owner
      is restored, moved or not.
    """

    on_demand: bool = True
    background: str = "hot_first"
    hold: str = "sub_group"
    background_after_s: float = 0.0
    chunk_sub_groups: int = 8
    chunk_bytes: int = 4 << 20
    fetch_concurrency: int = 2
    inflight_chunks: int = 3
    pause_sources: bool = False
    full_restore: bool = False

    def __post_init__(self) -> None:
        if self.background not in ("hot_first", "all", "none"):
            msg = f"background must be 'hot_first', 'all' or 'none', got {self.background!r}"
            raise ConfigError(msg)
        if self.hold not in ("sub_group", "all_moved"):
            msg = f"hold must be 'sub_group' or 'all_moved', got {self.hold!r}"
            raise ConfigError(msg)
        v = self.chunk_bytes
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            msg = (
                f"chunk_bytes must be an int >= 1 (bytes of state per chunk, e.g. 4 << 20 for "
                f"4 MiB), got {v!r}"
            )
            raise ConfigError(msg)
        for name in ("chunk_sub_groups", "fetch_concurrency", "inflight_chunks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                msg = f"{name} must be an int >= 1, got {v!r}"
                raise ConfigError(msg)
        if self.background_after_s < 0:
            msg = f"background_after_s must be >= 0, got {self.background_after_s!r}"
            raise ConfigError(msg)


@dataclass(frozen=True)
class RescaleContext:
    """What a strategy plans from."""

    step: str
    old: RoutingTable
    new: RoutingTable  # the target assignment (see raystream.assignment.rebalance)
    load: np.ndarray  # measured records per key group
    sub_groups: int


@dataclass(frozen=True)
class MigrationPlan:
    """Routing tables to go through, one rescale barrier each, the last equal to the target."""

    strategy: str
    steps: tuple[RoutingTable, ...]
    policy: FetchPolicy = field(default_factory=FetchPolicy)


@runtime_checkable
class MigrationStrategy(Protocol):
    """A migration strategy plugin."""

    name: str

    def plan(self, ctx: RescaleContext) -> MigrationPlan: ...


def steps_moving(
    ctx: RescaleContext, groups_per_step: int, *, hottest_first: bool = True
) -> tuple[RoutingTable, ...]:
    """Intermediate tables that move ``groups_per_step`` key groups at a time (Megaphone)."""
    moved = ctx.old.moved_key_groups(ctx.new)
    if hottest_first:
        moved = moved[np.argsort(-ctx.load[moved], kind="stable")]
    owners = ctx.old.owners.copy()
    steps = []
    epoch = ctx.old.epoch
    for start in range(0, len(moved), groups_per_step):
        chunk = moved[start : start + groups_per_step]
        owners = owners.copy()
        owners[chunk] = ctx.new.owners[chunk]
        epoch += 1
        steps.append(
            RoutingTable(
                epoch=epoch,
                owners=owners,
                parallelism=max(ctx.new.parallelism, ctx.old.parallelism),
            )
        )
    if not steps:
        return (
            RoutingTable(
                epoch=ctx.old.epoch + 1, owners=ctx.new.owners, parallelism=ctx.new.parallelism
            ),
        )
    last = steps[-1]
    steps[-1] = RoutingTable(epoch=last.epoch, owners=last.owners, parallelism=ctx.new.parallelism)
    return tuple(steps)
