"""Building a commit's RocksDB write batch while its changelog is compressed and uploaded.

The write batch of a commit (10,000 ``WriteBatch.put`` calls from Python: ~3.5 ms) needs
nothing from the upload; only writing it, with the label of the new version, must wait for
the commit point, so that the working copy never holds a version the blob store does not
(invariant 3 of ARCHITECTURE §5: the label is in the same write as the data). So the store
hands the batch to a helper thread just before it frames the changelog. The helper gets the
interpreter when the committing thread lets go of it (zstd's compression, the file writes
and fsyncs of the upload) and the batch is ready when the manifest is written. Where every
core is busy this gains nothing and costs a handoff between threads (~0.1 ms).

The helpers are a small pool per process (two threads: commits of several stores run side by
side), made when first used and forgotten in a forked child (threads do not survive a fork).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from statekeeper.changelog import Columns
from statekeeper.store._working_copy import PreparedWrite, WorkingCopy

__all__ = ["prepare_in_background", "settle"]

_WORKERS = 2
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def prepare_in_background(copy: WorkingCopy, columns: Columns) -> Future[PreparedWrite]:
    """Start :meth:`WorkingCopy.prepare` of a commit's ``columns`` (with its undo record)
    on a helper thread. The caller must not write to ``copy`` until the future is done."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="statekeeper-batch")
        pool = _pool
    return pool.submit(copy.prepare, columns, undo=True)


def settle(future: Future[PreparedWrite]) -> None:
    """Wait for a preparation whose batch will not be written (the commit failed), so that
    nothing reads the copy behind the caller's back afterwards; its own failure, if any, is
    of no consequence then."""
    if not future.cancel():
        future.exception()


def _forget_pool() -> None:
    global _pool, _lock
    _pool = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)
