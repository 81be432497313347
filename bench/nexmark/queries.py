"""NEXMark queries as raystream dataflows, built from the public operator API.

Input: one source per table (``person``, ``auction``, ``bid``), each replaying its Parquet file
in ``dateTime`` order. Output: a stream whose rows, gathered by the sink and passed through
:func:`final_result`, equal the DuckDB oracle's answer (:mod:`bench.nexmark.oracle`).

Append-only queries emit their result rows once. Updating queries emit a change for a key each
time its value changes, with a per-key ``_version`` kept in keyed state (it moves with the
key's state on a rescale), so the final value of a key is its row with the highest version,
whatever order the sink saw them in; q5 also deletes rows (``_kind`` ``-D``: an auction that is
no longer among a window's hottest). That is the changelog ``rs.sinks.parquet(dir,
mode="upsert", key=..., order_by="_version")`` writes and ``rs.read_upsert`` reads back.

Example::

    flow, spec = build_flow("q1", {"bid": rs.sources.parquet("data/bid.parquet")},
                            rs.sinks.collect())
    result = rs.run(flow, parallelism={spec.step: 2})
    final = final_result("q1", result.table(SINK))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import raystream.operators as ops
from raystream.operators import windows

import raystream as rs
from bench.nexmark import oracle
from bench.nexmark.daily import build_q15, build_q16, build_q17
from bench.nexmark.category_join import build_q20
from bench.nexmark.projections import decimal_milli as _decimal_milli
from bench.nexmark.projections import (
    q10_partition_columns,
    q14_price_range,
    q21_channel_id,
    q22_url_dirs,
)
from bench.nexmark.processing_time import build_q12, q12_finish
from bench.nexmark.ranking import build_q18, build_q19
from bench.nexmark.seller_average import seller_average
from bench.nexmark.side_input import build_q13
from bench.nexmark.columns import KIND, META, VERSION
from bench.nexmark.columns import carry_meta as _carry_meta
from bench.nexmark.columns import ms as _ms
from bench.nexmark.columns import ts as _ts
from bench.nexmark.columns import with_meta as _with_meta
from raystream.upsert import final_table, to_changes

__all__ = ["QUERIES", "SINK", "Query", "build_flow", "final_result", "result_rows"]

SINK = "result"


# --------------------------------------------------------------------------------------------
# q0-q2: stateless, vectorised over Arrow


def q0_passthrough(batch: pa.RecordBatch) -> pa.RecordBatch:
    """q0: every bid, its five columns (a pass-through to measure the system's overhead)."""
    return _with_meta(batch, {c: batch.column(c) for c in oracle.SCHEMA["q0"].names})


def q1_currency(batch: pa.RecordBatch) -> pa.RecordBatch:
    """q1: the price in euro, ``0.908 * price`` as DECIMAL(23, 3) (and in milli-euro, int64):
    ``price * 908`` thousandths (an int64 overflow raises rather than wraps)."""
    milli = pc.multiply_checked(batch.column("price"), 908)
    return _with_meta(
        batch,
        {
            "auction": batch.column("auction"),
            "bidder": batch.column("bidder"),
            "price": _decimal_milli(milli),
            "price_milli": milli,
            "dateTime": batch.column("dateTime"),
            "extra": batch.column("extra"),
        },
    )


def q2_selection(batch: pa.RecordBatch) -> pa.RecordBatch | None:
    """q2: auction and price of the bids whose auction id is a multiple of 123."""
    auction = batch.column("auction").to_numpy(zero_copy_only=False)
    mask = pa.array(auction % 123 == 0)
    if not pc.any(mask).as_py():
        return None
    kept = batch.filter(mask)
    return _with_meta(kept, {"auction": kept.column("auction"), "price": kept.column("price")})


# --------------------------------------------------------------------------------------------
# small vectorised pieces


def _select(
    columns: tuple[str, ...], name: str, where: Callable[[pa.RecordBatch], Any] | None = None
) -> rs.Operator:
    """A map_batches step keeping ``columns`` (and the runtime's), optionally the rows where
    ``where(batch)`` (a boolean array) holds."""

    def select(batch: pa.RecordBatch) -> pa.RecordBatch | None:
        if where is not None:
            mask = where(batch)
            if not pc.any(mask).as_py():
                return None
            batch = batch.filter(mask)
        return _with_meta(batch, {c: batch.column(c) for c in columns})

    return rs.map_batches(select, name=name)


def _columnwise(
    finish: Callable[[dict[str, Any]], dict[str, Any]],
) -> Callable[[pa.Table], pa.Table]:
    """A finishing function over column dicts, for tables and batches alike."""

    def apply(table: pa.Table) -> pa.Table:
        cols = {n: table.column(n) for n in table.schema.names}
        out = finish(cols)
        for passed in (VERSION, KIND, *META):  # the changelog's and the runtime's columns
            if passed in cols:
                out[passed] = cols[passed]
        return pa.table(out)

    return apply


# --------------------------------------------------------------------------------------------
# q3: a regular join of category-10 auctions with their sellers in OR, ID, CA


_SELLER_STATE = {
    "person": rs.ValueState(object),  # (name, city, state) of the seller
    "waiting": rs.ValueState(object),  # ids of auctions that came before their seller
}


@rs.keyed_batches(name="seller_join", state=_SELLER_STATE)
def seller_join(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch | None:
    """A regular inner join, keyed by the seller: input 0 auctions (id), input 1 persons (name,
    city, state; one per id). Every auction is emitted once, when both it and its seller are
    here; auctions that come first wait in state for their seller."""
    keys, offsets, rec = batch.keys, batch.offsets, batch.records
    person = state.person.get(keys)
    out_idx: list[int] = []  # the key of every output row
    out_ids: list[int] = []
    if batch.input == 0:  # auctions
        ids = rec.column("id").to_numpy()
        known = [i for i, p in enumerate(person) if p is not None]
        for i in known:
            mine = ids[offsets[i] : offsets[i + 1]].tolist()
            out_ids.extend(mine)
            out_idx.extend([i] * len(mine))
        unknown = np.array([i for i, p in enumerate(person) if p is None], np.int64)
        if len(unknown):
            waiting = state.waiting.get(keys.take(unknown))
            stored = []
            for j, i in enumerate(unknown.tolist()):
                mine = ids[offsets[i] : offsets[i + 1]]
                stored.append(mine if waiting[j] is None else np.concatenate([waiting[j], mine]))
            state.waiting.put(keys.take(unknown), stored)
    else:  # persons: the last row of each key
        last = offsets[1:] - 1
        cols = [rec.column(c).to_pylist() for c in ("name", "city", "state")]
        for i, r in enumerate(last.tolist()):
            person[i] = (cols[0][r], cols[1][r], cols[2][r])
        state.person.put(keys, person)
        waiting = state.waiting.get(keys)
        settled = [i for i, w in enumerate(waiting) if w is not None]
        for i in settled:
            out_ids.extend(waiting[i].tolist())
            out_idx.extend([i] * len(waiting[i]))
        if settled:
            state.waiting.delete(keys.take(np.array(settled, np.int64)))
    if not out_ids:
        return None
    who = [person[i] for i in out_idx]
    idx = np.array(out_idx, np.int64)
    out = {
        "name": pa.array([p[0] for p in who], pa.string()),
        "city": pa.array([p[1] for p in who], pa.string()),
        "state": pa.array([p[2] for p in who], pa.string()),
        "id": pa.array(out_ids, pa.int64()),
    }
    _carry_meta(batch, idx, out)
    return pa.RecordBatch.from_pydict(out)


def _q3(inputs: dict[str, rs.Stream]) -> rs.Stream:
    auctions = inputs["auction"].apply(
        _select(("id", "seller"), "q3_auctions", lambda b: pc.equal(b.column("category"), 10))
    )
    persons = inputs["person"].apply(
        _select(
            ("id", "name", "city", "state"),
            "q3_persons",
            lambda b: pc.is_in(b.column("state"), pa.array(["OR", "ID", "CA"])),
        )
    )
    return auctions.key_by("seller").connect(persons.key_by("id")).apply(seller_join, name="q3")


# --------------------------------------------------------------------------------------------
# q9 (and q4's first step): the winning bid of every auction, an updating join


_WINNER_STATE = {
    "auction": rs.ValueState(object),  # (seller, category, start_ms, expires_ms)
    "best": rs.ValueState(object),  # (price, t_ms, bidder) of the winning bid so far
    "pending": rs.ValueState(object),  # bids that came before their auction: int64 (n, 3)
    "version": rs.ValueState(int, default=0),
}
_NO_BIDS = np.empty((0, 3), np.int64)


def _best_row(bids: np.ndarray) -> tuple[int, int, int] | None:
    """The winner of ``bids`` (rows price, t, bidder): highest price, then earliest, then the
    smallest bidder."""
    if not len(bids):
        return None
    i = np.lexsort((bids[:, 2], bids[:, 1], -bids[:, 0]))[0]
    return int(bids[i, 0]), int(bids[i, 1]), int(bids[i, 2])


def _better(new: tuple[int, int, int], old: tuple[int, int, int] | None) -> bool:
    return old is None or (-new[0], new[1], new[2]) < (-old[0], old[1], old[2])


@rs.keyed_batches(name="winner", state=_WINNER_STATE)
def auction_winner(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch | None:
    """Input 0: auctions (id, seller, category, start, expires); input 1: bids (auction, price,
    t, bidder). Per auction, the bid with the highest price (earliest, then smallest bidder)
    among the bids whose time lies in ``[start, expires]``; a new row whenever it changes, with
    the previous winning price (null for the first) and the key's ``_version``."""
    keys = batch.keys
    n = len(keys)
    auctions = state.auction.get(keys)
    best = state.best.get(keys)
    version = state.version.get(keys)
    rec = batch.records
    offsets = batch.offsets
    changed: list[int] = []
    previous: list[int | None] = []
    if batch.input == 0:  # auctions: remember them, settle the bids that waited
        seller = rec.column("seller").to_numpy()
        category = rec.column("category").to_numpy()
        start = rec.column("start").to_numpy()
        expires = rec.column("expires").to_numpy()
        pending = state.pending.get(keys)
        clear = []
        for i in range(n):
            last = int(offsets[i + 1]) - 1  # an auction id comes once; keep the last if not
            auctions[i] = (
                int(seller[last]),
                int(category[last]),
                int(start[last]),
                int(expires[last]),
            )
            waiting = pending[i]
            if waiting is None:
                continue
            clear.append(i)
            inside = waiting[(waiting[:, 1] >= auctions[i][2]) & (waiting[:, 1] <= auctions[i][3])]
            cand = _best_row(inside)
            if cand is not None and _better(cand, best[i]):
                previous.append(None if best[i] is None else best[i][0])
                best[i] = cand
                changed.append(i)
        state.auction.put(keys, auctions)
        if clear:
            state.pending.delete(keys.take(np.array(clear)))
    else:  # bids
        price = rec.column("price").to_numpy()
        t = rec.column("t").to_numpy()
        bidder = rec.column("bidder").to_numpy()
        rows = np.stack([price, t, bidder], axis=1)
        key_index = batch.key_index()
        known = np.fromiter((a is not None for a in auctions), bool, n)
        if not known.all():  # bids ahead of their auction wait for it
            wait = np.flatnonzero(~known)
            pending = state.pending.get(keys.take(wait))
            stored = []
            for j, i in enumerate(wait.tolist()):
                mine = rows[offsets[i] : offsets[i + 1]]
                stored.append(mine if pending[j] is None else np.concatenate([pending[j], mine]))
            state.pending.put(keys.take(wait), stored)
        if known.any():
            lo = np.array([a[2] if a is not None else 0 for a in auctions], np.int64)
            hi = np.array([a[3] if a is not None else -1 for a in auctions], np.int64)
            inside = (t >= lo[key_index]) & (t <= hi[key_index])
            if inside.any():
                idx = np.flatnonzero(inside)
                # per key, the winner among its bids in the window: sort, first of each key
                order = idx[np.lexsort((bidder[idx], t[idx], -price[idx], key_index[idx]))]
                ki = key_index[order]
                first = order[np.r_[True, ki[1:] != ki[:-1]]]
                for r in first.tolist():
                    i = int(key_index[r])
                    cand = (int(price[r]), int(t[r]), int(bidder[r]))
                    if _better(cand, best[i]):
                        previous.append(None if best[i] is None else best[i][0])
                        best[i] = cand
                        changed.append(i)
    if not changed:
        return None
    idx = np.array(changed, np.int64)
    version = np.asarray(version, np.int64).copy()
    version[idx] += 1
    sub = keys.take(idx)
    state.best.put(sub, [best[i] for i in changed])
    state.version.put(sub, version[idx])
    won = [best[i] for i in changed]
    auc = [auctions[i] for i in changed]
    out = {
        batch.key_column: keys.keys.take(pa.array(idx)),
        "seller": pa.array([a[0] for a in auc], pa.int64()),
        "category": pa.array([a[1] for a in auc], pa.int64()),
        "bidder": pa.array([w[2] for w in won], pa.int64()),
        "price": pa.array([w[0] for w in won], pa.int64()),
        "bid_dateTime": _ts([w[1] for w in won]),
        "prev_price": pa.array(previous, pa.int64()),
        VERSION: pa.array(version[idx], pa.int64()),
    }
    _carry_meta(batch, idx, out)
    return pa.RecordBatch.from_pydict(out)


def _winners(inputs: dict[str, rs.Stream], prefix: str, parallel_name: str) -> rs.Stream:
    def auction_cols(batch: pa.RecordBatch) -> pa.RecordBatch:
        return _with_meta(
            batch,
            {
                "id": batch.column("id"),
                "seller": batch.column("seller"),
                "category": batch.column("category"),
                "start": pa.array(_ms(batch.column("dateTime"))),
                "expires": pa.array(_ms(batch.column("expires"))),
            },
        )

    def bid_cols(batch: pa.RecordBatch) -> pa.RecordBatch:
        return _with_meta(
            batch,
            {
                "auction": batch.column("auction"),
                "price": batch.column("price"),
                "t": pa.array(_ms(batch.column("dateTime"))),
                "bidder": batch.column("bidder"),
            },
        )

    auctions = inputs["auction"].apply(rs.map_batches(auction_cols, name=f"{prefix}_auctions"))
    bids = inputs["bid"].apply(rs.map_batches(bid_cols, name=f"{prefix}_bids"))
    return (
        auctions.key_by("id")
        .connect(bids.key_by("auction"))
        .apply(auction_winner, name=parallel_name)
    )


def _q9(inputs: dict[str, rs.Stream]) -> rs.Stream:
    return _winners(inputs, "q9", "q9")


# --------------------------------------------------------------------------------------------
# q4: the average winning price per category (updating)


@rs.keyed_batches(
    name="category_average",
    state={
        "sum": rs.ValueState(int, default=0),
        "count": rs.ValueState(int, default=0),
        "version": rs.ValueState(int, default=0),
    },
)
def category_average(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch:
    """Per category, the integer average (truncated) of its auctions' current winning prices.
    A winner's update replaces its previous price in the sum (``prev_price``); the first one
    of an auction also counts it. Additions commute, so the order updates come in (also across
    a rescale of the step before) does not change the final value."""
    price = batch.records.column("price").to_numpy()
    prev = batch.records.column("prev_price")
    first = prev.is_null().to_numpy(zero_copy_only=False)
    delta = price - np.where(first, 0, prev.fill_null(0).to_numpy())
    starts = batch.offsets[:-1]
    total = state.sum.get(batch.keys) + np.add.reduceat(delta, starts)
    count = state.count.get(batch.keys) + np.add.reduceat(first.astype(np.int64), starts)
    version = state.version.get(batch.keys) + 1
    state.sum.put(batch.keys, total)
    state.count.put(batch.keys, count)
    state.version.put(batch.keys, version)
    return batch.output({"id": batch.keys.keys, "final": total // count, VERSION: version})


def _q4(inputs: dict[str, rs.Stream]) -> rs.Stream:
    winners = _winners(inputs, "q4", "q4")
    return winners.key_by("category").apply(category_average, name="q4_average")


# --------------------------------------------------------------------------------------------
# q6: per seller, the average winning price of an auction and the 10 before it (updating)


def _q6(inputs: dict[str, rs.Stream]) -> rs.Stream:
    winners = _winners(inputs, "q6", "q6")
    return winners.key_by("seller").apply(seller_average, name="q6_average")


# --------------------------------------------------------------------------------------------
# q5: the hottest auctions of every hopping window (10 s, every 2 s)


@rs.keyed_batches(
    name="hot_items",
    state={"top": rs.ValueState(object), "version": rs.ValueState(int, default=0)},
)
def hot_items(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch | None:
    """Keyed by hop window start: the highest bid count among the window's auctions and every
    auction that has it (ties kept). A window's counts come once each (the window step emits an
    auction's count when the window closes), so this is the join of AuctionBids with MaxBids of
    the query, updated as counts come, without depending on when they come.

    Output: changes to the table keyed by (``hop_start``, ``auction``), all changes of a window
    with the window's next ``_version``: ``+I`` for an auction that joins the top, ``-D`` for
    those a higher count pushed out."""
    top = state.top.get(batch.keys)
    num = batch.records.column("num").to_numpy()
    auction = batch.records.column("auction").to_numpy()
    offsets = batch.offsets
    changed: list[int] = []
    rows: list[tuple[int, int, int, str]] = []  # key index, auction, num, kind
    for i in range(len(top)):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        best = int(num[lo:hi].max())
        ties = auction[lo:hi][num[lo:hi] == best].tolist()
        old = top[i]
        if old is None or best > old[0]:
            if old is not None:
                rows.extend((i, a, old[0], "-D") for a in old[1])
            top[i] = (best, ties)
        elif best == old[0]:
            top[i] = (best, old[1] + ties)
        else:
            continue
        rows.extend((i, a, best, "+I") for a in ties)
        changed.append(i)
    if not changed:
        return None
    idx = np.array(changed, np.int64)
    sub = batch.keys.take(idx)
    version = state.version.get(sub) + 1
    state.top.put(sub, [top[i] for i in changed])
    state.version.put(sub, version)
    at = np.zeros(len(top), np.int64)
    at[idx] = version
    key_index = np.array([r[0] for r in rows], np.int64)
    out = {
        "hop_start": batch.keys.keys.take(pa.array(key_index)),
        "auction": pa.array([r[1] for r in rows], pa.int64()),
        "num": pa.array([r[2] for r in rows], pa.int64()),
        KIND: pa.array([r[3] for r in rows], pa.string()),
        VERSION: pa.array(at[key_index], pa.int64()),
    }
    _carry_meta(batch, key_index, out)
    return pa.RecordBatch.from_pydict(out)


def _q5(inputs: dict[str, rs.Stream]) -> rs.Stream:
    counts = (
        inputs["bid"]
        .key_by("auction")
        .apply(windows.sliding(10_000, 2_000, ops.count(name="num"), name="q5"))
    )  # auction, window_start, window_end, num; event_time = window_end - 1
    # keyed by the window's start straight away (no renaming step between: one hop less);
    # hot_items names the key hop_start in its output: hop_start, auction, num, _kind, _version
    return counts.key_by("window_start").apply(hot_items, name="q5_hot")


def _q5_finish(cols: dict[str, Any]) -> dict[str, Any]:
    return {
        "auction": cols["auction"],
        "num": cols["num"],
        "window_start": cols["hop_start"],
        "window_end": pc.add(cols["hop_start"], 10_000),
    }


# --------------------------------------------------------------------------------------------
# q7: the highest bids of every 10 s window


_Q7_COLS = ("auction", "price", "bidder", "t", "ingest_ts")  # int64 columns kept per row


def _rows_of(rec: pa.RecordBatch, idx: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Rows ``idx`` of ``rec`` as an int64 (n, 5) array of :data:`_Q7_COLS` and the extras."""
    cols = [rec.column(c).to_numpy(zero_copy_only=False)[idx] for c in _Q7_COLS]
    return np.stack(cols, axis=1).astype(np.int64), rec.column("extra").take(
        pa.array(idx)
    ).to_pylist()


def _q7_fire(timers: Any, state: Any) -> pa.RecordBatch | None:
    """A window's bids with its top price (its own, and those exactly at its end)."""
    values = state.get(timers.keyset)
    parts, extras, ends = [], [], []
    for w, v in zip(timers.keys.to_pylist(), values, strict=True):
        if v is None or v[0] is None:
            continue
        top, own, own_extra, edge, edge_extra = v
        hit = edge[:, 1] == top
        rows = np.concatenate([own, edge[hit]])
        parts.append(rows)
        extras.extend(own_extra + [e for e, h in zip(edge_extra, hit.tolist(), strict=True) if h])
        ends.append(np.full(len(rows), w + 10_000, np.int64))
    state.delete(timers.keyset)
    if not parts:
        return None
    rows = np.concatenate(parts)
    end = np.concatenate(ends)
    return pa.RecordBatch.from_pydict(
        {
            "auction": pa.array(rows[:, 0]),
            "price": pa.array(rows[:, 1]),
            "bidder": pa.array(rows[:, 2]),
            "dateTime": _ts(rows[:, 3]),
            "extra": pa.array(extras, pa.string()),
            "window_end": pa.array(end),
            "event_time": pa.array(end - 1),
            "ingest_ts": pa.array(rows[:, 4]),
        }
    )


@rs.keyed_batches(name="window_top_bids", state=rs.ValueState(object), on_timer=_q7_fire)
def window_top_bids(batch: rs.KeyedBatch, state: Any) -> None:
    """Keyed by window start ``w``: the top price of the bids in ``[w, w + 10 s)`` and the bids
    that have it, plus the bids at exactly ``w + 10 s`` (``edge``) that may match it (the
    query's BETWEEN includes the window's end). Emitted when the watermark passes the end."""
    rec = batch.records
    price = rec.column("price").to_numpy()
    edge = rec.column("edge").to_numpy(zero_copy_only=False)
    values = state.get(batch.keys)
    offsets = batch.offsets
    for i in range(len(values)):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        top, own, own_extra, old_edge, edge_extra = values[i] or (
            None,
            np.empty((0, 5), np.int64),
            [],
            np.empty((0, 5), np.int64),
            [],
        )
        mine = np.arange(lo, hi)
        is_own = ~edge[lo:hi]
        if is_own.any():
            new_top = int(price[mine[is_own]].max())
            if top is None or new_top > top:
                top, own, own_extra = new_top, own[:0], []
            if new_top == top:
                r, e = _rows_of(rec, mine[is_own][price[mine[is_own]] == top])
                own, own_extra = np.concatenate([own, r]), own_extra + e
        if (~is_own).any():
            r, e = _rows_of(rec, mine[~is_own])
            old_edge, edge_extra = np.concatenate([old_edge, r]), edge_extra + e
        if top is not None and len(old_edge):  # an edge bid below the top can never match
            keep = old_edge[:, 1] >= top
            old_edge = old_edge[keep]
            edge_extra = [x for x, k in zip(edge_extra, keep.tolist(), strict=True) if k]
        values[i] = (top, own, own_extra, old_edge, edge_extra)
    state.put(batch.keys, values)
    batch.timers.register(batch.keys.keys.to_numpy() + 10_000)  # all bids <= the end are in
    return None


def _q7_windows(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Each bid keyed by its window start ``w``; a bid exactly on a boundary also goes to the
    window that ends there (``edge``)."""
    t = _ms(batch.column("dateTime"))
    w = t - t % 10_000
    on_edge = np.flatnonzero(t % 10_000 == 0)
    idx = np.concatenate([np.arange(len(t)), on_edge])
    window = np.concatenate([w, w[on_edge] - 10_000])
    edge = np.zeros(len(idx), bool)
    edge[len(t) :] = True
    take = pa.array(idx)
    cols = {
        "w": pa.array(window),
        "edge": pa.array(edge),
        "t": pa.array(t[idx]),
        **{c: batch.column(c).take(take) for c in ("auction", "price", "bidder", "extra")},
    }
    for c in META:
        if c in batch.schema.names:
            cols[c] = batch.column(c).take(take)
    return pa.RecordBatch.from_pydict(cols)


def _q7(inputs: dict[str, rs.Stream]) -> rs.Stream:
    return (
        inputs["bid"]
        .apply(rs.map_batches(_q7_windows, name="q7_windows"))
        .key_by("w")
        .apply(window_top_bids, name="q7")
    )


# --------------------------------------------------------------------------------------------
# q8: new persons who opened an auction in the same 10 s window


_Q8_GRACE_MS = 60_000

# A key's q8 state is one bytes value: u32 n, then n records (w int64, tag int32), then the UTF-8
# names of its persons one after the other. tag: the byte length of a person's name, or
# _SOLD (a window the key sold in) or _NULL_NAME (a person without a name).
_Q8_REC = np.dtype([("w", "<i8"), ("tag", "<i4")])
_SOLD = -1
_NULL_NAME = -2


@dataclass
class _Entries:
    """Packed q8 entries of many keys as flat arrays: ``key`` (index into the batch's keys),
    ``w``, ``tag``, and ``name`` (a string array, null for windows and nameless persons)."""

    key: np.ndarray
    w: np.ndarray
    tag: np.ndarray
    name: pa.Array

    def take(self, idx: np.ndarray) -> _Entries:
        return _Entries(self.key[idx], self.w[idx], self.tag[idx], self.name.take(pa.array(idx)))

    @staticmethod
    def concat(parts: list[_Entries]) -> _Entries:
        return _Entries(
            np.concatenate([p.key for p in parts]),
            np.concatenate([p.w for p in parts]),
            np.concatenate([p.tag for p in parts]),
            pa.concat_arrays([p.name for p in parts]),
        )


def _gather(buf: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """``width`` bytes at each of ``starts`` of ``buf``, as an (n, width) uint8 array."""
    return buf[starts[:, None] + np.arange(width)]


def _runs(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For runs of ``lengths``: the run of every item and its position within its run."""
    run = np.repeat(np.arange(len(lengths)), lengths)
    first = np.cumsum(lengths) - lengths
    return run, np.arange(int(lengths.sum())) - first[run]


def _q8_unpack(values: list[bytes | None]) -> _Entries:
    """The entries of every key (``values[i]``: key ``i``'s stored bytes, None: nothing)."""
    present = np.flatnonzero(np.fromiter(map(bool, values), bool, len(values)))
    blobs = [values[i] for i in present.tolist()]
    if not blobs:
        e = np.empty(0, np.int64)
        return _Entries(e, e, np.empty(0, np.int32), pa.nulls(0, pa.string()))
    lens = np.fromiter(map(len, blobs), np.int64, len(blobs))
    buf = np.frombuffer(b"".join(blobs), np.uint8)
    starts = np.cumsum(lens) - lens
    count = _gather(buf, starts, 4).copy().view("<u4").ravel().astype(np.int64)
    blob, j = _runs(count)
    rec_at = starts[blob] + 4 + _Q8_REC.itemsize * j
    recs = _gather(buf, rec_at, _Q8_REC.itemsize).copy().view(_Q8_REC).ravel()
    tag = recs["tag"].astype(np.int32)
    size = np.maximum(tag, 0).astype(np.int64)
    # a name's first byte: after its blob's records, behind the names before it in the blob
    before = np.cumsum(size) - size
    first_of_blob = np.cumsum(count) - count
    base = before[np.minimum(first_of_blob, max(len(before) - 1, 0))]
    name_at = starts[blob] + 4 + _Q8_REC.itemsize * count[blob] + before - base[blob]
    item, pos = _runs(size)
    data = buf[name_at[item] + pos] if len(item) else np.empty(0, np.uint8)
    offsets = np.zeros(len(tag) + 1, np.int32)
    np.cumsum(size, out=offsets[1:])
    valid = tag >= 0
    names = pa.Array.from_buffers(
        pa.string(),
        len(tag),
        [pa.py_buffer(np.packbits(valid, bitorder="little")), pa.py_buffer(offsets),
         pa.py_buffer(data)],
    )  # fmt: skip
    return _Entries(present[blob], recs["w"].astype(np.int64), tag, names)


def _q8_pack(entries: _Entries, n_keys: int) -> list[bytes | None]:
    """Per key its entries as one bytes value (None: it has none). ``entries`` sorted by key."""
    out: list[bytes | None] = [None] * n_keys
    if not len(entries.key):
        return out
    key = entries.key
    bounds = np.flatnonzero(np.r_[True, key[1:] != key[:-1], True])
    count = np.diff(bounds)
    names = entries.name
    name_off = np.frombuffer(names.buffers()[1], np.int32)[
        names.offset : names.offset + len(key) + 1
    ]
    size = np.diff(name_off).astype(np.int64)
    size[entries.tag < 0] = 0
    name_bytes = np.add.reduceat(size, bounds[:-1])
    blob_len = 4 + _Q8_REC.itemsize * count + name_bytes
    blob_off = np.zeros(len(count) + 1, np.int64)
    np.cumsum(blob_len, out=blob_off[1:])
    buf = np.empty(int(blob_off[-1]), np.uint8)
    starts = blob_off[:-1]
    buf[starts[:, None] + np.arange(4)] = count.astype("<u4").view(np.uint8).reshape(-1, 4)
    recs = np.empty(len(key), _Q8_REC)
    recs["w"] = entries.w
    recs["tag"] = entries.tag
    blob, j = _runs(count)
    rec_at = starts[blob] + 4 + _Q8_REC.itemsize * j
    buf[rec_at[:, None] + np.arange(_Q8_REC.itemsize)] = recs.view(np.uint8).reshape(
        -1, _Q8_REC.itemsize
    )
    if int(name_bytes.sum()):
        before = np.cumsum(size) - size
        name_at = starts[blob] + 4 + _Q8_REC.itemsize * count[blob] + before - before[bounds[blob]]
        item, pos = _runs(size)
        src = np.frombuffer(names.buffers()[2], np.uint8)
        buf[name_at[item] + pos] = src[name_off[item] + pos]
    packed = pa.Array.from_buffers(
        pa.large_binary(), len(count), [None, pa.py_buffer(blob_off), pa.py_buffer(buf)]
    )
    for k, v in zip(key[bounds[:-1]].tolist(), packed.to_pylist(), strict=True):
        out[k] = v
    return out


def _pairs_in(key: np.ndarray, w: np.ndarray, set_key: np.ndarray, set_w: np.ndarray) -> np.ndarray:
    """Whether each (key, w) is among the pairs (set_key, set_w)."""
    if not len(set_key) or not len(key):
        return np.zeros(len(key), bool)
    _, rank = np.unique(np.concatenate([w, set_w]), return_inverse=True)
    span = int(rank.max()) + 1
    code = np.concatenate([key, set_key]).astype(np.int64) * span + rank
    return np.isin(code[: len(key)], code[len(key) :])


@rs.keyed_batches(name="new_sellers", state=rs.ValueState(bytes))
def new_sellers(batch: rs.KeyedBatch, state: Any) -> pa.RecordBatch | None:
    """Keyed by person id = seller: input 0 persons (name, w), input 1 auctions (w), ``w`` the
    10 s window start. Emits (id, name, w) once, as soon as a person and an auction of theirs
    are seen in the same window. State per id: the (w, name) pairs of its persons and the windows
    it sold in; a pair is emitted when it comes into a window already sold in, or a window is
    first sold in that has it (so each pair once). A window's entries are dropped once the
    watermark passed its end by :data:`_Q8_GRACE_MS` (nothing of it can come any more).
    Vectorised over the batch: the keys' entries are unpacked into flat arrays, matched with
    numpy, and packed again (one bytes value per key, no pickling)."""
    keys, rec = batch.keys, batch.records
    values = state.get(keys)
    stored = _q8_unpack(values)
    # windows starting at or before this are complete (with a grace period: records a new
    # owner buffered during a rescale can be processed after its watermark passed them)
    closed = batch.watermark - 10_000 - _Q8_GRACE_MS
    live = stored.w > closed
    if not live.all():
        stored = stored.take(np.flatnonzero(live))
    ki = batch.key_index()
    w = rec.column("w").to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    sold = stored.tag == _SOLD
    if batch.input == 0:  # persons: new (w, name) pairs of a key, matched with its windows
        name = rec.column("name")
        if not pa.types.is_string(name.type):
            name = name.cast(pa.string())
        person = np.flatnonzero(~sold)
        every = pa.concat_arrays([stored.name.take(pa.array(person)), name])
        code = (
            pc.dictionary_encode(every, null_encoding="encode")
            .indices.to_numpy(zero_copy_only=False)
            .astype(np.int64)
        )
        all_k = np.concatenate([stored.key[person], ki])
        all_w = np.concatenate([stored.w[person], w])
        order = np.lexsort((np.arange(len(all_k)), code, all_w, all_k))
        s_k, s_w, s_c = all_k[order], all_w[order], code[order]
        first = np.r_[True, (s_k[1:] != s_k[:-1]) | (s_w[1:] != s_w[:-1]) | (s_c[1:] != s_c[:-1])]
        fresh_sorted = first & (order >= len(person))  # a new pair, not stored, first of the batch
        fresh = np.sort(order[fresh_sorted]) - len(person)  # rows of the batch
        size = pc.binary_length(name).fill_null(_NULL_NAME).to_numpy(zero_copy_only=False)
        added = _Entries(
            ki[fresh], w[fresh], size[fresh].astype(np.int32), name.take(pa.array(fresh))
        )
        hit = _pairs_in(ki[fresh], w[fresh], stored.key[sold], stored.w[sold])
        out_rows = fresh[hit]
        out_idx, out_w, out_name = ki[out_rows], w[out_rows], name.take(pa.array(out_rows))
    else:  # auctions: windows first sold in, matched with the key's persons
        pair = np.lexsort((w, ki))
        s_k, s_w = ki[pair], w[pair]
        first = pair[np.r_[True, (s_k[1:] != s_k[:-1]) | (s_w[1:] != s_w[:-1])]]
        new = first[~_pairs_in(ki[first], w[first], stored.key[sold], stored.w[sold])]
        added = _Entries(
            ki[new], w[new], np.full(len(new), _SOLD, np.int32), pa.nulls(len(new), pa.string())
        )
        person = np.flatnonzero(~sold)
        hit = person[_pairs_in(stored.key[person], stored.w[person], ki[new], w[new])]
        out_idx, out_w = stored.key[hit], stored.w[hit]
        out_name = stored.name.take(pa.array(hit))
    table = _Entries.concat([stored, added])
    table = table.take(np.argsort(table.key, kind="stable"))
    packed = _q8_pack(table, len(keys))
    present = np.fromiter((v is not None for v in packed), bool, len(packed))
    if present.any():
        state.put(keys.take(np.flatnonzero(present)), [v for v in packed if v is not None])
    had = np.fromiter(map(bool, values), bool, len(values)) & ~present
    if had.any():
        state.delete(keys.take(np.flatnonzero(had)))
    if not len(out_idx):
        return None
    idx = np.asarray(out_idx, np.int64)
    out = {
        "id": keys.keys.take(pa.array(idx)),
        "name": out_name,
        "stime": pa.array(out_w, pa.int64()),
    }
    _carry_meta(batch, idx, out)
    return pa.RecordBatch.from_pydict(out)


def _window_of(columns: tuple[str, ...], name: str) -> rs.Operator:
    def window(batch: pa.RecordBatch) -> pa.RecordBatch:
        t = _ms(batch.column("dateTime"))
        cols = {c: batch.column(c) for c in columns}
        cols["w"] = pa.array(t - t % 10_000)
        return _with_meta(batch, cols)

    return rs.map_batches(window, name=name)


def _q8(inputs: dict[str, rs.Stream]) -> rs.Stream:
    persons = inputs["person"].apply(_window_of(("id", "name"), "q8_persons"))
    sellers = inputs["auction"].apply(_window_of(("seller",), "q8_auctions"))
    return persons.key_by("id").connect(sellers.key_by("seller")).apply(new_sellers, name="q8")


# --------------------------------------------------------------------------------------------
# q11: bids per bidder session (10 s of inactivity ends one)

# The session operator merges records *less than* gap apart, into [first, last + gap). Flink
# merges session windows [t, t + 10 s) that touch, i.e. bids at most 10 s apart: with integer
# ms that is "less than 10,001 ms apart", and the session's end is then window_end - 1.
_Q11_GAP_MS = 10_001


def _q11(inputs: dict[str, rs.Stream]) -> rs.Stream:
    return (
        inputs["bid"]
        .key_by("bidder")
        .apply(windows.session(_Q11_GAP_MS, ops.count(name="bid_count"), name="q11"))
    )


def _q11_finish(cols: dict[str, Any]) -> dict[str, Any]:
    return {
        "bidder": cols["bidder"],
        "bid_count": cols["bid_count"],
        "starttime": cols["window_start"],
        "endtime": pc.subtract(cols["window_end"], _Q11_GAP_MS - 10_000),
    }


# --------------------------------------------------------------------------------------------
# the registry


@dataclass(frozen=True)
class Query:
    """One query: the tables it reads, how to build it, the step that ``--parallelism`` (and a
    rescale, when keyed) applies to, whether its result is updating (then its rows are changes
    ordered per ``key`` of the result by ``_version``, with a ``_kind`` column if ``deletes``),
    ``columns``: the columns it reads of each table (its sources project the others away),
    ``finish``: sink rows -> the result's columns (row by row), for windowed queries
    ``window_end``: result rows -> the end (ms, exclusive) of the window each belongs to, and
    ``side_inputs``: files the query reads beside its tables (given as paths in ``sources``)."""

    name: str
    tables: tuple[str, ...]
    build: Callable[[dict[str, rs.Stream]], rs.Stream]
    step: str
    keyed: bool = False
    updating: bool = False
    windowed: bool = False
    key: tuple[str, ...] = ()
    deletes: bool = False
    columns: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (table, columns read); () all
    finish: Callable[[pa.Table], pa.Table] | None = None
    window_end: Callable[[pa.Table], pa.Array] | None = None
    side_inputs: tuple[str, ...] = ()  # files read by a step (q13): ``sources[name]``, a path
    partition_by: tuple[str, ...] = ()  # q10: the result's folder columns in a Parquet sink
    # q10: when a folder is committed (Flink's sink.partition-commit.*)
    partition_commit: Any = None
    # q12: windows of the wall clock; its result is checked by bench.nexmark.processing_time
    # (invariants and per-bidder totals), not compared with oracle rows
    processing_time: bool = False


def _stateless(
    name: str, fn: Callable[[pa.RecordBatch], Any]
) -> Callable[[dict[str, rs.Stream]], rs.Stream]:
    def build(inputs: dict[str, rs.Stream]) -> rs.Stream:
        return inputs["bid"].apply(rs.map_batches(fn, name=name))

    return build


def _column(name: str, plus_ms: int = 0) -> Callable[[pa.Table], Any]:
    def end(table: pa.Table) -> Any:
        return pc.add(table.column(name), plus_ms) if plus_ms else table.column(name)

    return end


# q0 and q1 read the bid columns they output (channel and url are ~40 % of its bytes)
_Q0_COLS = ("auction", "bidder", "price", "dateTime", "extra")

QUERIES: dict[str, Query] = {
    "q0": Query(
        "q0", ("bid",), _stateless("q0", q0_passthrough), "q0", columns=(("bid", _Q0_COLS),)
    ),
    "q1": Query("q1", ("bid",), _stateless("q1", q1_currency), "q1", columns=(("bid", _Q0_COLS),)),
    "q2": Query(
        "q2",
        ("bid",),
        _stateless("q2", q2_selection),
        "q2",
        columns=(("bid", ("auction", "price", "dateTime")),),
    ),
    "q3": Query("q3", ("person", "auction"), _q3, "q3", keyed=True),
    "q4": Query("q4", ("auction", "bid"), _q4, "q4", keyed=True, updating=True, key=("id",)),
    "q5": Query(
        "q5",
        ("bid",),
        _q5,
        "q5",
        keyed=True,
        updating=True,
        windowed=True,
        key=("window_start", "auction"),
        deletes=True,
        columns=(("bid", ("auction", "dateTime")),),
        finish=_columnwise(_q5_finish),
        window_end=_column("window_end"),
    ),
    "q6": Query("q6", ("auction", "bid"), _q6, "q6", keyed=True, updating=True, key=("id",)),
    "q7": Query(
        "q7", ("bid",), _q7, "q7", keyed=True, windowed=True, window_end=_column("window_end")
    ),
    "q8": Query(
        "q8",
        ("person", "auction"),
        _q8,
        "q8",
        keyed=True,
        windowed=True,
        columns=(("person", ("id", "name", "dateTime")), ("auction", ("seller", "dateTime"))),
        window_end=_column("stime", 10_000),
    ),
    "q9": Query("q9", ("auction", "bid"), _q9, "q9", keyed=True, updating=True, key=("id",)),
    "q10": Query(
        "q10",
        ("bid",),
        _stateless("q10", q10_partition_columns),
        "q10",
        columns=(("bid", _Q0_COLS),),
        partition_by=("dt", "hm"),
        # Flink's q10: trigger partition-time, pattern '$dt $hm:00', delay 1 min, success-file
        partition_commit=rs.sinks.partition_commit(
            "partition-time", time_pattern="$dt $hm:00", delay_ms=60_000
        ),
    ),
    "q11": Query(
        "q11",
        ("bid",),
        _q11,
        "q11",
        keyed=True,
        windowed=True,
        columns=(("bid", ("bidder", "dateTime")),),
        finish=_columnwise(_q11_finish),
        # [starttime, endtime] closes when the watermark reaches endtime = last bid + 10 s
        window_end=_column("endtime", 1),
    ),
    "q12": Query(
        "q12",
        ("bid",),
        build_q12,
        "q12",
        keyed=True,
        columns=(("bid", ("bidder", "dateTime")),),
        finish=_columnwise(q12_finish),
        processing_time=True,
    ),
    "q13": Query(
        "q13",
        ("bid",),
        build_q13,
        "q13",
        columns=(("bid", ("auction", "bidder", "price", "dateTime")),),
        side_inputs=("side_input",),
    ),
    "q14": Query(
        "q14",
        ("bid",),
        _stateless("q14", q14_price_range),
        "q14",
        columns=(("bid", ("auction", "bidder", "price", "dateTime", "extra")),),
    ),
    "q15": Query(
        "q15",
        ("bid",),
        build_q15,
        "q15",
        keyed=True,
        updating=True,
        key=("day",),
        columns=(("bid", ("auction", "bidder", "price", "dateTime")),),
    ),
    "q16": Query(
        "q16",
        ("bid",),
        build_q16,
        "q16",
        keyed=True,
        updating=True,
        key=("channel", "day"),
        columns=(("bid", ("auction", "bidder", "price", "channel", "dateTime")),),
    ),
    "q17": Query(
        "q17",
        ("bid",),
        build_q17,
        "q17",
        keyed=True,
        updating=True,
        key=("auction", "day"),
        columns=(("bid", ("auction", "price", "dateTime")),),
    ),
    "q18": Query(
        "q18",
        ("bid",),
        build_q18,
        "q18",
        keyed=True,
        updating=True,
        key=("bidder", "auction"),
    ),
    "q19": Query(
        "q19",
        ("bid",),
        build_q19,
        "q19",
        keyed=True,
        updating=True,
        key=("auction", "rank_number"),
    ),
    "q20": Query("q20", ("auction", "bid"), build_q20, "q20", keyed=True),
    "q21": Query(
        "q21",
        ("bid",),
        _stateless("q21", q21_channel_id),
        "q21",
        columns=(("bid", ("auction", "bidder", "price", "channel", "url", "dateTime")),),
    ),
    "q22": Query(
        "q22",
        ("bid",),
        _stateless("q22", q22_url_dirs),
        "q22",
        columns=(("bid", ("auction", "bidder", "price", "channel", "url", "dateTime")),),
    ),
}


def build_flow(
    query: str,
    sources: Mapping[str, Any],
    sink: Any,
    *,
    max_out_of_orderness_ms: int = 0,
    num_key_groups: int = 128,
    name: str | None = None,
    extra_sinks: Mapping[str, Any] | None = None,
) -> tuple[rs.Dataflow, Query]:
    """The dataflow of ``query`` over ``sources`` (table name -> raystream source; a side
    input's name -> its file's path), ending in
    ``sink`` (step name :data:`SINK`) and in each of ``extra_sinks`` (step name -> sink). Each
    source's event time is its ``dateTime`` column, with watermarks ``max_out_of_orderness_ms``
    behind the largest seen."""
    if query not in QUERIES:
        msg = f"query {query!r} is not built as a raystream dataflow; built: {sorted(QUERIES)}"
        raise KeyError(msg)
    spec = QUERIES[query]
    missing = [t for t in (*spec.tables, *spec.side_inputs) if t not in sources]
    if missing:
        msg = (
            f"{query} reads tables {list(spec.tables)} and side inputs "
            f"{list(spec.side_inputs)}; nothing given for {missing}"
        )
        raise rs.ConfigError(msg)
    flow = rs.Dataflow(name or f"nexmark-{query}", num_key_groups=num_key_groups)
    inputs: dict[str, Any] = {name: sources[name] for name in spec.side_inputs}  # paths
    for table in spec.tables:
        inputs[table] = flow.source(
            sources[table],
            name=table,
            event_time="dateTime",
            max_out_of_orderness_ms=max_out_of_orderness_ms,
        )
    out = spec.build(inputs)
    out.sink(sink, name=SINK)
    for step, extra in (extra_sinks or {}).items():
        out.sink(extra, name=step)
    return flow, spec


def result_rows(query: str, table: pa.Table) -> pa.Table:
    """Sink rows as the result's columns (``finish`` applied; the changelog's ``_version`` and
    ``_kind`` and the runtime's columns kept)."""
    finish = QUERIES[query].finish
    return finish(table) if finish is not None else table


def final_result(query: str, table: pa.Table) -> pa.Table:
    """The final result from what the sink received: for an updating query the changes reduced
    to the final table (per key the change of the highest ``_version``, unless a delete: the
    reduction ``rs.read_upsert`` applies to an upsert sink's output); canonical (columns, types,
    order) as the oracle's."""
    spec = QUERIES[query]
    table = result_rows(query, table)
    if spec.updating and table.num_rows:
        kind = KIND if spec.deletes else None
        changes, _ = to_changes(table, spec.key, order_by=VERSION, kind_column=kind)
        table = final_table(changes, spec.key)
    return oracle.canonical(query, table)
