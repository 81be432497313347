"""q15, q16, q17: per-day bid statistics, updating aggregates as Flink computes them.

Flink groups by ``DATE_FORMAT(dateTime, 'yyyy-MM-dd')`` (UTC here) without a window, so its
result is an updating table: a group's row changes with every bid. The dataflows emit the same
changelog: per group a new row whenever a batch changes it, with the group's ``_version`` kept in
keyed state, so the final table (per group the row of the highest version) is the aggregate
over all bids, which the oracle computes. Price ranks: 1 below 10,000, 2 from 10,000 below
1,000,000, 3 from 1,000,000.

* q17, per (auction, day): bid counts (total, per rank), min, max, ``avg`` (BIGINT: the sum
  divided by the count, truncated) and sum of the price; one keyed step, its state per group one
  packed int64 row (no pickling).
* q15 (per day) and q16 (per channel and day, also the latest ``HH:mm`` of its bids): bid
  counts and ``count(distinct bidder)`` / ``count(distinct auction)``, each in total and per
  rank. Distinct counts in two steps, as Flink's split-distinct aggregation does: a step keyed
  by (group, bidder) or (group, auction) keeps the ranks that value was seen with (a bit mask)
  and emits +1 for every (group, rank) the value is new to; a step keyed by the group adds those
  up with the bid counts. The first step holds the large state (one entry per distinct value)
  and is the one that ``--parallelism`` and a rescale apply to; the second has one key per group
  (q15: one per day).

Groups are string keys: ``day`` for q15, ``day|channel`` for q16 (the day has a fixed width, so
the channel may contain ``|``), ``auction|day`` for q17; a distinct value's key is
``group|kind|value`` (kind 1 bidder, 2 auction). Null channels are not supported (a null key is
refused by the runtime).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import raystream as rs
from bench.nexmark.columns import META, VERSION, ms, with_meta

__all__ = [
    "auction_day_stats",
    "build_q15",
    "build_q16",
    "build_q17",
    "daily_totals",
    "day_strings",
    "first_seen",
    "price_rank",
]

DAY_MS = 86_400_000
_MINUTE_MS = 60_000
_RANK_BOUNDS = np.array([10_000, 1_000_000], np.int64)
_EPOCH = dt.date(1970, 1, 1)


def price_rank(price: np.ndarray) -> np.ndarray:
    """0 for a price below 10,000, 1 from 10,000 below 1,000,000, 2 from 1,000,000."""
    return np.searchsorted(_RANK_BOUNDS, price, side="right")


def day_strings(t_ms: np.ndarray) -> pa.Array:
    """``DATE_FORMAT(t, 'yyyy-MM-dd')`` of ms since the epoch (UTC); each distinct day formatted
    once."""
    days, inverse = np.unique(t_ms // DAY_MS, return_inverse=True)
    names = pa.array([(_EPOCH + dt.timedelta(days=int(d))).isoformat() for d in days], pa.string())
    return names.take(pa.array(inverse.ravel()))


def _minute_strings(minute: np.ndarray) -> pa.Array:
    """``HH:mm`` of minutes of the day."""
    return pa.array([f"{m // 60:02d}:{m % 60:02d}" for m in minute.tolist()], pa.string())


def _packed(values: list[bytes | None], initial: np.ndarray) -> np.ndarray:
    """Per key its int64 row (``initial`` where it has none) as an (n, width) array."""
    blank = initial.astype("<i8").tobytes()
    buf = b"".join(blank if v is None else v for v in values)
    return np.frombuffer(buf, "<i8").reshape(len(values), len(initial)).copy()


def _rows(matrix: np.ndarray) -> list[bytes]:
    data = np.ascontiguousarray(matrix, "<i8")
    return [row.tobytes() for row in data]


# --------------------------------------------------------------------------------------------
# q17: per auction and day


# count, rank 1-3 counts, min, max, sum, version
_Q17_INITIAL = np.array(
    [0, 0, 0, 0, np.iinfo(np.int64).max, np.iinfo(np.int64).min, 0, 0], np.int64
)


@rs.keyed_batches(name="auction_day_stats", state=rs.ValueState(bytes))
def auction_day_stats(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    """Keyed by ``auction|day``: the group's counts (total, per price rank), min, max, average
    (truncated) and sum of the price, a new row with the next ``_version`` per batch."""
    stats = _packed(state.get(batch.keys), _Q17_INITIAL)
    rec = batch.records
    price = rec.column("price").to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    rank = price_rank(price)
    ones = np.zeros((len(price), 4), np.int64)
    ones[:, 0] = 1
    ones[np.arange(len(price)), 1 + rank] = 1
    starts = batch.offsets[:-1]
    stats[:, 0:4] += np.add.reduceat(ones, starts, axis=0)
    stats[:, 4] = np.minimum(stats[:, 4], np.minimum.reduceat(price, starts))
    stats[:, 5] = np.maximum(stats[:, 5], np.maximum.reduceat(price, starts))
    stats[:, 6] += np.add.reduceat(price, starts)
    stats[:, 7] += 1
    state.put(batch.keys, _rows(stats))
    first = pa.array(starts)
    return batch.output(
        {
            "auction": rec.column("auction").take(first),
            "day": rec.column("day").take(first),
            "total_bids": stats[:, 0],
            "rank1_bids": stats[:, 1],
            "rank2_bids": stats[:, 2],
            "rank3_bids": stats[:, 3],
            "min_price": stats[:, 4],
            "max_price": stats[:, 5],
            "avg_price": stats[:, 6] // stats[:, 0],
            "sum_price": stats[:, 6],
            VERSION: stats[:, 7],
        }
    )


def _q17_groups(batch: pa.RecordBatch) -> pa.RecordBatch:
    day = day_strings(ms(batch.column("dateTime")))
    auction = batch.column("auction")
    key = pc.binary_join_element_wise(auction.cast(pa.string()), day, "|")
    return with_meta(
        batch, {"g": key, "auction": auction, "day": day, "price": batch.column("price")}
    )


def build_q17(inputs: dict[str, rs.Stream]) -> rs.Stream:
    groups = inputs["bid"].apply(rs.map_batches(_q17_groups, name="q17_groups"))
    return groups.key_by("g").apply(auction_day_stats, name="q17")


# --------------------------------------------------------------------------------------------
# q15, q16: counts and distinct counts per day (and channel)

BIDS, BIDDERS, AUCTIONS = 0, 1, 2  # kinds of the counts a group adds up
_DELTAS = ("d0", "d1", "d2", "d3")  # total, rank 1, rank 2, rank 3


def _per_group(
    batch: pa.RecordBatch | rs.KeyedBatch,
    group: pa.Array,
    rows: np.ndarray,
    deltas: np.ndarray,
    kind: np.ndarray,
    minute: np.ndarray,
    columns: dict[str, pa.Array],
) -> pa.RecordBatch | None:
    """One row per (group, kind) of the rows ``rows`` of ``group`` (and of ``columns``, e.g. the
    day and channel): the deltas summed, the latest minute, the rows' oldest ingest_ts and newest
    event_time (of the records ``rows`` point at)."""
    if not len(rows):
        return None
    code = pc.dictionary_encode(group.take(pa.array(rows))).indices.to_numpy(zero_copy_only=False)
    pair = code.astype(np.int64) * 3 + kind
    uniq, first, inverse = np.unique(pair, return_index=True, return_inverse=True)
    inverse = inverse.ravel()
    n = len(uniq)
    summed = np.zeros((n, 4), np.int64)
    np.add.at(summed, inverse, deltas)
    latest = np.full(n, -1, np.int64)
    np.maximum.at(latest, inverse, minute)
    at = pa.array(rows[first])
    out: dict[str, Any] = {"group": group.take(at)}
    out.update({name: col.take(at) for name, col in columns.items()})
    out["kind"] = pa.array(uniq % 3, pa.int64())
    for j, name in enumerate(_DELTAS):
        out[name] = pa.array(summed[:, j], pa.int64())
    out["minute"] = pa.array(latest, pa.int64())
    rec = batch.records if isinstance(batch, rs.KeyedBatch) else batch
    for col, how, init in (("ingest_ts", np.minimum, np.iinfo(np.int64).max),
                           ("event_time", np.maximum, np.iinfo(np.int64).min)):  # fmt: skip
        if col in rec.schema.names:
            v = rec.column(col).to_numpy(zero_copy_only=False).astype(np.int64)[rows]
            red = np.full(n, init, np.int64)
            how.at(red, inverse, v)
            out[col] = pa.array(red, pa.int64())
    return pa.RecordBatch.from_pydict(out)


def _rank_columns(with_channel: bool) -> Callable[[pa.RecordBatch], pa.RecordBatch]:
    """Bids -> group (day, or day|channel), day, channel, rank, bidder, auction, minute."""

    def ranks(batch: pa.RecordBatch) -> pa.RecordBatch:
        t = ms(batch.column("dateTime"))
        day = day_strings(t)
        cols: dict[str, Any] = {"group": day, "day": day}
        if with_channel:
            channel = batch.column("channel")
            cols["group"] = pc.binary_join_element_wise(day, channel, "|")
            cols["channel"] = channel
        price = batch.column("price").to_numpy(zero_copy_only=False).astype(np.int64)
        cols["rank"] = pa.array(price_rank(price))
        cols["bidder"] = batch.column("bidder")
        cols["auction"] = batch.column("auction")
        cols["minute"] = pa.array((t % DAY_MS) // _MINUTE_MS)
        return with_meta(batch, cols)

    return ranks


def _carried(batch: pa.RecordBatch) -> dict[str, pa.Array]:
    return {c: batch.column(c) for c in ("day", "channel") if c in batch.schema.names}


def _bid_counts(batch: pa.RecordBatch) -> pa.RecordBatch | None:
    """Per group of the batch: its bids in total and per rank, and their latest minute."""
    n = batch.num_rows
    rank = batch.column("rank").to_numpy(zero_copy_only=False)
    deltas = np.zeros((n, 4), np.int64)
    deltas[:, 0] = 1
    deltas[np.arange(n), 1 + rank] = 1
    minute = batch.column("minute").to_numpy(zero_copy_only=False).astype(np.int64)
    return _per_group(
        batch, batch.column("group"), np.arange(n), deltas, np.full(n, BIDS), minute,
        _carried(batch),
    )  # fmt: skip


def _distinct_values(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Every bid twice: keyed by ``group|1|bidder`` and by ``group|2|auction``."""
    group = batch.column("group")
    both = pa.concat_arrays([group, group])
    kind = np.repeat(np.array([BIDDERS, AUCTIONS]), batch.num_rows)
    value = pa.concat_arrays([batch.column("bidder"), batch.column("auction")]).cast(pa.string())
    key = pc.binary_join_element_wise(both, pa.array(kind).cast(pa.string()), value, "|")
    idx = pa.array(np.tile(np.arange(batch.num_rows), 2))
    cols: dict[str, Any] = {"v": key, "group": both, "kind": pa.array(kind, pa.int64())}
    cols.update({c: a.take(idx) for c, a in _carried(batch).items()})
    cols["rank"] = batch.column("rank").take(idx)
    for col in META:
        if col in batch.schema.names:
            cols[col] = batch.column(col).take(idx)
    return pa.RecordBatch.from_pydict(cols)


@rs.keyed_batches(name="first_seen", state=rs.ValueState(int, default=0))
def first_seen(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch | None:
    """Keyed by ``group|kind|value``: the ranks the value was seen with in its group, as bits.
    For a value new to its group +1 in total, and +1 for every rank new to it; summed per
    (group, kind) of the batch."""
    rec = batch.records
    bits = np.left_shift(1, rec.column("rank").to_numpy(zero_copy_only=False).astype(np.int64))
    old = np.asarray(state.get(batch.keys), np.int64)
    new = old | np.bitwise_or.reduceat(bits, batch.offsets[:-1])
    changed = np.flatnonzero(new != old)
    if not len(changed):
        return None
    state.put(batch.keys.take(changed), new[changed])
    fresh = new[changed] & ~old[changed]
    deltas = np.stack(
        [(old[changed] == 0).astype(np.int64), fresh & 1, (fresh >> 1) & 1, (fresh >> 2) & 1],
        axis=1,
    )
    rows = batch.offsets[:-1][changed]  # a record of each changed key: its group and kind
    kind = rec.column("kind").to_numpy(zero_copy_only=False)[rows].astype(np.int64)
    carried = {c: rec.column(c) for c in ("day", "channel") if c in rec.schema.names}
    return _per_group(
        batch, rec.column("group"), rows, deltas, kind, np.full(len(rows), -1), carried
    )


# 3 kinds x (total, rank 1-3), the latest minute, the version
_TOTALS_INITIAL = np.array([0] * 12 + [-1, 0], np.int64)
_KIND_NAMES = ("bids", "bidders", "auctions")


@rs.keyed_batches(name="daily_totals", state=rs.ValueState(bytes))
def daily_totals(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    """Keyed by the group: bid counts and distinct bidders and auctions, each in total and per
    rank, added up from the counts and the first-seen steps; a new row with the next
    ``_version`` per batch."""
    totals = _packed(state.get(batch.keys), _TOTALS_INITIAL)
    rec = batch.records
    n = rec.num_rows
    kind = rec.column("kind").to_numpy(zero_copy_only=False).astype(np.int64)
    spread = np.zeros((n, 12), np.int64)
    for j, name in enumerate(_DELTAS):
        spread[np.arange(n), kind * 4 + j] = rec.column(name).to_numpy(zero_copy_only=False)
    starts = batch.offsets[:-1]
    totals[:, :12] += np.add.reduceat(spread, starts, axis=0)
    minute = rec.column("minute").to_numpy(zero_copy_only=False).astype(np.int64)
    totals[:, 12] = np.maximum(totals[:, 12], np.maximum.reduceat(minute, starts))
    totals[:, 13] += 1
    state.put(batch.keys, _rows(totals))
    first = pa.array(starts)
    out: dict[str, Any] = {"day": rec.column("day").take(first)}
    if "channel" in rec.schema.names:
        out["channel"] = rec.column("channel").take(first)
        out["minute"] = _minute_strings(totals[:, 12])
    for k, kind_name in enumerate(_KIND_NAMES):
        for j, rank_name in enumerate(("total", "rank1", "rank2", "rank3")):
            out[f"{rank_name}_{kind_name}"] = totals[:, 4 * k + j]
    out[VERSION] = totals[:, 13]
    return batch.output(out)


def _daily(inputs: dict[str, rs.Stream], query: str, with_channel: bool) -> rs.Stream:
    ranked = inputs["bid"].apply(rs.map_batches(_rank_columns(with_channel), name=f"{query}_ranks"))
    counts = ranked.apply(rs.map_batches(_bid_counts, name=f"{query}_bids"))
    values = ranked.apply(rs.map_batches(_distinct_values, name=f"{query}_values"))
    firsts = values.key_by("v").apply(first_seen, name=query)
    return counts.union(firsts).key_by("group").apply(daily_totals, name=f"{query}_totals")


def build_q15(inputs: dict[str, rs.Stream]) -> rs.Stream:
    return _daily(inputs, "q15", with_channel=False)


def build_q16(inputs: dict[str, rs.Stream]) -> rs.Stream:
    return _daily(inputs, "q16", with_channel=True)
