"""What an incremental snapshot must upload: a local checkpoint directory against the index
of the previous snapshot (the seed's ``DirDiff``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from statekeeper.snapshot._files import crc32c_of_file, is_immutable, is_skipped
from statekeeper.snapshot._index import ROOT_DIR_NAME, DirIndex, FileIndex, iter_files
from statekeeper.snapshot._rules import name_problem

__all__ = ["DirDiff", "diff_dir"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DirDiff:
    """The difference between one local directory and the same directory of an index.

    Attributes:
        dir_name: the directory's name (``""`` for the root).
        files_added: local files to upload (absolute paths), sorted by name.
        bytes_added: their total size (this directory only).
        files_retained: previous entries whose blobs the new snapshot reuses unchanged.
        files_replaced: previous entries of files that exist locally under the same name
            but are uploaded again (mutable files, or an immutable file whose size or
            content differs); their blobs are no longer referenced.
        files_removed: previous entries with no local file of that name.
        sub_dirs_added: local subdirectories the previous index does not have.
        sub_dirs_retained: subdirectories on both sides, diffed recursively.
        sub_dirs_removed: previous subdirectories with no local directory of that name.
    """

    dir_name: str
    files_added: tuple[Path, ...] = ()
    bytes_added: int = 0
    files_retained: tuple[FileIndex, ...] = ()
    files_replaced: tuple[FileIndex, ...] = ()
    files_removed: tuple[FileIndex, ...] = ()
    sub_dirs_added: tuple[DirDiff, ...] = ()
    sub_dirs_retained: tuple[DirDiff, ...] = ()
    sub_dirs_removed: tuple[DirIndex, ...] = ()

    def _children(self) -> tuple[DirDiff, ...]:
        return self.sub_dirs_added + self.sub_dirs_retained

    @property
    def bytes_to_upload(self) -> int:
        """Total size of every file to upload, in this directory and below."""
        return self.bytes_added + sum(d.bytes_to_upload for d in self._children())

    @property
    def bytes_retained(self) -> int:
        """Total size of every file reused from the previous snapshot, here and below."""
        here = sum(f.size_in_bytes for f in self.files_retained)
        return here + sum(d.bytes_retained for d in self._children())

    def iter_added(self) -> Iterator[tuple[str, Path]]:
        """Every file to upload, here and below, with its ``/``-joined relative path."""
        for path in self.files_added:
            yield path.name, path
        for sub in self._children():
            for rel, path in sub.iter_added():
                yield f"{sub.dir_name}/{rel}", path

    def iter_retained(self) -> Iterator[FileIndex]:
        """Every reused previous entry, here and below."""
        yield from self.files_retained
        for sub in self._children():
            yield from sub.iter_retained()

    def iter_removed(self) -> Iterator[FileIndex]:
        """Every previous file that no longer exists locally, including those of removed
        subdirectories."""
        yield from self.files_removed
        for gone in self.sub_dirs_removed:
            for _, f in iter_files(gone):
                yield f
        for sub in self.sub_dirs_retained:
            yield from sub.iter_removed()


def diff_dir(local: Path, previous: DirIndex | None, *, trust_names: bool) -> DirDiff:
    """Diff the directory tree at ``local`` against ``previous``, recursively.

    An immutable file (see :func:`is_immutable`) whose relative path and size match a
    previous entry is retained: with ``trust_names`` it is identified by name alone, as
    RocksDB never reuses a file number within one database's history; without it (the local
    copy does not descend from ``previous``, so numbers may repeat with other content) its
    CRC32C must match too, computed only for such candidates. Every other local file is
    added. RocksDB's ``LOCK`` and ``LOG*`` files are ignored. Symlinks are never followed.

    Args:
        local: the checkpoint directory (its own path may be a symlink).
        previous: the previous snapshot's root directory, or ``None`` for a first snapshot.
        trust_names: whether the local copy descends from ``previous``.

    Raises:
        ValueError: ``local`` holds a symlink, a special file, or a name a snapshot index
            cannot hold.
        OSError: ``local`` cannot be read.
    """
    return _diff(Path(local), previous, ROOT_DIR_NAME, trust_names)


def _diff(path: Path, previous: DirIndex | None, name: str, trust_names: bool) -> DirDiff:
    files, dirs = _scan(path)
    prev_files = {f.file_name: f for f in previous.files_present} if previous else {}
    prev_dirs = {d.dir_name: d for d in previous.sub_directories_present} if previous else {}
    added: list[Path] = []
    retained: list[FileIndex] = []
    replaced: list[FileIndex] = []
    for file_name, size in sorted(files.items()):
        old = prev_files.get(file_name)
        if old is not None and _unchanged(path / file_name, size, old, trust_names):
            retained.append(old)
            continue
        added.append(path / file_name)
        if old is not None:
            replaced.append(old)
    return DirDiff(
        dir_name=name,
        files_added=tuple(added),
        bytes_added=sum(files[p.name] for p in added),
        files_retained=tuple(retained),
        files_replaced=tuple(replaced),
        files_removed=tuple(f for n, f in sorted(prev_files.items()) if n not in files),
        sub_dirs_added=tuple(
            _diff(path / d, None, d, trust_names) for d in sorted(dirs) if d not in prev_dirs
        ),
        sub_dirs_retained=tuple(
            _diff(path / d, prev_dirs[d], d, trust_names) for d in sorted(dirs) if d in prev_dirs
        ),
        sub_dirs_removed=tuple(d for n, d in sorted(prev_dirs.items()) if n not in dirs),
    )


def _unchanged(path: Path, size: int, old: FileIndex, trust_names: bool) -> bool:
    if not is_immutable(old.file_name) or old.size_in_bytes != size:
        return False
    return trust_names or crc32c_of_file(path) == old.crc


def _scan(path: Path) -> tuple[dict[str, int], set[str]]:
    """Regular files (name -> size) and subdirectories of ``path``, without following links."""
    files: dict[str, int] = {}
    dirs: set[str] = set()
    with os.scandir(path) as entries:
        for entry in entries:
            if is_skipped(entry.name):
                continue
            problem = name_problem(entry.name)
            if problem is not None:
                raise ValueError(f"cannot snapshot {entry.path!r}: {problem}")
            if entry.is_symlink():
                raise ValueError(
                    f"cannot snapshot {entry.path!r}: expected a regular file or directory, "
                    "found a symlink (a snapshot never follows links)"
                )
            if entry.is_dir(follow_symlinks=False):
                dirs.add(entry.name)
            elif entry.is_file(follow_symlinks=False):
                files[entry.name] = entry.stat(follow_symlinks=False).st_size
            else:
                raise ValueError(
                    f"cannot snapshot {entry.path!r}: expected a regular file or directory, "
                    "found a special file"
                )
    return files, dirs
