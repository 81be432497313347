"""Inputs and DuckDB oracles for the window and join integration tests.

Events carry an int64 ms time column ``ts`` that runs forward with a bounded jitter, so with
``max_out_of_orderness_ms >= JITTER_MS`` no record is late; the oracles are SQL over the same
rows (DuckDB, independent of raystream and of numpy's group-by)."""

from __future__ import annotations

from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

JITTER_MS = 400
OUT_OF_ORDERNESS_MS = JITTER_MS


def events(n: int, keys: int, seed: int, *, start_ms: int = 1_700_000_000_000) -> pa.Table:
    """``n`` events: key ``k`` (str), time ``ts`` (ms, out of order by < JITTER_MS), value
    ``x``, unique ``id``; the clock advances about 5 ms per event."""
    rng = np.random.default_rng(seed)
    clock = start_ms + np.cumsum(rng.integers(0, 10, n))
    ts = clock - rng.integers(0, JITTER_MS, n)
    return pa.table(
        {
            "k": [f"user-{v}" for v in rng.integers(0, keys, n).tolist()],
            "ts": ts.astype(np.int64),
            "x": rng.integers(-50, 500, n).astype(np.int64),
            "id": np.arange(n, dtype=np.int64) + seed * 10_000_000,
        }
    )


def sql(query: str, **tables: pa.Table) -> list[tuple[Any, ...]]:
    con = duckdb.connect()
    try:
        for name, t in tables.items():
            con.register(name, t)
        return [tuple(r) for r in con.execute(query).fetchall()]
    finally:
        con.close()


def tumbling_oracle(t: pa.Table, size: int) -> list[tuple[Any, ...]]:
    return sorted(
        sql(
            f"""SELECT k, (ts // {size}) * {size} AS ws, count(*), sum(x), max(x)
                FROM ev GROUP BY k, ws""",
            ev=t,
        )
    )


def sliding_oracle(t: pa.Table, size: int, slide: int) -> list[tuple[Any, ...]]:
    per = -(-size // slide)
    return sorted(
        sql(
            f"""WITH w AS (
                  SELECT k, x, ts, (ts // {slide}) * {slide} - j * {slide} AS ws
                  FROM ev CROSS JOIN range({per}) AS r(j))
                SELECT k, ws, count(*), sum(x), max(x) FROM w
                WHERE ws <= ts AND ts < ws + {size} GROUP BY k, ws""",
            ev=t,
        )
    )


def session_oracle(t: pa.Table, gap: int) -> list[tuple[Any, ...]]:
    return sorted(
        sql(
            f"""WITH o AS (
                  SELECT k, ts, x, CASE WHEN ts - lag(ts) OVER (PARTITION BY k ORDER BY ts, id)
                    < {gap} THEN 0 ELSE 1 END AS opens FROM ev),
                s AS (SELECT *, sum(opens) OVER (PARTITION BY k ORDER BY ts
                        ROWS UNBOUNDED PRECEDING) AS sid FROM o)
                SELECT k, min(ts), max(ts) + {gap}, count(*), sum(x), max(x) FROM s
                GROUP BY k, sid""",
            ev=t,
        )
    )


def window_rows(out: pa.Table, *cols: str) -> list[tuple[Any, ...]]:
    return sorted(zip(*[out[c].to_pylist() for c in cols], strict=True))


def interval_oracle(a: pa.Table, b: pa.Table, lower: int, upper: int) -> list[tuple[Any, ...]]:
    return sorted(
        sql(
            f"""SELECT a.id, b.id FROM a JOIN b ON a.k = b.k
                AND b.ts BETWEEN a.ts + {lower} AND a.ts + {upper}""",
            a=a,
            b=b,
        )
    )


def window_join_oracle(a: pa.Table, b: pa.Table, size: int) -> list[tuple[Any, ...]]:
    return sorted(
        sql(
            f"""SELECT a.id, b.id, (a.ts // {size}) * {size} FROM a JOIN b ON a.k = b.k
                AND a.ts // {size} = b.ts // {size}""",
            a=a,
            b=b,
        )
    )


def equi_join_oracle(a: pa.Table, b: pa.Table) -> list[tuple[Any, ...]]:
    return sorted(sql("SELECT a.id, b.id FROM a JOIN b ON a.k = b.k", a=a, b=b))
