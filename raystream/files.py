"""File sources: Parquet, CSV and JSON lines through ``pyarrow.dataset`` and ``pyarrow.fs``.

A path is a file, a folder (searched recursively; names starting with ``.`` or ``_`` are
skipped, as Spark and Hive leave such files), a glob (``*`` and ``?`` within one path segment,
``**`` across segments) or an object-store URI (``s3://``, ``gs://``, ``hdfs://``, anything
:func:`pyarrow.fs.FileSystem.from_uri` takes), or any of these on a given
:class:`pyarrow.fs.FileSystem`. Folders named ``column=value`` (hive partitions) add ``column``
to every row below them.

The files are listed once, when the spec is built, and sorted by path; the spec carries the
listing, so every instance and every recovery reads the same files. The listing is cut into
units: a row group of a Parquet file, a whole CSV or JSON file. Instance ``i`` of ``P`` reads
units ``i, i + P, ...``, so each unit goes to exactly one instance, and within a unit rows keep
their file order. A reader's position is (unit, row): :meth:`FileReader.skip` goes past whole
Parquet row groups from their metadata without reading them, and checkpoints record the listing's
digest, so a recovery against a changed listing fails clearly instead of replaying wrong rows.

Example::

    >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq, os
    >>> d = tempfile.mkdtemp()
    >>> os.makedirs(f"{d}/day=1")
    >>> pq.write_table(pa.table({"v": [1, 2]}), f"{d}/day=1/a.parquet")
    >>> src = FileSource.build(d, "parquet")
    >>> src.schema().names, src.open(0, 1).read(10).to_pydict()
    (['v', 'day'], {'v': [1, 2], 'day': [1, 1]})
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.fs as pafs

from raystream.errors import ConfigError, SchemaError, SourceError

if TYPE_CHECKING:  # imported where used: pyarrow.dataset imports pandas (~0.3 s per process)
    import pyarrow.dataset as ds

__all__ = ["FORMATS", "FileReader", "FileSource", "Listing", "list_files", "schema_diff"]

# format -> file name endings a folder listing picks up (a glob picks what it matches)
FORMATS: dict[str, tuple[str, ...]] = {
    "parquet": (".parquet",),
    "csv": (".csv", ".csv.gz", ".csv.bz2", ".tsv"),
    "json": (".json", ".jsonl", ".ndjson", ".json.gz", ".jsonl.gz", ".ndjson.gz"),
}
_KIND = {"parquet": "Parquet", "csv": "CSV", "json": "JSON-lines"}
_GLOB_CHARS = re.compile(r"[*?\[]")
_HIDDEN = (".", "_")


# --------------------------------------------------------------------------------------------
# listing


@dataclass(frozen=True)
class Listing:
    """The files of a path: ``filesystem``, ``files`` (sorted paths on it) and ``base`` (the
    folder hive partitions are parsed below)."""

    filesystem: pafs.FileSystem
    files: tuple[str, ...]
    base: str


def _resolve(path: str, filesystem: pafs.FileSystem | None) -> tuple[pafs.FileSystem, str]:
    if filesystem is not None:
        return filesystem, path
    if "://" not in path:
        return pafs.LocalFileSystem(), os.path.abspath(path)
    try:
        return pafs.FileSystem.from_uri(path)
    except (pa.ArrowException, OSError, ValueError) as exc:
        msg = (
            f"cannot open the filesystem of {path!r} ({exc}); expected a local path or a URI "
            "pyarrow.fs understands (s3://bucket/prefix, gs://..., hdfs://host/path). Install "
            "the filesystem's support or pass filesystem=pyarrow.fs.<FileSystem>(...)."
        )
        raise SourceError(msg) from exc


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """``**`` any number of segments, ``*`` and ``?`` within one segment, ``[...]`` a class."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1 : end].replace("\\", "\\\\")
                out.append("[^" + body[1:] + "]" if body.startswith("!") else "[" + body + "]")
                i = end
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


def _partition_root(base: str) -> str:
    """``base`` without its trailing ``column=value`` folders: those are partitions too."""
    parts = base.split("/")
    while len(parts) > 1 and "=" in parts[-1]:
        parts.pop()
    return "/".join(parts)


def _hidden(rel: str) -> bool:
    return any(part.startswith(_HIDDEN) for part in rel.split("/") if part)


def _select(fs: pafs.FileSystem, base: str, where: str) -> list[pafs.FileInfo]:
    try:
        return fs.get_file_info(pafs.FileSelector(base, recursive=True))
    except (pa.ArrowException, OSError) as exc:
        msg = f"cannot list {where!r} ({exc}); expected a readable folder."
        raise SourceError(msg) from exc


def list_files(path: str, fmt: str, filesystem: pafs.FileSystem | None = None) -> Listing:
    """The files ``path`` names, sorted (see the module doc); :class:`SourceError` if none."""
    fs, target = _resolve(path, filesystem)
    kind = _KIND[fmt]
    ends = FORMATS[fmt]
    glob = _GLOB_CHARS.search(target)
    if glob is not None:
        base = target[: glob.start()].rsplit("/", 1)[0] if "/" in target[: glob.start()] else ""
        pattern = _glob_regex(target)
        infos = _select(fs, base, path) if base == "" or _is_dir(fs, base) else []
        files = sorted(
            i.path
            for i in infos
            if i.type == pafs.FileType.File
            and pattern.match(i.path)
            and not _hidden(i.path[len(base) :])
        )
        if not files:
            msg = (
                f"no file matches {path!r} (searched below {base or '/'!r}); expected at least "
                f"one {kind} file. Check the pattern: '*' stays within one folder, '**' crosses "
                "folders."
            )
            raise SourceError(msg)
        return Listing(fs, tuple(files), _partition_root(base))
    try:
        info = fs.get_file_info(target)
    except (pa.ArrowException, OSError) as exc:
        msg = f"cannot look up {path!r} ({exc}); expected a {kind} file or a folder of them."
        raise SourceError(msg) from exc
    if info.type == pafs.FileType.File:
        folder = target.rsplit("/", 1)[0] if "/" in target else ""
        return Listing(fs, (target,), _partition_root(folder))
    if info.type != pafs.FileType.Directory:
        where = f", here {os.getcwd()!r}" if "://" not in path and filesystem is None else ""
        msg = (
            f"no such file or directory: {path!r}; expected a {kind} file or a directory of "
            f"{kind} files. Check the path (relative paths resolve against the worker's "
            f"working directory{where})."
        )
        raise SourceError(msg)
    files = sorted(
        i.path
        for i in _select(fs, target, path)
        if i.type == pafs.FileType.File
        and i.path.lower().endswith(ends)
        and not _hidden(i.path[len(target) :])
    )
    if not files:
        shown = ", ".join(f"*{e}" for e in ends)
        msg = (
            f"directory {path!r} holds no {shown} files (sub-directories searched, names "
            f"starting with '.' or '_' skipped); expected a {kind} file or a folder of them. "
            "Use a glob (e.g. 'folder/**/*.dat') for other file names."
        )
        raise SourceError(msg)
    return Listing(fs, tuple(files), _partition_root(target))


def _is_dir(fs: pafs.FileSystem, path: str) -> bool:
    try:
        return bool(fs.get_file_info(path).type == pafs.FileType.Directory)
    except (pa.ArrowException, OSError):
        return False


def schema_diff(a: pa.Schema, b: pa.Schema) -> str:
    """What differs between two schemas, in words."""
    fa = {f.name: f.type for f in a}
    fb = {f.name: f.type for f in b}
    parts = []
    if only_a := [n for n in fa if n not in fb]:
        parts.append(f"only in the first: {only_a}")
    if only_b := [n for n in fb if n not in fa]:
        parts.append(f"only in the second: {only_b}")
    if changed := [f"{n}: {fa[n]} vs {fb[n]}" for n in fa if n in fb and fa[n] != fb[n]]:
        parts.append(f"different types: {changed}")
    if not parts:
        parts.append(f"column order {a.names} vs {b.names}")
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------
# the source


def _format(fmt: str, schema: pa.Schema | None, delimiter: str) -> ds.FileFormat:
    import pyarrow.dataset as ds

    if fmt == "parquet":
        return ds.ParquetFileFormat()
    if fmt == "csv":
        import pyarrow.csv as pcsv

        convert = pcsv.ConvertOptions(column_types=schema) if schema is not None else None
        return ds.CsvFileFormat(
            parse_options=pcsv.ParseOptions(delimiter=delimiter), convert_options=convert
        )
    import pyarrow.json as pjson

    parse = pjson.ParseOptions(explicit_schema=schema) if schema is not None else None
    return ds.JsonFileFormat(parse_options=parse) if parse is not None else ds.JsonFileFormat()


def _partitioning(partitioning: object) -> Any:
    import pyarrow.dataset as ds

    if partitioning is None or isinstance(partitioning, (ds.Partitioning, ds.PartitioningFactory)):
        return partitioning
    if partitioning == "hive":
        return ds.HivePartitioning.discover(infer_dictionary=False)
    msg = (
        f"partitioning must be 'hive', None or a pyarrow.dataset partitioning, got {partitioning!r}"
    )
    raise ConfigError(msg)


@dataclass(frozen=True)
class FileSource:
    """Files of one format as a source; build it with :meth:`build` (or ``rs.sources.parquet``,
    ``csv``, ``json``). See the module doc for paths, partitions and how instances split it.

    ``units``: ``(file index, row group, rows)`` for Parquet (row group -1 and rows -1 for a
    whole CSV or JSON file); ``partitions``: per file, the hive partition expression."""

    path: str
    format: str
    batch_rows: int
    rate_eps: float
    columns: tuple[str, ...] | None
    filesystem: pafs.FileSystem = field(repr=False)
    files: tuple[str, ...] = field(repr=False)
    units: tuple[tuple[int, int, int], ...] = field(repr=False)
    partitions: tuple[Any, ...] = field(repr=False)
    full_schema: pa.Schema = field(repr=False)
    file_schema: pa.Schema | None = field(repr=False)  # the declared schema of CSV / JSON files
    delimiter: str = ","
    digest: str = field(default="", repr=False)  # of the listing; set by build()

    @classmethod
    def build(
        cls,
        path: str | os.PathLike[str],
        fmt: str,
        *,
        batch_rows: int = 65536,
        rate_eps: float = 0.0,
        columns: Sequence[str] | None = None,
        partitioning: object = "hive",
        filesystem: pafs.FileSystem | None = None,
        schema: pa.Schema | None = None,
        delimiter: str = ",",
    ) -> FileSource:
        if fmt not in FORMATS:
            msg = f"file format must be one of {sorted(FORMATS)}, got {fmt!r}"
            raise ConfigError(msg)
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            msg = f"{fmt} source path must be a path, glob or URI (str), got {path!r}"
            raise ConfigError(msg)
        if schema is not None and (fmt == "parquet" or not isinstance(schema, pa.Schema)):
            msg = (
                f"schema= declares the columns of CSV / JSON files (a pyarrow.Schema); got "
                f"{schema!r} for a {fmt} source (Parquet files carry their own)"
            )
            raise ConfigError(msg)
        path = os.fspath(path)
        listing = list_files(path, fmt, filesystem)
        fs, files = listing.filesystem, listing.files
        file_format = _format(fmt, schema, delimiter)
        file_schema, units = _inspect(fs, files, fmt, file_format, schema)
        factory = _partitioning(partitioning)
        parts, full = _partitions(fs, files, listing.base, file_format, factory, file_schema)
        if columns is not None:
            cols = tuple(columns)
            missing = [c for c in cols if c not in full.names]
            if isinstance(columns, str) or not cols or missing or len(set(cols)) < len(cols):
                msg = (
                    f"{fmt} source {path!r}: columns must be distinct column names of the "
                    f"files ({full.names}), got {columns!r}"
                )
                raise SchemaError(msg)
            columns = cols
        return cls(
            path=path,
            format=fmt,
            batch_rows=batch_rows,
            rate_eps=rate_eps,
            columns=None if columns is None else tuple(columns),
            filesystem=fs,
            files=files,
            units=units,
            partitions=parts,
            full_schema=full,
            file_schema=schema,
            delimiter=delimiter,
            digest=_digest(files, units),
        )

    # -- the Source protocol ----------------------------------------------------------------

    def schema(self) -> pa.Schema:
        if self.columns is None:
            return self.full_schema
        full = self.full_schema
        return pa.schema([full.field(c) for c in self.columns], metadata=full.metadata)

    def open(self, index: int, parallelism: int) -> FileReader:
        return FileReader(self, index, parallelism)

    def warm_up(self) -> None:
        """Import the reader of the format (``pyarrow.dataset`` and its format module: tens of
        ms a process pays once), so a source instance pays it while the job deploys, not in
        its first read."""
        _format(self.format, self.file_schema, self.delimiter)

    def describe(self) -> str:
        what = "row group(s)" if self.format == "parquet" else "file(s)"
        return (
            f"{self.format}({self.path!r}: {len(self.files)} file(s), {len(self.units)} {what}, "
            f"rate_eps={self.rate_eps})"
        )

    # -- reading ----------------------------------------------------------------------------

    def unit_batches(self, unit: int) -> Iterator[pa.RecordBatch]:
        """The rows of ``units[unit]``, in file order (partition columns filled in)."""
        file_index, row_group, _ = self.units[unit]
        file = self.files[file_index]
        fmt = _format(self.format, self.file_schema, self.delimiter)
        kwargs: dict[str, Any] = {"partition_expression": self.partitions[file_index]}
        if row_group >= 0:
            kwargs["row_groups"] = [row_group]
        cols = list(self.columns) if self.columns is not None else self.full_schema.names
        try:
            fragment = fmt.make_fragment(file, self.filesystem, **kwargs)
            batches = fragment.to_batches(
                schema=self.full_schema, columns=cols, batch_size=self.batch_rows
            )
            for batch in batches:
                if batch.num_rows:
                    yield batch
        except (pa.ArrowException, OSError) as exc:
            msg = (
                f"cannot read {file!r} as {self.format} ({exc}); expected a readable file of "
                f"the schema {self.full_schema.names} found when the source was built. Fix or "
                "move the file."
            )
            raise SourceError(msg) from exc


def _digest(files: Sequence[str], units: Sequence[tuple[int, int, int]]) -> str:
    """A fingerprint of a listing (files and units): the same input, the same digest."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.encode() + b"\0")
    h.update(repr(tuple(units)).encode())
    return h.hexdigest()[:16]


def _inspect(
    fs: pafs.FileSystem,
    files: Sequence[str],
    fmt: str,
    file_format: ds.FileFormat,
    declared: pa.Schema | None,
) -> tuple[pa.Schema, tuple[tuple[int, int, int], ...]]:
    """One schema for all files (checked) and the units to read."""
    schema: pa.Schema | None = declared
    first = files[0]
    units: list[tuple[int, int, int]] = []
    for i, file in enumerate(files):
        try:
            if fmt == "parquet":
                fragment = file_format.make_fragment(file, fs)
                got = fragment.physical_schema
                units.extend((i, rg.id, rg.num_rows) for rg in fragment.row_groups)
            else:
                got = file_format.inspect(file, fs)
                units.append((i, -1, -1))
        except (pa.ArrowException, OSError) as exc:
            kind = _KIND[fmt]
            msg = f"cannot read {file!r} as {kind} ({exc}); expected a readable {kind} file."
            raise SourceError(msg) from exc
        if schema is None:
            schema = got
        elif declared is not None:
            if sorted(got.names) != sorted(declared.names):
                msg = (
                    f"{fmt} file {file!r} has columns {got.names}, expected {declared.names} "
                    "(the schema= given). Fix the file or the schema."
                )
                raise SchemaError(msg)
        elif not schema.equals(got, check_metadata=False):
            kind = _KIND[fmt]
            hint = "" if fmt == "parquet" else " or declare the types with schema="
            msg = (
                f"{kind} files {first!r} and {file!r} have different schemas "
                f"({schema_diff(schema, got)}); expected every file of a source to have the "
                f"same columns and types. Rewrite or move the odd file{hint}."
            )
            raise SchemaError(msg)
    assert schema is not None
    return schema, tuple(units)


def _partitions(
    fs: pafs.FileSystem,
    files: Sequence[str],
    base: str,
    file_format: ds.FileFormat,
    factory: Any,
    file_schema: pa.Schema,
) -> tuple[tuple[Any, ...], pa.Schema]:
    """Per file its partition expression, and the source's schema (file columns + partition
    columns)."""
    import pyarrow.dataset as ds

    if factory is None:
        return tuple(ds.scalar(True) for _ in files), file_schema
    try:
        dataset = ds.dataset(
            list(files),
            filesystem=fs,
            format=file_format,
            partitioning=factory,
            partition_base_dir=base,
            schema=None,
        )
    except (pa.ArrowException, OSError) as exc:
        msg = f"cannot read the partitions of {base!r} ({exc}); pass partitioning=None to ignore"
        raise SourceError(msg) from exc
    by_path = {f.path: f.partition_expression for f in dataset.get_fragments()}
    names = set(file_schema.names)
    extra = [f for f in dataset.schema if f.name not in names]
    clash = [
        f.name
        for f in dataset.schema
        if f.name in names and f.type != file_schema.field(f.name).type
    ]
    if clash:
        msg = (
            f"partition folders of {base!r} name columns {clash} that the files hold with "
            "another type; rename the folders or pass partitioning=None"
        )
        raise SchemaError(msg)
    full = pa.schema(list(file_schema) + extra, metadata=file_schema.metadata)
    return tuple(by_path[f] for f in files), full


# --------------------------------------------------------------------------------------------
# the reader


class FileReader:
    """Reads the units ``index, index + parallelism, ...`` of a :class:`FileSource`."""

    def __init__(self, source: FileSource, index: int, parallelism: int) -> None:
        from raystream.sources import _check_partition

        _check_partition(index, parallelism)
        self.source = source
        self._units = list(range(index, len(source.units), parallelism))
        self._at = 0  # position in self._units
        self._row = 0  # rows of the current unit already returned
        self._batches: Iterator[pa.RecordBatch] | None = None
        self._pending: pa.RecordBatch | None = None

    # position -------------------------------------------------------------------------------

    def position(self) -> dict[str, Any]:
        """Where the next row comes from: the unit (its index in the source's listing, or -1 at
        the end), its file, the row within the unit, and the listing's digest."""
        unit = self._units[self._at] if self._at < len(self._units) else -1
        file = self.source.files[self.source.units[unit][0]] if unit >= 0 else None
        return {"unit": unit, "file": file, "row": self._row, "listing": self.source.digest}

    def check_position(self, position: dict[str, Any]) -> None:
        """A checkpoint's position belongs to this listing (else the input changed)."""
        got = position.get("listing")
        if got is not None and got != self.source.digest:
            msg = (
                f"{self.source.describe()} lists other files than when the checkpoint was taken "
                f"(listing digest {got} then, {self.source.digest} now); a file source resumes "
                "at a position in its listing. Restore with the same input files, or start the "
                "job without the checkpoint."
            )
            raise SourceError(msg)

    def skip(self, rows: int) -> int:
        """Go past ``rows`` rows: whole Parquet row groups by their metadata (not read), the rest
        by reading. Returns the rows skipped (fewer at the end of the input)."""
        skipped = 0
        while skipped < rows and self._at < len(self._units):
            known = self.source.units[self._units[self._at]][2]
            fresh = self._row == 0 and self._batches is None and self._pending is None
            if fresh and 0 <= known <= rows - skipped:
                skipped += known
                self._at += 1
                continue
            batch = self.read(min(rows - skipped, 1 << 20))
            if batch is None:
                break
            skipped += batch.num_rows
        return skipped

    # reading --------------------------------------------------------------------------------

    def _next_batch(self) -> pa.RecordBatch | None:
        while self._at < len(self._units):
            if self._batches is None:
                self._batches = self.source.unit_batches(self._units[self._at])
            batch = next(self._batches, None)
            if batch is not None:
                return batch
            self._batches = None
            self._at += 1
            self._row = 0
        return None

    def read(self, max_rows: int) -> pa.RecordBatch | None:
        from raystream.sources import _check_max_rows

        _check_max_rows(max_rows)
        parts: list[pa.RecordBatch] = []
        need = max_rows
        while need > 0:
            if self._pending is None:
                self._pending = self._next_batch()
                if self._pending is None:
                    break
            take = min(need, self._pending.num_rows)
            parts.append(self._pending.slice(0, take))
            self._row += take
            need -= take
            rest = self._pending.num_rows - take
            self._pending = self._pending.slice(take) if rest else None
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else pa.concat_batches(parts)

    def close(self) -> None:
        self._batches = None
        self._pending = None
        self._at = len(self._units)
