"""raystream: elastic, stateful stream processing on Ray.

Quick start::

    import raystream as rs

    flow = rs.Dataflow("keycount")
    counts = flow.source(rs.sources.generator(events=1_000_000, keys=1000)).key_by("key")
    ...
"""

from __future__ import annotations

import time as _time

_IMPORT_STARTED_AT = _time.time()  # start-up timeline (raystream.runtime.startup)

import importlib.util as _ilu  # noqa: E402
import os as _os  # noqa: E402

# The source tree maps operators/, migration/ and autoscaler/ into this package (setup.cfg
# package_dir). Run from the repository root without an editable install, the bare raystream/
# folder shadows the installed package and those subpackages vanish: say how to fix it.
if _ilu.find_spec("raystream.operators") is None:  # pragma: no cover - depends on the install
    _msg = (
        f"raystream was imported from {_os.path.dirname(__file__)!r}, a source folder that shadows "
        "the installed package, so raystream.operators cannot be found. Install the checkout "
        "in editable mode (`pip install -e .`, what `make test` does), or run from another "
        "directory (for `ray job submit`, use your job's folder as --working-dir, not the "
        "raystream repository)."
    )
    raise ImportError(_msg)

from raystream.errors import (  # noqa: E402
    CheckpointError,
    ConfigError,
    DataflowDefinitionError,
    InternalError,
    JobFailedError,
    JobNotFoundError,
    NullKeyError,
    PlacementError,
    PluginNotFoundError,
    RaystreamError,
    ReconfigurationError,
    RescaleError,
    SchemaError,
    SourceError,
    StateError,
)
from raystream.keys import KeyGroupRange, KeySpace, RoutingTable  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataflowDefinitionError",
    "InternalError",
    "JobFailedError",
    "JobNotFoundError",
    "KeyGroupRange",
    "KeySpace",
    "NullKeyError",
    "PlacementError",
    "PluginNotFoundError",
    "RaystreamError",
    "ReconfigurationError",
    "RescaleError",
    "RoutingTable",
    "SchemaError",
    "SourceError",
    "StateError",
    "__version__",
]

# The rest of the public API is loaded on first use (PEP 562): an operator instance's actor
# imports raystream.runtime.actors, which brings this package in, and a worker that runs one
# step needs neither the job driver nor the connectors of every other step (importing them
# all made each actor's start-up ~0.2 s of CPU longer).
_LAZY: dict[str, tuple[str, str | None]] = {
    **{n: ("raystream.dataflow", n) for n in (
        "ConnectedStreams", "Dataflow", "Operator", "Stream", "filter", "flat_map", "keyed",
        "keyed_batches", "map", "map_batches",
    )},
    **{n: ("raystream.job", n) for n in ("Job", "JobResult", "attach", "run", "start")},
    "RuntimeConfig": ("raystream.runtime.instance", "RuntimeConfig"),
    "Watermark": ("raystream.runtime.messages", "Watermark"),
    "Outputs": ("raystream.runtime.outputs", "Outputs"),
    "KeyedBatch": ("raystream.runtime.processors", "KeyedBatch"),
    "FiredTimers": ("raystream.runtime.timers", "FiredTimers"),
    "KeySet": ("raystream.state.handles", "KeySet"),
    "ResidentStore": ("raystream.state.resident", "ResidentStore"),
    **{n: ("raystream.state.spec", n) for n in (
        "ListState", "MapState", "ResidentState", "ValueState",
    )},
    "StateTables": ("raystream.state_reader", "StateTables"),
    "read_state": ("raystream.state_reader", "read_state"),
    "read_upsert": ("raystream.upsert", "read_upsert"),
    # subpackages and modules of the API: the built-in operators and the test harness are
    # written against the names above
    **{n: (f"raystream.{n}", None) for n in ("sinks", "sources", "spark", "operators", "testing")},
}  # fmt: skip

__all__ += sorted(_LAZY)


def __getattr__(name: str) -> object:
    """A public name (or any submodule, as ``rs.metrics``) on first use."""
    import importlib

    module, attr = _LAZY.get(name, (f"raystream.{name}", None))
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module or name in _LAZY:
            raise
        msg = f"module 'raystream' has no attribute {name!r}"
        raise AttributeError(msg) from None
    value = loaded if attr is None else getattr(loaded, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
