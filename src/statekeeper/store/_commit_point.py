"""The commit point of one store: the decision, against its manifests, of whether an attempt
may become a version, and the manifest write that makes it one.

A :class:`CommitPoint` keeps the newest manifest its store knows of (the one it read at open,
or wrote since), so a commit reads nothing unless another writer (a background snapshot, a
re-run, a zombie) wrote a manifest meanwhile: then its create-only write is refused, and the
newest manifest is listed, read, and the decision taken again (:mod:`statekeeper.manifest`).
A refused attempt whose changes equal, byte for byte, what the version already holds (a
re-run that changed nothing) adopts that content instead of failing, unless the version
belongs to another owner.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from statekeeper import phases
from statekeeper.changelog import Columns
from statekeeper.config import StoreConfig
from statekeeper.errors import CommitConflictError, StateKeeperError, StateNotFoundError
from statekeeper.manifest import (
    PLAIN_ORDER,
    STALE_AFTER_S,
    Kind,
    Order,
    SnapshotEntry,
    StoreManifest,
    apply,
    decide,
    fenced,
    names_snapshot,
    owns,
    read_newest_after_conflict,
    read_newest_manifest,
    with_snapshot,
    write_manifest,
)
from statekeeper.storage import BlobStore
from statekeeper.store._changelogs import changelog_parts, prefix_length

__all__ = ["CommitPoint", "check_order", "check_owner"]

_log = logging.getLogger("statekeeper.store")
_UPDATE_TRIES = 20


class CommitPoint:
    """The manifests of one (operator, partition) as its writer sees them.

    It belongs to one :class:`~statekeeper.store.StateStore`: its commits, the
    registration of its background snapshots and the base moves of GC in the same process
    take turns (a lock) and share the manifest each writes, instead of racing each other
    through the blob store (a commit every few milliseconds kept the others losing until
    they gave up, and the retained versions grew without bound).
    """

    def __init__(
        self,
        blobs: BlobStore,
        config: StoreConfig,
        *,
        root_id: str,
        operator: str,
        partition: int,
        manifest: StoreManifest,
        read_at: float | None = None,
    ) -> None:
        """``manifest``: the newest when it was read (``read_at``, ``time.monotonic()``;
        by default now)."""
        self._blobs = blobs
        self._config = config
        self._root_id = root_id
        self._operator = operator
        self._partition = partition
        self.manifest = manifest
        """The newest manifest known: read at open, or written or read since."""
        self._known_at = time.monotonic() if read_at is None else read_at
        self._lock = threading.RLock()

    def refresh(self) -> StoreManifest:
        """Read the newest manifest and return the newest known after it (a commit may have
        written a newer one meanwhile: the read does not hold up commits).

        Raises:
            StorageError: the read failed.
        """
        found = self._newest(none_yet=self.manifest.seq == 0)
        with self._lock:
            if found.seq >= self.manifest.seq:
                self._know(found)
            return self.manifest

    def update(self, change: Callable[[StoreManifest], StoreManifest | None]) -> StoreManifest:
        """Write ``change(newest)`` as the next manifest, taking turns with this store's
        commits; ``change`` returns ``None`` when there is nothing to write. A lost race
        (another process wrote the next manifest) applies ``change`` again to the newest.
        Returns the newest manifest known after it (the one written, if any).

        Raises:
            StateKeeperError: other writers won the next manifest too many times in a row.
            StorageError: reading or writing a manifest failed.
        """
        with self._lock:
            manifest = self._reread_if_stale() or self.manifest
            for _ in range(_UPDATE_TRIES):
                new = change(manifest)
                if new is None:
                    self._know(manifest)
                    return manifest
                try:
                    write_manifest(self._blobs, new)
                except CommitConflictError:
                    manifest = self._after_conflict(new)  # another process wrote one
                    continue
                self._know(new)
                return new
        raise StateKeeperError(
            f"the manifest of {self._operator}/{self._partition} changed {_UPDATE_TRIES} times "
            "in a row while writing the next one"
        )

    def register_snapshot(self, snapshot: SnapshotEntry, *, reused: str | None) -> bool:
        """Name ``snapshot`` in a new manifest, unless the newest refuses it (see
        :func:`~statekeeper.manifest.with_snapshot`); returns whether it was named.

        Raises:
            StateKeeperError: other writers won the next manifest too many times in a row.
            StorageError: reading or writing a manifest failed.
        """
        named = self.update(lambda m: with_snapshot(m, snapshot, reused=reused))
        return snapshot in named.snapshots

    def _reread_if_stale(self) -> StoreManifest | None:
        """The newest manifest if the known one is older than
        :data:`~statekeeper.manifest.STALE_AFTER_S` (GC may have deleted the manifests after
        it: its next sequence number must not be written again), else ``None``."""
        if time.monotonic() - self._known_at <= STALE_AFTER_S:
            return None
        return self._newest(none_yet=self.manifest.seq == 0)

    def _know(self, manifest: StoreManifest) -> None:
        """``manifest`` was just read or written: the newest known."""
        self.manifest, self._known_at = manifest, time.monotonic()

    def refuse_early(
        self, version: int, attempt: str, order: Order, columns: Columns, parent: str, owner: str
    ) -> str | None:
        """Refuse a commit of ``version`` that the known manifest already refuses, before
        anything is written (its fence and its final versions only grow); ``None``, or the
        attempt adopted when the version holds identical content already (see
        :meth:`publish`).

        Raises:
            CommitConflictError: the commit is refused.
            StorageError: reading or writing a manifest failed (the commit may be retried).
        """
        try:
            self.check(version, attempt, order, parent, owner)
        except CommitConflictError:
            with self._lock:
                adopted = self._adopt(version, columns, parent, owner, order)
            if adopted is None:
                raise
            return adopted
        return None

    def check(self, version: int, attempt: str, order: Order, parent: str, owner: str) -> None:
        """Raise if the known manifest refuses ``attempt`` of ``owner`` as ``version`` (built
        on ``parent``'s content of ``version - 1``); a commit whose blob must be written first
        and cannot be adopted (a snapshot) checks before it writes.

        Raises:
            CommitConflictError: the commit is refused.
        """
        decide(
            self.manifest, parent=version - 1, attempt=attempt, order=order,
            parent_attempt=parent, owner=owner,
        )  # fmt: skip

    def publish(
        self,
        version: int,
        attempt: str,
        order: Order,
        kind: Kind,
        blob: str,
        columns: Columns | None,
        parent: str,
        owner: str,
        *,
        reused: str | None = None,
    ) -> str | None:
        """Write the manifest naming ``attempt`` of ``owner`` as ``version``, built on
        ``parent``'s content of ``version - 1``: the commit point.

        A snapshot whose upload reused the file blobs of the snapshot ``reused`` is refused
        if the newest manifest names that snapshot no more (GC may have deleted the files).
        A manifest known for longer than :data:`~statekeeper.manifest.STALE_AFTER_S` is
        read again first: GC may have deleted the manifests after it.

        Returns ``None``, or the attempt adopted when another attempt of the same owner
        committed ``version`` first with identical content (``columns``; ``None``: nothing
        is adopted) on the same parent (see :meth:`_adopt`).

        Raises:
            CommitConflictError: the commit is refused (see
                :meth:`statekeeper.store.StateStore.commit`).
            StorageError: the manifest write failed (it may have landed: a retry decides).
        """
        with self._lock:
            newest = self._reread_if_stale()
            manifest = newest or self.manifest
            while True:
                if reused is not None and not names_snapshot(manifest, reused):
                    raise CommitConflictError(
                        f"the snapshot of version {version} of store {self._operator}/"
                        f"{self._partition} reused files of snapshot {reused}, which the store "
                        "no longer names: "
                        "garbage collection may delete them. Nothing was committed; a retry "
                        "uploads them again"
                    )
                try:
                    decision = decide(
                        manifest, parent=version - 1, attempt=attempt, order=order,
                        parent_attempt=parent, owner=owner,
                    )  # fmt: skip
                except CommitConflictError:
                    adopted = (
                        None
                        if columns is None
                        else self._adopt(version, columns, parent, owner, order, newest)
                    )
                    if adopted is None:
                        raise
                    return adopted
                if decision.action == "done":
                    self._know(manifest)
                    return None
                new = apply(
                    manifest, decision, attempt=attempt, order=order, kind=kind, blob=blob,
                    owner=owner,
                )  # fmt: skip
                try:
                    write_manifest(self._blobs, new)
                except CommitConflictError:
                    manifest = newest = self._after_conflict(new)
                    continue
                self._know(new)
                return None

    def _adopt(
        self,
        version: int,
        columns: Columns,
        parent: str,
        owner: str,
        order: Order,
        newest: StoreManifest | None = None,
    ) -> str | None:
        """The attempt whose identical content (``columns``, built on ``parent``) the newest
        manifest names as ``version``, now taken over by this attempt; ``None`` if there is
        none (the commit is refused).

        The known manifest may be stale: a newer attempt may have replaced the version
        since, and the commit would then be acknowledged for content that is no longer the
        version. So the newest manifest decides: ``newest`` if the caller has just read it,
        else it is read here. Adopting raises the store's fence to
        ``order`` if it is lower (one more manifest), so that an older attempt (a zombie of
        the run this one replaces) cannot append to versions this run has taken over, which
        would leave them final to it; a lost race for that manifest decides again.

        Raises:
            StorageError: reading or writing a manifest failed (the commit may be retried).
        """
        with phases.phase("upload"):
            while True:
                manifest = newest if newest is not None else self._newest()
                newest = None
                try:
                    adopted = self._identical(manifest, version, columns, parent, owner)
                except StateNotFoundError:
                    # The manifest read was already stale: a newer one moved the base past
                    # the version and GC deleted its blob. Decide again on the newest; a
                    # blob the newest still names is missing indeed, and not hidden.
                    newest = self._newest()
                    if _blob_of(newest, version) == _blob_of(manifest, version):
                        raise
                    continue
                if adopted is None:
                    return None
                if order > manifest.fence:
                    manifest = fenced(manifest, order)
                    try:
                        write_manifest(self._blobs, manifest)
                    except CommitConflictError:
                        newest = self._after_conflict(manifest)
                        continue
                self._know(manifest)
                return adopted

    def _after_conflict(self, lost: StoreManifest) -> StoreManifest:
        """The newest manifest after the write of ``lost`` lost its sequence number (past a
        damaged manifest there: :func:`~statekeeper.manifest.read_newest_after_conflict`)."""
        return read_newest_after_conflict(self._blobs, lost, root_id=self._root_id)

    def _newest(self, *, none_yet: bool = False) -> StoreManifest:
        """The newest manifest; with ``none_yet`` (the known one is the empty store's, from
        before the first commit), the known one if there is none."""
        found = read_newest_manifest(
            self._blobs, root_id=self._root_id, operator=self._operator, partition=self._partition
        )
        if found is None and none_yet:
            return self.manifest
        if found is None:
            raise StateKeeperError(
                f"the manifests of store {self._operator}/{self._partition} disappeared"
            )
        return found

    def _identical(
        self, manifest: StoreManifest, version: int, columns: Columns, parent: str, owner: str
    ) -> str | None:
        """The attempt holding ``version`` if it was built on ``parent``, holds exactly
        ``columns`` (a re-run that changed nothing) and ``owner`` may take it over."""
        entry = manifest.entry(version)
        if entry is None or entry.kind != "changelog" or entry.parent_attempt != parent:
            return None
        if not owns(owner, entry):
            return None
        key = entry.blob
        length = prefix_length(self._config)
        first = self._blobs.get_range(key, 0, length)
        parts = changelog_parts(self._blobs, key, first=first, length=length)
        done = 0
        for part in parts:  # a part at a time: the blob may be larger than memory allows
            if part.header.base_version != version - 1:
                return None
            if part.records != columns.records(done, done + len(part.records)):
                return None
            done += len(part.records)
        if done != len(columns):
            return None
        _log.info("version %s already committed with identical content: accepted", key)
        return entry.attempt


def _blob_of(manifest: StoreManifest, version: int) -> str | None:
    entry = manifest.entry(version)
    return None if entry is None else entry.blob


def check_order(order: object) -> Order:
    """``order`` if it is an :data:`~statekeeper.manifest.Order`.

    Raises:
        ValueError: it is not a tuple of 4 ints >= 0.
    """
    if (
        not isinstance(order, tuple)
        or len(order) != len(PLAIN_ORDER)
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in order)
    ):
        raise ValueError(
            "order must be a tuple of 4 ints >= 0 (generation, stage id, stage attempt, "
            f"task attempt), got {order!r}"
        )
    return order


MAX_OWNER_LENGTH = 255


def check_owner(owner: object) -> str:
    """``owner`` if it names an owner of versions.

    Raises:
        ValueError: it is not a non-empty str of at most 255 printable characters.
    """
    if (
        not isinstance(owner, str)
        or not 0 < len(owner) <= MAX_OWNER_LENGTH
        or not owner.isprintable()
    ):
        raise ValueError(
            f"owner must be a non-empty str of at most {MAX_OWNER_LENGTH} printable "
            f"characters (or None: anyone's), got {owner!r}"
        )
    return owner
