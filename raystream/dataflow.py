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

The four stateless forms also take ``async def`` functions, for I/O (a Ray actor or Ray Serve
call, an HTTP lookup): ``@rs.map(concurrency=64, timeout_s=5)`` awaits up to 64 calls of an
instance at once and keeps the records' order (see :class:`AsyncCalls`).

Event time and several inputs::

    events = flow.source(src, event_time="ts", max_out_of_orderness_ms=500)  # watermarks
    both = events.union(more_events)                        # same schema, one stream
    joined = clicks.key_by("user").connect(views.key_by("user")).apply(join_op)  # batch.input
    @rs.keyed_batches(state=rs.ValueState(int, default=0), on_timer=fire)  # timers
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
from raystream.placement import ActorOptions
from raystream.runtime.watermarks import EventTimeSpec
from raystream.state.spec import StateSpec, check_state_specs

__all__ = [
    "AsyncCalls",
    "ConnectedStreams",
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
DEFAULT_CONCURRENCY = 32  # calls of an async stateless function an instance awaits at once
_KEYED = ("keyed", "keyed_batches")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class AsyncCalls:
    """How an instance runs an ``async def`` stateless function (Flink's async I/O, ordered).

    The records of a batch are handed to the function as they come, at most ``concurrency``
    calls awaited at once per instance (default 32; ``@rs.map_batches``: the batch cut into
    ``concurrency`` parts of about equal size, default 1, the whole batch); the outputs leave
    in the records' order once every call of the batch returned. A batch is done before the
    instance takes the next one, so a checkpoint barrier, a watermark or a rescale never passes
    a call in flight: after a recovery the calls for the records after the checkpoint are made
    again (as in Flink, they should be idempotent). The calls run on the instance's event loop:
    a blocking call inside them holds every other call up (use ``await``, or
    ``asyncio.to_thread``).
    ``timeout_s``: a call that takes longer fails the step (and so the job, or its recovery)
    with a :class:`TimeoutError` naming the record; ``None`` waits as long as it takes.
    ``retries``: a call that raised or timed out is made again up to this many times, after
    ``retry_backoff_s``, doubling each time (Flink's async retry strategy, on any exception).
    """

    concurrency: int = DEFAULT_CONCURRENCY
    timeout_s: float | None = None
    retries: int = 0
    retry_backoff_s: float = 0.1

    def __post_init__(self) -> None:
        c = self.concurrency
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            msg = f"concurrency must be an int >= 1 (calls awaited at once), got {c!r}"
            raise DataflowDefinitionError(msg)
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, int | float) or t <= 0):
            msg = f"timeout_s must be a number of seconds > 0, or None (no limit), got {t!r}"
            raise DataflowDefinitionError(msg)
        r = self.retries
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            msg = f"retries must be an int >= 0 (calls made again after a failure), got {r!r}"
            raise DataflowDefinitionError(msg)
        b = self.retry_backoff_s
        if isinstance(b, bool) or not isinstance(b, int | float) or b < 0:
            msg = f"retry_backoff_s must be a number of seconds >= 0, got {b!r}"
            raise DataflowDefinitionError(msg)


@dataclass(frozen=True)
class Operator:
    """A user function turned into an operator by a decorator; apply it with ``stream.apply``."""

    kind: str
    fn: Callable[..., Any]
    name: str
    state: dict[str, StateSpec] = field(default_factory=dict)
    parallelism: int | None = None
    on_timer: Callable[..., Any] | None = None
    async_calls: AsyncCalls | None = None  # an async def stateless function: how it is awaited

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
    "keyed": (
        "fn(key, records, state) with state=..., fn(key, records) without, and a last "
        "argument timers with on_timer="
    ),
    "keyed_batches": "fn(batch, state) with state=..., fn(batch) without",
}


def _check_arity(
    kind: str, fn: Callable[..., Any], name: str, has_state: bool, timed: bool = False
) -> None:
    if not callable(fn):
        msg = f"@rs.{kind} needs a function, got {type(fn).__name__}: {fn!r}"
        raise DataflowDefinitionError(msg)
    want = {"keyed": 3 if has_state else 2, "keyed_batches": 2 if has_state else 1}.get(kind, 1)
    want += kind == "keyed" and timed  # the per-key form gets the key's timers last
    required, maximum = _positional_arity(fn)
    if required > want or (maximum is not None and maximum < want):
        got = f"{required}" if maximum == required else f"{required}..{maximum or 'any'}"
        msg = (
            f"step {name!r}: @rs.{kind} expects {_SIGNATURES[kind]} ({want} positional "
            f"argument(s)), but {getattr(fn, '__qualname__', fn)!r} takes {got}"
        )
        raise DataflowDefinitionError(msg)


def is_async_function(fn: Any) -> bool:
    """``async def`` (also a callable object whose ``__call__`` is, or a partial of one)."""
    while hasattr(fn, "func") and hasattr(fn, "args"):  # functools.partial
        fn = fn.func
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(type(fn), "__call__", None)
    return not inspect.isfunction(fn) and call is not None and inspect.iscoroutinefunction(call)


def _async_calls(kind: str, fn: Any, name: str, options: dict[str, Any]) -> AsyncCalls | None:
    """How ``fn`` is awaited (``options``: the decorator's concurrency=, timeout_s=, retries=,
    retry_backoff_s= that were given), or None for a synchronous function."""
    if not is_async_function(fn):
        if inspect.isasyncgenfunction(fn):
            msg = (
                f"step {name!r}: {getattr(fn, '__qualname__', fn)!r} is an async generator; "
                f"@rs.{kind} takes an async def function that returns its result"
                + (" (a list of dicts for @rs.flat_map)" if kind == "flat_map" else "")
            )
            raise DataflowDefinitionError(msg)
        if options:
            given = f"{next(iter(options))}="
            msg = (
                f"step {name!r}: {given} is for async def functions (calls awaited at once); "
                f"{getattr(fn, '__qualname__', fn)!r} is synchronous. Declare it async def, "
                f"or leave out {given}"
            )
            raise DataflowDefinitionError(msg)
        return None
    if kind not in _STATELESS:
        msg = (
            f"step {name!r}: @rs.{kind} takes a synchronous function (its state is read and "
            f"written while it runs); {getattr(fn, '__qualname__', fn)!r} is async def. Do the "
            "I/O in an async @rs.map / @rs.map_batches before key_by, and keep the keyed "
            "function synchronous"
        )
        raise DataflowDefinitionError(msg)
    # a batch function gets the whole batch unless told otherwise
    default = 1 if kind == "map_batches" else DEFAULT_CONCURRENCY
    return AsyncCalls(**{"concurrency": default, **options})


def _decorator(kind: str) -> Callable[..., Any]:
    def decorate(
        fn: Callable[..., Any] | None = None,
        *,
        name: str | None = None,
        state: Any = None,
        parallelism: int | None = None,
        on_timer: Callable[..., Any] | None = None,
        concurrency: int | None = None,
        timeout_s: float | None = None,
        retries: int | None = None,
        retry_backoff_s: float | None = None,
    ) -> Any:
        given = {
            k: v
            for k, v in (
                ("concurrency", concurrency),
                ("timeout_s", timeout_s),
                ("retries", retries),
                ("retry_backoff_s", retry_backoff_s),
            )
            if v is not None
        }

        def wrap(f: Callable[..., Any]) -> Operator:
            step_name = name or getattr(f, "__name__", kind)
            if kind not in _KEYED and state is not None:
                msg = f"step {step_name!r}: only @rs.keyed and @rs.keyed_batches take state="
                raise DataflowDefinitionError(msg)
            specs = check_state_specs(state, step_name) if kind in _KEYED else {}
            _check_arity(kind, f, step_name, bool(specs), on_timer is not None)
            if on_timer is not None:
                _check_on_timer(kind, on_timer, step_name, bool(specs))
                if is_async_function(on_timer):
                    msg = (
                        f"step {step_name!r}: on_timer must be a synchronous function (it reads "
                        "and writes the key's state); it is async def"
                    )
                    raise DataflowDefinitionError(msg)
            calls = _async_calls(kind, f, step_name, given)
            return Operator(kind, f, step_name, specs, parallelism, on_timer, calls)

        return wrap(fn) if fn is not None else wrap

    decorate.__name__ = kind
    decorate.__doc__ = f"Decorate ``{_SIGNATURES[kind]}`` into a ``{kind}`` operator."
    return decorate


def _check_on_timer(kind: str, fn: Any, name: str, has_state: bool) -> None:
    """``on_timer``: ``fn(timers: rs.FiredTimers[, state])`` for @rs.keyed_batches,
    ``fn(key, timestamp[, state], timers)`` (yielding rows) for @rs.keyed."""
    if kind not in _KEYED:
        msg = f"step {name!r}: on_timer= is for @rs.keyed_batches and @rs.keyed, not @rs.{kind}"
        raise DataflowDefinitionError(msg)
    if kind == "keyed_batches":
        want = 2 if has_state else 1
        form = f"fn(timers: rs.FiredTimers{', state' * has_state})"
    else:
        want = 4 if has_state else 3
        form = f"fn(key, timestamp{', state' * has_state}, timers)"
    required, maximum = _positional_arity(fn) if callable(fn) else (-1, -1)
    if required < 0 or required > want or (maximum is not None and maximum < want):
        msg = (
            f"step {name!r}: on_timer must be {form} ({want} positional argument(s)), got {fn!r}"
        )
        raise DataflowDefinitionError(msg)


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
    on_timer: Callable[..., Any] | None = None  # keyed_batches: fn(timers, state)
    event_time: EventTimeSpec | None = None  # sources: event-time column and watermarks
    inputs: tuple[int, ...] = ()  # two-input keyed steps: input index of each upstream step
    keys: tuple[KeySpec, ...] = ()  # two-input keyed steps: how each input is keyed
    ports: tuple[str, ...] = ()  # per upstream step: which of its outputs ('' main, or a side)
    actor: ActorOptions = field(default_factory=ActorOptions)  # Ray actor options, placement
    chain: bool = True  # may share an actor with its neighbours (raystream.chaining)
    async_calls: AsyncCalls | None = None  # an async def stateless function: how it is awaited

    @property
    def is_keyed(self) -> bool:
        return self.kind in _KEYED

    @property
    def input_keys(self) -> tuple[KeySpec, ...]:
        """How each input is keyed (one entry, ``key``, for a single-input keyed step)."""
        if self.keys:
            return self.keys
        return (self.key,) if self.key is not None else ()

    def input_of(self, upstream: str) -> int:
        """Which input (0 or 1) the records of step ``upstream`` are."""
        if not self.inputs:
            return 0
        return self.inputs[self.upstream.index(upstream)]

    def port_for(self, upstream: str) -> str:
        """Which output of step ``upstream`` this step reads: '' (main) or a side output."""
        return self.ports[self.upstream.index(upstream)] if self.ports else ""

    def key_for(self, upstream: str) -> KeySpec | None:
        """How the records from step ``upstream`` are keyed on their way into this step."""
        keys = self.input_keys
        return keys[self.input_of(upstream)] if keys else None


class Stream:
    """A stream of Arrow record batches out of one step; optionally keyed."""

    def __init__(
        self,
        flow: Dataflow,
        step: str,
        schema: pa.Schema | None,
        key: KeySpec | None = None,
        upstream: tuple[str, ...] = (),
        ports: tuple[str, ...] = (),
    ) -> None:
        self._flow = flow
        self.step = step
        self.schema = schema
        self.key = key
        self.upstream = upstream or (step,)  # the steps whose outputs make this stream
        self.ports = ports or ("",) * len(self.upstream)  # '' main output, else a side output

    def __repr__(self) -> str:
        keyed_by = f", keyed by {self.key.column or 'a function'}" if self.key else ""
        return f"Stream(from {self.step!r}{keyed_by})"

    def _with(self, schema: pa.Schema | None, key: KeySpec | None) -> Stream:
        return Stream(self._flow, self.step, schema, key, self.upstream, self.ports)

    @property
    def _step_ports(self) -> tuple[str, ...]:
        return self.ports if any(self.ports) else ()

    def side_output(self, name: str) -> Stream:
        """The records step ``self.step`` returned under ``name`` in ``rs.Outputs(...)``.
        Example::

            # count_on_time returns rs.Outputs(main=..., late=...)
            counted = events.key_by("key").apply(count_on_time)
            counted.sink(rs.sinks.collect(), name="counts")
            counted.side_output("late").sink(rs.sinks.collect(), name="late")
        """
        from raystream.runtime.outputs import check_port_name

        check_port_name(name)
        step = self._flow.steps.get(self.step)
        if len(self.upstream) != 1 or self.ports[0] or step is None or step.kind == "source":
            msg = (
                f"side_output({name!r}) needs the output stream of one operator step, got "
                f"{self!r}; call it on what apply() returned"
            )
            raise DataflowDefinitionError(msg)
        return Stream(self._flow, f"{self.step}.{name}", None, None, (self.step,), (name,))

    def options(self, **actor_options: Any) -> Stream:
        """Ray actor options for the instances of the step that makes this stream:
        ``num_cpus``, ``num_gpus``, ``memory`` (bytes), ``resources`` (custom, a dict),
        ``scheduling_strategy`` and ``runtime_env`` (Ray's: ``env_vars``, ``pip``,
        ``working_dir``, ...; merged by Ray with the job's; a step with one gets no warm
        standby actor). Without a strategy raystream spreads the step's instances over the
        nodes that have room for them. ``chain=False`` keeps the step out of operator chains
        (its own actors; see :mod:`raystream.chaining`). Unknown options or runtime_env keys
        raise :class:`ConfigError` here. Example::

            counts = events.key_by("user").apply(count).options(num_cpus=1)
            parsed = raw.map(parse).options(runtime_env={"env_vars": {"TZ": "UTC"}})
            tagged = events.map(tag).options(chain=False)
        """
        if len(self.upstream) != 1 or self.ports[0] or self.step not in self._flow.steps:
            msg = (
                f"options() sets the actor options of one step; {self!r} is not the output of "
                "one step. Call it on what source() or apply() returned, or use "
                "flow.options(step_name, ...)"
            )
            raise DataflowDefinitionError(msg)
        self._flow.options(self.step, **actor_options)
        return self

    # ---- several inputs -------------------------------------------------------------------
    def union(self, *others: Stream) -> Stream:
        """One stream of the records of this stream and ``others`` (same schema, any order
        between them). Example::

            both = flow.source(a, name="a").union(flow.source(b, name="b"))
            both.key_by("key").apply(count).sink(rs.sinks.collect())
        """
        streams = (self, *others)
        upstream: list[str] = []
        ports: list[str] = []
        for st in streams:
            if not isinstance(st, Stream) or st._flow is not self._flow:
                msg = f"union() takes streams of the same Dataflow, got {st!r}"
                raise DataflowDefinitionError(msg)
            if st.key is not None:
                msg = f"union(): {st!r} is keyed; union the streams first, then key_by"
                raise DataflowDefinitionError(msg)
            for up in st.upstream:
                if up in upstream:
                    msg = f"union(): step {up!r} is in the union twice; each stream once"
                    raise DataflowDefinitionError(msg)
                upstream.append(up)
            ports += st.ports
        known = [st for st in streams if st.schema is not None]
        for st in known[1:]:
            diff = _schema_diff(known[0].schema, st.schema)  # type: ignore[arg-type]
            if diff:
                msg = (
                    f"union(): streams from {known[0].step!r} and {st.step!r} must have the same "
                    f"schema; {diff}. Select or cast columns with map_batches first."
                )
                raise DataflowDefinitionError(msg)
        schema = known[0].schema if len(known) == len(streams) else None
        name = "union(" + ", ".join(upstream) + ")"
        return Stream(self._flow, name, schema, None, tuple(upstream), tuple(ports))

    def connect(self, other: Stream) -> ConnectedStreams:
        """Two keyed streams into one keyed step with shared state: ``.apply(op)`` adds it.

        The keys of both sides must be of one type; in ``op`` a batch holds records of one side
        only, ``batch.input`` says which (0: this stream, 1: ``other``). Example::

            @rs.keyed_batches(state=rs.ValueState(int, default=0))
            def balance(batch, state):
                sign = 1 if batch.input == 0 else -1
                new = state.get(batch.keys) + sign * batch.reduce("amount", "sum")
                state.put(batch.keys, new)
                return batch.output({"balance": new})

            deposits.key_by("account").connect(withdrawals.key_by("account")).apply(balance)
        """
        if not isinstance(other, Stream) or other._flow is not self._flow:
            msg = f"connect() takes a stream of the same Dataflow, got {other!r}"
            raise DataflowDefinitionError(msg)
        if self.key is None or other.key is None:
            side = "this stream" if self.key is None else "the other stream"
            msg = f"connect(): {side} is not keyed; call .key_by(...) on both sides first"
            raise DataflowDefinitionError(msg)
        shared = set(self.upstream) & set(other.upstream)
        if shared:
            msg = (
                f"connect(): step(s) {sorted(shared)} feed both sides; put a map step on one "
                "side so each input comes from its own steps"
            )
            raise DataflowDefinitionError(msg)
        a = _key_type(self)
        b = _key_type(other)
        if a is not None and b is not None and _key_family(a) != _key_family(b):
            msg = (
                f"connect(): the keys must have one type, but {self.key.column!r} is {a} and "
                f"{other.key.column!r} is {b}; cast one side with map_batches first"
            )
            raise DataflowDefinitionError(msg)
        return ConnectedStreams(self, other)

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
            return self._with(self.schema, KeySpec(column=key))
        if callable(key):
            required, maximum = _positional_arity(key)
            if required > 1 or maximum == 0:
                msg = (
                    f"key_by(fn) after step {self.step!r}: fn must take one argument (a "
                    f"RecordBatch, or a record with per_record=True), got {key!r}"
                )
                raise DataflowDefinitionError(msg)
            return self._with(self.schema, KeySpec(fn=key, per_record=per_record))
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
            upstream=self.upstream,
            key=self.key if op.kind in _KEYED else None,
            state=op.state,
            parallelism=parallelism if parallelism is not None else op.parallelism,
            on_timer=op.on_timer,
            ports=self._step_ports,
            async_calls=op.async_calls,
        )
        self._flow._add(step)
        schema = self.schema if op.kind == "filter" else None
        return Stream(self._flow, step_name, schema)

    def map(self, fn: Callable[..., Any], *, name: str | None = None, **aio: Any) -> Stream:
        """``fn(record) -> dict`` per record (``aio``: see :meth:`_stateless`)."""
        return self._stateless(map, fn, name, aio)

    def filter(self, fn: Callable[..., Any], *, name: str | None = None, **aio: Any) -> Stream:
        """The records for which ``fn(record)`` is true."""
        return self._stateless(filter, fn, name, aio)

    def flat_map(self, fn: Callable[..., Any], *, name: str | None = None, **aio: Any) -> Stream:
        """``fn(record) -> iterable of dicts`` per record."""
        return self._stateless(flat_map, fn, name, aio)

    def map_batches(
        self, fn: Callable[..., Any], *, name: str | None = None, **aio: Any
    ) -> Stream:
        """``fn(batch) -> RecordBatch`` per batch (vectorised)."""
        return self._stateless(map_batches, fn, name, aio)

    def _stateless(
        self, decorator: Callable[..., Operator], fn: Any, name: str | None, aio: dict[str, Any]
    ) -> Stream:
        """``aio``, for an ``async def`` fn: concurrency=, timeout_s=, retries=,
        retry_backoff_s= (see :class:`AsyncCalls`)."""
        kind = decorator.__name__
        return self.apply(decorator(fn, name=name or _auto(fn, kind), **aio))

    def sink(self, sink: Any, *, name: str | None = None, parallelism: int | None = None) -> None:
        """End the stream in a sink (``rs.sinks.collect()``, ``rs.sinks.parquet(dir)``, ...)."""
        if not (hasattr(sink, "open") and callable(sink.open)):
            msg = f"sink() expects a sink such as rs.sinks.collect(), got {type(sink).__name__}: {sink!r}"
            raise DataflowDefinitionError(msg)
        check = getattr(sink, "check_schema", None)
        if callable(check) and self.schema is not None:  # e.g. partition columns, before the job
            check(self.schema)
        step_name = name or f"sink_{sum(1 for s in self._flow.steps.values() if s.kind == 'sink')}"
        self._flow._add(
            Step(
                step_name,
                "sink",
                sink,
                self.upstream,
                parallelism=parallelism or 1,
                ports=self._step_ports,
            )
        )


class ConnectedStreams:
    """Two keyed streams, made by ``a.key_by(...).connect(b.key_by(...))``."""

    def __init__(self, first: Stream, second: Stream) -> None:
        self.first = first
        self.second = second

    def __repr__(self) -> str:
        return f"ConnectedStreams({self.first!r}, {self.second!r})"

    def apply(
        self, op: Operator, *, name: str | None = None, parallelism: int | None = None
    ) -> Stream:
        """Add keyed operator ``op`` with both streams as inputs (``batch.input`` 0 or 1)."""
        if not isinstance(op, Operator) or op.kind not in _KEYED:
            msg = (
                f"ConnectedStreams.apply() expects a keyed operator (@rs.keyed_batches or "
                f"@rs.keyed), got {op!r}"
            )
            raise DataflowDefinitionError(msg)
        a, b = self.first, self.second
        assert a.key is not None and b.key is not None
        step_name = name or op.name
        step = Step(
            name=step_name,
            kind=op.kind,
            fn=op.fn,
            upstream=a.upstream + b.upstream,
            key=a.key,
            state=op.state,
            parallelism=parallelism if parallelism is not None else op.parallelism,
            on_timer=op.on_timer,
            inputs=(0,) * len(a.upstream) + (1,) * len(b.upstream),
            keys=(a.key, b.key),
            ports=(a.ports + b.ports) if any(a.ports + b.ports) else (),
        )
        a._flow._add(step)
        return Stream(a._flow, step_name, None)


def _key_type(stream: Stream) -> pa.DataType | None:
    key = stream.key
    if key is None or key.column is None or stream.schema is None:
        return None
    if key.column not in stream.schema.names:
        return None
    return stream.schema.field(key.column).type


def _key_family(t: pa.DataType) -> str:
    """Key types that hash alike (ints become int64, strings and large strings one type)."""
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_dictionary(t):
        return _key_family(t.value_type)
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "binary"
    return str(t)


def _schema_diff(a: pa.Schema, b: pa.Schema) -> str:
    """'' if the schemas have the same column names and types, else what differs."""
    parts = []
    only_a = [n for n in a.names if n not in b.names]
    only_b = [n for n in b.names if n not in a.names]
    if only_a:
        parts.append(f"only the first has {only_a}")
    if only_b:
        parts.append(f"only the second has {only_b}")
    types = [
        f"{n}: {a.field(n).type} vs {b.field(n).type}"
        for n in a.names
        if n in b.names and a.field(n).type != b.field(n).type
    ]
    if types:
        parts.append(f"types differ ({', '.join(types)})")
    if not parts and a.names != b.names:
        parts.append(f"column order differs ({a.names} vs {b.names})")
    return "; ".join(parts)


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
        self,
        source: Any,
        *,
        name: str = "source",
        parallelism: int | None = None,
        event_time: str | None = None,
        max_out_of_orderness_ms: int = 0,
        watermark_idle_ms: float | None = None,
        watermark: Callable[[pa.RecordBatch], Any] | None = None,
    ) -> Stream:
        """Start a stream from a source (``rs.sources.generator(...)``, ``rs.sources.parquet(...)``).

        ``event_time="col"`` (a timestamp or int64 ms column) sets every record's ``event_time``
        from that column, and the source emits watermarks: the largest event time seen minus
        ``max_out_of_orderness_ms`` minus 1 (or ``watermark(batch) -> int ms``, if given).
        After ``watermark_idle_ms`` without rows, the source is idle and does not hold
        downstream watermarks back. Without ``event_time`` records get their ingest time and
        the only watermark is the end of input. Example::

            flow.source(rs.sources.parquet("trips"), event_time="dateTime",
                        max_out_of_orderness_ms=2_000, watermark_idle_ms=5_000)
        """
        if not (hasattr(source, "open") and callable(source.open)):
            msg = (
                f"source() expects a source such as rs.sources.parquet(path), got "
                f"{type(source).__name__}: {source!r}"
            )
            raise DataflowDefinitionError(msg)
        schema = source.schema() if hasattr(source, "schema") else None
        spec = None
        if event_time is not None:
            if not isinstance(event_time, str):
                msg = f"event_time= expects a column name, got {event_time!r}"
                raise DataflowDefinitionError(msg)
            spec = EventTimeSpec(event_time, max_out_of_orderness_ms, watermark_idle_ms, watermark)
            spec.check_schema(schema, name)
        elif watermark is not None or watermark_idle_ms is not None or max_out_of_orderness_ms:
            msg = (
                f"source {name!r}: watermark options need event_time='column' (the column that "
                "holds each record's event time)"
            )
            raise DataflowDefinitionError(msg)
        self._add(Step(name, "source", source, parallelism=parallelism or 1, event_time=spec))
        return Stream(self, name, schema)

    def options(self, step: str, **actor_options: Any) -> None:
        """Ray actor options for the instances of step ``step`` (sinks too), and ``chain=False``
        to keep it out of operator chains; see :meth:`Stream.options`. Example:
        ``flow.options("sink_0", resources={"ssd": 1})``, ``flow.options("parse", chain=False)``."""
        if step not in self.steps:
            msg = (
                f"options(): no step {step!r} in dataflow {self.name!r} (steps: "
                f"{list(self.steps)})"
            )
            raise DataflowDefinitionError(msg)
        chain = actor_options.pop("chain", None)
        if chain is not None:
            if not isinstance(chain, bool):
                msg = f"options(): chain= takes True or False, got {chain!r} for step {step!r}"
                raise DataflowDefinitionError(msg)
            self.steps[step] = replace(self.steps[step], chain=chain)
        if actor_options or chain is None:
            actor = ActorOptions.of(step, **actor_options)
            self.steps[step] = replace(self.steps[step], actor=actor)

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
