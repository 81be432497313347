"""The NEXMark event generator, vectorised with numpy (the field rules of the Beam/Flink one).

Events are numbered ``n = 0, 1, ...``; out of every 50 consecutive events one is a person, three
are auctions and 46 are bids (``n % 50``: 0 person, 1-3 auction, 4-49 bid). Event ``n`` happens at
``base_time_ms + floor(n * 1e6 / rate_eps) // 1000`` (event time: a rate of 10,000 events/s puts
ten events into each millisecond, whatever the machine does). Field rules, as in the reference:

* person ids are ``1000 + n // 50``; auction ids ``1000 + 3 * (n // 50) + (n % 50 - 1)``;
* an auction's seller is a hot seller (``(last person / 100) * 100``) with probability 3/4, else
  one of the ~1000 most recent persons (up to 10 not created yet); category ``10 + U{0..4}``;
  initial bid and reserve increment ``round(10 ** U(0, 6) * 100)``; it expires
  ``1 + U{0 .. 2 * horizon - 1}`` ms after it started, the horizon being the event time of
  ``n + 1666`` (the next 100 auctions) minus its own;
* a bid goes to a hot auction (``(last auction / 100) * 100``) with probability 1/2, else to
  one of the last ~100 auctions (or up to 10 ahead); its bidder is a hot bidder
  (``(last person / 100) * 100 + 1``) with probability 3/4, else a recent person; price as above;
  channel one of 4 hot channels (Google, Facebook, Baidu, Apple; probability 1/2) or one of
  10,000 ``channel-i`` with their URLs (90 % with ``&channel_id=`` and the bit-reversed ``i``);
* names, cities, states from the reference lists (city and state drawn independently); strings
  are 3..max-1 random letters with a 1/13 chance of a space per character, trimmed; ``extra``
  pads each event to about 200 (person), 500 (auction), 100 (bid) bytes with a slice of one
  1 MiB random string (length ``avg - size +- 20 %``).

Deviation, on purpose: the Flink generator adds ``FIRST_PERSON_ID`` to the bidder twice (a bug:
bidder ids then start at 2000 and match no person); here it is added once, as in Beam.
The random streams are numpy's (seeded, chunk by chunk), not Java's SplittableRandom: the same
rules and distributions, not the same values. Deterministic for a given seed.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

__all__ = [
    "AUCTION_SCHEMA",
    "BID_SCHEMA",
    "PERSON_SCHEMA",
    "NexmarkConfig",
    "NexmarkTables",
    "bounded_delay_order",
    "event_times",
    "generate",
    "iter_chunks",
    "write_parquet",
]

FIRST_PERSON_ID = 1000
FIRST_AUCTION_ID = 1000
FIRST_CATEGORY_ID = 10
NUM_CATEGORIES = 5
HOT_SELLER_RATIO = 100  # hot ids are multiples of this
HOT_AUCTION_RATIO = 100
HOT_BIDDER_RATIO = 100
PERSON_ID_LEAD = 10
AUCTION_ID_LEAD = 10
CHANNELS_NUMBER = 10_000
HOT_CHANNELS = ("Google", "Facebook", "Baidu", "Apple")
US_STATES = ("AZ", "CA", "ID", "OR", "WA", "WY")
US_CITIES = (
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
)
FIRST_NAMES = (
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
)
LAST_NAMES = (
    "Shultz",
    "Abrams",
    "Spencer",
    "White",
    "Bartels",
    "Walton",
    "Smith",
    "Jones",
    "Noris",
)
REUSABLE_EXTRA_BYTES = 1024 * 1024
MIN_STRING_LENGTH = 3
CHUNK_EVENTS = 200_000  # a multiple of 50: the random streams are seeded per chunk

_TS = pa.timestamp("ms")
PERSON_SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("name", pa.string()),
        ("emailAddress", pa.string()),
        ("creditCard", pa.string()),
        ("city", pa.string()),
        ("state", pa.string()),
        ("dateTime", _TS),
        ("extra", pa.string()),
    ]
)
AUCTION_SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("itemName", pa.string()),
        ("description", pa.string()),
        ("initialBid", pa.int64()),
        ("reserve", pa.int64()),
        ("dateTime", _TS),
        ("expires", _TS),
        ("seller", pa.int64()),
        ("category", pa.int64()),
        ("extra", pa.string()),
    ]
)
BID_SCHEMA = pa.schema(
    [
        ("auction", pa.int64()),
        ("bidder", pa.int64()),
        ("price", pa.int64()),
        ("channel", pa.string()),
        ("url", pa.string()),
        ("dateTime", _TS),
        ("extra", pa.string()),
    ]
)
SCHEMAS = {"person": PERSON_SCHEMA, "auction": AUCTION_SCHEMA, "bid": BID_SCHEMA}


@dataclass(frozen=True)
class NexmarkConfig:
    """What to generate. Defaults are the reference's (10,000 events/s, 1:3:46, ...)."""

    events: int
    rate_eps: float = 10_000.0
    seed: int = 0
    base_time_ms: int = 1_600_000_000_000  # 2020-09-13T12:26:40Z, a multiple of 10 s
    first_event_id: int = 0
    person_proportion: int = 1
    auction_proportion: int = 3
    bid_proportion: int = 46
    avg_person_bytes: int = 200
    avg_auction_bytes: int = 500
    avg_bid_bytes: int = 100
    hot_auction_ratio: int = 2
    hot_sellers_ratio: int = 4
    hot_bidders_ratio: int = 4
    num_in_flight_auctions: int = 100
    num_active_people: int = 1000
    total_proportion: int = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.events, int) or self.events < 0:
            msg = f"events must be an int >= 0, got {self.events!r}"
            raise ValueError(msg)
        if not (isinstance(self.rate_eps, int | float) and self.rate_eps > 0):
            msg = f"rate_eps (events per second of event time) must be > 0, got {self.rate_eps!r}"
            raise ValueError(msg)
        for name in ("person_proportion", "auction_proportion", "bid_proportion"):
            if getattr(self, name) < 1:
                msg = f"{name} must be >= 1, got {getattr(self, name)!r}"
                raise ValueError(msg)
        total = self.person_proportion + self.auction_proportion + self.bid_proportion
        object.__setattr__(self, "total_proportion", total)

    @property
    def inter_event_delay_us(self) -> float:
        return 1_000_000.0 / float(self.rate_eps)


@dataclass(frozen=True)
class NexmarkTables:
    """The three tables of one generated stream, each in event (= dateTime) order."""

    person: pa.Table
    auction: pa.Table
    bid: pa.Table

    @property
    def num_events(self) -> int:
        return self.person.num_rows + self.auction.num_rows + self.bid.num_rows

    def table(self, name: str) -> pa.Table:
        return getattr(self, name)


# --------------------------------------------------------------------------------------------
# id and time rules (pure functions of the event number)


def event_times(config: NexmarkConfig, n: np.ndarray) -> np.ndarray:
    """Event time in ms of event numbers ``n``: ``base + int(n * delay_us) // 1000``."""
    scaled = (np.asarray(n, dtype=np.float64) * config.inter_event_delay_us).astype(np.int64)
    return config.base_time_ms + scaled // 1000


def last_base0_person_id(config: NexmarkConfig, event_id: np.ndarray) -> np.ndarray:
    epoch, offset = np.divmod(event_id, config.total_proportion)
    offset = np.minimum(offset, config.person_proportion - 1)
    return epoch * config.person_proportion + offset


def last_base0_auction_id(config: NexmarkConfig, event_id: np.ndarray) -> np.ndarray:
    epoch, offset = np.divmod(event_id, config.total_proportion)
    pp, ap = config.person_proportion, config.auction_proportion
    before = offset < pp
    epoch = np.where(before, epoch - 1, epoch)
    offset = np.where(before | (offset >= pp + ap), ap - 1, offset - pp)
    return epoch * ap + offset


def _next_base0_person_id(
    config: NexmarkConfig, event_id: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    num_people = last_base0_person_id(config, event_id) + 1
    active = np.minimum(num_people, config.num_active_people)
    return num_people - active + _below(rng, active + PERSON_ID_LEAD)


def _next_base0_auction_id(
    config: NexmarkConfig, event_id: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    last = last_base0_auction_id(config, event_id)
    low = np.maximum(last - config.num_in_flight_auctions, 0)
    return low + _below(rng, last - low + 1 + AUCTION_ID_LEAD)


def _below(rng: np.random.Generator, bound: np.ndarray) -> np.ndarray:
    """One uniform integer in ``[0, bound[i])`` per element (numpy's per-element bounded
    ``integers`` is several times slower than scaling a uniform double)."""
    bound = np.asarray(bound, dtype=np.int64)
    out = (rng.random(bound.shape) * bound).astype(np.int64)
    return np.minimum(out, bound - 1)


def _next_price(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.floor(10.0 ** (rng.random(n) * 6.0) * 100.0 + 0.5).astype(np.int64)


# --------------------------------------------------------------------------------------------
# strings, vectorised


def _views_to_strings(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """``data[starts[i]:starts[i]+lengths[i]]`` as a string array, without a Python loop:
    Arrow string views into ``data`` (inline up to 12 bytes), cast to plain strings."""
    n = len(starts)
    starts = starts.astype(np.int64)
    lengths = lengths.astype(np.int64)
    padded = np.concatenate([data, np.zeros(16, dtype=np.uint8)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, 12)
    views = np.zeros((n, 16), dtype=np.uint8)
    views[:, 0:4] = lengths.astype("<i4").view(np.uint8).reshape(n, 4)
    short = lengths <= 12
    long_ = np.flatnonzero(~short)
    # long strings: 4-byte prefix, buffer 0, offset into it
    views[long_, 4:8] = windows[starts[long_], 0:4]
    views[long_, 12:16] = starts[long_].astype("<i4").view(np.uint8).reshape(-1, 4)
    short_ = np.flatnonzero(short)
    if len(short_):  # inline, zero padded
        inline = windows[starts[short_]]
        keep = np.arange(12)[None, :] < lengths[short_, None]
        views[short_, 4:16] = np.where(keep, inline, 0)
    arr = pa.Array.from_buffers(
        pa.string_view(), n, [None, pa.py_buffer(views), pa.py_buffer(data)]
    )
    return arr.cast(pa.string())


def _random_strings(
    rng: np.random.Generator, n: int, max_length: int, special: str = " "
) -> tuple[pa.Array, np.ndarray]:
    """The reference's ``nextString``: ``3 + U{0..max-4}`` characters, each ``special`` with
    probability 1/13 else a random lower-case letter, then trimmed of spaces. Returns the
    strings and their lengths."""
    lengths = MIN_STRING_LENGTH + rng.integers(0, max_length - MIN_STRING_LENGTH, n)
    width = int(lengths.max()) if n else 0
    draw = rng.integers(0, 26 * 13, (n, width), dtype=np.uint16)  # < 26: special (1/13)
    is_special = draw < 26
    chars = (ord("a") + draw % 26).astype(np.uint8)
    chars[is_special] = ord(special)
    pos = np.arange(width)[None, :]
    inside = pos < lengths[:, None]
    if special == " " and n:  # Java's trim() drops leading and trailing spaces
        solid = inside & ~is_special
        any_solid = solid.any(axis=1)
        first = np.argmax(solid, axis=1)
        last = width - 1 - np.argmax(solid[:, ::-1], axis=1)
        inside = any_solid[:, None] & (pos >= first[:, None]) & (pos <= last[:, None])
    out_len = inside.sum(axis=1)
    data = chars[inside]  # row-major: each string's characters in order
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(out_len, out=offsets[1:])
    arr = pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data))
    return arr, out_len


def _extra(
    rng: np.random.Generator, reusable: np.ndarray, current_size: np.ndarray, average: int
) -> tuple[pa.Array, np.ndarray]:
    """The reference's ``nextExtra``: pad to ``average`` bytes +- 20 %, a slice of one random
    string (empty when the event is already larger than ``average``)."""
    current_size = np.asarray(current_size, dtype=np.int64)
    desired = average - current_size
    delta = np.floor(desired * 0.2 + 0.5).astype(np.int64)
    minimum = desired - delta
    spread = _below(rng, np.maximum(2 * delta, 1))
    size = np.where(delta == 0, minimum, minimum + spread)
    size = np.where(current_size > average, 0, size)
    starts = _below(rng, len(reusable) - size)
    return _views_to_strings(reusable, starts, size), size


@lru_cache(maxsize=64)
def _arrow_strings(values: tuple[str, ...]) -> pa.Array:
    return pa.array(values, pa.string())


def _strings_of(values: tuple[str, ...], idx: np.ndarray) -> pa.Array:
    return _arrow_strings(tuple(values)).take(pa.array(idx))


@lru_cache(maxsize=8)
def _static_strings(seed: int) -> tuple[np.ndarray, pa.Array, pa.Array]:
    """Per seed: the 1 MiB random string extras are cut from, and the channel and URL arrays
    (4 hot channels first, then ``channel-0 .. channel-9999``)."""
    rng = np.random.default_rng([seed, 0x5EED])
    reusable = rng.integers(ord("a"), ord("z") + 1, REUSABLE_EXTRA_BYTES, dtype=np.uint8)
    count = len(HOT_CHANNELS) + CHANNELS_NUMBER
    parts = [_random_strings(rng, count, 5, "_")[0] for _ in range(3)]  # 3 or 4 characters
    base = pc.binary_join_element_wise(
        "https://www.nexmark.com/", parts[0], "/", parts[1], "/", parts[2], "/item.htm?query=1", ""
    )
    i = np.arange(CHANNELS_NUMBER, dtype=np.uint32)
    rev = np.zeros_like(i)
    for bit in range(32):  # Integer.reverse
        rev |= ((i >> bit) & 1) << (31 - bit)
    channel_id = np.abs(rev.view(np.int32))  # Math.abs: abs(MIN_VALUE) stays negative
    with_id = rng.integers(0, 10, CHANNELS_NUMBER) > 0
    suffix = pc.if_else(
        pa.array(with_id),
        pc.binary_join_element_wise("&channel_id=", pa.array(channel_id).cast(pa.string()), ""),
        "",
    )
    cached = pc.binary_join_element_wise(base[len(HOT_CHANNELS) :], suffix, "")
    urls = pa.concat_arrays([base[: len(HOT_CHANNELS)], cached])
    names = pc.binary_join_element_wise("channel-", pa.array(i).cast(pa.string()), "")
    channels = pa.concat_arrays([pa.array(HOT_CHANNELS, pa.string()), names])
    return reusable, channels, urls


# --------------------------------------------------------------------------------------------
# the three event kinds


def _persons(
    config: NexmarkConfig, n: np.ndarray, rng: np.random.Generator, reusable: np.ndarray
) -> pa.Table:
    k = len(n)
    event_id = config.first_event_id + n
    ids = last_base0_person_id(config, event_id) + FIRST_PERSON_ID
    first = rng.integers(0, len(FIRST_NAMES), k)
    last = rng.integers(0, len(LAST_NAMES), k)
    full_names = tuple(f"{a} {b}" for a in FIRST_NAMES for b in LAST_NAMES)
    name_len = np.array([len(s) for s in full_names])[first * len(LAST_NAMES) + last]
    names = _strings_of(full_names, first * len(LAST_NAMES) + last)
    user, user_len = _random_strings(rng, k, 7)
    host, host_len = _random_strings(rng, k, 5)
    emails = pc.binary_join_element_wise(user, "@", host, ".com", "")
    email_len = user_len + host_len + 5
    digits = rng.integers(0, 10_000, (k, 4))
    cards = pc.binary_join_element_wise(
        *[pc.utf8_lpad(pa.array(digits[:, j]).cast(pa.string()), 4, "0") for j in range(4)], " "
    )
    city_idx = rng.integers(0, len(US_CITIES), k)
    state_idx = rng.integers(0, len(US_STATES), k)
    city_len = np.array([len(c) for c in US_CITIES])[city_idx]
    size = 8 + name_len + email_len + 19 + city_len + 2
    extra, _ = _extra(rng, reusable, size, config.avg_person_bytes)
    return pa.Table.from_arrays(
        [
            pa.array(ids),
            names,
            emails,
            cards,
            _strings_of(US_CITIES, city_idx),
            _strings_of(US_STATES, state_idx),
            pa.array(event_times(config, n)).cast(_TS),
            extra,
        ],
        schema=PERSON_SCHEMA,
    )


def _auctions(
    config: NexmarkConfig, n: np.ndarray, rng: np.random.Generator, reusable: np.ndarray
) -> pa.Table:
    k = len(n)
    event_id = config.first_event_id + n
    ids = last_base0_auction_id(config, event_id) + FIRST_AUCTION_ID
    hot = rng.integers(0, config.hot_sellers_ratio, k) > 0
    hot_seller = (last_base0_person_id(config, event_id) // HOT_SELLER_RATIO) * HOT_SELLER_RATIO
    seller = np.where(hot, hot_seller, _next_base0_person_id(config, event_id, rng))
    seller = seller + FIRST_PERSON_ID
    category = FIRST_CATEGORY_ID + rng.integers(0, NUM_CATEGORIES, k)
    initial_bid = _next_price(rng, k)
    ts = event_times(config, n)
    in_flight_events = (config.num_in_flight_auctions * config.total_proportion) // (
        config.auction_proportion
    )
    horizon = event_times(config, n + in_flight_events) - ts
    expires = ts + 1 + _below(rng, np.maximum(horizon * 2, 1))
    name, name_len = _random_strings(rng, k, 20)
    desc, desc_len = _random_strings(rng, k, 100)
    reserve = initial_bid + _next_price(rng, k)
    extra, _ = _extra(rng, reusable, 8 + name_len + desc_len + 40, config.avg_auction_bytes)
    return pa.Table.from_arrays(
        [
            pa.array(ids),
            name,
            desc,
            pa.array(initial_bid),
            pa.array(reserve),
            pa.array(ts).cast(_TS),
            pa.array(expires).cast(_TS),
            pa.array(seller),
            pa.array(category),
            extra,
        ],
        schema=AUCTION_SCHEMA,
    )


def _bids(
    config: NexmarkConfig,
    n: np.ndarray,
    rng: np.random.Generator,
    statics: tuple[np.ndarray, pa.Array, pa.Array],
) -> pa.Table:
    reusable, channels, urls = statics
    k = len(n)
    event_id = config.first_event_id + n
    hot = rng.integers(0, config.hot_auction_ratio, k) > 0
    hot_auction = (last_base0_auction_id(config, event_id) // HOT_AUCTION_RATIO) * HOT_AUCTION_RATIO
    auction = np.where(hot, hot_auction, _next_base0_auction_id(config, event_id, rng))
    auction = auction + FIRST_AUCTION_ID
    hot = rng.integers(0, config.hot_bidders_ratio, k) > 0
    last_person = last_base0_person_id(config, event_id)
    hot_bidder = (last_person // HOT_BIDDER_RATIO) * HOT_BIDDER_RATIO + 1
    bidder = np.where(hot, hot_bidder, _next_base0_person_id(config, event_id, rng))
    bidder = bidder + FIRST_PERSON_ID
    price = _next_price(rng, k)
    hot_channel = rng.integers(0, 2, k) > 0
    channel_idx = np.where(
        hot_channel,
        rng.integers(0, len(HOT_CHANNELS), k),
        len(HOT_CHANNELS) + rng.integers(0, CHANNELS_NUMBER, k),
    )
    extra, _ = _extra(rng, reusable, np.full(k, 32), config.avg_bid_bytes)
    take = pa.array(channel_idx)
    return pa.Table.from_arrays(
        [
            pa.array(auction),
            pa.array(bidder),
            pa.array(price),
            channels.take(take),
            urls.take(take),
            pa.array(event_times(config, n)).cast(_TS),
            extra,
        ],
        schema=BID_SCHEMA,
    )


# --------------------------------------------------------------------------------------------
# public entry points


def _chunk(config: NexmarkConfig, index: int) -> NexmarkTables:
    statics = _static_strings(config.seed)
    start = index * CHUNK_EVENTS
    n = np.arange(start, min(start + CHUNK_EVENTS, config.events), dtype=np.int64)
    kind = (config.first_event_id + n) % config.total_proportion
    pp, ap = config.person_proportion, config.auction_proportion
    # one independent stream per chunk and kind: chunks can be made in any order
    rngs = [np.random.default_rng([config.seed, index, k]) for k in range(3)]
    return NexmarkTables(
        person=_persons(config, n[kind < pp], rngs[0], statics[0]),
        auction=_auctions(config, n[(kind >= pp) & (kind < pp + ap)], rngs[1], statics[0]),
        bid=_bids(config, n[kind >= pp + ap], rngs[2], statics),
    )


def iter_chunks(config: NexmarkConfig) -> Iterator[NexmarkTables]:
    """The stream in chunks of :data:`CHUNK_EVENTS` events, in event order."""
    for index in range(math.ceil(config.events / CHUNK_EVENTS)):
        yield _chunk(config, index)


def generate(config: NexmarkConfig) -> NexmarkTables:
    """The whole stream in memory."""
    parts = list(iter_chunks(config))
    if not parts:
        return NexmarkTables(*(SCHEMAS[t].empty_table() for t in ("person", "auction", "bid")))
    return NexmarkTables(
        *(
            pa.concat_tables([p.table(t) for p in parts]).combine_chunks()
            for t in ("person", "auction", "bid")
        )
    )


def write_parquet(
    config: NexmarkConfig, out_dir: str | os.PathLike[str], *, row_group_rows: int = 262_144
) -> dict[str, Path]:
    """Write ``person.parquet``, ``auction.parquet``, ``bid.parquet`` under ``out_dir`` chunk by
    chunk (bounded memory); files appear atomically (renamed when complete). Also q13's side
    input, ``side_input.csv`` (the same for every config)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = ("person", "auction", "bid")
    tmp = {t: out / f".{t}.parquet.tmp-{os.getpid()}" for t in names}
    writers = {t: pq.ParquetWriter(tmp[t], SCHEMAS[t]) for t in names}
    try:
        for chunk in iter_chunks(config):
            for t in names:
                writers[t].write_table(chunk.table(t), row_group_size=row_group_rows)
        for w in writers.values():
            w.close()
        paths = {}
        for t in names:
            paths[t] = out / f"{t}.parquet"
            os.replace(tmp[t], paths[t])
        from bench.nexmark.side_input import write_side_input  # q13's bounded side input

        paths["side_input"] = write_side_input(out / "side_input.csv")
        return paths
    except BaseException:
        for w in writers.values():
            with contextlib.suppress(Exception):  # already failing; remove the parts
                w.close()
        for p in tmp.values():
            p.unlink(missing_ok=True)
        raise


def bounded_delay_order(times_ms: np.ndarray, max_delay_ms: int, seed: int = 0) -> np.ndarray:
    """An arrival order with bounded out-of-orderness: each event arrives ``U{0..max_delay_ms}``
    ms after its event time; returns the permutation that sorts by arrival (stable). An event is
    then never preceded by one whose time is more than ``max_delay_ms`` above its own."""
    times_ms = np.asarray(times_ms, dtype=np.int64)
    if max_delay_ms <= 0:
        return np.argsort(times_ms, kind="stable")
    rng = np.random.default_rng([seed, 0xDE1A])
    arrival = times_ms + rng.integers(0, max_delay_ms + 1, len(times_ms))
    return np.argsort(arrival, kind="stable")
