"""NEXMark q14 and later: the DuckDB oracle on hand-made inputs whose answers are written out
here, and the raystream dataflows (in one process, ``run_local``: real instances, watermarks,
RocksDB) against the oracle on those inputs at parallelism 1 and 3. Generated events out of
order run through every built query in test_nexmark_queries.py."""

from __future__ import annotations

import asyncio
import datetime as dt
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pytest

import raystream as rs
from raystream.runtime.local import run_local
from tests._bench import import_bench

gen = import_bench("bench.nexmark.generator")
oracle = import_bench("bench.nexmark.oracle")
queries = import_bench("bench.nexmark.queries")
side_input = import_bench("bench.nexmark.side_input")

DAY0 = 1_599_955_200_000  # 2020-09-13 00:00:00 UTC
H = 3_600_000


def ts(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).replace(tzinfo=None)


def bid_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Bids from dicts with ``t`` (ms since the epoch) and any bid columns; defaults elsewhere."""
    full = []
    for i, r in enumerate(rows):
        row = {"auction": 1, "bidder": 1, "price": 1, "channel": "Google", "url": "u",
               "extra": f"x{i}", **{k: v for k, v in r.items() if k != "t"}}  # fmt: skip
        row["dateTime"] = ts(r["t"])
        full.append(row)
    return pa.Table.from_pylist(full, schema=gen.BID_SCHEMA)


def auction_table(rows: list[dict[str, Any]]) -> pa.Table:
    full = []
    for r in rows:
        row = {"itemName": "n", "description": "d", "initialBid": 1, "reserve": 2, "seller": 1,
               "category": 10, "extra": "", **{k: v for k, v in r.items() if k not in ("t", "e")}}  # fmt: skip
        row["dateTime"] = ts(r["t"])
        row["expires"] = ts(r.get("e", r["t"] + 1000))
        full.append(row)
    return pa.Table.from_pylist(full, schema=gen.AUCTION_SCHEMA)


def tables(bids: pa.Table, auctions: pa.Table | None = None) -> dict[str, pa.Table]:
    return {
        "person": gen.PERSON_SCHEMA.empty_table(),
        "auction": auctions if auctions is not None else gen.AUCTION_SCHEMA.empty_table(),
        "bid": bids,
    }


def run_query(
    query: str,
    data: dict[str, pa.Table],
    parallelism: int,
    tmp: Path,
    rates: dict[str, float] | None = None,
) -> pa.Table:
    """``query`` over ``data`` in one process; ``rates``: tables replayed at so many rows/s
    (the others as fast as they go)."""
    spec = queries.QUERIES[query]
    rates = rates or {}
    sources: dict[str, Any] = {
        t: rs.sources.from_table(data[t], rate_eps=rates.get(t, 0)) for t in spec.tables
    }
    for f in spec.side_inputs:  # q13: a file, written from the side input table
        sources[f] = tmp / f"{f}.csv"
        pacsv.write_csv(data[f], sources[f], pacsv.WriteOptions(include_header=False))
    flow, spec = queries.build_flow(query, sources, rs.sinks.collect())
    config = rs.RuntimeConfig(batch_rows=4, source_batch_rows=4)  # many small batches
    out = asyncio.run(run_local(flow, {spec.step: parallelism}, state_dir=str(tmp), config=config))
    got = out[queries.SINK]
    if got is None:
        return oracle.SCHEMA[query].empty_table()
    return queries.final_result(query, got)


def in_time_order(data: dict[str, pa.Table]) -> dict[str, pa.Table]:
    return {
        k: t.sort_by([("dateTime", "ascending")]) if "dateTime" in t.schema.names else t
        for k, t in data.items()
    }


# ------------------------------------------------------------------------------------------
# q6: per seller, the average winning price of an auction and the 10 before it


def q6_input() -> dict[str, pa.Table]:
    auctions = [{"id": k, "seller": 1, "t": DAY0, "e": DAY0 + 100_000} for k in range(1, 13)]
    auctions += [{"id": 20, "seller": 2, "t": DAY0, "e": DAY0 + 100_000}]  # no bids: no row
    bids = [{"auction": k, "price": 10 * k, "t": DAY0 + 1000 * k} for k in range(1, 13)]
    bids += [
        {"auction": 3, "price": 1000, "t": DAY0 + 50_000},  # 3's winner, now the latest one
        {"auction": 2, "price": 10**6, "t": DAY0 + 200_000},  # after 2 expired: not counted
    ]
    return tables(bid_table(bids), auction_table(auctions))


def test_q6_oracle_by_hand() -> None:
    got = [(r["id"], r["avg_price"]) for r in oracle.run("q6", q6_input()).to_pylist()]
    # winners by time: 1, 2, 4, ..., 12 (10 x id), then 3 (1000); 11 rows at most
    by_time = [(1, 10), (2, 15), (4, 23), (5, 30), (6, 36), (7, 41), (8, 47), (9, 52), (10, 57),
               (11, 63), (12, 68), (3, 158)]  # fmt: skip
    assert got == sorted(by_time)


# ------------------------------------------------------------------------------------------
# q13: bids joined with a side input file on auction % 10,000


def q13_input() -> dict[str, pa.Table]:
    side = pa.table(
        {"key": [0, 1, 5, 5, 9_999], "value": ["zero", "one", "five", "cinq", ""]},
        schema=side_input.SCHEMA,
    )  # key 5 twice: both join; an empty value is a value
    auctions = [1, 10_001, 5, 2, 19_999, 0, 20_000]
    data = tables(bid_table([{"auction": a, "t": DAY0 + i} for i, a in enumerate(auctions)]))
    data["side_input"] = side
    return data


def test_q13_oracle_by_hand() -> None:
    got = [(r["auction"], r["value"]) for r in oracle.run("q13", q13_input()).to_pylist()]
    assert got == [
        (0, "zero"),
        (1, "one"),
        (5, "cinq"),
        (5, "five"),
        (10_001, "one"),
        (19_999, ""),
        (20_000, "zero"),
    ]  # auction 2: no key 2


def test_side_input_file_round_trip(tmp_path: Path) -> None:
    """The generated side input: the reference's lines ``i,i``, read back as (i, "i")."""
    path = side_input.write_side_input(tmp_path / "side_input.csv", rows=3)
    assert path.read_text() == "0,0\n1,1\n2,2\n"
    assert side_input.read_side_input(path).equals(side_input.side_input_table(3))


# ------------------------------------------------------------------------------------------
# q14: price range, time of day, count of "c"


def q14_input() -> dict[str, pa.Table]:
    low, high = 1_101_322, 55_066_079  # the smallest and largest prices inside (x 0.908)
    rows = [
        {"auction": 1, "price": low - 1, "t": DAY0 + 8 * H},  # 999,999.468 euro: out
        {"auction": 2, "price": low, "t": DAY0 + 8 * H, "extra": "ccc"},  # 1,000,000.376
        {"auction": 3, "price": high, "t": DAY0 + 7 * H + 59 * 60_000, "extra": "abcC"},
        {"auction": 4, "price": high + 1, "t": DAY0 + 12 * H},  # 50,000,000.640: out
        {"auction": 5, "price": low, "t": DAY0 + 18 * H + 3_599_999, "extra": ""},
        {"auction": 6, "price": low, "t": DAY0 + 19 * H, "extra": None},
        {"auction": 7, "price": low, "t": DAY0 + 6 * H + 3_599_999, "extra": "çc"},
        {"auction": 8, "price": low, "t": DAY0 + 20 * H},
        {"auction": 9, "price": low, "t": DAY0 + 24 * H - 1},
        {"auction": 10, "price": low, "t": DAY0 + 24 * H},  # the next day, hour 0
    ]
    return tables(bid_table(rows))


def test_q14_oracle_by_hand() -> None:
    got = [
        (r["auction"], r["price"], r["bidTimeType"], r["c_counts"])
        for r in oracle.run("q14", q14_input()).to_pylist()
    ]
    assert got == [
        (2, Decimal("1000000.376"), "dayTime", 3),
        (3, Decimal("49999999.732"), "otherTime", 1),  # 07:59; the capital C is not a c
        (5, Decimal("1000000.376"), "dayTime", 0),  # 18:59:59.999
        (6, Decimal("1000000.376"), "otherTime", 0),  # 19:00; a null extra counts 0
        (7, Decimal("1000000.376"), "nightTime", 1),  # 06:59:59.999; ç is two other bytes
        (8, Decimal("1000000.376"), "nightTime", 0),
        (9, Decimal("1000000.376"), "nightTime", 0),
        (10, Decimal("1000000.376"), "nightTime", 0),
    ]


# ------------------------------------------------------------------------------------------
# q21: channel id from the channel's name or the URL


def q21_input() -> dict[str, pa.Table]:
    rows = [
        ("Apple", "https://x/y?a=1&channel_id=99"),  # a hot channel wins over the URL
        ("GOOGLE", "u"),
        ("faceBook", "u"),
        ("Baidu", "u"),
        ("channel-1", "https://x/y?query=1&channel_id=42"),
        ("channel-2", "channel_id=7&a=1"),  # at the start
        ("channel-3", "https://x/y?channel_id=9"),  # after ? (neither & nor the start): out
        ("channel-4", "https://x/y?a=1&channel_id=&b=2"),  # empty, but found
        ("channel-5", "a&channel_id=1&channel_id=2"),  # the first
        ("channel-6", "https://x/y?query=1"),  # none: out
        ("Apples", "u"),  # not a hot channel: out
    ]
    return tables(
        bid_table(
            [{"auction": i, "channel": c, "url": u, "t": DAY0 + i} for i, (c, u) in enumerate(rows)]
        )
    )


def test_q21_oracle_by_hand() -> None:
    got = [(r["auction"], r["channel_id"]) for r in oracle.run("q21", q21_input()).to_pylist()]
    assert got == [(0, "0"), (1, "1"), (2, "2"), (3, "3"), (4, "42"), (5, "7"), (7, ""), (8, "1")]


# ------------------------------------------------------------------------------------------
# q22: the URL's first three directories


# q10: every bid with its dt / hm partition columns, written to Hive-style folders


def q10_input() -> dict[str, pa.Table]:
    times = [DAY0 - 1, DAY0, DAY0 + 59_999, DAY0 + 60_000, DAY0 + 21 * H + 5, DAY0 + 21 * H + 7]
    return tables(bid_table([{"auction": i, "t": t} for i, t in enumerate(times)]))


def test_q10_oracle_by_hand() -> None:
    got = [(r["auction"], r["dt"], r["hm"]) for r in oracle.run("q10", q10_input()).to_pylist()]
    assert got == [
        (0, "2020-09-12", "23:59"),
        (1, "2020-09-13", "00:00"),
        (2, "2020-09-13", "00:00"),
        (3, "2020-09-13", "00:01"),
        (4, "2020-09-13", "21:00"),
        (5, "2020-09-13", "21:00"),
    ]


@pytest.mark.parametrize("parallelism", [1, 3])
def test_q10_partitioned_files_equal_the_oracle(parallelism: int, tmp_path: Path) -> None:
    """Generated bids out of order through q10 into the benchmark's partitioned Parquet sink;
    the folders read back with hive partitioning equal DuckDB's q10 over the bids, and every
    file sits in the folder of its rows' dateTime."""
    cli = import_bench("bench.nexmark.cli")
    bids = gen.generate(gen.NexmarkConfig(events=3000, rate_eps=20)).bid  # 150 s of events
    ms = bids.column("dateTime").cast(pa.int64()).to_numpy()
    bids = bids.take(pa.array(gen.bounded_delay_order(ms, 2_000, seed=parallelism)))
    data = tables(bids)
    out = tmp_path / "out"
    flow, spec = queries.build_flow(
        "q10",
        {"bid": rs.sources.from_table(data["bid"])},
        cli.PartFileSink(str(out), "q10"),
        max_out_of_orderness_ms=2_000,
    )
    config = rs.RuntimeConfig(batch_rows=64, source_batch_rows=64)
    asyncio.run(
        run_local(
            flow,
            {spec.step: parallelism, queries.SINK: parallelism},
            state_dir=str(tmp_path / "state"),
            config=config,
        )
    )
    want = oracle.run("q10", data)
    assert len(set(want.column("hm").to_pylist())) > 3  # several minute folders
    got = oracle.read_partitioned("q10", out, ("dt", "hm"))
    assert got.equals(want), (got.num_rows, want.num_rows)
    import pyarrow.parquet as pq

    for part in out.glob("*/*/*.parquet"):
        dt_dir, hm_dir = part.parent.parent.name, part.parent.name
        assert "dt" not in pq.read_schema(part).names
        times = pq.read_table(part).column("dateTime")
        assert dt_dir == "dt=" + pc.strftime(pc.min(times), "%Y-%m-%d").as_py()
        assert hm_dir == "hm=" + pc.strftime(pc.max(times), "%H:%M").as_py().replace(":", "%3A")
    # q10's partition commit: at the end of input every minute folder has its success file
    committed = oracle.check_committed(out, want, ("dt", "hm"))
    assert committed["ok"], committed
    assert committed["committed"] == len(set(want.column("hm").to_pylist())) > 3
    assert len(list(out.glob("*/*/_SUCCESS"))) == committed["committed"]


def q22_input() -> dict[str, pa.Table]:
    urls = [
        "https://www.nexmark.com/abc/de/f_g/item.htm?query=1",
        "https://x.com/a",  # one directory
        "a//b/c/d/e",  # an empty piece counts
        "",
        "https://x.com/a/b/",  # an empty last piece
        None,
    ]
    return tables(bid_table([{"auction": i, "url": u, "t": DAY0 + i} for i, u in enumerate(urls)]))


def test_q22_oracle_by_hand() -> None:
    got = [(r["dir1"], r["dir2"], r["dir3"]) for r in oracle.run("q22", q22_input()).to_pylist()]
    assert got == [
        ("abc", "de", "f_g"),
        ("a", None, None),
        ("c", "d", "e"),
        (None, None, None),
        ("a", "b", ""),
        (None, None, None),
    ]


# ------------------------------------------------------------------------------------------
# q15, q16, q17: per day (and channel, and auction); ranks at 10,000 and 1,000,000


def daily_input() -> dict[str, pa.Table]:
    rows = [  # bidder, auction, price, t, channel
        (1, 1, 9_999, DAY0 + 1000, "A"),  # rank 1
        (1, 1, 10_000, DAY0 + 2000, "A"),  # rank 2: bidder 1 and auction 1 again, another rank
        (2, 1, 999_999, DAY0 + 24 * H - 60_000, "B"),  # rank 2 again, at 23:59
        (2, 2, 1_000_000, DAY0 + 24 * H - 1, "x|y"),  # rank 3, the day's last ms
        (1, 2, 5, DAY0 + 24 * H, "A"),  # the next day
        (1, 2, 5, DAY0 + 24 * H + 1, "A"),  # the same bidder, auction and rank
    ]
    return tables(
        bid_table(
            [{"bidder": b, "auction": a, "price": p, "t": t, "channel": c}
             for b, a, p, t, c in rows]
        )
    )  # fmt: skip


def test_q15_oracle_by_hand() -> None:
    got = oracle.run("q15", daily_input()).to_pylist()
    assert [tuple(r.values()) for r in got] == [
        ("2020-09-13", 4, 1, 2, 1, 2, 1, 2, 1, 2, 1, 1, 1),
        ("2020-09-14", 2, 2, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0),
    ]


def test_q16_oracle_by_hand() -> None:
    got = oracle.run("q16", daily_input()).to_pylist()
    assert [(r["channel"], r["day"], r["minute"], r["total_bids"], r["total_bidders"],
             r["rank2_bidders"]) for r in got] == [
        ("A", "2020-09-13", "00:00", 2, 1, 1),
        ("A", "2020-09-14", "00:00", 2, 1, 0),
        ("B", "2020-09-13", "23:59", 1, 1, 1),
        ("x|y", "2020-09-13", "23:59", 1, 1, 0),
    ]  # fmt: skip


def test_q17_oracle_by_hand() -> None:
    got = oracle.run("q17", daily_input()).to_pylist()
    assert [tuple(r.values()) for r in got] == [
        (1, "2020-09-13", 3, 1, 2, 0, 9_999, 999_999, 339_999, 1_019_998),  # 339,999.33
        (2, "2020-09-13", 1, 0, 0, 1, 1_000_000, 1_000_000, 1_000_000, 1_000_000),
        (2, "2020-09-14", 2, 2, 0, 0, 5, 5, 5, 10),
    ]


# ------------------------------------------------------------------------------------------
# q18: the last bid per (bidder, auction); q19: the top ten per auction; q20: category 10 join


def q18_input() -> dict[str, pa.Table]:
    rows = [  # bidder, auction, price, t, channel, extra
        (1, 1, 5, 1000, "A", "a"),
        (1, 1, 3, 2000, "A", "b"),  # later: the last, although cheaper
        (1, 2, 5, 1000, "A", "a"),
        (1, 2, 7, 1000, "A", "a"),  # the same time: the higher price
        (2, 1, 4, 1000, "A", "x"),
        (2, 1, 4, 1000, "B", "x"),  # time and price tied: the larger channel
        (2, 2, 4, 1000, "A", None),
        (2, 2, 4, 1000, "A", ""),  # all else tied: "" beats null (nulls last)
    ]
    return tables(
        bid_table(
            [{"bidder": b, "auction": a, "price": p, "t": DAY0 + t, "channel": c, "extra": e}
             for b, a, p, t, c, e in rows]
        )
    )  # fmt: skip


def test_q18_oracle_by_hand() -> None:
    got = [
        (r["bidder"], r["auction"], r["price"], r["channel"], r["extra"])
        for r in oracle.run("q18", q18_input()).to_pylist()
    ]
    assert got == [
        (1, 1, 3, "A", "b"),
        (1, 2, 7, "A", "a"),
        (2, 1, 4, "B", "x"),
        (2, 2, 4, "A", ""),
    ]


def q19_input() -> dict[str, pa.Table]:
    rows = [(1, 100, 10), (2, 100, 5), (3, 100, 5)]  # bidder, price, t: ties on price
    rows += [(b, p, 20) for b, p in zip([4, 6, 7, 8, 9, 10, 11, 12, 13], range(90, 0, -10))]
    rows += [(5, 95, 30)]  # a late high bid pushes the ranks below it down
    bids = [{"auction": 1, "bidder": b, "price": p, "t": DAY0 + t} for b, p, t in rows]
    bids += [{"auction": 2, "bidder": 1, "price": 7, "t": DAY0}]
    return tables(bid_table(bids))


def test_q19_oracle_by_hand() -> None:
    got = [
        (r["auction"], r["rank_number"], r["price"], r["bidder"])
        for r in oracle.run("q19", q19_input()).to_pylist()
    ]
    top = [(100, 2), (100, 3), (100, 1), (95, 5), (90, 4), (80, 6), (70, 7), (60, 8), (50, 9),
           (40, 10)]  # fmt: skip
    assert got == [(1, r + 1, p, b) for r, (p, b) in enumerate(top)] + [(2, 1, 7, 1)]


def q20_input() -> dict[str, pa.Table]:
    auctions = auction_table(
        [
            {"id": 1, "category": 10, "t": DAY0 + 1000, "itemName": "one"},
            {"id": 2, "category": 11, "t": DAY0 + 1000},  # another category: its bids dropped
            {"id": 3, "category": 10, "t": DAY0 + 5000, "itemName": "three"},  # after a bid
            {"id": 4, "category": 10, "t": DAY0 + 6000},  # no bids
        ]
    )
    bids = bid_table(
        [
            {"auction": 1, "bidder": 1, "t": DAY0 + 1500},
            {"auction": 1, "bidder": 2, "t": DAY0 + 2500},
            {"auction": 2, "bidder": 3, "t": DAY0 + 1500},
            {"auction": 3, "bidder": 4, "t": DAY0 + 2000},  # waits for its auction
            {"auction": 3, "bidder": 5, "t": DAY0 + 6000},
            {"auction": 9, "bidder": 6, "t": DAY0 + 100},  # its auction never comes
        ]
    )
    return tables(bids, auctions)


def test_q20_oracle_by_hand() -> None:
    got = [
        (r["auction"], r["bidder"], r["itemName"])
        for r in oracle.run("q20", q20_input()).to_pylist()
    ]
    assert got == [(1, 1, "one"), (1, 2, "one"), (3, 4, "three"), (3, 5, "three")]


@pytest.mark.parametrize("slow", ["auction", "bid"])
def test_q20_bids_before_and_after_their_auctions(slow: str, tmp_path: Path) -> None:
    """One table replayed slowly (20 rows/s): bids reach the join before their auction (they
    wait; those of another category are dropped then), or after it (joined on arrival)."""
    data = in_time_order(q20_input())
    want = oracle.run("q20", data)
    got = run_query("q20", data, 2, tmp_path, rates={slow: 20})
    assert got.equals(want), (got.to_pylist(), want.to_pylist())


@pytest.mark.parametrize("query", ["q18", "q19"])
def test_ties_in_either_arrival_order_equal_the_oracle(query: str, tmp_path: Path) -> None:
    """Rows tied on the query's ORDER BY arrive in both orders: the same result (the tie-break
    does not depend on arrival)."""
    data = (q18_input if query == "q18" else q19_input)()
    want = oracle.run(query, data)
    for name, bids in (
        ("fwd", data["bid"]),
        ("rev", data["bid"].take(list(range(data["bid"].num_rows))[::-1])),
    ):
        arrived = dict(data, bid=bids.sort_by([("dateTime", "ascending")]))
        got = run_query(query, arrived, 2, tmp_path / name)
        assert got.equals(want), (name, got.to_pylist(), want.to_pylist())


# ------------------------------------------------------------------------------------------
# every new query's dataflow against the oracle on its hand-made input

INPUTS = {
    "q6": q6_input,
    "q13": q13_input,
    "q14": q14_input,
    "q15": daily_input,
    "q16": daily_input,
    "q17": daily_input,
    "q18": q18_input,
    "q19": q19_input,
    "q20": q20_input,
    "q21": q21_input,
    "q22": q22_input,
    "q10": q10_input,
}


@pytest.mark.parametrize("parallelism", [1, 3])
@pytest.mark.parametrize("query", sorted(INPUTS, key=lambda q: int(q[1:])))
def test_hand_made_input_equals_the_oracle(query: str, parallelism: int, tmp_path: Path) -> None:
    data = in_time_order(INPUTS[query]())
    want = oracle.run(query, data)
    assert want.num_rows > 0
    got = run_query(query, data, parallelism, tmp_path)
    assert got.equals(want), (got.to_pylist(), want.to_pylist())
