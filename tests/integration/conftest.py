"""Integration tests: every test here runs against one local Ray, started once per session.

Functions defined in these test modules and in ``_helpers.py`` (operators, sinks) travel to Ray
workers pickled *by value*, so a worker never has to import ``tests.integration.*`` (which would
depend on the worker's working directory and ``sys.path``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _modules_here() -> list[object]:
    out = []
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve().parent == HERE and not file.endswith("conftest.py"):
            out.append(module)
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from ray import cloudpickle

    for item in items:
        if Path(item.path).resolve().parent == HERE:
            item.add_marker(pytest.mark.integration)
            # No blanket reruns: these tests check exactness and order, and a rerun would hide
            # a failure that happens only sometimes. A test that depends on timing waits for
            # conditions instead.
    for module in _modules_here():
        cloudpickle.register_pickle_by_value(module)


@pytest.fixture(autouse=True)
def _ray(ray_session: None) -> None:
    """Every integration test runs with the session's Ray."""
