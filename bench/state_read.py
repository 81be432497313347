"""Reading a checkpoint's keyed state as a table (``rs.read_state``), without Ray.

Run it from the repository root::

    python -m bench.state_read --name state_read_1m --keys 1000000 --repeats 3

For each key type (``int``: int64 keys; ``str``: ``"key-<n>"``), a key-count step's state of
``--keys`` keys (``ValueState(int)``, random counts) is written over ``--instances`` RocksDB
instances (each holding the key groups a uniform routing gives it, through the runtime's
vectorised state handles), flushed, snapshotted and stored as checkpoint 1 through
``CheckpointStorage`` on local disk, with the controller's manifest. Then, ``--repeats`` times:

- **read_state**: the whole state as a table (wall time: rebuilding each instance's RocksDB
  folder from the checkpoint, SSTs hard-linked; a read-only range scan; the vectorised decode);
- of which **scan** (rebuild + scan) and **decode** (prefix split, key groups, the keys' hash
  check, the int64 and string key decode, 8-byte values), each timed alone on the same rows;
- **per-row decode**: the same rows decoded one by one in Python
  (``raystream.state.layout.decode_user_key`` and the codec's ``decode``, into a dict), for
  comparison with the vectorised decode;
- **one key**: ``read_state(key=k)`` for ``--lookups`` keys (one sub-group scanned), the median.

Every read is checked against the written counts (``exact``). Writes
``bench/results/NAME.json`` (medians, min-max and every run).
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
import numpy as np
import pyarrow as pa

import raystream as rs
from bench._report import imported_from
from raystream.checkpoint.storage import CheckpointStorage
from raystream.checkpointing import build_manifest
from raystream.keys import RoutingTable
from raystream.state.handles import KeyedStates
from raystream.state.layout import decode_user_key
from raystream.state.rocks import RocksStateBackend
from raystream.state_reader import _read_parts, _state_parts, state_tables_of

__all__ = ["main"]


@rs.keyed_batches(state=rs.ValueState(int, default=0))
def count(batch: Any, state: Any) -> None:
    return None


def _flow(name: str, key_groups: int, sub_groups: int) -> rs.Dataflow:
    flow = rs.Dataflow(name, num_key_groups=key_groups, sub_groups=sub_groups)
    src = flow.source(rs.sources.generator(events=1, keys=1))
    src.key_by("key").apply(count, name="count").sink(rs.sinks.null(), name="out")
    return flow


def write_checkpoint(
    flow: rs.Dataflow, keys: pa.Array, values: np.ndarray, instances: int, folder: Path
) -> str:
    """Checkpoint 1 of ``flow`` holding ``values`` for ``keys``; returns the storage URI."""
    ks = flow.key_space
    routing = RoutingTable.uniform(ks.num_key_groups, instances)
    owner = routing.owners[ks.locate(keys)[0]]
    uri = str(folder / "chk")
    storage = CheckpointStorage(uri, flow.name)
    acks = []
    for i in range(instances):
        backend = RocksStateBackend(folder / f"db-{i}", cache_entries=0)
        mine = np.flatnonzero(owner == i)
        handle = KeyedStates(backend, flow.steps["count"].state, ks).vectorised()
        for lo in range(0, len(mine), 100_000):
            part = mine[lo : lo + 100_000]
            handle.put(keys.take(pa.array(part)), values[part])
        local = folder / f"snap-{i}"
        backend.snapshot(local)
        desc = storage.upload_state(1, f"count/{i}", str(local), backend.uid)
        acks.append(
            {
                "instance": ("count", i),
                "state": desc,
                "key_groups": routing.key_groups_of(i).tolist(),
            }
        )
        backend.close()
        shutil.rmtree(local)
    manifest = build_manifest(
        job=flow.name,
        checkpoint_id=1,
        acks=acks,
        finished_sources=[],
        steps={n: s.kind for n, s in flow.steps.items()},
        parallelism={"count": instances},
        routing={"count": routing},
        num_key_groups=ks.num_key_groups,
        sub_groups=ks.sub_groups,
    )
    storage.complete(1, manifest)
    return uri


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def run_kind(
    kind: str, n: int, instances: int, repeats: int, lookups: int, folder: Path
) -> dict[str, Any]:
    flow = _flow(f"read-{kind}", 128, 16)
    rng = np.random.default_rng(7)
    ints = rng.permutation(np.arange(n, dtype=np.int64) * 7919 - n)
    keys = pa.array(ints) if kind == "int" else pa.array([f"key-{k}" for k in ints.tolist()])
    values = rng.integers(1, 1_000, n).astype(np.int64)
    uri = write_checkpoint(flow, keys, values, instances, folder)
    expected = dict(zip(keys.to_pylist(), values.tolist(), strict=True))
    runs: list[dict[str, float]] = []
    exact = True
    storage = CheckpointStorage(uri, flow.name, probe=False)
    manifest = storage.load(1)
    parts, _ = _state_parts(manifest, "count", 128, "bench")
    specs = flow.steps["count"].state
    for _ in range(repeats):
        t0 = time.perf_counter()
        table = rs.read_state(flow, "count", checkpoint_dir=uri)["state"]
        total = time.perf_counter() - t0
        got = dict(zip(table.column("key").to_pylist(), table.column("value").to_pylist()))
        exact &= got == expected
        t0 = time.perf_counter()
        rows = _read_parts(storage, parts, flow.key_space, None, "bench", None)
        scan = time.perf_counter() - t0
        t0 = time.perf_counter()
        decoded = state_tables_of(rows, specs, flow.key_space, "key")["state"]
        decode = time.perf_counter() - t0
        exact &= decoded.num_rows == n
        t0 = time.perf_counter()
        codec = specs[""].codec
        per_row = {
            decode_user_key(k, kind)[0]: codec.decode(v)
            for k, v in zip(rows[0].to_pylist(), rows[1].to_pylist(), strict=True)
        }
        per_row_s = time.perf_counter() - t0
        exact &= per_row == expected
        runs.append(
            {"read_state_s": total, "scan_s": scan, "decode_s": decode, "per_row_decode_s": per_row_s}
        )
    sample = keys.take(pa.array(rng.choice(n, lookups, replace=False))).to_pylist()
    one: list[float] = []
    for k in sample:
        t0 = time.perf_counter()
        t = rs.read_state(flow, "count", checkpoint_dir=uri, key=k)["state"]
        one.append(time.perf_counter() - t0)
        exact &= t.column("value").to_pylist() == [expected[k]]
    out: dict[str, Any] = {"keys": n, "exact": exact, "runs": runs}
    for field in runs[0]:
        out[field] = _summary([r[field] for r in runs])
    out["rows_per_s"] = _summary([n / r["read_state_s"] for r in runs])
    out["one_key_s"] = _summary(one)
    return out


@click.command()
@click.option("--name", default="state_read", show_default=True, help="bench/results/NAME.json")
@click.option("--keys", default=1_000_000, show_default=True)
@click.option("--instances", default=2, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--lookups", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--kinds", default="int,str", show_default=True, help="key types, comma-separated")
def main(name: str, keys: int, instances: int, repeats: int, lookups: int, kinds: str) -> None:
    report: dict[str, Any] = {
        "what": "rs.read_state of a ValueState(int) key-count checkpoint on local disk",
        "imported_from": imported_from(rs),
        "config": {"keys": keys, "instances": instances, "repeats": repeats, "lookups": lookups},
        "kinds": {},
    }
    for kind in kinds.split(","):
        with tempfile.TemporaryDirectory(prefix="bench-state-read-") as tmp:
            res = run_kind(kind, keys, instances, repeats, lookups, Path(tmp))
        report["kinds"][kind] = res
        click.echo(
            f"{kind}: read_state {res['read_state_s']['median']:.2f} s "
            f"({res['read_state_s']['min']:.2f}-{res['read_state_s']['max']:.2f}), "
            f"scan {res['scan_s']['median']:.2f} s, decode {res['decode_s']['median']:.3f} s, "
            f"per-row decode {res['per_row_decode_s']['median']:.2f} s, one key "
            f"{res['one_key_s']['median'] * 1e3:.1f} ms, exact {res['exact']}"
        )
    out = Path("bench/results") / f"{name}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
