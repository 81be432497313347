"""Shared fixtures.

Ray is started at most once per test session, and only when a test asks for it (the
``ray_session`` fixture; ``tests/integration`` and ``tests/e2e`` request it automatically).
Unit tests never start Ray.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """A fresh embedded Ray for the whole session (never attaches to a cluster running here),
    shut down at the end; only what this fixture started is stopped."""
    import ray

    from raystream.runtime.actors import NAMESPACE

    started = False
    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            namespace=NAMESPACE,
            log_to_driver=False,
        )
        started = True
    try:
        yield
    finally:
        if started:
            ray.shutdown()
