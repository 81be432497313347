"""Arrow record batches on the wire between raystream's processes: a slice sends its rows only.

A record batch cut from a larger one (``batch.slice``: a router's piece for one receiver, a
source's next ``batch_rows`` of a row group, the records of one sub-group handed over in a
rescale) shares its parent's buffers, and pyarrow pickles a sliced array with the *whole*
buffers (apache/arrow#26685, ARROW-10739): a 5-row slice of a 100k-row batch pickles to the
size of the batch. Ray works around this for ``pyarrow.Table`` only. :func:`register` makes
every Ray call of this process send a sliced batch as an Arrow IPC stream of its rows (one copy
of the slice's bytes; the receiver reads it without another) and any other batch as before
(its columns, buffers out of band). Each process that sends batches registers once: the
instances, the controller, the driver and Spark's tasks (:func:`register` after ``ray.init``).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

__all__ = ["from_wire", "register", "to_wire"]

# a batch is sent as a slice (its rows copied) when its buffers hold this much more than its rows
SLICE_SLACK_BYTES = 64 << 10
SLICE_SLACK_RATIO = 1.25

_registered: set[Any] = set()  # serialization contexts this process registered with


def _sliced(batch: pa.RecordBatch) -> bool:
    total = batch.get_total_buffer_size()
    used = batch.nbytes
    return total > used * SLICE_SLACK_RATIO and total - used > SLICE_SLACK_BYTES


def to_wire(batch: pa.RecordBatch) -> tuple[Any, ...]:
    """What is pickled for ``batch``: its rows as an IPC stream if it is a slice of a larger
    batch, else its schema and columns (as pyarrow pickles a batch)."""
    if batch.num_rows == 0:
        return ("empty", batch.schema)
    if _sliced(batch):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch)
        return ("ipc", sink.getvalue())
    return ("columns", batch.schema, batch.columns)


def from_wire(payload: tuple[Any, ...]) -> pa.RecordBatch:
    """The batch :func:`to_wire` sent."""
    if payload[0] == "ipc":
        return pa.ipc.open_stream(payload[1]).read_next_batch()
    if payload[0] == "empty":
        return _empty(payload[1])
    _, schema, columns = payload
    return pa.RecordBatch.from_arrays(list(columns), schema=schema)


def _empty(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([], type=f.type) for f in schema], schema=schema)


def register() -> None:
    """Send record batches of this process's Ray calls with :func:`to_wire` (idempotent; Ray
    must be initialised in this process)."""
    import ray

    context = ray._private.worker.global_worker.get_serialization_context()
    if id(context) in _registered:
        return
    ray.util.register_serializer(pa.RecordBatch, serializer=to_wire, deserializer=from_wire)
    _registered.add(id(context))
