"""q14, q21, q22: stateless NEXMark queries over bids, vectorised with Arrow compute and numpy.

* q14: bids whose euro price ``0.908 * price`` lies strictly between 1,000,000 and 50,000,000,
  with a ``bidTimeType`` by the hour of ``dateTime`` (8-18 ``dayTime``, 0-6 and 20-23
  ``nightTime``, else ``otherTime``) and ``c_counts``, the number of ``c`` bytes in ``extra``
  (the query's UDF ``count_char``: 0 for a null ``extra``). The price is exact: ``price * 908``
  thousandths (int64, overflow checked), also as DECIMAL(23, 3).
* q21: the channel id of a bid: ``'0'``..``'3'`` for the channels apple, google, facebook, baidu
  (case-insensitive), else ``REGEXP_EXTRACT(url, '(&|^)channel_id=([^&]*)', 2)``; bids with
  neither are dropped.
* q10: every bid (q0's columns) with ``dt`` = ``DATE_FORMAT(dateTime, 'yyyy-MM-dd')`` and
  ``hm`` = ``DATE_FORMAT(dateTime, 'HH:mm')``, the partition columns of its file sink; each
  distinct minute of a batch is formatted once and spread to its rows with ``take``.
* q22: ``SPLIT_INDEX(url, '/', i)`` for i = 3, 4, 5: the i-th (from 0) of the pieces of the URL
  between ``/`` (empty pieces kept), null where the URL has fewer pieces.

Times are UTC (``dateTime`` is a timestamp without a zone).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bench.nexmark.columns import ms, with_meta

__all__ = [
    "HOT_CHANNEL_IDS",
    "bid_time_type",
    "decimal_milli",
    "q10_partition_columns",
    "q14_price_range",
    "q21_channel_id",
    "q22_url_dirs",
    "split_index",
]

_PRICE_TYPE = pa.decimal128(23, 3)
_HOUR_MS = 3_600_000
_MINUTE_MS = 60_000
_Q10_COLUMNS = ("auction", "bidder", "price", "dateTime", "extra")


def q10_partition_columns(batch: pa.RecordBatch) -> pa.RecordBatch:
    """q10: the bid's columns plus ``dt`` (``yyyy-MM-dd``) and ``hm`` (``HH:mm``) of its
    ``dateTime`` (UTC; null for a null ``dateTime``)."""
    times = batch.column("dateTime")
    out = {c: batch.column(c) for c in _Q10_COLUMNS}
    if times.null_count == 0 and len(times):
        minutes, rows = np.unique(ms(times) // _MINUTE_MS, return_inverse=True)
        starts = pa.array(minutes * _MINUTE_MS, pa.int64()).cast(pa.timestamp("ms"))
        take = pa.array(rows.astype(np.int32, copy=False))
        out["dt"] = pc.strftime(starts, "%Y-%m-%d").take(take)
        out["hm"] = pc.strftime(starts, "%H:%M").take(take)
    else:  # nulls (or no rows): format every row
        out["dt"] = pc.strftime(times, "%Y-%m-%d")
        out["hm"] = pc.strftime(times, "%H:%M")
    return with_meta(batch, out)


def decimal_milli(milli: pa.Array) -> pa.Array:
    """int64 thousandths as DECIMAL(23, 3), exactly: a decimal128's unscaled value is a 128-bit
    two's complement integer, here the int64 (low word) and its sign (high word), built with
    numpy (pyarrow's decimal multiply and cast cost ~20x more)."""
    if milli.null_count:
        return milli.cast(_PRICE_TYPE)
    low = milli.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    words = np.empty(2 * len(low), np.int64)
    words[0::2] = low
    words[1::2] = low >> 63
    return pa.Array.from_buffers(_PRICE_TYPE, len(low), [None, pa.py_buffer(words)])


def bid_time_type(t_ms: np.ndarray) -> pa.Array:
    """``dayTime`` for hours 8-18, ``nightTime`` for hours <= 6 or >= 20, else ``otherTime``."""
    hour = (t_ms // _HOUR_MS) % 24
    kind = np.where((hour >= 8) & (hour <= 18), 0, np.where((hour <= 6) | (hour >= 20), 1, 2))
    names = pa.array(["dayTime", "nightTime", "otherTime"], pa.string())
    return names.take(pa.array(kind))


def q14_price_range(batch: pa.RecordBatch) -> pa.RecordBatch | None:
    """q14: bids with 1,000,000 < 0.908 * price < 50,000,000 euro (price * 908 thousandths
    between 10^9 and 5 * 10^10, both exclusive), their time of day and count of ``c``."""
    milli = pc.multiply_checked(batch.column("price"), 908)
    m = milli.to_numpy(zero_copy_only=False)
    keep = (m > 1_000_000_000) & (m < 50_000_000_000)
    if not keep.any():
        return None
    mask = pa.array(keep)
    kept = batch.filter(mask)
    milli = milli.filter(mask)
    extra = kept.column("extra")
    counts = pc.count_substring(extra, "c").cast(pa.int64()).fill_null(0)
    return with_meta(
        kept,
        {
            "auction": kept.column("auction"),
            "bidder": kept.column("bidder"),
            "price": decimal_milli(milli),
            "price_milli": milli,
            "bidTimeType": bid_time_type(ms(kept.column("dateTime"))),
            "dateTime": kept.column("dateTime"),
            "extra": extra,
            "c_counts": counts,
        },
    )


HOT_CHANNEL_IDS = ("apple", "google", "facebook", "baidu")  # ids "0".."3", in this order
_HOT = pa.array(HOT_CHANNEL_IDS, pa.string())
_CHANNEL_ID = r"(?:&|^)channel_id=(?P<id>[^&]*)"  # group 2 of the query's pattern


def q21_channel_id(batch: pa.RecordBatch) -> pa.RecordBatch | None:
    """q21: the bids with a known channel id: a hot channel's fixed id, else the URL's
    ``channel_id`` parameter (the first one; it may be empty)."""
    hot = pc.index_in(pc.utf8_lower(batch.column("channel")), value_set=_HOT)
    found = pc.struct_field(pc.extract_regex(batch.column("url"), _CHANNEL_ID), "id")
    channel_id = pc.if_else(pc.is_valid(hot), hot.cast(pa.string()), found)
    keep = pc.is_valid(channel_id)
    if not pc.any(keep).as_py():
        return None
    kept = batch.filter(keep)
    return with_meta(
        kept,
        {
            "auction": kept.column("auction"),
            "bidder": kept.column("bidder"),
            "price": kept.column("price"),
            "channel": kept.column("channel"),
            "channel_id": channel_id.filter(keep),
        },
    )


def split_index(strings: pa.Array, separator: str, index: int) -> pa.Array:
    """Flink's ``SPLIT_INDEX(s, separator, index)``: piece ``index`` (from 0) of ``s`` split at
    every ``separator`` (empty pieces kept), null if ``s`` is null or has fewer pieces."""
    pieces = pc.split_pattern(strings, separator)
    offsets = pieces.offsets.to_numpy(zero_copy_only=False)
    starts, ends = offsets[:-1], offsets[1:]
    at = starts + index
    valid = (at < ends) & pieces.is_valid().to_numpy(zero_copy_only=False)
    values = pieces.values
    if not len(values):
        return pa.nulls(len(strings), pa.string())
    taken = values.take(pa.array(np.where(valid, at, 0)))
    return pc.if_else(pa.array(valid), taken, pa.scalar(None, pa.string()))


def q22_url_dirs(batch: pa.RecordBatch) -> pa.RecordBatch:
    """q22: the first three directories of each bid's URL (pieces 3, 4, 5 between ``/``)."""
    url = batch.column("url")
    return with_meta(
        batch,
        {
            "auction": batch.column("auction"),
            "bidder": batch.column("bidder"),
            "price": batch.column("price"),
            "channel": batch.column("channel"),
            "dir1": split_index(url, "/", 3),
            "dir2": split_index(url, "/", 4),
            "dir3": split_index(url, "/", 5),
        },
    )
