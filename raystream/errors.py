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
    ├── JobFailedError                    an operator instance failed while the job ran
    └── InternalError (RuntimeError)      an invariant of raystream itself broke (a bug)

Every message says what was expected, what was given, and how to fix it.
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = [
    "CheckpointError",
    "InternalError",
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
    """An operator instance failed while the job was running.

    Where the failure came from a step's instance, ``step``, ``index`` (the instance),
    ``key`` (``repr`` of the key, or of the batch's first key, being processed; None if
    unknown),
    ``cause`` (``"Type: message"`` of the original exception) and ``remote_traceback`` tell
    where; ``str(error)`` holds all of them, the traceback last.
    """

    step: str | None = None
    index: int | None = None
    key: str | None = None
    cause: str | None = None
    remote_traceback: str | None = None

    @classmethod
    def of_instance(
        cls,
        job: str,
        step: str,
        index: int,
        error: str,
        *,
        context: tuple[str, str] | list[str] | None = None,
        traceback: str | None = None,
        where: str = "the instance's actor",
    ) -> JobFailedError:
        """The error for instance ``index`` of ``step`` failing with ``error``; the message::

        job 'wc' failed in step 'count', instance 1: ZeroDivisionError: division by zero
          while processing key 'a'

        Traceback of the failure (in the instance's actor):
        ...
        """
        msg = f"job {job!r} failed in step {step!r}, instance {index}: {error}"
        where_in = describe_context(context)
        if where_in is not None:
            msg += f"\n  {where_in}"
        if traceback:
            msg += f"\n\nTraceback of the failure (in {where}):\n{traceback.rstrip()}"
        exc = cls(msg)
        key = context[1] if context and context[0] in ("key", "batch", "timer") else None
        exc.step, exc.index, exc.key, exc.cause = step, index, key, error
        exc.remote_traceback = traceback
        return exc


class InternalError(RaystreamError, RuntimeError):
    """An invariant of raystream itself does not hold: a bug in raystream, not in the job.
    Please report it with the message and traceback."""


CONTEXT_ATTR = "__raystream_context__"
_CONTEXT = {
    "key": "while processing key {}",
    "batch": "while processing a batch whose first key is {}",
    "timer": "while firing a timer of key {}",
    "record": "while processing record {}",
    "rows": "while processing rows {} of a batch",
}


def note_context(exc: BaseException, kind: str, value: Any) -> None:
    """Remember on ``exc`` what a user function was processing when it raised: ``kind`` is
    ``"key"``, ``"batch"`` (its first key), ``"timer"`` (its key) or ``"record"``. The innermost
    note wins; values show as ``repr`` cut to 200 characters."""
    if getattr(exc, CONTEXT_ATTR, None) is not None:
        return
    text = repr(value)
    text = text if len(text) <= 200 else text[:197] + "..."
    # an exception type with __slots__ takes no attribute: no note then
    with contextlib.suppress(AttributeError, TypeError):
        setattr(exc, CONTEXT_ATTR, (kind, text))


def context_of(exc: BaseException | None) -> tuple[str, str] | None:
    """``(kind, repr)`` that :func:`note_context` put on ``exc``, or None."""
    ctx = getattr(exc, CONTEXT_ATTR, None) if exc is not None else None
    return tuple(ctx) if ctx else None  # type: ignore[return-value]


def describe_context(context: tuple[str, str] | list[str] | None) -> str | None:
    """``("key", "'a'")`` -> ``"while processing key 'a'"``."""
    if not context:
        return None
    kind, text = context
    return _CONTEXT.get(kind, kind + " {}").format(text)
