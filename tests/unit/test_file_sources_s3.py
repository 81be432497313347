"""File sources on an object store: S3 served by a local moto server (skipped without moto).
The oracle is pyarrow reading the same objects. No Ray."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

import raystream as rs

moto_server = pytest.importorskip("moto.server")


def test_s3_folder_glob_and_uri_read_every_object_once() -> None:
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"{host}:{port}"
        s3 = pafs.S3FileSystem(
            access_key="test",
            secret_key="test",
            endpoint_override=endpoint,
            scheme="http",
            region="us-east-1",
            allow_bucket_creation=True,
        )
        s3.create_dir("bucket")
        rng = np.random.default_rng(11)
        written = []
        for day in (1, 2):
            for part in range(2):
                n = int(rng.integers(30, 90))
                t = pa.table({"id": rng.integers(0, 10_000, n), "v": rng.random(n)})
                pq.write_table(
                    t, f"bucket/events/day={day}/p{part}.parquet", filesystem=s3, row_group_size=25
                )
                written.append(t.append_column("day", pa.array([day] * n, pa.int32())))
        s3.open_output_stream("bucket/events/_SUCCESS").close()
        want = pa.concat_tables(written).sort_by([("id", "ascending"), ("v", "ascending")])

        uri = (
            f"s3://test:test@bucket/events/**/*.parquet?endpoint_override={endpoint}"
            "&scheme=http&region=us-east-1"
        )
        for src in (rs.sources.parquet("bucket/events", filesystem=s3), rs.sources.parquet(uri)):
            assert len(src.files) == 4 and all(
                f.startswith("bucket/events/day=") for f in src.files
            )
            parts = []
            for i in range(3):
                reader = src.open(i, 3)
                while (b := reader.read(40)) is not None:
                    parts.append(b)
            got = pa.Table.from_batches(parts).sort_by([("id", "ascending"), ("v", "ascending")])
            assert got.equals(want)
    finally:
        server.stop()
