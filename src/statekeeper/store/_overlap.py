"""The helper threads that write a commit to its working copy after the commit returns.

Once a commit's changelog and manifest are durable, the commit is done: writing it to the
local RocksDB copy (10,000 ``WriteBatch.put`` calls from Python, the undo record's reads,
RocksDB's memtable inserts: 5-15 ms for 10,000 keys) only keeps the cache up to date. So a
one-part commit hands that write to a helper thread and returns
(:meth:`statekeeper.store._working_copy.WorkingCopy.write_behind`); every later use of the
copy waits for it first. rocksdict holds the GIL while it fills and writes the batch, so
the write overlaps only work that does not need the GIL (I/O, the JVM, other processes): in a
Spark task, whose report follows the commit, the report waits for it (a median 48 ms at
1M-row batches). Starting the write after the report instead made no difference to the
pipeline's throughput on 2 busy cores (the write's CPU time is the same wherever it runs),
so the commit starts it.

The helpers are a small pool per process (two threads: commits of several stores run side by
side), made when first used and forgotten in a forked child (threads do not survive a fork).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from statekeeper.storage import thread_pool

__all__ = ["submit"]

_WORKERS = 2
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def submit(fn: Callable[[], None]) -> Future[None]:
    """Run ``fn`` on a helper thread (in the caller's, once Python's exit has begun)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = thread_pool(_WORKERS, "statekeeper-write")
        pool = _pool
    return pool.submit(fn)


def _forget_pool() -> None:
    global _pool, _lock
    _pool = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)
