"""Partition commit of a partitioned Parquet sink: when a ``dt=…/hm=…`` folder is complete, and
what then happens to it (a ``_SUCCESS`` file, or a policy of your own), as Flink's filesystem
sink does (``sink.partition-commit.trigger``, ``.delay``, ``.policy.kind``).

- :func:`partition_commit` builds the (pure, picklable) :class:`PartitionCommit` given to
  ``rs.sinks.parquet(..., partition_by=[...], partition_commit=...)``.
- **Triggers.** ``"partition-time"``: a folder is committed once the job-wide watermark (the
  minimum over the sink's instances) is past its partition time plus ``delay_ms``
  (``watermark > time + delay``, as Flink's ``PartitionTimeCommitTrigger``). The partition time
  comes from the folder's values through ``time_pattern`` (``"$dt $hm:00"``: each ``$column``
  is replaced by that partition value) parsed by ``time_format`` in ``time_zone`` (UTC by
  default, as Flink's ``sink.partition-commit.watermark-time-zone``). ``"process-time"``: once
  the wall clock is ``delay_ms`` past the moment the committer first saw the folder (Flink's
  ``ProcTimeCommitTrigger``; with ``delay_ms=0`` at the first checkpoint holding its files).
- **When at all.** A folder is a candidate once a checkpoint holding parts of it completed and
  every sink instance published what that checkpoint pre-committed (the controller gathers the
  folders from the sink instances' checkpoint acknowledgements, with their watermarks at the
  barrier; :class:`PartitionCommitter` is that logic, without Ray). At the end of input every
  folder written is committed (end of input is the maximal watermark).
- **Policies** (:class:`CommitPolicy`): :class:`SuccessFile` writes an empty ``_SUCCESS``
  (overwriting one that is there); ``on_commit=fn`` calls ``fn(partition)`` with a
  :class:`CommittedPartition` (its folder, values, path and ``pyarrow.fs`` filesystem); any
  object with ``commit(partition)`` can be one.
- **Repeats.** A commit is idempotent: a recovery restores the folders that were pending at the
  checkpoint, so a folder committed after that checkpoint is committed again once due (its
  success file rewritten, never removed); rows that come late, after their folder was
  committed, are written (never dropped) and commit the folder again at the checkpoint that
  publishes them, as Flink does.
- **A folder whose values do not parse** by ``time_pattern`` / ``time_format`` (say
  ``hm=__HIVE_DEFAULT_PARTITION__`` from a null): its rows are written like any others, the job
  reports which folder, which value and what was expected (a warning in the log and in the
  job's ``partition_commit_errors``), and the folder is committed at the end of input only.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import re
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import pyarrow.fs as pafs

from raystream.errors import ConfigError

__all__ = [
    "CommitPolicy",
    "CommittedPartition",
    "PartitionCommit",
    "PartitionCommitter",
    "PartitionTimeError",
    "SuccessFile",
    "folder_values",
    "partition_commit",
]

log = logging.getLogger("raystream.partition_commit")

TRIGGERS = ("partition-time", "process-time")
DEFAULT_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
_DEFAULT_PARTITION = "__HIVE_DEFAULT_PARTITION__"
_TOKEN = re.compile(r"\$([A-Za-z][A-Za-z0-9_]*)")


class PartitionTimeError(ValueError):
    """A folder's values do not give a partition time by the pattern and format."""


@dataclass(frozen=True)
class CommittedPartition:
    """A folder being committed: ``folder`` relative to the sink's path (``dt=2015-07-15/
    hm=21%3A00``), ``values`` decoded (``{"dt": "2015-07-15", "hm": "21:00"}``, None for the
    Hive default partition), ``path`` the folder on ``filesystem`` (a local path for a local
    sink)."""

    folder: str
    values: dict[str, str | None]
    path: str
    filesystem: pafs.FileSystem


@runtime_checkable
class CommitPolicy(Protocol):
    """What committing a partition does. Must be picklable (it travels with the dataflow) and
    idempotent (a folder can be committed again: after a recovery, or after late rows)."""

    def commit(self, partition: CommittedPartition) -> None: ...


@dataclass(frozen=True)
class SuccessFile:
    """Flink's ``success-file`` policy: an empty file ``name`` in the folder, overwritten if
    there (readers skip names starting with ``_``)."""

    name: str = "_SUCCESS"

    def commit(self, partition: CommittedPartition) -> None:
        path = f"{partition.path.rstrip('/')}/{self.name}"
        with partition.filesystem.open_output_stream(path) as out:
            out.write(b"")


@dataclass(frozen=True)
class _Callback:
    fn: Callable[[CommittedPartition], Any]

    def commit(self, partition: CommittedPartition) -> None:
        self.fn(partition)


def folder_values(folder: str) -> dict[str, str | None]:
    """``{"dt": "2015-07-15", "hm": "21:00"}`` of ``dt=2015-07-15/hm=21%3A00`` (``%XX``
    decoded; the Hive default partition is None)."""
    out: dict[str, str | None] = {}
    for level in folder.strip("/").split("/"):
        name, sep, value = level.partition("=")
        if not sep:
            msg = f"partition folder {folder!r}: level {level!r} is not 'column=value'"
            raise PartitionTimeError(msg)
        out[name] = None if value == _DEFAULT_PARTITION else urllib.parse.unquote(value)
    return out


@dataclass(frozen=True)
class PartitionCommit:
    """When a partitioned Parquet sink commits a folder and what that does (see the module
    doc). Build it with :func:`partition_commit`."""

    trigger: str = "partition-time"
    time_pattern: str | None = None
    time_format: str = DEFAULT_TIME_FORMAT
    time_zone: str = "UTC"
    delay_ms: int = 0
    policies: tuple[Any, ...] = field(default=(SuccessFile(),), compare=False)

    def __post_init__(self) -> None:
        where = "partition_commit"
        if self.trigger not in TRIGGERS:
            msg = f"{where}: trigger must be one of {list(TRIGGERS)}, got {self.trigger!r}"
            raise ConfigError(msg)
        d = self.delay_ms
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            msg = f"{where}: delay_ms must be an int >= 0 (milliseconds), got {d!r}"
            raise ConfigError(msg)
        if self.time_pattern is not None:
            if not isinstance(self.time_pattern, str) or not _TOKEN.search(self.time_pattern):
                msg = (
                    f"{where}: time_pattern must be a string naming partition columns as "
                    f"$column (e.g. '$dt $hm:00'), got {self.time_pattern!r}"
                )
                raise ConfigError(msg)
            if self.trigger != "partition-time":
                msg = f"{where}: time_pattern is for trigger='partition-time', not {self.trigger!r}"
                raise ConfigError(msg)
        try:
            self._zone()
        except Exception as exc:  # noqa: BLE001 - ZoneInfoNotFoundError, ValueError
            msg = f"{where}: time_zone {self.time_zone!r} is not a known time zone ({exc})"
            raise ConfigError(msg) from exc
        if not self.policies:
            msg = f"{where}: no policy (success_file=None and no on_commit): committing would do nothing"
            raise ConfigError(msg)
        for p in self.policies:
            if not callable(getattr(p, "commit", None)):
                msg = f"{where}: a policy must have commit(partition), got {type(p).__name__}"
                raise ConfigError(msg)

    def _zone(self) -> _dt.tzinfo:
        if self.time_zone == "UTC":
            return _dt.UTC
        from zoneinfo import ZoneInfo

        return ZoneInfo(self.time_zone)

    def columns_of_pattern(self, partition_by: tuple[str, ...]) -> tuple[str, ...]:
        """The partition columns ``time_pattern`` names (the first partition column when no
        pattern is given, as Flink's default extractor)."""
        if self.time_pattern is None:
            return partition_by[:1]
        return tuple(dict.fromkeys(_TOKEN.findall(self.time_pattern)))

    def check_columns(self, partition_by: tuple[str, ...], where: str) -> None:
        """:class:`ConfigError` unless the sink is partitioned and the pattern names only
        partition columns."""
        if not partition_by:
            msg = f"{where}: partition_commit needs partition_by (it commits partition folders)"
            raise ConfigError(msg)
        if self.trigger != "partition-time":
            return
        unknown = [c for c in self.columns_of_pattern(partition_by) if c not in partition_by]
        if unknown:
            msg = (
                f"{where}: partition_commit time_pattern {self.time_pattern!r} names "
                f"{['$' + c for c in unknown]}, which are not partition columns; expected "
                f"$-names among partition_by {list(partition_by)}"
            )
            raise ConfigError(msg)

    def partition_time_ms(self, folder: str, partition_by: tuple[str, ...]) -> int:
        """The partition time of ``folder`` (epoch ms); :class:`PartitionTimeError` saying
        which value and what was expected when it does not parse."""
        values = folder_values(folder)
        cols = self.columns_of_pattern(partition_by)
        for c in cols:
            if values.get(c) is None:
                msg = (
                    f"partition folder {folder!r}: column {c!r} is "
                    f"{'missing' if c not in values else 'null (' + _DEFAULT_PARTITION + ')'}; "
                    f"expected a value for time_pattern {self.time_pattern or '$' + c!r}"
                )
                raise PartitionTimeError(msg)
        pattern = self.time_pattern or f"${cols[0]}"
        text = _TOKEN.sub(lambda m: str(values[m.group(1)]), pattern)
        try:
            stamp = _dt.datetime.strptime(text, self.time_format)
        except ValueError:
            stamp = None
            if self.time_format == DEFAULT_TIME_FORMAT:  # Flink: a date alone is its midnight
                try:
                    stamp = _dt.datetime.strptime(text, "%Y-%m-%d")
                except ValueError:
                    stamp = None
            if stamp is None:
                msg = (
                    f"partition folder {folder!r}: time_pattern {pattern!r} gives {text!r}, "
                    f"which does not parse by time_format {self.time_format!r}"
                )
                raise PartitionTimeError(msg) from None
        return int(stamp.replace(tzinfo=self._zone()).timestamp() * 1000)

    def committer(self, partition_by: tuple[str, ...]) -> PartitionCommitter:
        return PartitionCommitter(self, partition_by)

    def describe(self) -> str:
        parts = [f"trigger={self.trigger!r}"]
        if self.time_pattern is not None:
            parts.append(f"time_pattern={self.time_pattern!r}")
        if self.time_format != DEFAULT_TIME_FORMAT:
            parts.append(f"time_format={self.time_format!r}")
        if self.time_zone != "UTC":
            parts.append(f"time_zone={self.time_zone!r}")
        parts.append(f"delay_ms={self.delay_ms}")
        return f"partition_commit({', '.join(parts)})"


def partition_commit(
    trigger: str = "partition-time",
    *,
    time_pattern: str | None = None,
    time_format: str = DEFAULT_TIME_FORMAT,
    time_zone: str = "UTC",
    delay_ms: int = 0,
    success_file: str | None = "_SUCCESS",
    on_commit: Callable[[CommittedPartition], Any] | CommitPolicy | None = None,
) -> PartitionCommit:
    """When to commit a partition folder and what that does: Flink's ``sink.partition-commit.*``
    (see :mod:`raystream.partition_commit`). NEXMark q10's Flink options are::

        >>> pc = partition_commit("partition-time", time_pattern="$dt $hm:00", delay_ms=60_000)
        >>> pc.partition_time_ms("dt=2015-07-15/hm=21%3A00", ("dt", "hm"))
        1436994000000

    ``success_file``: the name of the empty file written into a committed folder (None: none);
    ``on_commit``: a function called with the :class:`CommittedPartition`, or an object with
    ``commit(partition)``, run after the success file (on the controller: picklable)."""
    policies: list[Any] = []
    if success_file is not None:
        if not isinstance(success_file, str) or not success_file or "/" in success_file:
            msg = f"partition_commit: success_file must be a file name, got {success_file!r}"
            raise ConfigError(msg)
        policies.append(SuccessFile(success_file))
    if on_commit is not None:
        if callable(getattr(on_commit, "commit", None)):
            policies.append(on_commit)
        elif callable(on_commit):
            policies.append(_Callback(on_commit))
        else:
            msg = (
                "partition_commit: on_commit must be a function of the partition or an object "
                f"with commit(partition), got {type(on_commit).__name__}"
            )
            raise ConfigError(msg)
    return PartitionCommit(
        trigger=trigger,
        time_pattern=time_pattern,
        time_format=time_format,
        time_zone=time_zone,
        delay_ms=delay_ms,
        policies=tuple(policies),
    )


class PartitionCommitter:
    """The committer of one sink step (no Ray, no I/O): the folders written and not committed
    yet, and which of them are due. The state a checkpoint keeps is :meth:`snapshot`."""

    def __init__(self, spec: PartitionCommit, partition_by: tuple[str, ...]) -> None:
        self.spec = spec
        self.partition_by = partition_by
        self.pending: dict[str, int] = {}  # folder -> when first seen (processing time, ms)
        self._times: dict[str, int | None] = {}  # folder -> partition time (None: no parse)
        self.errors: list[str] = []  # folders whose values do not parse (new ones appended)

    def add(self, folders: Iterable[str], now_ms: int) -> None:
        """Folders that a completed checkpoint's parts (or an end) hold."""
        for folder in folders:
            self.pending.setdefault(folder, int(now_ms))
            if self.spec.trigger == "partition-time" and folder not in self._times:
                try:
                    self._times[folder] = self.spec.partition_time_ms(folder, self.partition_by)
                except PartitionTimeError as e:
                    self._times[folder] = None
                    self.errors.append(
                        f"{e}; its rows are written, and it is committed at the end of input only"
                    )

    def due(self, watermark_ms: int | None, now_ms: int) -> list[str]:
        """The pending folders to commit now (removed from pending): ``watermark_ms > partition
        time + delay_ms`` (None: no watermark yet), or for process-time ``now_ms > first seen +
        delay_ms`` (every one with ``delay_ms=0``), as Flink's triggers."""
        delay = self.spec.delay_ms
        if self.spec.trigger == "process-time":
            out = [f for f, seen in self.pending.items() if delay == 0 or now_ms > seen + delay]
        elif watermark_ms is None:
            return []
        else:
            out = [
                f
                for f in self.pending
                if (t := self._times.get(f)) is not None and watermark_ms > t + delay
            ]
        for f in out:
            del self.pending[f]
        return sorted(out)

    def end_of_input(self, folders: Iterable[str] = ()) -> list[str]:
        """Every folder pending or in ``folders`` (written in this attempt): all are due."""
        out = sorted(set(self.pending) | set(folders))
        self.pending.clear()
        return out

    def snapshot(self) -> dict[str, Any]:
        return {"pending": dict(self.pending)}

    def restore(self, state: dict[str, Any] | None) -> None:
        self.pending = {str(f): int(t) for f, t in ((state or {}).get("pending") or {}).items()}
        for f in list(self.pending):
            self.add([f], self.pending[f])


def commit_folders(
    spec: PartitionCommit, fs: pafs.FileSystem, root: str, folders: Iterable[str]
) -> None:
    """Run every policy of ``spec`` on each folder under ``root`` on ``fs``."""
    for folder in folders:
        partition = CommittedPartition(
            folder=folder,
            values=folder_values(folder),
            path=f"{root.rstrip('/')}/{folder}",
            filesystem=fs,
        )
        for policy in spec.policies:
            policy.commit(partition)


def now_ms() -> int:
    return int(time.time() * 1000)


WATERMARK_MAX = 2**63 - 1


class JobPartitionCommits:
    """The partition committers of a job's partitioned sinks with ``partition_commit``, fed
    from checkpoint acknowledgements (the controller) or from the sinks' results at the end.
    Each ``commit_*`` call does the I/O (run it in a thread)."""

    def __init__(self, steps: dict[str, Any]) -> None:
        self.sinks = {
            name: step.fn
            for name, step in steps.items()
            if step.kind == "sink" and getattr(step.fn, "partition_commit", None) is not None
        }
        self.committers = {
            name: sink.partition_commit.committer(sink.partition_by)
            for name, sink in self.sinks.items()
        }
        self.errors: list[str] = []  # what could not be parsed or committed (for the status)
        self._where: dict[str, tuple[pafs.FileSystem, str]] = {}
        self.committed = 0  # folder commits done (a folder committed twice counts twice)
        self.at_end = 0  # ... of which at the end of input

    def __bool__(self) -> bool:
        return bool(self.committers)

    def snapshot(self) -> dict[str, Any]:
        return {name: c.snapshot() for name, c in self.committers.items()}

    def restore(self, manifest: dict[str, Any] | None) -> None:
        """Back to the pending folders of ``manifest`` (None: a fresh start, nothing pending)."""
        state = (manifest or {}).get("partition_commits") or {}
        for name, c in self.committers.items():
            c.restore(state.get(name))
        self._take_errors()

    def add_acks(self, acks: Iterable[dict[str, Any]], now: int) -> dict[str, int | None]:
        """Add the folders the sink instances' acknowledgements of one checkpoint list; the
        job-wide watermark of each sink step at that checkpoint: the minimum over its instances
        (None when one has none yet; instances that reached their end do not hold it back)."""
        marks: dict[str, int | None] = {name: WATERMARK_MAX for name in self.committers}
        for a in acks:
            step = a["instance"][0]
            if step not in self.committers:
                continue
            state = a.get("sink_state")
            if isinstance(state, dict):
                self.committers[step].add(state.get("partitions") or {}, now)
            if "watermark_ms" in a and not a.get("final_sink_state"):
                w, mark = a["watermark_ms"], marks[step]
                marks[step] = None if w is None or mark is None else min(mark, int(w))
        self._take_errors()
        return marks

    def commit_due(self, marks: dict[str, int | None], now: int) -> list[tuple[str, str]]:
        """Commit what is due after a checkpoint completed and its parts were published."""
        due = {name: c.due(marks.get(name), now) for name, c in self.committers.items()}
        return self._commit(due, retry=True)

    def commit_end(self, written: dict[str, Iterable[str]]) -> list[tuple[str, str]]:
        """End of input: every pending folder and every folder in ``written`` (per sink step,
        what its instances wrote in this attempt)."""
        due = {name: c.end_of_input(written.get(name, ())) for name, c in self.committers.items()}
        return self._commit(due, retry=False)

    def _commit(self, due: dict[str, list[str]], *, retry: bool) -> list[tuple[str, str]]:
        done = []
        for name, folders in due.items():
            if not folders:
                continue
            fs, root = self._location(name)
            spec = self.sinks[name].partition_commit
            for folder in folders:
                try:
                    commit_folders(spec, fs, root, [folder])
                except Exception as e:  # noqa: BLE001 - retried after the next checkpoint
                    msg = (
                        f"sink {name!r}: committing partition {folder!r} failed: "
                        f"{type(e).__name__}: {e}"
                    )
                    if retry:
                        self.committers[name].add([folder], now_ms())
                        msg += " (retried after the next checkpoint)"
                    log.warning("%s", msg)
                    self.errors.append(msg)
                    continue
                done.append((name, folder))
                self.committed += 1
                self.at_end += not retry
        return done

    def _location(self, name: str) -> tuple[pafs.FileSystem, str]:
        if name not in self._where:
            from raystream.part_store import PartStore

            sink = self.sinks[name]
            store = PartStore(sink.path, sink.filesystem)
            store.close()
            root = os.path.abspath(store.root) if store.local else store.root
            self._where[name] = (store.fs, root)
        return self._where[name]

    def _take_errors(self) -> None:
        for name, c in self.committers.items():
            for e in c.errors:
                msg = f"sink {name!r}: {e}"
                log.warning("%s", msg)
                self.errors.append(msg)
            c.errors.clear()


def written_partitions(results: Iterable[tuple[str, Any]]) -> dict[str, list[str]]:
    """Per sink step, the folders its instances' results (:class:`WrittenFile`) name."""
    out: dict[str, list[str]] = {}
    for step, result in results:
        out.setdefault(step, []).extend(getattr(result, "partitions", ()) or ())
    return out
