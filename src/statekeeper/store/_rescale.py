"""The second half of a rescale's commit: the store manifests that make the new stores.

A rescale (:mod:`statekeeper.repartition`) uploads every new store's snapshot first (blobs
no manifest names: orphans for GC if it dies), then commits with one compare-and-swap on the
root metadata (:meth:`RootRegistry.rescale`: the new partition count, a new run generation,
a pending :class:`Rescale`). Only then may the manifests of the new stores be written: before
it, a store path shared by the old and the new layout still serves the old one. This module
writes them, and it is safe to run any number of times, from any process: each store's next
manifest is written create-only, and a store whose newest manifest names the rescale's
snapshot is done (nothing is committed on a new store before every store is done: opening
one finishes the rest first). The rescale itself runs it right after its
commit point; should it die in between, every :class:`StateBackend` that opens the operator
finishes the job before it reads a store.

A new store's manifest starts at the rescale's version: ``base`` is that version, whose only
snapshot is the rescale's; its earlier snapshots are retired (GC keeps their files while the
manifest names them, and whatever a new store's snapshot names for as long as it is retained).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import rocksdict

from statekeeper import layout
from statekeeper.config import StoreConfig
from statekeeper.errors import CommitConflictError, StateKeeperError
from statekeeper.history import StoreHistory
from statekeeper.manifest import (
    PLAIN_ORDER,
    RetiredSnapshot,
    SnapshotEntry,
    StoreManifest,
    read_newest_manifest,
    retire,
    write_manifest,
)
from statekeeper.snapshot import (
    SnapshotIndex,
    SnapshotMetrics,
    iter_files,
    load_index,
    upload_snapshot,
)
from statekeeper.storage import BlobStore, thread_pool
from statekeeper.store._label import pack_label
from statekeeper.store._restore import restore_copy
from statekeeper.store._root import Rescale, RootMetadata, RootRegistry
from statekeeper.store._working_copy import LABEL_KEY, WorkingCopy

__all__ = [
    "ParentCopy",
    "StoreRescale",
    "complete_rescale",
    "finish_pending_rescale",
    "latest_versions",
    "rescaled_manifest",
]

_TRIES = 10


def rescaled_manifest(
    newest: StoreManifest | None,
    *,
    root_id: str,
    operator: str,
    partition: int,
    rescale: Rescale,
    now_ms: int,
) -> StoreManifest:
    """The manifest that makes store (``operator``, ``partition``) start at the rescale's
    version from the rescale's snapshot, following ``newest`` (``None``: a store without
    one)."""
    fence = (rescale.generation, 0, 0, 0) if rescale.fenced else PLAIN_ORDER
    key = layout.attempt_snapshot_key(operator, partition, rescale.version, rescale.attempt)
    snapshot = SnapshotEntry(rescale.version, rescale.attempt, key)
    if newest is None:
        return StoreManifest(
            seq=1, root_id=root_id, operator=operator, partition=partition, fence=fence,
            base=rescale.version, snapshots=(snapshot,),
        )  # fmt: skip
    retired = retire(
        newest.retired, (RetiredSnapshot(s.index_blob, now_ms) for s in newest.snapshots)
    )
    return dataclasses.replace(
        newest,
        seq=newest.seq + 1,
        fence=max(newest.fence, fence),
        base=rescale.version,
        versions=(),
        snapshots=(snapshot,),
        retired=retired,
    )


def _complete_store(
    blobs: BlobStore, root_id: str, operator: str, partition: int, rescale: Rescale
) -> bool:
    """Write the store's rescale manifest unless it is there; True if this call wrote it.

    Raises:
        CommitConflictError: other writers kept winning the next sequence number.
        CorruptStateError: no manifest of the store is readable.
        StorageError: the blob store failed.
    """
    for _ in range(_TRIES):
        newest = read_newest_manifest(
            blobs, root_id=root_id, operator=operator, partition=partition
        )
        if newest is not None and any(
            (s.version, s.attempt) == (rescale.version, rescale.attempt) for s in newest.snapshots
        ):
            return False  # done: only an opener that finished the rescale writes after it
        manifest = rescaled_manifest(
            newest, root_id=root_id, operator=operator, partition=partition, rescale=rescale,
            now_ms=int(time.time() * 1000),
        )  # fmt: skip
        try:
            write_manifest(blobs, manifest)
        except CommitConflictError:
            continue  # another opener (or a zombie) wrote that seq: look again
        return True
    raise CommitConflictError(
        f"could not write the rescale manifest of store {operator}/{partition}: other writers "
        f"won {_TRIES} times in a row"
    )


def complete_rescale(
    blobs: BlobStore,
    registry: RootRegistry,
    meta: RootMetadata,
    operator: str,
    *,
    io_threads: int,
) -> RootMetadata:
    """Write every store manifest ``operator``'s pending rescale still lacks, then record
    it as done; returns the root metadata after that (``meta`` if nothing was pending).

    Raises:
        CommitConflictError: a store's manifest could not be written.
        CorruptStateError: no manifest of some store is readable.
        StorageError: the blob store failed.
    """
    rescale = meta.rescales.get(operator)
    partitions = meta.operators.get(operator)
    if rescale is None or not rescale.pending or partitions is None:
        return meta
    with thread_pool(max(1, io_threads), "statekeeper-rescale") as pool:
        list(
            pool.map(
                lambda p: _complete_store(blobs, meta.root_id, operator, p, rescale),
                range(partitions),
            )
        )
    return registry.finish_rescale(operator, rescale.generation)


def finish_pending_rescale(blobs: BlobStore, operator: str, *, io_threads: int) -> None:
    """Finish ``operator``'s last rescale if it died after its commit point (nothing to do
    otherwise), without opening a store.

    Raises:
        CommitConflictError, CorruptStateError, StorageError: as :func:`complete_rescale`.
    """
    registry = RootRegistry(blobs)
    meta = registry.read()
    if meta is not None:
        complete_rescale(blobs, registry, meta, operator, io_threads=io_threads)


def latest_versions(
    blobs: BlobStore,
    root_id: str,
    operator: str,
    partitions: int,
    *,
    history: Callable[[int], StoreHistory] | None = None,
) -> list[int]:
    """The newest committed version of each store of ``operator`` (0 for one without), from
    ``history(partition)`` if given (histories the caller read already), else read now.

    Raises:
        CorruptStateError: no manifest of some store is readable.
        StorageError: the blob store failed.
    """
    load = history or (lambda p: StoreHistory.load(blobs, operator, p, root_id=root_id))
    found = []
    for p in range(partitions):
        versions = load(p).restorable_versions()
        found.append(versions[-1] if versions else 0)
    return found


@dataclass
class ParentCopy:
    """A store of the old layout restored into the rescale's work folder, at the cut."""

    partition: int
    copy: WorkingCopy
    index: SnapshotIndex | None
    """The snapshot it was restored from (its blobs are what children reuse); ``None`` if
    it was rebuilt from changelogs alone."""
    bytes_downloaded: int

    @property
    def state_bytes(self) -> int:
        """The size of its files: its snapshot's (what children may reuse), else what its
        restore downloaded."""
        if self.index is None:
            return self.bytes_downloaded
        return sum(f.size_in_bytes for _, f in iter_files(self.index.dir_index))

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Its items whose key starts with ``prefix``, sorted (the label left out)."""
        return self.copy.scan(prefix)


class StoreRescale:
    """The store layer's half of a rescale of ``source`` into ``target`` (often the same
    operator) at ``version``: restore the old stores, hand out new stores as raw RocksDB
    directories to fill, upload them as snapshots that reuse their parent's blobs, and
    commit. Which keys a new store holds is the caller's business (it knows the key layout).
    """

    def __init__(
        self,
        blobs: BlobStore,
        config: StoreConfig,
        meta: RootMetadata,
        *,
        source: str,
        target: str,
        version: int,
        attempt: str,
        work_dir: Path,
    ) -> None:
        self._blobs, self._config, self._meta = blobs, config, meta
        self.source, self.target, self.version, self.attempt = source, target, version, attempt
        self._work = work_dir

    def restore_parent(self, partition: int) -> ParentCopy:
        """Restore old store ``partition`` at the rescale's version into the work folder.

        Raises:
            StateNotFoundError, CorruptStateError, StorageError: as a store's restore.
        """
        cfg = self._config
        history = StoreHistory.load(self._blobs, self.source, partition, root_id=self._meta.root_id)
        path = self._work / "parents" / str(partition)
        copy, info = restore_copy(
            blobs=self._blobs, config=cfg, history=history, version=self.version,
            root_id=self._meta.root_id,
            open_copy=lambda: WorkingCopy(
                str(path), write_buffer_mb=cfg.write_buffer_mb, memory_mb=cfg.rocksdb_memory_mb,
                checkpoint_interval_s=cfg.local_checkpoint_interval_s, compactions=False,
            ),
        )  # fmt: skip
        index = None
        if info.base_kind == "snapshot":
            index = load_index(
                self._blobs, self.source, partition, info.base, key=history.index_key(info.base)
            )
        return ParentCopy(partition, copy, index, info.bytes_downloaded)

    def open_child(self, partition: int, parent: ParentCopy) -> rocksdict.Rdict:
        """New store ``partition`` as a RocksDB checkpoint of ``parent`` (hard links),
        opened raw with automatic compactions off (so its files stay the parent's); the
        caller deletes what it does not own, adds what it lacks, and :meth:`upload_child`
        labels, flushes, closes and uploads it.

        Raises:
            StateKeeperError: RocksDB failed.
        """
        path = self.child_path(partition)
        path.parent.mkdir(parents=True, exist_ok=True)
        parent.copy.checkpoint(str(path))
        opts = rocksdict.Options(raw_mode=True)
        opts.set_disable_auto_compactions(True)
        try:
            # The default column family too: rocksdict would take the checkpoint's OPTIONS.
            return rocksdict.Rdict(str(path), opts, column_families={"default": opts})
        except Exception as exc:  # rocksdict raises a bare Exception for every failure
            raise StateKeeperError(f"cannot open the new store's copy {path}: {exc}") from exc

    def child_path(self, partition: int) -> Path:
        """Where new store ``partition`` is built."""
        return self._work / "children" / str(partition)

    def upload_child(
        self, partition: int, db: rocksdict.Rdict, parent: ParentCopy
    ) -> tuple[SnapshotIndex, SnapshotMetrics]:
        """Label ``db`` as the rescale's version and attempt, flush and close it, and upload
        it as new store ``partition``'s snapshot, reusing ``parent``'s blobs for every file
        it still holds. Nothing names the snapshot until :meth:`commit`.

        Raises:
            StateKeeperError: RocksDB failed.
            StorageError: an upload failed.
        """
        label = pack_label(
            self.version, dirty=False, root_id=self._meta.root_id, attempt=self.attempt
        )
        try:
            db.put(LABEL_KEY, label)
            db.flush(wait=True)
            db.close()
        except Exception as exc:  # rocksdict raises a bare Exception for every failure
            raise StateKeeperError(f"cannot write the new store's copy: {exc}") from exc
        key = layout.attempt_snapshot_key(self.target, partition, self.version, self.attempt)
        return upload_snapshot(
            self._blobs, self.child_path(partition), operator=self.target, partition=partition,
            version=self.version, previous=parent.index, trust_names=parent.index is not None,
            chunk_size=self._config.chunk_size, io_threads=self._config.io_threads,
            index_key=key, root_id=self._meta.root_id, attempt=self.attempt,
            parent=parent.index is not None,
        )  # fmt: skip

    def commit(self, partitions: int) -> RootMetadata:
        """The commit point (:meth:`RootRegistry.rescale`), then every new store's manifest
        (:func:`complete_rescale`); returns the root metadata after both.

        Raises:
            CommitConflictError: the source operator changed since the cut was read.
            StorageError: the blob store failed (after the commit point, any opener of the
                operator finishes the manifests).
        """
        registry = RootRegistry(self._blobs)
        registry.rescale(
            self.target, partitions=partitions, source=self.source,
            source_partitions=self._meta.operators[self.source] or 0,
            source_generation=self._meta.generations.get(self.source, 0),
            version=self.version, attempt=self.attempt,
        )  # fmt: skip
        meta = registry.read()
        assert meta is not None
        return complete_rescale(
            self._blobs, registry, meta, self.target, io_threads=self._config.io_threads
        )
