"""StateBackend: the entry point that opens versioned stores under one checkpoint root."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from types import TracebackType

from statekeeper import layout
from statekeeper.config import StoreConfig
from statekeeper.errors import ConfigMismatchError, StateKeeperError, StateNotFoundError
from statekeeper.gc import GcReport, ManifestUpdate, collect_garbage
from statekeeper.history import StoreHistory
from statekeeper.snapshot import SnapshotMetrics
from statekeeper.storage import BlobStore, local_root, open_blob_store
from statekeeper.store._export import ExportInfo, prepare_target, publish, staging_dir, write_db
from statekeeper.store._overlay import check_progress
from statekeeper.store._rescale import complete_rescale
from statekeeper.store._restore import restore_copy
from statekeeper.store._rocks import damaged_tables
from statekeeper.store._root import FORMAT_VERSION, Retention, RootMetadata, RootRegistry
from statekeeper.store._snapshots import Snapshotter, remove_stale_checkpoints
from statekeeper.store._state_store import StateStore
from statekeeper.store._working_copy import DamagedCopyError, WorkingCopy
from statekeeper.verify import Problem, Progress, VerifyReport, verify_root

__all__ = ["StateBackend"]

_log = logging.getLogger("statekeeper.store")
_BACKGROUND_GC_BUDGET_S = 10.0


class StateBackend:
    """Durable, versioned key -> value stores under one checkpoint root.

    Thread-safe for opening different stores from different threads; each returned
    :class:`StateStore` is used by one thread.

    Close stores and the backend (``with``): closing flushes the working copy, writes the
    buffered commit metrics and waits for background snapshots. A program that ends without
    closing keeps every commit and finishes the snapshot upload running as it ends (once
    Python's exit has begun, the work its background threads would do runs in the thread
    that asks for it: :func:`statekeeper.storage.thread_pool`), but loses its buffered
    commit metrics. A thread that goes on committing after the main thread returned takes
    its due snapshots within its commits.

    Example::

        backend = StateBackend("/tmp/app-state")
        with backend.open("sessions", partition=3) as store:
            store.put(b"k", b"v")
            store.commit()
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | BlobStore,
        *,
        config: StoreConfig | None = None,
        storage_options: Mapping[str, str] | None = None,
    ) -> None:
        """Connect to a checkpoint root (a path, ``file://``, ``s3://``, ``gs://``, ``az://``
        URI, or a ready :class:`BlobStore`).

        Raises:
            TypeError: ``config`` is not a StoreConfig.
            ValueError: the URI or a storage option is not understood, or the working
                copies' folder lies inside a local root.
            StorageError: the root cannot be read.
            ConfigMismatchError: the root was written by a newer statekeeper.
            CorruptStateError: the root metadata is not a statekeeper document.
        """
        if config is None:
            config = StoreConfig()
        if not isinstance(config, StoreConfig):
            raise TypeError(f"config must be a StoreConfig, got {type(config).__name__}")
        self._config = config
        if isinstance(root, BlobStore):
            self._blobs = root
        else:
            self._blobs = open_blob_store(
                os.fspath(root), storage_options, io_threads=config.io_threads
            )
        self._owns_blobs = True
        self._closed = False
        try:
            _refuse_inside_root(self._blobs.uri, config.resolved_local_dir, "StoreConfig.local_dir")
        except ValueError:
            if not isinstance(root, BlobStore):
                self._blobs.close()  # opened here: its threads go with the refusal
            raise
        self._registry = RootRegistry(self._blobs)
        self._snapshotter = Snapshotter(self._blobs, config)
        self._snapshotter.after_upload = self._gc_after_snapshot
        self._open_lock = threading.Lock()
        self._open_stores: weakref.WeakValueDictionary[tuple[str, int], StateStore] = (
            weakref.WeakValueDictionary()
        )
        self._registry.read()  # fail fast on an unreadable root or a newer format

    def __repr__(self) -> str:
        return f"StateBackend({self._blobs.uri!r})"

    @property
    def config(self) -> StoreConfig:
        """The configuration stores of this backend use."""
        return self._config

    @property
    def blobs(self) -> BlobStore:
        """The blob store under the checkpoint root."""
        return self._blobs

    def open(
        self,
        name: str,
        partition: int,
        version: int | None = None,
        *,
        partitions: int | None = None,
    ) -> StateStore:
        """Open store (``name``, ``partition``) at ``version`` (default: the latest).

        A local working copy at exactly ``version`` is reused without any download; one that
        is behind replays only the missing changelogs; one that is one commit ahead (a
        re-run of the batch) or holds an attempt another one replaced steps back with the
        undo record of its last commit, without a download; one further ahead, or of
        another root, is discarded and rebuilt; one RocksDB cannot open or read is set
        aside (renamed, with a WARNING) and rebuilt.

        Args:
            name: the operator name.
            partition: the partition, in ``[0, partitions)``.
            version: the committed version to load; ``None`` for the latest.
            partitions: the operator's partition count; recorded on first use and checked
                on every later open.

        Raises:
            TypeError, ValueError: a malformed argument.
            StateNotFoundError: ``version`` was never committed or is no longer retained.
            ConfigMismatchError: ``partitions`` or ``partition`` contradicts the root.
            CorruptStateError: a changelog fails its checksum or format checks.
            StorageError: the blob store failed.
            StateKeeperError: the local working copy is in use by another process, or the
                local disk is full (the message says how full).
        """
        self._check_open()
        layout.validate_operator(name)
        layout.validate_partition(partition)
        if version is not None:
            layout.validate_version(version)
        if partitions is not None:
            _check_partitions(partitions)
        meta = self._registry.register(name, partitions)
        rescale = meta.rescales.get(name)
        if rescale is not None and rescale.pending:  # a rescale died after its commit point
            meta = complete_rescale(
                self._blobs, self._registry, meta, name, io_threads=self._config.io_threads
            )
        count = meta.operators.get(name)
        if count is not None and partition >= count and partitions is None:
            meta = self._registry.read() or meta  # a rescale may have changed the count
            count = meta.operators.get(name)
        if count is not None and partition >= count:
            raise _out_of_range(name, partition, count)
        groups = meta.key_groups.get(name)
        if count is None and groups is not None and partition >= groups:
            # Committed to, it would keep any partition count from being recorded.
            raise ConfigMismatchError(
                f"partition {partition} is out of range: operator {name!r} has {groups} key "
                f"groups, so at most {groups} partitions (0..{groups - 1})"
            )
        # A store closed here with its snapshot still uploading: the job records its
        # lineage beside the copy when done, which must not land on a copy this open
        # rebuilds (its files would be trusted by name against another database's).
        self._snapshotter.wait((name, partition))
        read_at = time.monotonic()  # a restore may take minutes: the manifest is older
        history = StoreHistory.load(self._blobs, name, partition, root_id=meta.root_id)
        wanted = history.latest() if version is None else version
        copy, info = restore_copy(
            blobs=self._blobs,
            config=self._config,
            history=history,
            version=wanted,
            root_id=meta.root_id,
            open_copy=lambda: self._open_copy(
                name, partition, step_back=(history, wanted, meta.root_id)
            ),
            local_path=self.local_path(name, partition),
        )
        store = StateStore(
            blobs=self._blobs,
            config=self._config,
            operator=name,
            partition=partition,
            copy=copy,
            root_id=meta.root_id,
            restore_info=info,
            snapshotter=self._snapshotter,
            manifest=history.as_manifest(meta.root_id),
            manifest_read_at=read_at,
            before_commit=None if meta.format_version >= FORMAT_VERSION else self._registry.upgrade,
            rebuild=lambda at: self._rebuild_copy(name, partition, at, meta.root_id),
        )
        with self._open_lock:
            self._open_stores[(name, partition)] = store
        return store

    def register(self, name: str, partitions: int) -> None:
        """Record operator ``name`` with ``partitions`` partitions in the root (idempotent).

        Raises:
            TypeError, ValueError: a malformed argument.
            ConfigMismatchError: the root records another partition count.
            StorageError: the root cannot be read or written.
        """
        self._check_open()
        layout.validate_operator(name)
        _check_partitions(partitions)
        self._registry.register(name, partitions)

    def start_generation(self, name: str) -> int:
        """Start a new run of operator ``name``: bump its run generation in the root by
        compare-and-swap and return it. Commits of this run use it as the first number of
        their order (``StateStore.commit(order=(generation, ...))``), so they replace what an
        earlier run left half done, and an earlier run's tasks still alive are refused.
        The root also records this backend's ``retain_versions`` and ``orphan_ttl_s`` as
        the retention ``statekeeper gc`` applies by default.

        Raises:
            TypeError, ValueError: a malformed name.
            StorageError: the root cannot be read or written.
        """
        self._check_open()
        layout.validate_operator(name)
        retention = Retention(self._config.retain_versions, self._config.orphan_ttl_s)
        return self._registry.start_generation(name, retention)

    def operators(self) -> dict[str, int | None]:
        """Operator name -> partition count (``None`` if never stated), as the root records.

        Raises:
            StorageError: the root cannot be read.
        """
        self._check_open()
        meta = self._registry.read()
        return {} if meta is None else dict(meta.operators)

    def local_path(self, name: str, partition: int) -> str:
        """The folder of the local working copy of a store (it may not exist yet)."""
        # One folder per root URI, so two roots never share a working copy.
        root_key = hashlib.sha256(self._blobs.uri.encode("utf-8")).hexdigest()[:16]
        return os.path.join(
            self._config.resolved_local_dir,
            root_key,
            layout.validate_operator(name),
            str(layout.validate_partition(partition)),
        )

    def snapshot(self, name: str, partition: int) -> SnapshotMetrics | None:
        """Snapshot the latest version of a store now; ``None`` if that snapshot exists.

        Uses the store's open working copy if this backend has it open, else opens it. A
        store open here belongs to the thread that uses it: call this from that thread.
        From another, a copy in the middle of a commit is never checked out (``None``),
        but the snapshot may be of the version before the one being committed.

        Raises:
            TypeError, ValueError: a malformed argument.
            StateNotFoundError: the root has no operator ``name``, or the store has no
                restorable version.
            ConfigMismatchError: the operator has no partition ``partition``.
            StateKeeperError: the store failed, or the upload failed; or the backend is
                closed.
        """
        self._check_open()
        layout.validate_operator(name)
        layout.validate_partition(partition)
        with self._open_lock:
            store = self._open_stores.get((name, partition))
        if store is not None and not store.closed:
            return store.snapshot_now()
        self._existing(name, partition)  # not open here: opening it must not register it
        with self.open(name, partition) as store:
            return store.snapshot_now()

    def gc(
        self, dry_run: bool = False, *, retention: Mapping[str, Retention] | None = None
    ) -> GcReport:
        """Delete what no retained version needs (see :mod:`statekeeper.gc`).

        Every version among the newest ``retain_versions`` of each store stays restorable;
        blobs no committed version references are deleted once older than
        ``orphan_ttl_s``. Safe to run at any time, from any process, repeatedly.

        Both come from this backend's config, or, for an operator named in ``retention``,
        from there (``statekeeper gc`` passes what the root records of each operator's last
        run, :meth:`recorded_retention`). Epoch manifests and temporary files, which belong
        to the whole root, get the longest history and grace among them.

        A repartition that died after its commit point left new stores that no manifest
        names yet: a run first finishes it, as opening the operator would (without that,
        once their blobs outlived ``orphan_ttl_s``, it deleted every new store). A dry run
        writes nothing, so it leaves such an operator out.

        Raises:
            StorageError: a listing or delete failed; a later run finishes the job.
            CommitConflictError, CorruptStateError: as :meth:`open`, finishing a repartition.
        """
        self._check_open()
        meta = self._registry.read()
        pending = [] if meta is None else sorted(n for n, r in meta.rescales.items() if r.pending)
        for name in [] if dry_run else pending:
            assert meta is not None
            meta = complete_rescale(
                self._blobs, self._registry, meta, name, io_threads=self._config.io_threads
            )
        return collect_garbage(
            self._blobs,
            self._config,
            [o for o in self._operators() if not (dry_run and o in pending)],
            dry_run=dry_run,
            busy=self._snapshotter.uploading(),
            root_id="" if meta is None else meta.root_id,
            shared_from=() if meta is None else sorted(meta.rescales),
            updates=self._manifest_updates(),
            configs={
                name: dataclasses.replace(
                    self._config,
                    retain_versions=kept.retain_versions,
                    orphan_ttl_s=kept.orphan_ttl_s,
                )
                for name, kept in (retention or {}).items()
            },
        )

    def recorded_retention(self) -> dict[str, Retention]:
        """Operator name -> the retention the root records for it: its last run's, else
        (an operator recorded before roots kept one per operator) the last run's of the
        root; operators with neither are left out.

        Raises:
            StorageError: the root cannot be read.
        """
        self._check_open()
        meta = self._registry.read()
        if meta is None:
            return {}
        return {
            name: kept
            for name in meta.operators
            if (kept := meta.retentions.get(name, meta.retention)) is not None
        }

    def _manifest_updates(self) -> dict[tuple[str, int], ManifestUpdate]:
        """How GC writes the next manifest of each store open here: through the store's
        commit point, taking turns with its commits instead of racing them."""
        with self._open_lock:
            stores = list(self._open_stores.items())
        return {key: store._point.update for key, store in stores}

    def verify(self, deep: bool = True, progress: Progress | None = None) -> VerifyReport:
        """Check every reference and, with ``deep``, every checksum of every store.

        Raises:
            TypeError: ``progress`` is not callable.
            StorageError: a listing or read failed for a reason other than a missing blob.
            StateKeeperError: the backend is closed.
        """
        self._check_open()
        check_progress(progress)
        meta = self._registry.read()
        report = verify_root(
            self._blobs, self._operators(), deep=deep, progress=progress,
            root_id="" if meta is None else meta.root_id, check_tables=damaged_tables,
        )  # fmt: skip
        missing = None if meta is not None else self._registry.missing_metadata()
        if missing is not None:
            report.problems.append(Problem("", layout.ROOT_METADATA, "missing", missing))
        return report

    def _operators(self) -> list[str]:
        return sorted(self.operators())

    def _gc_after_snapshot(self, name: str, partition: int) -> None:
        """Background maintenance: collect one store's garbage, bounded in time."""
        try:
            meta = self._registry.read()
            collect_garbage(
                self._blobs,
                self._config,
                [name],
                only=(name, partition),
                busy=self._snapshotter.uploading(),
                budget_s=_BACKGROUND_GC_BUDGET_S,
                root_id="" if meta is None else meta.root_id,
                shared_from=() if meta is None else sorted(meta.rescales),
                updates=self._manifest_updates(),
            )
        except StateKeeperError as exc:
            _log.warning("background gc of %s/%s failed: %s", name, partition, exc)

    def wait_for_snapshots(self, name: str | None = None, partition: int | None = None) -> None:
        """Block until every background snapshot scheduled so far has finished; given
        ``name`` and ``partition``, only that store's, which, if still queued behind other
        stores' snapshots, is uploaded next.

        Raises:
            ValueError: only one of ``name`` and ``partition`` is given.
        """
        if name is None and partition is None:
            self._snapshotter.wait()
        elif name is None or partition is None:
            raise ValueError(
                "wait_for_snapshots takes both name and partition (one store) or neither "
                f"(every store); got name={name!r}, partition={partition!r}"
            )
        else:
            self._snapshotter.wait((name, partition))

    def versions(self, name: str, partition: int) -> list[int]:
        """Every version of the store that can be opened, ascending; none if the root has
        no operator ``name``.

        Raises:
            TypeError, ValueError: a malformed argument.
            ConfigMismatchError: the operator has no partition ``partition``.
            StorageError: the listing failed.
        """
        try:
            meta = self._existing(name, partition)
        except StateNotFoundError:
            return []
        history = StoreHistory.load(self._blobs, name, partition, root_id=meta.root_id)
        return history.restorable_versions()

    def root_metadata(self) -> RootMetadata | None:
        """What the root records (format version, root id, operators and their partition
        counts), read now; ``None`` if nothing was ever registered in it.

        Raises:
            CorruptStateError: the root metadata is not valid.
            ConfigMismatchError: it was written by a newer statekeeper.
            StorageError: the root cannot be read.
        """
        self._check_open()
        return self._registry.read()

    def export(
        self,
        name: str,
        partition: int,
        to: str | os.PathLike[str],
        *,
        version: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> ExportInfo:
        """Write store (``name``, ``partition``) at ``version`` as a RocksDB directory ``to``.

        The directory opens with ``rocksdict.Rdict(path)`` (or any RocksDB tool) and holds
        exactly the store's items. The store is restored into a working copy beside ``to``
        (never this backend's own working copies) and the result is renamed into place only
        when complete.

        Args:
            name: the operator.
            partition: the partition.
            to: the directory to create; it must not exist, or be empty.
            version: the version to export; the latest if ``None``.
            progress: called with the number of items written, batch by batch.

        Raises:
            FileExistsError: ``to`` exists and is not an empty directory.
            TypeError: ``progress`` is not callable.
            ValueError: ``to`` lies inside a local root.
            StateNotFoundError: the root has no operator ``name``; or as :meth:`open`.
            ConfigMismatchError: the operator has no partition ``partition``.
            CorruptStateError, StorageError: as :meth:`open`.
        """
        self._existing(name, partition)
        check_progress(progress)
        _refuse_inside_root(self._blobs.uri, os.fspath(to), "the export target")
        target = prepare_target(to)
        staging = staging_dir(target)
        config = dataclasses.replace(self._config, local_dir=str(staging / "work"))
        try:
            staged = StateBackend(self._blobs, config=config)
            staged._owns_blobs = False
            with staged, staged.open(name, partition, version) as store:
                keys, size = write_db(store, staging / "db", progress)
                info = store.restore_info
                exported = store.version
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        publish(staging, target)
        return ExportInfo(str(target), exported, keys, size, info)

    def close(self) -> None:
        """Finish background snapshots, then release the blob store's threads (unless the
        blob store is shared with the backend that made this one). Idempotent.

        Afterwards the backend refuses new work (:class:`StateKeeperError`). A store opened
        before keeps working until closed; its background snapshots then run in a pool of
        their own, which ends with the process.
        """
        if self._closed:
            return
        self._snapshotter.close()
        self._closed = True
        if self._owns_blobs:
            self._blobs.close()

    def _existing(self, name: str, partition: int) -> RootMetadata:
        """The root's metadata, once it is known to hold store (``name``, ``partition``): what
        only reads a store must not register it, as :meth:`open` would.

        Raises:
            TypeError, ValueError: a malformed argument.
            StateNotFoundError: the root has no operator ``name``.
            ConfigMismatchError: the operator has no partition ``partition``.
            StateKeeperError: the backend is closed.
        """
        self._check_open()
        layout.validate_operator(name)
        layout.validate_partition(partition)
        meta = self._registry.read()
        if meta is None or name not in meta.operators:
            known = "none" if meta is None else ", ".join(sorted(meta.operators)) or "none"
            raise StateNotFoundError(
                f"operator {name!r} is not in checkpoint root {self._blobs.uri} (its operators: "
                f"{known})"
            )
        count = meta.operators[name]
        if count is not None and partition >= count:
            raise _out_of_range(name, partition, count)
        return meta

    def _check_open(self) -> None:
        """Refuse new work once closed.

        Raises:
            StateKeeperError: :meth:`close` was called.
        """
        if self._closed:
            raise StateKeeperError(
                f"{self!r} is closed: it opens, snapshots, lists and collects nothing more. "
                "Make a new StateBackend for the root"
            )

    def __enter__(self) -> StateBackend:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------

    def _open_copy(
        self,
        name: str,
        partition: int,
        *,
        step_back: tuple[StoreHistory, int, str] | None = None,
    ) -> WorkingCopy:
        """Open the store's working copy; with ``step_back`` (the history, the version
        wanted, the root id), a copy one commit ahead of the authority steps back first."""
        path = self.local_path(name, partition)
        remove_stale_checkpoints(path)
        copy = WorkingCopy(
            path,
            write_buffer_mb=self._config.write_buffer_mb,
            memory_mb=self._config.rocksdb_memory_mb,
            checkpoint_interval_s=self._config.local_checkpoint_interval_s,
            write_mb_s=self._config.background_write_mb_s,
        )
        if step_back is not None:
            try:
                _step_back_if_ahead(copy, *step_back)
            except DamagedCopyError as exc:  # the undo record's block is damaged
                copy.set_aside(exc)
                return self._open_copy(name, partition)
            except BaseException:
                copy.close(flush=False)
                raise
        return copy

    def _rebuild_copy(self, name: str, partition: int, version: int, root_id: str) -> WorkingCopy:
        """A new working copy of the store at ``version``, restored from the blob store
        (after the damaged one was set aside).

        Raises:
            StateNotFoundError, CorruptStateError, StorageError: as :meth:`open`.
        """
        history = StoreHistory.load(self._blobs, name, partition, root_id=root_id)
        copy, _ = restore_copy(
            blobs=self._blobs,
            config=self._config,
            history=history,
            version=version,
            root_id=root_id,
            open_copy=lambda: self._open_copy(name, partition),
            local_path=self.local_path(name, partition),
        )
        return copy


def _step_back_if_ahead(
    copy: WorkingCopy, history: StoreHistory, wanted: int, root_id: str
) -> None:
    """Step a copy back one commit, without a download, when it holds a version the
    authority does not (a re-run opens ``b`` while the copy holds ``b + 1`` of the failed
    attempt, or another attempt replaced the copy's version) and the version under it is
    the authority's and not above ``wanted``.

    Raises:
        DamagedCopyError: the copy's label cannot be read.
        StateKeeperError: the local write failed.
    """
    held = copy.label
    if held is None or not copy.can_step_back or copy.root_id != root_id:
        return
    # A dirty copy of the authority's attempt holds that version all the same (a snapshot
    # mode checkpoint is taken before its commit point): it is no step ahead.
    current = held <= wanted and copy.attempt == history.attempt(held)
    if current or held - 1 > wanted:
        return
    copy.step_back(version=held - 1, attempt=history.attempt(held - 1))


def _out_of_range(name: str, partition: int, count: int) -> ConfigMismatchError:
    return ConfigMismatchError(
        f"partition {partition} is out of range: operator {name!r} has {count} "
        f"partitions (0..{count - 1}) in this checkpoint root"
    )


def _check_partitions(partitions: object) -> None:
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise ValueError(f"partitions must be an int >= 1, got {partitions!r}")


def _refuse_inside_root(root_uri: str, path: str, what: str) -> None:
    """Refuse a local folder inside a local root: GC takes the files there for blobs no
    version names, and deletes them.

    Raises:
        ValueError: ``path`` is the root or lies inside it.
    """
    local = local_root(root_uri)
    if local is None:
        return
    root = os.path.realpath(local)
    folder = os.path.realpath(path)
    if folder == root or folder.startswith(root.rstrip(os.sep) + os.sep):
        raise ValueError(
            f"{what} {path!r} lies inside the checkpoint root {root}: GC would take its "
            "files for blobs no version names and delete them; choose a folder outside it"
        )
