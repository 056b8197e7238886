"""Bring a local working copy to a committed version: reuse, snapshot restore, replay."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from statekeeper.config import StoreConfig
from statekeeper.errors import CorruptStateError, StateNotFoundError
from statekeeper.history import RestorePlan, StoreHistory
from statekeeper.manifest import LEGACY_ATTEMPT
from statekeeper.snapshot import RestoreMetrics, load_index, restore_snapshot
from statekeeper.storage import BlobStore
from statekeeper.store._changelogs import (
    changelog_parts,
    prefix_length,
    read_prefixes,
    replay_changelog,
)
from statekeeper.store._state_store import RestoreInfo
from statekeeper.store._working_copy import (
    WorkingCopy,
    copy_exists,
    delete_copy_folder,
    forget_lineage,
    unmark_copy,
)

__all__ = ["restore_copy"]

_log = logging.getLogger("statekeeper.store")
_NO_SNAPSHOT = RestoreMetrics(
    files_downloaded=0,
    bytes_downloaded=0,
    files_reused=0,
    bytes_reused=0,
    files_deleted=0,
    duration_s=0.0,
)


def restore_copy(
    *,
    blobs: BlobStore,
    config: StoreConfig,
    history: StoreHistory,
    version: int,
    root_id: str,
    open_copy: Callable[[], WorkingCopy],
    local_path: str | None = None,
) -> tuple[WorkingCopy, RestoreInfo]:
    """Open the working copy and bring it to ``version``; the copy is returned open.

    With ``local_path`` (the directory ``open_copy`` opens), a directory that holds no
    database yet (a fresh host) is not opened first: a snapshot is restored straight into
    it, so a restore from a snapshot opens RocksDB once instead of creating an empty
    database only to close it again.

    Raises:
        StateNotFoundError: ``version`` is not restorable, or a blob it needs is missing.
        CorruptStateError: a blob fails its checks, or a snapshot holds another version.
        StorageError: the blob store failed.
    """
    started = time.perf_counter()
    unusable: list[tuple[str, CorruptStateError | StateNotFoundError]] = []
    while True:
        copy = open_copy() if local_path is None or copy_exists(local_path) else None
        try:
            local = None if copy is None else copy.version
            held = (
                (local, copy.attempt)
                if copy is not None and local is not None and copy.root_id == root_id
                else None
            )
            plan = _plan(history, version, held, unusable)
            snap = _NO_SNAPSHOT
            if plan.base_kind == "snapshot":
                try:
                    copy, snap = _from_snapshot(
                        blobs, config, history, plan, (copy, local_path), open_copy, root_id
                    )
                except (CorruptStateError, StateNotFoundError) as exc:
                    unusable.append((history.index_key(plan.base), exc))
                    history = _without_snapshot(history, plan.base, exc)
                    continue  # _from_snapshot removed the half-restored copy
            elif copy is None:
                if local_path is not None and os.path.isdir(local_path):
                    # No database, but maybe the files of a restore cut short: never open
                    # a database among them (replayed onto, they could read back).
                    delete_copy_folder(local_path)
                copy = open_copy()
            elif plan.base_kind == "empty" and (copy.label is not None or copy.root_id):
                _log.info(
                    "discarding local copy of %s/%s at version %s (dirty=%s, root %s): "
                    "%s wanted",
                    history.operator, history.partition, copy.label, copy.dirty,
                    copy.root_id, version,
                )  # fmt: skip
                copy.destroy()
                copy = open_copy()
            replayed_bytes = _replay(blobs, config, copy, plan, history, root_id)
        except BaseException:
            if copy is not None:
                copy.close(flush=False)
            raise
        break
    info = RestoreInfo(
        version=version,
        base=plan.base,
        base_kind=plan.base_kind,
        changelogs_replayed=len(plan.replay),
        bytes_downloaded=replayed_bytes + snap.bytes_downloaded,
        duration_s=time.perf_counter() - started,
        files_downloaded=snap.files_downloaded,
        files_reused=snap.files_reused,
        bytes_reused=snap.bytes_reused,
    )
    if plan.base_kind != "local" or plan.replay:
        _log.info("restored %s/%s: %s", history.operator, history.partition, info)
    return copy, info


def _plan(
    history: StoreHistory,
    version: int,
    held: tuple[int, str] | None,
    unusable: list[tuple[str, CorruptStateError | StateNotFoundError]],
) -> RestorePlan:
    """The history's plan; when none is left after unusable snapshots were dropped, an
    error that names them and why (not only "version v does not exist").

    Raises:
        CorruptStateError: no plan, and a dropped snapshot was corrupt.
        StateNotFoundError: no plan (a dropped snapshot, if any, was missing).
    """
    try:
        return history.plan(version, held)
    except StateNotFoundError as exc:
        if not unusable:
            raise
        reasons = "; ".join(f"snapshot index {key} is unusable: {why}" for key, why in unusable)
        message = (
            f"version {version} of store {history.operator}/{history.partition} cannot be "
            f"restored: {reasons}; without it: {exc}"
        )
        if any(isinstance(why, CorruptStateError) for _, why in unusable):
            raise CorruptStateError(message) from unusable[-1][1]
        raise StateNotFoundError(message) from unusable[-1][1]


def _without_snapshot(history: StoreHistory, version: int, exc: Exception) -> StoreHistory:
    """Plan again without an unusable snapshot (invariant 6: a logged fallback)."""
    _log.warning(
        "snapshot %s of store %s/%s is unusable, falling back to an older snapshot or the "
        "changelogs: %s",
        version, history.operator, history.partition, exc,
    )  # fmt: skip
    return dataclasses.replace(history, snapshots=history.snapshots - {version})


def _from_snapshot(
    blobs: BlobStore,
    config: StoreConfig,
    history: StoreHistory,
    plan: RestorePlan,
    local: tuple[WorkingCopy | None, str | None],
    open_copy: Callable[[], WorkingCopy],
    root_id: str,
) -> tuple[WorkingCopy, RestoreMetrics]:
    """Restore the snapshot into the copy's directory (``local``: the open copy, or none
    and its directory) and open it.

    On a missing or corrupt blob the half-restored copy is removed before raising.
    """
    copy, path = local
    if copy is not None:
        copy.close(flush=False)
        path = copy.path
    assert path is not None, "restore_copy passes the open copy or its directory"
    forget_lineage(path)  # until the restore completes, the files are mixed
    unmark_copy(path)  # and no database: a restore cut short is resumed, not set aside
    try:
        checkpoint_id, snap = _restore_snapshot(blobs, config, history, plan, Path(path), root_id)
    except (CorruptStateError, StateNotFoundError):
        _remove_half_restored(copy, path)
        raise
    restored = open_copy()
    try:
        _check_restored(restored, plan, root_id, history)
        restored.set_lineage(checkpoint_id, plan.base)
    except CorruptStateError:
        restored.destroy()
        raise
    except BaseException:
        restored.close(flush=False)  # else this process could never open the copy again
        raise
    return restored, snap


def _remove_half_restored(copy: WorkingCopy | None, path: str) -> None:
    if copy is not None:
        copy.destroy()
        return
    delete_copy_folder(path)
    forget_lineage(path)


def _restore_snapshot(
    blobs: BlobStore,
    config: StoreConfig,
    history: StoreHistory,
    plan: RestorePlan,
    target: Path,
    root_id: str,
) -> tuple[str, RestoreMetrics]:
    """Make ``target`` hold the snapshot at ``plan.base`` (its index checked to be of this
    root, store, version and attempt); returns its checkpoint id."""
    key = history.index_key(plan.base)
    attempt = history.attempt(plan.base)
    index = load_index(
        blobs, history.operator, history.partition, plan.base, key=key,
        # The empty store has no attempt (a schema-1 index): only its store and version count.
        root_id=root_id if attempt else None, attempt=attempt or None,
        anonymous_ok=attempt in (LEGACY_ATTEMPT, ""),
    )  # fmt: skip
    metrics = restore_snapshot(blobs, index, target, io_threads=config.io_threads, index_blob=key)
    return index.checkpoint_id, metrics


def _check_restored(
    copy: WorkingCopy, plan: RestorePlan, root_id: str, history: StoreHistory
) -> None:
    """A restored snapshot must hold the version and root its index claims."""
    key = history.index_key(plan.base)
    if copy.label != plan.base or copy.root_id != root_id:
        raise CorruptStateError(
            f"snapshot {key} is not valid: expected the files of version {plan.base} of root "
            f"{root_id}, found version {copy.label} of root {copy.root_id}"
        )
    # The attempt comes from the authority: a snapshot-mode commit's checkpoint is taken
    # before its index (dirty), and a format-1 snapshot holds no attempt.
    copy.apply((), version=plan.base, root_id=root_id, attempt=history.attempt(plan.base))


def _replay(
    blobs: BlobStore,
    config: StoreConfig,
    copy: WorkingCopy,
    plan: RestorePlan,
    history: StoreHistory,
    root_id: str,
) -> int:
    """Download the plan's changelogs in parallel windows and apply them in order; each is
    checked to be the changelog the history names for its version (root, store, versions,
    attempt).

    Raises:
        StateNotFoundError: a changelog is missing (named, with the version it holds).
        CorruptStateError: a changelog fails its checks or belongs elsewhere.
    """
    if not plan.replay:
        if copy.label is None:
            copy.apply((), version=plan.version, root_id=root_id, attempt="")
        return 0
    downloaded = 0
    window = max(1, config.io_threads * 2)
    versions = list(plan.replay)
    for start in range(0, len(versions), window):
        batch = versions[start : start + window]
        keys = [history.changelog_key(v) for v in batch]
        length = prefix_length(config)  # a changelog of several parts is read part by part
        for v, key, data in zip(
            batch, keys, _download(blobs, batch, keys, plan, history, length), strict=True
        ):
            identity, legacy = history.changelog_identity(v, root_id)
            parts = changelog_parts(
                blobs, key, first=data, length=length, expected=(v, identity), anonymous_ok=legacy
            )
            downloaded += replay_changelog(
                copy, parts, version=v, root_id=root_id, attempt=history.attempt(v)
            )
    copy.flush()
    return downloaded


def _download(
    blobs: BlobStore,
    versions: list[int],
    keys: list[str],
    plan: RestorePlan,
    history: StoreHistory,
    length: int,
) -> list[bytes]:
    """The first ``length`` bytes of the changelogs ``keys``; a missing one is named with
    its version.

    Raises:
        StateNotFoundError: a changelog is missing.
    """
    try:
        return read_prefixes(blobs, keys, length)
    except StateNotFoundError as exc:
        missing = [(v, k) for v, k in zip(versions, keys, strict=True) if not _exists(blobs, k)]
        named = ", ".join(f"changelog {k} (version {v})" for v, k in missing) or str(exc)
        raise StateNotFoundError(
            f"version {plan.version} of store {history.operator}/{history.partition} cannot be "
            f"restored from base {plan.base}: {named} is missing"
        ) from exc


def _exists(blobs: BlobStore, key: str) -> bool:
    try:
        blobs.head(key)
    except StateNotFoundError:
        return False
    return True
