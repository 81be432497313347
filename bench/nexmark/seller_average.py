"""q6: per seller, the average winning price over an auction and the 10 before it.

The reference's text (Flink cannot run it: FLINK-19059)::

    AVG(Q.price) OVER (PARTITION BY Q.seller ORDER BY Q.dateTime
                       ROWS BETWEEN 10 PRECEDING AND CURRENT ROW)

over ``Q``, per auction its winning bid (the highest price among the bids in ``[dateTime,
expires]``). Read on a bounded input: one row per auction with a winner, the average (BIGINT:
truncated) of its winning price and those of the seller's 10 auctions before it, in the order of
the winning bids' ``dateTime`` (then the auction id). That is 11 rows, as written (the
description says "last 10"). Winners are q9's (ties: earliest, then smallest bidder).

Streaming, the winners are an updating stream (q9's ``auction_winner``), so this is updating
too: keyed by seller, the step keeps the seller's current winners (auction -> (time, price)) and
the average it last emitted per auction; on every batch it recomputes the seller's averages with
numpy and emits a change, keyed by auction with the seller's next ``_version``, for every
auction whose average changed (a new or better winner moves the 10 after it). The final table
(per auction the highest version) is the query's result over the whole input.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

import raystream as rs
from bench.nexmark.columns import VERSION, carry_meta, ms

__all__ = ["ROWS", "rolling_average", "seller_average"]

ROWS = 11  # ROWS BETWEEN 10 PRECEDING AND CURRENT ROW


def rolling_average(price: np.ndarray, rows: int = ROWS) -> np.ndarray:
    """Per position the truncated average of ``price`` over it and the ``rows - 1`` before."""
    total = np.cumsum(price, dtype=np.int64)
    before = np.concatenate([np.zeros(rows, np.int64), total])[: len(total)]
    count = np.minimum(np.arange(1, len(price) + 1), rows)
    return (total - before) // count


@rs.keyed_batches(name="seller_average", state=rs.ValueState(object))
def seller_average(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch | None:
    """Keyed by seller; input: winner changes (id, price, bid_dateTime) of its auctions. State
    per seller: (version, {auction: (t, price)}, {auction: average emitted})."""
    rec = batch.records
    ids = rec.column("id").to_numpy(zero_copy_only=False)
    price = rec.column("price").to_numpy(zero_copy_only=False)
    t = ms(rec.column("bid_dateTime"))
    offsets = batch.offsets
    stored = state.get(batch.keys)
    out_key: list[int] = []
    out_id: list[int] = []
    out_avg: list[int] = []
    out_version: list[int] = []
    put_idx: list[int] = []
    put_values: list[Any] = []
    for i, value in enumerate(stored):
        version, winners, emitted = value if value is not None else (0, {}, {})
        for r in range(int(offsets[i]), int(offsets[i + 1])):  # in arrival order
            winners[int(ids[r])] = (int(t[r]), int(price[r]))
        order = sorted(winners, key=lambda a: (winners[a][0], a))
        avg = rolling_average(np.array([winners[a][1] for a in order], np.int64))
        changed = [(a, int(v)) for a, v in zip(order, avg.tolist(), strict=True)
                   if emitted.get(a) != v]  # fmt: skip
        if not changed:
            continue
        version += 1
        for a, v in changed:
            emitted[a] = v
            out_key.append(i)
            out_id.append(a)
            out_avg.append(v)
            out_version.append(version)
        put_idx.append(i)
        put_values.append((version, winners, emitted))
    if not put_idx:
        return None
    state.put(batch.keys.take(np.array(put_idx, np.int64)), put_values)
    idx = np.array(out_key, np.int64)
    out: dict[str, Any] = {
        "seller": batch.keys.keys.take(pa.array(idx)),
        "id": pa.array(out_id, pa.int64()),
        "avg_price": pa.array(out_avg, pa.int64()),
        VERSION: pa.array(out_version, pa.int64()),
    }
    carry_meta(batch, idx, out)
    return pa.RecordBatch.from_pydict(out)
