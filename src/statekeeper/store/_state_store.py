"""StateStore: one open, versioned key -> value map of bytes, and its commit state machine.

Uncommitted writes live in an in-memory overlay (:mod:`statekeeper.store._overlay`), so they
are invisible to every other reader, vanish on ``abort`` or a crash, and are seen by this
store's own reads and scans. ``commit`` uploads the attempt's changelog (or, in snapshot
mode, its snapshot) create-only under a name unique to the attempt, then writes the store's
next manifest naming it — the one commit point for both modes
(:mod:`statekeeper.store._commit_point`) — and only then applies the overlay to the working
copy in one write batch that also records the new version and attempt (invariants 1 and 3
of ARCHITECTURE §5). The store keeps the manifest it wrote, so a commit costs two
create-only puts and no read, unless another writer (a background snapshot, a re-run) wrote
a manifest since: then one listing and one read more, and the decision is taken again.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import TypeVar

from statekeeper import layout, phases
from statekeeper.changelog import ChangelogIdentity, ChangelogParts, Columns, encode_changelog_parts
from statekeeper.config import StoreConfig
from statekeeper.errors import CommitConflictError, OwnerConflictError, StateKeeperError
from statekeeper.manifest import PLAIN_ORDER, Order, StoreManifest
from statekeeper.metrics import CommitMetrics, from_commit
from statekeeper.snapshot import SnapshotMetrics
from statekeeper.storage import BlobStore, put_stream
from statekeeper.store._commit_point import CommitPoint, check_order, check_owner
from statekeeper.store._overlay import (
    SortedPending,
    as_columns,
    as_key,
    as_keys,
    as_value,
    merge,
    sorted_columns,
)
from statekeeper.store._snapshots import SnapshotJob, Snapshotter, write_metrics_quietly
from statekeeper.store._working_copy import DamagedCopyError, WorkingCopy

__all__ = ["CommitInfo", "RestoreInfo", "StateStore"]

_log = logging.getLogger("statekeeper.store")
_T = TypeVar("_T")


@dataclass(frozen=True)
class CommitInfo:
    """What one commit did."""

    operator: str
    partition: int
    version: int
    """The version this commit created."""
    puts: int
    deletes: int
    raw_bytes: int
    """Sum of key and value lengths of the changed records."""
    bytes_uploaded: int
    duration_s: float
    """Wall time of ``commit`` (the occasional write of buffered metrics excepted): what the
    commit metrics record as its latency."""
    blob: str
    """Key of the blob that commits the version: a changelog, or a snapshot index."""
    snapshot: bool = False
    """True if this commit is a snapshot (``mode="snapshot"``)."""
    snapshot_scheduled: bool = False
    """True if a background snapshot of this version was scheduled."""
    phases_ms: Mapping[str, float] = field(default_factory=dict)
    """Where ``duration_s`` went, in milliseconds, by phase: ``encode`` (sorting and
    framing the changes), ``compress``, ``checksum``, ``upload`` (blob-store writes of the
    changelog and the manifest, their fsyncs excluded), ``fsync`` (local root only),
    ``apply`` (the RocksDB write of the working copy: a one-part commit, nearly every
    commit, writes it on a helper thread after it returns, so this is the wait for the
    previous commit's write, if still running; a commit of several parts writes its own)
    and ``other`` (the rest), which add up to ``duration_s``; a snapshot-mode commit reports
    ``snapshot`` for its upload, a changelog-mode commit for scheduling a background one.
    Every ``metrics_every`` commits, ``metrics`` is the write of the buffered commit
    metrics, which follows the recorded duration (a commit cannot record its own
    recording)."""


@dataclass(frozen=True)
class RestoreInfo:
    """How ``open`` brought the working copy to the version asked for."""

    version: int
    base: int
    base_kind: str
    """``"local"`` (reused the working copy), ``"snapshot"`` (restored a snapshot,
    reusing identical local files) or ``"empty"`` (rebuilt from changelogs alone)."""
    changelogs_replayed: int
    bytes_downloaded: int
    duration_s: float
    files_downloaded: int = 0
    """Snapshot files downloaded."""
    files_reused: int = 0
    """Snapshot files already present locally with the same size and checksum."""
    bytes_reused: int = 0


class _State(enum.Enum):
    OPEN = "open"
    FAILED = "failed"
    CLOSED = "closed"


class StateStore:
    """The state of one (operator, partition) at one version, plus uncommitted writes.

    Not thread-safe: use one store from one thread at a time. Obtain it from
    :meth:`statekeeper.StateBackend.open`.
    """

    def __init__(
        self,
        *,
        blobs: BlobStore,
        config: StoreConfig,
        operator: str,
        partition: int,
        copy: WorkingCopy,
        root_id: str,
        restore_info: RestoreInfo,
        snapshotter: Snapshotter,
        manifest: StoreManifest,
        manifest_read_at: float | None = None,
        before_commit: Callable[[], object] | None = None,
        rebuild: Callable[[int], WorkingCopy] | None = None,
    ) -> None:
        self._blobs = blobs
        self._config = config
        self._operator = operator
        self._partition = partition
        self._copy = copy
        self._root_id = root_id
        self._version = restore_info.version
        self._pending: dict[bytes, bytes | None] = {}
        self._sorted = SortedPending()
        self._state = _State.OPEN
        self._snapshotter = snapshotter
        self._point = CommitPoint(
            blobs, config, root_id=root_id, operator=operator, partition=partition,
            manifest=manifest, read_at=manifest_read_at,
        )  # fmt: skip
        self._last_snapshot = max([manifest.base, *(s.version for s in manifest.snapshots)])
        self._attempt: str | None = None
        self._before_commit = before_commit
        self._rebuild = rebuild
        self._job: SnapshotJob | None = None
        self._metrics: list[CommitMetrics] = []
        self._behind: tuple[int, str] | None = None
        """Version and attempt the working copy is being written with after the commit."""
        self.restore_info = restore_info

    def __repr__(self) -> str:
        return (
            f"StateStore({self._operator!r}, partition={self._partition}, "
            f"version={self._version}, state={self._state.value})"
        )

    @property
    def operator(self) -> str:
        """The operator this store belongs to."""
        return self._operator

    @property
    def partition(self) -> int:
        """The partition this store belongs to."""
        return self._partition

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._state is _State.CLOSED

    @property
    def version(self) -> int:
        """The committed version loaded (advances by one on each successful commit)."""
        return self._version

    def ready(self) -> bool:
        """True if the store can be used now: it is open, and the last commit's write to
        the local working copy landed (waited for here). False if it is closed or failed; a
        write that failed fails the store now (logged with the error its next call would
        have raised): close it and open it again from the backend, which catches the copy
        up from the blob store. Never raises."""
        if self._state is not _State.OPEN:
            return False
        try:
            self._settle()
        except StateKeeperError as exc:
            _log.warning("%s", exc)
            return False
        return True

    # -- reads ----------------------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        """The value of ``key``, seeing this store's uncommitted writes.

        Raises:
            TypeError: ``key`` is not bytes.
            StateKeeperError: the store is closed or failed.
        """
        self._check_open()
        key = as_key(key)
        if key in self._pending:
            return self._pending[key]
        return self._read(lambda copy: copy.get(key))

    def multi_get(self, keys: Iterable[bytes]) -> list[bytes | None]:
        """Values of ``keys`` in order; those not written here are read from the working copy
        in one pass.

        Raises:
            TypeError: a key is not bytes.
            StateKeeperError: the store is closed or failed.
        """
        self._check_open()
        keys = as_keys(keys)
        pending = self._pending
        if not pending:
            return self._read(lambda copy: copy.multi_get(keys))
        missing = [k for k in keys if k not in pending]
        values = self._read(lambda copy: copy.multi_get(missing))
        found = dict(zip(missing, values, strict=True))
        return [pending[k] if k in pending else found[k] for k in keys]

    def scan(
        self, prefix: bytes = b"", *, start: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """Items whose key starts with ``prefix`` (and, with ``start``, is at or above it),
        sorted by key, seeing own writes. A scan with ``start`` seeks there: keys before it,
        live or deleted, cost nothing.

        Writes made while iterating may or may not be seen; do not commit while iterating.

        Raises:
            TypeError: ``prefix`` or ``start`` is not bytes.
            StateKeeperError: the store is closed or failed.
        """
        self._check_open()
        for name, arg in (("prefix", prefix), ("start", start)):
            if arg is not None and not isinstance(arg, bytes | bytearray | memoryview):
                raise TypeError(f"{name} must be bytes, got {type(arg).__name__}")
        prefix = bytes(prefix)
        start = None if start is None else bytes(start)
        self._settle()
        overlay = self._sorted.items(self._pending, prefix, start)
        return merge(self._scan_committed(prefix, start), overlay)

    def _read(self, read: Callable[[WorkingCopy], _T]) -> _T:
        """``read`` from the working copy; a damaged copy is rebuilt once, then read again."""
        self._settle()
        try:
            return read(self._copy)
        except DamagedCopyError as exc:
            self._replace_damaged_copy(exc)
        return read(self._copy)

    def _scan_committed(
        self, prefix: bytes, start: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """The working copy's items under ``prefix``; a scan that meets damage goes on
        after the last key it returned, in the rebuilt copy."""
        after: bytes | None = None
        rebuilt = False
        while True:
            try:
                for key, value in self._copy.scan(prefix, after=after, start=start):
                    after = key
                    yield key, value
                return
            except StateKeeperError as exc:
                if self._state is _State.CLOSED:
                    raise StateKeeperError(
                        f"{self!r} is closed: this scan of it cannot go on"
                    ) from exc
                if not isinstance(exc, DamagedCopyError):
                    raise
                if rebuilt:
                    raise
                self._replace_damaged_copy(exc)
                rebuilt = True

    def _replace_damaged_copy(self, exc: DamagedCopyError) -> None:
        """Set the damaged working copy aside and restore this store's version from the
        blob store into a new one; uncommitted writes are kept (they live in memory).

        Raises:
            StateKeeperError: the store cannot rebuild (it is then failed), or the rebuild
                failed.
        """
        try:
            if self._rebuild is None:
                raise exc
            self._copy.set_aside(exc)
            self._copy = self._rebuild(self._version)
        except BaseException:
            self._state = _State.FAILED
            raise

    # -- writes ---------------------------------------------------------------------------

    def put(self, key: bytes, value: bytes) -> None:
        """Set ``key`` to ``value`` (visible to this store now, to others after commit).

        Raises:
            TypeError: ``key`` or ``value`` is not bytes.
            ValueError: the key is empty or either is 2 GiB or larger.
            StateKeeperError: the store is closed or failed.
        """
        self._check_open()
        key = as_key(key)  # first: a put of a bad key and a bad value names the key
        self._pending[key] = as_value(value)
        # Changes after a failed commit make a new attempt: the failed one's blobs may
        # have landed, and must never be taken for these changes.
        self._attempt = None

    def put_many(
        self,
        items: Iterable[tuple[bytes, bytes]] | Iterable[bytes],
        values: Iterable[bytes] | None = None,
    ) -> None:
        """:meth:`put` every (key, value) pair of ``items``, in order; or, with ``values``,
        ``items`` are the keys and ``values`` their values (two columns of equal length, what
        a vectorized function has: no pair is built per key). The checks run once over all
        of them (no Python call per pair), so bulk writes cost what the dictionary costs.

        Raises:
            TypeError, ValueError: as :meth:`put`, for any pair, or ``values`` of another
                length than the keys (then nothing is put).
            StateKeeperError: the store is closed or failed.
        """
        self._check_open()
        keys, column = as_columns(items, values)
        if not keys:
            return
        self._pending.update(zip(keys, column, strict=True))
        self._attempt = None

    def delete(self, key: bytes) -> None:
        """Remove ``key`` (a no-op for a key that does not exist).

        Raises:
            TypeError: ``key`` is not bytes.
            StateKeeperError: the store is closed or failed.
        """
        self._check_open()
        self._pending[as_key(key)] = None
        self._attempt = None

    # -- lifecycle ------------------------------------------------------------------------

    def commit(self, *, order: Order | None = None, owner: str | None = None) -> CommitInfo:
        """Make the uncommitted writes durable as version ``self.version + 1``.

        The commit is an *attempt* of that version, of ``order`` (see
        :data:`statekeeper.manifest.Order`; the plain API's is ``(0, 0, 0, 0)``) and of
        ``owner`` (``None``: anyone's; the Spark layer passes its streaming query's id). An
        attempt of one owner never replaces, adopts or builds on a version of another. It
        replaces another attempt's ``version + 1`` if that one is older and nothing was
        built on it (a re-run of a batch); it is refused if an attempt of a newer order
        already wrote the store (this one is a zombie), if ``version + 1`` is final, if
        an attempt of the same order committed it with other content (one of the same
        content, a re-run, is accepted), or if another attempt replaced ``version`` since
        this store loaded it (its changes were made on other content: reopen the store).
        If the upload fails with a storage error nothing changes locally and, in changelog
        mode, ``commit`` may be called again (the same attempt, unless writes were made in
        between). :attr:`CommitInfo.phases_ms` says where the time went. Every
        ``snapshot_every`` versions a snapshot is scheduled in the background. In snapshot
        mode the commit is an incremental snapshot.

        A changelog-mode commit returns once the version is durable in the blob store; its
        write to the local working copy runs on a helper thread, and the store's next read,
        commit or close waits for it. Should that write fail (a full local disk), that next
        call raises the error and the store is failed: the version is committed all the
        same, and a reopened store catches up from the blob store.

        Raises:
            CommitConflictError: the commit was refused; the store is then failed and must
                be reopened.
            StorageError: the upload failed; in changelog mode the writes are kept and
                commit can be retried, in snapshot mode the store is failed. The manifest
                write may have landed all the same (a timeout after the store took it):
                then the version is committed, and a retry says so; an :meth:`abort`
                followed by other writes is refused (``CommitConflictError``) instead.
            StateKeeperError: the store is closed or failed, or the previous commit's write
                to the working copy failed (the store is then failed).
        """
        self._check_open()
        started = time.perf_counter_ns()
        order = PLAIN_ORDER if order is None else check_order(order)
        owner = "" if owner is None else check_owner(owner)
        with phases.measure() as spent:
            with phases.phase("apply"):
                self._settle()  # the previous commit's write to the working copy
            info = self._commit(order, owner, started)
            elapsed = time.perf_counter_ns() - started
            info = dataclasses.replace(
                info, duration_s=elapsed / 1e9, phases_ms=_phases_ms(spent, elapsed)
            )
            self._metrics.append(
                from_commit(
                    info.version, info.duration_s, info.bytes_uploaded, info.puts + info.deletes,
                    phases_ms=info.phases_ms,
                )
            )  # fmt: skip
            if (
                self._job is not None
                and info.snapshot_scheduled
                and self._job.give_metrics(self._metrics)  # False: that job is done already
            ):
                self._metrics = []  # written in the background
            elif len(self._metrics) >= self._config.metrics_every:
                # After the duration was taken: a commit cannot record its own recording.
                with phases.phase("metrics"):
                    self._write_metrics()
                info = dataclasses.replace(
                    info, phases_ms={**info.phases_ms, "metrics": spent["metrics"] / 1e6}
                )
        _log.debug("committed %s", info)
        return info

    def _commit(self, order: Order, owner: str, started: int) -> CommitInfo:
        with phases.phase("encode"):
            columns = sorted_columns(self._pending)
        # The attempt whose content this store loaded (and its copy holds): a re-run may
        # have replaced that version since, and these changes were made on this content.
        parent = self._copy.attempt
        if self._attempt is None:
            self._attempt = uuid.uuid4().hex
        if self._before_commit is not None:
            self._before_commit()  # a format-1 root is upgraded before its first manifest
            self._before_commit = None
        try:
            if self._config.mode == "snapshot":
                with phases.phase("snapshot"):
                    key, uploaded = self._commit_snapshot(columns, order, parent, owner)
            else:
                key, uploaded = self._commit_changelog(columns, order, parent, owner)
        except CommitConflictError as exc:
            self._state = _State.FAILED
            then = (
                "its owner's own attempts may continue it"
                if isinstance(exc, OwnerConflictError)
                else "reopen the store to continue from the newest version"
            )
            raise type(exc)(
                f"version {self._version + 1} of store {self._operator}/{self._partition} was "
                f"not committed: {exc}; {then}"
            ) from exc
        self._version += 1
        self._pending = {}
        self._sorted.clear()
        self._attempt = None
        scheduled = self._maybe_schedule_snapshot()
        deletes = columns.deletes
        return CommitInfo(
            operator=self._operator,
            partition=self._partition,
            version=self._version,
            puts=len(columns) - deletes,
            deletes=deletes,
            raw_bytes=columns.raw_length(0, len(columns)),
            bytes_uploaded=uploaded,
            duration_s=(time.perf_counter_ns() - started) / 1e9,
            blob=key,
            snapshot=self._config.mode == "snapshot",
            snapshot_scheduled=scheduled,
        )

    def _write_metrics(self) -> None:
        """Write buffered commit metrics, best effort: they are never state."""
        metrics, self._metrics = self._metrics, []
        write_metrics_quietly(self._blobs, self._operator, self._partition, metrics)

    def _commit_changelog(
        self, columns: Columns, order: Order, parent: str, owner: str
    ) -> tuple[str, int]:
        new_version = self._version + 1
        attempt = self._attempt
        assert attempt is not None
        adopted = self._point.refuse_early(new_version, attempt, order, columns, parent, owner)
        if adopted is not None:
            self._apply_locally(columns, new_version, adopted)
            return self._point.manifest.entry(new_version).blob, 0  # type: ignore[union-attr]

        def encode() -> ChangelogParts:
            return encode_changelog_parts(
                columns,
                base_version=self._version,
                version=new_version,
                compression=self._config.compression,
                level=self._config.compression_level,
                identity=ChangelogIdentity(self._root_id, self._operator, self._partition, attempt),
                part_size=self._config.changelog_part_bytes,
            )

        key = layout.attempt_changelog_key(self._operator, self._partition, new_version, attempt)
        parts = encode()
        try:
            size = self._upload_changelog(key, parts, encode)
        except CommitConflictError:
            # The name is this attempt's own: an earlier try of this commit wrote it (the
            # same changes: any change since makes a new attempt).
            _log.info("changelog %s was written by an earlier try of this commit", key)
            size = 0
        with phases.phase("upload"):
            adopted = self._point.publish(
                new_version, attempt, order, "changelog", key, columns, parent, owner
            )
        if parts.count == 1:
            # Nearly every commit: written to the copy after the commit returns (_overlap).
            self._copy.write_behind(
                columns, version=new_version, root_id=self._root_id, attempt=adopted or attempt
            )
            self._behind = new_version, adopted or attempt
            return key, size
        # As the changelog is written: a part at a time.
        self._apply_locally(columns, new_version, adopted or attempt, parts.spans)
        return key, size

    def _upload_changelog(
        self, key: str, parts: ChangelogParts, encode: Callable[[], ChangelogParts]
    ) -> int:
        """Write the changelog ``parts`` at ``key``: one ``put`` for one part (nearly every
        commit), else streamed a part at a time (one part in memory, not the whole), a retry
        encoding them again with ``encode``.

        Raises:
            CommitConflictError: the blob exists.
            StorageError: the upload failed.
        """
        if parts.count == 1:
            blob = next(parts)
            with phases.phase("upload"):
                self._blobs.put(key, blob)
            return len(blob)
        first: list[ChangelogParts] = [parts]

        def chunks() -> ChangelogParts:
            return first.pop() if first else encode()

        with phases.phase("upload"):
            return put_stream(self._blobs, key, chunks)

    def _apply_locally(
        self,
        columns: Columns,
        version: int,
        attempt: str,
        slices: list[tuple[int, int]] | None = None,
    ) -> None:
        """Apply a committed version to the working copy (with the undo record that steps
        it back), and flush if due. With ``slices`` (a commit of several changelog parts)
        each slice of ``columns`` is its own write, so RocksDB holds one slice's batch at a
        time; the copy is labelled dirty until the last (a crash in between leaves a copy
        no open trusts, never a mix labelled as a version).

        Raises:
            StateKeeperError: the local write failed (a full disk, a damaged copy): the
                commit is durable all the same; the store is failed and its copy released.
        """
        slices = slices or [(0, len(columns))]
        if len(slices) > 1 and self._job is not None:
            # A scheduled snapshot must check the copy out before it is dirty: between the
            # slices it holds part of a version.
            self._job.ensure_checkpoint()
        try:
            with phases.phase("apply"):
                for i, (start, stop) in enumerate(slices):
                    self._copy.apply(
                        columns if len(slices) == 1 else columns.slice(start, stop),
                        version=version, root_id=self._root_id, attempt=attempt, undo=True,
                        dirty=i + 1 < len(slices),
                    )  # fmt: skip
                self._copy.flush_if_due()
        except DamagedCopyError as exc:
            if self._rebuild is None:
                raise self._local_failure(version, attempt, exc, committed=True) from exc
            # The version is committed: the store's next call rebuilds the copy at it.
            self._copy.report_damage(exc)
        except StateKeeperError as exc:
            raise self._local_failure(version, attempt, exc, committed=True) from exc

    def _commit_snapshot(
        self, columns: Columns, order: Order, parent: str, owner: str
    ) -> tuple[str, int]:
        """Apply locally marked dirty, upload the snapshot, publish it, then mark clean."""
        new_version = self._version + 1
        attempt = self._attempt
        assert attempt is not None
        try:
            self._point.check(new_version, attempt, order, parent, owner)
            self._apply_dirty(columns, new_version, attempt)
            job = SnapshotJob(
                self._copy, self._operator, self._partition, root_id=self._root_id,
                point=self._point, register=False,
            )  # fmt: skip
            metrics = self._snapshotter.run(job)
            if metrics is None:
                raise StateKeeperError(f"could not snapshot {self!r}: the copy was closed")
            self._point.publish(
                new_version, attempt, order, "snapshot", job.index_key, None, parent, owner,
                reused=job.reused,
            )  # fmt: skip
        except BaseException:
            self._state = _State.FAILED  # the local copy holds an uncommitted version
            raise
        try:
            self._copy.mark_clean()
        except StateKeeperError as exc:
            raise self._local_failure(new_version, attempt, exc, committed=True) from exc
        self._last_snapshot = new_version
        return metrics.index_blob, metrics.bytes_uploaded

    def _apply_dirty(self, columns: Columns, version: int, attempt: str) -> None:
        """Apply a snapshot-mode commit locally before its upload (dirty until published).

        Raises:
            StateKeeperError: the local write failed: nothing was committed, and the copy
                is released.
        """
        try:
            self._copy.apply(
                columns, version=version, root_id=self._root_id, attempt=attempt, dirty=True,
                undo=True,
            )  # fmt: skip
        except StateKeeperError as exc:
            raise self._local_failure(version, attempt, exc, committed=False) from exc

    def _local_failure(
        self, version: int, attempt: str, exc: StateKeeperError, *, committed: bool
    ) -> StateKeeperError:
        """Fail the store and release its working copy after a local write failed (set it
        aside if the failure is damage: RocksDB would fail every later write of it, and
        only a rebuild, at the next open, gets past it); the error to raise says whether
        ``version`` is committed all the same."""
        self._state = _State.FAILED
        if isinstance(exc, DamagedCopyError):
            try:
                self._copy.set_aside(exc)
            except StateKeeperError as failed:
                _log.warning("%s; the next open finds the copy damaged again", failed)
        else:
            self._copy.close(flush=False)
        store = f"store {self._operator}/{self._partition}"
        if committed:
            what = (
                f"version {version} of {store} IS committed (durable in the blob store, "
                f"attempt {attempt}), but the local working copy could not record it"
            )
        else:
            what = f"version {version} of {store} was NOT committed (nothing was published)"
        then = (
            "it is rebuilt from the blob store (the damaged copy is set aside)"
            if isinstance(exc, DamagedCopyError)
            else "once the local disk has room, it catches up from the blob store"
        )
        return StateKeeperError(
            f"{what}: {exc}. The store is closed and its working copy released; reopen it: {then}"
        )

    def _settle(self) -> None:
        """Wait for the working copy's write of the last commit (``write_behind``). A copy
        found damaged (by that write, or by a snapshot that checked its files) is rebuilt
        at this store's version from the blob store, where that version is committed.

        Raises:
            StateKeeperError: that write failed: the store is failed (the version is
                committed all the same); or the rebuild failed.
        """
        try:
            self._copy.wait()
        except StateKeeperError as exc:
            if isinstance(exc, DamagedCopyError) and self._rebuild is not None:
                self._behind = None
                self._replace_damaged_copy(exc)
                return
            if self._behind is None:
                raise
            version, attempt = self._behind
            raise self._local_failure(version, attempt, exc, committed=True) from exc
        self._behind = None

    def _maybe_schedule_snapshot(self) -> bool:
        if self._config.mode == "snapshot":
            return False
        if self._version - self._last_snapshot < self._config.snapshot_every:
            return False
        job = SnapshotJob(
            self._copy, self._operator, self._partition, root_id=self._root_id,
            point=self._point,
        )  # fmt: skip
        future = self._snapshotter.schedule(job)
        if future is None:
            return False  # the previous one is still uploading: try again next commit
        self._job = job
        self._last_snapshot = self._version
        # Done already: taken in this thread (at Python's exit), not in the background, so
        # this commit's metrics are not handed to it.
        return not future.done()

    def snapshot_now(self) -> SnapshotMetrics | None:
        """Snapshot the committed version now, synchronously; ``None`` if one exists (or
        the copy is in the middle of a commit: from another thread, see
        :meth:`StateBackend.snapshot`).

        Raises:
            StateKeeperError: the store is closed or failed, or the upload failed.
        """
        self._check_open()
        self._settle()
        job = SnapshotJob(
            self._copy, self._operator, self._partition, root_id=self._root_id,
            point=self._point,
        )  # fmt: skip
        metrics = self._snapshotter.run(job)
        self._last_snapshot = self._version
        return metrics

    def flush(self) -> None:
        """Make the committed version durable on local disk and write the buffered commit
        metrics; the store stays open. A process killed afterwards (without closing the
        store) leaves a working copy the next open reuses as it is, with nothing to replay.
        Uncommitted writes are kept, and not written.

        A copy the flush finds damaged (a compaction met a block whose checksum fails) is
        set aside and rebuilt at this store's version from the blob store, as a commit
        would.

        Raises:
            StateKeeperError: the store is closed or failed, the last commit's write to the
                working copy failed (the store is then failed), the flush failed, or the
                rebuild did.
        """
        self._check_open()
        self._settle()
        try:
            self._copy.flush()
        except DamagedCopyError as exc:
            self._replace_damaged_copy(exc)
        self._write_metrics()

    def abort(self) -> None:
        """Drop the uncommitted writes; the store stays open at its version.

        Raises:
            StateKeeperError: the store is closed.
        """
        if self._state is _State.CLOSED:
            raise StateKeeperError(f"{self!r} is closed")
        self._pending = {}
        self._sorted.clear()
        self._attempt = None

    def close(self) -> None:
        """Drop uncommitted writes and release the working copy (kept on disk). Idempotent."""
        if self._state is _State.CLOSED:
            return
        self._pending = {}
        self._sorted.clear()
        self._state = _State.CLOSED
        self._write_metrics()
        if self._job is not None:
            self._job.ensure_checkpoint()  # a scheduled snapshot needs its checkpoint first
        self._copy.close()

    def __enter__(self) -> StateStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._state is not _State.OPEN:
            raise StateKeeperError(
                f"{self!r} cannot be used: it is {self._state.value}"
                + ("; reopen it from the backend" if self._state is _State.FAILED else "")
            )


def _phases_ms(phases: dict[str, int], elapsed_ns: int) -> dict[str, float]:
    """Phase totals in milliseconds, with ``other`` for the time no phase claimed."""
    out = {name: round(ns / 1e6, 3) for name, ns in sorted(phases.items())}
    out["other"] = round(max(elapsed_ns - sum(phases.values()), 0) / 1e6, 3)
    return out
