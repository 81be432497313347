"""The built-in strategies: each plans steps and a fetch policy, nothing more."""

from __future__ import annotations

from dataclasses import dataclass

from raystream.rescale import FetchPolicy, MigrationPlan, RescaleContext, steps_moving

__all__ = ["AllAtOnce", "Batched", "Fluid", "Lazy", "Meces", "StopRestart"]


def _one_step(ctx: RescaleContext) -> tuple:
    return steps_moving(ctx, max(1, ctx.old.num_key_groups))


@dataclass(frozen=True)
class Meces:
    """Hot keys first (Meces): fetch on demand, pull the rest hottest first in bounded chunks."""

    name: str = "meces"
    chunk_sub_groups: int = 8
    chunk_bytes: int = 4 << 20
    fetch_concurrency: int = 2
    # calls outstanding per (new owner, old owner) pair, one kept for on-demand fetches; a pair
    # moves about (inflight_chunks - 1) x chunk_bytes per round trip of a call
    inflight_chunks: int = 5

    def plan(self, ctx: RescaleContext) -> MigrationPlan:
        policy = FetchPolicy(
            on_demand=True,
            background="hot_first",
            hold="sub_group",
            chunk_sub_groups=self.chunk_sub_groups,
            chunk_bytes=self.chunk_bytes,
            fetch_concurrency=self.fetch_concurrency,
            inflight_chunks=self.inflight_chunks,
        )
        return MigrationPlan(self.name, _one_step(ctx), policy)


@dataclass(frozen=True)
class AllAtOnce:
    """Move every affected sub-group as one block; hold moved key groups until all arrived."""

    name: str = "all_at_once"
    chunk_bytes: int = 4 << 20
    inflight_chunks: int = 2

    def plan(self, ctx: RescaleContext) -> MigrationPlan:
        policy = FetchPolicy(
            on_demand=False,
            background="all",
            hold="all_moved",
            chunk_bytes=self.chunk_bytes,
            chunk_sub_groups=1 << 20,
            inflight_chunks=self.inflight_chunks,
        )
        return MigrationPlan(self.name, _one_step(ctx), policy)


@dataclass(frozen=True)
class Fluid:
    """Megaphone's fluid migration: one key group per step, each step behind its own barrier."""

    name: str = "fluid"

    def plan(self, ctx: RescaleContext) -> MigrationPlan:
        policy = FetchPolicy(
            on_demand=False, background="all", hold="all_moved", chunk_sub_groups=1 << 20
        )
        return MigrationPlan(self.name, steps_moving(ctx, 1), policy)


@dataclass(frozen=True)
class Batched:
    """Megaphone's batched migration: ``batch_size`` key groups per step."""

    name: str = "batched"
    batch_size: int = 8

    def plan(self, ctx: RescaleContext) -> MigrationPlan:
        policy = FetchPolicy(
            on_demand=False, background="all", hold="all_moved", chunk_sub_groups=1 << 20
        )
        return MigrationPlan(self.name, steps_moving(ctx, max(1, self.batch_size)), policy)


@dataclass(frozen=True)
class Lazy:
    """On-demand only; after ``max_lazy_s`` the rest is pulled so old owners can retire."""

    name: str = "lazy"
    max_lazy_s: float = 5.0

    def plan(self, ctx: RescaleContext) -> MigrationPlan:
        policy = FetchPolicy(
            on_demand=True, background="none", hold="sub_group", background_after_s=self.max_lazy_s
        )
        return MigrationPlan(self.name, _one_step(ctx), policy)


@dataclass(frozen=True)
class StopRestart:
    """Flink's way: pause the sources, drain, snapshot, restore every key group, resume.

    As Flink's stop-with-savepoint and restore does, every new owner restores all its key
    groups from the snapshots, those that did not change hands as well."""

    name: str = "stop_restart"

    def plan(self, ctx: RescaleContext) -> MigrationPlan:
        policy = FetchPolicy(
            on_demand=False,
            background="none",
            hold="all_moved",
            pause_sources=True,
            full_restore=True,
        )
        return MigrationPlan(self.name, _one_step(ctx), policy)
