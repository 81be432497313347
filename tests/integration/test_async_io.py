"""An ``async def`` map calling a real Ray actor (a lookup service) from inside the job, with
checkpoints, and its instance killed while calls are in flight: after the recovery the calls
for the records after the checkpoint are made again, and the published output holds every
record once, each with the price the service has for its key (DuckDB joins the generator's
stream with the price table)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import ray

import raystream as rs
from raystream.runtime.actors import NAMESPACE, instance_actor_name
from tests.integration._helpers import NOT_SCALED_OUT, running_count_carrying, wait_checkpoints

KEYS = 500
EVENTS = 6_000  # a Ray actor call per record: ~1k calls/s beside the job on two cores
SERVICE = "raystream-test-price-service"


@ray.remote(num_cpus=0)
class PriceService:
    """What the job enriches its records with: a price per key, after a short await."""

    def __init__(self, prices: dict[int, float]) -> None:
        self.prices = prices
        self.calls = 0

    async def price(self, key: int) -> float:
        self.calls += 1
        await asyncio.sleep(0.0005)
        return self.prices[key]

    async def calls_made(self) -> int:
        return self.calls


def _prices() -> dict[int, float]:
    return {k: round(1 + (k * 37 % 101) / 4, 2) for k in range(KEYS)}


def _enrich() -> Any:
    handles: dict[str, Any] = {}  # each instance's process looks the service up once

    @rs.map(concurrency=64, timeout_s=30)
    async def enrich(r: dict) -> dict:
        if "service" not in handles:
            handles["service"] = ray.get_actor(SERVICE, namespace=NAMESPACE)
        price = await handles["service"].price.remote(r["key"])
        return {"key": r["key"], "seq": r["seq"], "price": price}

    return enrich


def test_an_async_map_calling_a_ray_actor_recovers_exactly_once(tmp_path: Path) -> None:
    prices = _prices()
    service = PriceService.options(name=SERVICE, namespace=NAMESPACE).remote(prices)
    out = tmp_path / "out"
    gen = rs.sources.generator(events=EVENTS, keys=KEYS, zipf=1.1, seed=5, rate_eps=2_000)
    flow = rs.Dataflow("async-io-recovery", num_key_groups=64, sub_groups=8)
    (
        flow.source(gen)
        .apply(_enrich(), name="enrich")
        .options(chain=False)  # its own actor, killed below
        .key_by("key")
        .apply(running_count_carrying("price"), name="count")
        .sink(rs.sinks.parquet(str(out)), name="out")
    )
    job = rs.start(
        flow,
        parallelism={"count": 2},
        checkpoint_interval_s=0.5,
        checkpoint_dir=str(tmp_path / "chk"),
        restart_delay_s=0.2,
        batch_rows=2_000,
        linger_ms=10.0,
        **NOT_SCALED_OUT,
    )
    try:
        wait_checkpoints(job, 2)
        ray.kill(ray.get_actor(instance_actor_name(job.name, "enrich", 0), namespace=NAMESPACE))
        result = job.wait(180)
        calls = ray.get(service.calls_made.remote())
    finally:
        job.cancel()
        ray.kill(service)
    assert result.state == "finished", result.error
    assert [r["instance"][0] for r in result.recoveries] == ["enrich"], result.recoveries
    assert calls >= EVENTS  # every record asked once, those after the checkpoint again
    (enrich,) = result.step_metrics("enrich")  # the recovered attempt's instance: one call a record
    assert enrich["async_calls"] == {"calls": enrich["records_in"], "retries": 0}, enrich

    stream = gen.generate_all().select(["key", "seq"])  # noqa: F841 - read by DuckDB
    price_table = pa.table({"key": list(prices), "price": list(prices.values())})  # noqa: F841
    con = duckdb.connect()
    con.register("stream", stream)
    con.register("price_table", price_table)
    files = f"read_parquet('{out}/*.parquet')"
    ((dups,),) = con.sql(
        f"select count(*) from (select key, seq from {files} group by 1, 2 having count(*) > 1)"
    ).fetchall()
    assert dups == 0, f"{dups} records published more than once"
    wrong = con.sql(
        f"""select s.key, s.seq, p.price, o.price, o.count from stream s
            join price_table p using (key)
            full join {files} o on o.key = s.key and o.seq = s.seq
            where o.price is distinct from p.price or o.count is distinct from s.seq + 1
            limit 5"""
    ).fetchall()
    assert wrong == [], f"records missing, unexpected or wrongly priced: {wrong}"
    ((n,),) = con.sql(f"select count(*) from {files}").fetchall()
    assert n == EVENTS
