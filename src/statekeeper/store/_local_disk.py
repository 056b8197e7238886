"""The local disk under a working copy: who holds its lock, how full it is, setting it aside.

rocksdict raises a bare ``Exception`` for every RocksDB failure, with RocksDB's status text
as the only detail, so a failure is never classified by its message (RocksDB's "block
checksum mismatch" contains the word "lock"). Instead the cause is measured:

* **A real lock conflict** is another process holding the POSIX record lock that RocksDB
  takes on the database's ``LOCK`` file. :func:`holding_lock` tries to take that lock
  itself, without waiting: refused (``EAGAIN``/``EACCES``) means another process has the
  copy open. The probe must never run while this process holds the lock (closing any
  descriptor of the file would drop RocksDB's own POSIX lock): :class:`WorkingCopy` keeps
  the set of directories it has open in this process and refuses a second open before ever
  reaching RocksDB, and nothing else in statekeeper opens these directories. (Not the
  ``filelock`` package: it takes ``flock`` locks, which on Linux are independent of POSIX
  record locks, so it acquires the ``LOCK`` file of a copy another process has open; checked
  with a real RocksDB holder.)
* **A full disk** is measured with ``statvfs`` (:func:`disk_note`), and said in the error
  with what to free.
* **Anything else** (a flipped byte, a truncated file, a restore interrupted half way) means
  the copy is damaged. The copy is only a cache of the blob store, so it is set aside
  (renamed, never deleted: someone may want to look at it; :func:`set_aside`) and rebuilt.
"""

from __future__ import annotations

import calendar
import contextlib
import errno
import fcntl
import logging
import os
import resource
import shutil
import time
import uuid
from collections.abc import Iterator

from statekeeper.errors import StateKeeperError

__all__ = [
    "LOW_SPACE_BYTES",
    "DamagedCopyError",
    "disk_note",
    "free_bytes",
    "holding_lock",
    "read_failure",
    "set_aside",
    "set_aside_copies",
    "set_aside_time",
    "write_failure",
]

_log = logging.getLogger("statekeeper.store")

# Below this much free space a failure to open is taken for a full disk, not for damage:
# setting the copy aside would not help, and a rebuild needs room.
LOW_SPACE_BYTES = 16 * 1024 * 1024
_ASIDE_MARK = ".damaged-"


class DamagedCopyError(StateKeeperError):
    """The local working copy cannot be read: rebuild it from the blob store."""

    def __init__(self, path: str, cause: BaseException) -> None:
        super().__init__(f"the local working copy {path} is damaged: {cause}")
        self.path = path


def read_failure(path: str, cause: BaseException) -> StateKeeperError:
    """What a failure to open or read the copy at ``path`` means: damage
    (:class:`DamagedCopyError`, so the copy is rebuilt), unless the process ran out of file
    handles, or may not read it: neither says anything about the copy (setting it aside and
    rebuilding it would fail the same way, and leave a copy behind each time)."""
    if _denied(cause):
        return StateKeeperError(
            f"cannot read the local working copy {path}: permission denied ({cause}). The "
            f"process runs as uid {os.getuid()}: give it read and write access to {path} "
            "and its folder, or point StoreConfig.local_dir at a folder it owns"
        )
    if not _out_of_file_handles(cause):
        return DamagedCopyError(path, cause)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return StateKeeperError(
        f"cannot read the local working copy {path}: this process is out of file handles "
        f"({cause}). Its open files are limited to {soft} (ulimit -n; the hard limit is "
        f"{hard}), and each open store holds about 7 plus its SST files: raise the limit, or "
        "lower StoreConfig.max_open_stores"
    )


def write_failure(path: str, action: str, cause: BaseException) -> StateKeeperError:
    """What a failed write, flush or checkpoint of the copy at ``path`` means: damage, if
    RocksDB reports corruption (a flush or compaction met a block whose checksum fails; from
    then on RocksDB fails every write of the copy, so only a rebuild gets past it) or a
    file or folder of the copy missing (deleted under the open database, by a cleaner of
    temporary files, say: its checkpoints fail for good); else a problem of the disk, with
    a note on its free space. ``action`` says what failed."""
    if _is_corruption(cause) or _missing(cause):
        return DamagedCopyError(path, cause)
    return StateKeeperError(f"{action}: {cause}; {disk_note(path)}")


def _is_corruption(cause: BaseException) -> bool:
    # RocksDB's Status::Corruption reads "Corruption: ..." (rocksdict raises a bare
    # Exception with that text); a background error it made sticky keeps the prefix.
    return "Corruption:" in str(cause)


def _missing(cause: BaseException) -> bool:
    if isinstance(cause, OSError) and cause.errno == errno.ENOENT:
        return True
    # RocksDB reports an IO error whose text holds strerror(ENOENT).
    return os.strerror(errno.ENOENT) in str(cause)


def _denied(cause: BaseException) -> bool:
    if isinstance(cause, OSError) and cause.errno in (errno.EACCES, errno.EPERM):
        return True
    # RocksDB reports an IO error whose text ends with strerror(EACCES).
    return os.strerror(errno.EACCES) in str(cause)


def _out_of_file_handles(cause: BaseException) -> bool:
    if isinstance(cause, OSError) and cause.errno in (errno.EMFILE, errno.ENFILE):
        return True
    # RocksDB reports an IO error whose text ends with strerror(EMFILE or ENFILE).
    return os.strerror(errno.EMFILE) in str(cause) or os.strerror(errno.ENFILE) in str(cause)


@contextlib.contextmanager
def holding_lock(path: str, cause: BaseException | None) -> Iterator[None]:
    """Hold the lock of the RocksDB database at ``path`` for the duration (no-op if it has
    no ``LOCK`` file), so no other process opens it meanwhile.

    Raises:
        StateKeeperError: another process holds the lock (the copy is in use), or whether
            one does cannot be told; ``cause`` (why the copy is looked at) is chained.
    """
    lock = os.path.join(path, "LOCK")
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        yield
        return
    except OSError as exc:
        raise StateKeeperError(
            f"cannot open the local working copy {path} ({cause}), and cannot open its lock "
            f"file {lock} to tell whether another process uses it: {exc}"
        ) from cause
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise StateKeeperError(
                    f"the local working copy {path} is in use by another process (it holds "
                    f"{lock}); stop that process, or give this one another local_dir"
                ) from cause
            raise StateKeeperError(
                f"cannot open the local working copy {path} ({cause}), and cannot tell "
                f"whether another process uses it: locking {lock} failed: {exc}"
            ) from cause
        yield
    finally:
        os.close(fd)  # releases the probe's lock


def free_bytes(path: str) -> int | None:
    """Bytes free to this user on the file system of ``path`` (or its nearest existing
    parent); ``None`` if that cannot be measured."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        stats = os.statvfs(probe)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def disk_note(path: str) -> str:
    """A sentence on the free space under ``path``, and what to do if it is (nearly) full."""
    free = free_bytes(path)
    if free is None:
        return f"the free space under {path} could not be measured"
    note = f"{free:,} bytes are free on the file system of {path}"
    if free < LOW_SPACE_BYTES:
        note += (
            "; the disk is full: free space there (old working copies of other roots, "
            "folders set aside as *.damaged-*) or point StoreConfig.local_dir at a larger disk"
        )
    return note


def set_aside(path: str, reason: BaseException | str) -> str:
    """Rename the damaged working copy at ``path`` out of the way; returns the new name.

    Raises:
        StateKeeperError: the rename failed (the copy is left where it was).
    """
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = f"{path}{_ASIDE_MARK}{stamp}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return aside  # nothing there to keep
    except OSError as exc:
        raise StateKeeperError(
            f"the local working copy {path} is damaged ({reason}) and could not be set "
            f"aside as {aside}: {exc}"
        ) from exc
    _log.warning(
        "the local working copy %s is damaged (%s): set aside as %s (kept for inspection; "
        "delete it when done) and rebuilt from the checkpoint root",
        path, reason, aside,
    )  # fmt: skip
    # Only the newest is kept: damage that comes back (a disk going bad) would otherwise
    # leave a whole copy behind at every rebuild, and fill the disk.
    for older in set_aside_copies(path):
        if older != aside:
            shutil.rmtree(older, ignore_errors=True)
    return aside


def set_aside_copies(path: str) -> list[str]:
    """The folders the copy at ``path`` was set aside as (:func:`set_aside`), oldest first."""
    folder, name = os.path.split(path)
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    mark = f"{name}{_ASIDE_MARK}"
    return [os.path.join(folder, n) for n in sorted(names) if n.startswith(mark)]


def set_aside_time(aside: str) -> float | None:
    """When the copy at ``aside`` was set aside (seconds since the epoch), from its name."""
    stamp = os.path.basename(aside).rpartition(_ASIDE_MARK)[2].split("-", 1)[0]
    try:
        return calendar.timegm(time.strptime(stamp, "%Y%m%dT%H%M%SZ"))
    except ValueError:
        return None
