"""A bucket on a local S3 server (moto's ThreadedMotoServer on 127.0.0.1, nothing leaves this
machine) for the tests of object-store paths."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def local_s3_bucket(bucket: str) -> Iterator[str]:
    """Start a local S3 server with ``bucket`` in it (credentials test/test, us-east-1); yields
    its endpoint ``host:port``; stops the server on exit."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        boto3.client(
            "s3",
            endpoint_url=f"http://{host}:{port}",
            aws_access_key_id="test",
            aws_secret_access_key="test",  # noqa: S106 - moto's dummy credentials
            region_name="us-east-1",
        ).create_bucket(Bucket=bucket)
        yield f"{host}:{port}"
    finally:
        server.stop()
