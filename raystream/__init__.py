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

from raystream import sinks, sources, spark  # noqa: E402
from raystream.dataflow import (  # noqa: E402
    ConnectedStreams,
    Dataflow,
    Operator,
    Stream,
    filter,
    flat_map,
    keyed,
    keyed_batches,
    map,
    map_batches,
)
from raystream.job import Job, JobResult, attach, run, start  # noqa: E402
from raystream.runtime.instance import RuntimeConfig  # noqa: E402
from raystream.runtime.messages import Watermark  # noqa: E402
from raystream.runtime.outputs import Outputs  # noqa: E402
from raystream.runtime.processors import KeyedBatch  # noqa: E402
from raystream.runtime.timers import FiredTimers  # noqa: E402
from raystream.state.handles import KeySet  # noqa: E402
from raystream.state.resident import ResidentStore  # noqa: E402
from raystream.state.spec import ListState, MapState, ResidentState, ValueState  # noqa: E402
from raystream.state_reader import StateTables, read_state  # noqa: E402
from raystream.upsert import read_upsert  # noqa: E402

__all__ += [
    "ConnectedStreams",
    "Dataflow",
    "FiredTimers",
    "Job",
    "JobResult",
    "KeySet",
    "KeyedBatch",
    "ListState",
    "MapState",
    "Operator",
    "Outputs",
    "ResidentState",
    "ResidentStore",
    "RuntimeConfig",
    "StateTables",
    "Stream",
    "ValueState",
    "Watermark",
    "attach",
    "filter",
    "flat_map",
    "keyed",
    "keyed_batches",
    "map",
    "map_batches",
    "read_state",
    "read_upsert",
    "run",
    "sinks",
    "sources",
    "spark",
    "start",
]

# last: the built-in operators and the test harness are written against the public API above
from raystream import operators, testing  # noqa: E402

__all__ += ["operators", "testing"]
