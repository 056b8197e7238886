"""StateBackend: the entry point that opens versioned stores under one checkpoint root."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Mapping
from types import TracebackType

from statekeeper import layout
from statekeeper.changelog import decode_changelog
from statekeeper.config import StoreConfig
from statekeeper.errors import ConfigMismatchError, CorruptStateError
from statekeeper.storage import BlobStore, open_blob_store
from statekeeper.store._history import RestorePlan, StoreHistory
from statekeeper.store._root import RootRegistry
from statekeeper.store._state_store import RestoreInfo, StateStore
from statekeeper.store._working_copy import WorkingCopy

__all__ = ["StateBackend"]

_log = logging.getLogger("statekeeper.store")


class StateBackend:
    """Durable, versioned key -> value stores under one checkpoint root.

    Thread-safe for opening different stores from different threads; each returned
    :class:`StateStore` is used by one thread.

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
            ValueError: the URI or a storage option is not understood.
            StorageError: the root cannot be read.
            ConfigMismatchError: the root was written by a newer statekeeper.
            CorruptStateError: the root metadata is not a statekeeper document.
        """
        if config is None:
            config = StoreConfig()
        if not isinstance(config, StoreConfig):
            raise TypeError(f"config must be a StoreConfig, got {type(config).__name__}")
        if config.mode != "changelog":
            raise ConfigMismatchError(
                f"StoreConfig.mode={config.mode!r} is not available yet; use 'changelog'"
            )
        self._config = config
        if isinstance(root, BlobStore):
            self._blobs = root
        else:
            self._blobs = open_blob_store(
                os.fspath(root), storage_options, io_threads=config.io_threads
            )
        self._registry = RootRegistry(self._blobs)
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
        is behind replays only the missing changelogs; one that is ahead, or belongs to
        another root, is discarded and rebuilt.

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
        """
        layout.validate_operator(name)
        layout.validate_partition(partition)
        if version is not None:
            layout.validate_version(version)
        if partitions is not None and (
            isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1
        ):
            raise ValueError(f"partitions must be an int >= 1, got {partitions!r}")
        meta = self._registry.register(name, partitions)
        count = meta.operators.get(name)
        if count is not None and partition >= count:
            raise ConfigMismatchError(
                f"partition {partition} is out of range: operator {name!r} has {count} "
                f"partitions (0..{count - 1}) in this checkpoint root"
            )
        started = time.perf_counter()
        history = StoreHistory.load(self._blobs, name, partition)
        target = history.latest() if version is None else version
        copy = self._open_copy(name, partition)
        try:
            local = copy.version if copy.root_id == meta.root_id else None
            plan = history.plan(target, local)
            if plan.base_kind == "empty" and (copy.version is not None or copy.root_id):
                _log.info(
                    "discarding local copy of %s/%s at version %s (root %s): %s wanted",
                    name,
                    partition,
                    copy.version,
                    copy.root_id,
                    target,
                )
                copy.destroy()
                copy = self._open_copy(name, partition)
            downloaded = self._replay(copy, plan, name, partition, meta.root_id)
        except BaseException:
            copy.close(flush=False)
            raise
        info = RestoreInfo(
            version=target,
            base=plan.base,
            base_kind=plan.base_kind,
            changelogs_replayed=len(plan.replay),
            bytes_downloaded=downloaded,
            duration_s=time.perf_counter() - started,
        )
        if plan.replay:
            _log.info("restored %s/%s: %s", name, partition, info)
        return StateStore(
            blobs=self._blobs,
            config=self._config,
            operator=name,
            partition=partition,
            copy=copy,
            root_id=meta.root_id,
            restore_info=info,
        )

    def versions(self, name: str, partition: int) -> list[int]:
        """Every version of the store that can be opened, ascending.

        Raises:
            TypeError, ValueError: a malformed argument.
            StorageError: the listing failed.
        """
        return StoreHistory.load(self._blobs, name, partition).restorable_versions()

    def close(self) -> None:
        """Release the blob store's threads and connections."""
        self._blobs.close()

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

    def _copy_path(self, name: str, partition: int) -> str:
        # One folder per root URI, so two roots never share a working copy.
        root_key = hashlib.sha256(self._blobs.uri.encode("utf-8")).hexdigest()[:16]
        return os.path.join(self._config.resolved_local_dir, root_key, name, str(partition))

    def _open_copy(self, name: str, partition: int) -> WorkingCopy:
        return WorkingCopy(
            self._copy_path(name, partition),
            write_buffer_mb=self._config.write_buffer_mb,
            checkpoint_interval_s=self._config.local_checkpoint_interval_s,
        )

    def _replay(
        self, copy: WorkingCopy, plan: RestorePlan, name: str, partition: int, root_id: str
    ) -> int:
        """Download the plan's changelogs in parallel windows and apply them in order."""
        if not plan.replay:
            if copy.version is None:
                copy.apply((), version=plan.version, root_id=root_id)
            return 0
        downloaded = 0
        window = max(1, self._config.io_threads * 2)
        versions = list(plan.replay)
        for start in range(0, len(versions), window):
            batch = versions[start : start + window]
            keys = [layout.changelog_key(name, partition, v) for v in batch]
            for v, key, data in zip(batch, keys, self._blobs.get_many(keys), strict=True):
                downloaded += len(data)
                log = decode_changelog(data, blob=key)
                if log.header.version != v or log.header.base_version != v - 1:
                    raise CorruptStateError(
                        f"changelog {key} is not valid: expected versions {v - 1} -> {v}, "
                        f"found {log.header.base_version} -> {log.header.version}"
                    )
                copy.apply(log.records, version=v, root_id=root_id)
        copy.flush()
        return downloaded
