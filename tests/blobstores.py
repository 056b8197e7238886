"""Wrappers around a real BlobStore for tests: they observe or disturb, never replace it."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterable

import statekeeper as sk
from statekeeper.errors import StorageError, TransientStorageError
from statekeeper.gc import MIN_ORPHAN_TTL_S, collect_garbage
from statekeeper.history import StoreHistory
from statekeeper.storage import BlobMeta, BlobStore
from statekeeper.storage._parallel import ParallelTransfers
from statekeeper.store._root import RootRegistry


class RecordingBlobStore(ParallelTransfers):
    """Delegates every call to ``inner`` and records (operation, key) pairs.

    Bulk transfers go through ``put``/``get`` one blob at a time (``ParallelTransfers``),
    so every blob is recorded.
    """

    def __init__(self, inner: BlobStore, io_threads: int = 4) -> None:
        super().__init__(io_threads)
        self.inner = inner
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def _record(self, op: str, key: str) -> None:
        with self._lock:
            self.calls.append((op, key))

    def counts(self) -> Counter[str]:
        """How many calls of each operation were made."""
        with self._lock:
            return Counter(op for op, _ in self.calls)

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()

    @property
    def uri(self) -> str:
        return self.inner.uri

    def put(
        self, key: str, data: bytes, *, overwrite: bool = False, if_match: str | None = None
    ) -> None:
        self._record("put", key)
        self.inner.put(key, data, overwrite=overwrite, if_match=if_match)

    def get(self, key: str) -> bytes:
        self._record("get", key)
        return self.inner.get(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self._record("get_range", key)
        return self.inner.get_range(key, start, length)

    def head(self, key: str) -> BlobMeta:
        self._record("head", key)
        return self.inner.head(key)

    def list(self, prefix: str = "") -> list[BlobMeta]:
        self._record("list", prefix)
        return self.inner.list(prefix)

    def delete_many(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for key in keys:
            self._record("delete", key)
        self.inner.delete_many(keys)

    def sweep_incomplete(self, older_than_s: float, *, dry_run: bool = False) -> int:
        self._record("sweep", "")
        return self.inner.sweep_incomplete(older_than_s, dry_run=dry_run)

    def close(self) -> None:
        super().close()
        self.inner.close()


class SimulatedCrash(BaseException):
    """Raised by FaultyBlobStore(kind="crash") in-process; never caught by library code."""


class FaultyBlobStore(RecordingBlobStore):
    """Fails the ``fail_at``-th call (1-based) of operation ``op`` (any operation if None).

    ``kind``: ``"transient"`` raises TransientStorageError, ``"permanent"`` StorageError,
    ``"kill"`` SIGKILLs this process (for child processes), ``"crash"`` raises
    SimulatedCrash. ``times`` consecutive calls fail (for retry tests).
    """

    def __init__(
        self,
        inner: BlobStore,
        *,
        fail_at: int,
        kind: str,
        op: str | None = None,
        times: int = 1,
    ) -> None:
        super().__init__(inner)
        self.fail_at, self.kind, self.op, self.times = fail_at, kind, op, times
        self.seen = 0

    def _record(self, op: str, key: str) -> None:
        super()._record(op, key)
        if self.op is not None and op != self.op:
            return
        with self._lock:
            self.seen += 1
            failing = self.fail_at <= self.seen < self.fail_at + self.times
        if not failing:
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "crash":
            raise SimulatedCrash(f"injected crash at {op} {key} (call {self.seen})")
        if self.kind == "transient":
            raise TransientStorageError(f"injected transient failure of {op} {key}")
        raise StorageError(f"injected permanent failure of {op} {key}")


def store_history(backend: sk.StateBackend, operator: str, partition: int) -> StoreHistory:
    """The store's history as its newest manifest states it (blob keys of every version);
    ``backend`` may be closed."""
    meta = RootRegistry(backend.blobs).read()
    assert meta is not None
    return StoreHistory.load(backend.blobs, operator, partition, root_id=meta.root_id)


def gc_later(backend: sk.StateBackend, seconds: float = MIN_ORPHAN_TTL_S + 1) -> sk.GcReport:
    """A gc of ``backend``'s root run as if ``seconds`` had passed: every grace period
    (``orphan_ttl_s``, at least :data:`MIN_ORPHAN_TTL_S`) of what is there now has ended."""
    meta = backend.root_metadata()
    return collect_garbage(
        backend.blobs,
        backend.config,
        sorted(backend.operators()),
        now=time.time() + seconds,
        root_id="" if meta is None else meta.root_id,
    )
