"""The DuckDB oracle of the NEXMark queries (bench/nexmark/oracle.py) on tiny hand-made inputs
whose answers are worked out by hand below, one case per semantic corner."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest

from tests._bench import import_bench

oracle = import_bench("bench.nexmark.oracle")
gen = import_bench("bench.nexmark.generator")

T = 1_600_000_000_000  # a multiple of 10 s: window bounds below are T + offsets


def ts(offset_ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp((T + offset_ms) / 1000, tz=dt.UTC).replace(tzinfo=None)


def bids(rows: list[tuple[int, int, int, int]]) -> pa.Table:
    """(auction, bidder, price, t) rows; channel/url/extra filled in."""
    return pa.Table.from_pylist(
        [
            {
                "auction": a,
                "bidder": b,
                "price": p,
                "channel": "Google",
                "url": "u",
                "dateTime": ts(t),
                "extra": f"x{i}",
            }
            for i, (a, b, p, t) in enumerate(rows)
        ],
        schema=gen.BID_SCHEMA,
    )


def auctions(rows: list[tuple[int, int, int, int, int]]) -> pa.Table:
    """(id, seller, category, start, expires) rows."""
    return pa.Table.from_pylist(
        [
            {
                "id": i,
                "itemName": "n",
                "description": "d",
                "initialBid": 1,
                "reserve": 2,
                "dateTime": ts(s),
                "expires": ts(e),
                "seller": sel,
                "category": c,
                "extra": "",
            }
            for i, sel, c, s, e in rows
        ],
        schema=gen.AUCTION_SCHEMA,
    )


def persons(rows: list[tuple[int, str, str, int]]) -> pa.Table:
    """(id, name, state, t) rows; the city is the name's reverse."""
    return pa.Table.from_pylist(
        [
            {
                "id": i,
                "name": n,
                "emailAddress": "e",
                "creditCard": "c",
                "city": n[::-1],
                "state": s,
                "dateTime": ts(t),
                "extra": "",
            }
            for i, n, s, t in rows
        ],
        schema=gen.PERSON_SCHEMA,
    )


def run(query: str, **tables: pa.Table) -> list[dict[str, Any]]:
    return oracle.run(query, tables).to_pylist()


def test_q0_passes_bids_through() -> None:
    rows = run("q0", bid=bids([(2, 7, 10, 5), (1, 8, 20, 3)]))
    assert rows == [
        {"auction": 1, "bidder": 8, "price": 20, "dateTime": ts(3), "extra": "x1"},
        {"auction": 2, "bidder": 7, "price": 10, "dateTime": ts(5), "extra": "x0"},
    ]


def test_q1_converts_to_euro_exactly() -> None:
    rows = run("q1", bid=bids([(1, 1, 1000, 0), (2, 1, 7, 0), (3, 1, 123_456_789, 0)]))
    assert [(r["price"], r["price_milli"]) for r in rows] == [
        (Decimal("908.000"), 908_000),
        (Decimal("6.356"), 6_356),
        (Decimal("112098764.412"), 112_098_764_412),
    ]
    assert oracle.run("q1", {"bid": bids([(1, 1, 1, 0)])}).schema.field(
        "price"
    ).type == pa.decimal128(23, 3)


def test_q2_keeps_auctions_divisible_by_123() -> None:
    rows = run("q2", bid=bids([(123, 1, 5, 0), (124, 1, 6, 0), (246, 1, 7, 0), (0, 1, 8, 0)]))
    assert rows == [
        {"auction": 0, "price": 8},
        {"auction": 123, "price": 5},
        {"auction": 246, "price": 7},
    ]


def test_q3_joins_category_10_auctions_with_sellers_in_or_id_ca() -> None:
    p = persons(
        [(1, "Ann", "OR", 0), (2, "Bob", "WA", 0), (3, "Cid", "CA", 0), (4, "Dee", "ID", 0)]
    )
    a = auctions(
        [
            (10, 1, 10, 0, 5),  # OR, category 10: yes
            (11, 2, 10, 0, 5),  # WA: no
            (12, 3, 11, 0, 5),  # category 11: no
            (13, 3, 10, 0, 5),  # CA: yes
            (14, 9, 10, 0, 5),  # no such person: no
            (15, 4, 10, 0, 5),  # ID: yes
        ]
    )
    assert run("q3", person=p, auction=a) == [
        {"name": "Ann", "city": "nnA", "state": "OR", "id": 10},
        {"name": "Cid", "city": "diC", "state": "CA", "id": 13},
        {"name": "Dee", "city": "eeD", "state": "ID", "id": 15},
    ]


def test_q4_average_of_winning_bids_per_category_truncated() -> None:
    a = auctions([(1, 1, 10, 0, 100), (2, 1, 10, 50, 60), (3, 1, 11, 0, 100), (4, 1, 11, 0, 10)])
    b = bids(
        [
            (1, 1, 5, 0),  # at the start: counts
            (1, 1, 7, 100),  # at expires: counts -> max 7
            (1, 1, 100, 101),  # after expires: not counted
            (2, 1, 4, 55),  # -> max 4; category 10: (7 + 4) // 2 = 5
            (2, 1, 90, 49),  # before the start: not counted
            (4, 1, 3, 10),  # auction 4 -> 3; auction 3 has no bid: category 11 = 3
        ]
    )
    assert run("q4", auction=a, bid=b) == [{"id": 10, "final": 5}, {"id": 11, "final": 3}]


def test_q5_hot_items_per_hopping_window_with_ties() -> None:
    b = bids([(1, 1, 1, 0), (1, 1, 1, 1000), (2, 1, 1, 3000), (3, 1, 1, 9000)])
    # windows [s, s + 10 s), s a multiple of 2 s; a1 twice at 0 and 1 s wins every window
    # from -8 s to 0 s; window 2 s..12 s holds a2 and a3 once each: both; a3 alone after.
    want = [(1, 2, s) for s in (-8000, -6000, -4000, -2000, 0)]
    want += [(2, 1, 2000), (3, 1, 2000), (3, 1, 4000), (3, 1, 6000), (3, 1, 8000)]
    assert run("q5", bid=b) == [
        {"auction": a, "num": n, "window_start": T + s, "window_end": T + s + 10_000}
        for a, n, s in sorted(want, key=lambda r: (r[2], r[0]))
    ]


def test_q7_highest_bids_with_the_inclusive_window_end() -> None:
    b = bids(
        [
            (1, 11, 5, 1000),
            (2, 12, 9, 2000),  # top of [0, 10 s)
            (3, 13, 9, 9999),  # tie: also top
            (4, 14, 9, 10000),  # top of [10 s, 20 s), and at the end of [0, 10 s) with its price
            (5, 15, 2, 15000),
        ]
    )
    rows = run("q7", bid=b)
    assert [(r["auction"], r["price"], r["bidder"], r["window_end"] - T) for r in rows] == [
        (2, 9, 12, 10_000),
        (3, 9, 13, 10_000),
        (4, 9, 14, 10_000),
        (4, 9, 14, 20_000),
    ]
    assert rows[0]["dateTime"] == ts(2000) and rows[0]["extra"] == "x1"


def test_q8_new_persons_who_sold_in_the_same_tumbling_window() -> None:
    p = persons([(1, "Ann", "OR", 1000), (2, "Bob", "OR", 5000), (3, "Cid", "OR", 12000)])
    a = auctions(
        [
            (10, 1, 10, 9999, 99999),  # same window as Ann
            (11, 2, 10, 10000, 99999),  # the next window after Bob's: no
            (12, 3, 10, 15000, 99999),  # Cid
            (13, 3, 10, 16000, 99999),  # Cid again: one row
        ]
    )
    assert run("q8", person=p, auction=a) == [
        {"id": 1, "name": "Ann", "stime": T},
        {"id": 3, "name": "Cid", "stime": T + 10_000},
    ]


def test_q9_winning_bid_per_auction() -> None:
    a = auctions([(1, 7, 10, 0, 100), (2, 8, 11, 0, 100), (3, 9, 12, 0, 100), (4, 6, 13, 0, 100)])
    b = bids(
        [
            (1, 1, 5, 10),
            (1, 2, 7, 20),
            (1, 3, 7, 15),  # same price, earlier: wins auction 1
            (1, 4, 50, 101),  # after expires
            (2, 5, 1, 100),  # at expires: counts
            (4, 9, 3, 5),
            (4, 4, 3, 5),  # same price and time: the smaller bidder
        ]
    )
    assert run("q9", auction=a, bid=b) == [
        {"id": 1, "seller": 7, "category": 10, "bidder": 3, "price": 7, "bid_dateTime": ts(15)},
        {"id": 2, "seller": 8, "category": 11, "bidder": 5, "price": 1, "bid_dateTime": ts(100)},
        {"id": 4, "seller": 6, "category": 13, "bidder": 4, "price": 3, "bid_dateTime": ts(5)},
    ]


def test_q11_sessions_with_a_10_s_gap() -> None:
    b = bids(
        [
            (1, 1, 1, 0),
            (1, 1, 1, 10000),  # exactly 10 s later: same session
            (1, 1, 1, 20001),  # 10.001 s later: a new one
            (1, 2, 1, 5),
            (1, 2, 1, 3),
        ]
    )
    assert run("q11", bid=b) == [
        {"bidder": 1, "bid_count": 2, "starttime": T, "endtime": T + 20_000},
        {"bidder": 1, "bid_count": 1, "starttime": T + 20_001, "endtime": T + 30_001},
        {"bidder": 2, "bid_count": 2, "starttime": T + 3, "endtime": T + 10_005},
    ]


def test_empty_input_gives_empty_results_with_the_schema() -> None:
    for q in oracle.QUERIES:
        result = oracle.run(q, {})
        assert result.num_rows == 0
        assert result.schema.equals(oracle.SCHEMA[q])


def test_unknown_query() -> None:
    with pytest.raises(KeyError, match="q12"):
        oracle.run("q12", {})
