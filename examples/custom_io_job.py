"""Your own source and sink, and a vectorised ``map_batches`` step between them.

    raystream run examples/custom_io_job.py -p hottest=2

``Readings`` is a source: a frozen, picklable spec whose ``open(index, parallelism)`` returns the
reader of one instance's share. Here sensor readings are computed from the row number, so the
stream is the same for any parallelism and a reader re-opened after a failure gives the same rows
(recovery rewinds a source by reading it again). ``CsvFiles`` is a sink: each instance writes
``part-<index>.csv`` through a hidden temporary file that ``close()`` renames, so a reader never
sees half a file. (A sink that also has ``pre_commit`` / ``commit`` / ``restore`` takes part in
checkpoints; see ``raystream.sinks.CommittingSinkWriter``.)

Environment variables (optional): ``RAYSTREAM_OUT`` (the output folder, default a temporary one),
``RAYSTREAM_EVENTS`` (readings, default 100,000).
"""

import os
import tempfile
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv

import raystream as rs

CHUNK = 10_000  # rows per unit of work: instance i of P reads chunks i, i + P, ...


@dataclass(frozen=True)
class Readings:
    """``rows`` readings (sensor id, reading number, degrees Celsius) of ``sensors`` sensors."""

    rows: int
    sensors: int = 50
    rate_eps: float = 0.0  # 0: as fast as downstream takes them

    def schema(self) -> pa.Schema:
        return pa.schema([("sensor", pa.int64()), ("n", pa.int64()), ("celsius", pa.float64())])

    def open(self, index: int, parallelism: int) -> "ReadingsReader":
        return ReadingsReader(self, range(index, -(-self.rows // CHUNK), parallelism))

    def describe(self) -> str:
        return f"Readings(rows={self.rows}, sensors={self.sensors})"

    def chunk(self, c: int) -> pa.RecordBatch:
        n = np.arange(c * CHUNK, min((c + 1) * CHUNK, self.rows), dtype=np.int64)
        celsius = 20 + 10 * np.sin(n / 1000.0) + (n * 7919 % 101) / 10.0
        return pa.record_batch([n % self.sensors, n, celsius], schema=self.schema())


class ReadingsReader:
    def __init__(self, spec: Readings, chunks: range) -> None:
        self.spec, self.chunks, self.pending = spec, iter(chunks), None

    def read(self, max_rows: int) -> pa.RecordBatch | None:
        if self.pending is None or self.pending.num_rows == 0:
            c = next(self.chunks, None)
            if c is None:
                return None
            self.pending = self.spec.chunk(c)
        out, self.pending = self.pending.slice(0, max_rows), self.pending.slice(max_rows)
        return out

    def close(self) -> None:
        self.pending = None


@dataclass(frozen=True)
class CsvFiles:
    """Each instance writes ``<path>/part-<index>.csv``."""

    path: str

    def open(self, index: int, parallelism: int) -> "CsvWriter":
        os.makedirs(self.path, exist_ok=True)
        return CsvWriter(os.path.join(self.path, f"part-{index:05d}.csv"))

    def describe(self) -> str:
        return f"CsvFiles({self.path!r})"


class CsvWriter:
    def __init__(self, final: str) -> None:
        self.final = final
        self.tmp = os.path.join(os.path.dirname(final), "." + os.path.basename(final) + ".tmp")
        self.writer: pcsv.CSVWriter | None = None

    def write(self, batch: pa.RecordBatch) -> None:
        if self.writer is None:
            self.writer = pcsv.CSVWriter(self.tmp, batch.schema)
        self.writer.write_batch(batch)

    def close(self) -> str | None:
        if self.writer is None:
            return None
        self.writer.close()
        os.replace(self.tmp, self.final)
        return self.final

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.close()
            os.remove(self.tmp)


@rs.map_batches
def to_fahrenheit(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A column computed over the whole batch at once (pyarrow.compute); the other columns stay."""
    fahrenheit = pc.add(pc.multiply(batch.column("celsius"), 1.8), 32)
    return batch.append_column("fahrenheit", fahrenheit)


@rs.keyed_batches(state=rs.ValueState(float, default=float("-inf")))
def hottest(batch, state):
    """The hottest reading so far per sensor."""
    new = np.maximum(state.get(batch.keys), batch.reduce("fahrenheit", "max"))
    state.put(batch.keys, new)
    return batch.output({"max_fahrenheit": new})


flow = rs.Dataflow("custom-io", num_key_groups=32)
source = Readings(rows=int(os.environ.get("RAYSTREAM_EVENTS", "100000")))
out_dir = os.environ.get("RAYSTREAM_OUT") or tempfile.mkdtemp(prefix="raystream-custom-io-")
(
    flow.source(source, parallelism=2)
    .apply(to_fahrenheit)
    .key_by("sensor")
    .apply(hottest)
    .sink(CsvFiles(out_dir), name="out")
)

if __name__ == "__main__":
    rs.run(flow, parallelism={"hottest": 2})
    print(f"wrote {out_dir}")
