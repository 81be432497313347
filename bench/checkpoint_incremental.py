"""Incremental checkpoint uploads: bytes copied per checkpoint while a fraction of keys changes.

Run it from the repository root::

    python -m bench.checkpoint_incremental                 # 200k keys, 1% changed per round
    python -m bench.checkpoint_incremental --rounds 8 --changed 0.01
    python -m bench.checkpoint_incremental --keys 1000000 --value-bytes 1024   # 1 GB of state

One RocksDB (``RocksStateBackend``) gets ``--keys`` keys with ``--value-bytes`` values (random,
incompressible) in ``--flushes``
flushed SST files; then every round overwrites ``--changed`` of the keys at random, flushes,
snapshots and uploads through :class:`CheckpointStorage` (retain 3). Each line shows the bytes
uploaded vs referenced and the SST files of the snapshot, so RocksDB compactions (which rewrite
files, and so make a round upload more) are visible. Every round is restored and checked against
a dict of all keys (read back in key order, one chunk at a time).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import click
import numpy as np
import pyarrow as pa

from raystream.checkpoint import CheckpointStorage
from raystream.state.layout import encode_keys
from raystream.state.rocks import RocksStateBackend, snapshot_chunks

NUM_KEY_GROUPS = 128


def _encode(keys: np.ndarray) -> list[bytes]:
    kgs = (keys % NUM_KEY_GROUPS).astype(np.uint16)
    return encode_keys(kgs, np.zeros(len(keys), np.uint8), 0, pa.array(keys, pa.int64()))


@click.command()
@click.option("--keys", default=200_000, show_default=True)
@click.option("--changed", default=0.01, show_default=True, help="fraction of keys per round")
@click.option("--flushes", default=2, show_default=True, help="SST files of the first state")
@click.option("--rounds", default=6, show_default=True)
@click.option("--value-bytes", default=100, show_default=True, help="bytes per value")
@click.option("--seed", default=1, show_default=True)
@click.option("--report", type=click.Path(dir_okay=False), default=None, help="write JSON here")
def main(
    keys: int,
    changed: float,
    flushes: int,
    rounds: int,
    value_bytes: int,
    seed: int,
    report: str | None,
) -> None:
    if value_bytes <= 0:
        msg = f"expected a value size in bytes > 0, got {value_bytes}"
        raise click.BadParameter(msg, param_hint="'--value-bytes'")
    rng = np.random.default_rng(seed)
    lines: list[dict[str, object]] = []
    oracle: dict[bytes, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        db = RocksStateBackend(root / "db", cache_entries=0)
        storage = CheckpointStorage(root / "chk", "bench", retain=3)

        def put(ids: np.ndarray) -> None:
            for part in np.array_split(ids, max(1, len(ids) // 50_000)):
                raw = _encode(part)
                blob = rng.bytes(len(raw) * value_bytes)
                values = [blob[i * value_bytes : (i + 1) * value_bytes] for i in range(len(raw))]
                db.write(raw, values)
                oracle.update(zip(raw, values, strict=True))

        for part in np.array_split(rng.permutation(keys).astype(np.int64), flushes):
            put(part)
            db.flush()
        first = 0
        for cid in range(1, rounds + 2):
            if cid > 1:
                put(rng.choice(keys, int(keys * changed), replace=False).astype(np.int64))
                db.flush()
            snap = db.snapshot(root / f"snap-{cid}")
            state = storage.upload_state(cid, "count/0", str(snap), db.uid)
            storage.complete(cid, {"job": "bench", "state": state})
            ssts = sorted(f["name"] for f in state["files"] if f["name"].endswith(".sst"))
            first = first or state["uploaded_bytes"]
            local = storage.materialize_state(storage.load(cid)["state"], root / f"r-{cid}")
            seen = 0
            for c in snapshot_chunks(local, range(NUM_KEY_GROUPS)):
                for k, v in zip(c.column(0).to_pylist(), c.column(1).to_pylist(), strict=True):
                    assert oracle.get(k) == v, f"checkpoint {cid} restores a wrong value"
                    seen += 1
            assert seen == len(oracle), f"checkpoint {cid} restores {seen} of {len(oracle)} keys"
            shutil.rmtree(local)
            shutil.rmtree(snap)
            lines.append(
                {
                    "checkpoint": cid,
                    "uploaded_bytes": state["uploaded_bytes"],
                    "referenced_bytes": state["referenced_bytes"],
                    "uploaded_pct_of_first": round(100 * state["uploaded_bytes"] / first, 2),
                    "uploaded_pct_of_state": round(
                        100 * state["uploaded_bytes"]
                        / (state["uploaded_bytes"] + state["referenced_bytes"]),
                        2,
                    ),
                    "sst_files": len(ssts),
                }
            )
            click.echo(
                f"checkpoint {cid}: uploaded {state['uploaded_bytes']:>10,} B "
                f"({100 * state['uploaded_bytes'] / first:5.1f}% of the first), referenced "
                f"{state['referenced_bytes']:>10,} B, SSTs {ssts}"
            )
        db.close()
    if report:
        config = {
            "keys": keys,
            "value_bytes": value_bytes,
            "changed": changed,
            "rounds": rounds,
            "flushes": flushes,
        }
        Path(report).write_text(json.dumps({"config": config, "checkpoints": lines}, indent=1))


if __name__ == "__main__":
    main()
