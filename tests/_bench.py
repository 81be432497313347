"""Import a benchmark module (``bench.*``, not packaged) from the repository root, which is
not on ``sys.path`` under pytest's importlib mode, without leaving it there (the bare
``raystream/`` folder would shadow the installed package)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def import_bench(name: str) -> Any:
    root = str(REPO)
    added = root not in sys.path
    if added:
        sys.path.insert(0, root)
    try:
        return importlib.import_module(name)
    finally:
        if added:
            sys.path.remove(root)


def put_bench_on_path() -> None:
    """Make ``bench`` importable for the rest of the session (a test module that imports it at
    the top, also in an xdist worker that collected no other such module first). ``raystream``
    is imported from its install first, so the bare folder cannot shadow it afterwards."""
    import raystream  # noqa: F401 - cached in sys.modules before the root goes on sys.path

    root = str(REPO)
    if root not in sys.path:
        sys.path.append(root)
