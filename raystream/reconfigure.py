"""Changing a running job: which replacement functions fit a step, and rewriting state for one.

Pure (no Ray): the controller validates here before anything changes, the operator instances
rewrite their state here at the replace barrier.

A replacement fits a step when

* the step is an operator (sources and sinks are not replaced);
* the kinds fit: a keyed step takes ``@rs.keyed`` or ``@rs.keyed_batches`` (the key and the state
  stay where they are), a stateless step an operator of its own kind;
* the key is the step's (the key belongs to the stream, ``key_by``; a replacement keeps it, and a
  ``key=`` given to :func:`check_replacement` must name the same column);
* the states keep their names, order and kinds (ValueState / MapState / ListState); states may be
  added at the end (they start at their defaults); a state whose stored form changes (e.g.
  ``ValueState(int)`` -> ``ValueState(object)``) needs a state migration function, old value ->
  new value;
* a step with timers keeps an ``on_timer`` (timers registered already must still fire).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from raystream.dataflow import Operator, Step
from raystream.errors import ReconfigurationError
from raystream.state.spec import StateSpec

__all__ = ["check_replacement", "load_object", "migrate_state_rows", "normalise_migrations"]

_KEYED = ("keyed", "keyed_batches")
_TIMER_IDS = (253, 254)  # raystream.runtime.timers: timers move with their sub-group
MIGRATE_CHUNK_ROWS = 10_000


def _spec_form(spec: StateSpec) -> str:
    return f"{type(spec).__name__}({spec.codec.name})"


def load_object(spec: str, what: str = "operator") -> Any:
    """The object at ``"package.module:attr"`` (ReconfigurationError when it does not import).
    Its module is pickled by value, so instances on other nodes need not import it."""
    import importlib
    import sys

    module, sep, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not (module and sep and attr):
        msg = f"the {what} must be given as 'package.module:attr', got {spec!r}"
        raise ReconfigurationError(msg)
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        msg = (
            f"cannot load the {what} {spec!r}: {type(e).__name__}: {e}. Expected "
            f"'package.module:attr' importable here (sys.path starts with {sys.path[:3]})"
        )
        raise ReconfigurationError(msg) from e
    file = getattr(sys.modules[module], "__file__", None)
    installed = (sys.prefix, sys.base_prefix, sys.exec_prefix)
    if file and not module.startswith("raystream") and not file.startswith(installed):
        from ray import cloudpickle  # the user's own code: workers need not import it

        cloudpickle.register_pickle_by_value(sys.modules[module])
    return obj


def normalise_migrations(
    migrate_state: Callable[[Any], Any] | dict[str, Callable[[Any], Any]] | None,
    states: dict[str, StateSpec],
    step: str,
) -> dict[str, Callable[[Any], Any]]:
    """``migrate_state`` as ``{state name: fn}``: one function applies to every declared state
    (the single state of ``state=rs.ValueState(...)`` has the name ``""``)."""
    if migrate_state is None:
        return {}
    if callable(migrate_state):
        if not states:
            msg = (
                f"cannot replace the function of {step!r} with a state migration function: the "
                "step keeps no state; leave migrate_state out"
            )
            raise ReconfigurationError(msg)
        return dict.fromkeys(states, migrate_state)
    if isinstance(migrate_state, dict):
        unknown = sorted(set(migrate_state) - set(states))
        bad = sorted(k for k, v in migrate_state.items() if not callable(v))
        if unknown or bad:
            what = f"unknown state(s) {unknown}" if unknown else f"non-callable value(s) for {bad}"
            msg = (
                f"migrate_state for {step!r} must map state names {sorted(states)} to functions "
                f"old value -> new value; got {what}"
            )
            raise ReconfigurationError(msg)
        return dict(migrate_state)
    msg = (
        f"migrate_state must be a function old value -> new value or a dict of them per state, "
        f"got {type(migrate_state).__name__}: {migrate_state!r}"
    )
    raise ReconfigurationError(msg)


def check_replacement(
    step: Step,
    op: Any,
    *,
    key: str | None = None,
    migrate_state: Callable[[Any], Any] | dict[str, Callable[[Any], Any]] | None = None,
) -> tuple[Step, dict[str, Callable[[Any], Any]]]:
    """The step with ``op``'s function (and state declarations, timers), and the state migration
    functions per state name; :class:`ReconfigurationError` (nothing changed) when ``op`` does
    not fit ``step``, saying what was expected and what came."""
    name = step.name
    if step.kind in ("source", "sink"):
        msg = (
            f"cannot replace the function of {name!r}: it is a {step.kind}; only operator steps "
            "(map, filter, flat_map, map_batches, keyed, keyed_batches) take a new function"
        )
        raise ReconfigurationError(msg)
    if not isinstance(op, Operator):
        msg = (
            f"the replacement for {name!r} must be an operator made with @rs.{step.kind} "
            f"(a decorated function), got {type(op).__name__}: {op!r}"
        )
        raise ReconfigurationError(msg)
    if step.is_keyed != (op.kind in _KEYED) or (not step.is_keyed and op.kind != step.kind):
        want = "@rs.keyed or @rs.keyed_batches" if step.is_keyed else f"@rs.{step.kind}"
        msg = (
            f"the replacement for {name!r} must be {want} (the step is {step.kind}), got "
            f"@rs.{op.kind} ({getattr(op.fn, '__qualname__', op.fn)!r})"
        )
        raise ReconfigurationError(msg)
    if key is not None:
        have = step.key.column if step.key is not None else None
        if key != have:
            msg = (
                f"the replacement for {name!r} must keep its key: the step is keyed by "
                f"{repr(have) if have else 'a function'}, the replacement asks for {key!r}; "
                "changing the key moves every record to other state: start a new job keyed "
                "the new way"
            )
            raise ReconfigurationError(msg)
    migrations = normalise_migrations(migrate_state, step.state, name)
    old_names, new_names = list(step.state), list(op.state)
    if new_names[: len(old_names)] != old_names:
        msg = (
            f"the replacement for {name!r} must keep the step's states in order, {old_names} "
            f"(new states may follow), got {new_names}"
        )
        raise ReconfigurationError(msg)
    for s in old_names:
        old, new = step.state[s], op.state[s]
        label = repr(s) if s else "the state"
        if type(old) is not type(new):
            msg = (
                f"the replacement for {name!r} must keep {label} a {type(old).__name__}, got "
                f"{type(new).__name__}"
            )
            raise ReconfigurationError(msg)
        if old.codec != new.codec and s not in migrations:
            msg = (
                f"the replacement for {name!r} stores {label} as {_spec_form(new)}, the step "
                f"holds it as {_spec_form(old)}: give a state migration function, old value -> "
                "new value (migrate_state=...)"
            )
            raise ReconfigurationError(msg)
    if step.on_timer is not None and op.on_timer is None:
        msg = (
            f"the replacement for {name!r} must have on_timer=: the step has timers, and those "
            "already registered would never fire"
        )
        raise ReconfigurationError(msg)
    new_step = replace(
        step, fn=op.fn, state=dict(op.state), on_timer=op.on_timer, async_calls=op.async_calls
    )
    return new_step, migrations


def migrate_state_rows(
    backend: Any,
    old: dict[str, StateSpec],
    new: dict[str, StateSpec],
    migrations: dict[str, Callable[[Any], Any]],
) -> int:
    """Rewrite every stored value of the states in ``migrations`` (decoded as ``old`` declares,
    passed through the function, encoded as ``new`` declares) in ``backend`` (a
    RocksStateBackend: keys ``[key_group u16][sub_group u8][state id u8][user key]``). Map states
    migrate each map value. Returns the rows rewritten."""
    if not migrations:
        return 0
    ids = {i + 1: s for i, s in enumerate(old) if s in migrations}
    rows = 0
    keys: list[bytes] = []
    values: list[bytes] = []

    def write() -> None:
        backend.write_direct(keys, values)
        keys.clear()
        values.clear()

    # the scan flushes the write-back cache first, and rewritten rows go past it
    for k, v in backend.scan(b"", b"\xff\xff\xff\xff"):
        sid = k[3] if len(k) > 3 else 0
        state = ids.get(sid)
        if state is None or sid in _TIMER_IDS:
            continue
        value = migrations[state](old[state].codec.decode(v))
        keys.append(k)
        values.append(new[state].codec.encode(value))
        rows += 1
        if len(keys) >= MIGRATE_CHUNK_ROWS:
            write()
    if keys:
        write()
    return rows
