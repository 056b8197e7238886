"""A cross-process lock per local working copy, with a polite way to ask the holder to let go.

Only one process at a time may use a working copy (RocksDB allows one handle per directory).
Spark keeps Python workers alive between tasks, and a worker keeps its stores open for the
next task of the same partition; when a task of that partition lands in *another* worker on
the same host, that worker asks for the lock by creating a *request file* next to it. The
holder's janitor thread (see ``_cache``) sees the request, closes the idle store and
unlocks; the waiter gets the lock. A holder that is busy (its task still runs) or dead
(the OS releases ``flock`` locks of dead processes) needs no cooperation: the waiter waits
until the task ends, up to a timeout, and then fails with an error naming the directory
and the holder's pid.

On Linux the waiter also nudges the holder: a datagram to the holder's janitor socket
(:func:`janitor_address`, named by the pid the lock file holds, in the abstract namespace:
no file, gone with the process), so an idle holder's janitor need not poll for requests.
Elsewhere, or when the nudge is lost, the janitor finds the request file on its own.

The lock is ``fcntl.flock`` on ``<working copy>.lock``; lock files are never deleted (a
deleted lock file lets two processes lock two different inodes). Releasing the lock after
using the copy sets the lock file's modification time: when the copy was last used, which
the janitor's local-copy sweep reads (:meth:`StoreLock.try_acquire` takes the lock without
marking a use). While a lock is held, the janitor refreshes that time every minute
(:meth:`StoreLock.keep`), so that an age-based cleaner of temporary files leaves the file of
a store open for days alone, and learns if it was deleted all the same.

Why not the ``filelock`` package (reviewed for issue 13): its ``UnixFileLock`` is the same
``flock`` call with polling, so it would replace about twenty lines; what this module adds is
the rest: the request file a waiter leaves for an idle holder, the holder's pid in the
timeout error, and no extra dependency on every executor. Kept.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import sys
import time

from statekeeper.errors import StateKeeperError

__all__ = ["StoreBusyError", "StoreLock", "janitor_address"]

_log = logging.getLogger("statekeeper.spark")

# A handover (the holder's janitor sees the request, closes the store, unlocks) takes tens of
# milliseconds, and the waiting task's core idles meanwhile: poll finely at first, so the
# lock is taken within _POLL_FAST_S of its release (an exponential backoff overslept by up
# to its last step, half the handover again). A holder still busy with a task can keep the
# lock for seconds: after _FAST_FOR_S, poll coarsely.
_POLL_FAST_S = 0.002
_POLL_SLOW_S = 0.05
_FAST_FOR_S = 1.0
_NUDGE_AGAIN_S = 0.5
"""A waiter nudges the holder when it makes the request, and again at most this often."""


def janitor_address(pid: int) -> bytes | None:
    """The address of the janitor socket of process ``pid`` (Linux's abstract namespace),
    or ``None`` where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    return b"\0statekeeper-janitor-%d" % pid


class StoreBusyError(StateKeeperError, TimeoutError):
    """Another process kept a local working copy locked for longer than the lock timeout."""


class StoreLock:
    """Exclusive lock of one working copy directory, shared by the processes of a host."""

    def __init__(self, copy_path: str) -> None:
        """Lock for the working copy at ``copy_path`` (the lock file sits beside it)."""
        self.path = f"{copy_path}.lock"
        self.request_path = f"{copy_path}.lock.request"
        self._fd: int | None = None
        self._used = False
        self._nudged_at = -_NUDGE_AGAIN_S

    def __repr__(self) -> str:
        return f"StoreLock({self.path!r}, held={self.held})"

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._fd is not None

    def acquire(self, timeout_s: float) -> float:
        """Take the lock, asking an idle holder to release it; returns seconds waited.

        Raises:
            StoreBusyError: still held by another process after ``timeout_s``.
            StateKeeperError: already held by this object, or the lock file cannot be opened.
        """
        if self._fd is not None:
            raise StateKeeperError(f"{self!r} is already held")
        started = time.monotonic()
        fd = self._open()
        try:
            while not _try_lock(fd):
                waited = time.monotonic() - started
                if waited >= timeout_s:
                    raise StoreBusyError(self._busy_message(fd, waited))
                self.ask()
                time.sleep(_POLL_FAST_S if waited < _FAST_FOR_S else _POLL_SLOW_S)
        except BaseException:
            os.close(fd)
            raise
        try:
            # Who holds it, for another process's busy message; not worth failing over (a
            # full disk): a lock left held by a failed acquire would refuse every task.
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            _log.debug("could not note this process in %s: %s", self.path, exc)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.request_path)  # served; other waiters renew their own request
        self._fd, self._used = fd, True
        return time.monotonic() - started

    def try_acquire(self) -> bool:
        """Take the lock if no process holds it, without waiting or asking, and without
        marking the copy as used; True if taken.

        Raises:
            StateKeeperError: already held by this object, or the lock file cannot be opened.
        """
        if self._fd is not None:
            raise StateKeeperError(f"{self!r} is already held")
        fd = self._open()
        try:
            taken = _try_lock(fd)
        except BaseException:
            os.close(fd)
            raise
        if not taken:
            os.close(fd)
            return False
        self._fd, self._used = fd, False
        return True

    def keep(self) -> bool:
        """While held: refresh the lock file's time, so that an age-based cleaner of
        temporary files leaves it alone, and tell whether the lock still guards the copy:
        False once the file was deleted or replaced (then another process can take a lock
        of the same name while this one holds it). True if not held."""
        fd = self._fd
        if fd is None:
            return True
        with contextlib.suppress(OSError):  # a read-only file system: only the cleaner's clock
            os.utime(fd)
        try:
            named, held = os.stat(self.path), os.fstat(fd)
        except OSError:
            return False
        return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)

    def requested(self) -> bool:
        """True if another process asked for the lock since it was last taken."""
        return os.path.exists(self.request_path)

    def release(self) -> None:
        """Release the lock (marking the copy used now, if taken by :meth:`acquire`).
        Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            if self._used:
                with contextlib.suppress(OSError):  # only the sweep's clock; never fatal
                    os.utime(fd)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def last_used(self) -> float | None:
        """When (``time.time()`` seconds) the copy was last used, as far as the lock file
        tells; ``None`` if there is no lock file."""
        try:
            return os.stat(self.path).st_mtime
        except OSError:
            return None

    def _open(self) -> int:
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StateKeeperError(f"cannot open the lock file {self.path}: {exc}") from exc

    def ask(self) -> None:
        """Ask the holder to let go once idle (the request file), without waiting, and
        nudge its janitor; the process that takes the lock next removes the request. Never
        raises: a request that could not be made only makes a later :meth:`acquire` wait
        longer."""
        try:
            os.close(os.open(self.request_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            made = True
        except FileExistsError:
            made = False
        except OSError:
            return
        now = time.monotonic()
        if made or now - self._nudged_at >= _NUDGE_AGAIN_S:
            self._nudged_at = now
            self._nudge()

    def _nudge(self) -> None:
        """Wake the holder's janitor (best effort: it also looks for requests by itself)."""
        try:
            with open(self.path, "rb") as fh:
                holder = int(fh.read(32).split()[0])
        except (OSError, ValueError, IndexError):
            return  # no holder noted (yet)
        address = janitor_address(holder)
        if address is None:
            return
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.setblocking(False)
            s.sendto(b"!", address)  # no such socket, or its queue is full: it polls

    def _busy_message(self, fd: int, waited: float) -> str:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        return (
            f"the local working copy {self.path.removesuffix('.lock')} is locked by another "
            f"process (pid {holder}); gave up after {waited:.1f} s. Only one process at a time "
            "may use a working copy: is another query using the same checkpoint root, operator "
            "and local_dir, or is a task of this partition still running? Raise lock_timeout_s "
            "if tasks are just slow"
        )


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
            return False
        raise StateKeeperError(f"cannot lock a working copy: {exc}") from exc
    return True
