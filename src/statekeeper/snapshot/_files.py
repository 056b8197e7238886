"""Local file facts shared by the diff, the upload and the restore.

Every open here refuses to follow a symlink in the last component, so a link planted in a
checkpoint or restore directory can never make us read or write a file outside it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import google_crc32c

__all__ = [
    "READ_SIZE",
    "crc32c_of_file",
    "fsync_dir",
    "is_immutable",
    "is_skipped",
    "open_no_follow",
]

READ_SIZE = 1 << 20
"""Bytes read at a time when only a checksum is needed."""

_IMMUTABLE_SUFFIXES = (".sst", ".blob")
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def is_immutable(name: str) -> bool:
    """Whether RocksDB never rewrites a file of this name (SST and blob files).

    Such a file is identified by its name and size; every other file (``MANIFEST-*``,
    ``CURRENT``, ``OPTIONS-*``, ...) may change under the same name and is always uploaded.
    """
    return name.endswith(_IMMUTABLE_SUFFIXES)


def is_skipped(name: str) -> bool:
    """Whether a file is RocksDB's lock or info log (``LOG``, ``LOG.old.*``), which are never
    part of a snapshot."""
    return name in ("LOCK", "LOG") or name.startswith("LOG.")


def open_no_follow(path: Path) -> int:
    """Open a regular file for reading without following a symlink; returns the fd.

    Raises:
        OSError: the file is missing, a symlink (``ELOOP``) or not a regular file.
    """
    # O_NONBLOCK: opening a FIFO swapped in for a file must fail the type check, not hang.
    flags = os.O_RDONLY | _NO_FOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"not a regular file: {str(path)!r}")
    return fd


def crc32c_of_file(path: Path) -> int:
    """CRC32C of a local regular file, read in bounded pieces.

    Raises:
        OSError: as :func:`open_no_follow`, or a read fails.
    """
    crc = 0
    with os.fdopen(open_no_follow(path), "rb") as f:
        while piece := f.read(READ_SIZE):
            crc = google_crc32c.extend(crc, piece)
    return crc


def fsync_dir(path: Path) -> None:
    """Make renames and unlinks in directory ``path`` durable.

    Raises:
        OSError: the directory cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY | _DIRECTORY | _NO_FOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
