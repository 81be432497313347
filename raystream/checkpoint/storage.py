"""Checkpoint storage: where snapshots of a job go, through ``pyarrow.fs`` (local path, ``s3://``...).

Layout under ``<uri>/<job>`` (every path a manifest holds is relative to that root)::

    shared/<db_uid>/<name>.sst            SST files: immutable, stored once, shared by checkpoints
    chk-<id>/<step>/<index>/rocksdb/...   the other files of a RocksDB checkpoint (MANIFEST-*, ...)
    chk-<id>/<step>/<index>/blobs/<name>  small opaque blobs (sink tables, dedupe tables, ...)
    chk-<id>/<step>/<index>/_INTENT.json  shared files an upload references (guards retention)
    chk-<id>/_MANIFEST.json               written last, atomically: the checkpoint is complete

Uploads are incremental like Flink's incremental RocksDB checkpoints: an SST file already in
``shared/`` (same name, same size) is referenced, not copied. ``complete()`` writes the manifest
and then applies retention. Checkpoints are meant to be taken one at a time: ``complete(n)`` runs
before uploads of checkpoint ``n + 1`` start (uploads of a later checkpoint that already wrote
their ``_INTENT.json`` are protected, but an upload that checks ``shared/`` in the instant between
retention listing intents and deleting could reference a file being deleted; it is then caught
when that checkpoint is verified, which skips it).

A savepoint is a self-contained copy of one checkpoint at another URI, with the same relative
layout (so the paths in its manifest stay valid); :func:`open_savepoint` reads it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from raystream.errors import CheckpointError

__all__ = ["CheckpointReader", "CheckpointStorage", "check_compatible", "open_savepoint"]

log = logging.getLogger("raystream.checkpoint")

MANIFEST = "_MANIFEST.json"
INTENT = "_INTENT.json"
VERSION = 1
# completes (and their retention) run one at a time in a process: a checkpoint and the final
# commit at the end of input may complete at once, and must not delete the same files twice
_COMPLETING = threading.Lock()
_STALE_TMP_S = 3600.0  # a temporary upload file older than this is debris of a crashed upload


def _resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """A filesystem and a path in it; a plain (relative) local path is made absolute."""
    if not isinstance(uri, (str, os.PathLike)) or not os.fspath(uri):
        msg = f"checkpoint storage needs a URI or a directory path, got {uri!r}"
        raise CheckpointError(msg)
    uri = os.fspath(uri)
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri).replace(os.sep, "/")
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
        msg = (
            f"checkpoint storage URI {uri!r} cannot be opened by pyarrow.fs ({exc}); pass a local "
            "path or a URI pyarrow supports (file://, s3://, gs://, hdfs://)"
        )
        raise CheckpointError(msg) from exc
    return fs, path.rstrip("/")


def _link(fs: pafs.FileSystem, src: str, dst: str) -> bool:
    """Hard-link local file ``src`` as ``dst`` when the storage is a local filesystem (RocksDB
    never changes an SST file once written, so a link is as good as a copy, and costs no I/O).
    False when it is not local or the link fails (another device, no link support): copy."""
    if not isinstance(fs, pafs.LocalFileSystem):
        return False
    try:
        os.link(src, dst)
    except OSError:
        return False
    return True


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts) if p)


def _check_instance(instance: str) -> str:
    parts = instance.split("/") if isinstance(instance, str) else []
    if len(parts) != 2 or not all(parts) or any(p in (".", "..") for p in parts):
        msg = f"instance must be '<step>/<index>' (e.g. 'count/3'), got {instance!r}"
        raise CheckpointError(msg)
    return instance


def _check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        msg = f"{what} must be a plain file name (no '/'), got {name!r}"
        raise CheckpointError(msg)
    return name


def _file_refs(obj: Any) -> Iterator[tuple[str, int]]:
    """Every ``{"path": str, "size": int, ...}`` in a manifest (the files of state uploads)."""
    if isinstance(obj, dict):
        path, size = obj.get("path"), obj.get("size")
        if isinstance(path, str) and isinstance(size, int) and not isinstance(size, bool):
            yield path, size
        for v in obj.values():
            yield from _file_refs(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _file_refs(v)


def _chk_id(name: str) -> int | None:
    if not name.startswith("chk-"):
        return None
    digits = name[4:]
    return int(digits) if digits.isdigit() else None


class CheckpointReader:
    """Reads files of checkpoints (or of a savepoint) below one root."""

    def __init__(self, fs: pafs.FileSystem, root: str) -> None:
        self.fs = fs
        self.root = root

    def _abs(self, rel: str) -> str:
        if rel.startswith("/") or ".." in rel.split("/"):
            msg = f"checkpoint file reference {rel!r} must be a path relative to the storage root"
            raise CheckpointError(msg)
        return _join(self.root, rel)

    def get_blob(self, ref: str) -> bytes:
        """The bytes of a blob :meth:`CheckpointStorage.put_blob` stored (``ref`` is what it
        returned)."""
        try:
            with self.fs.open_input_stream(self._abs(ref)) as f:
                return bytes(f.readall())
        except (FileNotFoundError, OSError) as exc:
            msg = f"checkpoint blob {ref!r} cannot be read below {self.root!r} ({exc})"
            raise CheckpointError(msg) from exc

    def materialize_state(self, state: dict[str, Any], local_dir: str | os.PathLike[str]) -> str:
        """Download the files of one :meth:`CheckpointStorage.upload_state` result into
        ``local_dir`` (new or empty), a RocksDB checkpoint folder that
        ``RocksStateBackend.restore_key_groups(local_dir, key_groups)`` reads. Returns the path."""
        local = Path(local_dir)
        if local.exists() and (not local.is_dir() or any(local.iterdir())):
            msg = f"materialize_state needs a new or empty local folder; {local} is not"
            raise CheckpointError(msg)
        files = state.get("files") if isinstance(state, dict) else None
        if not isinstance(files, list) or not files:
            msg = f"materialize_state expects an upload_state() result with 'files', got {state!r}"
            raise CheckpointError(msg)
        local.mkdir(parents=True, exist_ok=True)
        for entry in files:
            name = _check_name(entry["name"], "a state file name")
            target = local / name
            if name.endswith(".sst") and _link(self.fs, self._abs(entry["path"]), str(target)):
                pass  # immutable: linked, not copied (a restored DB only ever deletes it)
            else:
                self._copy_in(entry, target)
            if target.stat().st_size != entry["size"]:
                msg = (
                    f"state file {entry['path']!r} has {target.stat().st_size} bytes, the "
                    f"checkpoint recorded {entry['size']}; restore from another checkpoint"
                )
                raise CheckpointError(msg)
        return str(local)

    def _copy_in(self, entry: dict[str, Any], target: Path) -> None:
        try:
            with (
                self.fs.open_input_stream(self._abs(entry["path"])) as src,
                open(target, "wb") as dst,
            ):
                shutil.copyfileobj(src, dst, 1 << 20)
        except (FileNotFoundError, OSError) as exc:
            msg = (
                f"state file {entry['path']!r} cannot be read below {self.root!r} ({exc}); "
                "the checkpoint is damaged, restore from another one"
            )
            raise CheckpointError(msg) from exc

    # ---- manifests --------------------------------------------------------------------------
    def _read_manifest(self, path: str) -> tuple[dict[str, Any] | None, str]:
        """(manifest, "") if ``path`` holds a usable manifest whose files are all there with their
        recorded sizes, else (None, why not)."""
        try:
            with self.fs.open_input_stream(path) as f:
                raw = f.readall()
        except FileNotFoundError:
            return None, "it has no _MANIFEST.json (incomplete)"
        except OSError as exc:
            return None, f"its _MANIFEST.json cannot be read ({exc})"
        try:
            manifest = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            return None, f"its _MANIFEST.json is not valid JSON ({exc})"
        if not isinstance(manifest, dict) or manifest.get("version") != VERSION:
            return None, f"its _MANIFEST.json is not a version-{VERSION} raystream manifest"
        files = manifest.get("storage_files")
        if not isinstance(files, dict):
            return None, "its _MANIFEST.json lists no storage_files"
        why = self._verify_files(files)
        return (None, why) if why else (manifest, "")

    def _verify_files(self, files: dict[str, int]) -> str:
        rels = sorted(files)
        infos = self.fs.get_file_info([self._abs(r) for r in rels]) if rels else []
        for rel, info in zip(rels, infos, strict=True):
            if info.type != pafs.FileType.File:
                return f"file {rel!r} it references is missing"
            if info.size != files[rel]:
                return f"file {rel!r} has {info.size} bytes, the manifest recorded {files[rel]}"
        return ""


class CheckpointStorage(CheckpointReader):
    """Checkpoints of job ``job`` under ``<uri>/<job>``, keeping the newest ``retain``.

    Safe to use from several threads and processes at once for uploads (each instance writes its
    own files); :meth:`complete` belongs to one caller (the controller).
    """

    def __init__(self, uri: str, job: str, *, retain: int = 3, probe: bool = True) -> None:
        """``probe=False``: only to read checkpoints (no file is written, no folder made)."""
        _check_name(job, "the job name used as checkpoint folder")
        if not isinstance(retain, int) or isinstance(retain, bool) or retain < 1:
            msg = f"retain must be an int >= 1 (checkpoints kept), got {retain!r}"
            raise CheckpointError(msg)
        fs, base = _resolve(uri)
        super().__init__(fs, _join(base, job))
        self.uri = os.fspath(uri)
        self.job = job
        self.retain = retain
        if probe:
            _probe_writable(self.fs, self.root, self.uri)

    def __repr__(self) -> str:
        return f"CheckpointStorage({self.root!r}, retain={self.retain})"

    def _write(self, path: str, data: bytes) -> None:
        self.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with self.fs.open_output_stream(path) as out:
            out.write(data)

    def _upload(self, local: str, path: str, *, link: bool = False) -> None:
        self.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        if link and _link(self.fs, local, path):
            return
        with open(local, "rb") as src, self.fs.open_output_stream(path) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)

    # ---- writing a checkpoint ---------------------------------------------------------------
    def upload_state(
        self, checkpoint_id: int, instance: str, local_dir: str, db_uid: str
    ) -> dict[str, Any]:
        """Store a RocksDB checkpoint folder (``RocksStateBackend.snapshot``) of ``instance``
        (``"<step>/<index>"``). SST files go to ``shared/<db_uid>/`` once and are referenced
        afterwards; the other files are copied to ``chk-<id>/<instance>/rocksdb/``.

        Returns ``{"db_uid", "files": [{"name", "path", "size"}], "uploaded_bytes",
        "referenced_bytes"}`` (JSON-able; put it in the manifest as it is)."""
        _check_instance(instance)
        _check_name(db_uid, "db_uid")
        local = Path(local_dir)
        if not (local / "CURRENT").is_file():
            msg = f"{local} is not a RocksDB checkpoint folder (no CURRENT file); snapshot first"
            raise CheckpointError(msg)
        names = sorted(p.name for p in local.iterdir() if p.is_file())
        sizes = {n: (local / n).stat().st_size for n in names}
        ssts = [n for n in names if n.endswith(".sst")]
        base = _join(f"chk-{int(checkpoint_id)}", instance)
        shared = [_join("shared", db_uid, n) for n in ssts]
        # Announce the shared files first: retention keeps them while this checkpoint is running.
        self._write(self._abs(_join(base, INTENT)), json.dumps(shared).encode())
        infos = self.fs.get_file_info([self._abs(p) for p in shared]) if shared else []
        files: list[dict[str, Any]] = []
        uploaded = referenced = 0
        for name, rel, info in zip(ssts, shared, infos, strict=True):
            size = sizes[name]
            if info.type == pafs.FileType.File and info.size == size:
                referenced += size
            else:
                if info.type != pafs.FileType.NotFound:  # same name, other size: a torn upload
                    rel = _join("shared", db_uid, f"{int(checkpoint_id)}-{name}")
                tmp = self._abs(f"{rel}.{uuid.uuid4().hex}.tmp")
                self._upload(str(local / name), tmp, link=True)  # SSTs: linked on a local fs
                self.fs.move(tmp, self._abs(rel))
                uploaded += size
            files.append({"name": name, "path": rel, "size": size})
        for name in names:
            if name.endswith(".sst"):
                continue
            rel = _join(base, "rocksdb", name)
            self._upload(str(local / name), self._abs(rel))
            uploaded += sizes[name]
            files.append({"name": name, "path": rel, "size": sizes[name]})
        return {
            "db_uid": db_uid,
            "files": files,
            "uploaded_bytes": uploaded,
            "referenced_bytes": referenced,
        }

    def put_blob(
        self, checkpoint_id: int, instance: str, name: str, data: bytes, *, shared: bool = False
    ) -> str:
        """Store ``data`` for ``instance`` in checkpoint ``checkpoint_id``; returns its ref (a
        path relative to the root) for :meth:`get_blob`. Blobs are part of their checkpoint.
        ``shared=True``: the blob goes to ``shared/`` and lives as long as a retained manifest
        references it as ``{"path": ref, "size": len(data)}`` (later checkpoints may too)."""
        _check_instance(instance)
        _check_name(name, "blob name")
        rel = _join(f"chk-{int(checkpoint_id)}", instance, "blobs", name)
        if shared:
            rel = _join("shared", "blobs", instance, f"{int(checkpoint_id)}-{name}")
        self._write(self._abs(rel), bytes(data))
        return rel

    def complete(self, checkpoint_id: int, manifest: dict[str, Any]) -> None:
        """Make checkpoint ``checkpoint_id`` complete: write its ``_MANIFEST.json`` (the caller's
        dict plus ``version``, ``checkpoint_id`` and ``storage_files`` = every file it needs with
        its size) through a temporary name, then apply retention."""
        cid = int(checkpoint_id)
        chk = f"chk-{cid}"
        files: dict[str, int] = {}
        for info in self.fs.get_file_info(
            pafs.FileSelector(self._abs(chk), allow_not_found=True, recursive=True)
        ):
            name = info.path.rsplit("/", 1)[-1]
            own = name not in (INTENT, MANIFEST) and not name.endswith(".tmp")
            if info.type == pafs.FileType.File and own:
                files[info.path[len(self.root) + 1 :]] = info.size
        for rel, size in _file_refs(manifest):
            files[rel] = size
        why = self._verify_files(files)
        if why:
            msg = f"checkpoint {cid} of job {self.job!r} cannot complete: {why}; it was not stored"
            raise CheckpointError(msg)
        doc = dict(manifest)
        doc.update(version=VERSION, checkpoint_id=cid, storage_files=files)
        try:
            data = json.dumps(doc, sort_keys=True).encode()
        except (TypeError, ValueError) as exc:
            msg = (
                f"checkpoint {cid} manifest must be JSON-able (lists, dicts, str, int, float, "
                f"bool, None): {exc}; convert numpy values and tuples before complete()"
            )
            raise CheckpointError(msg) from exc
        tmp = self._abs(_join(chk, f"{MANIFEST}.{uuid.uuid4().hex}.tmp"))
        with _COMPLETING:
            self._write(tmp, data)
            self.fs.move(tmp, self._abs(_join(chk, MANIFEST)))
            self._apply_retention()

    # ---- reading ----------------------------------------------------------------------------
    def _chk_ids(self) -> list[int]:
        infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        ids = (_chk_id(i.base_name) for i in infos if i.type == pafs.FileType.Directory)
        return sorted(i for i in ids if i is not None)

    def _load(self, cid: int) -> tuple[dict[str, Any] | None, str]:
        return self._read_manifest(self._abs(_join(f"chk-{cid}", MANIFEST)))

    def latest(self) -> dict[str, Any] | None:
        """The manifest of the newest complete, intact checkpoint; None if there is none. A newer
        checkpoint that is incomplete or damaged is skipped with a warning saying why."""
        for cid in reversed(self._chk_ids()):
            manifest, why = self._load(cid)
            if manifest is not None:
                return manifest
            log.warning(
                "checkpoint %d of job %r under %s is skipped: %s", cid, self.job, self.root, why
            )
        return None

    def load(self, checkpoint_id: int) -> dict[str, Any]:
        """The manifest of checkpoint ``checkpoint_id``; CheckpointError if it is not usable."""
        cid = int(checkpoint_id)
        manifest, why = self._load(cid)
        if manifest is None:
            have = self.checkpoints()
            msg = (
                f"checkpoint {cid} of job {self.job!r} under {self.root} cannot be used: {why}; "
                f"complete checkpoints there: {have or 'none'}"
            )
            raise CheckpointError(msg)
        return manifest

    def checkpoints(self) -> list[int]:
        """Ids of the complete, intact checkpoints kept, oldest first."""
        return [cid for cid in self._chk_ids() if self._load(cid)[0] is not None]

    # ---- retention --------------------------------------------------------------------------
    def _apply_retention(self) -> None:
        ids = self._chk_ids()
        good = {cid: m for cid in ids if (m := self._load(cid)[0]) is not None}
        keep = sorted(good)[-self.retain :]
        if not keep:
            return
        newest = keep[-1]
        referenced: set[str] = set()
        for cid in keep:
            referenced.update(good[cid]["storage_files"])
        for cid in ids:
            if cid > newest:  # still being written: keep the shared files it announced
                referenced.update(self._intents(cid))
            elif cid not in keep:
                _delete(self.fs.delete_dir, self._abs(f"chk-{cid}"))
        now = time.time()
        for info in self.fs.get_file_info(
            pafs.FileSelector(self._abs("shared"), allow_not_found=True, recursive=True)
        ):
            if info.type != pafs.FileType.File:
                continue
            rel = info.path[len(self.root) + 1 :]
            if rel in referenced:
                continue
            if (
                rel.endswith(".tmp")
                and info.mtime is not None
                and (now - info.mtime.timestamp() < _STALE_TMP_S)
            ):
                continue  # an upload in progress
            _delete(self.fs.delete_file, info.path)

    def _intents(self, cid: int) -> set[str]:
        out: set[str] = set()
        for info in self.fs.get_file_info(
            pafs.FileSelector(self._abs(f"chk-{cid}"), allow_not_found=True, recursive=True)
        ):
            if info.type == pafs.FileType.File and info.base_name == INTENT:
                try:
                    with self.fs.open_input_stream(info.path) as f:
                        out.update(json.loads(f.readall()))
                except (OSError, ValueError):
                    continue
        return out

    # ---- savepoints -------------------------------------------------------------------------
    def savepoint(self, checkpoint_id: int, target_uri: str) -> str:
        """Copy checkpoint ``checkpoint_id`` with every file it references (also those in
        ``shared/``) to ``target_uri``, self-contained, with the same relative layout so the
        manifest's paths stay valid there, and its own ``_MANIFEST.json`` (written last, with a
        ``savepoint`` entry). Retention never touches it. Returns the manifest's path."""
        manifest = self.load(checkpoint_id)
        fs, target = _resolve(target_uri)
        probe = fs.get_file_info(_join(target, MANIFEST))
        if probe.type != pafs.FileType.NotFound:
            msg = f"{target_uri!r} already holds a savepoint; choose a new target"
            raise CheckpointError(msg)
        _probe_writable(fs, target, os.fspath(target_uri))
        for rel in sorted(manifest["storage_files"]):
            dst = _join(target, rel)
            fs.create_dir(dst.rsplit("/", 1)[0], recursive=True)
            with (
                self.fs.open_input_stream(self._abs(rel)) as src,
                fs.open_output_stream(dst) as out,
            ):
                shutil.copyfileobj(src, out, 1 << 20)
        doc = dict(manifest)
        doc["savepoint"] = {
            "source": self.root,
            "checkpoint_id": int(checkpoint_id),
            "created": time.time(),
        }
        path = _join(target, MANIFEST)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with fs.open_output_stream(tmp) as out:
            out.write(json.dumps(doc, sort_keys=True).encode())
        fs.move(tmp, path)
        return path


def open_savepoint(uri: str) -> tuple[CheckpointReader, dict[str, Any]]:
    """Open the savepoint at ``uri``: ``(reader, manifest)``; the reader has ``get_blob`` and
    ``materialize_state`` for the refs and state descriptions of the manifest. CheckpointError
    if it is missing, incomplete or damaged."""
    fs, root = _resolve(uri)
    reader = CheckpointReader(fs, root)
    manifest, why = reader._read_manifest(_join(root, MANIFEST))  # noqa: SLF001
    if manifest is None:
        msg = f"{uri!r} is not a usable savepoint: {why}; pass the folder savepoint() wrote"
        raise CheckpointError(msg)
    return reader, manifest


def check_compatible(
    manifest: dict[str, Any],
    job: str,
    steps: dict[str, str],
    num_key_groups: int,
    sub_groups: int,
) -> None:
    """Raise CheckpointError naming every difference between the job a manifest was taken from
    (its keys ``job``, ``steps`` = {step name: kind}, ``num_key_groups``, ``sub_groups``) and the
    job about to be restored from it."""
    problems: list[str] = []
    if manifest.get("job") != job:
        problems.append(f"job name is {manifest.get('job')!r}, this job is {job!r}")
    old = manifest.get("steps")
    if not isinstance(old, dict):
        problems.append("the manifest records no step names and kinds ('steps')")
        old = {}
    missing = sorted(set(old) - set(steps))
    extra = sorted(set(steps) - set(old))
    changed = sorted(s for s in set(old) & set(steps) if old[s] != steps[s])
    if missing:
        problems.append(f"steps {missing} of the checkpoint are not in this job")
    if extra:
        problems.append(f"steps {extra} of this job are not in the checkpoint")
    for s in changed:
        problems.append(f"step {s!r} was a {old[s]!r}, is now a {steps[s]!r}")
    if manifest.get("num_key_groups") != num_key_groups:
        problems.append(
            f"num_key_groups was {manifest.get('num_key_groups')}, is now {num_key_groups}"
        )
    if manifest.get("sub_groups") != sub_groups:
        problems.append(f"sub_groups was {manifest.get('sub_groups')}, is now {sub_groups}")
    if problems:
        msg = (
            f"checkpoint {manifest.get('checkpoint_id')} does not fit job {job!r}: "
            + "; ".join(problems)
            + ". Restore it into the dataflow it was taken from (same step names and kinds, "
            "num_key_groups and sub_groups), or start the job without restoring."
        )
        raise CheckpointError(msg)


def _delete(delete: Any, path: str) -> None:
    """Retention deletes ``path``; one that is gone already (another process's retention of
    the same storage got there first) is as good as deleted."""
    try:
        delete(path)
    except FileNotFoundError:
        log.debug("checkpoint storage: %s was already deleted", path)


def _probe_writable(fs: pafs.FileSystem, root: str, uri: str) -> None:
    """Write and delete a small file under ``root``; CheckpointError saying what to do if not."""
    probe = _join(root, f".probe-{uuid.uuid4().hex}")
    try:
        path = root
        while path:  # the first existing folder on the way up must not be a file
            info = fs.get_file_info(path)
            if info.type == pafs.FileType.File:
                msg = f"checkpoint path {path!r} (from {uri!r}) is a file; pass a directory"
                raise CheckpointError(msg)
            if info.type == pafs.FileType.Directory or "/" not in path.strip("/"):
                break
            path = path.rstrip("/").rsplit("/", 1)[0]
        fs.create_dir(root, recursive=True)
        with fs.open_output_stream(probe) as out:
            out.write(b"raystream")
        fs.delete_file(probe)
    except CheckpointError:
        raise
    except (OSError, pa.ArrowException) as exc:
        msg = (
            f"checkpoint path {root!r} (from {uri!r}) is not writable ({exc}); pass a directory "
            "this process can create and write files in"
        )
        raise CheckpointError(msg) from exc
