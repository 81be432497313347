"""Bulk state moves: SST file ingestion against write batches, on one machine, no Ray.

Run it from the repository root::

    python -m bench.state_transfer                       # 100 MB: 100k keys x 1,000-byte values
    python -m bench.state_transfer --keys 200000 --value-bytes 500 --repeats 3

One RocksDB (``RocksStateBackend``) holds ``--keys`` keys with ``--value-bytes``-byte values over
128 key groups x 8 sub-groups. Every sub-group is exported the way a migration's old owner
serves it (:meth:`RocksStateBackend.export_chunk`, chunks of at most ``--chunk-bytes``), then the
chunks are imported into a fresh RocksDB twice: once by ``WriteBatch`` and once by writing each
chunk to an SST file and ingesting it. Chunks hold one sub-group each (``per_sub_group``: small
sub-groups make small chunks) or consecutive sub-groups up to ``--chunk-bytes`` (``packed``: one
read per sub-group, the pieces copied into one chunk, as serve calls did), or (``runs``) each
key group's sub-groups read as one key range (:meth:`RocksStateBackend.export_run`, one iterator)
filling calls of up to ``--chunk-bytes``, one batch per range read, as a serve call does now.
Each import is timed from the first chunk to the last
(the export is timed on its own); MB/s count the bytes of keys and values.
Every import is checked against the source: same rows, same bytes (a digest of a full scan).
The median of ``--repeats`` runs is reported; results go to ``bench/results/state_transfer.json``.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import click
import numpy as np
import pyarrow as pa

from raystream.state.layout import encode_keys, key_group_bounds
from raystream.state.rocks import IMPORT_METHODS, RocksStateBackend

NUM_KEY_GROUPS = 128
SUB_GROUPS = 8


def _fill(backend: RocksStateBackend, keys: int, value_bytes: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    ids = np.arange(keys, dtype=np.int64)
    for start in range(0, keys, 20_000):
        part = ids[start : start + 20_000]
        kgs = (part % NUM_KEY_GROUPS).astype(np.uint16)
        sgs = ((part // NUM_KEY_GROUPS) % SUB_GROUPS).astype(np.uint8)
        encoded = encode_keys(kgs, sgs, 0, pa.array(part, pa.int64()))
        payload = rng.integers(0, 256, size=(len(part), value_bytes), dtype=np.uint8)
        backend.write_direct(encoded, [row.tobytes() for row in payload])
    backend.flush()


def _digest(backend: RocksStateBackend) -> tuple[int, str]:
    h = hashlib.blake2b(digest_size=16)
    rows = 0
    lower, _ = key_group_bounds(0)
    _, upper = key_group_bounds(NUM_KEY_GROUPS - 1)
    for k, v in backend.scan(lower, upper):
        h.update(k)
        h.update(v)
        rows += 1
    return rows, h.hexdigest()


def _export(backend: RocksStateBackend, chunk_bytes: int, packed: bool) -> list[pa.RecordBatch]:
    """Every sub-group in key order, in chunks of at most ``chunk_bytes``: one sub-group per
    chunk, or (``packed``) consecutive sub-groups filling a chunk, as one serve call does."""
    chunks: list[pa.RecordBatch] = []
    pieces: list[pa.RecordBatch] = []
    room = chunk_bytes

    def close() -> None:
        nonlocal pieces, room
        if pieces:
            chunks.append(pa.Table.from_batches(pieces).combine_chunks().to_batches()[0])
        pieces, room = [], chunk_bytes

    for kg in range(NUM_KEY_GROUPS):
        for sg in range(SUB_GROUPS):
            start: bytes | None = None
            while True:
                piece, resume = backend.export_chunk(kg, sg, start, max(1, room))
                if pieces and piece.nbytes > room:
                    close()
                    continue  # again from the same key, into an empty chunk
                start = resume
                if piece.num_rows:
                    pieces.append(piece)
                    room -= piece.nbytes
                if start is not None or room <= 0:
                    close()
                if start is None:
                    break
            if not packed:
                close()
    close()
    return chunks


def _export_runs(backend: RocksStateBackend, chunk_bytes: int) -> list[pa.RecordBatch]:
    """Every key group's sub-groups as one key range each, read the way a serve call reads a
    run of consecutive sub-groups: calls of at most ``chunk_bytes``, one batch per range read."""
    chunks: list[pa.RecordBatch] = []
    kg, first, start = 0, 0, None
    while kg < NUM_KEY_GROUPS:
        room, pieces = chunk_bytes, []
        while kg < NUM_KEY_GROUPS and room > 0:
            piece, nxt, resume = backend.export_run(
                kg, first, SUB_GROUPS - 1, start, room, alone=not pieces
            )
            if piece.num_rows:
                pieces.append(piece)
                room -= piece.nbytes
            if resume is not None:
                first, start = nxt, resume
                break
            kg, first, start = kg + 1, 0, None
        chunks.extend(pieces)
    return chunks


LAYOUTS = ("per_sub_group", "packed", "runs")


@click.command()
@click.option("--keys", default=100_000, show_default=True)
@click.option("--value-bytes", default=1_000, show_default=True)
@click.option("--chunk-bytes", default=4 << 20, show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--out", default="bench/results/state_transfer.json", show_default=True)
def main(keys: int, value_bytes: int, chunk_bytes: int, repeats: int, out: str) -> None:
    with tempfile.TemporaryDirectory(prefix="rs-transfer-") as tmp:
        src = RocksStateBackend(Path(tmp) / "src", cache_entries=0)
        _fill(src, keys, value_bytes, seed=1)
        expected = _digest(src)
        runs: dict[str, list[float]] = {}
        n_chunks: dict[str, int] = {}
        nbytes = 0
        for r in range(repeats):
            for layout in LAYOUTS:
                t0 = time.perf_counter()
                if layout == "runs":
                    chunks = _export_runs(src, chunk_bytes)
                else:
                    chunks = _export(src, chunk_bytes, packed=layout == "packed")
                runs.setdefault(f"export_{layout}", []).append(time.perf_counter() - t0)
                nbytes = sum(c.nbytes - 8 * (c.num_rows + 1) for c in chunks)  # keys + values
                n_chunks[layout] = len(chunks)
                assert max(c.nbytes for c in chunks) <= chunk_bytes
                for method in IMPORT_METHODS:
                    dst = RocksStateBackend(Path(tmp) / f"{method}-{layout}-{r}", cache_entries=0)
                    t0 = time.perf_counter()
                    rows = sum(dst.import_chunk(c, method=method) for c in chunks)
                    runs.setdefault(f"{method}_{layout}", []).append(time.perf_counter() - t0)
                    got = _digest(dst)
                    assert rows == keys and got == expected, (method, rows, got, expected)
                    dst.destroy()
        src.destroy()
    mb = nbytes / 1e6
    result = {
        "what": (
            "every sub-group exported (RocksStateBackend.export_chunk) in chunks of at most "
            "chunk_bytes, one sub-group per chunk (per_sub_group) or consecutive sub-groups "
            "filling a chunk (packed: one read per sub-group, copied into one chunk) or each key "
            "group's sub-groups read as one key range (runs: RocksStateBackend.export_run, calls "
            "of at most chunk_bytes, one batch per range read, as a serve call does), then imported into a fresh RocksDB "
            "by WriteBatch or by SST file ingestion; each import checked against the source; "
            "median seconds of `repeats` runs; MB/s over the keys' and values' bytes; one "
            "process, no Ray"
        ),
        "command": (
            f"python -m bench.state_transfer --keys {keys} --value-bytes {value_bytes} "
            f"--chunk-bytes {chunk_bytes} --repeats {repeats}"
        ),
        "keys": keys,
        "value_bytes": value_bytes,
        "chunk_bytes": chunk_bytes,
        "chunks": n_chunks,
        "state_mb": round(mb, 1),
        "repeats": repeats,
        "seconds": {k: [round(x, 3) for x in v] for k, v in runs.items()},
        "mb_per_s": {k: round(mb / statistics.median(v), 1) for k, v in runs.items()},
    }
    for layout in LAYOUTS:
        imports = {m: result["mb_per_s"][f"{m}_{layout}"] for m in IMPORT_METHODS}
        result[f"faster_import_{layout}"] = max(imports, key=imports.__getitem__)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    click.echo(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
