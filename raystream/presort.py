"""Pushes sorted by key group: the writer hashes, the source instance only cuts.

When the step after a push source is a key partitioning by a column, an outside writer (a Spark
task) can do the per-row work of routing itself: it computes every row's key group, sorts the
push by key group (stable, so per-key order holds) and adds the key groups as the column
:data:`KEY_GROUP_COLUMN`. The source instance's partitioner then maps key groups to owners
through its *current* routing table and cuts the batch into contiguous slices, one run of equal
owners each: no hash, no sort, no copy there.

Rescales stay exact because only the key group travels with a row, never its owner: the key
groups of a job are fixed for its life (``num_key_groups``), and which instance owns one is
decided where it always was, by the source's routing table at its epoch. Exactly-once stays
where it was too: the sort is a function of the push's rows, so a partition computed again
yields the same pushes in the same order, and the source's dedupe by ``(token, offset)``
recognises them.

Every partitioner strips the column (:func:`take_key_groups`), so no step downstream sees it.

Example::

    >>> import pyarrow as pa
    >>> from raystream.keys import KeySpace, RoutingTable
    >>> ks = KeySpace(num_key_groups=8)
    >>> b = sort_by_key_group(pa.record_batch({"key": list(range(6))}), "key", ks)
    >>> b.schema.names
    ['key', '__raystream_key_group']
    >>> rest, kg = take_key_groups(b)
    >>> [(r, e - s) for r, s, e in owner_runs(kg, RoutingTable.uniform(8, 2))]
    [(0, 1), (1, 5)]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from raystream.keys import KeySpace, RoutingTable, stable_hash, to_key_array

if TYPE_CHECKING:
    from raystream.dataflow import Step

__all__ = [
    "KEY_GROUP_COLUMN",
    "KeyGroupPlan",
    "owner_runs",
    "plan_for",
    "sort_by_key_group",
    "split_by_owner",
    "take_key_groups",
]

KEY_GROUP_COLUMN = "__raystream_key_group"

# more runs of equal owners than this (a batch made of many sorted pushes, or none) and a
# stable sort by owner is cheaper than that many slices
MAX_RUNS_PER_RECEIVER = 8


@dataclass(frozen=True)
class KeyGroupPlan:
    """What a writer needs to sort its pushes by key group: the key column of the step after the
    source and the job's key-group count (fixed for the job's life)."""

    key_column: str
    num_key_groups: int
    sub_groups: int = 16

    @property
    def key_space(self) -> KeySpace:
        return KeySpace(self.num_key_groups, self.sub_groups)


def sort_by_key_group(
    batch: pa.RecordBatch, key_column: str, key_space: KeySpace
) -> pa.RecordBatch:
    """``batch`` stably sorted by its rows' key groups, with the key groups (uint16) appended as
    :data:`KEY_GROUP_COLUMN`. Null or unsupported keys raise as ``key_by`` would."""
    idx = batch.schema.get_field_index(key_column)
    if idx < 0:
        from raystream.errors import SchemaError

        msg = (
            f"records have no key column {key_column!r}; they have columns "
            f"{batch.schema.names}. Fix key_by(...) or the DataFrame."
        )
        raise SchemaError(msg)
    kg = key_space.key_group(stable_hash(to_key_array(batch.column(idx), column=key_column)))
    if len(kg) > 1 and (kg[1:] < kg[:-1]).any():
        order = np.argsort(kg, kind="stable")  # a radix sort for uint16
        batch = batch.take(pa.array(order))
        kg = kg[order]
    return batch.append_column(_field(key_column, key_space), pa.array(kg, pa.uint16()))


def _field(key_column: str, key_space: KeySpace) -> pa.Field:
    """The key-group column's field; its metadata says which key and key space it holds."""
    meta = {b"key_column": key_column.encode(), b"num_key_groups": str(key_space.num_key_groups)}
    return pa.field(KEY_GROUP_COLUMN, pa.uint16(), nullable=False, metadata=meta)


def take_key_groups(
    batch: pa.RecordBatch, key_column: str | None = None, key_space: KeySpace | None = None
) -> tuple[pa.RecordBatch, np.ndarray | None]:
    """The batch without :data:`KEY_GROUP_COLUMN` (zero-copy) and that column's key groups;
    ``(batch, None)`` when it has none, or when they were computed for another key column or
    key-group count than ``key_column`` / ``key_space`` (then the caller computes its own)."""
    idx = batch.schema.get_field_index(KEY_GROUP_COLUMN)
    if idx < 0:
        return batch, None
    meta = batch.schema.field(idx).metadata or {}
    rest = batch.remove_column(idx)
    if key_column is not None and meta.get(b"key_column") != key_column.encode():
        return rest, None
    if (
        key_space is not None
        and meta.get(b"num_key_groups") != str(key_space.num_key_groups).encode()
    ):
        return rest, None
    return rest, batch.column(idx).to_numpy(zero_copy_only=False)


def owner_runs(kg: np.ndarray, table: RoutingTable) -> list[tuple[int, int, int]]:
    """``(receiver, start, end)`` for each run of consecutive rows whose key groups have the same
    owner in ``table``. A batch sorted by key group has about one run per receiver while owners
    are contiguous ranges (as :meth:`RoutingTable.uniform` and a rescale's moves keep them
    mostly); any order is correct, only slower."""
    n = len(kg)
    if n == 0:
        return []
    dest = table.owners[kg]
    cuts = np.flatnonzero(dest[1:] != dest[:-1]) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [n]))
    return list(zip(dest[starts].tolist(), starts.tolist(), ends.tolist(), strict=True))


def split_by_owner(
    batch: pa.RecordBatch, kg: np.ndarray, table: RoutingTable
) -> list[tuple[int, pa.RecordBatch]]:
    """``batch`` (key groups ``kg``, a row each) cut into ``(receiver, rows)`` pieces by the
    owners in ``table``, rows of each receiver in batch order: zero-copy slices when the batch
    comes in few runs of equal owners (sorted by key group), else one stable sort by owner."""
    if batch.num_rows == 0:
        return []
    if table.parallelism == 1:
        return [(0, batch)]
    runs = owner_runs(kg, table)
    if len(runs) <= MAX_RUNS_PER_RECEIVER * table.parallelism:
        return [(r, batch.slice(s, e - s)) for r, s, e in runs]
    return split_by_destination(batch, table.owners[kg], table.parallelism)


def split_by_destination(
    batch: pa.RecordBatch, dest: np.ndarray, parallelism: int
) -> list[tuple[int, pa.RecordBatch]]:
    """``batch`` cut into ``(receiver, rows)`` pieces by ``dest`` (a receiver per row, below
    ``parallelism``), rows of each receiver in batch order: one stable sort by receiver."""
    order = np.argsort(dest.astype(np.uint16), kind="stable")  # a radix sort (< 32768)
    counts = np.bincount(dest, minlength=parallelism)
    taken = batch.take(pa.array(order))
    out = []
    offset = 0
    for receiver, k in enumerate(counts.tolist()):
        if k:
            out.append((receiver, taken.slice(offset, k)))
            offset += k
    return out


def plan_for(steps: Mapping[str, Step], source: str, key_space: KeySpace) -> KeyGroupPlan | None:
    """The plan for writers into source step ``source``: set when every step reading it is a
    single-input keyed step keyed by a column (so its records are routed by that column's key
    group), all by the same column; None otherwise."""
    readers = [s for s in steps.values() if source in s.upstream]
    columns = set()
    for step in readers:
        key = step.key_for(source)
        if not step.is_keyed or len(step.input_keys) != 1 or key is None or key.column is None:
            return None
        columns.add(key.column)
    if len(columns) != 1:
        return None
    return KeyGroupPlan(columns.pop(), key_space.num_key_groups, key_space.sub_groups)
