"""A bounded history: the newest records of something that happens all the time (checkpoints).

A job that checkpoints every second for a week takes 604,800 checkpoints; the controller keeps
a record of each for ``status()`` (the last, the recent ones, how many). :class:`BoundedHistory`
keeps the newest ``keep`` records and counts every one appended, like Flink's checkpoint history
(``web.checkpoints.history``, 10 by default) beside its counts.

It reads like the list it replaces for the ways the controller reads it: ``len()`` and truth are
the number appended (``completed``), ``h[-1]`` is the newest, ``h[-20:]`` the 20 newest, and
iterating gives the records kept, oldest first. An index of a record no longer kept raises
``IndexError`` saying so.

Example::

    >>> h = BoundedHistory(keep=3)
    >>> for i in range(10):
    ...     h.append({"id": i})
    >>> len(h), h[-1], [r["id"] for r in h], [r["id"] for r in h[-2:]]
    (10, {'id': 9}, [7, 8, 9], [8, 9])
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from raystream.errors import ConfigError

__all__ = [
    "ACKED_EPOCHS_KEPT",
    "CHECKPOINT_HISTORY",
    "PUBLISHED_PATHS_KEPT",
    "RECORDS_KEPT",
    "BoundedHistory",
    "PublishedFiles",
    "RecentEpochs",
]

CHECKPOINT_HISTORY = 100  # checkpoint records the controller keeps (the newest)
# records of what happens again and again over a job's life that the controller keeps (the
# newest; a ``<name>_total`` beside each counts them all): rescales, standby and spare refills,
# recoveries, and the metrics of retired instances listed in the job's result
RECORDS_KEPT = 100
# paths a Parquet sink instance lists in its result (the newest; ``files`` counts them all):
# a checkpoint a second publishes a part file a second, 604,800 in a week
PUBLISHED_PATHS_KEPT = 1000
ACKED_EPOCHS_KEPT = 1024  # barrier epochs an instance remembers acknowledging (the newest)


def _kept_count(keep: Any, what: str) -> int:
    """``keep`` checked: an int >= 1 (how many ``what`` are kept)."""
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        msg = f"keep must be an int >= 1 ({what} kept), got {keep!r}"
        raise ConfigError(msg)
    return keep


class BoundedHistory:
    """The newest ``keep`` records appended, and how many were (see the module)."""

    def __init__(self, keep: int = CHECKPOINT_HISTORY) -> None:
        self.keep = _kept_count(keep, "records")
        self._kept: deque[Any] = deque(maxlen=keep)
        self._appended = 0

    def append(self, record: Any) -> None:
        self._kept.append(record)
        self._appended += 1

    def __len__(self) -> int:
        return self._appended

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._kept))

    def kept(self) -> list[Any]:
        """The records kept, oldest first."""
        return list(self._kept)

    def __getitem__(self, index: int | slice) -> Any:
        first = self._appended - len(self._kept)  # the position of the oldest kept
        if isinstance(index, slice):
            return [
                self._kept[i - first] for i in range(*index.indices(self._appended)) if i >= first
            ]
        i = index + self._appended if index < 0 else index
        if not first <= i < self._appended:
            msg = (
                f"record {index} of {self._appended}: only the newest {len(self._kept)} are kept "
                f"(positions {first} .. {self._appended - 1})"
            )
            raise IndexError(msg)
        return self._kept[i - first]

    def __repr__(self) -> str:
        return (
            f"BoundedHistory(appended={self._appended}, kept={len(self._kept)}, keep={self.keep})"
        )


class RecentEpochs:
    """The barrier epochs an instance acknowledged, the newest ``keep`` of them: a set for the
    questions asked of it (was the checkpoint or rescale barrier in flight acknowledged?),
    which are about recent epochs; one epoch a second for days is not kept.

    Example::

        >>> acked = RecentEpochs(keep=2)
        >>> for epoch in (1, 2, 3):
        ...     acked.add(epoch)
        >>> 3 in acked, 1 in acked, sorted(acked), len(acked)
        (True, False, [2, 3], 2)
    """

    def __init__(self, keep: int = ACKED_EPOCHS_KEPT) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            msg = f"keep must be an int >= 1 (epochs kept), got {keep!r}"
            raise ConfigError(msg)
        self.keep = keep
        self._set: set[int] = set()
        self._order: deque[int] = deque()

    def add(self, epoch: int) -> None:
        if epoch in self._set:
            return
        self._set.add(epoch)
        self._order.append(epoch)
        while len(self._order) > self.keep:
            self._set.discard(self._order.popleft())

    def __contains__(self, epoch: object) -> bool:
        return epoch in self._set

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._set)


class PublishedFiles:
    """The files a sink instance published: how many (``files``) and their rows (``rows``),
    every one counted, and the paths of the newest ``keep`` (``paths``, in publishing order).

    Example::

        >>> done = PublishedFiles(keep=2)
        >>> done.extend([("a", 5), ("b", 0), ("c", 7)])
        >>> done.paths, done.files, done.rows, bool(done)
        (('b', 'c'), 3, 12, True)
    """

    def __init__(self, keep: int | None = None) -> None:
        keep = _kept_count(PUBLISHED_PATHS_KEPT if keep is None else keep, "paths")
        self.keep = keep
        self._paths: deque[str] = deque(maxlen=keep)
        self.files = 0
        self.rows = 0

    def add(self, path: str, rows: int) -> None:
        self._paths.append(path)
        self.files += 1
        self.rows += int(rows)

    def extend(self, published: Iterable[tuple[str, int]]) -> None:
        """Add ``(path, rows)`` of each file, in publishing order."""
        for path, rows in published:
            self.add(path, rows)

    def merge(self, other: PublishedFiles) -> None:
        """Add what ``other`` counted, its paths after these (the newest ``keep`` stay)."""
        self._paths.extend(other._paths)
        self.files += other.files
        self.rows += other.rows

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(self._paths)

    @property
    def last(self) -> str | None:
        """The path of the file published last (None if none was)."""
        return self._paths[-1] if self._paths else None

    def __bool__(self) -> bool:
        return self.files > 0

    def __repr__(self) -> str:
        return f"PublishedFiles(files={self.files}, rows={self.rows}, kept={len(self._paths)})"
