"""Which steps can go into or out of a running job, and how: pure checks (no Ray).

The controller (:mod:`raystream.rewiring`) builds an inserted step here and checks a removal here
before anything changes; a refusal is a :class:`ReconfigurationError` saying what was expected,
what came and what to do.

* A stateless operator (``@rs.map``, ``@rs.filter``, ``@rs.flat_map``, ``@rs.map_batches``) goes
  in as it is. A keyed one (``@rs.keyed``, ``@rs.keyed_batches``) needs ``key_by`` (a column of
  the records it gets, or a function of a RecordBatch, as ``Stream.key_by``); its instances
  start with empty state and their own routing table.
* A stateless step comes out as it is. A keyed step comes out only when the caller says what
  happens to its state, as Flink asks for ``--allowNonRestoredState`` before it drops the state
  of a removed operator: ``state="drop"`` drops it; ``state="emit"`` first fires every timer (as
  at the end of its input, like Flink's ``stop --drain``: windows emit their results) and then
  sends each key's remaining state downstream as one record (raystream.state.final), as a
  Bytewax stateful step emits from its state at end of input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from raystream.dataflow import KeySpec, Operator, Step
from raystream.errors import ReconfigurationError
from raystream.state.final import state_columns

__all__ = [
    "KEYED",
    "REMOVAL_STATES",
    "STATELESS",
    "check_removal_state",
    "graph_with_step",
    "graph_without_step",
    "inserted_step",
]

STATELESS = ("map", "filter", "flat_map", "map_batches")
KEYED = ("keyed", "keyed_batches")
REMOVAL_STATES = ("drop", "emit")


def _key_spec(key_by: str | Callable[..., Any] | KeySpec, name: str) -> KeySpec:
    if isinstance(key_by, KeySpec):
        return key_by
    if isinstance(key_by, str) and key_by:
        return KeySpec(column=key_by)
    if callable(key_by):
        return KeySpec(fn=key_by)
    msg = (
        f"key_by of the inserted keyed step {name!r} must be a column name or a function of a "
        f"RecordBatch (as Stream.key_by), got {type(key_by).__name__}: {key_by!r}"
    )
    raise ReconfigurationError(msg)


def inserted_step(
    op: Any,
    name: str,
    after: str,
    parallelism: int,
    key_by: str | Callable[..., Any] | KeySpec | None = None,
    *,
    num_key_groups: int | None = None,
) -> Step:
    """The step ``op`` makes when inserted after step ``after`` (checked: the operator's kind,
    ``key_by`` given for a keyed one and only for it, the parallelism: a keyed step has at most
    ``num_key_groups`` instances)."""
    if not isinstance(op, Operator) or op.kind not in STATELESS + KEYED:
        got = f"@rs.{op.kind}" if isinstance(op, Operator) else type(op).__name__
        msg = (
            "insert takes an operator: stateless (@rs.map, @rs.filter, @rs.flat_map, "
            f"@rs.map_batches) or keyed (@rs.keyed, @rs.keyed_batches, with key_by=), got {got}"
        )
        raise ReconfigurationError(msg)
    if isinstance(parallelism, bool) or not isinstance(parallelism, int) or parallelism < 1:
        msg = f"parallelism of the inserted step must be an int >= 1, got {parallelism!r}"
        raise ReconfigurationError(msg)
    if op.kind in STATELESS:
        if key_by is not None:
            msg = (
                f"key_by is for keyed operators; {name!r} is @rs.{op.kind} (stateless): leave "
                "key_by out"
            )
            raise ReconfigurationError(msg)
        # its own actors (chain=False), as it runs once inserted: a recovery, which plans the
        # graph anew, would chain it to its neighbours otherwise, and then it could not be
        # removed (nor its neighbours rewired) any more
        return Step(
            name,
            op.kind,
            op.fn,
            (after,),
            parallelism=parallelism,
            chain=False,
            async_calls=op.async_calls,
        )
    if key_by is None:
        msg = (
            f"inserting keyed step {name!r} (@rs.{op.kind}) needs key_by=: the column (or a "
            f"function of a RecordBatch) that keys the records it gets from {after!r}, e.g. "
            f"job.insert({after!r}, op, name={name!r}, key_by='key')"
        )
        raise ReconfigurationError(msg)
    if num_key_groups is not None and parallelism > num_key_groups:
        msg = (
            f"keyed step {name!r} can have at most {num_key_groups} instances (the job's "
            f"num_key_groups), got parallelism={parallelism}"
        )
        raise ReconfigurationError(msg)
    return Step(
        name,
        op.kind,
        op.fn,
        (after,),
        key=_key_spec(key_by, name),
        state=dict(op.state),
        parallelism=parallelism,
        on_timer=op.on_timer,
        chain=False,
    )


def check_removal_state(step: Step, downstream: Step | None, state: str | None) -> str | None:
    """What happens to the state of removed step ``step``: None for a stateless step, else
    ``"drop"`` or ``"emit"`` as ``state`` asks (refused when missing or unknown, or when the
    emitted records cannot reach ``downstream``)."""
    name = step.name
    if not step.is_keyed:
        if state is not None:
            msg = (
                f"cannot remove {name!r} with state={state!r}: it is a {step.kind} step and "
                "keeps no state; leave state= out"
            )
            raise ReconfigurationError(msg)
        return None
    if state is None:
        where = repr(downstream.name) if downstream is not None else "its downstream step"
        msg = (
            f"cannot remove {name!r}: it is a {step.kind} step with state per key; say what "
            f"happens to it: state='drop' drops it, state='emit' fires its timers and sends each "
            f"key's final state on to {where} first (job.remove({name!r}, "
            f"state='emit'), or `raystream remove JOB {name} --state emit`)"
        )
        raise ReconfigurationError(msg)
    if state not in REMOVAL_STATES:
        msg = (
            f"cannot remove {name!r}: state must be one of {list(REMOVAL_STATES)} (what happens "
            f"to its state), got {state!r}"
        )
        raise ReconfigurationError(msg)
    if state == "emit" and downstream is not None and downstream.is_keyed:
        key = downstream.key_for(name)
        cols = {step.key.key_column if step.key else "_key"}
        cols.update(state_columns(step.state, next(iter(cols))).values())
        if key is not None and key.column is not None and key.column not in cols:
            msg = (
                f"cannot remove {name!r} with state='emit': {downstream.name!r} is keyed by "
                f"{key.column!r}, but the final-state records have the columns {sorted(cols)}; "
                "use state='drop'"
            )
            raise ReconfigurationError(msg)
    return state


def graph_with_step(steps: dict[str, Step], new: Step, before: str) -> dict[str, Step]:
    """The graph ``steps`` with ``new`` right before step ``before``, which reads ``new`` from
    now on (what recoveries, rescales and checkpoints of the running job build on)."""
    out: dict[str, Step] = {}
    for name, step in steps.items():
        if name == before:
            out[new.name] = new
            step = replace(step, upstream=(new.name,))
        out[name] = step
    return out


def graph_without_step(steps: dict[str, Step], name: str) -> dict[str, Step]:
    """The graph ``steps`` without step ``name`` (one upstream step): its downstream step reads
    its upstream step again."""
    (after,) = steps[name].upstream
    return {
        n: replace(s, upstream=tuple(after if u == name else u for u in s.upstream))
        for n, s in steps.items()
        if n != name
    }
