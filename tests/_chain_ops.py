"""Steps shared by the keyed-chain tests (unit and integration)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

import raystream as rs


def parity_tagger(version: int, name: str) -> Any:
    """A map_batches step that adds ``even`` (the count's parity) and ``version`` (which
    function wrote the row: a replacement tags with another version)."""

    @rs.map_batches(name=name)
    def tag(batch: pa.RecordBatch) -> pa.RecordBatch:
        even = pc.equal(pc.bit_wise_and(batch["count"], 1), 0)
        return batch.append_column("even", even).append_column(
            "version", pa.array([version] * batch.num_rows, pa.int64())
        )

    return tag
