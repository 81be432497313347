"""q13: bids joined with a bounded side input, a file read once.

The side input is the reference's ``side_input.txt``: CSV lines ``key,value`` without a header,
``i,i`` for ``i`` in ``[0, 10,000)`` (``SideInputGenerator``, ``--num 10000``). Flink joins it
``FOR SYSTEM_TIME AS OF`` the bid's processing time ``ON mod(B.auction, 10000) = S.key``: a
lookup into a table that never changes, so the result is the inner join of the bids with the
file. Here a stateless step reads the file once per instance (at its first batch) into a sorted
key array and joins every batch with a binary search: no state, nothing to move on a rescale.
``mod`` is Java's remainder (the sign of the dividend), as ``np.fmod``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

import raystream as rs
from bench.nexmark.columns import with_meta

__all__ = [
    "MODULUS",
    "SCHEMA",
    "build_q13",
    "read_side_input",
    "side_input_join",
    "side_input_table",
    "write_side_input",
]

MODULUS = 10_000  # q13's mod(B.auction, 10000)
ROWS = 10_000  # the reference's side_input_gen.sh: --num 10000
SCHEMA = pa.schema([("key", pa.int64()), ("value", pa.string())])


def side_input_table(rows: int = ROWS) -> pa.Table:
    """The reference's side input: ``(i, str(i))`` for ``i`` in ``[0, rows)``."""
    keys = np.arange(rows, dtype=np.int64)
    return pa.table({"key": keys, "value": pa.array(keys).cast(pa.string())}, schema=SCHEMA)


def write_side_input(path: str | os.PathLike[str], rows: int = ROWS) -> Path:
    """Write the side input as the reference does: lines ``i,i``, no header."""
    out = Path(path)
    out.write_text("".join(f"{i},{i}\n" for i in range(rows)))
    return out


def read_side_input(path: str | os.PathLike[str]) -> pa.Table:
    """The side input file as a table ``key`` (int64), ``value`` (string)."""
    return pacsv.read_csv(
        path,
        read_options=pacsv.ReadOptions(column_names=SCHEMA.names),
        convert_options=pacsv.ConvertOptions(column_types=SCHEMA),
    )


def side_input_join(path: str | os.PathLike[str], name: str = "q13") -> rs.Operator:
    """A map_batches step: every bid whose ``fmod(auction, MODULUS)`` is a key of the side
    input, with that key's ``value`` (bids without a match dropped; a key twice in the file
    joins twice, as a join does)."""
    path = str(path)
    loaded: dict[str, Any] = {}

    def join(batch: pa.RecordBatch) -> pa.RecordBatch | None:
        if not loaded:  # once per instance
            side = read_side_input(path).sort_by("key")
            loaded["key"] = side.column("key").to_numpy()
            loaded["value"] = side.column("value").combine_chunks()
        keys = loaded["key"]
        auction = batch.column("auction").to_numpy(zero_copy_only=False)
        k = np.fmod(auction, MODULUS)
        lo = np.searchsorted(keys, k, side="left")
        hi = np.searchsorted(keys, k, side="right")
        count = hi - lo
        if not count.any():
            return None
        rows = np.repeat(np.arange(len(k)), count)
        first = np.cumsum(count) - count
        match = lo[rows] + np.arange(len(rows)) - first[rows]
        take = pa.array(rows)
        kept = batch.take(take)
        return with_meta(
            kept,
            {
                "auction": kept.column("auction"),
                "bidder": kept.column("bidder"),
                "price": kept.column("price"),
                "dateTime": kept.column("dateTime"),
                "value": loaded["value"].take(pa.array(match)),
            },
        )

    return rs.map_batches(join, name=name)


def build_q13(inputs: dict[str, Any]) -> rs.Stream:
    """``inputs["bid"]``: the bid stream; ``inputs["side_input"]``: the side input's path."""
    return inputs["bid"].apply(side_input_join(inputs["side_input"]))
