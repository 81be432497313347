"""NEXMark queries as raystream dataflows, built from the public operator API.

Input: one source per table (``person``, ``auction``, ``bid``), each replaying its Parquet file
in ``dateTime`` order. Output: a stream whose rows, gathered by the sink and passed through
:func:`final_result`, equal the DuckDB oracle's answer (:mod:`bench.nexmark.oracle`).

Append-only queries emit their result rows once. Updating queries emit a new row for a key each
time its value changes, with a per-key ``_version`` kept in keyed state (it moves with the
key's state on a rescale), so the final value of a key is its row with the highest version,
whatever order the sink saw them in.

Example::

    flow, spec = build_flow("q1", {"bid": rs.sources.parquet("data/bid.parquet")},
                            rs.sinks.collect())
    result = rs.run(flow, parallelism={spec.step: 2})
    final = final_result("q1", result.table(SINK))
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

import raystream as rs
from bench.nexmark import oracle

__all__ = ["QUERIES", "SINK", "Query", "build_flow", "final_result"]

SINK = "result"
VERSION = "_version"
META = ("event_time", "ingest_ts")


def _with_meta(batch: pa.RecordBatch, columns: dict[str, pa.Array]) -> pa.RecordBatch:
    """``columns`` plus the runtime's event_time / ingest_ts columns of ``batch`` (same rows)."""
    out = dict(columns)
    for col in META:
        if col in batch.schema.names:
            out[col] = batch.column(col)
    return pa.RecordBatch.from_pydict(out)


# --------------------------------------------------------------------------------------------
# q0-q2: stateless, vectorised over Arrow


def q0_passthrough(batch: pa.RecordBatch) -> pa.RecordBatch:
    """q0: every bid, its five columns (a pass-through to measure the system's overhead)."""
    return _with_meta(batch, {c: batch.column(c) for c in oracle.SCHEMA["q0"].names})


_EURO = pa.scalar(Decimal("0.908"), pa.decimal128(4, 3))
_PRICE_TYPE = pa.decimal128(23, 3)


def q1_currency(batch: pa.RecordBatch) -> pa.RecordBatch:
    """q1: the price in euro, ``0.908 * price`` as DECIMAL(23, 3) (and in milli-euro, int64)."""
    price = batch.column("price")
    euro = pc.multiply(price.cast(pa.decimal128(19, 0)), _EURO).cast(_PRICE_TYPE)
    return _with_meta(
        batch,
        {
            "auction": batch.column("auction"),
            "bidder": batch.column("bidder"),
            "price": euro,
            "price_milli": pc.multiply(price, 908),
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
# the registry


@dataclass(frozen=True)
class Query:
    """One query: the tables it reads, how to build it, the step that ``--parallelism`` (and a
    rescale, when keyed) applies to, and whether its result is updating."""

    name: str
    tables: tuple[str, ...]
    build: Callable[[dict[str, rs.Stream]], rs.Stream]
    step: str
    keyed: bool = False
    updating: bool = False
    windowed: bool = False
    key: tuple[str, ...] = ()  # updating queries: the columns that identify a result row


def _stateless(
    name: str, fn: Callable[[pa.RecordBatch], Any]
) -> Callable[[dict[str, rs.Stream]], rs.Stream]:
    def build(inputs: dict[str, rs.Stream]) -> rs.Stream:
        return inputs["bid"].apply(rs.map_batches(fn, name=name))

    return build


QUERIES: dict[str, Query] = {
    "q0": Query("q0", ("bid",), _stateless("q0", q0_passthrough), "q0"),
    "q1": Query("q1", ("bid",), _stateless("q1", q1_currency), "q1"),
    "q2": Query("q2", ("bid",), _stateless("q2", q2_selection), "q2"),
}


def _supports_event_time() -> bool:
    return "event_time" in inspect.signature(rs.Dataflow.source).parameters


def build_flow(
    query: str,
    sources: Mapping[str, Any],
    sink: Any,
    *,
    max_out_of_orderness_ms: int = 0,
    num_key_groups: int = 128,
    name: str | None = None,
) -> tuple[rs.Dataflow, Query]:
    """The dataflow of ``query`` over ``sources`` (table name -> raystream source), ending in
    ``sink`` (step name :data:`SINK`). With a runtime that knows event time, each source's
    event time is its ``dateTime`` column, with watermarks ``max_out_of_orderness_ms`` behind."""
    if query not in QUERIES:
        msg = f"query {query!r} is not built as a raystream dataflow; built: {sorted(QUERIES)}"
        raise KeyError(msg)
    spec = QUERIES[query]
    missing = [t for t in spec.tables if t not in sources]
    if missing:
        msg = f"{query} reads tables {list(spec.tables)}; no source given for {missing}"
        raise rs.ConfigError(msg)
    flow = rs.Dataflow(name or f"nexmark-{query}", num_key_groups=num_key_groups)
    inputs: dict[str, rs.Stream] = {}
    for table in spec.tables:
        kwargs: dict[str, Any] = {"name": table}
        if _supports_event_time():
            kwargs.update(event_time="dateTime", max_out_of_orderness_ms=max_out_of_orderness_ms)
        inputs[table] = flow.source(sources[table], **kwargs)
    spec.build(inputs).sink(sink, name=SINK)
    return flow, spec


def final_result(query: str, table: pa.Table) -> pa.Table:
    """The final result from what the sink received: for an updating query the row of the
    highest ``_version`` per key; canonical (columns, types, order) as the oracle's."""
    spec = QUERIES[query]
    if spec.updating and table.num_rows:
        table = latest_by_version(table, spec.key)
    return oracle.canonical(query, table)


def latest_by_version(table: pa.Table, key: tuple[str, ...]) -> pa.Table:
    """Per ``key``, the row with the highest ``_version`` (a key's versions are unique)."""
    newest = table.group_by(list(key)).aggregate([(VERSION, "max")])
    newest = newest.rename_columns([*key, VERSION])
    return table.join(newest, keys=[*key, VERSION], join_type="inner")
