"""Restore a snapshot into a local directory, reusing the files that are already right.

The target is made to hold exactly the index's tree: identical files (same path, size and
CRC32C) are kept, everything else the index names is downloaded, verified and renamed into
place, and everything else in the target is removed. Nothing outside the target is ever
written: index paths are checked against the resolved target before anything is touched,
and symlinks found inside the target are removed, never followed (ARCHITECTURE §5.7).
"""

from __future__ import annotations

import logging
import os
import stat
import time
import uuid
from collections import deque
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, NoReturn

import google_crc32c

from statekeeper.errors import CorruptStateError, StateKeeperError, StateNotFoundError
from statekeeper.snapshot._files import crc32c_of_file, fsync_dir
from statekeeper.snapshot._index import DirIndex, FileIndex, SnapshotIndex, iter_dirs
from statekeeper.snapshot._rules import name_problem, offsets_problem
from statekeeper.snapshot._transfer import check_transfer_args
from statekeeper.storage import transfer_pool

if TYPE_CHECKING:
    from statekeeper.storage import BlobStore

__all__ = ["RestoreMetrics", "restore_snapshot"]

_log = logging.getLogger("statekeeper.snapshot")
_TEMP_PREFIX = ".sk-restore-"
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class RestoreMetrics:
    """What one restore did.

    Attributes:
        files_downloaded: files fetched from the blob store.
        bytes_downloaded: their total size.
        files_reused: files already identical in the target, kept.
        bytes_reused: their total size.
        files_deleted: files (and symlinks) removed from the target because the snapshot
            does not have them, including those inside removed directories and, with
            ``wipe``, everything the target held.
        duration_s: wall time of the whole restore.
    """

    files_downloaded: int
    bytes_downloaded: int
    files_reused: int
    bytes_reused: int
    files_deleted: int
    duration_s: float


@dataclass(slots=True)
class _Download:
    rel: str
    path: Path
    file: FileIndex
    keys: tuple[str, ...]


@dataclass(slots=True)
class _Plan:
    keys: dict[str, tuple[str, ...]]
    downloads: list[_Download] = field(default_factory=list)
    files_reused: int = 0
    bytes_reused: int = 0
    files_deleted: int = 0


def restore_snapshot(
    blobs: BlobStore,
    index: SnapshotIndex,
    target: Path,
    *,
    io_threads: int,
    index_blob: str,
    wipe: bool = False,
) -> RestoreMetrics:
    """Make directory ``target`` hold exactly the snapshot described by ``index``.

    Files of the target with the index's relative path, size and CRC32C are kept (their
    permission bits and mtime set from the index); the others are downloaded, chunks
    ``io_threads`` at a time, reassembled in offset order into a temporary file next to
    the final one, checked for size and CRC32C, fsynced and renamed into place. Files and
    directories the index does not name are removed; empty files and directories are
    recreated. On failure the target is left partly restored (never with an unverified
    file in place); restoring again finishes the job, reusing what is already right.

    Args:
        blobs: the checkpoint root's store.
        index: the snapshot to restore.
        target: the directory to fill; created if missing; its own path may hold symlinks.
        io_threads: parallel downloads.
        index_blob: key of the index, named in errors and logs.
        wipe: empty the target first instead of reusing what it holds.

    Returns:
        The restore's metrics.

    Raises:
        CorruptStateError: the index holds a path that would leave the target or an
            invalid blob id (refused before anything is written), or a chunk's length or a
            file's CRC32C does not match; the message names the blob(s) and the file.
        StateNotFoundError: a chunk blob is missing; the message names it and the file.
        StorageError: the blob store failed a read.
        NotADirectoryError: ``target`` exists and is not a directory.
        ValueError: ``io_threads`` is not an int >= 1.
        StateKeeperError: a directory of the target was swapped for a link mid-restore.
        OSError: the target cannot be written.
    """
    started = time.monotonic()
    check_transfer_args(io_threads=io_threads)
    root = Path(target).resolve()
    plan = _Plan(keys=_checked_keys(index, root, index_blob))
    plan.files_deleted += _prepare_root(root, wipe)
    _sync_dir(root, root, index.dir_index, "", plan)
    _download_all(blobs, plan.downloads, io_threads, index_blob)
    for rel, _ in iter_dirs(index.dir_index):
        fsync_dir(root / rel)
    metrics = RestoreMetrics(
        files_downloaded=len(plan.downloads),
        bytes_downloaded=sum(d.file.size_in_bytes for d in plan.downloads),
        files_reused=plan.files_reused,
        bytes_reused=plan.bytes_reused,
        files_deleted=plan.files_deleted,
        duration_s=time.monotonic() - started,
    )
    _log.info(
        "restore %s into %s: downloaded %d files (%d bytes), reused %d files (%d bytes), "
        "deleted %d files, in %.3f s",
        index_blob, root, metrics.files_downloaded, metrics.bytes_downloaded,
        metrics.files_reused, metrics.bytes_reused, metrics.files_deleted, metrics.duration_s,
    )  # fmt: skip
    return metrics


def _checked_keys(index: SnapshotIndex, root: Path, index_blob: str) -> dict[str, tuple[str, ...]]:
    """Check every index path against ``root`` and return each file's chunk blob keys.

    The dataclasses already refuse unsafe names; this checks again, component by component,
    on the paths a restore will actually write, so that no way of building an index (or
    mutating one) can slip one through.

    Raises:
        CorruptStateError: a path would not be a proper descendant of ``root``, names
            repeat in a directory, offsets do not tile a file, or a blob id is invalid.
    """
    if not isinstance(index, SnapshotIndex):
        raise TypeError(f"index must be a SnapshotIndex, got {type(index).__name__}")
    check = _IndexCheck(root, index, index_blob)
    check.dir(index.dir_index, ())
    return check.keys


class _IndexCheck:
    def __init__(self, root: Path, index: SnapshotIndex, index_blob: str) -> None:
        self.root = root
        self.meta = index.metadata
        self.index_blob = index_blob
        self.keys: dict[str, tuple[str, ...]] = {}

    def refuse(self, detail: str) -> NoReturn:
        raise CorruptStateError(
            f"snapshot index {self.index_blob!r}: refusing to restore into "
            f"{str(self.root)!r}: {detail}"
        )

    def dir(self, d: DirIndex, parts: tuple[str, ...]) -> None:
        names = [f.file_name for f in d.files_present]
        names += [s.dir_name for s in d.sub_directories_present]
        if len(set(names)) != len(names):
            self.refuse(f"expected unique names in directory {'/'.join(parts)!r}, found duplicates")
        for f in d.files_present:
            rel = "/".join(self.path(parts, f.file_name))
            problem = offsets_problem([b.offset for b in f.blobs], f.size_in_bytes)
            if problem is not None:
                self.refuse(f"file {rel!r}: {problem}")
            try:
                self.keys[rel] = tuple(
                    b.key(self.meta.operator, self.meta.partition) for b in f.blobs
                )
            except (TypeError, ValueError) as exc:
                self.refuse(f"file {rel!r}: {exc}")
        for sub in d.sub_directories_present:
            self.dir(sub, self.path(parts, sub.dir_name))

    def path(self, parts: tuple[str, ...], name: str) -> tuple[str, ...]:
        """``parts + (name,)`` if that is a proper descendant of the root, else refuse."""
        full = (*parts, name)
        problem = name_problem(name)
        if problem is not None:
            self.refuse(f"path {full!r}: {problem}")
        joined = Path(os.path.normpath(os.path.join(self.root, *full)))
        if not joined.is_relative_to(self.root) or joined.relative_to(self.root).parts != full:
            self.refuse(f"path {full!r} resolves to {str(joined)!r}, outside the target")
        return full


def _prepare_root(root: Path, wipe: bool) -> int:
    """Create ``root`` if missing; with ``wipe``, empty it. Returns the files removed."""
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"restore target {str(root)!r} exists and is not a directory")
    root.mkdir(parents=True, exist_ok=True)
    if not wipe:
        return 0
    with os.scandir(root) as entries:
        return sum(_remove(Path(e.path), e.is_dir(follow_symlinks=False)) for e in entries)


def _remove(path: Path, is_dir: bool) -> int:
    """Remove a file, symlink or directory tree without following links; count non-dirs."""
    if not is_dir:
        path.unlink()
        return 1
    with os.scandir(path) as entries:
        removed = sum(_remove(Path(e.path), e.is_dir(follow_symlinks=False)) for e in entries)
    path.rmdir()
    return removed


def _sync_dir(root: Path, path: Path, dir_index: DirIndex, rel: str, plan: _Plan) -> None:
    """Remove what ``path`` should not hold, keep identical files, plan the downloads."""
    # Symlinks never match: a link where a file or directory belongs is removed, not used.
    files = {f.file_name: f for f in dir_index.files_present}
    dirs = {d.dir_name: d for d in dir_index.sub_directories_present}
    with os.scandir(path) as scan:
        entries = list(scan)
    for entry in entries:
        is_dir = entry.is_dir(follow_symlinks=False)
        wanted = dirs if is_dir else files if entry.is_file(follow_symlinks=False) else {}
        if entry.name not in wanted:
            plan.files_deleted += _remove(Path(entry.path), is_dir)
    for name, f in sorted(files.items()):
        file_rel = f"{rel}{name}"
        if _keep_if_identical(path / name, f):
            plan.files_reused += 1
            plan.bytes_reused += f.size_in_bytes
        else:
            plan.downloads.append(_Download(file_rel, path / name, f, plan.keys[file_rel]))
    for name, d in sorted(dirs.items()):
        sub = path / name
        if not sub.is_dir():
            sub.mkdir()
        # Defense in depth: the directory we are about to fill must really be where the
        # checked path says, not reached through a link created since the scan.
        if sub.resolve() != root / f"{rel}{name}":
            raise StateKeeperError(
                f"restore target changed during restore: {str(sub)!r} resolves elsewhere"
            )
        _sync_dir(root, sub, d, f"{rel}{name}/", plan)


def _keep_if_identical(path: Path, f: FileIndex) -> bool:
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size != f.size_in_bytes:
            return False
        if crc32c_of_file(path) != f.crc:
            return False
    except FileNotFoundError:
        return False
    except PermissionError:
        return False  # unreadable (attribs 0o000, not root): download and replace it
    mtime_ns = f.mtime_ms * 1_000_000
    if stat.S_IMODE(st.st_mode) != f.attribs:
        os.chmod(path, f.attribs)
    if st.st_mtime_ns != mtime_ns:
        os.utime(path, ns=(st.st_atime_ns, mtime_ns), follow_symlinks=False)
    return True


def _download_all(
    blobs: BlobStore, downloads: list[_Download], io_threads: int, index_blob: str
) -> None:
    keys = [key for d in downloads for key in d.keys]
    with transfer_pool(io_threads, "statekeeper-restore") as pool:
        fetcher = _Prefetch(pool, blobs, keys, io_threads)
        try:
            for d in downloads:
                _download_file(fetcher, d, index_blob)
        finally:
            fetcher.cancel()


class _Prefetch:
    """Fetches blobs in order, at most ``limit`` ahead of the consumer (bounded memory)."""

    def __init__(self, pool: Executor, blobs: BlobStore, keys: list[str], limit: int):
        self._pool = pool
        self._blobs = blobs
        self._keys = keys
        self._limit = limit
        self._next = 0
        self._ahead: deque[Future[bytes]] = deque()

    def take(self) -> bytes:
        """The next blob's bytes.

        Raises:
            StateNotFoundError, StorageError: as ``BlobStore.get``.
        """
        while self._next < len(self._keys) and len(self._ahead) < self._limit:
            self._ahead.append(self._pool.submit(self._blobs.get, self._keys[self._next]))
            self._next += 1
        return self._ahead.popleft().result()

    def cancel(self) -> None:
        for future in self._ahead:
            future.cancel()


def _download_file(fetcher: _Prefetch, d: _Download, index_blob: str) -> None:
    where = f"file {d.rel!r} of snapshot index {index_blob!r}"
    crc = 0
    with _TempFile(d.path) as tmp:
        for key, expected in zip(d.keys, d.file.chunk_sizes(), strict=True):
            try:
                data = fetcher.take()
            except StateNotFoundError as exc:
                raise StateNotFoundError(f"chunk blob {key!r} of {where} is missing") from exc
            if len(data) != expected:
                raise CorruptStateError(
                    f"chunk blob {key!r} of {where}: expected {expected} bytes, found {len(data)}"
                )
            tmp.write(data)
            crc = google_crc32c.extend(crc, data)
        if crc != d.file.crc:
            raise CorruptStateError(
                f"{where} fails its checksum: expected CRC32C {d.file.crc:#010x}, found "
                f"{crc:#010x}; blobs {list(d.keys)!r}"
            )
        tmp.commit(d.file)


class _TempFile:
    """A new file next to ``final`` that replaces it only once complete and durable."""

    def __init__(self, final: Path) -> None:
        self._final = final
        self._path = final.parent / f"{_TEMP_PREFIX}{uuid.uuid4().hex}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW | getattr(os, "O_CLOEXEC", 0)
        self._file = os.fdopen(os.open(self._path, flags, 0o600), "wb")
        self._committed = False

    def __enter__(self) -> _TempFile:
        return self

    def write(self, data: bytes) -> None:
        self._file.write(data)

    def commit(self, f: FileIndex) -> None:
        """Apply the index's metadata, fsync, and rename over the final name."""
        self._file.flush()
        fd = self._file.fileno()
        os.fchmod(fd, f.attribs)
        mtime_ns = f.mtime_ms * 1_000_000
        os.utime(fd, ns=(mtime_ns, mtime_ns))
        os.fsync(fd)
        self._file.close()
        os.replace(self._path, self._final)
        self._committed = True

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._committed:
            self._file.close()
            self._path.unlink(missing_ok=True)
