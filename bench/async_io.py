"""Calling a service from a stream: a blocking map against an ``async def`` one (async I/O).

Run it from the repository root::

    python -m bench.async_io --name async_io

Every case is one job on a local Ray: an unthrottled generator (``--keys`` keys) feeding one
instance of a step ``enrich`` that asks a service for each record's price, into a collecting sink.
The service answers after ``--latency-ms`` (a remote lookup's round trip):

- ``sleep``: the call is simulated in the instance's own process, ``time.sleep`` in a synchronous
  ``@rs.map`` (a blocking client) or ``await asyncio.sleep`` in an ``async def`` one (an async
  client) at ``concurrency`` 1, 8, 64 and 256;
- ``ray actor``: a real Ray actor holds the prices and awaits the latency in each call; the step
  calls it per record with ``ray.get`` (synchronous map), per record with ``await`` (async map,
  concurrency 64), or once per part of a batch with ``await`` (async ``@rs.map_batches``,
  concurrency 4, the part's keys in one call).

The source emits batches of ``--batch-rows`` records. Each output row carries when its call was
answered (``done_ns``; a ``map_batches`` part's rows share one). Figure: **events/s** = the
records answered after the first answer, divided by the time from the first answer to the last
(the job's start-up and shutdown left out). Each case is checked: the sink holds every
generated record once, with the price the service has for its key. Writes
``bench/results/NAME.json``.
"""

from __future__ import annotations

import asyncio
import json
import platform
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
import pyarrow as pa
import ray

import raystream as rs
from bench._report import imported_from, write_atomically

__all__ = ["main"]

SERVICE = "raystream-bench-price-service"


def prices_of(keys: np.ndarray) -> np.ndarray:
    """The service's price for each key (what every case's output is checked against)."""
    return 1 + (keys * 37 % 101) / 4


@ray.remote(num_cpus=0)
class PriceService:
    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s

    async def price(self, key: int) -> float:
        await asyncio.sleep(self.latency_s)
        return float(prices_of(np.asarray(key)))

    async def prices(self, keys: np.ndarray) -> np.ndarray:
        await asyncio.sleep(self.latency_s)
        return prices_of(keys)


def done() -> dict[str, int]:
    """When a call was answered (the figure's clock)."""
    return {"done_ns": time.time_ns()}


def _service() -> Any:
    return ray.get_actor(SERVICE, namespace="raystream")


def enrich_op(case: str, concurrency: int, latency_s: float) -> rs.Operator:
    """The step of ``case``: what a user writes for each way of calling the service."""
    handles: dict[str, Any] = {}

    def service() -> Any:
        if "s" not in handles:
            handles["s"] = _service()
        return handles["s"]

    if case == "sleep-sync":

        @rs.map(name="enrich")
        def blocking(r: dict) -> dict:
            time.sleep(latency_s)
            return {"key": r["key"], "seq": r["seq"], "price": float(prices_of(r["key"])), **done()}

        return blocking
    if case == "sleep-async":

        @rs.map(name="enrich", concurrency=concurrency)
        async def awaiting(r: dict) -> dict:
            await asyncio.sleep(latency_s)
            return {"key": r["key"], "seq": r["seq"], "price": float(prices_of(r["key"])), **done()}

        return awaiting
    if case == "actor-sync":

        @rs.map(name="enrich")
        def ray_get(r: dict) -> dict:
            price = ray.get(service().price.remote(r["key"]))
            return {"key": r["key"], "seq": r["seq"], "price": price, **done()}

        return ray_get
    if case == "actor-async":

        @rs.map(name="enrich", concurrency=concurrency)
        async def ray_await(r: dict) -> dict:
            price = await service().price.remote(r["key"])
            return {"key": r["key"], "seq": r["seq"], "price": price, **done()}

        return ray_await
    if case == "actor-batches":

        @rs.map_batches(name="enrich", concurrency=concurrency)
        async def ray_await_batch(batch: pa.RecordBatch) -> pa.RecordBatch:
            keys = batch.column("key").to_numpy()
            price = await service().prices.remote(keys)
            n = batch.num_rows
            return pa.record_batch(
                {
                    "key": batch.column("key"),
                    "seq": batch.column("seq"),
                    "price": price,
                    "done_ns": np.full(n, time.time_ns(), np.int64),
                }
            )

        return ray_await_batch
    msg = f"unknown case {case!r}"
    raise click.BadParameter(msg)


CASES: list[tuple[str, int, int]] = [  # (case, concurrency, events at 2 ms: ~3-10 s each)
    ("sleep-sync", 1, 2_000),
    ("sleep-async", 1, 2_000),
    ("sleep-async", 8, 16_000),
    ("sleep-async", 64, 100_000),
    ("sleep-async", 256, 150_000),
    ("actor-sync", 1, 2_000),
    ("actor-async", 64, 10_000),
    ("actor-batches", 4, 300_000),
]


def run_case(
    case: str, concurrency: int, events: int, keys: int, latency_s: float, batch_rows: int
) -> dict[str, Any]:
    gen = rs.sources.generator(events=events, keys=keys, seed=3)
    flow = rs.Dataflow(f"bench-async-{case}-{concurrency}")
    flow.source(gen).apply(enrich_op(case, concurrency, latency_s)).sink(
        rs.sinks.collect(), name="out"
    )
    t0 = time.perf_counter()
    result = rs.run(
        flow,
        timeout_s=600,
        batch_rows=batch_rows,
        source_batch_rows=batch_rows,  # the step takes many batches, not one large one
        standby_instances=0,
    )
    wall = time.perf_counter() - t0
    out = result.table("out")
    stream = gen.generate_all()
    want = prices_of(stream.column("key").to_numpy())
    got = out.sort_by([("key", "ascending"), ("seq", "ascending")])
    order = np.lexsort((stream.column("seq").to_numpy(), stream.column("key").to_numpy()))
    exact = out.num_rows == events and bool(
        np.array_equal(got.column("key").to_numpy(), stream.column("key").to_numpy()[order])
        and np.array_equal(got.column("seq").to_numpy(), stream.column("seq").to_numpy()[order])
        and np.allclose(got.column("price").to_numpy(), want[order])
    )
    done_ns = np.sort(out.column("done_ns").to_numpy())
    span_s = (done_ns[-1] - done_ns[0]) / 1e9
    after_first = int(np.count_nonzero(done_ns > done_ns[0]))
    return {
        "case": case,
        "concurrency": concurrency,
        "events": events,
        "exact": exact,
        "events_per_s": round(after_first / span_s, 1) if span_s else None,
        "span_s": round(span_s, 3),
        "job_wall_s": round(wall, 2),
        "ideal_events_per_s": round(concurrency / latency_s, 1)
        if case.startswith("sleep")
        else None,
    }


@click.command()
@click.option("--name", default="async_io", help="bench/results/NAME.json")
@click.option("--latency-ms", default=2.0, help="the service's answer time")
@click.option("--keys", default=1_000)
@click.option("--batch-rows", default=500, help="rows per source batch (RuntimeConfig.batch_rows)")
@click.option("--only", default=None, help="run only this case (e.g. sleep-async)")
def main(name: str, latency_ms: float, keys: int, batch_rows: int, only: str | None) -> None:
    latency_s = latency_ms / 1000
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="raystream")
    service = PriceService.options(name=SERVICE, namespace="raystream").remote(latency_s)
    ray.get(service.price.remote(1))
    runs = []
    try:
        for case, concurrency, events in CASES:
            if only and case != only:
                continue
            r = run_case(case, concurrency, events, keys, latency_s, batch_rows)
            print(json.dumps(r))
            runs.append(r)
    finally:
        ray.kill(service)
        ray.shutdown()
    report = {
        "benchmark": "async_io",
        "figure": (
            "events/s: records answered after the first answer, divided by the time from the "
            "first answer to the last (one instance of the enrich step)"
        ),
        "latency_ms": latency_ms,
        "keys": keys,
        "batch_rows": batch_rows,
        "machine": {"cpus": 2, "python": platform.python_version()},
        "raystream": imported_from(rs),
        "runs": runs,
    }
    path = Path("bench/results") / f"{name}.json"
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(report, indent=2) + "\n"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
