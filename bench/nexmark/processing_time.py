"""q12: bids per bidder per 10 s processing-time window, and the checks of its result.

The reference (``nexmark-flink/src/main/resources/queries/q12.sql``)::

    CREATE VIEW B AS SELECT *, PROCTIME() as p_time FROM bid;
    SELECT bidder, count(*) as bid_count, window_start AS starttime, window_end AS endtime
    FROM TABLE(TUMBLE(TABLE B, DESCRIPTOR(p_time), INTERVAL '10' SECOND))
    GROUP BY bidder, window_start, window_end;

Here ``bid.key_by("bidder")`` into ``raystream.operators.proctime.tumbling(10_000, count())``.
Each result row carries its window (``starttime``, ``endtime``, ms since the epoch) and
``fired_at``, the processing time (ms) at which the window fired.

No oracle can know the processing times, so :func:`check` holds the result to what does not
depend on them, with DuckDB over the result and the ``bid`` table:

* ``totals``: per bidder, the sum of ``bid_count`` over its windows = its number of bids (exact);
* ``aligned``: every window is ``[k * 10 s, (k + 1) * 10 s)``;
* ``twice``: no (bidder, starttime) is emitted twice;
* ``early``: every window fired at or after its end by the processing clock, except the one
  window per bidder still open when the input ended (flushed then; it must be the bidder's
  latest window).

The exact per-window counts are checked where the processing clock can be injected, without
Ray (tests/unit/test_nexmark_q12.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import raystream.operators as ops
from raystream.operators import proctime

import raystream as rs
from bench.nexmark import oracle
from bench.nexmark.generator import NexmarkTables

__all__ = ["SIZE_MS", "build_q12", "check", "q12_finish", "q12_window"]

SIZE_MS = 10_000


def q12_window(clock: Callable[[], int] = proctime.wall_clock_ms) -> rs.Operator:
    """q12's keyed step: ``bid_count`` per 10 s window of ``clock`` (the wall clock; another
    one only in tests)."""
    return proctime.tumbling(SIZE_MS, ops.count(name="bid_count"), clock=clock, name="q12")


def build_q12(inputs: dict[str, rs.Stream]) -> rs.Stream:
    return inputs["bid"].key_by("bidder").apply(q12_window())


def q12_finish(cols: dict[str, Any]) -> dict[str, Any]:
    return {
        "bidder": cols["bidder"],
        "bid_count": cols["bid_count"],
        "starttime": cols["window_start"],
        "endtime": cols["window_end"],
        "fired_at": cols[proctime.FIRED_AT],
    }


_CHECKS = {
    # bidders whose windows do not add up to their bids (either side may miss a bidder)
    "totals": """
        SELECT count(*) FROM (SELECT bidder, count(*) AS n FROM bid GROUP BY bidder) AS b
        FULL OUTER JOIN (SELECT bidder, sum(bid_count) AS n FROM result GROUP BY bidder) AS r
        USING (bidder) WHERE b.n IS DISTINCT FROM r.n
    """,
    "aligned": f"""
        SELECT count(*) FROM result
        WHERE starttime % {SIZE_MS} <> 0 OR endtime - starttime <> {SIZE_MS}
    """,
    "twice": """
        SELECT count(*) FROM (
            SELECT bidder, starttime FROM result GROUP BY ALL HAVING count(*) > 1
        )
    """,
    # fired before its end and not the bidder's latest window (only that one may be flushed
    # early, when the input ends)
    "early": """
        SELECT count(*) FROM result AS r
        WHERE fired_at < endtime
          AND starttime < (SELECT max(starttime) FROM result AS l WHERE l.bidder = r.bidder)
    """,
}


def check(
    result: pa.Table, source: NexmarkTables | Mapping[str, pa.Table] | str | os.PathLike[str]
) -> dict[str, Any]:
    """q12's result rows (``bidder, bid_count, starttime, endtime, fired_at``) against the bids
    of ``source``: per check the number of rows (or bidders) that break it, ``ok`` when none
    does, and what the windows' timing looked like (``fire_delay_ms``: ``fired_at - endtime``
    of the windows fired by their timer, p50/p99/max; ``flushed_at_end``: windows fired when
    the input ended)."""
    bids = oracle.load_tables(source)["bid"].select(["bidder"])
    result = result.select(["bidder", "bid_count", "starttime", "endtime", "fired_at"])
    con = duckdb.connect()
    try:
        con.register("bid", bids)
        con.register("result", result)
        broken = {name: int(con.sql(sql).fetchall()[0][0]) for name, sql in _CHECKS.items()}
        bidders, total = con.sql(
            "SELECT count(DISTINCT bidder), coalesce(sum(bid_count), 0) FROM result"
        ).fetchall()[0]
    finally:
        con.close()
    delay = pc.subtract(result.column("fired_at"), result.column("endtime")).to_numpy()
    by_timer = delay[delay >= 0]
    out: dict[str, Any] = {
        "ok": not any(broken.values()),
        "broken": broken,
        "rows": result.num_rows,
        "bidders": int(bidders),
        "bids_counted": int(total),
        "bids": bids.num_rows,
        "flushed_at_end": int((delay < 0).sum()),
    }
    if len(by_timer):
        p50, p99 = np.percentile(by_timer, [50, 99])
        out["fire_delay_ms"] = {"p50": float(p50), "p99": float(p99), "max": int(by_timer.max())}
    return out
