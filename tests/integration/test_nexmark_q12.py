"""NEXMark q12 (bids per bidder per 10 s processing-time window) on Ray: across a live rescale
of its window step (meces) followed by a killed window instance, the windows of every bidder add
up to its bids exactly, are aligned, none is emitted twice and none fires before its end (but
the ones still open when the input ends): the checks of ``bench.nexmark.processing_time``,
with DuckDB over the bids. Each run replays the bids for about 10 s of wall clock, so windows
fire by their timers while the job runs, not only at the end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pytest
import ray

import raystream as rs
from raystream.runtime.actors import NAMESPACE, instance_actor_name
from tests._bench import import_bench
from tests.integration._helpers import wait_checkpoints

generator = import_bench("bench.nexmark.generator")
queries = import_bench("bench.nexmark.queries")
cli = import_bench("bench.nexmark.cli")
q12 = import_bench("bench.nexmark.processing_time")

EVENTS = 60_000
REPLAY_EPS = 5_000  # all tables: the bids take about 11 s of wall clock


@pytest.fixture(scope="module", autouse=True)
def _ship_bench() -> None:
    """Ray workers cannot import bench/ (not installed): its modules travel by value."""
    cli._pickle_by_value()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("nexmark-q12")
    generator.write_parquet(generator.NexmarkConfig(events=EVENTS, rate_eps=2_000, seed=12), out)
    return out


def _sources(data: Path) -> dict[str, Any]:
    spec = queries.QUERIES["q12"]
    return cli.table_sources(
        data, spec.tables, batch_rows=1024, replay_rate_eps=REPLAY_EPS, columns=dict(spec.columns)
    )


def _checked(result: pa.Table, data: Path) -> dict[str, Any]:
    checks = q12.check(queries.final_result("q12", result), data)
    assert checks["ok"], checks
    assert checks["bids_counted"] == checks["bids"] > 0
    # windows fired by their timers during the run, not only at the end of input
    assert checks["rows"] > checks["flushed_at_end"], checks
    return checks


def test_q12_windows_add_up_across_a_live_rescale_and_a_killed_instance(
    data: Path, tmp_path: Path
) -> None:
    """A live 2 -> 3 rescale of the window step (meces), a checkpoint at the new parallelism,
    then a window instance killed with Ray's own API: the job restores that checkpoint (or a
    later one) and replays the bids after it, which join the windows of the time they are
    replayed; the exactly-once Parquet output still counts every bid once."""
    out = tmp_path / "out"
    flow, spec = queries.build_flow("q12", _sources(data), rs.sinks.parquet(str(out)))
    job = rs.start(
        flow,
        parallelism={spec.step: 2},
        checkpoint_interval_s=0.5,
        checkpoint_dir=str(tmp_path / "chk"),
        restart_delay_s=0.2,
        linger_ms=10.0,
        batch_rows=1024,
    )
    try:
        wait_checkpoints(job, 2)
        job.rescale(spec.step, 3, "meces")
        after_rescale = job.checkpoint()
        ray.kill(ray.get_actor(instance_actor_name(job.name, spec.step, 0), namespace=NAMESPACE))
        result = job.wait(90)
    finally:
        job.cancel()
    assert result.state == "finished", result.error
    assert [r["to"] for r in result.rescales] == [3]
    assert len(result.recoveries) >= 1, result.recoveries
    assert result.recoveries[0]["checkpoint_id"] >= after_rescale["checkpoint_id"]
    rows = duckdb.connect().sql(f"SELECT * FROM read_parquet('{out}/*.parquet')").to_arrow_table()
    _checked(rows, data)
