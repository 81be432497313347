"""The raystream exception tree.

::

    RaystreamError
    ├── ConfigError (ValueError)          bad option or parameter value
    │   ├── RescaleError                  a rescale that cannot be carried out
    │   └── ReconfigurationError          a replace / move of a running job refused or failed
    ├── DataflowDefinitionError (TypeError) misuse of the dataflow API, caught at definition time
    ├── SchemaError (ValueError)          input data of the wrong shape
    │   └── NullKeyError                  a key column holding nulls
    ├── SourceError                       a source that cannot be read (missing file, ...)
    ├── StateError                        keyed state that is not where it should be
    ├── CheckpointError                   checkpoint storage unusable, checkpoint missing or damaged
    ├── PluginNotFoundError (LookupError) an unknown strategy / policy name
    ├── JobNotFoundError (LookupError)    no running job of that name
    ├── ClusterError (ConnectionError)    a Ray cluster that cannot be reached or refuses us (auth)
    └── JobFailedError                    an operator instance failed while the job ran

Every message says what was expected, what was given, and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ClusterError",
    "ConfigError",
    "DataflowDefinitionError",
    "JobFailedError",
    "JobNotFoundError",
    "NullKeyError",
    "PluginNotFoundError",
    "RaystreamError",
    "ReconfigurationError",
    "RescaleError",
    "SchemaError",
    "PlacementError",
    "SourceError",
    "StateError",
]


class RaystreamError(Exception):
    """Base class of every error raystream raises on purpose."""


class ConfigError(RaystreamError, ValueError):
    """An option or parameter has a value raystream cannot use."""


class RescaleError(ConfigError):
    """A rescale request that cannot be carried out; the job keeps running."""


class ReconfigurationError(ConfigError):
    """A change to a running job (replace a function, move an instance) that cannot be carried
    out; refused before anything changed unless the message says otherwise."""


class PlacementError(ConfigError):
    """No node of the cluster can hold an instance with the resources its step asks for."""


class DataflowDefinitionError(RaystreamError, TypeError):
    """The dataflow API was used in a way that cannot work (caught when the flow is defined)."""


class SchemaError(RaystreamError, ValueError):
    """Input data does not have the columns or types the dataflow expects."""


class NullKeyError(SchemaError):
    """A key column holds nulls; every record needs a key to find its key group."""


class SourceError(RaystreamError):
    """A source cannot be opened or read."""


class StateError(RaystreamError):
    """Keyed state is missing, owned elsewhere, or inconsistent."""


class CheckpointError(RaystreamError):
    """Checkpoint storage cannot be used, or a checkpoint / savepoint is missing, damaged or does
    not fit the job restored from it."""


class PluginNotFoundError(RaystreamError, LookupError):
    """No plugin of that name is registered."""


class JobNotFoundError(RaystreamError, LookupError):
    """No running job of that name."""


class ClusterError(RaystreamError, ConnectionError):
    """A Ray cluster cannot be reached at the address tried, or refuses the request
    (token authentication)."""


class JobFailedError(RaystreamError):
    """An operator instance failed while the job was running."""
