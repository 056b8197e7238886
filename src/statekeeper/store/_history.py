"""Which versions of a store exist in the blob store, and how to rebuild one of them.

A version ``v`` is restorable when some base — the empty store (version 0), a snapshot, or a
local working copy — is at ``b <= v`` and the changelogs ``b+1 .. v`` all exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from statekeeper import layout
from statekeeper.errors import StateNotFoundError
from statekeeper.storage import BlobStore

__all__ = ["RestorePlan", "StoreHistory"]


@dataclass(frozen=True)
class RestorePlan:
    """How to bring a local copy to ``version``."""

    version: int
    base: int
    """The version to start from."""
    base_kind: str
    """``"local"`` (the working copy as it is), ``"empty"`` (a new, empty copy)."""
    replay: tuple[int, ...]
    """Changelog versions to apply, in order."""


@dataclass(frozen=True)
class StoreHistory:
    """The committed versions of one store, as listed from the blob store."""

    operator: str
    partition: int
    changelogs: frozenset[int]

    @classmethod
    def load(cls, blobs: BlobStore, operator: str, partition: int) -> StoreHistory:
        """List the store's changelogs.

        Raises:
            StorageError: the listing failed.
        """
        versions = {
            v
            for meta in blobs.list(layout.changelog_prefix(operator, partition))
            if (v := layout.parse_changelog_key(meta.key)) is not None
        }
        return cls(operator, partition, frozenset(versions))

    def _bases(self) -> list[int]:
        """Versions a rebuild can start from without a local copy."""
        if not self.changelogs or 1 in self.changelogs:
            return [0]
        return []

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
                f"changelogs {_ranges(self.changelogs)} exist, but none starts at version 1"
            )
        return versions[-1]

    def plan(self, version: int, local_version: int | None) -> RestorePlan:
        """The cheapest way to bring a copy at ``local_version`` to ``version``.

        A local copy ahead of ``version`` is never used: it holds changes of later commits.

        Raises:
            StateNotFoundError: ``version`` was never committed or is no longer restorable.
        """
        if local_version is not None and local_version <= version <= self._chain_end(local_version):
            replay = tuple(range(local_version + 1, version + 1))
            return RestorePlan(version, local_version, "local", replay)
        for base in sorted(self._bases(), reverse=True):
            if base <= version <= self._chain_end(base):
                return RestorePlan(version, base, "empty", tuple(range(base + 1, version + 1)))
        raise StateNotFoundError(
            f"version {version} of store {self.operator}/{self.partition} does not exist: "
            f"restorable versions are {_ranges(set(self.restorable_versions())) or 'none'}"
        )


def _ranges(values: set[int] | frozenset[int]) -> str:
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
