"""The NEXMark dataflows (bench/nexmark/queries.py) run in one process (``run_local``: the real
instances, channels, watermarks and RocksDB state, without Ray) against the DuckDB oracle:
on hand-made inputs that hit each query's corners, and on generated events that arrive out of
order within a bound."""

from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

import raystream as rs
from raystream.runtime.local import run_local
from tests._bench import import_bench

gen = import_bench("bench.nexmark.generator")
oracle = import_bench("bench.nexmark.oracle")
queries = import_bench("bench.nexmark.queries")
side_input = import_bench("bench.nexmark.side_input")

BUILT = sorted(queries.QUERIES, key=lambda q: int(q[1:]))
# q14 and later have their own hand-made inputs (test_nexmark_more.py)
CORNERS = [q for q in BUILT if int(q[1:]) <= 11]
# q12's windows follow the wall clock: no oracle rows (tests/unit/test_nexmark_q12.py)
ORACLE = [q for q in BUILT if not queries.QUERIES[q].processing_time]
T = 1_600_000_000_000


def ts(offset_ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp((T + offset_ms) / 1000, tz=dt.UTC).replace(tzinfo=None)


def corner_tables() -> dict[str, pa.Table]:
    """Small tables with each query's corner cases (see test_nexmark_oracle for the answers)."""
    persons = [
        (1, "Ann", "OR", 1000),
        (2, "Bob", "WA", 5000),
        (3, "Cid", "CA", 12000),
        (4, "Dee", "ID", 13000),
    ]
    auctions = [  # id, seller, category, start, expires
        (10, 1, 10, 0, 100),
        (11, 2, 10, 9999, 20000),
        (12, 3, 10, 15000, 16000),
        (13, 3, 11, 16000, 30000),
        (14, 9, 10, 100, 200),  # seller 9 never comes
        (15, 4, 10, 14000, 30000),
    ]
    bids = [  # auction, bidder, price, t
        (10, 1, 5, 0),  # at the auction's start
        (10, 2, 7, 100),  # at its expiry: counts
        (10, 3, 7, 50),  # same price, earlier: wins auction 10
        (10, 4, 8, 101),  # after expiry
        (11, 5, 9, 10000),  # top of [10 s, 20 s) and at the end of [0, 10 s)
        (11, 6, 9, 2000),  # top of [0, 10 s) ...
        (12, 7, 9, 9999),  # ... tied
        (12, 8, 3, 15500),
        (12, 4, 3, 15500),  # tie on price and time: the smaller bidder wins
        (13, 1, 1, 20001),  # bidder 1: sessions at 0, 20,001 (10,001 ms gap) ...
        (13, 1, 2, 30001),  # ... and exactly 10 s later: the same session
        (15, 9, 2, 14000),
        (16, 9, 4, 14500),  # an auction id that never comes
        (123, 2, 6, 500),  # q2 keeps auctions 123 and 246
        (246, 3, 4, 600),
    ]
    person = pa.Table.from_pylist(
        [
            {"id": i, "name": n, "emailAddress": "e", "creditCard": "c", "city": n[::-1],
             "state": s, "dateTime": ts(t), "extra": ""}
            for i, n, s, t in persons
        ],
        schema=gen.PERSON_SCHEMA,
    )  # fmt: skip
    auction = pa.Table.from_pylist(
        [
            {"id": i, "itemName": "n", "description": "d", "initialBid": 1, "reserve": 2,
             "dateTime": ts(s), "expires": ts(e), "seller": sel, "category": c, "extra": ""}
            for i, sel, c, s, e in auctions
        ],
        schema=gen.AUCTION_SCHEMA,
    )  # fmt: skip
    bid = pa.Table.from_pylist(
        [
            {"auction": a, "bidder": b, "price": p, "channel": "Google", "url": "u",
             "dateTime": ts(t), "extra": f"x{k}"}
            for k, (a, b, p, t) in enumerate(bids)
        ],
        schema=gen.BID_SCHEMA,
    )  # fmt: skip
    return {"person": person, "auction": auction, "bid": bid}


def run_query(
    query: str, tables: dict[str, pa.Table], parallelism: int, tmp: Path, bound_ms: int = 0
) -> pa.Table:
    spec = queries.QUERIES[query]
    sources: dict[str, Any] = {t: rs.sources.from_table(tables[t]) for t in spec.tables}
    for f in spec.side_inputs:  # q13: a file, written from the side input table
        sources[f] = tmp / f"{f}.csv"
        pacsv.write_csv(tables[f], sources[f], pacsv.WriteOptions(include_header=False))
    flow, spec = queries.build_flow(
        query, sources, rs.sinks.collect(), max_out_of_orderness_ms=bound_ms
    )
    config = rs.RuntimeConfig(batch_rows=512, source_batch_rows=512)
    out = asyncio.run(run_local(flow, {spec.step: parallelism}, state_dir=str(tmp), config=config))
    got = out[queries.SINK]
    if got is None:
        return oracle.SCHEMA[query].empty_table()
    return queries.final_result(query, got)


def in_time_order(tables: dict[str, pa.Table]) -> dict[str, pa.Table]:
    return {k: t.sort_by([("dateTime", "ascending")]) for k, t in tables.items()}


@pytest.mark.parametrize("parallelism", [1, 3])
@pytest.mark.parametrize("query", CORNERS)
def test_corner_cases_equal_the_oracle(query: str, parallelism: int, tmp_path: Path) -> None:
    tables = in_time_order(corner_tables())
    want = oracle.run(query, tables)
    assert want.num_rows > 0
    got = run_query(query, tables, parallelism, tmp_path)
    assert got.equals(want), (got.to_pylist(), want.to_pylist())


def test_corner_answers_by_hand(tmp_path: Path) -> None:
    """A few answers of the corner input worked out by hand, through the dataflows."""
    tables = in_time_order(corner_tables())
    q7 = run_query("q7", tables, 2, tmp_path / "q7").to_pylist()
    assert [(r["auction"], r["bidder"], r["window_end"] - T) for r in q7] == [
        (11, 5, 10_000),  # at 10 s: the end of [0, 10 s), included, with its top price 9
        (11, 6, 10_000),
        (12, 7, 10_000),
        (11, 5, 20_000),  # and the top of [10 s, 20 s) itself
        (13, 1, 30_000),
        (13, 1, 40_000),
    ]
    q9 = {
        r["id"]: (r["bidder"], r["price"])
        for r in run_query("q9", tables, 2, tmp_path / "q9").to_pylist()
    }
    assert q9[10] == (3, 7) and q9[12] == (4, 3) and 14 not in q9
    q11 = run_query("q11", tables, 2, tmp_path / "q11").to_pylist()
    assert {"bidder": 1, "bid_count": 2, "starttime": T + 20_001, "endtime": T + 40_001} in q11


@pytest.fixture(scope="module")
def shuffled() -> tuple[dict[str, pa.Table], dict[str, pa.Table]]:
    """8,000 generated events; each table in an arrival order up to 300 ms out of order."""
    tables = gen.generate(gen.NexmarkConfig(events=8_000, rate_eps=500, seed=9))
    out = {}
    for i, name in enumerate(("person", "auction", "bid")):
        t = tables.table(name)
        ms = t["dateTime"].cast(pa.int64()).to_numpy()
        order = gen.bounded_delay_order(ms, 300, seed=i)
        out[name] = t.take(pa.array(order))
    ordered = {n: tables.table(n) for n in ("person", "auction", "bid")}
    ordered["side_input"] = out["side_input"] = side_input.side_input_table()  # q13's
    return ordered, out


def test_the_shuffle_is_out_of_order(shuffled: Any) -> None:
    _, arrived = shuffled
    ms = arrived["bid"]["dateTime"].cast(pa.int64()).to_numpy()
    behind = np.maximum.accumulate(ms) - ms
    assert 0 < behind.max() <= 300


@pytest.mark.parametrize("parallelism", [1, 2])
@pytest.mark.parametrize("query", ORACLE)
def test_out_of_order_input_equals_the_oracle(
    query: str, parallelism: int, shuffled: Any, tmp_path: Path
) -> None:
    """Generated events, out of order within the bound, at one instance and at two (the Ray
    tests run them at three)."""
    ordered, arrived = shuffled
    want = oracle.run(query, ordered)
    assert want.num_rows > 0
    got = run_query(query, arrived, parallelism, tmp_path, bound_ms=300)
    assert got.equals(want)


# ------------------------------------------------------------------------------------------
# the command line: usage errors exit with code 2 before anything runs


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--query", "q23"], "'q23' is not one of"),
        (["--query", "q1", "--rescale", "3@1"], "no keyed step to rescale"),
        (["--query", "q9", "--rescale", "x"], "expected P@T"),
        (["--query", "q9", "--parallelism", "200"], "at most 128"),
        (["--query", "q9", "--strategy", "nope"], "nope"),
    ],
)
def test_cli_usage_errors(args: list[str], message: str) -> None:
    from click.testing import CliRunner

    cli = import_bench("bench.nexmark.cli")
    res = CliRunner().invoke(cli.main, args)
    assert res.exit_code == 2
    assert message in res.output


def test_cli_input_without_the_tables(tmp_path: Path) -> None:
    from click.testing import CliRunner

    cli = import_bench("bench.nexmark.cli")
    gen.write_parquet(gen.NexmarkConfig(events=100), tmp_path)
    (tmp_path / "person.parquet").unlink()
    res = CliRunner().invoke(cli.main, ["--query", "q3", "--input", str(tmp_path)])
    assert res.exit_code == 2
    assert "person.parquet" in res.output


def test_cli_generate_only(tmp_path: Path) -> None:
    from click.testing import CliRunner

    cli = import_bench("bench.nexmark.cli")
    res = CliRunner().invoke(cli.main, ["--generate", str(tmp_path), "--events", "5000"])
    assert res.exit_code == 0, res.output
    want = gen.generate(gen.NexmarkConfig(events=5000))
    import pyarrow.parquet as pq

    for name in ("person", "auction", "bid"):
        assert pq.read_table(tmp_path / f"{name}.parquet").equals(want.table(name))


def test_q8_state_packing_round_trip() -> None:
    """q8's per-key bytes values: every (key, w, tag, name) entry comes back, names with nulls,
    empty strings and multi-byte characters; keys without entries store None."""
    rng = np.random.default_rng(5)
    n_keys, n = 50, 400
    key = np.sort(rng.integers(0, n_keys, n))
    w = rng.integers(-(10**12), 10**13, n)
    words = ["", "Ann", "Jörg Müller", "李", None, "x" * 300]
    names = [words[i] for i in rng.integers(0, len(words), n)]
    sold = rng.random(n) < 0.4
    names = [None if s else m for s, m in zip(sold.tolist(), names, strict=True)]
    tag = np.array(
        [
            -1 if s else (-2 if m is None else len(m.encode()))
            for s, m in zip(sold, names, strict=True)
        ],
        np.int32,
    )
    entries = queries._Entries(key, w, tag, pa.array(names, pa.string()))
    values = queries._q8_pack(entries, n_keys)
    assert [v is not None for v in values] == [k in set(key.tolist()) for k in range(n_keys)]
    back = queries._q8_unpack(values)

    def rows(e: Any) -> list[tuple[Any, ...]]:
        return sorted(
            zip(e.key.tolist(), e.w.tolist(), e.tag.tolist(), e.name.to_pylist(), strict=True),
            key=repr,
        )

    assert rows(back) == rows(entries)


@pytest.mark.parametrize("parallelism", [1, 2])
def test_q8_repeated_and_nameless_persons_equal_the_oracle(
    parallelism: int, tmp_path: Path
) -> None:
    """q8 where the generator never goes: a person id seen twice in one window (same name:
    one row; another name: two rows), a person without a name, auctions before and after their
    seller, several auctions of a seller in one window, the same id again windows later (after
    its first window's entries were dropped)."""
    persons = [  # id, name, t
        (1, "Ann", 1000), (1, "Ann", 2000), (1, "Anna", 3000),
        (2, None, 4000), (3, "Cid", 15000), (1, "Ann", 125000), (4, "Dee", 126000),
    ]  # fmt: skip
    auctions = [(1, 500), (1, 9000), (2, 9999), (3, 12000), (3, 19999), (5, 5000), (1, 129000)]
    person = pa.Table.from_pylist(
        [
            {"id": i, "name": n, "emailAddress": "e", "creditCard": "c", "city": "x",
             "state": "OR", "dateTime": ts(t), "extra": ""}
            for i, n, t in persons
        ],
        schema=gen.PERSON_SCHEMA,
    )  # fmt: skip
    auction = pa.Table.from_pylist(
        [
            {"id": 100 + k, "itemName": "n", "description": "d", "initialBid": 1, "reserve": 2,
             "dateTime": ts(t), "expires": ts(t + 1), "seller": s, "category": 10, "extra": ""}
            for k, (s, t) in enumerate(auctions)
        ],
        schema=gen.AUCTION_SCHEMA,
    )  # fmt: skip
    tables = in_time_order({"person": person, "auction": auction, "bid": corner_tables()["bid"]})
    want = oracle.run("q8", tables)
    assert want.num_rows == 5  # 1/Ann, 1/Anna, 2/None, 3/Cid and 1/Ann again; not 4 and 5
    got = run_query("q8", tables, parallelism, tmp_path)
    assert got.equals(want), (got.to_pylist(), want.to_pylist())
