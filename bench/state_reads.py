"""RocksDB reads of the 1 GB key-count, replayed without Ray, by data block size.

Run it from the repository root::

    python -m bench.state_reads --name state_reads_1gb --repeats 3

Instance 0's share of the generator's events (as ``bench.count_state`` cuts it: ``--instances``,
``--batch-rows``) runs once through the payload count (``--value-bytes``) over instance 0's
prefilled state, recording every list of keys the write-back cache passed on to RocksDB (its
misses, the reads the job makes). Then, for each ``--block-bytes``, the same rows are written
into SST files with the state DB's options and that block size, ingested into a new DB, and
two things are timed, ``--repeats`` times each on a fresh copy:

- **point reads**: the recorded key lists, one ``get`` each, in order, on a cold block cache
  (as a prefilled instance starts): process CPU seconds per key read;
- **range read**: every row in key order with the options of a state export (no block cache
  fill, 2 MiB readahead): MB/s of keys and values (wall time).

Writes ``bench/results/NAME.json`` (medians and min-max per block size, and every run).
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import click
from rocksdict import IngestExternalFileOptions, Rdict, ReadOptions, SstFileWriter

import raystream as rs
from bench._report import imported_from
from bench._payload import prefill_state
from bench.count_state import _share
from raystream.runtime.processors import KeyedProcessor
from raystream.state.rocks import EXPORT_READAHEAD_BYTES, state_db_options

__all__ = ["main", "record_reads"]


def record_reads(share: Any, prefilled: Path, folder: Path) -> list[list[bytes]]:
    """The key lists the count step over ``share`` reads from RocksDB (past its write-back
    cache), starting from a copy of the ``prefilled`` DB."""
    _, step, ks, owned, batches, _ = share
    path = folder / "record"
    shutil.copytree(prefilled, path)
    proc = KeyedProcessor(step, ks, path, owned, track=True)
    reads: list[list[bytes]] = []
    db = proc.backend._db  # noqa: SLF001 - a recording stand-in for the reads

    class _Recording:
        def get(self, keys: list[bytes]) -> Any:
            reads.append(list(keys))
            return db.get(keys)

        def __getattr__(self, name: str) -> Any:
            return getattr(db, name)

    proc.backend._db = _Recording()  # noqa: SLF001
    try:
        for b in batches:
            proc.process(b)
    finally:
        proc.backend._db = db  # noqa: SLF001
        proc.backend.close()
        shutil.rmtree(path, ignore_errors=True)
    return reads


def _rewrite(prefilled: Path, dest: Path, block_bytes: int, sst_rows: int = 65_536) -> None:
    """The rows of ``prefilled`` into a new DB at ``dest`` whose SST files have ``block_bytes``
    data blocks (written with ``SstFileWriter`` and ingested: no compaction)."""
    src_opts = state_db_options()
    src = Rdict(str(prefilled), src_opts, column_families={"default": src_opts})
    opts = state_db_options(block_bytes=block_bytes)
    staging = Path(f"{dest}-sst")
    staging.mkdir(parents=True)
    files: list[str] = []
    writer = None
    try:
        for n, (k, v) in enumerate(src.items()):
            if writer is None:
                writer = SstFileWriter(opts)
                files.append(str(staging / f"{len(files):05d}.sst"))
                writer.open(files[-1])
            writer[k] = v
            if (n + 1) % sst_rows == 0:
                writer.finish()
                writer = None
        if writer is not None:
            writer.finish()
    finally:
        src.close()
    db = Rdict(str(dest), opts, column_families={"default": opts})
    ingest = IngestExternalFileOptions()
    ingest.set_move_files(True)
    db.ingest_external_file(files, ingest)
    db.close()
    shutil.rmtree(staging)


def _time_reads(template: Path, folder: Path, block_bytes: int, reads: list[list[bytes]]) -> float:
    """CPU seconds of the recorded reads on a fresh copy of ``template`` (cold block cache)."""
    path = folder / "reads"
    shutil.copytree(template, path)
    opts = state_db_options(block_bytes=block_bytes)
    db = Rdict(str(path), opts, column_families={"default": opts})
    try:
        cpu0 = time.process_time()
        for keys in reads:
            db.get(keys)
        return time.process_time() - cpu0
    finally:
        db.close()
        shutil.rmtree(path)


def _time_scan(template: Path, block_bytes: int) -> tuple[float, int]:
    """Wall seconds and bytes (keys and values) of reading every row as an export does."""
    opts = state_db_options(block_bytes=block_bytes)
    db = Rdict(str(template), opts, column_families={"default": opts})
    ro = ReadOptions()
    ro.fill_cache(False)
    ro.set_readahead_size(EXPORT_READAHEAD_BYTES)
    size = 0
    try:
        t0 = time.perf_counter()
        for k, v in db.items(read_opt=ro):
            size += len(k) + len(v)
        return time.perf_counter() - t0, size
    finally:
        db.close()


def _spread(values: list[float], digits: int) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


@click.command()
@click.option("--name", default="state_reads", show_default=True, help="bench/results/NAME.json")
@click.option("--events", default=3_000_000, show_default=True)
@click.option("--keys", default=1_000_000, show_default=True)
@click.option("--zipf", default=1.1, show_default=True)
@click.option("--instances", default=2, show_default=True, help="parallelism the share is of")
@click.option("--batch-rows", default=350, show_default=True)
@click.option("--value-bytes", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option(
    "--block-bytes",
    default="1024,4096",
    show_default=True,
    help="comma-separated data block sizes to compare",
)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
def main(
    name: str,
    events: int,
    keys: int,
    zipf: float,
    instances: int,
    batch_rows: int,
    value_bytes: int,
    block_bytes: str,
    repeats: int,
) -> None:
    """Replay the 1 GB key-count's RocksDB reads by data block size."""
    try:
        sizes = [int(s) for s in block_bytes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        msg = f"expected comma-separated block sizes in bytes >= 1 (e.g. 1024,4096), got {block_bytes!r}"
        raise click.BadParameter(msg, param_hint="'--block-bytes'")
    share = _share(events, keys, zipf, instances, batch_rows, value_bytes)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="raystream-state-reads-") as tmp:
        folder = Path(tmp)
        prefill_state(folder, share[0], "count", instances, keys, "int", value_bytes, instances=[0])
        prefilled = folder / "count" / "0"
        reads = record_reads(share, prefilled, folder)
        n_keys = sum(map(len, reads))
        click.echo(f"{len(reads):,} reads of {n_keys:,} keys recorded")
        for size in sizes:
            template = folder / f"blocks-{size}"
            _rewrite(prefilled, template, size)
            cpu = [_time_reads(template, folder, size, reads) for _ in range(repeats)]
            scans = [_time_scan(template, size) for _ in range(repeats)]
            per_key = [c / n_keys * 1e6 for c in cpu]
            mb_s = [b / s / 1e6 for s, b in scans]
            results[str(size)] = {
                "us_per_key_read": _spread(per_key, 3),
                "scan_mb_s": _spread(mb_s, 0),
                "runs": {"read_cpu_s": cpu, "scan": [{"s": s, "bytes": b} for s, b in scans]},
            }
            click.echo(
                f"{size:>6} B blocks: {statistics.median(per_key):.2f} us CPU per key read "
                f"({min(per_key):.2f}-{max(per_key):.2f}); range read "
                f"{statistics.median(mb_s):,.0f} MB/s ({min(mb_s):,.0f}-{max(mb_s):,.0f})"
            )
    out = {
        "benchmark": "state_reads",
        "measures": "point reads: process CPU seconds of the recorded RocksDB reads (the payload "
        "count's write-back cache misses over instance 0's prefilled state), per key, cold block "
        "cache; range read: wall MB/s of keys and values read in key order as an export does",
        "raystream": imported_from(rs),
        "config": {
            "events": events,
            "keys": keys,
            "zipf": zipf,
            "instances": instances,
            "batch_rows": batch_rows,
            "value_bytes": value_bytes,
            "repeats": repeats,
        },
        "reads": len(reads),
        "keys_read": n_keys,
        "by_block_bytes": results,
    }
    path = Path("bench/results") / f"{name}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    click.echo(f"wrote {path}")


if __name__ == "__main__":
    main()
