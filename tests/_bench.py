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
