"""The dataflow API: decorators turn functions into operators; a Dataflow is a frozen graph.

No Ray here. Example::

    import raystream as rs

    flow = rs.Dataflow("keycount", num_key_groups=128)

    @rs.keyed(state=rs.ValueState(int, default=0))
    def count(key, records, state):       # one key's records of a batch
        state.value += len(records)
        yield {"key": key, "count": state.value}

    (flow.source(rs.sources.generator(events=10_000, keys=100))
         .key_by("key")
         .apply(count)
         .sink(rs.sinks.collect()))

Operator forms:

* ``@rs.map``           fn(record: dict) -> dict
* ``@rs.filter``        fn(record: dict) -> bool
* ``@rs.flat_map``      fn(record: dict) -> iterable of dicts
* ``@rs.map_batches``   fn(batch: pa.RecordBatch) -> pa.RecordBatch | None   (vectorised)
* ``@rs.keyed``         fn(key, records: pa.RecordBatch, state) -> iterable of dicts / (key, value)
* ``@rs.keyed_batches`` fn(batch: rs.KeyedBatch, state) -> pa.RecordBatch | None (vectorised)
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa

from raystream.errors import DataflowDefinitionError
from raystream.keys import KeySpace
from raystream.state.spec import StateSpec, check_state_specs

__all__ = [
    "Dataflow",
    "KeySpec",
    "Operator",
    "Step",
    "Stream",
    "filter",
    "flat_map",
    "keyed",
    "keyed_batches",
    "map",
    "map_batches",
]

_STATELESS = ("map", "filter", "flat_map", "map_batches")
_KEYED = ("keyed", "keyed_batches")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class Operator:
    """A user function turned into an operator by a decorator; apply it with ``stream.apply``."""

    kind: str
    fn: Callable[..., Any]
    name: str
    state: dict[str, StateSpec] = field(default_factory=dict)
    parallelism: int | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calling the operator calls the function itself (handy in unit tests)."""
        return self.fn(*args, **kwargs)


def _positional_arity(fn: Callable[..., Any]) -> tuple[int, int | None]:
    """(required, maximum) positional parameters; maximum None with *args."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: trust the user
        return 0, None
    required = 0
    maximum: int | None = 0
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            maximum = None
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            if maximum is not None:
                maximum += 1
            if p.default is p.empty:
                required += 1
    return required, maximum


_SIGNATURES = {
    "map": "fn(record: dict) -> dict",
    "filter": "fn(record: dict) -> bool",
    "flat_map": "fn(record: dict) -> iterable of dicts",
    "map_batches": "fn(batch: pyarrow.RecordBatch) -> pyarrow.RecordBatch",
    "keyed": "fn(key, records, state) with state=..., fn(key, records) without",
    "keyed_batches": "fn(batch, state) with state=..., fn(batch) without",
}


def _check_arity(kind: str, fn: Callable[..., Any], name: str, has_state: bool) -> None:
    if not callable(fn):
        msg = f"@rs.{kind} needs a function, got {type(fn).__name__}: {fn!r}"
        raise DataflowDefinitionError(msg)
    want = {"keyed": 3 if has_state else 2, "keyed_batches": 2 if has_state else 1}.get(kind, 1)
    required, maximum = _positional_arity(fn)
    if required > want or (maximum is not None and maximum < want):
        got = f"{required}" if maximum == required else f"{required}..{maximum or 'any'}"
        msg = (
            f"step {name!r}: @rs.{kind} expects {_SIGNATURES[kind]} ({want} positional "
            f"argument(s)), but {getattr(fn, '__qualname__', fn)!r} takes {got}"
        )
        raise DataflowDefinitionError(msg)


def _decorator(kind: str) -> Callable[..., Any]:
    def decorate(
        fn: Callable[..., Any] | None = None,
        *,
        name: str | None = None,
        state: Any = None,
        parallelism: int | None = None,
    ) -> Any:
        def wrap(f: Callable[..., Any]) -> Operator:
            step_name = name or getattr(f, "__name__", kind)
            if kind not in _KEYED and state is not None:
                msg = f"step {step_name!r}: only @rs.keyed and @rs.keyed_batches take state="
                raise DataflowDefinitionError(msg)
            specs = check_state_specs(state, step_name) if kind in _KEYED else {}
            _check_arity(kind, f, step_name, bool(specs))
            return Operator(kind, f, step_name, specs, parallelism)

        return wrap(fn) if fn is not None else wrap

    decorate.__name__ = kind
    decorate.__doc__ = f"Decorate ``{_SIGNATURES[kind]}`` into a ``{kind}`` operator."
    return decorate


map = _decorator("map")  # noqa: A001 - the domain's word
filter = _decorator("filter")  # noqa: A001
flat_map = _decorator("flat_map")
map_batches = _decorator("map_batches")
keyed = _decorator("keyed")
keyed_batches = _decorator("keyed_batches")


@dataclass(frozen=True)
class KeySpec:
    """How a stream is keyed: by a column, or by a function of a RecordBatch (vectorised)."""

    column: str | None = None
    fn: Callable[[pa.RecordBatch], Any] | None = None
    per_record: bool = False

    @property
    def key_column(self) -> str:
        """The column that holds the key once the partitioner has run."""
        return self.column if self.column is not None else "_key"


@dataclass(frozen=True)
class Step:
    """One node of the logical graph."""

    name: str
    kind: str  # source | sink | map | filter | flat_map | map_batches | keyed | keyed_batches
    fn: Any  # the user function, the Source or the Sink
    upstream: tuple[str, ...] = ()
    key: KeySpec | None = None  # for keyed steps: how the input is keyed
    state: dict[str, StateSpec] = field(default_factory=dict)
    parallelism: int | None = None

    @property
    def is_keyed(self) -> bool:
        return self.kind in _KEYED


class Stream:
    """A stream of Arrow record batches out of one step; optionally keyed."""

    def __init__(
        self, flow: Dataflow, step: str, schema: pa.Schema | None, key: KeySpec | None = None
    ) -> None:
        self._flow = flow
        self.step = step
        self.schema = schema
        self.key = key

    def __repr__(self) -> str:
        keyed_by = f", keyed by {self.key.column or 'a function'}" if self.key else ""
        return f"Stream(from {self.step!r}{keyed_by})"

    # ---- keying ---------------------------------------------------------------------------
    def key_by(self, key: str | Callable[..., Any], *, per_record: bool = False) -> Stream:
        """Key the stream by a column name, or by ``fn(batch) -> array`` (``per_record=True``:
        ``fn(record: dict) -> key``)."""
        if isinstance(key, str):
            if self.schema is not None and key not in self.schema.names:
                msg = (
                    f"key_by({key!r}) after step {self.step!r}: no column {key!r}; the stream "
                    f"has columns {self.schema.names}"
                )
                raise DataflowDefinitionError(msg)
            return Stream(self._flow, self.step, self.schema, KeySpec(column=key))
        if callable(key):
            required, maximum = _positional_arity(key)
            if required > 1 or maximum == 0:
                msg = (
                    f"key_by(fn) after step {self.step!r}: fn must take one argument (a "
                    f"RecordBatch, or a record with per_record=True), got {key!r}"
                )
                raise DataflowDefinitionError(msg)
            return Stream(
                self._flow, self.step, self.schema, KeySpec(fn=key, per_record=per_record)
            )
        msg = f"key_by expects a column name or a function, got {type(key).__name__}: {key!r}"
        raise DataflowDefinitionError(msg)

    # ---- operators ------------------------------------------------------------------------
    def apply(
        self, op: Operator, *, name: str | None = None, parallelism: int | None = None
    ) -> Stream:
        """Add a decorated operator downstream of this stream."""
        if not isinstance(op, Operator):
            msg = (
                f"apply() expects an operator made with @rs.map, @rs.keyed, ..., got "
                f"{type(op).__name__}: {op!r}. Decorate the function first."
            )
            raise DataflowDefinitionError(msg)
        step_name = name or op.name
        if op.kind in _KEYED and self.key is None:
            msg = (
                f"step {step_name!r} is a keyed operator (@rs.{op.kind}) but its input stream from "
                f"{self.step!r} is not keyed; call .key_by(column) before .apply({step_name})"
            )
            raise DataflowDefinitionError(msg)
        step = Step(
            name=step_name,
            kind=op.kind,
            fn=op.fn,
            upstream=(self.step,),
            key=self.key if op.kind in _KEYED else None,
            state=op.state,
            parallelism=parallelism if parallelism is not None else op.parallelism,
        )
        self._flow._add(step)
        schema = self.schema if op.kind == "filter" else None
        return Stream(self._flow, step_name, schema)

    def map(self, fn: Callable[..., Any], *, name: str | None = None) -> Stream:
        return self.apply(map(fn, name=name or _auto(fn, "map")))

    def filter(self, fn: Callable[..., Any], *, name: str | None = None) -> Stream:
        return self.apply(filter(fn, name=name or _auto(fn, "filter")))

    def flat_map(self, fn: Callable[..., Any], *, name: str | None = None) -> Stream:
        return self.apply(flat_map(fn, name=name or _auto(fn, "flat_map")))

    def map_batches(self, fn: Callable[..., Any], *, name: str | None = None) -> Stream:
        return self.apply(map_batches(fn, name=name or _auto(fn, "map_batches")))

    def sink(self, sink: Any, *, name: str | None = None, parallelism: int | None = None) -> None:
        """End the stream in a sink (``rs.sinks.collect()``, ``rs.sinks.parquet(dir)``, ...)."""
        if not (hasattr(sink, "open") and callable(sink.open)):
            msg = f"sink() expects a sink such as rs.sinks.collect(), got {type(sink).__name__}: {sink!r}"
            raise DataflowDefinitionError(msg)
        step_name = name or f"sink_{sum(1 for s in self._flow.steps.values() if s.kind == 'sink')}"
        self._flow._add(Step(step_name, "sink", sink, (self.step,), parallelism=parallelism or 1))


def _auto(fn: Any, kind: str) -> str:
    base = getattr(fn, "__name__", kind)
    return kind if base == "<lambda>" else base


class Dataflow:
    """A named dataflow graph; steps are added through streams and frozen by :meth:`freeze`."""

    def __init__(self, name: str, *, num_key_groups: int = 128, sub_groups: int = 16) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            msg = (
                f"Dataflow name must be 1-64 characters of letters, digits, '_', '-', '.', "
                f"starting with a letter or '_', got {name!r}"
            )
            raise DataflowDefinitionError(msg)
        self.name = name
        self.key_space = KeySpace(num_key_groups, sub_groups)
        self.steps: dict[str, Step] = {}

    # decorators also reachable from the flow, as in the ARCHITECTURE example
    map = staticmethod(map)
    filter = staticmethod(filter)
    flat_map = staticmethod(flat_map)
    map_batches = staticmethod(map_batches)
    keyed = staticmethod(keyed)
    keyed_batches = staticmethod(keyed_batches)

    def __repr__(self) -> str:
        return f"Dataflow({self.name!r}, steps={list(self.steps)})"

    def source(
        self, source: Any, *, name: str = "source", parallelism: int | None = None
    ) -> Stream:
        """Start a stream from a source (``rs.sources.generator(...)``, ``rs.sources.parquet(...)``)."""
        if not (hasattr(source, "open") and callable(source.open)):
            msg = (
                f"source() expects a source such as rs.sources.parquet(path), got "
                f"{type(source).__name__}: {source!r}"
            )
            raise DataflowDefinitionError(msg)
        self._add(Step(name, "source", source, parallelism=parallelism or 1))
        schema = source.schema() if hasattr(source, "schema") else None
        return Stream(self, name, schema)

    def _add(self, step: Step) -> None:
        if not _NAME.match(step.name):
            msg = f"step name {step.name!r} must match {_NAME.pattern}"
            raise DataflowDefinitionError(msg)
        if step.name in self.steps:
            msg = (
                f"duplicate step name {step.name!r} in dataflow {self.name!r}; every step needs "
                f"a unique name: pass name=... to apply() (existing: {list(self.steps)})"
            )
            raise DataflowDefinitionError(msg)
        for up in step.upstream:
            if self.steps.get(up) is None or self.steps[up].kind == "sink":
                msg = f"step {step.name!r} reads from {up!r}, which is not a source or operator"
                raise DataflowDefinitionError(msg)
        if step.parallelism is not None:
            _check_step_parallelism(step.name, step.parallelism, step.is_keyed, self.key_space)
        self.steps[step.name] = step

    def with_parallelism(self, parallelism: dict[str, int] | None) -> dict[str, Step]:
        """Validated steps with parallelism filled in (default 1) and overridden by ``parallelism``."""
        parallelism = dict(parallelism or {})
        unknown = sorted(set(parallelism) - set(self.steps))
        if unknown:
            msg = (
                f"parallelism given for unknown step(s) {unknown}; the steps are {list(self.steps)}"
            )
            raise DataflowDefinitionError(msg)
        if not any(s.kind == "sink" for s in self.steps.values()):
            msg = f"dataflow {self.name!r} has no sink; end a stream with .sink(rs.sinks.collect())"
            raise DataflowDefinitionError(msg)
        out = {}
        for name, step in self.steps.items():
            p = parallelism.get(name, step.parallelism or 1)
            _check_step_parallelism(name, p, step.is_keyed, self.key_space)
            out[name] = replace(step, parallelism=p)
        return out


def _check_step_parallelism(name: str, p: Any, keyed: bool, key_space: KeySpace) -> None:
    from raystream.errors import ConfigError

    if not isinstance(p, int) or isinstance(p, bool) or p < 1:
        msg = f"parallelism of step {name!r} must be an int >= 1, got {p!r}"
        raise ConfigError(msg)
    if keyed and p > key_space.num_key_groups:
        msg = (
            f"parallelism of keyed step {name!r} must be at most the number of key groups "
            f"({key_space.num_key_groups}), got {p}. Create the Dataflow with a larger "
            "num_key_groups (up to 32768) to go higher."
        )
        raise ConfigError(msg)
