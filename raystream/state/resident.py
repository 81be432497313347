"""Keyed state an operator keeps in memory in its own form, with RocksDB as the truth whenever
anything else reads or copies the state (no Ray here).

A :class:`ResidentStore` holds the rows of the sub-groups its instance holds. It follows them as
the in-memory timers do (:class:`raystream.runtime.timers.TimerService`): a sub-group that
arrived (restore, migration, or one a new migration task brings in again) is read from RocksDB
with one range scan of its state id; one that left is forgotten. It writes to RocksDB only when
the backend asks its pending writers (:meth:`RocksStateBackend.add_pending_writer`): before the
whole DB is read or copied (cache flush, range scans, snapshots, close, a move's hand-over) and
before sub-groups are evicted for an export (which it then forgets). It writes the sub-groups
changed since the last write as one ``bytes`` value per key, through the write-back cache (so
every reader of the cache sees them and a snapshot holds them), and deletes the keys it wrote
before that have no rows left. Nothing is written between those moments: a batch or a firing
touches memory only.

A subclass says how its rows look: :meth:`ResidentStore._load` (a sub-group's stored values
arrived), :meth:`ResidentStore._values` (the values to store for some sub-groups) and
:meth:`ResidentStore._drop` (forget sub-groups). It calls :meth:`ResidentStore.sync` before it
uses its rows and :meth:`ResidentStore.touch` for the sub-groups it changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from raystream.errors import StateError
from raystream.keys import KeySpace
from raystream.state.layout import PREFIX_LEN, decode_user_key, encode_keys

__all__ = ["Residency", "ResidentStore"]

_NONE: frozenset[bytes] = frozenset()


def _all_held(n: int) -> Callable[[], np.ndarray]:
    mask = np.ones(n, bool)
    return lambda: mask


def stale_sub_groups(
    indexed: np.ndarray, held: np.ndarray, task: Any, last_task: Any
) -> np.ndarray:
    """The sub-groups (a bool mask) whose in-memory copy must be dropped: those indexed here that
    this instance no longer holds, and, when a new migration ``task`` came (not ``last_task``),
    those it brings in although they are indexed (they left and came back with the rows of
    their other owner meanwhile)."""
    stale = indexed & ~held
    if task is not None and task is not last_task:
        incoming = np.fromiter(getattr(task, "incoming", ()), np.int64)
        stale[incoming[indexed[incoming]]] = True
    return stale


@dataclass
class Residency:
    """What a resident store needs from its instance: the sub-groups held here (bool mask over
    global sub-groups), those whose windows/timers may fire now (a rescale hands some out), the
    running migration task (its ``incoming`` sub-groups), the key kind ('int', 'str', 'bytes';
    None before the first batch) and the key column's name."""

    held: Callable[[], np.ndarray]
    firing: Callable[[], np.ndarray]
    task: Callable[[], Any]
    key_kind: Callable[[], str | None]
    key_column: str = "key"

    @staticmethod
    def everything(key_space: KeySpace, key_column: str = "key") -> Residency:
        """Every sub-group held and firing, no migration (tests, tools)."""
        held = _all_held(key_space.num_key_groups * key_space.sub_groups)
        return Residency(held, held, lambda: None, lambda: None, key_column)


class ResidentStore:
    """Base of an operator's in-memory keyed state (see the module doc)."""

    backend: Any = None
    state_id = 0
    key_space: KeySpace
    residency: Residency

    def bind(self, backend: Any, state_id: int, key_space: KeySpace, residency: Residency) -> None:
        """Attach to an instance's RocksDB as state ``state_id`` (done by the runtime)."""
        self.backend = backend
        self.state_id = state_id
        self.key_space = key_space
        self.residency = residency
        n = key_space.num_key_groups * key_space.sub_groups
        self._indexed = np.zeros(n, bool)  # sub-groups whose rows are here
        self._dirty = np.zeros(n, bool)  # changed since they were last written
        self._written: dict[int, set[bytes]] = {}  # per sub-group: its keys in RocksDB
        self._last_task: Any = None
        self._detached = False
        self.loaded = 0  # values read from RocksDB (sub-groups that arrived)
        self.writes = 0  # values written to RocksDB
        backend.add_pending_writer(lambda prefixes: self.write(backend, prefixes))

    def detach(self) -> None:
        """Never write again (the step's function was replaced, or the backend was)."""
        self._detached = True

    # ---- to implement ----------------------------------------------------------------------
    def _load(self, group: int, keys: list[Any], values: list[bytes]) -> None:
        """Sub-group ``group`` (global id) arrived: ``values[i]`` is stored for ``keys[i]``."""
        raise NotImplementedError

    def _values(self, groups: np.ndarray) -> tuple[np.ndarray, pa.Array, list[bytes]]:
        """Per key with rows in the sub-groups ``groups`` (bool mask): its global sub-group,
        the keys (an Arrow array) and the value to store."""
        raise NotImplementedError

    def _drop(self, gone: np.ndarray) -> None:
        """Forget the rows of the sub-groups ``gone`` (bool mask)."""
        raise NotImplementedError

    # ---- residency -------------------------------------------------------------------------
    def touch(self, groups: np.ndarray) -> None:
        """The rows of these global sub-groups (int array) changed."""
        self._dirty[groups] = True

    def sync(self) -> None:
        """Load the sub-groups that arrived, forget those that left. A sub-group a new migration
        task brings in is loaded again, even if it was here before (it left, was written when
        it was evicted, and came back with the rows of its other owner)."""
        held = self.residency.held()
        task = self.residency.task()
        if task is self._last_task and np.array_equal(held, self._indexed):
            return
        stale = stale_sub_groups(self._indexed, held, task, self._last_task)
        if task is not None:
            self._last_task = task
        if stale.any():
            self._forget(stale)
        arrived = np.flatnonzero(held & ~self._indexed)
        if len(arrived):
            self._indexed |= held  # before the scans: a flush they cause writes nothing of them
            for g in arrived.tolist():
                self._load_group(g)

    def _load_group(self, g: int) -> None:
        kg, sg = divmod(g, self.key_space.sub_groups)
        lower = kg.to_bytes(2, "big") + bytes((sg, self.state_id))
        upper = lower[:3] + bytes((self.state_id + 1,)) if self.state_id < 255 else None
        if upper is None:  # pragma: no cover - state ids stop at 250
            msg = f"state id {self.state_id} has no upper bound"
            raise StateError(msg)
        raws: list[bytes] = []
        values: list[bytes] = []
        for k, v in self.backend.scan(lower, upper):
            raws.append(bytes(k))
            values.append(bytes(v))
        if not raws:
            return
        kind = self.residency.key_kind() or _infer_kind(raws[0])
        keys = [decode_user_key(r, kind)[0] for r in raws]
        self._written[g] = set(raws)
        self.loaded += len(raws)
        self._load(g, keys, values)

    # ---- writing ---------------------------------------------------------------------------
    def write(self, backend: Any, prefixes: set[bytes] | None) -> None:
        """Write the changed sub-groups (of these 3-byte prefixes; None: all) to RocksDB.
        Sub-groups named by their prefixes are being evicted for an export: once written they
        are forgotten here, and loaded again from RocksDB if they are used here again (they may
        come back with another owner's rows before this instance looks at what it holds)."""
        if self._detached or backend is not self.backend:
            return
        if prefixes is None:
            self._write(backend, self._dirty.copy())
            return
        s = self.key_space.sub_groups
        mask = np.zeros_like(self._dirty)
        ids = [int.from_bytes(p[:2], "big") * s + p[2] for p in prefixes]
        mask[np.asarray(ids, np.int64)] = True
        self._write(backend, self._dirty & mask)
        gone = mask & self._indexed
        if gone.any():
            self._forget(gone)

    def _forget(self, gone: np.ndarray) -> None:
        self._drop(gone)
        for g in np.flatnonzero(gone).tolist():
            self._written.pop(g, None)
        self._dirty &= ~gone
        self._indexed &= ~gone

    def _write(self, backend: Any, groups: np.ndarray) -> None:
        if not groups.any():
            return
        g, keys, values = self._values(groups)
        s = self.key_space.sub_groups
        enc = encode_keys(g // s, g % s, self.state_id, keys) if len(keys) else []
        now: dict[int, set[bytes]] = {int(x): set() for x in np.flatnonzero(groups).tolist()}
        order = np.argsort(g, kind="stable")
        bounds = np.flatnonzero(np.r_[True, g[order][1:] != g[order][:-1], True]) if len(g) else []
        for a, b in zip(bounds[:-1], bounds[1:], strict=False):
            now[int(g[order[a]])] = {enc[i] for i in order[a:b].tolist()}
        deletes = sorted(k for x, ks in now.items() for k in self._written.get(x, _NONE) - ks)
        self._written.update(now)
        self._dirty &= ~groups
        if len(enc) or deletes:
            sort = sorted(range(len(enc)), key=enc.__getitem__)  # RocksDB likes sorted writes
            backend.write([enc[i] for i in sort], [values[i] for i in sort], deletes=deletes)
            self.writes += len(enc)


def _infer_kind(raw: bytes) -> str:
    """The key kind of a stored key when the instance has seen no key yet (after a restore): an
    8-byte body is an int64; else a string if it decodes as UTF-8."""
    body = raw[PREFIX_LEN:]
    if len(body) == 8 and int.from_bytes(body[:4], "big") != 4:
        return "int"
    try:
        body[4:].decode()
    except UnicodeDecodeError:
        return "bytes"
    return "str"
