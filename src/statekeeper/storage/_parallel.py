"""What every backend shares: key checks and parallel ``put_many``/``get_many``.

``put_many`` and ``get_many`` go through ``self.put`` and ``self.get`` one blob at a time, so a
wrapper store (fault injection, metrics) that subclasses :class:`ParallelTransfers` and
overrides ``put``/``get`` sees every blob of a bulk transfer too.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from types import TracebackType
from typing import Any, ParamSpec, Self, TypeVar

__all__ = [
    "ParallelTransfers",
    "check_data",
    "check_key",
    "check_prefix",
    "check_range",
    "thread_pool",
    "transfer_pool",
]

_A = TypeVar("_A")
_R = TypeVar("_R")
_P = ParamSpec("_P")


class _InlineExecutor(Executor):
    """Runs each task in the submitting thread: with one transfer at a time a pool thread
    buys nothing and costs a thread start and two handoffs per transfer."""

    def submit(self, fn: Callable[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_R]:
        future: Future[_R] = Future()
        _run_into(future, fn, *args, **kwargs)
        return future


def _run_into(
    future: Future[_R], fn: Callable[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs
) -> None:
    """Call ``fn`` here; its result or exception into ``future``, as a pool thread does."""
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - delivered by .result(), as a pool does
        future.set_exception(exc)
    else:
        future.set_result(result)


class _ExitSafePool(ThreadPoolExecutor):
    """A thread pool that runs a call in the caller's thread when it refuses the call.

    Once Python's exit has begun (the main thread has returned), every ``concurrent.futures``
    pool refuses new work with ``RuntimeError``, before Python waits for the other threads
    and runs ``atexit`` handlers: a commit still being made on a non-daemon thread failed
    after it was made durable, and a background snapshot still uploading as the program
    ended was cut off. Run in the caller's thread instead, the work finishes, without
    parallelism. ``submit`` also raises ``RuntimeError`` for a call it has already queued
    when it cannot start a thread for it (and a pool shut down refuses calls too): each call
    is claimed once, by the caller or by a pool thread, so none runs twice.
    """

    def submit(self, fn: Callable[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_R]:
        future: Future[_R] = Future()
        claim = threading.Lock()

        def run() -> None:
            if claim.acquire(blocking=False) and future.set_running_or_notify_cancel():
                _run_into(future, fn, *args, **kwargs)

        try:
            super().submit(run)
        except RuntimeError:
            run()
        return future


def thread_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads named after ``name`` that runs a call in the caller's
    thread when it refuses it, as every pool does once Python's exit has begun
    (:class:`_ExitSafePool`). Every pool of the store's own background and transfer work is
    one of these."""
    return _ExitSafePool(workers, thread_name_prefix=name)


def transfer_pool(io_threads: int, name: str) -> Executor:
    """An executor for ``io_threads`` parallel transfers, as a context manager: a thread
    pool (:func:`thread_pool`), or for one transfer at a time the caller's own thread."""
    if io_threads == 1:
        return _InlineExecutor()
    return thread_pool(io_threads, name)


def check_key(key: object) -> str:
    """Return ``key`` if it is a valid blob key.

    A key is a relative ``/``-separated path: no empty segment, no segment starting with
    ``.`` (that also refuses ``.`` and ``..``, and keeps the names backends use for temporary
    and lock files out of the key space), no backslash, no NUL.

    Raises:
        TypeError: ``key`` is not a str.
        ValueError: ``key`` breaks one of the rules above; the message says which.
    """
    if not isinstance(key, str):
        raise TypeError(f"blob key must be a str, got {type(key).__name__}")
    if not key:
        raise ValueError("blob key must not be empty")
    _check_path(key, key, "blob key")
    return key


def is_key(key: str) -> bool:
    """Whether ``key`` is a valid blob key (:func:`check_key`), without raising."""
    try:
        check_key(key)
    except ValueError:
        return False
    return True


def check_prefix(prefix: object) -> str:
    """Return ``prefix`` if it is a valid listing prefix.

    A prefix is any string start of a valid key: ``""``, ``"a/"``, ``"a/b"`` (which also
    matches ``"a/bc"``). Only its folder part (up to the last ``/``) must follow the key rules.

    Raises:
        TypeError: ``prefix`` is not a str.
        ValueError: the folder part breaks a key rule, or ``prefix`` holds ``\\`` or NUL.
    """
    if not isinstance(prefix, str):
        raise TypeError(f"list prefix must be a str, got {type(prefix).__name__}")
    folder, _, last = prefix.rpartition("/")
    if "\\" in last or "\x00" in last:
        raise ValueError(f"list prefix must not contain '\\' or NUL, got {prefix!r}")
    if prefix.startswith("/"):
        raise ValueError(f"list prefix must be relative (no leading '/'), got {prefix!r}")
    if folder:
        _check_path(folder, prefix, "list prefix")
    return prefix


def check_data(data: object) -> None:
    """Refuse blob data that is not bytes-like.

    Raises:
        TypeError: ``data`` is not ``bytes``, ``bytearray`` or ``memoryview``.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"blob data must be bytes, got {type(data).__name__}")


def check_range(start: object, length: object) -> None:
    """Refuse a byte range that is not two ints >= 0.

    Raises:
        TypeError: ``start`` or ``length`` is not an int.
        ValueError: ``start`` or ``length`` is negative.
    """
    for name, value in (("start", start), ("length", length)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"get_range {name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"get_range {name} must be >= 0, got {value}")


def _check_path(path: str, shown: str, what: str) -> None:
    if path.startswith("/"):
        raise ValueError(f"{what} must be relative (no leading '/'), got {shown!r}")
    if "\\" in path or "\x00" in path:
        raise ValueError(f"{what} must not contain '\\' or NUL, got {shown!r}")
    for segment in path.split("/"):
        if not segment:
            raise ValueError(
                f"{what} must not have empty segments ('//' or a trailing '/'): {shown!r}"
            )
        if segment in (".", ".."):
            raise ValueError(f"{what} must not contain '.' or '..' segments, got {shown!r}")
        if segment.startswith("."):
            raise ValueError(
                f"{what} segments must not start with '.' (reserved for temporary files), "
                f"got {shown!r}"
            )


class ParallelTransfers(abc.ABC):
    """Base of the backends: bulk transfers on a lazily created pool of I/O threads.

    Subclasses implement ``put`` and ``get``; this class provides ``put_many``,
    ``get_many``, ``close`` and the context-manager protocol.
    """

    def __init__(self, io_threads: int = 8) -> None:
        """Set the pool size; no thread is started before the first bulk transfer.

        Raises:
            ValueError: ``io_threads`` is not an int >= 1.
        """
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise ValueError(f"io_threads must be an int >= 1, got {io_threads!r}")
        self._io_threads = io_threads
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @abc.abstractmethod
    def put(
        self, key: str, data: bytes, *, overwrite: bool = False, if_match: str | None = None
    ) -> None:
        """Write one blob (see :class:`~statekeeper.storage.BlobStore`)."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """Read one blob (see :class:`~statekeeper.storage.BlobStore`)."""

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Read part of one blob (see :class:`~statekeeper.storage.BlobStore`); the backends
        implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not read ranges")

    @property
    def io_threads(self) -> int:
        """Parallel transfers per bulk call."""
        return self._io_threads

    def put_many(self, items: Sequence[tuple[str, bytes]], *, overwrite: bool = False) -> None:
        """``put`` every item in parallel; every item is attempted.

        Raises:
            CommitConflictError: an item's key exists (create-only); the first failing
                item in ``items`` order is raised, after all transfers ended.
            StorageError: as ``put``, with the same ordering rule.
        """

        def put_one(item: tuple[str, bytes]) -> None:
            self.put(item[0], item[1], overwrite=overwrite)

        self._run_all(put_one, items)

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        """``get`` every key in parallel; results are in ``keys`` order.

        Raises:
            StateNotFoundError: a key has no blob; the first failing key in ``keys`` order
                is raised, after all transfers ended.
            StorageError: as ``get``, with the same ordering rule.
        """
        return self._run_all(self.get, keys)

    def get_prefixes(self, keys: Sequence[str], length: int) -> list[bytes]:
        """``get_range(key, 0, length)`` of every key in parallel; results in ``keys`` order.

        Raises:
            StateNotFoundError: a key has no blob; the first failing key in ``keys`` order
                is raised, after all transfers ended.
            StorageError: as ``get_range``, with the same ordering rule.
        """
        return self._run_all(lambda key: self.get_range(key, 0, length), keys)

    def close(self) -> None:
        """Shut the I/O threads down, waiting for running transfers. Idempotent.

        A later bulk transfer starts a new pool, so a closed store stays usable.
        """
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = thread_pool(self._io_threads, "statekeeper-io")
            return self._pool

    def _run_all(self, fn: Callable[[_A], _R], args: Sequence[_A]) -> list[_R]:
        if len(args) == 1:
            # One transfer gains nothing from a thread hop.
            return [fn(args[0])]
        if self._io_threads == 1:
            return _run_inline(fn, args)
        pool = self._executor()
        futures: list[Future[_R]] = [pool.submit(fn, arg) for arg in args]
        # Wait for all before raising: a caller that retries or cleans up after an error
        # must not race transfers still running in the background.
        wait(futures)
        for future in futures:
            error = future.exception()
            if error is not None:
                raise error
        return [future.result() for future in futures]


def _run_inline(fn: Callable[[_A], _R], args: Sequence[_A]) -> list[_R]:
    """``_run_all`` in the caller's thread: every item attempted, the first failure raised."""
    results: list[Any] = []
    error: BaseException | None = None
    for arg in args:
        try:
            results.append(fn(arg))
        except Exception as exc:  # noqa: BLE001 - raised below, after every item ran
            error = error or exc
    if error is not None:
        raise error
    return results
