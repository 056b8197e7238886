"""Which versions of a store exist in the blob store, and how to rebuild one of them.

The history of a store is derived here and nowhere else: from a listing of the store
(:meth:`StoreHistory.load`) or from one listing of the whole root (:class:`RootListing`).

A version ``v`` is restorable when some base — the empty store (version 0), a snapshot, or a
local working copy — is at ``b <= v`` and the changelogs ``b+1 .. v`` all exist.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from statekeeper import layout
from statekeeper.errors import StateKeeperError, StateNotFoundError
from statekeeper.snapshot import iter_files, load_index
from statekeeper.storage import BlobMeta, BlobStore

__all__ = ["RestorePlan", "RootListing", "StoreHistory", "ranges"]


@dataclass
class RootListing:
    """Every blob of a root, from one listing, grouped by store: a root-wide view for tools
    that would otherwise list each store (``info``, ``stats``, ``versions``)."""

    blobs: list[BlobMeta]
    stores: dict[tuple[str, int], list[BlobMeta]] = field(default_factory=dict)
    epochs: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, blobs: BlobStore) -> RootListing:
        """List ``blobs`` once and group the keys.

        Raises:
            StorageError: the listing failed.
        """
        listing = cls(blobs.list(""))
        for meta in listing.blobs:
            store = layout.parse_store_key(meta.key)
            if store is not None:
                listing.stores.setdefault(store, []).append(meta)
            elif (epoch := layout.parse_epoch_key(meta.key)) is not None:
                listing.epochs.append(epoch)
        listing.epochs.sort()
        return listing

    def partitions(self, operator: str) -> list[int]:
        """Partitions of ``operator`` that hold at least one blob."""
        return sorted(p for op, p in self.stores if op == operator)

    def metas(self, operator: str, partition: int) -> list[BlobMeta]:
        """The blobs of one store (empty if it holds none)."""
        return self.stores.get((operator, partition), [])

    def sizes(self, operator: str, partition: int) -> dict[str, int]:
        """Blob key -> size, for the blobs of one store."""
        return {m.key: m.size for m in self.metas(operator, partition)}

    def restore_bytes(
        self, blobs: BlobStore, operator: str, partition: int, version: int
    ) -> int | None:
        """What restoring ``version`` onto an empty disk downloads: the snapshot it starts
        from (its index and files) and the changelogs after it; ``None`` if the snapshot's
        index cannot be read (the restore itself reports that, or falls back). For
        progress bars: an estimate never fails a command.

        Raises:
            StateNotFoundError: ``version`` is not restorable.
        """
        plan = self.history(operator, partition).plan(version, None)
        sizes = self.sizes(operator, partition)
        total = sum(sizes.get(layout.changelog_key(operator, partition, v), 0) for v in plan.replay)
        if plan.base_kind == "snapshot":
            try:
                index = load_index(blobs, operator, partition, plan.base)
            except StateKeeperError:
                return None
            total += sizes.get(layout.snapshot_index_key(operator, partition, plan.base), 0)
            total += sum(f.size_in_bytes for _, f in iter_files(index.dir_index))
        return total

    def history(self, operator: str, partition: int) -> StoreHistory:
        """The committed versions of one store, as :meth:`StoreHistory.load` would list them."""
        return StoreHistory.from_keys(
            operator, partition, (m.key for m in self.metas(operator, partition))
        )


@dataclass(frozen=True)
class RestorePlan:
    """How to bring a local copy to ``version``."""

    version: int
    base: int
    """The version to start from."""
    base_kind: str
    """``"local"`` (the working copy as it is), ``"snapshot"`` (restore the snapshot at
    ``base`` into the working copy, reusing identical files) or ``"empty"`` (a new copy)."""
    replay: tuple[int, ...]
    """Changelog versions to apply, in order."""


@dataclass(frozen=True)
class StoreHistory:
    """The committed versions of one store, as listed from the blob store."""

    operator: str
    partition: int
    changelogs: frozenset[int]
    snapshots: frozenset[int] = frozenset()

    @classmethod
    def load(cls, blobs: BlobStore, operator: str, partition: int) -> StoreHistory:
        """List the store's changelogs and snapshot indexes (not its many file blobs).

        Raises:
            StorageError: a listing failed.
        """
        metas = [
            *blobs.list(layout.changelog_prefix(operator, partition)),
            *blobs.list(layout.snapshot_prefix(operator, partition)),
        ]
        return cls.from_keys(operator, partition, (m.key for m in metas))

    @classmethod
    def from_keys(cls, operator: str, partition: int, keys: Iterable[str]) -> StoreHistory:
        """The history the blob keys ``keys`` of one store describe (other keys ignored)."""
        changelogs: set[int] = set()
        snapshots: set[int] = set()
        for key in keys:
            if (v := layout.parse_changelog_key(key)) is not None:
                changelogs.add(v)
            elif (v := layout.parse_snapshot_key(key)) is not None:
                snapshots.add(v)
        return cls(operator, partition, frozenset(changelogs), frozenset(snapshots))

    @property
    def newest_snapshot(self) -> int | None:
        """The newest snapshot version, if any."""
        return max(self.snapshots) if self.snapshots else None

    def _bases(self) -> list[int]:
        """Versions a rebuild can start from without a local copy."""
        bases = set(self.snapshots)
        if 1 in self.changelogs or not (self.changelogs or self.snapshots):
            bases.add(0)
        return sorted(bases)

    def _chain_end(self, base: int) -> int:
        """The highest version reachable from ``base`` by contiguous changelogs."""
        v = base
        while v + 1 in self.changelogs:
            v += 1
        return v

    def restorable_versions(self) -> list[int]:
        """Every version that can be rebuilt from the blob store alone, ascending."""
        out: set[int] = set()
        for base in self._bases():
            out.update(range(base, self._chain_end(base) + 1))
        return sorted(out)

    def latest(self) -> int:
        """The newest restorable version.

        Raises:
            StateNotFoundError: nothing is restorable (every base was lost).
        """
        versions = self.restorable_versions()
        if not versions:
            raise StateNotFoundError(
                f"store {self.operator}/{self.partition} has no restorable version: "
                f"changelogs {ranges(self.changelogs)} exist, but none starts at version 1"
            )
        return versions[-1]

    def plan(self, version: int, local_version: int | None) -> RestorePlan:
        """The cheapest way to bring a copy at ``local_version`` to ``version``.

        The base is the newest of: the local copy, a snapshot, the empty store — among those
        at or below ``version`` from which the changelogs reach it; on a tie the local copy
        wins (nothing to download). A local copy ahead of ``version`` is never used: it holds
        changes of later commits.

        Raises:
            StateNotFoundError: ``version`` was never committed or is no longer restorable.
        """
        candidates: list[tuple[int, int, str]] = []
        if local_version is not None and local_version <= version <= self._chain_end(local_version):
            candidates.append((local_version, 2, "local"))
        for base in self._bases():
            if base <= version <= self._chain_end(base):
                candidates.append((base, 1, "snapshot" if base in self.snapshots else "empty"))
        if candidates:
            base, _, kind = max(candidates)
            return RestorePlan(version, base, kind, tuple(range(base + 1, version + 1)))
        raise StateNotFoundError(
            f"version {version} of store {self.operator}/{self.partition} does not exist: "
            f"restorable versions are {ranges(set(self.restorable_versions())) or 'none'}"
        )


def ranges(values: set[int] | frozenset[int]) -> str:
    """Render ``{0,1,2,5}`` as ``0-2, 5`` for error messages."""
    if not values:
        return ""
    ordered = sorted(values)
    parts: list[str] = []
    start = prev = ordered[0]
    for v in ordered[1:]:
        if v != prev + 1:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = v
        prev = v
    parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(parts)
