"""Incremental snapshot upload (Samza style) and index loading.

Only what the diff marks as added is uploaded, in ``chunk_size`` chunks, each a separate
create-only blob with a fresh id, ``io_threads`` at a time; the index blob is written last,
create-only, so a snapshot exists iff its index does and the index only names blobs that
were completely written before it (ARCHITECTURE §5.1). A file an earlier, cut-off upload of
the same working copy finished is named from its journal instead of being uploaded again
(:mod:`statekeeper.snapshot._resume`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import google_crc32c

from statekeeper import layout
from statekeeper.errors import CommitConflictError, StateNotFoundError
from statekeeper.snapshot._diff import DirDiff, diff_dir
from statekeeper.snapshot._files import open_no_follow
from statekeeper.snapshot._index import (
    DirIndex,
    FileBlob,
    FileIndex,
    SnapshotIndex,
    SnapshotMetadata,
    check_metadata,
    rebased,
)
from statekeeper.snapshot._resume import ResumePolicy, UploadJournal, check_resumed
from statekeeper.storage import BlobMeta, transfer_pool

if TYPE_CHECKING:
    from statekeeper.storage import BlobStore

__all__ = ["SnapshotMetrics", "check_transfer_args", "load_index", "upload_snapshot"]

_log = logging.getLogger("statekeeper.snapshot")


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotMetrics:
    """What one snapshot upload did.

    Attributes:
        files_uploaded: files uploaded (added or changed since the previous snapshot).
        bytes_uploaded: their total size (the index blob not included).
        files_reused: files whose previous blobs the new index references.
        bytes_reused: their total size.
        files_removed: files of the previous snapshot that no longer exist.
        duration_s: wall time of the whole upload.
        index_blob: key of the index blob written.
        full_upload_reason: why nothing was diffed against the previous snapshot although
            there is one (its index is corrupt or missing); ``None`` otherwise.
        files_resumed: added files not uploaded again: an earlier, unfinished upload of
            the same copy had uploaded them (see :mod:`statekeeper.snapshot._resume`).
        bytes_resumed: their total size.
    """

    files_uploaded: int
    bytes_uploaded: int
    files_reused: int
    bytes_reused: int
    files_removed: int
    duration_s: float
    index_blob: str
    full_upload_reason: str | None = None
    files_resumed: int = 0
    bytes_resumed: int = 0


def check_transfer_args(*, io_threads: int, chunk_size: int = 1) -> None:
    """Refuse a non-positive ``io_threads`` or ``chunk_size``.

    Raises:
        ValueError: either is not an int >= 1.
    """
    for name, value in (("io_threads", io_threads), ("chunk_size", chunk_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def upload_snapshot(
    blobs: BlobStore,
    checkpoint_dir: Path,
    *,
    operator: str,
    partition: int,
    version: int,
    previous: SnapshotIndex | None,
    trust_names: bool,
    chunk_size: int,
    io_threads: int,
    checkpoint_id: str | None = None,
    index_key: str | None = None,
    previous_key: str | None = None,
    root_id: str | None = None,
    attempt: str | None = None,
    parent: bool = False,
    resume: ResumePolicy | None = None,
    check_added: Callable[[list[Path]], None] | None = None,
) -> tuple[SnapshotIndex, SnapshotMetrics]:
    """Upload a RocksDB checkpoint directory as the snapshot of ``version``, incrementally.

    Files are diffed against ``previous`` (see :func:`diff_dir`); added files are uploaded
    chunked, with at most about ``io_threads * chunk_size`` bytes in memory, their CRC32C
    computed while reading; retained files reference the previous blobs. The index's
    ``filesRemoved`` lists every previous file whose blobs it no longer references (deleted
    or uploaded again). The index blob is written last and create-only. On failure, chunk
    blobs already written stay behind unreferenced, for GC to sweep after its grace period.

    Args:
        blobs: the checkpoint root's store.
        checkpoint_dir: a RocksDB checkpoint that nobody modifies during the upload.
        operator, partition, version: the store and the version the checkpoint holds.
        previous: the index of the store's previous snapshot (lower version), or ``None``.
        trust_names: whether ``checkpoint_dir`` descends from ``previous`` (see
            :func:`diff_dir`).
        chunk_size: maximum bytes per file blob.
        io_threads: parallel uploads.
        checkpoint_id: id recorded in the index; a fresh uuid hex by default.
        index_key: where to write the index (format 2: a name unique to the upload);
            format 1's name for ``version`` by default.
        previous_key: the key ``previous`` was read from (format 1's name by default).
        root_id, attempt: the root and the attempt whose content ``version`` is, recorded
            in the index's metadata (schema 2) so that every reader can check them; both or
            neither (a schema-1 index, as statekeeper 0.1 wrote).
        parent: ``previous`` is a snapshot of another store (at or below ``version``) that
            ``checkpoint_dir`` was made from by a rescale: retained files keep naming that
            store's blobs (schema 3, see :func:`rebased`) and the new index starts no
            ``prevSnapshotIndexBlobId`` chain.
        resume: the copy's upload journal: files an earlier upload of it finished are not
            uploaded again, and the files this one finishes are noted (see
            :mod:`statekeeper.snapshot._resume`); ``None``: neither.
        check_added: called with the files the upload would add, before any is uploaded;
            it raises if one must not be (a damaged file: the store checks SST files, see
            :func:`statekeeper.store._rocks.damaged_tables`).

    Just before the index is written, every blob it reuses from ``previous`` is checked to
    still exist (one listing of the store's files); if garbage collection removed one
    meanwhile, the snapshot is uploaded again in full, so a published index never names a
    deleted blob it reused (ARCHITECTURE invariant 5). The same listing checks the blobs
    taken from the journal (present, of their size, and young enough); a file failing that
    is uploaded again.

    Returns:
        The index written and the upload's metrics.

    Raises:
        CommitConflictError: an index for ``version`` already exists.
        ValueError: bad arguments, ``previous`` is of another store or not older, or the
            directory holds something a snapshot cannot (see :func:`diff_dir`).
        StorageError: the blob store failed a write.
        OSError: the directory cannot be read.
    """
    started = time.monotonic()
    key = index_key or layout.snapshot_index_key(operator, partition, version)
    check_transfer_args(io_threads=io_threads, chunk_size=chunk_size)
    start: DirIndex | None = None
    if parent and previous is not None:
        held = (previous.metadata.operator, previous.metadata.partition)
        if previous.metadata.version > version:
            raise ValueError(
                f"a parent snapshot must be at or below version {version}, got "
                f"{held[0]}/{held[1]} version {previous.metadata.version}"
            )
        start = rebased(previous.dir_index, held, (operator, partition))
    else:
        _check_previous(previous, operator, partition, version)
        start = previous.dir_index if previous else None
    _refuse_existing(blobs, key, version)
    with contextlib.ExitStack() as stack:
        journal = (
            None
            if resume is None or resume.max_age_s <= 0
            else stack.enter_context(UploadJournal.take(resume.journal))
        )
        job = _Upload(blobs, operator, partition, chunk_size, io_threads, journal, resume)
        diff = diff_dir(checkpoint_dir, start, trust_names=trust_names)
        if check_added is not None:
            check_added([path for _, path in diff.iter_added()])
        uploaded, resumed = job.upload(diff)
        if previous is not None and job.reused_missing(diff):
            _log.warning(
                "snapshot %s: blobs it would reuse from %s were deleted meanwhile (gc); "
                "uploading it in full", key, previous_key,
            )  # fmt: skip
            # What this upload finished is in the journal: the full upload takes it again.
            previous = None
            diff = diff_dir(checkpoint_dir, None, trust_names=False)
            if check_added is not None:
                check_added([path for _, path in diff.iter_added()])
            uploaded, resumed = job.upload(diff)
        index = SnapshotIndex(
            checkpoint_id=checkpoint_id if checkpoint_id is not None else uuid.uuid4().hex,
            created_time_ms=time.time_ns() // 1_000_000,
            metadata=SnapshotMetadata(
                operator=operator,
                partition=partition,
                version=version,
                root_id=root_id,
                attempt=attempt,
            ),
            dir_index=_new_dir_index(diff, uploaded, ""),
            prev_snapshot_index_blob_id=(
                (
                    previous_key
                    or layout.snapshot_index_key(operator, partition, previous.metadata.version)
                )
                if previous is not None and not parent
                else None
            ),
        )
        if journal is not None:
            journal.clear()  # no line may name a blob an index names
        try:
            blobs.put(key, index.to_json())
        except CommitConflictError as exc:
            raise _conflict(key, version) from exc
    fresh = [f for rel, f in uploaded.items() if rel not in resumed]
    metrics = SnapshotMetrics(
        files_uploaded=len(fresh),
        bytes_uploaded=sum(f.size_in_bytes for f in fresh),
        files_reused=sum(1 for _ in diff.iter_retained()),
        bytes_reused=diff.bytes_retained,
        files_removed=sum(1 for _ in diff.iter_removed()),
        duration_s=time.monotonic() - started,
        index_blob=key,
        files_resumed=len(resumed),
        bytes_resumed=sum(uploaded[rel].size_in_bytes for rel in resumed),
    )
    _log.info(
        "snapshot %s: uploaded %d files (%d bytes), resumed %d files (%d bytes), reused %d "
        "files (%d bytes), removed %d files, in %.3f s",
        key, metrics.files_uploaded, metrics.bytes_uploaded, metrics.files_resumed,
        metrics.bytes_resumed, metrics.files_reused, metrics.bytes_reused,
        metrics.files_removed, metrics.duration_s,
    )  # fmt: skip
    return index, metrics


class _Upload:
    """Uploads the added files of a diff, taking what the journal has, and lists the blobs
    that the index will reuse or resume, just before it is written."""

    def __init__(
        self,
        blobs: BlobStore,
        operator: str,
        partition: int,
        chunk_size: int,
        io_threads: int,
        journal: UploadJournal | None,
        resume: ResumePolicy | None,
    ) -> None:
        self._blobs = blobs
        self._operator = operator
        self._partition = partition
        self._chunk_size = chunk_size
        self._io_threads = io_threads
        self._journal = journal
        self._resume = resume
        self._listing: dict[tuple[str, int], dict[str, BlobMeta]] = {}

    def _key_of(self, blob_id: str) -> str:
        return layout.file_blob_key(self._operator, self._partition, blob_id)

    def upload(self, diff: DirDiff) -> tuple[dict[str, FileIndex], set[str]]:
        """Every added file's entry by relative path, and which of them were resumed."""
        added = list(diff.iter_added())
        resumed: dict[str, FileIndex] = {}
        if self._journal is not None and self._journal.load():
            for rel, path in added:
                if (entry := self._journal.match(rel, path)) is not None:
                    resumed[rel] = entry
        uploaded = self._upload([(rel, p) for rel, p in added if rel not in resumed])
        if resumed and self._resume is not None:
            present = self.listing(self._operator, self._partition, fresh=True)
            now = self._resume.now()
            bad = set(check_resumed(resumed, present, now, self._resume.max_age_s))
            if bad:
                _log.info(
                    "%d files of an unfinished upload are gone or too old to name: "
                    "uploading them again", len(bad),
                )  # fmt: skip
                uploaded.update(self._upload([(rel, p) for rel, p in added if rel in bad]))
            for rel in bad:
                del resumed[rel]
            uploaded.update(resumed)
        return uploaded, set(resumed)

    def reused_missing(self, diff: DirDiff) -> bool:
        """Whether a blob the diff reuses is no longer in the store that holds it."""
        reused: dict[tuple[str, int], set[str]] = {}
        for f in diff.iter_retained():
            for b in f.blobs:
                reused.setdefault(b.store or (self._operator, self._partition), set()).add(
                    b.blob_id
                )
        return any(not ids <= self.listing(*owner).keys() for owner, ids in reused.items())

    def listing(self, operator: str, partition: int, *, fresh: bool = False) -> dict[str, BlobMeta]:
        """The blobs of a store's ``files/`` by id: listed once per upload (or now, with
        ``fresh``)."""
        owner = (operator, partition)
        if fresh or owner not in self._listing:
            self._listing[owner] = {
                m.key.rsplit("/", 1)[-1]: m
                for m in self._blobs.list(layout.files_prefix(operator, partition))
            }
        return self._listing[owner]

    def _upload(self, files: list[tuple[str, Path]]) -> dict[str, FileIndex]:
        """Upload ``files`` (relative path, path); returns their entries by relative path."""
        return _upload_added(
            self._blobs, files, self._key_of, chunk_size=self._chunk_size,
            io_threads=self._io_threads, journal=self._journal,
        )  # fmt: skip


def load_index(
    blobs: BlobStore,
    operator: str,
    partition: int,
    version: int,
    *,
    key: str | None = None,
    root_id: str | None = None,
    attempt: str | None = None,
    anonymous_ok: bool = False,
) -> SnapshotIndex:
    """Fetch and validate the snapshot index of ``version`` (at ``key``, format 2; at
    format 1's name by default), and check that it is what its name says
    (:func:`check_metadata`): of that store and version and, when given, of root ``root_id``
    and attempt ``attempt``. A schema-1 index (no root, no attempt) passes those two only
    with ``anonymous_ok`` (the reader expects a snapshot of statekeeper 0.1).

    Raises:
        StateNotFoundError: no snapshot of ``version`` exists; the message names the blob.
        CorruptStateError: the blob is not a valid index of that store and version (or
            root and attempt), naming what was expected and what it says.
        StorageError: the blob store failed the read.
    """
    key = key or layout.snapshot_index_key(operator, partition, version)
    try:
        data = blobs.get(key)
    except StateNotFoundError as exc:
        raise StateNotFoundError(
            f"snapshot index {key!r} not found: {operator}/{partition} has no snapshot of "
            f"version {version}"
        ) from exc
    index = SnapshotIndex.from_json(data, blob=key)
    expected = SnapshotMetadata(
        operator=operator, partition=partition, version=version, root_id=root_id,
        attempt=attempt,
    )  # fmt: skip
    check_metadata(index, blob=key, expected=expected, anonymous_ok=anonymous_ok)
    return index


def _check_previous(
    previous: SnapshotIndex | None, operator: str, partition: int, version: int
) -> None:
    if previous is None:
        return
    meta = previous.metadata
    if (meta.operator, meta.partition) != (operator, partition) or meta.version >= version:
        # Retained files would name blobs under another store's prefix, or the
        # prevSnapshotIndexBlobId chain would not go back in time.
        raise ValueError(
            f"previous snapshot must be of {operator}/{partition} below version {version}, "
            f"got {meta.operator}/{meta.partition} version {meta.version}"
        )


def _conflict(key: str, version: int) -> CommitConflictError:
    return CommitConflictError(
        f"snapshot index {key!r} already exists: version {version} was already snapshotted"
    )


def _refuse_existing(blobs: BlobStore, key: str, version: int) -> None:
    # Only saves a useless upload (a retried batch re-snapshotting a committed version); the
    # create-only write of the index is what actually guarantees a single winner.
    try:
        blobs.head(key)
    except StateNotFoundError:
        return
    raise _conflict(key, version)


class _Window:
    """Runs transfers on a pool with at most ``limit`` in flight, raising the first failure."""

    def __init__(self, pool: Executor, limit: int) -> None:
        self._pool = pool
        self._limit = limit
        self._pending: set[Future[None]] = set()

    def submit(self, fn: Callable[[str, bytes], None], key: str, data: bytes) -> Future[None]:
        while len(self._pending) >= self._limit:
            self._settle()
        future = self._pool.submit(fn, key, data)
        self._pending.add(future)
        return future

    def drain(self) -> None:
        while self._pending:
            self._settle()

    def abandon(self) -> None:
        for future in self._pending:
            future.cancel()
        wait(self._pending)

    def _settle(self) -> None:
        done, self._pending = wait(self._pending, return_when=FIRST_COMPLETED)
        for future in done:
            future.result()


def _upload_added(
    blobs: BlobStore,
    files: list[tuple[str, Path]],
    key_of: Callable[[str], str],
    *,
    chunk_size: int,
    io_threads: int,
    journal: UploadJournal | None,
) -> dict[str, FileIndex]:
    """Upload ``files`` (relative path, path); returns their new entries by relative path.
    Each file is noted in ``journal`` once all its chunks are written, also when the upload
    fails later."""
    uploaded: dict[str, FileIndex] = {}
    unsure: list[tuple[str, Path, list[Future[None]]]] = []  # not noted in the journal yet

    def note_finished() -> None:
        if journal is None:
            return
        for item in list(unsure):
            rel, path, chunks = item
            if all(c.done() for c in chunks):
                unsure.remove(item)
                if not any(c.cancelled() or c.exception() is not None for c in chunks):
                    journal.record(rel, path, uploaded[rel])

    with transfer_pool(io_threads, "statekeeper-upload") as pool:
        window = _Window(pool, io_threads)
        try:
            for rel, path in files:
                uploaded[rel], chunks = _upload_file(blobs, window, path, key_of, chunk_size)
                unsure.append((rel, path, chunks))
                note_finished()
            window.drain()
        except BaseException:
            window.abandon()
            note_finished()
            raise
        note_finished()
    return uploaded


def _upload_file(
    blobs: BlobStore,
    window: _Window,
    path: Path,
    key_of: Callable[[str], str],
    chunk_size: int,
) -> tuple[FileIndex, list[Future[None]]]:
    crc = 0
    size = 0
    chunks: list[FileBlob] = []
    writes: list[Future[None]] = []
    with os.fdopen(open_no_follow(path), "rb") as f:
        st = os.fstat(f.fileno())
        # Reading one chunk at a time and handing it to the window keeps memory bounded
        # whatever the file's size.
        while data := f.read(chunk_size):
            # A fresh id per chunk, never derived from the file name: a blob is written
            # once and never overwritten, even when RocksDB reuses a file name.
            blob_id = uuid.uuid4().hex
            writes.append(window.submit(blobs.put, key_of(blob_id), data))
            chunks.append(FileBlob(blob_id=blob_id, offset=size))
            crc = google_crc32c.extend(crc, data)
            size += len(data)
    entry = FileIndex(
        file_name=path.name,
        blobs=tuple(chunks),
        size_in_bytes=size,
        mtime_ms=st.st_mtime_ns // 1_000_000,
        ctime_ms=st.st_ctime_ns // 1_000_000,
        crc=crc,
        attribs=stat.S_IMODE(st.st_mode) & 0o777,
    )
    return entry, writes


def _new_dir_index(diff: DirDiff, uploaded: dict[str, FileIndex], prefix: str) -> DirIndex:
    def by_name(f: FileIndex) -> str:
        return f.file_name

    files = list(diff.files_retained) + [uploaded[prefix + p.name] for p in diff.files_added]
    subs = [
        _new_dir_index(sub, uploaded, f"{prefix}{sub.dir_name}/")
        for sub in diff.sub_dirs_added + diff.sub_dirs_retained
    ]
    return DirIndex(
        dir_name=diff.dir_name,
        files_present=tuple(sorted(files, key=by_name)),
        files_removed=tuple(sorted(diff.files_removed + diff.files_replaced, key=by_name)),
        sub_directories_present=tuple(sorted(subs, key=lambda d: d.dir_name)),
        sub_directories_removed=diff.sub_dirs_removed,
    )
