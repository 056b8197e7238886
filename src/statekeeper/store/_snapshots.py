"""Snapshots of working copies: taken now, or in the background off the commit path.

A snapshot is a RocksDB checkpoint (hard links, so it is cheap and immune to later
compactions) of the working copy, uploaded incrementally against the previous snapshot's
index (``statekeeper.snapshot``). The checkpoint is created under the working copy's lock, so
it holds exactly one labelled, committed version; the upload then runs from the checkpoint
directory without touching the live database.
"""

from __future__ import annotations

import logging
import shutil
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from statekeeper import layout
from statekeeper.config import StoreConfig
from statekeeper.errors import CommitConflictError, StateKeeperError, StateNotFoundError
from statekeeper.metrics import CommitMetrics, write_commit_metrics
from statekeeper.snapshot import SnapshotIndex, SnapshotMetrics, load_index, upload_snapshot
from statekeeper.storage import BlobStore
from statekeeper.store._working_copy import WorkingCopy

__all__ = [
    "SnapshotJob",
    "Snapshotter",
    "release_checkpoint",
    "remove_stale_checkpoints",
    "write_metrics_quietly",
]

_log = logging.getLogger("statekeeper.store")

# Checkpoint folders whose upload is running in this process.
_active: set[Path] = set()
_active_lock = threading.Lock()


class SnapshotJob:
    """One snapshot of one working copy: checkpoint once, then upload.

    The checkpoint is taken by whoever gets there first: the background thread, or the
    store's ``close`` (which must not release the database before it exists).
    """

    def __init__(self, copy: WorkingCopy, operator: str, partition: int) -> None:
        self.copy = copy
        self.operator = operator
        self.partition = partition
        self._lock = threading.Lock()
        self._taken = False
        self._checkpoint: tuple[Path, int] | None = None
        self.metrics: list[CommitMetrics] = []
        """Commit metrics to write once the upload is done (off the commit path)."""

    def ensure_checkpoint(self) -> tuple[Path, int] | None:
        """Create the checkpoint if nobody did yet; ``None`` if the copy was already closed."""
        with self._lock:
            if not self._taken:
                self._taken = True
                path = Path(f"{self.copy.path}.checkpoints") / uuid.uuid4().hex
                path.parent.mkdir(parents=True, exist_ok=True)
                with _active_lock:
                    _active.add(path)
                try:
                    self._checkpoint = (path, self.copy.checkpoint(str(path)))
                except StateKeeperError as exc:
                    release_checkpoint(path)
                    _log.info("snapshot of %s/%s skipped: %s", self.operator, self.partition, exc)
            return self._checkpoint


class Snapshotter:
    """Uploads snapshots for one backend, synchronously or on a background thread."""

    def __init__(self, blobs: BlobStore, config: StoreConfig) -> None:
        self._blobs = blobs
        self._config = config
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._running: dict[tuple[str, int], Future[SnapshotMetrics | None]] = {}
        self._uploading: dict[tuple[str, int], int] = {}
        self.after_upload: Callable[[str, int], None] | None = None
        """Called (on the background thread) after each background snapshot upload."""

    def uploading(self) -> frozenset[tuple[str, int]]:
        """Stores with a snapshot upload in flight in this process (for GC)."""
        with self._pool_lock:
            return frozenset(k for k, n in self._uploading.items() if n)

    def schedule(self, job: SnapshotJob) -> Future[SnapshotMetrics | None] | None:
        """Run ``job`` in the background; ``None`` if one for that store is still running."""
        key = (job.operator, job.partition)
        with self._pool_lock:
            running = self._running.get(key)
            if running is not None and not running.done():
                return None
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="statekeeper-snapshot")
            future = self._pool.submit(self._run_logged, job)
            self._running[key] = future
        return future

    def wait(self) -> None:
        """Block until every scheduled snapshot has finished."""
        with self._pool_lock:
            futures = list(self._running.values())
        for future in futures:
            future.exception()

    def close(self) -> None:
        """Finish scheduled snapshots and stop the background thread."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _run_logged(self, job: SnapshotJob) -> SnapshotMetrics | None:
        try:
            metrics = self.run(job)
            write_metrics_quietly(self._blobs, job.operator, job.partition, job.metrics)
            if metrics is not None and self.after_upload is not None:
                self.after_upload(job.operator, job.partition)
            return metrics
        except Exception:
            # A failed background snapshot loses nothing: the changelogs still hold every
            # version. It is retried at the next interval.
            _log.exception("background snapshot of %s/%s failed", job.operator, job.partition)
            raise

    def run(self, job: SnapshotJob, *, dirty_ok: bool = False) -> SnapshotMetrics | None:
        """Checkpoint (if not done yet) and upload; ``None`` if skipped.

        Skipped when the copy was closed before its checkpoint, or when another writer
        already holds a snapshot of that version.

        Raises:
            StateKeeperError: the upload failed (storage, corrupt previous index, ...).
        """
        taken = job.ensure_checkpoint()
        if taken is None:
            return None
        path, version = taken
        key = (job.operator, job.partition)
        with self._pool_lock:
            self._uploading[key] = self._uploading.get(key, 0) + 1
        try:
            return self._upload(job, path, version)
        except CommitConflictError:
            if not dirty_ok:
                _log.info("snapshot %s/%s@%s exists already", job.operator, job.partition, version)
                return None
            raise
        finally:
            with self._pool_lock:
                self._uploading[key] -= 1
            release_checkpoint(path)

    def _upload(self, job: SnapshotJob, path: Path, version: int) -> SnapshotMetrics:
        previous, trust = self._previous(job, version)
        index, metrics = upload_snapshot(
            self._blobs,
            path,
            operator=job.operator,
            partition=job.partition,
            version=version,
            previous=previous,
            trust_names=trust,
            chunk_size=self._config.chunk_size,
            io_threads=self._config.io_threads,
        )
        job.copy.set_lineage(index.checkpoint_id, version)
        return metrics

    def _previous(self, job: SnapshotJob, version: int) -> tuple[SnapshotIndex | None, bool]:
        """The index to diff against, and whether its file names can be trusted.

        Only the newest snapshot below ``version`` is diffed against: garbage collection
        always keeps it and its files, so the new index never references a deleted blob.
        Its names are trusted only if the copy itself descends from it; any other
        snapshot (say, written by another host) is diffed by name, size and checksum.
        """
        older = [
            v
            for meta in self._blobs.list(layout.snapshot_prefix(job.operator, job.partition))
            if (v := layout.parse_snapshot_key(meta.key)) is not None and v < version
        ]
        if not older:
            return None, False
        try:
            index = load_index(self._blobs, job.operator, job.partition, max(older))
        except StateNotFoundError:
            return None, False  # deleted since the listing: upload everything
        lineage = job.copy.lineage
        return index, lineage is not None and lineage[0] == index.checkpoint_id


def remove_stale_checkpoints(copy_path: str) -> None:
    """Delete checkpoint folders a crashed run left beside a working copy.

    Folders of uploads still running in this process are kept.
    """
    folder = Path(f"{copy_path}.checkpoints")
    if not folder.is_dir():
        return
    for child in folder.iterdir():
        with _active_lock:
            if child in _active:
                continue
        shutil.rmtree(child, ignore_errors=True)


def write_metrics_quietly(
    blobs: BlobStore, operator: str, partition: int, metrics: list[CommitMetrics]
) -> None:
    """Write commit metrics if there are any; failures are logged, never raised."""
    if not metrics:
        return
    try:
        write_commit_metrics(blobs, operator, partition, metrics)
    except StateKeeperError as exc:  # a re-run's duplicate, or storage trouble: only metrics
        _log.info("commit metrics of %s/%s not written: %s", operator, partition, exc)


def release_checkpoint(path: Path) -> None:
    """Delete a checkpoint folder once its upload is over."""
    shutil.rmtree(path, ignore_errors=True)
    with _active_lock:
        _active.discard(path)
