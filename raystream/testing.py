"""Test dataflows in the test's own process, without Ray.

Two tools, both on the real runtime (the real :class:`~raystream.runtime.instance.OperatorInstance`
and :class:`~raystream.runtime.processors.KeyedProcessor`: RocksDB state, key groups,
watermarks, timers, side outputs); only Ray is left out.

:func:`run` runs a whole dataflow to the end of its in-memory input, every instance in one
asyncio loop (channels, barriers and watermarks as on a cluster), and returns each sink's rows
(in the spirit of ``bytewax.testing.run_main``)::

    >>> import raystream as rs
    >>> from raystream import testing
    >>> @rs.keyed(state=rs.ValueState(int, default=0))
    ... def count(key, records, state):
    ...     state.value += len(records)
    ...     yield {"count": state.value}
    >>> flow = rs.Dataflow("wordcount")
    >>> words = flow.source(testing.source([{"word": w} for w in "a b a".split()]))
    >>> words.key_by("word").apply(count).sink(rs.sinks.collect(), name="out")
    >>> out = testing.run(flow, parallelism={"count": 2})
    >>> sorted(out["out"].to_pylist(), key=lambda r: r["word"])
    [{'word': 'a', 'count': 2}, {'word': 'b', 'count': 1}]

:class:`KeyedStepHarness` drives one keyed step by hand (in the spirit of Flink's
``KeyedOneInputStreamOperatorTestHarness``): feed records with event times, advance the
watermark or the processing-time clock, read the main and side outputs, and look at a key's
state::

    >>> with testing.KeyedStepHarness(count, key="word") as h:
    ...     h.process([{"word": "a"}, {"word": "a"}]).to_pylist()
    ...     h.state("a")
    [{'word': 'a', 'count': 2}]
    2

The internal columns ``ingest_ts`` and ``input_events`` are left out of what both return (and
``event_time`` too, unless ``keep_event_time=True``), so outputs compare equal run after run.
A user function's exception fails the run with :class:`~raystream.errors.JobFailedError`
naming the step, instance and key, with the original exception as its ``__cause__``.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from raystream.dataflow import Dataflow, Operator, Step
from raystream.errors import ConfigError, JobFailedError, context_of
from raystream.runtime.instance import RuntimeConfig
from raystream.runtime.outputs import port_of
from raystream.runtime.processors import (
    EVENT_TIME,
    INGEST_TS,
    INPUT_EVENTS,
    KeyedProcessor,
    make_processor,
)
from raystream.runtime.watermarks import WATERMARK_MAX, WATERMARK_MIN, event_time_ms
from raystream.sources import TableSource, from_table
from raystream.state.handles import KeySet, MapHandle, VectorValueState
from raystream.state.layout import encode_one
from raystream.state.spec import MapState

__all__ = ["KeyedStepHarness", "run", "run_async", "source"]

Records = Sequence[dict[str, Any]] | dict[str, Sequence[Any]] | pa.Table | pa.RecordBatch


def _table(records: Records, schema: pa.Schema | None = None) -> pa.Table:
    """Rows (a list of dicts), columns (a dict of lists), a Table or a RecordBatch, as a Table."""
    if isinstance(records, pa.Table):
        return records
    if isinstance(records, pa.RecordBatch):
        return pa.Table.from_batches([records])
    if isinstance(records, dict):
        return pa.table(records, schema=schema)
    if isinstance(records, Sequence) and not isinstance(records, (str, bytes)):
        rows = list(records)
        if not rows and schema is None:
            msg = "no records and no schema: pass schema= to say which columns the input has"
            raise ConfigError(msg)
        if not all(isinstance(r, dict) for r in rows):
            bad = next(r for r in rows if not isinstance(r, dict))
            msg = f"records must be dicts (one per row), got {type(bad).__name__}: {bad!r}"
            raise ConfigError(msg)
        return pa.Table.from_pylist(rows, schema=schema)
    msg = (
        "records must be a list of dicts, a dict of columns, a pyarrow Table or a RecordBatch, "
        f"got {type(records).__name__}"
    )
    raise ConfigError(msg)


def source(records: Records, *, schema: pa.Schema | None = None) -> TableSource:
    """An in-memory source over ``records``: a list of dicts (one per row), a dict of columns,
    a pyarrow Table or RecordBatch (:func:`raystream.sources.from_table` underneath).
    ``schema`` types the columns (needed for an empty list).

    Example::

        >>> source([{"key": "a", "v": 1}, {"key": "b", "v": 2}]).table.num_rows
        2
    """
    return from_table(_table(records, schema))


def _clean(table: pa.Table | None, keep_event_time: bool) -> pa.Table:
    if table is None:
        return pa.table({})
    drop = [INGEST_TS, INPUT_EVENTS] + ([] if keep_event_time else [EVENT_TIME])
    return table.drop_columns([c for c in drop if c in table.schema.names])


async def run_async(
    flow: Dataflow,
    parallelism: dict[str, int] | None = None,
    *,
    batch_rows: int | None = None,
    config: RuntimeConfig | None = None,
    state_dir: str | Path | None = None,
    keep_event_time: bool = False,
    timeout_s: float = 60.0,
) -> dict[str, pa.Table]:
    """:func:`run` for a test that already runs an asyncio loop."""
    from raystream.runtime.local import run_local

    cfg = config or RuntimeConfig(metrics_export_s=0.0)
    if batch_rows is not None:
        from dataclasses import replace

        cfg = replace(cfg, source_batch_rows=batch_rows, batch_rows=batch_rows)
    if state_dir is not None:
        out = await run_local(
            flow, parallelism, state_dir=state_dir, config=cfg, timeout_s=timeout_s
        )
    else:
        with tempfile.TemporaryDirectory(prefix=f"raystream-test-{flow.name}-") as tmp:
            out = await run_local(flow, parallelism, state_dir=tmp, config=cfg, timeout_s=timeout_s)
    return {sink: _clean(table, keep_event_time) for sink, table in out.items()}


def run(
    flow: Dataflow,
    parallelism: dict[str, int] | None = None,
    *,
    batch_rows: int | None = None,
    config: RuntimeConfig | None = None,
    state_dir: str | Path | None = None,
    keep_event_time: bool = False,
    timeout_s: float = 60.0,
) -> dict[str, pa.Table]:
    """Run ``flow`` in this process without Ray, to the end of its input; returns each sink
    step's rows (all instances together) by sink name.

    Same semantics as ``rs.run``: the real instances, channels, key groups, RocksDB state,
    barriers, watermarks and timers (every event-time timer fires at the end of input).
    ``parallelism`` as for ``rs.run``; ``batch_rows`` caps the rows a source reads and a
    channel ships at once (e.g. 1: record by record, so watermarks advance between records);
    state lives in a temporary folder (``state_dir`` to keep it). Raises
    :class:`~raystream.errors.JobFailedError` if a step fails (its ``__cause__`` is the
    original exception). A sink that received nothing gives an empty table.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        msg = (
            "testing.run() was called inside a running asyncio loop; use "
            "`await testing.run_async(...)` there"
        )
        raise ConfigError(msg)
    return asyncio.run(
        run_async(
            flow,
            parallelism,
            batch_rows=batch_rows,
            config=config,
            state_dir=state_dir,
            keep_event_time=keep_event_time,
            timeout_s=timeout_s,
        )
    )


class _HarnessInput:
    """The input of a harnessed step: no reader (the harness pushes batches itself)."""

    def open(self, index: int, parallelism: int) -> Any:  # pragma: no cover - never opened
        msg = "the input of a KeyedStepHarness is fed with harness.process(...)"
        raise ConfigError(msg)

    def describe(self) -> str:
        return "KeyedStepHarness input"


class KeyedStepHarness:
    """One keyed step (``@rs.keyed`` or ``@rs.keyed_batches``, with its state and timers)
    driven by hand, on its real processor and a RocksDB in a temporary folder.

    ``key``: the column (or ``fn(batch) -> keys``; ``per_record=True``: ``fn(record)``) the
    input is keyed by, as in ``stream.key_by``. ``event_time``: the records' event-time column
    (int ms or timestamp), as in ``flow.source(event_time=...)``; without it a record's event
    time is its ``event_time`` column if it has one, else the time it was fed.

    Example (a tumbling-window count with an event-time timer)::

        h = KeyedStepHarness(window_count, key="user", event_time="ts")
        h.process([{"user": "a", "ts": 1_000}, {"user": "a", "ts": 1_500}])
        assert h.state("a") == {2_000: 2}      # MapState: window end -> count
        fired = h.advance_watermark(1_999)     # the window's timer (at its end - 1) fires
        assert fired.to_pylist() == [{"user": "a", "window_end": 2_000, "count": 2}]
        assert h.side_output("late").num_rows == 0  # rs.Outputs(..., late=rows)

    (``window_count`` is in ``tests/unit/test_testing_harness.py``.) Watermarks only go
    forward (a smaller one is ignored, as in the runtime); processing-time timers fire when
    :meth:`advance_processing_time` passes them (the harness's own clock, starting at 0, not
    the wall clock). One instance holds every key group; rescaling is not part of the harness.
    Close it (or use ``with``) to release RocksDB and its folder.
    """

    def __init__(
        self,
        operator: Operator,
        *,
        key: str | Callable[..., Any] = "key",
        per_record: bool = False,
        event_time: str | None = None,
        name: str | None = None,
        num_key_groups: int = 128,
        sub_groups: int = 16,
        state_dir: str | Path | None = None,
        keep_event_time: bool = False,
    ) -> None:
        if not isinstance(operator, Operator) or operator.kind not in ("keyed", "keyed_batches"):
            msg = (
                "KeyedStepHarness takes a keyed operator (@rs.keyed or @rs.keyed_batches), got "
                f"{getattr(operator, 'kind', type(operator).__name__)!r}; test other steps with "
                "testing.run(flow)"
            )
            raise ConfigError(msg)
        flow = Dataflow("harness", num_key_groups=num_key_groups, sub_groups=sub_groups)
        stream = flow.source(_HarnessInput(), name="input").key_by(key, per_record=per_record)
        stream.apply(operator, name=name).sink(_HarnessInput(), name="output")
        self.step: Step = next(s for s in flow.steps.values() if s.is_keyed)
        self.key_space = flow.key_space
        self.event_time = event_time
        self.keep_event_time = keep_event_time
        self._tmp = (
            tempfile.TemporaryDirectory(prefix=f"raystream-harness-{self.step.name}-")
            if state_dir is None
            else None
        )
        path = Path(state_dir if state_dir is not None else self._tmp.name)  # type: ignore[union-attr]
        self.processor: KeyedProcessor = make_processor(
            self.step,
            self.key_space,
            path / "state",
            range(num_key_groups),
        )
        self.watermark = WATERMARK_MIN
        self.processing_time_ms = (
            0  # the harness's own clock (ms), moved by advance_processing_time
        )
        self._outputs: dict[str, list[pa.RecordBatch]] = {}
        self._closed = False

    # ---- feeding -------------------------------------------------------------------------
    def process(
        self,
        records: Records,
        *,
        event_times_ms: Sequence[int] | np.ndarray | None = None,
        schema: pa.Schema | None = None,
    ) -> pa.Table:
        """Feed ``records`` (a list of dicts, a dict of columns, a Table or a RecordBatch) as
        one batch; returns the main output of this call. ``event_times_ms`` overrides the
        records' event times."""
        self._check_open()
        table = _table(records, schema)
        if table.num_rows == 0:
            return pa.table({})
        batch = table.combine_chunks().to_batches()[0]
        batch = self._stamp(batch, event_times_ms)
        try:
            outs = self.processor.process(batch)
        except Exception as e:
            raise self._failed(e) from e
        return self._collect(outs)

    def advance_watermark(self, watermark_ms: int) -> pa.Table:
        """Move the watermark to ``watermark_ms`` (ignored if not past the current one): every
        event-time timer at or before it fires; returns the main output of the fired timers."""
        self._check_open()
        if watermark_ms <= self.watermark:
            return pa.table({})
        self.watermark = int(watermark_ms)
        try:
            outs = self.processor.on_watermark(self.watermark)
        except Exception as e:
            raise self._failed(e) from e
        return self._collect(outs)

    def advance_processing_time(self, now_ms: int) -> pa.Table:
        """Set the harness's processing-time clock to ``now_ms`` (ms since the epoch): every
        processing-time timer at or before it fires; returns their main output."""
        self._check_open()
        self.processing_time_ms = max(self.processing_time_ms, int(now_ms))
        try:
            outs = self.processor.fire_processing(self.processing_time_ms)
        except Exception as e:
            raise self._failed(e) from e
        return self._collect(outs)

    def end_of_input(self) -> pa.Table:
        """The input ended: the watermark jumps to +inf and every event-time timer fires."""
        return self.advance_watermark(WATERMARK_MAX)

    # ---- reading -------------------------------------------------------------------------
    @property
    def output(self) -> pa.Table:
        """Every main-output row so far, in order."""
        return self._port("")

    def side_output(self, name: str) -> pa.Table:
        """Every row put under ``name`` (``rs.Outputs(..., name=rows)``) so far."""
        return self._port(name)

    @property
    def side_outputs(self) -> list[str]:
        """Names of the side outputs that received rows."""
        return sorted(p for p in self._outputs if p)

    def state(self, key: Any, name: str | None = None) -> Any:
        """The value of ``key``'s state (the step's only state, or the one called ``name``):
        the value (its default if never set) of a ValueState, a list for a ListState, a dict
        for a MapState."""
        self._check_open()
        state_name, spec = self._spec(name)
        sid = self.processor.states.ids[state_name]
        keys = KeySet.of([key], self.key_space)
        if isinstance(spec, MapState):
            prefix = encode_one(int(keys.key_group[0]), int(keys.sub_group[0]), sid, key)
            return dict(MapHandle(self.processor.backend, prefix, spec.default_value).items())
        values = VectorValueState(self.processor.backend, sid, spec, self.key_space).get(keys)
        value = values[0]
        return value.item() if isinstance(value, np.generic) else value

    def state_items(self, name: str | None = None) -> dict[Any, Any]:
        """Every key that holds the state (the only one, or ``name``) -> its value (value and
        list states)."""
        self._check_open()
        state_name, spec = self._spec(name)
        if isinstance(spec, MapState):
            msg = (
                f"state_items() reads value and list states; read map state {state_name!r} "
                "per key with state(key)"
            )
            raise ConfigError(msg)
        kind = self.processor.key_kind
        if kind is None:  # nothing fed yet
            return {}
        return dict(self.processor.states.iter_values(state_name, kind))

    def pending_timers(self) -> int:
        """How many event-time and processing-time timers are registered and not fired yet."""
        from raystream.runtime.timers import EVENT_TIMERS, PROCESSING_TIMERS

        n = 0
        for sid in (EVENT_TIMERS, PROCESSING_TIMERS):
            for kg in range(self.key_space.num_key_groups):
                prefix = kg.to_bytes(2, "big")
                n += sum(1 for k, _ in self.processor.backend.scan_prefix(prefix) if k[3] == sid)
        return n

    # ---- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.processor.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> KeyedStepHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- inside --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            msg = f"this KeyedStepHarness of step {self.step.name!r} is closed"
            raise ConfigError(msg)

    def _spec(self, name: str | None) -> tuple[str, Any]:
        specs = self.step.state
        if not specs:
            msg = f"step {self.step.name!r} declares no state"
            raise ConfigError(msg)
        if name is None:
            if len(specs) != 1:
                msg = f"step {self.step.name!r} has states {sorted(specs)}; pass name="
                raise ConfigError(msg)
            name = next(iter(specs))
        if name not in specs:
            msg = f"step {self.step.name!r} has no state {name!r}; its states: {sorted(specs)}"
            raise ConfigError(msg)
        return name, specs[name]

    def _stamp(
        self, batch: pa.RecordBatch, event_times_ms: Sequence[int] | np.ndarray | None
    ) -> pa.RecordBatch:
        """As a source does: ``ingest_ts`` now, ``event_time`` from the event-time column."""
        from raystream.runtime.instance import _stamp

        ingest = np.full(batch.num_rows, time.time_ns(), np.int64)
        if event_times_ms is not None:
            event_ms = np.asarray(event_times_ms, dtype=np.int64)
            if len(event_ms) != batch.num_rows:
                msg = f"event_times_ms has {len(event_ms)} values for {batch.num_rows} records"
                raise ConfigError(msg)
        elif self.event_time is not None:
            event_ms = event_time_ms(batch, self.event_time)
        else:
            event_ms = None
        return _stamp(batch, ingest, event_ms)

    def _collect(self, outs: Iterable[pa.RecordBatch]) -> pa.Table:
        main: list[pa.RecordBatch] = []
        for b in outs:
            port, b = port_of(b)
            self._outputs.setdefault(port, []).append(b)
            if port == "":
                main.append(b)
        return self._as_table(main)

    def _port(self, port: str) -> pa.Table:
        return self._as_table(self._outputs.get(port, []))

    def _as_table(self, batches: list[pa.RecordBatch]) -> pa.Table:
        if not batches:
            return pa.table({})
        tables = [pa.Table.from_batches([b.replace_schema_metadata(None)]) for b in batches]
        return _clean(pa.concat_tables(tables, promote_options="permissive"), self.keep_event_time)

    def _failed(self, exc: Exception) -> JobFailedError:
        import traceback

        return JobFailedError.of_instance(
            "harness",
            self.step.name,
            0,
            f"{type(exc).__name__}: {exc}",
            context=context_of(exc),
            traceback="".join(traceback.format_exception(exc)),
            where="the harnessed step",
        )
