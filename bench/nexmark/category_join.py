"""q20: every bid joined with its auction, for auctions of category 10 (a regular inner join,
append-only: each (bid, auction) pair is emitted once, when both are here).

Keyed by the auction id: input 0 the auctions (all of them, with their category), input 1 the
bids. An auction of category 10 is kept in state and joins the bids that waited for it and every
later bid; an auction of another category is kept only as a mark, so its bids are dropped on
arrival instead of waiting forever (filtering auctions before the join would leave every bid of
the other 80 % of auctions in state). Bids of an auction not seen yet wait for it. One auction
per id, as the generator makes them (a second row of an id replaces the first).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

import raystream as rs
from bench.nexmark.columns import carry_meta, ms, ts

__all__ = ["AUCTION_COLUMNS", "BID_COLUMNS", "CATEGORY", "auction_bids", "build_q20"]

CATEGORY = 10
# output name -> auction column; dateTime and expires as int64 ms in state
AUCTION_COLUMNS = {
    "itemName": "itemName",
    "description": "description",
    "initialBid": "initialBid",
    "reserve": "reserve",
    "auction_dateTime": "dateTime",
    "expires": "expires",
    "seller": "seller",
    "category": "category",
    "auction_extra": "extra",
}
BID_COLUMNS = {
    "bidder": "bidder",
    "price": "price",
    "channel": "channel",
    "url": "url",
    "bid_dateTime": "dateTime",
    "bid_extra": "extra",
}
_TYPES = {
    "itemName": pa.string(), "description": pa.string(), "initialBid": pa.int64(),
    "reserve": pa.int64(), "seller": pa.int64(), "category": pa.int64(),
    "auction_extra": pa.string(), "bidder": pa.int64(), "price": pa.int64(),
    "channel": pa.string(), "url": pa.string(), "bid_extra": pa.string(),
}  # fmt: skip
_TIMES = ("auction_dateTime", "expires", "bid_dateTime")
_OTHER_CATEGORY = False  # the state of an auction of another category


def _column(name: str, values: list[Any]) -> pa.Array:
    if name in _TIMES:
        return ts(values)
    return pa.array(values, _TYPES[name])


def _values(rec: pa.RecordBatch, columns: dict[str, str], rows: np.ndarray) -> list[list[Any]]:
    """The ``columns`` of records ``rows`` as Python lists (times as int64 ms)."""
    take = pa.array(rows)
    out = []
    for name, col in columns.items():
        c = rec.column(col)
        out.append(ms(c)[rows].tolist() if name in _TIMES else c.take(take).to_pylist())
    return out


@rs.keyed_batches(
    name="auction_bids",
    state={
        "auction": rs.ValueState(object),  # the auction's values (AUCTION_COLUMNS), or False
        "waiting": rs.ValueState(object),  # bids before their auction: lists of BID_COLUMNS
    },
)
def auction_bids(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch | None:
    """See the module. Output: auction, the bid's columns, the auction's columns."""
    rec, keys, offsets = batch.records, batch.keys, batch.offsets
    n = len(keys)
    auctions = state.auction.get(keys)
    out_key: list[int] = []  # per output row: the key's index
    bid_rows: list[list[Any]] = [[] for _ in BID_COLUMNS]
    if batch.input == 0:  # auctions: the last of each key
        last = offsets[1:] - 1
        vals = _values(rec, AUCTION_COLUMNS, last)
        category = vals[list(AUCTION_COLUMNS).index("category")]
        for i in range(n):
            auctions[i] = tuple(v[i] for v in vals) if category[i] == CATEGORY else _OTHER_CATEGORY
        state.auction.put(keys, auctions)
        waiting = state.waiting.get(keys)
        settled = [i for i in range(n) if waiting[i] is not None]
        for i in settled:
            if auctions[i] is _OTHER_CATEGORY:
                continue
            for j, column in enumerate(waiting[i]):
                bid_rows[j].extend(column)
            out_key.extend([i] * len(waiting[i][0]))
        if settled:
            state.waiting.delete(keys.take(np.array(settled, np.int64)))
    else:  # bids
        known = np.fromiter((a is not None for a in auctions), bool, n)
        joined = np.fromiter((bool(a) for a in auctions), bool, n)  # False/None: not joined
        if not known.all():  # bids ahead of their auction wait for it
            wait = np.flatnonzero(~known)
            pending = state.waiting.get(keys.take(wait))
            stored = []
            for j, i in enumerate(wait.tolist()):
                mine = _values(rec, BID_COLUMNS, np.arange(offsets[i], offsets[i + 1]))
                if pending[j] is not None:
                    mine = [a + b for a, b in zip(pending[j], mine, strict=True)]
                stored.append(mine)
            state.waiting.put(keys.take(wait), stored)
        if joined.any():
            ki = batch.key_index()
            rows = np.flatnonzero(joined[ki])
            vals = _values(rec, BID_COLUMNS, rows)
            for j, column in enumerate(vals):
                bid_rows[j].extend(column)
            out_key.extend(ki[rows].tolist())
    if not out_key:
        return None
    idx = np.array(out_key, np.int64)
    out: dict[str, Any] = {"auction": keys.keys.take(pa.array(idx))}
    for j, name in enumerate(BID_COLUMNS):
        out[name] = _column(name, bid_rows[j])
    distinct, inverse = np.unique(idx, return_inverse=True)
    for j, name in enumerate(AUCTION_COLUMNS):  # per key once, then taken for its rows
        per_key = _column(name, [auctions[i][j] for i in distinct.tolist()])
        out[name] = per_key.take(pa.array(inverse.ravel()))
    carry_meta(batch, idx, out)
    return pa.RecordBatch.from_pydict(out)


def build_q20(inputs: dict[str, rs.Stream]) -> rs.Stream:
    auctions = inputs["auction"].key_by("id")
    bids = inputs["bid"].key_by("auction")
    return auctions.connect(bids).apply(auction_bids, name="q20")
