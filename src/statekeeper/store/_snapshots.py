"""Snapshots of working copies: taken now, or in the background off the commit path.

A snapshot is a RocksDB checkpoint (hard links, so it is cheap and immune to later
compactions) of the working copy, uploaded incrementally against the previous snapshot's
index (``statekeeper.snapshot``). The checkpoint is created under the working copy's lock, so
it holds exactly one labelled, committed version; the upload then runs from the checkpoint
directory without touching the live database.
"""

from __future__ import annotations

import functools
import logging
import shutil
import threading
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from statekeeper import layout, phases
from statekeeper.clock import latest_now
from statekeeper.config import StoreConfig
from statekeeper.errors import (
    CorruptStateError,
    StateKeeperError,
    StateNotFoundError,
)
from statekeeper.gc import resumable_age_s
from statekeeper.manifest import (
    LEGACY_ATTEMPT,
    SnapshotEntry,
)
from statekeeper.metrics import CommitMetrics, write_commit_metrics
from statekeeper.snapshot import (
    ResumePolicy,
    SnapshotIndex,
    SnapshotMetrics,
    load_index,
    upload_snapshot,
)
from statekeeper.storage import BlobStore, thread_pool
from statekeeper.store._commit_point import CommitPoint
from statekeeper.store._label import parse_label
from statekeeper.store._rocks import damaged_tables, read_checkpoint
from statekeeper.store._working_copy import (
    LABEL_KEY,
    DamagedCopyError,
    WorkingCopy,
    upload_journal_path,
)

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
    """One snapshot of one working copy: checkpoint once, upload, register in the manifest.

    The checkpoint is taken by whoever gets there first: the background thread, or the
    store's ``close`` (which must not release the database before it exists).

    Args:
        copy: the working copy.
        operator, partition: its store.
        root_id: the root's id (manifests are checked against it).
        point: the store's commit point: the previous snapshot is taken from the manifest
            it knows (a background job reads the newest one first), and the snapshot is
            registered through it.
        register: whether the job registers the snapshot in a new manifest (a background
            snapshot); a snapshot-mode commit publishes its own entry instead.
    """

    def __init__(
        self,
        copy: WorkingCopy,
        operator: str,
        partition: int,
        *,
        root_id: str,
        point: CommitPoint,
        register: bool = True,
    ) -> None:
        self.copy = copy
        self.operator = operator
        self.partition = partition
        self.root_id = root_id
        self.point = point
        self.register = register
        self.index_key = ""
        """Where the index was (or will be) written; set by the upload."""
        self.reused: str | None = None
        """The index of the snapshot whose file blobs the upload reused, if it reused any;
        set by the upload."""
        self._lock = threading.Lock()
        self._taken = False
        self._checkpoint: tuple[Path, int, str] | None = None
        self._metrics: list[CommitMetrics] | None = []
        """Commit metrics to write once the upload is done (off the commit path); ``None``
        once written."""

    def give_metrics(self, metrics: list[CommitMetrics]) -> bool:
        """Hand commit metrics over, to be written when the job ends (with or without its
        snapshot); False if it has written its metrics already: the caller keeps them."""
        with self._lock:
            if self._metrics is None:
                return False
            self._metrics.extend(metrics)
            return True

    def take_metrics(self) -> list[CommitMetrics]:
        """The metrics handed over so far; any handed over later are refused."""
        with self._lock:
            metrics, self._metrics = self._metrics or [], None
            return metrics

    def ensure_checkpoint(self) -> tuple[Path, int, str] | None:
        """Create the checkpoint if nobody did yet; ``None`` if the copy was already closed."""
        with self._lock:
            if not self._taken:
                self._taken = True
                path = Path(f"{self.copy.path}.checkpoints") / uuid.uuid4().hex
                path.parent.mkdir(parents=True, exist_ok=True)
                with _active_lock:
                    _active.add(path)
                try:
                    checkpoint = self.copy.checkpoint(str(path), dirty_ok=not self.register)
                    self._checkpoint = (path, *checkpoint)
                except DamagedCopyError as exc:
                    # Every later checkpoint of this copy would fail too (files of it were
                    # deleted, say): without a rebuild no snapshot is ever taken again.
                    release_checkpoint(path)
                    self.copy.report_damage(exc)
                    _log.warning(
                        "snapshot of %s/%s skipped, the copy is rebuilt: %s",
                        self.operator, self.partition, exc,
                    )  # fmt: skip
                except StateKeeperError as exc:
                    release_checkpoint(path)
                    _log.info("snapshot of %s/%s skipped: %s", self.operator, self.partition, exc)
            return self._checkpoint


class Snapshotter:
    """Uploads snapshots for one backend, synchronously or on a background thread.

    Background snapshots run one at a time, in the order scheduled, except that a store
    waited for (:meth:`wait` of one store: a store being handed over to another process
    must keep its checkpoint until its upload is done) moves its queued snapshot to the
    front, so its wait is the upload running now and its own, not every snapshot scheduled
    before it. Nothing is ever dropped from the queue.
    """

    def __init__(self, blobs: BlobStore, config: StoreConfig) -> None:
        self._blobs = blobs
        self._config = config
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._running: dict[tuple[str, int], Future[SnapshotMetrics | None]] = {}
        # Scheduled and not started, next first: each holds its own future, and the pool
        # runs one _run_next per job, whichever job is first by then.
        self._queue: deque[tuple[SnapshotJob, Future[SnapshotMetrics | None]]] = deque()
        self._uploading: dict[tuple[str, int], int] = {}
        self.after_upload: Callable[[str, int], None] | None = None
        """Called (on the background thread) after each background snapshot upload."""

    def uploading(self) -> frozenset[tuple[str, int]]:
        """Stores with a snapshot upload in flight in this process (for GC)."""
        with self._pool_lock:
            return frozenset(k for k, n in self._uploading.items() if n)

    def schedule(self, job: SnapshotJob) -> Future[SnapshotMetrics | None] | None:
        """Run ``job`` in the background; ``None`` if one for that store is still running.

        Once Python's exit has begun, its pools take no new work: the pool
        (:func:`~statekeeper.storage.thread_pool`) then runs the front job here, now. A
        thread that commits after the main thread returned keeps its snapshots (and its
        changelog chain bounded) that way, at the price of commits that wait for them.
        """
        key = (job.operator, job.partition)
        future: Future[SnapshotMetrics | None] = Future()
        with self._pool_lock:
            running = self._running.get(key)
            if running is not None and not running.done():
                return None
            if self._pool is None:
                self._pool = thread_pool(1, "statekeeper-snapshot")
            pool = self._pool
            self._queue.append((job, future))
            self._running[key] = future
        # One call per job queued, whichever job is first by then; submitted without the
        # lock, which the call takes (and takes here, at Python's exit).
        with phases.phase("snapshot"):  # in the commit's breakdown, as in snapshot mode
            pool.submit(self._run_next)
        return future

    def wait(self, store: tuple[str, int] | None = None) -> None:
        """Block until every scheduled snapshot has finished, or only that of ``store``
        (operator, partition), whose snapshot, if still queued, is run next."""
        with self._pool_lock:
            futures = [f for k, f in self._running.items() if store is None or k == store]
            if store is not None:
                self._run_first(store)
        for future in futures:
            future.exception()

    def _run_first(self, store: tuple[str, int]) -> None:
        """Move ``store``'s queued snapshot, if any, to the front of the queue (the pool's
        lock held)."""
        for i, (job, future) in enumerate(self._queue):
            if (job.operator, job.partition) == store:
                if i:
                    del self._queue[i]
                    self._queue.appendleft((job, future))
                return

    def _run_next(self) -> None:
        """Run the job at the front of the queue (the pool runs one call per job)."""
        with self._pool_lock:
            job, future = self._queue.popleft()
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = self._run_logged(job)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter, as an executor does
            future.set_exception(exc)
        else:
            future.set_result(result)

    def close(self) -> None:
        """Finish scheduled snapshots and stop the background thread."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _run_logged(self, job: SnapshotJob) -> SnapshotMetrics | None:
        try:
            try:
                metrics = self.run(job)
            finally:  # a failed snapshot loses no commit metrics either
                write_metrics_quietly(self._blobs, job.operator, job.partition, job.take_metrics())
            if metrics is not None and self.after_upload is not None:
                self.after_upload(job.operator, job.partition)
            return metrics
        except Exception:
            # A failed background snapshot loses nothing: the changelogs still hold every
            # version. It is retried at the next interval.
            _log.exception("background snapshot of %s/%s failed", job.operator, job.partition)
            raise

    def run(self, job: SnapshotJob) -> SnapshotMetrics | None:
        """Checkpoint (if not done yet), upload, and register; ``None`` if skipped.

        Skipped when the copy was closed before its checkpoint, or was in the middle of a
        commit (a registering job never checks out a dirty copy), or when the store already
        has a snapshot of that version.

        Raises:
            StateKeeperError: the upload or the registration failed.
        """
        taken = job.ensure_checkpoint()
        if taken is None:
            return None
        path, version, attempt = taken
        key = (job.operator, job.partition)
        with self._pool_lock:
            self._uploading[key] = self._uploading.get(key, 0) + 1
        try:
            # A background job diffs against, and registers on, the newest manifest.
            if job.register and any(s.version == version for s in job.point.refresh().snapshots):
                _log.info("snapshot %s/%s@%s exists already", *key, version)
                return None
            metrics = self._upload(job, path, version, attempt)
            if job.register:
                self._register(job, SnapshotEntry(version, attempt, job.index_key))
            return metrics
        finally:
            with self._pool_lock:
                self._uploading[key] -= 1
            release_checkpoint(path)

    def _register(self, job: SnapshotJob, entry: SnapshotEntry) -> None:
        """Name the uploaded snapshot in a new manifest, if its content is still that
        version's (a re-run may have replaced it meanwhile: the index is then an orphan) and
        the snapshot it reused files of is still named (else GC may have deleted them)."""
        if not job.point.register_snapshot(entry, reused=job.reused):
            _log.info(
                "snapshot %s not registered: version %s of %s/%s is no longer attempt %s "
                "(or not retained, or registered already), or the snapshot %s it reused "
                "files of is no longer named",
                entry.index_blob, entry.version, job.operator, job.partition, entry.attempt,
                job.reused,
            )  # fmt: skip

    def _upload(self, job: SnapshotJob, path: Path, version: int, attempt: str) -> SnapshotMetrics:
        previous, previous_key, trust, unusable = self._previous(job, version)
        _check_checkpoint(job.copy, path, version, attempt)
        job.index_key = layout.attempt_snapshot_key(
            job.operator, job.partition, version, uuid.uuid4().hex
        )
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
            index_key=job.index_key,
            previous_key=previous_key,
            # The empty store (version 0) has no attempt to name: a schema-1 index.
            root_id=job.root_id if attempt else None,
            attempt=attempt or None,
            resume=ResumePolicy(
                upload_journal_path(job.copy.path),
                resumable_age_s(self._config),
                lambda: latest_now(self._blobs),
            ),
            check_added=functools.partial(_check_tables, job.copy),
        )
        job.copy.set_lineage(index.checkpoint_id, version)
        job.reused = previous_key if metrics.files_reused else None
        return metrics if unusable is None else replace(metrics, full_upload_reason=unusable)

    def _previous(
        self, job: SnapshotJob, version: int
    ) -> tuple[SnapshotIndex | None, str | None, bool, str | None]:
        """The index to diff against, its key, whether its file names can be trusted, and
        why a previous snapshot is unusable (then the upload is a full one).

        The newest registered snapshot below ``version`` (in the manifest the store knows)
        is diffed against; garbage collection keeps its files while the store's manifest
        names it, registered or retired, the upload checks that every reused blob still
        exists before writing its index, and the registration that the newest manifest
        still names it. Its names are
        trusted only if the copy itself descends from it; any other snapshot (say, written
        by another host) is diffed by name, size and checksum. An unreadable previous index
        means a full upload, never a failed snapshot.
        """
        older = [s for s in job.point.manifest.snapshots if s.version < version]
        if not older:
            return None, None, False, None
        newest = older[-1]
        try:
            index = load_index(
                self._blobs, job.operator, job.partition, newest.version, key=newest.index_blob,
                root_id=job.root_id if newest.attempt else None, attempt=newest.attempt or None,
                anonymous_ok=newest.attempt in (LEGACY_ATTEMPT, ""),
            )  # fmt: skip
        except (StateNotFoundError, CorruptStateError) as exc:
            _log.warning(
                "snapshot of %s/%s@%s uploads in full: its previous snapshot is unusable: %s",
                job.operator, job.partition, version, exc,
            )  # fmt: skip
            return None, None, False, f"previous snapshot {newest.index_blob} is unusable: {exc}"
        lineage = job.copy.lineage
        trusted = lineage is not None and lineage[0] == index.checkpoint_id
        return index, newest.index_blob, trusted, None


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


def _check_tables(copy: WorkingCopy, added: list[Path]) -> None:
    """Refuse to upload SST files that RocksDB cannot read whole: damage on the local disk
    that no read met yet would otherwise become the snapshot's (see
    :func:`statekeeper.store._rocks.damaged_tables`). The copy is reported damaged, so
    the store rebuilds it from the blob store.

    Raises:
        DamagedCopyError: a file is damaged.
        StateKeeperError: the check failed.
    """
    with phases.phase("verify"):
        bad = damaged_tables([path for path in added if path.suffix == ".sst"])
    if bad:
        _refuse_upload(
            copy,
            f"its SST files {', '.join(bad)} fail their checksums (found before a snapshot "
            "would have uploaded them)",
        )


def _check_checkpoint(copy: WorkingCopy, path: Path, version: int, attempt: str) -> None:
    """Refuse to upload a checkpoint that does not open as the database of ``version``
    (``attempt``): files of another database at the copy's path (its folder replaced under
    the live store by a cleaner of temporary files, say) make a snapshot whose every file
    passes its own checksum, which no restore can open, and which GC could take as the
    base of the versions it keeps. The copy is reported damaged, so the store rebuilds it.

    Raises:
        DamagedCopyError: the checkpoint does not open, or holds another version.
    """
    with phases.phase("verify"):
        try:
            raw = read_checkpoint(path, LABEL_KEY)
            label = None if raw is None else parse_label(raw)[0]
            held = (0, "") if label is None else (label.version, label.attempt)  # empty
            problem = (
                None
                if held == (version, attempt)
                else f"it holds version {held[0]} attempt {held[1]!r}, not version "
                f"{version} attempt {attempt!r}"
            )
        except (StateKeeperError, ValueError) as exc:
            problem = str(exc)
    if problem is not None:
        _refuse_upload(copy, f"a checkpoint of it is not the database it was taken of: {problem}")


def _refuse_upload(copy: WorkingCopy, why: str) -> NoReturn:
    """Report ``copy`` damaged (``why``), so the store rebuilds it, and fail the snapshot.

    Raises:
        DamagedCopyError: always.
    """
    damage = DamagedCopyError(copy.path, CorruptStateError(why))
    copy.report_damage(damage)
    raise damage


def release_checkpoint(path: Path) -> None:
    """Delete a checkpoint folder once its upload is over."""
    shutil.rmtree(path, ignore_errors=True)
    with _active_lock:
        _active.discard(path)
