"""Side outputs: a step returns ``rs.Outputs(main=..., late=...)``; ``stream.side_output("late")``
is the stream of what it put under ``late`` (no Ray here).

Each output batch is tagged with its port in the schema metadata on its way from the user
function to the instance's output channels, which send it only to the edges of that port.
Example::

    @rs.keyed_batches(state=rs.ValueState(int, default=0))
    def count_on_time(batch, state):
        late = batch.records.column("event_time").to_numpy() <= batch.watermark
        ...
        return rs.Outputs(main=batch.output({"count": new}), late=batch.records.filter(late))

    counted = events.key_by("key").apply(count_on_time)
    counted.side_output("late").sink(rs.sinks.collect(), name="late_records")
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from raystream.errors import DataflowDefinitionError

__all__ = ["PORT_META", "Outputs", "check_port_name", "port_of", "tag_port"]

PORT_META = b"raystream.port"


class Outputs:
    """The main output and named side outputs of one call of a user function.

    Each value is what the function could return alone: a RecordBatch, a Table, a dict of
    columns, or None. Supported by ``@rs.map_batches``, ``@rs.keyed_batches`` and ``on_timer``.
    """

    __slots__ = ("main", "side")

    def __init__(self, main: Any = None, **side: Any) -> None:
        self.main = main
        self.side = side

    def __repr__(self) -> str:
        return f"Outputs(main={'set' if self.main is not None else None}, side={list(self.side)})"


def check_port_name(name: Any) -> str:
    if not isinstance(name, str) or not name.isidentifier() or name == "main":
        msg = (
            f"side_output() expects the identifier a step uses in rs.Outputs(..., name=batch) "
            f"(not 'main'), got {name!r}"
        )
        raise DataflowDefinitionError(msg)
    return name


def tag_port(batch: pa.RecordBatch, port: str) -> pa.RecordBatch:
    meta = dict(batch.schema.metadata or {})
    meta[PORT_META] = port.encode()
    return batch.replace_schema_metadata(meta)


def port_of(batch: pa.RecordBatch) -> tuple[str, pa.RecordBatch]:
    """(port, the batch without the tag); port '' is the main output."""
    meta = batch.schema.metadata
    if not meta or PORT_META not in meta:
        return "", batch
    rest = {k: v for k, v in meta.items() if k != PORT_META}
    return meta[PORT_META].decode(), batch.replace_schema_metadata(rest or None)
