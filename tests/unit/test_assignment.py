"""The routing table a rescale aims at (``rebalance``): every instance gets work, a hot key group
does not stop the rest from being balanced, and only what must move moves."""

from __future__ import annotations

import numpy as np
import pytest

from raystream.assignment import rebalance
from raystream.keys import RoutingTable


def _loads(table: RoutingTable, load: np.ndarray) -> np.ndarray:
    return np.bincount(table.owners, weights=load, minlength=table.parallelism)


@pytest.mark.parametrize("seed", range(5))
def test_a_scale_out_with_one_hot_key_group_still_spreads_the_rest(seed: int) -> None:
    """One key group carries ~2/3 of the load: it stays alone on its instance, and every other
    instance, new ones included, gets a fair share of the rest."""
    rng = np.random.default_rng(seed)
    load = rng.integers(10, 2_000, size=32).astype(float)
    hot = int(rng.integers(0, 32))
    load[hot] = 2 * (load.sum() - load[hot])
    old = RoutingTable(epoch=4, owners=np.arange(32) % 2, parallelism=2)
    new = rebalance(old, 5, load)
    assert new.epoch == 5 and new.parallelism == 5
    per = _loads(new, load)
    holder = int(new.owners[hot])
    assert new.key_groups_of(holder).tolist() == [hot], "the hot group fills its instance alone"
    rest = np.delete(per, holder)
    fair = (load.sum() - load[hot]) / 4
    assert (rest > 0).all(), f"an instance got nothing: {per}"
    assert rest.max() <= 1.25 * fair + load.max(where=np.arange(32) != hot, initial=0) / 2
    # nothing moves between the two old instances: groups only go to the new ones, or off the
    # hot group's instance
    moved = old.moved_key_groups(new)
    assert all(new.owners[g] >= 2 or old.owners[g] == old.owners[hot] for g in moved)


def test_uniform_scale_out_and_in_are_balanced_and_keep_every_key_group() -> None:
    load = np.ones(128)
    t = RoutingTable.uniform(128, 3)
    out = rebalance(t, 4, load)
    counts = np.bincount(out.owners, minlength=4)
    # within the 5 % tolerance of the mean (32 groups each), give or take one group
    assert counts.max() <= 1.05 * 32 + 1 and counts.min() >= 0.85 * 32, counts
    assert len(t.moved_key_groups(out)) == counts[3], "only the new instance's share moves"
    back = rebalance(out, 2, load)
    assert set(back.owners.tolist()) == {0, 1}
    assert np.bincount(back.owners).tolist() == [64, 64]
    # on a scale-in, only the retired instances' groups move
    assert all(out.owners[g] >= 2 for g in out.moved_key_groups(back))


def test_nothing_moves_when_already_balanced() -> None:
    t = RoutingTable.uniform(64, 4)
    assert len(t.moved_key_groups(rebalance(t, 4, np.ones(64)))) == 0
