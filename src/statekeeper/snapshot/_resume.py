"""Resuming a snapshot upload that was cut off: the upload journal of a working copy.

A snapshot upload can be cut off half way: Spark kills a Python worker that has been idle
for a minute without running its exit handlers, and an upload of gigabytes (after a large
compaction) then never finishes, every retry starting over. So an upload notes every file
it finished uploading in a journal beside the working copy: a JSON line with the file's
relative path, identity (size, inode, mtime) and CRC32C, and the chunk blobs holding it.
A later upload of the same copy takes an added file's blobs from the journal instead of
uploading it again when the file is the same (relative path, size, inode and mtime, and a
CRC32C computed now) and, just before the index is written, every blob is still there,
of the size the journal says, and young enough (:func:`check_resumed`).

Nothing names those blobs, so GC counts their age: it deletes them once older than
``orphan_ttl_s``. A blob is named again only while at least ``MIN_ORPHAN_TTL_S`` of that
grace is left by the latest clock any GC can read (:func:`statekeeper.clock.latest_now`):
the time a fresh blob gets between its upload and its naming. The journal is emptied before
an index is written, so no journal line ever names a blob an index may name (GC deletes the
files of an expired snapshot at once, whatever their age).

One upload at a time owns a copy's journal in a process (:meth:`UploadJournal.take`); the
working copy's lock keeps other processes out. The journal is local and needs no fsync:
lost, it costs a re-upload; a torn last line is skipped.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from statekeeper.snapshot._files import crc32c_of_file, is_immutable
from statekeeper.snapshot._index import FileBlob, FileIndex
from statekeeper.storage import BlobMeta

__all__ = ["ResumePolicy", "UploadJournal", "check_resumed"]

_log = logging.getLogger("statekeeper.snapshot")
_owned: set[str] = set()
_owned_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class ResumePolicy:
    """Where a copy's upload journal is, how old a blob it names may be to be named again,
    and the clock that age is measured with: the latest "now" any GC of the blob store can
    take (:func:`statekeeper.clock.latest_now`). Resuming is off when ``max_age_s`` is not
    positive."""

    journal: Path
    max_age_s: float
    now: Callable[[], float]


@dataclass(frozen=True, slots=True)
class _Entry:
    rel: str
    size: int
    ino: int
    mtime_ns: int
    crc: int
    blobs: tuple[FileBlob, ...]


class UploadJournal:
    """The files one upload of a working copy finished, appended as they finish."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: dict[str, _Entry] = {}

    @classmethod
    @contextlib.contextmanager
    def take(cls, path: Path) -> Iterator[UploadJournal | None]:
        """The journal at ``path`` for one upload, or ``None`` while another upload of this
        process has it."""
        key = os.path.abspath(path)
        with _owned_lock:
            if key in _owned:
                yield None
                return
            _owned.add(key)
        try:
            yield cls(path)
        finally:
            with _owned_lock:
                _owned.discard(key)

    def load(self) -> int:
        """Read the journal for :meth:`match`; returns how many files it names."""
        self._entries = self._read()
        return len(self._entries)

    def _read(self) -> dict[str, _Entry]:
        """Every readable line, by relative path (the last line of a path wins)."""
        try:
            with open(self.path, encoding="utf-8") as fh:
                lines = fh.read().splitlines()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            _log.warning("upload journal %s unreadable, not resuming from it: %s", self.path, exc)
            return {}
        out: dict[str, _Entry] = {}
        for line in lines:
            entry = _parse(line)
            if entry is not None:
                out[entry.rel] = entry
        return out

    def record(self, rel: str, path: Path, done: FileIndex) -> None:
        """Note that every chunk of ``done`` (the file ``path``, at ``rel``) is uploaded."""
        if not is_immutable(done.file_name):
            return  # a file RocksDB may rewrite under its name is never taken again
        try:
            st = os.stat(path, follow_symlinks=False)
            line = json.dumps(
                {
                    "rel": rel,
                    "size": done.size_in_bytes,
                    "ino": st.st_ino,
                    "mtimeNs": st.st_mtime_ns,
                    "crc": done.crc,
                    "blobs": [[b.blob_id, b.offset] for b in done.blobs],
                },
                separators=(",", ":"),
            )
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, (line + "\n").encode())  # one write: lines never interleave
            finally:
                os.close(fd)
        except OSError as exc:  # a full disk, say: the upload goes on, only unresumable
            _log.warning("upload journal %s not written: %s", self.path, exc)

    def clear(self) -> None:
        """Forget every line (before an index naming their blobs is written)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def match(self, rel: str, path: Path) -> FileIndex | None:
        """The entry of ``path`` (at ``rel``) if the journal has the same file: same size,
        inode and mtime, and a CRC32C computed now equal to the journal's."""
        entry = self._entries.get(rel)
        if entry is None:
            return None
        try:
            st = os.stat(path, follow_symlinks=False)
            same = (st.st_size, st.st_ino, st.st_mtime_ns) == (
                entry.size, entry.ino, entry.mtime_ns,
            )  # fmt: skip
            if not same or crc32c_of_file(path) != entry.crc:
                return None
        except OSError:
            return None
        return FileIndex(
            file_name=path.name,
            blobs=entry.blobs,
            size_in_bytes=entry.size,
            mtime_ms=st.st_mtime_ns // 1_000_000,
            ctime_ms=st.st_ctime_ns // 1_000_000,
            crc=entry.crc,
            attribs=st.st_mode & 0o777,
        )


def check_resumed(
    resumed: dict[str, FileIndex],
    present: dict[str, BlobMeta],
    now: float,
    max_age_s: float,
) -> list[str]:
    """The relative paths of ``resumed`` files not to name after all: a chunk blob is missing
    from ``present`` (blob id -> listing), of another size than its place in the file says,
    or older than ``max_age_s`` at ``now``."""
    bad: list[str] = []
    for rel, f in resumed.items():
        ends = [b.offset for b in f.blobs[1:]] + [f.size_in_bytes]
        for blob, end in zip(f.blobs, ends, strict=True):
            meta = present.get(blob.blob_id)
            if (
                meta is None
                or meta.size != end - blob.offset
                or now - meta.last_modified > max_age_s
            ):
                bad.append(rel)
                break
    return bad


def _parse(line: str) -> _Entry | None:
    try:
        doc = json.loads(line)
        blobs = tuple(FileBlob(blob_id=str(b), offset=int(o)) for b, o in doc["blobs"])
        entry = _Entry(
            rel=str(doc["rel"]),
            size=int(doc["size"]),
            ino=int(doc["ino"]),
            mtime_ns=int(doc["mtimeNs"]),
            crc=int(doc["crc"]),
            blobs=blobs,
        )
    except (ValueError, KeyError, TypeError):  # a torn line (the process was killed mid-write)
        return None
    if (
        not blobs
        or blobs[0].offset != 0
        or any(a.offset >= b.offset for a, b in itertools.pairwise(blobs))
    ):
        return None
    return entry
