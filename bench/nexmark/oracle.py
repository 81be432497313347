"""DuckDB SQL for the NEXMark queries: the final result over a completely consumed input.

Each query follows the Flink SQL text of the nexmark/nexmark repository
(``nexmark-flink/src/main/resources/queries/qN.sql``), written for a bounded input:

* windows are epoch-aligned and half-open, ``[start, end)``, times in ms since the epoch;
  window bounds are returned as int64 ms, ``dateTime`` columns keep ``timestamp[ms]``;
* q4's ``AVG`` over BIGINT is integer division (truncated), as in Flink;
* q7 keeps ``B.dateTime BETWEEN window_end - 10 s AND window_end`` inclusive at both ends, as
  written (so a bid exactly at ``window_end`` with the previous window's top price matches);
* q9 keeps, per auction, the bid of the highest price, ties broken by the earliest
  ``dateTime`` (as written), and then by the smallest ``bidder`` so the answer is unique;
* q10's ``DATE_FORMAT(dateTime, 'yyyy-MM-dd')`` / ``'HH:mm'`` format the timestamp as it is
  (UTC, no zone), as ``strftime`` does;
* q11 sessions per bidder: a bid within 10 s (inclusive) of the session's previous bid joins
  it (Flink merges session windows ``[t, t + gap)`` that touch); ``endtime`` is the last bid's
  time + 10 s;
* q12 (processing-time windows) has no SQL here: no oracle knows when a bid was processed.
  :func:`bench.nexmark.processing_time.check` holds its result to what does not depend on it
  (per bidder the windows add up to its bids, aligned windows, none twice, none fired early).

Updating queries (q3, q4, q9, ...) give one row per key with its final value; every result is
sorted by :data:`SORT_KEYS` so two results compare with ``equals``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from bench.nexmark import side_input
from bench.nexmark.generator import SCHEMAS, NexmarkTables

__all__ = [
    "QUERIES",
    "SORT_KEYS",
    "SQL",
    "canonical",
    "load_tables",
    "read_partitioned",
    "run",
    "run_all",
]

TABLES = ("person", "auction", "bid")
SIDE_INPUT = "side_input"  # q13's bounded side input: side_input.csv

# dateTime is timestamp[ms]; epoch_ms() of it goes through TIMESTAMP (us) explicitly: DuckDB
# 2.0.1 fails on epoch_ms(TIMESTAMP_MS) ("Unimplemented type for cast (INT64 -> INT64)")
SQL: dict[str, str] = {
    "q0": """
        SELECT auction, bidder, price, dateTime, extra FROM bid
    """,
    "q1": """
        SELECT auction, bidder,
               CAST(CAST(price AS DECIMAL(20, 0)) * 0.908 AS DECIMAL(23, 3)) AS price,
               price * 908 AS price_milli,
               dateTime, extra
        FROM bid
    """,
    "q2": """
        SELECT auction, price FROM bid WHERE auction % 123 = 0
    """,
    "q3": """
        SELECT P.name, P.city, P.state, A.id
        FROM auction AS A JOIN person AS P ON A.seller = P.id
        WHERE A.category = 10 AND (P.state = 'OR' OR P.state = 'ID' OR P.state = 'CA')
    """,
    "q4": """
        WITH Q AS (
            SELECT MAX(B.price) AS final, A.category
            FROM auction A, bid B
            WHERE A.id = B.auction AND B.dateTime BETWEEN A.dateTime AND A.expires
            GROUP BY A.id, A.category
        )
        SELECT category AS id, CAST(SUM(final) // COUNT(*) AS BIGINT) AS final
        FROM Q GROUP BY category
    """,
    "q5": """
        WITH B AS (SELECT auction, epoch_ms(CAST(dateTime AS TIMESTAMP)) AS t FROM bid),
        W AS (  -- HOP(size 10 s, slide 2 s): the five windows [s, s + 10 s) holding t
            SELECT auction, (t // 2000 - k) * 2000 AS window_start
            FROM B, range(0, 5) AS r(k)
        ),
        C AS (
            SELECT auction, COUNT(*) AS num, window_start, window_start + 10000 AS window_end
            FROM W GROUP BY auction, window_start
        ),
        M AS (SELECT window_start, MAX(num) AS maxn FROM C GROUP BY window_start)
        SELECT C.auction, C.num, C.window_start, C.window_end
        FROM C JOIN M ON C.window_start = M.window_start AND C.num >= M.maxn
    """,
    "q7": """
        WITH B1 AS (
            SELECT MAX(price) AS maxprice,
                   (epoch_ms(CAST(dateTime AS TIMESTAMP)) // 10000) * 10000 + 10000 AS window_end
            FROM bid GROUP BY window_end
        )
        SELECT B.auction, B.price, B.bidder, B.dateTime, B.extra, B1.window_end
        FROM bid B JOIN B1 ON B.price = B1.maxprice
        WHERE epoch_ms(CAST(B.dateTime AS TIMESTAMP))
              BETWEEN B1.window_end - 10000 AND B1.window_end
    """,
    "q8": """
        WITH P AS (
            SELECT id, name,
                   (epoch_ms(CAST(dateTime AS TIMESTAMP)) // 10000) * 10000 AS starttime
            FROM person GROUP BY id, name, starttime
        ),
        A AS (
            SELECT seller, (epoch_ms(CAST(dateTime AS TIMESTAMP)) // 10000) * 10000 AS starttime
            FROM auction GROUP BY seller, starttime
        )
        SELECT P.id, P.name, P.starttime AS stime
        FROM P JOIN A ON P.id = A.seller AND P.starttime = A.starttime
    """,
    "q9": """
        WITH J AS (
            SELECT A.id, A.seller, A.category, B.bidder, B.price, B.dateTime AS bid_dateTime,
                   ROW_NUMBER() OVER (PARTITION BY A.id
                                      ORDER BY B.price DESC, B.dateTime ASC, B.bidder ASC)
                   AS rownum
            FROM auction A, bid B
            WHERE A.id = B.auction AND B.dateTime BETWEEN A.dateTime AND A.expires
        )
        SELECT id, seller, category, bidder, price, bid_dateTime FROM J WHERE rownum <= 1
    """,
    "q11": """
        WITH B0 AS (SELECT bidder, epoch_ms(CAST(dateTime AS TIMESTAMP)) AS t FROM bid),
        B AS (
            SELECT bidder, t, t - LAG(t) OVER (PARTITION BY bidder ORDER BY t) AS gap FROM B0
        ),
        S AS (
            SELECT bidder, t,
                   SUM(CASE WHEN gap IS NULL OR gap > 10000 THEN 1 ELSE 0 END)
                       OVER (PARTITION BY bidder ORDER BY t
                             ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS session
            FROM B
        )
        SELECT bidder, COUNT(*) AS bid_count, MIN(t) AS starttime, MAX(t) + 10000 AS endtime
        FROM S GROUP BY bidder, session
    """,
    "q15": """
        SELECT strftime(dateTime, '%Y-%m-%d') AS day,
               count(*) AS total_bids,
               count(*) FILTER (WHERE price < 10000) AS rank1_bids,
               count(*) FILTER (WHERE price >= 10000 AND price < 1000000) AS rank2_bids,
               count(*) FILTER (WHERE price >= 1000000) AS rank3_bids,
               count(DISTINCT bidder) AS total_bidders,
               count(DISTINCT bidder) FILTER (WHERE price < 10000) AS rank1_bidders,
               count(DISTINCT bidder) FILTER (WHERE price >= 10000 AND price < 1000000)
                   AS rank2_bidders,
               count(DISTINCT bidder) FILTER (WHERE price >= 1000000) AS rank3_bidders,
               count(DISTINCT auction) AS total_auctions,
               count(DISTINCT auction) FILTER (WHERE price < 10000) AS rank1_auctions,
               count(DISTINCT auction) FILTER (WHERE price >= 10000 AND price < 1000000)
                   AS rank2_auctions,
               count(DISTINCT auction) FILTER (WHERE price >= 1000000) AS rank3_auctions
        FROM bid GROUP BY strftime(dateTime, '%Y-%m-%d')
    """,
    "q16": """
        SELECT channel, strftime(dateTime, '%Y-%m-%d') AS day,
               max(strftime(dateTime, '%H:%M')) AS minute,
               count(*) AS total_bids,
               count(*) FILTER (WHERE price < 10000) AS rank1_bids,
               count(*) FILTER (WHERE price >= 10000 AND price < 1000000) AS rank2_bids,
               count(*) FILTER (WHERE price >= 1000000) AS rank3_bids,
               count(DISTINCT bidder) AS total_bidders,
               count(DISTINCT bidder) FILTER (WHERE price < 10000) AS rank1_bidders,
               count(DISTINCT bidder) FILTER (WHERE price >= 10000 AND price < 1000000)
                   AS rank2_bidders,
               count(DISTINCT bidder) FILTER (WHERE price >= 1000000) AS rank3_bidders,
               count(DISTINCT auction) AS total_auctions,
               count(DISTINCT auction) FILTER (WHERE price < 10000) AS rank1_auctions,
               count(DISTINCT auction) FILTER (WHERE price >= 10000 AND price < 1000000)
                   AS rank2_auctions,
               count(DISTINCT auction) FILTER (WHERE price >= 1000000) AS rank3_auctions
        FROM bid GROUP BY channel, strftime(dateTime, '%Y-%m-%d')
    """,
    "q17": """
        SELECT auction, strftime(dateTime, '%Y-%m-%d') AS day,
               count(*) AS total_bids,
               count(*) FILTER (WHERE price < 10000) AS rank1_bids,
               count(*) FILTER (WHERE price >= 10000 AND price < 1000000) AS rank2_bids,
               count(*) FILTER (WHERE price >= 1000000) AS rank3_bids,
               min(price) AS min_price, max(price) AS max_price,
               sum(price) // count(*) AS avg_price, sum(price) AS sum_price
        FROM bid GROUP BY auction, strftime(dateTime, '%Y-%m-%d')
    """,
    "q18": """
        SELECT auction, bidder, price, channel, url, dateTime, extra
        FROM (
            SELECT *, ROW_NUMBER() OVER (
                PARTITION BY bidder, auction
                ORDER BY dateTime DESC, price DESC, channel DESC NULLS LAST,
                         url DESC NULLS LAST, extra DESC NULLS LAST) AS rank_number
            FROM bid)
        WHERE rank_number <= 1
    """,
    "q19": """
        SELECT auction, bidder, price, channel, url, dateTime, extra, rank_number
        FROM (
            SELECT *, ROW_NUMBER() OVER (
                PARTITION BY auction
                ORDER BY price DESC, dateTime ASC, bidder ASC, channel ASC NULLS LAST,
                         url ASC NULLS LAST, extra ASC NULLS LAST) AS rank_number
            FROM bid)
        WHERE rank_number <= 10
    """,
    "q20": """
        SELECT auction, bidder, price, channel, url, B.dateTime AS bid_dateTime,
               B.extra AS bid_extra, itemName, description, initialBid, reserve,
               A.dateTime AS auction_dateTime, expires, seller, category,
               A.extra AS auction_extra
        FROM bid AS B INNER JOIN auction AS A ON B.auction = A.id
        WHERE A.category = 10
    """,
    "q6": """
        WITH W AS (
            SELECT A.id, A.seller, B.price, B.dateTime,
                   ROW_NUMBER() OVER (PARTITION BY A.id, A.seller
                                      ORDER BY B.price DESC, B.dateTime ASC, B.bidder ASC)
                   AS rownum
            FROM auction A, bid B
            WHERE A.id = B.auction AND B.dateTime BETWEEN A.dateTime AND A.expires
        )
        SELECT seller, id,
               CAST(SUM(price) OVER w // COUNT(*) OVER w AS BIGINT) AS avg_price
        FROM W WHERE rownum = 1
        WINDOW w AS (PARTITION BY seller ORDER BY dateTime, id
                     ROWS BETWEEN 10 PRECEDING AND CURRENT ROW)
    """,
    "q13": """
        SELECT B.auction, B.bidder, B.price, B.dateTime, S.value
        FROM bid AS B JOIN side_input AS S ON B.auction % 10000 = S.key
    """,
    "q14": """
        SELECT auction, bidder,
               CAST(CAST(price AS DECIMAL(20, 0)) * 0.908 AS DECIMAL(23, 3)) AS price,
               price * 908 AS price_milli,
               CASE
                   WHEN hour(dateTime) >= 8 AND hour(dateTime) <= 18 THEN 'dayTime'
                   WHEN hour(dateTime) <= 6 OR hour(dateTime) >= 20 THEN 'nightTime'
                   ELSE 'otherTime'
               END AS bidTimeType,
               dateTime, extra,
               coalesce(length(extra) - length(replace(extra, 'c', '')), 0) AS c_counts
        FROM bid
        WHERE 0.908 * price > 1000000 AND 0.908 * price < 50000000
    """,
    "q21": """
        WITH B AS (
            SELECT auction, bidder, price, channel,
                   CASE WHEN regexp_matches(url, '(&|^)channel_id=([^&]*)')
                        THEN regexp_extract(url, '(&|^)channel_id=([^&]*)', 2) END AS found
            FROM bid
        )
        SELECT auction, bidder, price, channel,
               CASE
                   WHEN lower(channel) = 'apple' THEN '0'
                   WHEN lower(channel) = 'google' THEN '1'
                   WHEN lower(channel) = 'facebook' THEN '2'
                   WHEN lower(channel) = 'baidu' THEN '3'
                   ELSE found
               END AS channel_id
        FROM B
        WHERE found IS NOT NULL OR lower(channel) IN ('apple', 'google', 'facebook', 'baidu')
    """,
    "q10": """
        SELECT auction, bidder, price, dateTime, extra,
               strftime(dateTime, '%Y-%m-%d') AS dt, strftime(dateTime, '%H:%M') AS hm
        FROM bid
    """,
    "q22": """
        SELECT auction, bidder, price, channel,
               string_split(url, '/')[4] AS dir1,
               string_split(url, '/')[5] AS dir2,
               string_split(url, '/')[6] AS dir3
        FROM bid
    """,
}

QUERIES = tuple(SQL)

SORT_KEYS: dict[str, tuple[str, ...]] = {
    "q0": ("auction", "bidder", "price", "dateTime", "extra"),
    "q1": ("auction", "bidder", "price_milli", "dateTime", "extra"),
    "q2": ("auction", "price"),
    "q3": ("id", "name", "city", "state"),
    "q4": ("id",),
    "q5": ("window_start", "auction"),
    "q7": ("window_end", "auction", "price", "bidder", "dateTime", "extra"),
    "q8": ("stime", "id"),
    "q9": ("id",),
    "q11": ("bidder", "starttime"),
    "q12": ("bidder", "starttime"),
    "q15": ("day",),
    "q16": ("channel", "day"),
    "q17": ("auction", "day"),
    "q18": ("bidder", "auction"),
    "q19": ("auction", "rank_number"),
    "q20": ("auction", "bid_dateTime", "bidder", "price", "channel", "url", "bid_extra"),
    "q6": ("id",),
    "q13": ("auction", "bidder", "price", "dateTime", "value"),
    "q14": ("auction", "bidder", "price_milli", "dateTime", "extra"),
    "q21": ("auction", "bidder", "price", "channel", "channel_id"),
    "q22": ("auction", "bidder", "price", "channel", "dir1", "dir2", "dir3"),
    "q10": ("auction", "bidder", "price", "dateTime", "extra"),
}


def _counts(*of: str) -> list[tuple[str, pa.DataType]]:
    """q15-q17's count columns: per counted thing, its total and its three price ranks."""
    return [
        (f"{c}_{what}", pa.int64()) for what in of for c in ("total", "rank1", "rank2", "rank3")
    ]


# the bid's first columns, and a whole bid row as q18-q20 carry it
_BID_KEY = [("auction", pa.int64()), ("bidder", pa.int64()), ("price", pa.int64())]
_BID_ROW = [
    *_BID_KEY,
    ("channel", pa.string()),
    ("url", pa.string()),
    ("dateTime", pa.timestamp("ms")),
    ("extra", pa.string()),
]

SCHEMA: dict[str, pa.Schema] = {
    "q10": pa.schema(
        [
            *_BID_KEY,
            ("dateTime", pa.timestamp("ms")),
            ("extra", pa.string()),
            ("dt", pa.string()),
            ("hm", pa.string()),
        ]
    ),
    "q0": pa.schema(
        [
            *_BID_KEY,
            ("dateTime", pa.timestamp("ms")),
            ("extra", pa.string()),
        ]
    ),
    "q1": pa.schema(
        [
            ("auction", pa.int64()),
            ("bidder", pa.int64()),
            ("price", pa.decimal128(23, 3)),
            ("price_milli", pa.int64()),
            ("dateTime", pa.timestamp("ms")),
            ("extra", pa.string()),
        ]
    ),
    "q2": pa.schema([("auction", pa.int64()), ("price", pa.int64())]),
    "q3": pa.schema(
        [("name", pa.string()), ("city", pa.string()), ("state", pa.string()), ("id", pa.int64())]
    ),
    "q4": pa.schema([("id", pa.int64()), ("final", pa.int64())]),
    "q5": pa.schema(
        [
            ("auction", pa.int64()),
            ("num", pa.int64()),
            ("window_start", pa.int64()),
            ("window_end", pa.int64()),
        ]
    ),
    "q7": pa.schema(
        [
            ("auction", pa.int64()),
            ("price", pa.int64()),
            ("bidder", pa.int64()),
            ("dateTime", pa.timestamp("ms")),
            ("extra", pa.string()),
            ("window_end", pa.int64()),
        ]
    ),
    "q8": pa.schema([("id", pa.int64()), ("name", pa.string()), ("stime", pa.int64())]),
    "q9": pa.schema(
        [
            ("id", pa.int64()),
            ("seller", pa.int64()),
            ("category", pa.int64()),
            ("bidder", pa.int64()),
            ("price", pa.int64()),
            ("bid_dateTime", pa.timestamp("ms")),
        ]
    ),
    "q11": pa.schema(
        [
            ("bidder", pa.int64()),
            ("bid_count", pa.int64()),
            ("starttime", pa.int64()),
            ("endtime", pa.int64()),
        ]
    ),
    # q12 has no SQL here (its windows follow the processing clock): the schema of its result
    # rows, which bench.nexmark.processing_time.check holds to the bids
    "q12": pa.schema(
        [
            ("bidder", pa.int64()),
            ("bid_count", pa.int64()),
            ("starttime", pa.int64()),
            ("endtime", pa.int64()),
            ("fired_at", pa.int64()),
        ]
    ),
    "q15": pa.schema([("day", pa.string()), *_counts("bids", "bidders", "auctions")]),
    "q16": pa.schema(
        [
            ("channel", pa.string()),
            ("day", pa.string()),
            ("minute", pa.string()),
            *_counts("bids", "bidders", "auctions"),
        ]
    ),
    "q17": pa.schema(
        [
            ("auction", pa.int64()),
            ("day", pa.string()),
            *_counts("bids"),
            ("min_price", pa.int64()),
            ("max_price", pa.int64()),
            ("avg_price", pa.int64()),
            ("sum_price", pa.int64()),
        ]
    ),
    "q18": pa.schema(
        [
            *_BID_ROW,
        ]
    ),
    "q19": pa.schema(
        [
            *_BID_ROW,
            ("rank_number", pa.int64()),
        ]
    ),
    "q20": pa.schema(
        [
            *_BID_KEY,
            ("channel", pa.string()),
            ("url", pa.string()),
            ("bid_dateTime", pa.timestamp("ms")),
            ("bid_extra", pa.string()),
            ("itemName", pa.string()),
            ("description", pa.string()),
            ("initialBid", pa.int64()),
            ("reserve", pa.int64()),
            ("auction_dateTime", pa.timestamp("ms")),
            ("expires", pa.timestamp("ms")),
            ("seller", pa.int64()),
            ("category", pa.int64()),
            ("auction_extra", pa.string()),
        ]
    ),
    "q6": pa.schema([("seller", pa.int64()), ("id", pa.int64()), ("avg_price", pa.int64())]),
    "q13": pa.schema(
        [
            *_BID_KEY,
            ("dateTime", pa.timestamp("ms")),
            ("value", pa.string()),
        ]
    ),
    "q14": pa.schema(
        [
            ("auction", pa.int64()),
            ("bidder", pa.int64()),
            ("price", pa.decimal128(23, 3)),
            ("price_milli", pa.int64()),
            ("bidTimeType", pa.string()),
            ("dateTime", pa.timestamp("ms")),
            ("extra", pa.string()),
            ("c_counts", pa.int64()),
        ]
    ),
    "q21": pa.schema(
        [
            *_BID_KEY,
            ("channel", pa.string()),
            ("channel_id", pa.string()),
        ]
    ),
    "q22": pa.schema(
        [
            *_BID_KEY,
            ("channel", pa.string()),
            ("dir1", pa.string()),
            ("dir2", pa.string()),
            ("dir3", pa.string()),
        ]
    ),
}


def load_tables(
    source: NexmarkTables | Mapping[str, pa.Table] | str | os.PathLike[str],
) -> dict[str, pa.Table]:
    """The three tables and q13's side input from generated tables (with the side input
    ``write_parquet`` writes beside them), a mapping, or a directory of the Parquet files and
    ``side_input.csv`` (a missing table is empty)."""
    if isinstance(source, NexmarkTables):
        out = {t: source.table(t) for t in TABLES}
        out[SIDE_INPUT] = side_input.side_input_table()  # what write_parquet writes beside them
        return out
    if isinstance(source, Mapping):
        out = {t: source.get(t, SCHEMAS[t].empty_table()) for t in TABLES}
        out[SIDE_INPUT] = source.get(SIDE_INPUT, side_input.SCHEMA.empty_table())
        return out
    import pyarrow.parquet as pq

    base = Path(source)
    out = {}
    for t in TABLES:
        path = base / f"{t}.parquet"
        out[t] = pq.read_table(path) if path.exists() else SCHEMAS[t].empty_table()
    csv = base / f"{SIDE_INPUT}.csv"
    out[SIDE_INPUT] = (
        side_input.read_side_input(csv) if csv.exists() else side_input.SCHEMA.empty_table()
    )
    return out


def canonical(query: str, table: pa.Table) -> pa.Table:
    """``table`` with the query's columns and types, sorted by its sort keys."""
    schema = SCHEMA[query]
    table = table.select(schema.names).cast(schema)
    if table.num_rows == 0:
        return table
    return table.sort_by([(k, "ascending") for k in SORT_KEYS[query]])


def run(
    query: str, source: NexmarkTables | Mapping[str, pa.Table] | str | os.PathLike[str]
) -> pa.Table:
    """The final result of ``query`` (``"q0"`` ... ``"q11"``) over ``source``, canonical."""
    if query not in SQL:
        msg = f"no oracle for query {query!r}; expected one of {list(SQL)}"
        raise KeyError(msg)
    tables = load_tables(source)
    con = duckdb.connect()
    try:
        for name, table in tables.items():
            con.register(name, table)
        result = con.sql(SQL[query]).to_arrow_table()
    finally:
        con.close()
    if isinstance(result, pa.RecordBatchReader):
        result = result.read_all()
    return canonical(query, result)


def run_all(
    source: NexmarkTables | Mapping[str, pa.Table] | str | os.PathLike[str],
) -> dict[str, pa.Table]:
    tables = load_tables(source)
    return {q: run(q, tables) for q in SQL}


def read_partitioned(
    query: str, path: str | os.PathLike[str], partition_by: tuple[str, ...]
) -> pa.Table:
    """The rows of a Hive-partitioned output folder (q10's ``path/dt=.../hm=.../*.parquet``),
    read with ``pyarrow.dataset`` (the partition columns from the folder names, typed as in
    :data:`SCHEMA`), canonical."""
    import pyarrow.dataset as ds

    schema = SCHEMA[query]
    part = ds.partitioning(pa.schema([schema.field(c) for c in partition_by]), flavor="hive")
    table = ds.dataset(os.fspath(path), format="parquet", partitioning=part).to_table()
    return canonical(query, table)


def check_committed(
    path: str | os.PathLike[str], want: pa.Table, partition_by: tuple[str, ...]
) -> dict[str, Any]:
    """q10's partition commit after the job: the folders holding a ``_SUCCESS`` file are exactly
    the partitions of the oracle's result (``want``'s distinct partition values)."""
    from raystream.partition_commit import folder_values

    root = os.fspath(path)
    committed = set()
    for here, _, files in os.walk(root):
        if "_SUCCESS" in files:
            values = folder_values(os.path.relpath(here, root).replace(os.sep, "/"))
            committed.add(tuple(values.get(c) for c in partition_by))
    expected = set(zip(*(want.column(c).to_pylist() for c in partition_by), strict=True))
    return {
        "ok": committed == expected,
        "partitions": len(expected),
        "committed": len(committed & expected),
        "missing": sorted(expected - committed)[:5],
        "unexpected": sorted(committed - expected)[:5],
    }
