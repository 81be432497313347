"""The NEXMark generator (bench/nexmark/generator.py) against the reference's rules, checked
with plain Python arithmetic, regular expressions and counts over the generated rows."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests._bench import import_bench

gen = import_bench("bench.nexmark.generator")
BASE = 1_600_000_000_000


@pytest.fixture(scope="module")
def tables() -> Any:
    return gen.generate(gen.NexmarkConfig(events=20_000, rate_eps=1000, seed=7, base_time_ms=BASE))


def test_proportions_and_ids(tables: Any) -> None:
    # 20,000 events = 400 rounds of 50: 1 person, 3 auctions, 46 bids each
    assert tables.person.num_rows == 400
    assert tables.auction.num_rows == 1200
    assert tables.bid.num_rows == 18_400
    assert tables.person["id"].to_pylist() == list(range(1000, 1400))
    assert tables.auction["id"].to_pylist() == list(range(1000, 2200))


def test_partial_round_keeps_the_order_of_kinds() -> None:
    # 53 events: events 0..49 are one round; 50 is a person, 51 and 52 auctions
    t = gen.generate(gen.NexmarkConfig(events=53, rate_eps=1000, base_time_ms=BASE))
    assert (t.person.num_rows, t.auction.num_rows, t.bid.num_rows) == (2, 5, 46)
    assert t.person["dateTime"].cast(pa.int64()).to_pylist() == [BASE, BASE + 50]
    assert t.auction["dateTime"].cast(pa.int64()).to_pylist() == [
        BASE + 1,
        BASE + 2,
        BASE + 3,
        BASE + 51,
        BASE + 52,
    ]


def test_date_time_follows_the_rate_in_event_time(tables: Any) -> None:
    # 1000 events/s: event n at BASE + n ms; person i is event 50 i, auction j event
    # 50 (j // 3) + 1 + j % 3, bid k event 50 (k // 46) + 4 + k % 46
    ms = {
        name: tables.table(name)["dateTime"].cast(pa.int64()).to_pylist()
        for name in ("person", "auction", "bid")
    }
    assert ms["person"] == [BASE + 50 * i for i in range(400)]
    assert ms["auction"] == [BASE + 50 * (j // 3) + 1 + j % 3 for j in range(1200)]
    assert ms["bid"] == [BASE + 50 * (k // 46) + 4 + k % 46 for k in range(18_400)]


@pytest.mark.parametrize("rate", [10_000, 7_000, 333])
def test_date_time_at_other_rates(rate: int) -> None:
    t = gen.generate(gen.NexmarkConfig(events=5_000, rate_eps=rate, base_time_ms=BASE))
    delay_us = 1_000_000 / rate
    bids = t.bid["dateTime"].cast(pa.int64()).to_pylist()
    expect = [
        BASE + int((50 * (k // 46) + 4 + k % 46) * delay_us) // 1000 for k in range(len(bids))
    ]
    assert bids == expect
    assert all(a <= b for a, b in zip(bids, bids[1:], strict=False))  # monotone
    span_s = (bids[-1] - BASE) / 1000
    assert span_s == pytest.approx(5_000 / rate, rel=0.01)


def test_auction_field_rules(tables: Any) -> None:
    a = tables.auction.to_pydict()
    for j in range(len(a["id"])):
        event = 50 * (j // 3) + 1 + j % 3
        last_person = event // 50  # base-0 id of the newest person
        seller = a["seller"][j] - 1000
        hot = (last_person // 100) * 100
        recent = max(0, last_person + 1 - 1000) <= seller <= last_person + 10
        assert seller == hot or recent, (j, seller)
        assert 10 <= a["category"][j] <= 14
        assert 100 <= a["initialBid"][j] <= 100_000_000
        assert a["reserve"][j] - a["initialBid"][j] >= 100
        start = a["dateTime"][j].timestamp()
        assert a["expires"][j].timestamp() > start
        assert len(a["itemName"][j]) <= 19 and len(a["description"][j]) <= 99  # trimmed
        assert a["itemName"][j] == a["itemName"][j].strip()
        assert re.fullmatch(r"[a-z ]*", a["description"][j])
    cats = np.bincount(np.array(a["category"]) - 10)
    assert cats.min() > 0.15 * len(a["id"])  # five categories, about uniform
    # expires: 1 + U{0..2 horizon - 1} ms, horizon = time of 1666 events later (1.666 s here)
    length_ms = (
        tables.auction["expires"].cast(pa.int64()).to_numpy()
        - tables.auction["dateTime"].cast(pa.int64()).to_numpy()
    )
    assert length_ms.min() >= 1 and length_ms.max() <= 2 * 1666
    assert length_ms.mean() == pytest.approx(1666, rel=0.1)
    hot_share = np.mean(
        [
            (s - 1000) % 100 == 0 and s - 1000 == ((50 * (j // 3) + 1 + j % 3) // 50 // 100) * 100
            for j, s in enumerate(a["seller"])
        ]
    )
    assert hot_share == pytest.approx(0.75, abs=0.05)


def test_bid_field_rules(tables: Any) -> None:
    b = tables.bid.to_pydict()
    hot_auctions = hot_bidders = hot_channels = 0
    for k in range(len(b["auction"])):
        event = 50 * (k // 46) + 4 + k % 46
        last_auction = 3 * (event // 50) + 2  # base-0 id of the newest auction
        last_person = event // 50
        auction = b["auction"][k] - 1000
        if auction == (last_auction // 100) * 100:
            hot_auctions += 1
        else:
            assert max(0, last_auction - 100) <= auction <= last_auction + 10, (k, auction)
        bidder = b["bidder"][k] - 1000
        if bidder == (last_person // 100) * 100 + 1:
            hot_bidders += 1
        else:
            assert max(0, last_person + 1 - 1000) <= bidder <= last_person + 10, (k, bidder)
        assert 100 <= b["price"][k] <= 100_000_000
        channel, url = b["channel"][k], b["url"][k]
        if channel in ("Google", "Facebook", "Baidu", "Apple"):
            hot_channels += 1
            assert re.fullmatch(
                r"https://www\.nexmark\.com/[a-z_]{3,4}/[a-z_]{3,4}/[a-z_]{3,4}/item\.htm\?query=1",
                url,
            )
        else:
            i = int(re.fullmatch(r"channel-(\d+)", channel).group(1))  # type: ignore[union-attr]
            assert 0 <= i < 10_000
            m = re.fullmatch(
                r"https://www\.nexmark\.com/([a-z_]{3,4}/){3}item\.htm\?query=1(&channel_id=(-?\d+))?",
                url,
            )
            assert m is not None, url
            if m.group(3) is not None:  # abs(Integer.reverse(i)) on 32 bits
                rev = int(f"{i:032b}"[::-1], 2)
                signed = rev - (1 << 32) if rev >= 1 << 31 else rev
                assert int(m.group(3)) == (signed if signed == -(1 << 31) else abs(signed))
        assert 54 <= len(b["extra"][k]) < 82  # 100 - 32 bytes, +- 20 %
    n = len(b["auction"])
    assert hot_auctions / n == pytest.approx(0.5, abs=0.05)
    assert hot_bidders / n == pytest.approx(0.75, abs=0.05)
    assert hot_channels / n == pytest.approx(0.5, abs=0.03)
    # the same channel always has the same URL
    pairs: dict[str, str] = {}
    for c, u in zip(b["channel"], b["url"], strict=True):
        assert pairs.setdefault(c, u) == u
    # prices: log10(price / 100) uniform on [0, 6]
    logs = np.log10(np.array(b["price"]) / 100)
    assert np.histogram(logs, bins=6, range=(0, 6))[0].min() > n / 6 * 0.9


def test_person_field_rules(tables: Any) -> None:
    p = tables.person.to_pydict()
    first = {
        "Peter",
        "Paul",
        "Luke",
        "John",
        "Saul",
        "Vicky",
        "Kate",
        "Julie",
        "Sarah",
        "Deiter",
        "Walter",
    }
    last = {"Shultz", "Abrams", "Spencer", "White", "Bartels", "Walton", "Smith", "Jones", "Noris"}
    cities = {
        "Phoenix",
        "Los Angeles",
        "San Francisco",
        "Boise",
        "Portland",
        "Bend",
        "Redmond",
        "Seattle",
        "Kent",
        "Cheyenne",
    }
    for i in range(len(p["id"])):
        f, _, l_ = p["name"][i].partition(" ")
        assert f in first and l_ in last
        assert p["city"][i] in cities
        assert p["state"][i] in {"AZ", "CA", "ID", "OR", "WA", "WY"}
        assert re.fullmatch(r"[a-z ]{0,6}@[a-z ]{0,4}\.com", p["emailAddress"][i])
        assert re.fullmatch(r"\d{4} \d{4} \d{4} \d{4}", p["creditCard"][i])
        size = 8 + len(p["name"][i]) + len(p["emailAddress"][i]) + 19 + len(p["city"][i]) + 2
        want = 200 - size
        delta = int(want * 0.2 + 0.5)
        assert want - delta <= len(p["extra"][i]) < want + delta
    assert len(set(p["state"])) == 6


def test_deterministic_by_seed() -> None:
    config = gen.NexmarkConfig(events=3_000, seed=11)
    a, b = gen.generate(config), gen.generate(config)
    other = gen.generate(gen.NexmarkConfig(events=3_000, seed=12))
    for name in ("person", "auction", "bid"):
        assert a.table(name).equals(b.table(name))
        assert not a.table(name).equals(other.table(name))


def test_chunks_are_independent_of_how_they_are_iterated() -> None:
    config = gen.NexmarkConfig(events=gen.CHUNK_EVENTS + 700, seed=3)
    whole = gen.generate(config)
    second = gen._chunk(config, 1)  # made alone, without the first
    assert whole.bid.slice(whole.bid.num_rows - second.bid.num_rows).equals(second.bid)
    assert second.person["id"][0].as_py() == 1000 + gen.CHUNK_EVENTS // 50


def test_write_parquet_round_trips(tmp_path: Path) -> None:
    config = gen.NexmarkConfig(events=gen.CHUNK_EVENTS + 1_000, seed=5)
    paths = gen.write_parquet(config, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "auction.parquet",
        "bid.parquet",
        "person.parquet",
        "side_input.csv",  # q13's, the same for every config
    ]
    assert paths.pop("side_input").read_text().startswith("0,0\n1,1\n")
    whole = gen.generate(config)
    for name, path in paths.items():
        table = pq.read_table(path)
        assert table.schema.equals(gen.SCHEMAS[name])
        assert table.equals(whole.table(name))
    assert pq.read_schema(paths["auction"]).field("expires").type == pa.timestamp("ms")


def test_bounded_delay_order() -> None:
    times = np.repeat(np.arange(0, 1000), 3)  # three events per ms
    order = gen.bounded_delay_order(times, max_delay_ms=20, seed=1)
    assert sorted(order.tolist()) == list(range(len(times)))
    arrived = times[order]
    running_max = np.maximum.accumulate(arrived)
    lateness = running_max - arrived
    assert lateness.max() <= 20 and lateness.max() > 0
    assert np.array_equal(gen.bounded_delay_order(times, 0), np.arange(len(times)))


def test_bad_config() -> None:
    with pytest.raises(ValueError, match="rate_eps"):
        gen.NexmarkConfig(events=10, rate_eps=0)
    with pytest.raises(ValueError, match="events"):
        gen.NexmarkConfig(events=-1)
