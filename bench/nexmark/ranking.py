"""q18 and q19: ``ROW_NUMBER() OVER (PARTITION BY ... ORDER BY ...) <= n`` as updating keyed
steps.

* q18, the last bid of every (bidder, auction): ``ORDER BY dateTime DESC``, rank 1. Flink's
  deduplication keeps, among bids of one time, the one that arrived last; to be independent of
  arrival order (the input may be out of order, and a rescale interleaves records) ties are
  broken here by ``price``, ``channel``, ``url``, ``extra``, all descending, nulls last.
* q19, the ten highest bids of every auction with their ``rank_number`` (1 = highest):
  ``ORDER BY price DESC``, ties broken by ``dateTime``, ``bidder``, ``channel``, ``url``,
  ``extra``, all ascending, nulls last.

Both emit changes with the key's next ``_version`` whenever a batch changes the key's rows:
q18 the new last bid of a (bidder, auction), q19 every rank from the first one that changed down
(a new bid pushes the ones below it down one rank; the ranks only grow, so nothing is deleted).
The final table, per (bidder, auction) or (auction, rank_number) the row of the highest version,
is the query's result over the whole input.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import raystream as rs
from bench.nexmark.columns import VERSION, carry_meta, ms, ts, with_meta

__all__ = ["TOP", "build_q18", "build_q19", "last_bid", "top_bids"]

TOP = 10  # q19's ranks
_BID_COLUMNS = ("auction", "bidder", "price", "channel", "url", "dateTime", "extra")


def _desc_nulls_last(s: str | None) -> tuple[bool, str]:
    """A sort key under which a larger string is larger and null is the smallest."""
    return (s is not None, s or "")


def _asc_nulls_last(s: str | None) -> tuple[bool, str]:
    """A sort key under which a smaller string is smaller and null is the largest."""
    return (s is None, s or "")


# --------------------------------------------------------------------------------------------
# q18: the last bid per (bidder, auction)


def _q18_rank(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """Larger is later: (t, price, channel, url, extra); row = (t, price, channel, url, extra,
    ...)."""
    return (row[0], row[1], *(_desc_nulls_last(s) for s in row[2:5]))


@rs.keyed_batches(name="last_bid", state=rs.ValueState(object))
def last_bid(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch | None:
    """Keyed by ``bidder|auction``: the key's last bid (see the module); a change with the
    key's next ``_version`` when a batch brings a later one. State per key: (t, price, channel,
    url, extra, version)."""
    rec = batch.records
    ki = batch.key_index()
    order = pa.table(
        {
            "k": ki,
            "t": ms(rec.column("dateTime")),
            "price": rec.column("price"),
            "channel": rec.column("channel"),
            "url": rec.column("url"),
            "extra": rec.column("extra"),
        }
    ).sort_by(
        [
            ("k", "ascending"),
            ("t", "descending"),
            ("price", "descending"),
            ("channel", "descending"),
            ("url", "descending"),
            ("extra", "descending"),
        ]
    )  # fmt: skip  (nulls sort last, also descending)
    k_sorted = order.column("k").to_numpy()
    first = np.flatnonzero(np.r_[True, k_sorted[1:] != k_sorted[:-1]])
    best = order.take(pa.array(first))  # one row per key, in key order
    cand = list(
        zip(*(best.column(c).to_pylist() for c in ("t", "price", "channel", "url", "extra")),
            strict=True)
    )  # fmt: skip
    stored = state.get(batch.keys)
    changed: list[int] = []
    values: list[tuple[Any, ...]] = []
    for i, (new, old) in enumerate(zip(cand, stored, strict=True)):
        if old is not None and _q18_rank(new) <= _q18_rank(old):
            continue
        changed.append(i)
        values.append((*new, 1 if old is None else old[5] + 1))
    if not changed:
        return None
    idx = np.array(changed, np.int64)
    state.put(batch.keys.take(idx), values)
    first_rec = pa.array(batch.offsets[:-1][idx])  # any record of the key: bidder, auction
    out: dict[str, Any] = {
        "auction": rec.column("auction").take(first_rec),
        "bidder": rec.column("bidder").take(first_rec),
        "price": pa.array([v[1] for v in values], pa.int64()),
        "channel": pa.array([v[2] for v in values], pa.string()),
        "url": pa.array([v[3] for v in values], pa.string()),
        "dateTime": ts([v[0] for v in values]),
        "extra": pa.array([v[4] for v in values], pa.string()),
        VERSION: pa.array([v[5] for v in values], pa.int64()),
    }
    carry_meta(batch, idx, out)
    return pa.RecordBatch.from_pydict(out)


def _pair_key(batch: pa.RecordBatch) -> pa.RecordBatch:
    cols = {c: batch.column(c) for c in _BID_COLUMNS}
    cols["pair"] = pc.binary_join_element_wise(
        batch.column("bidder").cast(pa.string()), batch.column("auction").cast(pa.string()), "|"
    )
    return with_meta(batch, cols)


def build_q18(inputs: dict[str, rs.Stream]) -> rs.Stream:
    pairs = inputs["bid"].apply(rs.map_batches(_pair_key, name="q18_pairs"))
    return pairs.key_by("pair").apply(last_bid, name="q18")


# --------------------------------------------------------------------------------------------
# q19: the top ten bids per auction


def _q19_rank(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """Smaller is better: row = (price, t, bidder, channel, url, extra)."""
    return (-row[0], row[1], row[2], *(_asc_nulls_last(s) for s in row[3:6]))


@rs.keyed_batches(name="top_bids", state=rs.ValueState(object))
def top_bids(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch | None:
    """Keyed by auction: its :data:`TOP` best bids (see the module). State per key:
    (version, rows best first), a row (price, t, bidder, channel, url, extra). A bid below a
    full top's last price cannot enter and is dropped before any Python work."""
    rec = batch.records
    stored = state.get(batch.keys)
    ki = batch.key_index()
    price = rec.column("price").to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    floor = np.array(
        [v[1][-1][0] if v is not None and len(v[1]) >= TOP else np.iinfo(np.int64).min
         for v in stored],
        np.int64,
    )  # fmt: skip
    live = np.flatnonzero(price >= floor[ki])
    if not len(live):
        return None
    take = pa.array(live)
    t = ms(rec.column("dateTime"))[live]
    cols = [price[live].tolist(), t.tolist(), rec.column("bidder").take(take).to_pylist()]
    cols += [rec.column(c).take(take).to_pylist() for c in ("channel", "url", "extra")]
    rows = list(zip(*cols, strict=True))
    live_keys = ki[live]
    bounds = np.flatnonzero(np.r_[True, live_keys[1:] != live_keys[:-1], True])
    out_key: list[int] = []
    out_rank: list[int] = []
    out_rows: list[tuple[Any, ...]] = []
    out_version: list[int] = []
    put_idx: list[int] = []
    put_values: list[Any] = []
    for b in range(len(bounds) - 1):
        lo, hi = int(bounds[b]), int(bounds[b + 1])
        i = int(live_keys[lo])
        version, old = stored[i] if stored[i] is not None else (0, [])
        new = sorted(old + rows[lo:hi], key=_q19_rank)[:TOP]
        same = 0
        while same < len(old) and new[same] == old[same]:
            same += 1
        if same == len(new):
            continue
        version += 1
        put_idx.append(i)
        put_values.append((version, new))
        for r in range(same, len(new)):
            out_key.append(i)
            out_rank.append(r + 1)
            out_rows.append(new[r])
            out_version.append(version)
    if not put_idx:
        return None
    state.put(batch.keys.take(np.array(put_idx, np.int64)), put_values)
    idx = np.array(out_key, np.int64)
    out: dict[str, Any] = {
        "auction": batch.keys.keys.take(pa.array(idx)),
        "bidder": pa.array([r[2] for r in out_rows], pa.int64()),
        "price": pa.array([r[0] for r in out_rows], pa.int64()),
        "channel": pa.array([r[3] for r in out_rows], pa.string()),
        "url": pa.array([r[4] for r in out_rows], pa.string()),
        "dateTime": ts([r[1] for r in out_rows]),
        "extra": pa.array([r[5] for r in out_rows], pa.string()),
        "rank_number": pa.array(out_rank, pa.int64()),
        VERSION: pa.array(out_version, pa.int64()),
    }
    carry_meta(batch, idx, out)
    return pa.RecordBatch.from_pydict(out)


def build_q19(inputs: dict[str, rs.Stream]) -> rs.Stream:
    return inputs["bid"].key_by("auction").apply(top_bids, name="q19")
