"""Which versions of a store exist in the blob store, and how to rebuild one of them.

A version ``v`` is restorable when some base — the empty store (version 0), a snapshot, or a
local working copy — is at ``b <= v`` and the changelogs ``b+1 .. v`` all exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from statekeeper import layout
from statekeeper.errors import StateNotFoundError
from statekeeper.storage import BlobStore

__all__ = ["RestorePlan", "StoreHistory", "ranges"]


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
        changelogs = {
            v
            for meta in blobs.list(layout.changelog_prefix(operator, partition))
            if (v := layout.parse_changelog_key(meta.key)) is not None
        }
        snapshots = {
            v
            for meta in blobs.list(layout.snapshot_prefix(operator, partition))
            if (v := layout.parse_snapshot_key(meta.key)) is not None
        }
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
