"""The demo: key-count on local Ray with RocksDB state, a live 2 -> 4 rescale (meces) in the
middle of the stream, and the final counts checked against numpy. ``raystream demo``."""

from __future__ import annotations

import threading
import time

import numpy as np

import raystream as rs

__all__ = ["main"]


def build(events: int, keys: int, rate_eps: int) -> tuple[rs.Dataflow, object]:
    flow = rs.Dataflow("demo-keycount", num_key_groups=128, sub_groups=16)

    @rs.keyed_batches(state=rs.ValueState(int, default=0))
    def count(batch: rs.KeyedBatch, state: object) -> object:
        """Vectorised: one multi-get and one WriteBatch per batch."""
        new = state.get(batch.keys) + batch.counts  # type: ignore[attr-defined]
        state.put(batch.keys, new)  # type: ignore[attr-defined]
        return batch.output({"count": new})

    source = rs.sources.generator(events=events, keys=keys, zipf=1.1, seed=7, rate_eps=rate_eps)
    flow.source(source).key_by("key").apply(count).sink(rs.sinks.collect(), name="counts")
    return flow, source


def main(events: int = 1_200_000, keys: int = 100_000, rate_eps: int = 100_000) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    flow, source = build(events, keys, rate_eps)
    console.print(
        f"[bold]raystream demo[/]: key-count of {events:,} events over {keys:,} keys (Zipf 1.1) at "
        f"{rate_eps:,} events/s, parallelism 2, live rescale to 4 (meces) after 4 s"
    )
    job = rs.start(flow, parallelism={"count": 2})
    stats: dict[str, object] = {}

    def rescale() -> None:
        time.sleep(4.0)
        stats.update(job.rescale("count", 4, "meces"))

    t = threading.Thread(target=rescale)
    t.start()
    result = job.wait()
    t.join()

    table = result.table("counts")
    keys_out = table.column("key").to_numpy()
    counts_out = table.column("count").to_numpy()
    order = np.lexsort((counts_out, keys_out))
    last = np.r_[keys_out[order][1:] != keys_out[order][:-1], True]
    final_keys, final_counts = keys_out[order][last], counts_out[order][last]
    oracle_keys, oracle_counts = np.unique(
        source.generate_all().column("key").to_numpy(), return_counts=True
    )  # type: ignore[attr-defined]
    exact = np.array_equal(final_keys, oracle_keys) and np.array_equal(final_counts, oracle_counts)

    lat = result.latency()
    summary = lat.summary() if lat is not None else {}
    t_out = Table(title="result")
    t_out.add_column("metric")
    t_out.add_column("value")
    t_out.add_row("events", f"{events:,} in {result.elapsed_s:.2f} s")
    t_out.add_row(
        "latency p50 / p99 / max",
        f"{summary.get('p50_ms')} / {summary.get('p99_ms')} / {summary.get('max_ms')} ms",
    )
    if stats:
        t_out.add_row(
            "rescale 2 -> 4 (meces)",
            f"{stats['duration_s']:.2f} s, {stats['moved_key_groups']} key groups, "
            f"{stats['moved_bytes']:,} bytes, {stats['on_demand_fetches']} on-demand fetches",
        )
    t_out.add_row("final counts vs numpy", "[green]exact[/]" if exact else "[red]MISMATCH[/]")
    console.print(t_out)
    if not exact:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
