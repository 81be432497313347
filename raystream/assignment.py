"""Rescale assignment: a new routing table that moves few key groups and balances measured load.

Contiguous ranges (Flink's formula, :meth:`RoutingTable.uniform`) are right for a fresh job; on a
rescale they would move most key groups. :func:`rebalance` instead keeps every key group where it
is unless its owner retires or is overloaded, and gives hot key groups more weight than cold ones.
"""

from __future__ import annotations

import heapq

import numpy as np

from raystream.errors import RescaleError
from raystream.keys import RoutingTable

__all__ = ["check_rescale_parallelism", "rebalance"]


def check_rescale_parallelism(parallelism: object, num_key_groups: int, step: str = "") -> None:
    """A rescale target must be an int in [1, num_key_groups]; RescaleError otherwise."""
    if (
        not isinstance(parallelism, (int, np.integer))
        or isinstance(parallelism, bool)
        or not 1 <= parallelism <= num_key_groups
    ):
        what = f"{step!r} " if step else ""
        msg = (
            f"cannot rescale {what}to parallelism {parallelism!r}: it must be an int in "
            f"[1, {num_key_groups}] (1 .. the number of key groups)"
        )
        raise RescaleError(msg)


def rebalance(
    table: RoutingTable,
    parallelism: int,
    load: np.ndarray | None = None,
    *,
    tolerance: float = 0.05,
) -> RoutingTable:
    """The routing table for ``parallelism`` instances, from ``table``, with epoch + 1.

    ``load[key_group]`` is the measured load (records processed); ``None`` means uniform. Every key
    group weighs ``load + 1% of the mean``, so cold groups still spread. Steps:

    1. Key groups of retired instances (index >= parallelism) go, heaviest first, to the least
       loaded remaining instance.
    2. While an instance is above ``(1 + tolerance) * mean``, the most loaded one that can give a
       key group away moves the group that best fills the gap to the least loaded instance (as
       long as that lowers the giver's load below where it was). An instance holding a single
       hot key group cannot be relieved; the others still are.
    """
    n = table.num_key_groups
    check_rescale_parallelism(parallelism, n)
    w = np.ones(n) if load is None else np.asarray(load, dtype=np.float64).copy()
    if w.shape != (n,):
        msg = f"load must have one entry per key group ({n}), got shape {w.shape}"
        raise RescaleError(msg)
    w = np.maximum(w, 0) + max(w.mean(), 1e-9) * 0.01
    owners = table.owners.astype(np.int64).copy()
    totals = np.bincount(
        owners[owners < parallelism], weights=w[owners < parallelism], minlength=parallelism
    )[:parallelism]

    # 1. orphans of retired instances, heaviest first, to the least loaded instance
    orphans = np.flatnonzero(owners >= parallelism)
    heap = [(totals[i], i) for i in range(parallelism)]
    heapq.heapify(heap)
    for g in orphans[np.argsort(-w[orphans], kind="stable")]:
        t, i = heapq.heappop(heap)
        owners[g] = i
        heapq.heappush(heap, (t + w[g], i))
    totals = np.bincount(owners, weights=w, minlength=parallelism)

    # 2. relieve overloaded instances with as few moves as possible
    # the mean over what can be balanced: a key group heavier than the mean of the rest fills
    # an instance on its own and is left out of the mean the others aim at
    rest, alone = w.sum(), 0
    for g in np.sort(w)[::-1]:
        if alone >= parallelism - 1 or g <= rest / (parallelism - alone):
            break
        rest -= g
        alone += 1
    target = rest / (parallelism - alone)
    for _ in range(n):
        lo = int(np.argmin(totals))
        move = None
        # the most loaded instance first; one that cannot give anything away (a single hot key
        # group) does not stop the others above the mean from being relieved
        for hi in np.argsort(-totals, kind="stable").tolist():
            if totals[hi] <= target * (1 + tolerance) or hi == lo:
                break
            mine = np.flatnonzero(owners == hi)
            if len(mine) <= 1:
                continue
            # the group closest to the gap without overshooting it (else the smallest)
            gap = (totals[hi] - totals[lo]) / 2
            fits = mine[w[mine] <= gap]
            g = int(fits[np.argmax(w[fits])]) if len(fits) else int(mine[np.argmin(w[mine])])
            if max(totals[hi] - w[g], totals[lo] + w[g]) < totals[hi]:
                move = (hi, g)
                break
        if move is None:
            break
        hi, g = move
        owners[g] = lo
        totals[hi] -= w[g]
        totals[lo] += w[g]
    return RoutingTable(
        epoch=table.epoch + 1, owners=owners.astype(np.int32), parallelism=parallelism
    )
