"""The snapshot index blob: the schema of the Samza design (seed 001), as frozen dataclasses.

An index names every file of a store's RocksDB checkpoint and the blobs holding its bytes, so
fetching the index is necessary and sufficient to rebuild the snapshot. Its JSON form uses
the seed's camelCase field names. Because a restore turns the names it holds into local
paths, every name and blob id is checked on construction and again when parsed: an index
that could make a restore write outside its target is refused before anything is written.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import google_crc32c

from statekeeper import layout
from statekeeper.errors import CorruptStateError
from statekeeper.snapshot import _rules as rules
from statekeeper.snapshot._metadata import SnapshotMetadata, check_metadata

__all__ = [
    "ROOT_DIR_NAME",
    "SCHEMA_VERSION",
    "DirIndex",
    "FileBlob",
    "FileIndex",
    "SnapshotIndex",
    "SnapshotMetadata",
    "check_metadata",
    "iter_dirs",
    "iter_files",
    "rebased",
    "referenced_blob_ids",
    "referenced_blob_keys",
]

SCHEMA_VERSION = 2
"""The schema version written when the metadata names its root and attempt (always, from
statekeeper's format 2); ``1`` (statekeeper 0.1: no ``rootId``, no ``attempt``) is still read."""
_ANONYMOUS_SCHEMA = 1
SHARED_SCHEMA_VERSION = 3
"""The schema of an index naming blobs of another store (``store`` on a chunk, written by a
rescale: see :mod:`statekeeper.repartition`); statekeeper before it refuses such an index as
written by a newer statekeeper instead of looking for the blobs in the wrong store."""
ROOT_DIR_NAME = ""
"""The name of the root :class:`DirIndex` of every snapshot (the seed's ``ROOT_DIR_NAME``)."""

_MAX_DEPTH = 64  # RocksDB directories are flat; this only bounds the parser's recursion
_T = TypeVar("_T")


def _require(problem: str | None) -> None:
    if problem is not None:
        raise ValueError(problem)


@dataclass(frozen=True, slots=True, kw_only=True)
class FileBlob:
    """One chunk of a file: the blob holding it and where it starts in the file.

    ``store`` is ``None`` for a blob of the index's own store, else the (operator, partition)
    whose ``files/`` hold it: a store made by a rescale reuses its parents' blobs in place.

    Raises:
        ValueError: ``blob_id`` is not a valid blob id, ``offset`` is not an int >= 0, or
            ``store`` is not a valid (operator, partition).
    """

    blob_id: str
    offset: int
    store: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        _require(rules.blob_id_problem(self.blob_id))
        _require(rules.int_problem(self.offset, "offset", 0))
        if self.store is not None:
            _require(rules.store_problem(self.store))

    def key(self, operator: str, partition: int) -> str:
        """The blob's key, for an index of store (``operator``, ``partition``)."""
        owner, part = self.store if self.store is not None else (operator, partition)
        return layout.file_blob_key(owner, part, self.blob_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class FileIndex:
    """A file of the snapshot: its name, its chunks and the metadata a restore checks.

    A chunk's size is the distance to the next chunk's offset (the last one runs to
    ``size_in_bytes``), so offsets start at 0 and strictly increase; an empty file has no
    chunks.

    Attributes:
        file_name: one safe path component (see :func:`name_problem`).
        blobs: the chunks in offset order.
        size_in_bytes: the file's length.
        mtime_ms: last modification, milliseconds since the epoch.
        ctime_ms: inode change time (POSIX ``st_ctime``), milliseconds since the epoch;
            informational, a restore cannot set it.
        crc: CRC32C of the whole file.
        attribs: permission bits (``0o644``); never setuid, setgid or sticky.

    Raises:
        ValueError: a field breaks one of the rules above.
    """

    file_name: str
    blobs: tuple[FileBlob, ...]
    size_in_bytes: int
    mtime_ms: int
    ctime_ms: int
    crc: int
    attribs: int

    def __post_init__(self) -> None:
        _require(rules.name_problem(self.file_name))
        _require(rules.int_problem(self.size_in_bytes, "sizeInBytes", 0))
        _require(rules.int_problem(self.mtime_ms, "mtime", 0, rules.MAX_TIME_MS))
        _require(rules.int_problem(self.ctime_ms, "ctime", 0, rules.MAX_TIME_MS))
        _require(rules.int_problem(self.crc, "crc", 0, rules.MAX_CRC))
        _require(rules.int_problem(self.attribs, "attribs", 0, rules.MAX_ATTRIBS))
        if not isinstance(self.blobs, tuple) or not all(
            isinstance(b, FileBlob) for b in self.blobs
        ):
            raise ValueError("expected blobs to be a tuple of FileBlob")
        _require(rules.offsets_problem([b.offset for b in self.blobs], self.size_in_bytes))

    def chunk_sizes(self) -> tuple[int, ...]:
        """Size of each chunk, in the order of :attr:`blobs`."""
        ends = [b.offset for b in self.blobs[1:]] + [self.size_in_bytes]
        return tuple(end - b.offset for b, end in zip(self.blobs, ends, strict=False))


@dataclass(frozen=True, slots=True, kw_only=True)
class DirIndex:
    """A directory of the snapshot; the root one is named ``""``.

    ``files_removed`` and ``sub_directories_removed`` record what the previous snapshot held
    here and this one no longer references (the seed keeps them for cleanup and GC); a
    restore ignores them.

    Raises:
        ValueError: ``dir_name`` is neither ``""`` nor a safe name, an entry is of the wrong
            type, or two present (or two removed) entries share a name.
    """

    dir_name: str
    files_present: tuple[FileIndex, ...] = ()
    files_removed: tuple[FileIndex, ...] = ()
    sub_directories_present: tuple[DirIndex, ...] = ()
    sub_directories_removed: tuple[DirIndex, ...] = ()

    def __post_init__(self) -> None:
        if self.dir_name != ROOT_DIR_NAME:
            _require(rules.name_problem(self.dir_name))
        for what, entries, kind in (
            ("files_present", self.files_present, FileIndex),
            ("files_removed", self.files_removed, FileIndex),
            ("sub_directories_present", self.sub_directories_present, DirIndex),
            ("sub_directories_removed", self.sub_directories_removed, DirIndex),
        ):
            if not isinstance(entries, tuple) or not all(isinstance(e, kind) for e in entries):
                raise ValueError(f"expected {what} to be a tuple of {kind.__name__}")
        for side, files, dirs in (
            ("present", self.files_present, self.sub_directories_present),
            ("removed", self.files_removed, self.sub_directories_removed),
        ):
            names = [f.file_name for f in files] + [d.dir_name for d in dirs]
            if "" in names[len(files) :]:
                raise ValueError(f"expected named subdirectories, found an empty name ({side})")
            if len(set(names)) != len(names):
                dupes = sorted({n for n in names if names.count(n) > 1})
                raise ValueError(f"expected unique {side} names, found duplicates {dupes!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotIndex:
    """The index blob of one snapshot.

    Attributes:
        checkpoint_id: unique id of the snapshot attempt (a uuid hex).
        created_time_ms: when it was taken, milliseconds since the epoch.
        metadata: the store and version.
        dir_index: the root directory (named ``""``).
        prev_snapshot_index_blob_id: key of the previous snapshot index of the same store,
            at a lower version, or ``None`` for a first snapshot.
        schema_version: :data:`SCHEMA_VERSION` when the metadata names its root and
            attempt, 1 when it does not; derived from the metadata when left at 0.

    Raises:
        ValueError: a field breaks one of the rules above.
    """

    checkpoint_id: str
    created_time_ms: int
    metadata: SnapshotMetadata
    dir_index: DirIndex
    prev_snapshot_index_blob_id: str | None
    schema_version: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.metadata, SnapshotMetadata):
            raise ValueError("expected metadata to be a SnapshotMetadata")
        derived = _ANONYMOUS_SCHEMA if self.metadata.root_id is None else SCHEMA_VERSION
        if derived == SCHEMA_VERSION and _shares(self.dir_index):
            derived = SHARED_SCHEMA_VERSION
        if self.schema_version == 0 and not isinstance(self.schema_version, bool):
            object.__setattr__(self, "schema_version", derived)
        if self.schema_version != derived or isinstance(self.schema_version, bool):
            raise ValueError(
                f"expected schemaVersion {derived} for this metadata, found {self.schema_version!r}"
            )
        if not isinstance(self.dir_index, DirIndex) or self.dir_index.dir_name != ROOT_DIR_NAME:
            raise ValueError(f"expected dirIndex to be a DirIndex named {ROOT_DIR_NAME!r}")
        _require(rules.checkpoint_id_problem(self.checkpoint_id))
        _require(rules.int_problem(self.created_time_ms, "createdTimeMs", 0, rules.MAX_TIME_MS))
        m = self.metadata
        _require(
            rules.prev_index_problem(
                self.prev_snapshot_index_blob_id, m.operator, m.partition, m.version
            )
        )

    def to_json(self) -> bytes:
        """The index blob's bytes: deterministic JSON (sorted keys, ASCII, compact)."""
        doc = {
            "schemaVersion": self.schema_version,
            "checkpointId": self.checkpoint_id,
            "createdTimeMs": self.created_time_ms,
            "metadata": _metadata_to_json(self.metadata),
            "dirIndex": _dir_to_json(self.dir_index),
            "prevSnapshotIndexBlobId": self.prev_snapshot_index_blob_id,
        }
        doc["crc32c"] = google_crc32c.value(_canonical(doc))
        return _canonical(doc)

    @classmethod
    def from_json(cls, data: bytes, *, blob: str) -> SnapshotIndex:
        """Parse and strictly validate an index blob.

        Args:
            data: the blob's bytes.
            blob: the blob's key, named in every error.

        Raises:
            CorruptStateError: the bytes are not valid JSON, a field is missing, unknown or
                of the wrong type, the schema version is unknown, chunk offsets do not
                cover the file, or a name or blob id is unsafe. The message names ``blob``
                and what was expected and found.
        """
        return _Parser(blob).index(data)


def _shares(d: DirIndex) -> bool:
    """Whether any chunk (of a present or a removed file) is held in another store."""
    files = d.files_present + d.files_removed
    return any(b.store is not None for f in files for b in f.blobs) or any(
        _shares(sub) for sub in d.sub_directories_present + d.sub_directories_removed
    )


def _canonical(doc: dict[str, Any]) -> bytes:
    # ensure_ascii keeps undecodable (surrogate-escaped) file names representable.
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _metadata_to_json(m: SnapshotMetadata) -> dict[str, Any]:
    doc: dict[str, Any] = {"operator": m.operator, "partition": m.partition, "version": m.version}
    if m.root_id is not None:
        doc.update(rootId=m.root_id, attempt=m.attempt)
    return doc


def _file_to_json(f: FileIndex) -> dict[str, Any]:
    return {
        "fileName": f.file_name,
        "blobs": [_blob_to_json(b) for b in f.blobs],
        "sizeInBytes": f.size_in_bytes,
        "mtime": f.mtime_ms,
        "ctime": f.ctime_ms,
        "crc": f.crc,
        "attribs": f.attribs,
    }


def _blob_to_json(b: FileBlob) -> dict[str, Any]:
    doc: dict[str, Any] = {"blobId": b.blob_id, "offset": b.offset}
    if b.store is not None:
        doc["store"] = {"operator": b.store[0], "partition": b.store[1]}
    return doc


def _dir_to_json(d: DirIndex) -> dict[str, Any]:
    return {
        "dirName": d.dir_name,
        "filesPresent": [_file_to_json(f) for f in d.files_present],
        "filesRemoved": [_file_to_json(f) for f in d.files_removed],
        "subDirectoriesPresent": [_dir_to_json(s) for s in d.sub_directories_present],
        "subDirectoriesRemoved": [_dir_to_json(s) for s in d.sub_directories_removed],
    }


def iter_files(dir_index: DirIndex) -> Iterator[tuple[str, FileIndex]]:
    """Every present file under ``dir_index``, depth first, with its ``/``-joined path.

    Paths are relative to ``dir_index`` itself (its own name is not part of them).
    """
    for f in dir_index.files_present:
        yield f.file_name, f
    for sub in dir_index.sub_directories_present:
        for path, f in iter_files(sub):
            yield f"{sub.dir_name}/{path}", f


def rebased(dir_index: DirIndex, store: tuple[str, int], own: tuple[str, int]) -> DirIndex:
    """``dir_index`` of store ``store`` as an index of store ``own`` would name it: every
    chunk of ``store``'s own says it is held in ``store`` (``None`` where that is ``own``)."""

    def chunk(b: FileBlob) -> FileBlob:
        held = b.store if b.store is not None else store
        return FileBlob(blob_id=b.blob_id, offset=b.offset, store=None if held == own else held)

    def file(f: FileIndex) -> FileIndex:
        return dataclasses.replace(f, blobs=tuple(chunk(b) for b in f.blobs))

    return dataclasses.replace(
        dir_index,
        files_present=tuple(file(f) for f in dir_index.files_present),
        files_removed=tuple(file(f) for f in dir_index.files_removed),
        sub_directories_present=tuple(
            rebased(d, store, own) for d in dir_index.sub_directories_present
        ),
        sub_directories_removed=tuple(
            rebased(d, store, own) for d in dir_index.sub_directories_removed
        ),
    )


def iter_dirs(dir_index: DirIndex) -> Iterator[tuple[str, DirIndex]]:
    """Every present directory under ``dir_index`` (itself first, as ``""``), depth first."""
    yield "", dir_index
    for sub in dir_index.sub_directories_present:
        for path, d in iter_dirs(sub):
            yield (f"{sub.dir_name}/{path}" if path else sub.dir_name), d


def referenced_blob_ids(index: SnapshotIndex) -> set[str]:
    """The blob ids of every present file held in the index's own store."""
    return {b.blob_id for _, f in iter_files(index.dir_index) for b in f.blobs if b.store is None}


def referenced_blob_keys(index: SnapshotIndex) -> set[str]:
    """The keys of the blobs of every present file, in whichever store holds them: what GC
    must keep while ``index`` is retained."""
    m = index.metadata
    return {b.key(m.operator, m.partition) for _, f in iter_files(index.dir_index) for b in f.blobs}


_INDEX_KEYS = frozenset(
    {
        "schemaVersion",
        "checkpointId",
        "createdTimeMs",
        "metadata",
        "dirIndex",
        "prevSnapshotIndexBlobId",
        "crc32c",
    }
)
_METADATA_KEYS = frozenset({"operator", "partition", "version"})
_IDENTITY_KEYS = frozenset({"rootId", "attempt"})
_DIR_KEYS = frozenset(
    {"dirName", "filesPresent", "filesRemoved", "subDirectoriesPresent", "subDirectoriesRemoved"}
)
_FILE_KEYS = frozenset({"fileName", "blobs", "sizeInBytes", "mtime", "ctime", "crc", "attribs"})
_BLOB_KEYS = frozenset({"blobId", "offset"})
_STORE_KEYS = frozenset({"operator", "partition"})


class _Parser:
    """Turns index JSON into dataclasses; every error names the blob and the JSON path."""

    def __init__(self, blob: str) -> None:
        self._blob = blob
        self._schema = SCHEMA_VERSION

    def fail(self, where: str, detail: str) -> NoReturn:
        raise CorruptStateError(f"snapshot index {self._blob!r} is invalid at {where}: {detail}")

    def _check_crc(self, obj: dict[str, Any]) -> None:
        """The index carries the CRC32C of its own canonical JSON without that field, so a
        changed digit anywhere (an mtime, a size) is caught like a flipped bit in a file."""
        found = self._field(obj, "crc32c", int, "$")
        expected = google_crc32c.value(_canonical({k: v for k, v in obj.items() if k != "crc32c"}))
        if found != expected:
            self.fail("$.crc32c", f"checksum mismatch: expected {expected}, found {found}")

    def index(self, data: bytes) -> SnapshotIndex:
        doc = self._load(data)
        # The schema version is checked before anything else: a newer writer may have
        # changed every other field.
        head = self._object(doc, "$", frozenset({"schemaVersion"}), check_extra=False)
        version = self._field(head, "schemaVersion", int, "$")
        known = (_ANONYMOUS_SCHEMA, SCHEMA_VERSION, SHARED_SCHEMA_VERSION)
        if version not in known:
            newer = "written by a newer statekeeper: " if version > known[-1] else ""
            self.fail(
                "$.schemaVersion",
                f"{newer}expected schemaVersion {_ANONYMOUS_SCHEMA}, {SCHEMA_VERSION} or "
                f"{SHARED_SCHEMA_VERSION}, found {version}",
            )
        self._schema = version
        obj = self._object(doc, "$", _INDEX_KEYS)
        metadata = self._metadata(obj["metadata"], version >= SCHEMA_VERSION)
        dir_index = self._dir(obj["dirIndex"], "$.dirIndex", 0)
        prev = obj["prevSnapshotIndexBlobId"]
        if prev is not None and not isinstance(prev, str):
            self.fail(
                "$.prevSnapshotIndexBlobId", f"expected a str or null, found {type(prev).__name__}"
            )
        index = self._build(
            "$",
            lambda: SnapshotIndex(
                checkpoint_id=self._field(obj, "checkpointId", str, "$"),
                created_time_ms=self._field(obj, "createdTimeMs", int, "$"),
                metadata=metadata,
                dir_index=dir_index,
                prev_snapshot_index_blob_id=prev,
                schema_version=version,
            ),
        )
        self._check_crc(obj)  # last, so a malformed document gets the precise complaint
        return index

    def _metadata(self, value: object, identified: bool) -> SnapshotMetadata:
        where = "$.metadata"
        meta = self._object(
            value, where, _METADATA_KEYS | (_IDENTITY_KEYS if identified else set())
        )
        return self._build(
            where,
            lambda: SnapshotMetadata(
                operator=self._field(meta, "operator", str, where),
                partition=self._field(meta, "partition", int, where),
                version=self._field(meta, "version", int, where),
                root_id=self._field(meta, "rootId", str, where) if identified else None,
                attempt=self._field(meta, "attempt", str, where) if identified else None,
            ),
        )

    def _load(self, data: bytes) -> object:
        def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            keys = [k for k, _ in pairs]
            if len(set(keys)) != len(keys):
                raise ValueError(f"duplicate keys {sorted({k for k in keys if keys.count(k) > 1})}")
            return dict(pairs)

        def no_constants(name: str) -> NoReturn:
            raise ValueError(f"{name} is not a JSON number")

        try:
            return json.loads(
                data.decode("utf-8"),
                object_pairs_hook=no_duplicates,
                parse_constant=no_constants,
            )
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            self.fail("$", f"expected a JSON document, found invalid JSON ({exc})")

    def _object(
        self, value: object, where: str, keys: frozenset[str], *, check_extra: bool = True
    ) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(where, f"expected an object, found {_json_type(value)}")
        missing = sorted(keys - value.keys())
        if missing:
            self.fail(where, f"expected fields {sorted(keys)}, missing {missing}")
        extra = sorted(value.keys() - keys)
        if check_extra and extra:
            self.fail(where, f"expected fields {sorted(keys)}, found unknown {extra}")
        return value

    def _field(self, obj: dict[str, Any], key: str, kind: type[_T], where: str) -> _T:
        value = obj[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            self.fail(f"{where}.{key}", f"expected {kind.__name__}, found {_json_type(value)}")
        return value

    def _list(self, obj: dict[str, Any], key: str, where: str) -> list[Any]:
        return self._field(obj, key, list, where)

    def _build(self, where: str, make: Callable[[], _T]) -> _T:
        try:
            return make()
        except (TypeError, ValueError) as exc:
            self.fail(where, str(exc))

    def _file_blob(self, value: object, where: str) -> FileBlob:
        # Only schema 3 may name another store's blob (an older reader would look in its own).
        shared = self._schema == SHARED_SCHEMA_VERSION and isinstance(value, dict)
        keys = _BLOB_KEYS | {"store"} if shared and "store" in value else _BLOB_KEYS  # type: ignore[operator]
        obj = self._object(value, where, keys)
        store = None
        if "store" in obj:
            s = self._object(obj["store"], f"{where}.store", _STORE_KEYS)
            store = (
                self._field(s, "operator", str, f"{where}.store"),
                self._field(s, "partition", int, f"{where}.store"),
            )
        return self._build(
            where,
            lambda: FileBlob(
                blob_id=self._field(obj, "blobId", str, where),
                offset=self._field(obj, "offset", int, where),
                store=store,
            ),
        )

    def _file(self, value: object, where: str) -> FileIndex:
        obj = self._object(value, where, _FILE_KEYS)
        blobs = tuple(
            self._file_blob(b, f"{where}.blobs[{i}]")
            for i, b in enumerate(self._list(obj, "blobs", where))
        )
        return self._build(
            where,
            lambda: FileIndex(
                file_name=self._field(obj, "fileName", str, where),
                blobs=blobs,
                size_in_bytes=self._field(obj, "sizeInBytes", int, where),
                mtime_ms=self._field(obj, "mtime", int, where),
                ctime_ms=self._field(obj, "ctime", int, where),
                crc=self._field(obj, "crc", int, where),
                attribs=self._field(obj, "attribs", int, where),
            ),
        )

    def _dir(self, value: object, where: str, depth: int) -> DirIndex:
        if depth > _MAX_DEPTH:
            self.fail(where, f"expected at most {_MAX_DEPTH} nested directories, found more")
        obj = self._object(value, where, _DIR_KEYS)

        def files(key: str) -> tuple[FileIndex, ...]:
            items = self._list(obj, key, where)
            return tuple(self._file(f, f"{where}.{key}[{i}]") for i, f in enumerate(items))

        def dirs(key: str) -> tuple[DirIndex, ...]:
            items = self._list(obj, key, where)
            return tuple(
                self._dir(d, f"{where}.{key}[{i}]", depth + 1) for i, d in enumerate(items)
            )

        return self._build(
            where,
            lambda: DirIndex(
                dir_name=self._field(obj, "dirName", str, where),
                files_present=files("filesPresent"),
                files_removed=files("filesRemoved"),
                sub_directories_present=dirs("subDirectoriesPresent"),
                sub_directories_removed=dirs("subDirectoriesRemoved"),
            ),
        )


def _json_type(value: object) -> str:
    names = {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        int: "integer",
        float: "number",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)
