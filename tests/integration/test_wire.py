"""Through a real Ray actor call: a slice an instance sends arrives as its rows only (the
receiver holds no copy of the parent batch), equal to what was sent."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import ray

import raystream as rs
from raystream.runtime import wire

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session")]


@ray.remote(num_cpus=0)
class _Receiver:
    def take(self, piece: pa.RecordBatch) -> dict[str, Any]:
        return {
            "rows": piece.num_rows,
            "buffers": piece.get_total_buffer_size(),
            "keys": piece.column("key").to_pylist(),
        }


@ray.remote(num_cpus=0)
class _Sender:
    """Sends as an instance does: registered at start (``rs.ensure_ray`` in a driver)."""

    def __init__(self) -> None:
        wire.register()

    def send(self, receiver: Any, n: int, offset: int, rows: int) -> dict[str, Any]:
        batch = pa.record_batch({"key": pa.array(np.arange(n)), "pad": pa.array(np.zeros(n))})
        return ray.get(receiver.take.remote(batch.slice(offset, rows)))


def test_a_slice_sent_between_actors_arrives_as_its_rows() -> None:
    rs.job.ensure_ray()
    receiver, sender = _Receiver.remote(), _Sender.remote()
    try:
        got = ray.get(sender.send.remote(receiver, 200_000, 123_456, 1_000))
        assert got["rows"] == 1_000 and got["keys"] == list(range(123_456, 124_456))
        # 1,000 rows of two 8-byte columns, not the parent's 3.2 MB
        assert got["buffers"] < 64_000, got["buffers"]
        # the driver registered too (ensure_ray): its own call sends the rows only
        n = 200_000
        batch = pa.record_batch({"key": pa.array(np.arange(n)), "pad": pa.array(np.zeros(n))})
        got = ray.get(receiver.take.remote(batch.slice(7, 3)))
        assert got["keys"] == [7, 8, 9] and got["buffers"] < 64_000, got["buffers"]
    finally:
        for a in (receiver, sender):
            ray.kill(a)
