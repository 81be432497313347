"""Where a Parquet sink's part files go: a local folder or any ``pyarrow.fs`` filesystem.

A sink writes each part into a local staging file first, then hands it over with
:meth:`PartStore.put` under a name in the output folder, and publishes a pre-committed part with
:meth:`PartStore.publish` (hidden pending name -> visible name). On a local folder the staging
files live in the output folder itself and both steps are atomic renames. On an object store
(``s3://``, ``gs://``) rename is not atomic, so the store never writes a visible name
before the part is complete and committed:

- ``put`` uploads the finished local file under its target name in one request; an object
  store creates an object whole when its upload completes, so a reader sees all of it or none;
- ``publish`` copies the pending object to its visible name on the server (``CopyObject``:
  the visible object again appears whole, and only after the checkpoint completed) and then
  deletes the pending one. A crash between the two leaves both; publishing again copies the
  same bytes once more and deletes the pending object, so it stays idempotent.

Flink's FileSink gets the same guarantee on S3 with a multipart upload it completes at the
checkpoint's commit; ``pyarrow.fs`` does not expose a multipart upload across processes, so
the pending part is a hidden object instead (one server-side copy per part at commit; S3's
``CopyObject`` takes objects up to 5 GB: keep parts smaller with ``max_file_bytes``). Readers
of ``folder/*.parquet`` (DuckDB, Spark, pyarrow.dataset, :func:`raystream.read_upsert`) skip the
hidden ``.part-*.pending`` names, so they read each committed record once. HDFS renames
atomically; ``publish`` is then one rename.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
from urllib.parse import unquote, urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from raystream.errors import ConfigError

__all__ = ["SCHEMES", "PartStore", "check_uri", "redact"]

# URI schemes pyarrow.fs.FileSystem.from_uri opens (file:// is taken as a local folder)
SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "file")
_BUCKETED = ("s3", "gs", "gcs", "abfs", "abfss")
_EXPECTED = (
    "a local folder or a pyarrow.fs URI: s3://bucket/prefix, gs://bucket/prefix, "
    "hdfs://host:port/path, file:///abs/path"
)


def redact(uri: str) -> str:
    """``s3://KEY:SECRET@bucket/...`` as ``s3://***@bucket/...`` (for messages and describe)."""
    scheme, sep, rest = uri.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return uri


def check_uri(path: str, where: str) -> str:
    """``path`` as the sink keeps it: a local path as given, ``file://`` URIs as local paths,
    other URIs unchanged after a syntax check (no network): :class:`ConfigError` naming what was
    expected for an unknown scheme or a URI without a bucket/host."""
    if "://" not in path:
        return path
    parts = urlsplit(path)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        msg = (
            f"{where}: {redact(path)!r} has the scheme {scheme!r}; expected {_EXPECTED} "
            f"(schemes: {', '.join(SCHEMES)})"
        )
        raise ConfigError(msg)
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path:
            msg = f"{where}: {path!r} is not a local file URI; expected file:///abs/path"
            raise ConfigError(msg)
        return unquote(parts.path)
    host = parts.netloc.rsplit("@", 1)[-1]
    if not host:
        what = "bucket" if scheme in _BUCKETED else "host"
        msg = f"{where}: {redact(path)!r} names no {what}; expected {_EXPECTED}"
        raise ConfigError(msg)
    return path


def _credentials_hint(path: str) -> str:
    scheme = path.partition("://")[0].lower()
    if scheme == "s3":
        return (
            "expected the bucket to exist and credentials that may write to it: "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or a profile or instance role) on every "
            "node, or s3://KEY:SECRET@bucket/...; for a store that is not AWS add "
            "?endpoint_override=host:port&scheme=http to the URI"
        )
    if scheme in ("gs", "gcs"):
        return (
            "expected the bucket to exist and Google credentials that may write to it "
            "(GOOGLE_APPLICATION_CREDENTIALS on every node)"
        )
    return "expected a folder this process may create and write to"


class PartStore:
    """The output folder of a Parquet sink (``path``: a local path or a URI; ``filesystem``:
    an explicit ``pyarrow.fs.FileSystem``, then ``path`` is a path on it)."""

    def __init__(self, path: str, filesystem: pafs.FileSystem | None = None) -> None:
        self.uri = path
        self.local = filesystem is None and "://" not in path
        if self.local:
            self.fs: pafs.FileSystem = pafs.LocalFileSystem()
            self.root = path
            self.stage_dir = path
            return
        if filesystem is not None:
            self.fs, self.root = filesystem, path.rstrip("/")
        else:
            try:
                self.fs, root = pafs.FileSystem.from_uri(path)
            except (pa.ArrowException, OSError, ValueError) as exc:
                msg = (
                    f"parquet sink {redact(path)!r}: pyarrow.fs cannot open it ({exc}); "
                    f"{_credentials_hint(path)}"
                )
                raise ConfigError(msg) from exc
            self.root = root.rstrip("/")
        self.stage_dir = tempfile.mkdtemp(prefix="raystream-parquet-sink-")
        self._scheme = "" if filesystem is not None else path.partition("://")[0] + "://"

    # ---- setup ------------------------------------------------------------------------
    def ensure_folder(self) -> None:
        """Create the output folder (if missing) and check it is one: :class:`ConfigError`
        naming what was expected if it is a file, or the store refuses (missing bucket,
        credentials, permissions)."""
        if self.local:
            if os.path.exists(self.root) and not os.path.isdir(self.root):
                msg = (
                    f"parquet sink path {self.root!r} is a file; expected a directory (each sink "
                    "instance writes part-NNNNN*.parquet into it). Choose another path."
                )
                raise ConfigError(msg)
            os.makedirs(self.root, exist_ok=True)
            return
        try:
            info = self.fs.get_file_info(self.root)
            if info.type == pafs.FileType.File:
                msg = (
                    f"parquet sink path {redact(self.uri)!r} is a file; expected a folder (each "
                    "sink instance writes part-NNNNN*.parquet into it). Choose another path."
                )
                raise ConfigError(msg)
            if info.type == pafs.FileType.NotFound:
                self.fs.create_dir(self.root, recursive=True)
        except (pa.ArrowException, OSError) as exc:
            msg = f"parquet sink {redact(self.uri)!r} cannot be written ({exc}); "
            msg += _credentials_hint(self.uri)
            raise ConfigError(msg) from exc

    # ---- names ------------------------------------------------------------------------
    def _abs(self, name: str) -> str:
        return os.path.join(self.root, name) if self.local else f"{self.root}/{name}"

    def display(self, name: str) -> str:
        """What results and messages call the file ``name`` (a local path, or a URI)."""
        if self.local:
            return os.path.join(self.root, name)
        return f"{self._scheme}{self.root}/{name}"

    def stage(self, name: str) -> str:
        """A local path to write a part to before :meth:`put` hands it over."""
        return os.path.join(self.stage_dir, name)

    # ---- operations -------------------------------------------------------------------
    def put(self, staged: str, name: str) -> None:
        """Hand the finished local file ``staged`` over as ``name`` in the folder (the local
        file is gone afterwards). Atomic: a reader sees the whole file or none."""
        if self.local:
            os.replace(staged, self._abs(name))
            return
        pafs.copy_files(
            staged,
            self._abs(name),
            source_filesystem=pafs.LocalFileSystem(),
            destination_filesystem=self.fs,
        )
        os.remove(staged)

    def publish(self, pending: str, final: str) -> None:
        """Make pending part ``pending`` visible as ``final``; FileNotFoundError if ``pending``
        is not there (publishing again after a crash finds ``final`` instead)."""
        if self.local:
            os.replace(self._abs(pending), self._abs(final))
            return
        if not self.exists(pending):
            raise FileNotFoundError(self.display(pending))
        # rename on HDFS; a server-side copy, then delete, on object stores (see module doc)
        self.fs.move(self._abs(pending), self._abs(final))

    def exists(self, name: str) -> bool:
        if self.local:
            return os.path.isfile(self._abs(name))
        return self.fs.get_file_info(self._abs(name)).type == pafs.FileType.File

    def names(self) -> list[str]:
        """The names of the files directly in the folder."""
        if self.local:
            return os.listdir(self.root)
        infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        return [i.base_name for i in infos if i.type == pafs.FileType.File]

    def delete(self, name: str) -> None:
        """Delete ``name`` from the folder (gone already counts as done)."""
        if self.local:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._abs(name))
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self._abs(name))

    def close(self) -> None:
        """Drop the local staging folder of a remote store."""
        if not self.local:
            shutil.rmtree(self.stage_dir, ignore_errors=True)

    # ---- sub-folders (partitioned output) ---------------------------------------------
    def child(self, folder: str) -> PartStore:
        """The store of sub-folder ``folder`` (a relative path with ``/``): same filesystem,
        its own staging folder on a remote store. Create it with :meth:`ensure_folder`."""
        sub = copy.copy(self)
        sub.root = self._abs(folder.replace("/", os.sep) if self.local else folder)
        sub.uri = self.display(folder)
        sub.stage_dir = sub.root if self.local else tempfile.mkdtemp(prefix="raystream-parquet-")
        return sub

    def folders(self, depth: int) -> list[str]:
        """The relative paths (``a/b``) of the folders exactly ``depth`` levels below this one."""
        if self.local:
            found = []
            for here, dirs, _ in os.walk(self.root):
                rel = os.path.relpath(here, self.root)
                level = 0 if rel == "." else rel.count(os.sep) + 1
                if level == depth:
                    found.append(rel.replace(os.sep, "/"))
                    dirs.clear()
            return sorted(found)
        sel = pafs.FileSelector(self.root, allow_not_found=True, recursive=True)
        found = []
        for info in self.fs.get_file_info(sel):
            if info.type != pafs.FileType.Directory:
                continue
            rel = info.path[len(self.root) :].strip("/")
            if rel and rel.count("/") + 1 == depth:
                found.append(rel)
        return sorted(found)
