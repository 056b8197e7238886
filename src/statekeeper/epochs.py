"""Epoch manifests: after micro-batch ``b`` the driver records every partition's state.

``_epochs/<query id>/<b:020d>.json`` (key from :func:`statekeeper.layout.epoch_key`), written
create-only once all partitions of the batch committed (Dozer's ``finalize_epoch``; Samza's
checkpoint topic). Keyed by query, so two queries on one root each keep theirs. For each
operator and partition it names the committed version (``b + 1``), the blob that committed
it, and the newest snapshot index at or below it. It is the consistent cut that readers take
(:func:`consistent_cut`, from :func:`latest_manifest`: every partition of an operator at the
same batch; ``read_state`` and the CLI read it), and GC keeps every version named by each
query's newest manifest restorable (:func:`pinned_versions`). Nothing's correctness depends
on it: every fact in it can be re-derived from the store manifests.
Format-1 roots kept them at ``_epochs/<b:020d>.json``; they are still read.

Document (``formatVersion`` 2 adds ``crc32c``, of the canonical JSON without it)::

    {"format": "statekeeper.epoch", "formatVersion": 2, "epoch": 7,
     "queryId": "...", "runId": "...", "createdTimeMs": 1700000000000, "crc32c": 123,
     "operators": {"counts": {"partitions": 2, "stores": [
         {"partition": 0, "version": 8, "commitBlob": "counts/0/changelog/...8.changelog",
          "snapshotVersion": 5, "snapshotIndex": "counts/0/snapshot/...5.index.json"}, ...]}}}
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from statekeeper import layout
from statekeeper.checksum import check_sealed, seal
from statekeeper.errors import (
    CommitConflictError,
    ConfigMismatchError,
    CorruptStateError,
    StateNotFoundError,
)
from statekeeper.history import StoreHistory
from statekeeper.storage import BlobMeta, BlobStore

__all__ = [
    "Cut",
    "EpochManifest",
    "StoreEntry",
    "build_manifest",
    "consistent_cut",
    "latest_epoch",
    "latest_manifest",
    "newest_manifests",
    "pinned_versions",
    "read_manifest",
    "write_manifest",
]

_log = logging.getLogger(__name__)

FORMAT = "statekeeper.epoch"
FORMAT_VERSION = 2


@dataclass(frozen=True)
class StoreEntry:
    """One partition's state after the epoch."""

    partition: int
    version: int
    commit_blob: str | None
    snapshot_version: int | None
    snapshot_index: str | None


@dataclass(frozen=True)
class EpochManifest:
    """The state of every operator of one micro-batch in one checkpoint root."""

    epoch: int
    query_id: str
    run_id: str | None
    created_time_ms: int
    partitions: dict[str, int]
    """Operator -> partition count."""
    stores: dict[str, list[StoreEntry]]
    """Operator -> one entry per partition, in partition order."""

    def to_json(self) -> bytes:
        """The stored document."""
        doc = {
            "format": FORMAT,
            "formatVersion": FORMAT_VERSION,
            "epoch": self.epoch,
            "queryId": self.query_id,
            "runId": self.run_id,
            "createdTimeMs": self.created_time_ms,
            "operators": {
                op: {
                    "partitions": self.partitions[op],
                    "stores": [_entry_json(e) for e in self.stores[op]],
                }
                for op in sorted(self.stores)
            },
        }
        seal(doc)
        return json.dumps(doc, indent=1, sort_keys=True).encode("utf-8") + b"\n"

    @classmethod
    def from_json(cls, data: bytes, *, blob: str) -> EpochManifest:
        """Parse a stored manifest.

        Raises:
            CorruptStateError: not an epoch manifest (names ``blob``).
            ConfigMismatchError: written by a newer format version.
        """
        try:
            doc = json.loads(data)
            if doc.get("format") != FORMAT:
                raise ValueError("not an epoch manifest")
            version = int(doc["formatVersion"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptStateError(f"epoch manifest {blob} is not valid: {exc}") from exc
        if version > FORMAT_VERSION:
            raise ConfigMismatchError(
                f"epoch manifest {blob} has format version {version}; this statekeeper reads "
                f"versions <= {FORMAT_VERSION}: upgrade statekeeper"
            )
        if version >= 2:
            check_sealed(doc, what=f"epoch manifest {blob}")
        try:
            ops = doc["operators"]
            return cls(
                epoch=int(doc["epoch"]),
                query_id=str(doc["queryId"]),
                run_id=doc.get("runId"),
                created_time_ms=int(doc["createdTimeMs"]),
                partitions={op: int(o["partitions"]) for op, o in ops.items()},
                stores={op: [_entry(e) for e in o["stores"]] for op, o in ops.items()},
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptStateError(f"epoch manifest {blob} is not valid: {exc!r}") from exc

    def versions(self) -> dict[str, list[int]]:
        """Operator -> committed version per partition."""
        return {op: [e.version for e in entries] for op, entries in self.stores.items()}


def _entry_json(entry: StoreEntry) -> dict[str, Any]:
    return {
        "partition": entry.partition,
        "version": entry.version,
        "commitBlob": entry.commit_blob,
        "snapshotVersion": entry.snapshot_version,
        "snapshotIndex": entry.snapshot_index,
    }


def _entry(doc: Mapping[str, Any]) -> StoreEntry:
    snap = doc.get("snapshotVersion")
    return StoreEntry(
        partition=int(doc["partition"]),
        version=int(doc["version"]),
        commit_blob=doc.get("commitBlob"),
        snapshot_version=None if snap is None else int(snap),
        snapshot_index=doc.get("snapshotIndex"),
    )


def build_manifest(
    blobs: BlobStore,
    *,
    epoch: int,
    query_id: str,
    run_id: str | None,
    operators: Mapping[str, int],
    root_id: str,
) -> tuple[EpochManifest | None, str]:
    """Describe the root after ``epoch``: ``operators`` maps each operator to its partition
    count.

    Each partition's history (its newest store manifest, or its format-1 listing) gives the
    blob that committed version ``epoch + 1`` and the newest snapshot at or below it; never
    a task report, which for an attempt that another one replaced may come late and name a
    blob that is no longer committed. ``root_id`` is the root's (manifests are checked
    against it).

    Returns:
        The manifest, or ``None`` and the reason when some partition has not committed
        version ``epoch + 1``.

    Raises:
        StorageError: a listing or lookup failed.
    """
    version = epoch + 1
    stores: dict[str, list[StoreEntry]] = {}
    for op, count in operators.items():
        entries = []
        for p in range(count):
            history = StoreHistory.load(blobs, op, p, root_id=root_id)
            blob = _commit_blob(history, version)
            if blob is None:
                return None, f"partition {p} of operator {op!r} has not committed version {version}"
            snap = max((v for v in history.snapshots if v <= version), default=None)
            index = None if snap is None else history.index_key(snap)
            entries.append(StoreEntry(p, version, blob, snap, index))
        stores[op] = entries
    manifest = EpochManifest(
        epoch=epoch,
        query_id=query_id,
        run_id=run_id,
        created_time_ms=int(time.time() * 1000),
        partitions=dict(operators),
        stores=stores,
    )
    return manifest, ""


def _commit_blob(history: StoreHistory, version: int) -> str | None:
    """The blob that committed ``version`` (its changelog, or its snapshot index)."""
    if version in history.changelogs:
        return history.changelog_key(version)
    if version in history.snapshots:
        return history.index_key(version)
    return None


def write_manifest(blobs: BlobStore, manifest: EpochManifest) -> bool:
    """Write ``manifest`` create-only; False if that epoch's manifest exists already.

    An existing manifest with the same versions is a re-run of the epoch (a restarted query
    replays its last batch): nothing to do.

    Raises:
        CommitConflictError: the existing manifest records different versions.
        StorageError: the write failed.
    """
    key = layout.epoch_key(manifest.epoch, manifest.query_id)
    try:
        blobs.put(key, manifest.to_json())
        return True
    except CommitConflictError:
        existing = EpochManifest.from_json(blobs.get(key), blob=key)
        ours = manifest.versions()
        theirs = existing.versions()
        if all(theirs.get(op) == versions for op, versions in ours.items()):
            return False
        raise CommitConflictError(
            f"epoch manifest {key} exists with other versions ({theirs}) than this run's "
            f"({ours}): is another run of query {manifest.query_id} still writing?"
        ) from None


def read_manifest(blobs: BlobStore, epoch: int, query_id: str | None = None) -> EpochManifest:
    """Read the manifest of ``epoch`` of query ``query_id`` (``None``: of the one query, or
    the format-1 manifest, that has one for ``epoch``).

    Raises:
        StateNotFoundError: no manifest for ``epoch``.
        ValueError: ``query_id`` is ``None`` and several queries have one for ``epoch``.
        CorruptStateError, ConfigMismatchError: as :meth:`EpochManifest.from_json`.
    """
    if query_id is not None:
        key = layout.epoch_key(epoch, query_id)
        return EpochManifest.from_json(blobs.get(key), blob=key)
    keys = [meta.key for (_, e), meta in _epoch_metas(blobs).items() if e == epoch]
    if len(keys) > 1:
        raise ValueError(
            f"{len(keys)} queries have an epoch manifest for epoch {epoch} ({', '.join(keys)}): "
            "give the query id"
        )
    key = keys[0] if keys else layout.epoch_key(epoch)
    return EpochManifest.from_json(blobs.get(key), blob=key)


def latest_epoch(blobs: BlobStore, query_id: str | None = None) -> int | None:
    """The newest epoch with a manifest (of query ``query_id``, if given), or ``None``.

    Raises:
        StorageError: the listing failed.
    """
    return max(
        (e for q, e in _epoch_metas(blobs, query_id) if query_id is None or q == query_id),
        default=None,
    )


def latest_manifest(blobs: BlobStore, operator: str | None = None) -> EpochManifest | None:
    """The newest epoch manifest (by the time it was written) of any query that names
    ``operator`` (any operator if ``None``); ``None`` if none does. A damaged or unreadable
    newest manifest is skipped for the one before it.

    Raises:
        StorageError: the listing failed.
    """
    metas = _epoch_metas(blobs)
    # Newest first: across queries by when each was written, then by epoch.
    newest = sorted(metas.items(), key=lambda item: (item[1].last_modified, item[0][1]))
    for _, meta in reversed(newest):
        manifest = _readable(blobs, meta.key)
        if manifest is not None and (operator is None or operator in manifest.stores):
            return manifest
    return None


def newest_manifests(blobs: BlobStore) -> list[EpochManifest]:
    """Each query's newest readable epoch manifest (the format-1 ones count as one query);
    a damaged or unreadable one is skipped for the one before it.

    Raises:
        StorageError: the listing failed.
    """
    by_query: dict[str | None, list[tuple[int, str]]] = defaultdict(list)
    for (query, epoch), meta in _epoch_metas(blobs).items():
        by_query[query].append((epoch, meta.key))
    found = []
    for epochs in by_query.values():
        for _, key in sorted(epochs, reverse=True):
            manifest = _readable(blobs, key)
            if manifest is not None:
                found.append(manifest)
                break
    return found


def pinned_versions(blobs: BlobStore) -> dict[tuple[str, int], int]:
    """(operator, partition) -> the oldest version some query's newest epoch manifest names.

    GC keeps these restorable whatever ``retain_versions`` says: they are what
    :func:`consistent_cut` reads, also for a query that stopped long ago, or when one
    partition committed far ahead of the others.

    Raises:
        StorageError: the listing failed.
    """
    pins: dict[tuple[str, int], int] = {}
    for manifest in newest_manifests(blobs):
        for operator, entries in manifest.stores.items():
            for e in entries:
                key = (operator, e.partition)
                pins[key] = min(e.version, pins.get(key, e.version))
    return pins


@dataclass(frozen=True)
class Cut:
    """The versions of an operator's partitions that belong together, and where from."""

    versions: dict[int, int]
    """Partition -> version."""
    manifest: EpochManifest | None
    """The epoch manifest that named them; ``None``: the newest version every partition has."""
    reason: str = ""
    """Why no epoch manifest was used (``""`` when one was)."""

    def describe(self) -> str:
        """Where the versions come from, for messages."""
        if self.manifest is None:
            return f"the newest version every partition has ({self.reason})"
        return f"epoch {self.manifest.epoch} of query {self.manifest.query_id}"


def consistent_cut(
    blobs: BlobStore,
    operator: str,
    partitions: int,
    history: Callable[[int], StoreHistory],
    *,
    only: Iterable[int] | None = None,
) -> Cut:
    """The versions of ``operator`` to read together: those the newest epoch manifest that
    names it records (:func:`latest_manifest`), the state after the last micro-batch a query
    finished — not a batch that failed half way, even if some or all partitions committed it.

    Where there is none (a root written without Spark's listener: by the store API, or from
    Spark Connect), or it records another partition count, or a version it names is no
    longer restorable, or it is older than a micro-batch finished since (a partition two or
    more versions past it: its query ran on without writing manifests), the newest version
    every partition has is read instead, and why is logged (INFO without manifests,
    WARNING otherwise).

    Args:
        blobs: the root's blob store.
        operator: the operator.
        partitions: its partition count (P).
        history: the history of a partition (e.g. :meth:`StoreHistory.load`).
        only: the partitions to give versions for (default: all P); without a manifest,
            the newest version all of them have.

    Raises:
        StorageError: a listing or read failed.
        CorruptStateError: no manifest of some store is readable.
    """
    wanted = list(range(partitions)) if only is None else sorted(set(only))
    history = functools.cache(history)  # each partition's is read once, whoever asks
    manifest = latest_manifest(blobs, operator)
    named, reason = _named_versions(manifest, operator, partitions, wanted, history)
    if named is not None:
        assert manifest is not None
        reason = _stale(manifest, named, {p: _newest(history(p)) for p in wanted})
        if not reason:
            return Cut(named, manifest)
        named = None
    _log.log(
        logging.INFO if manifest is None else logging.WARNING,
        "operator %r: reading the newest version every partition has: %s",
        operator,
        reason,
    )
    common = min((_newest(history(p)) for p in wanted), default=0)
    return Cut(dict.fromkeys(wanted, common), None, reason)


def _named_versions(
    manifest: EpochManifest | None,
    operator: str,
    partitions: int,
    wanted: list[int],
    history: Callable[[int], StoreHistory],
) -> tuple[dict[int, int] | None, str]:
    """Partition -> the version ``manifest`` names, or ``None`` and why it cannot be read."""
    if manifest is None:
        return None, f"no epoch manifest names operator {operator!r}"
    which = f"epoch manifest {manifest.epoch} of query {manifest.query_id}"
    count = manifest.partitions.get(operator)
    if count != partitions:
        return None, f"{which} records {count} partitions, the root {partitions}"
    named = {e.partition: e.version for e in manifest.stores[operator]}
    versions: dict[int, int] = {}
    for p in wanted:
        if p not in named:
            return None, f"{which} names no version of partition {p}"
        try:
            history(p).plan(named[p], None)
        except StateNotFoundError as exc:
            return None, f"{which} names version {named[p]} of partition {p}: {exc}"
        versions[p] = named[p]
    return versions, ""


def _stale(manifest: EpochManifest, named: dict[int, int], newest: dict[int, int]) -> str:
    """Why ``manifest`` is older than a micro-batch finished since, or ``""``.

    Spark runs micro-batch ``b`` only once ``b - 1`` finished, so a partition at version
    ``v`` (committed by batch ``v - 1``) shows that batch ``v - 2`` finished: a manifest
    naming a version below ``v - 1`` missed the epochs since (written from Spark Connect,
    whose sessions have no listener, or while no listener ran). One version beyond it is
    no such sign: that batch may have failed after the commit, and will run again.
    """
    for p, version in sorted(newest.items()):
        if version - 1 > named[p]:
            return (
                f"epoch manifest {manifest.epoch} of query {manifest.query_id} names version "
                f"{named[p]} of partition {p}, which is at version {version}: the micro-batch "
                f"that committed version {version - 1} finished since, with no epoch manifest "
                "(a run from Spark Connect, or without the listener)"
            )
    return ""


def _newest(history: StoreHistory) -> int:
    versions = history.restorable_versions()
    return versions[-1] if versions else 0


def _readable(blobs: BlobStore, key: str) -> EpochManifest | None:
    """The manifest stored at ``key``, or ``None`` (logged) if it is damaged or gone."""
    try:
        return EpochManifest.from_json(blobs.get(key), blob=key)
    except (CorruptStateError, ConfigMismatchError, StateNotFoundError) as exc:
        _log.warning("skipping epoch manifest %s: %s", key, exc)
        return None


def _epoch_metas(
    blobs: BlobStore, query_id: str | None = None
) -> dict[tuple[str | None, int], BlobMeta]:
    """(query id, epoch) -> every epoch manifest (of one query if given)."""
    found: dict[tuple[str | None, int], BlobMeta] = {}
    for meta in blobs.list(layout.epochs_prefix(query_id)):
        parsed = layout.parse_epoch_key(meta.key)
        if parsed is not None:
            found[parsed] = meta
    return found
