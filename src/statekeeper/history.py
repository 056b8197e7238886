"""Which versions of a store exist in the blob store, and how to rebuild one of them.

The history of a store is derived here and nowhere else (:meth:`StoreHistory.load`, or one
listing of the whole root with :class:`RootListing`). A store written by format 2 has a
manifest chain (:mod:`statekeeper.manifest`): its newest manifest is the one authority, and
names the blob of every retained version and every restorable snapshot. A store written by
format 1 (statekeeper 0.1) has none: its history is derived from the names of its changelogs
and snapshot indexes, as 0.1 did, until its first format-2 commit writes a manifest
(:meth:`StoreHistory.as_manifest`).

A version ``v`` is restorable when some base — the empty store (version 0), a snapshot, or a
local working copy holding the same attempt — is at ``b <= v`` and the changelogs
``b+1 .. v`` all exist.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from statekeeper import layout
from statekeeper.changelog import ChangelogIdentity
from statekeeper.errors import CorruptStateError, StateKeeperError, StateNotFoundError
from statekeeper.manifest import (
    LEGACY_ATTEMPT,
    PLAIN_ORDER,
    SnapshotEntry,
    StoreManifest,
    VersionEntry,
    read_newest_manifest,
)
from statekeeper.snapshot import iter_files, load_index
from statekeeper.storage import BlobMeta, BlobStore

__all__ = [
    "ChangeStretch",
    "RestorePlan",
    "RootListing",
    "StoreHistory",
    "lost_manifests",
    "ranges",
]


def lost_manifests(operator: str, partition: int, keys: Iterable[str]) -> str | None:
    """Why a store without any manifest must not be read as empty: it holds commit blobs
    named per attempt (format 2) and commit metrics, which a store writes only for commits
    a manifest registered, so its manifests were deleted (a lifecycle rule, a partial copy
    of the bucket). ``None`` otherwise: per-attempt blobs alone may all be orphans (first
    commits that never registered, and commits refused on top of them; a rescale that died
    before its commit point), and a store of statekeeper 0.1 (format-1 names) never had a
    manifest. ``keys`` are the store's blob keys, its metrics among them."""
    attempt: str | None = None
    metrics = False
    for key in keys:
        if layout.parse_changelog_key(key) is not None:
            return None  # a store of statekeeper 0.1
        if layout.parse_snapshot_key(key) is not None:
            return None
        if layout.parse_metrics_key(key) is not None:
            metrics = True
        elif attempt is None and (
            layout.parse_attempt_changelog_key(key) or layout.parse_attempt_snapshot_key(key)
        ):
            attempt = key
    if attempt is None or not metrics:
        return None
    return (
        f"store {operator}/{partition} holds commit blobs ({attempt}) and commit metrics, "
        "which only registered commits write, but no manifest "
        f"({layout.manifest_prefix(operator, partition)}...): its manifests were deleted or "
        "not copied, and its versions cannot be told without them. Restore the manifest "
        "blobs (from your object store's versions or a copy); until then the store is "
        "neither restored, committed to nor collected"
    )


@dataclass
class RootListing:
    """Every blob of a root, from one listing, grouped by store: a root-wide view for tools
    that would otherwise list each store (``info``, ``stats``, ``versions``)."""

    blobs: list[BlobMeta]
    source: BlobStore | None = None
    """The blob store listed (to read manifests); ``None``: format 1 names only."""
    root_id: str = ""
    stores: dict[tuple[str, int], list[BlobMeta]] = field(default_factory=dict)
    epochs: list[tuple[str | None, int]] = field(default_factory=list)
    """(query id, epoch) of every epoch manifest (query ``None``: a format-1 one), sorted."""
    _histories: dict[tuple[str, int], StoreHistory] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, blobs: BlobStore, *, root_id: str = "") -> RootListing:
        """List ``blobs`` once and group the keys; ``root_id`` (the root metadata's) checks
        the manifests read later.

        Raises:
            StorageError: the listing failed.
        """
        listing = cls(blobs.list(""), blobs, root_id)
        for meta in listing.blobs:
            store = layout.parse_store_key(meta.key)
            if store is not None:
                listing.stores.setdefault(store, []).append(meta)
            elif (epoch := layout.parse_epoch_key(meta.key)) is not None:
                listing.epochs.append(epoch)
        listing.epochs.sort(key=lambda e: (e[0] or "", e[1]))
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
        history = self.history(operator, partition)
        plan = history.plan(version, None)
        sizes = self.sizes(operator, partition)
        total = sum(sizes.get(history.changelog_key(v), 0) for v in plan.replay)
        if plan.base_kind == "snapshot":
            key = history.index_key(plan.base)
            try:
                index = load_index(blobs, operator, partition, plan.base, key=key)
            except StateKeeperError:
                return None
            total += sizes.get(key, 0)
            total += sum(f.size_in_bytes for _, f in iter_files(index.dir_index))
        return total

    def history(self, operator: str, partition: int) -> StoreHistory:
        """The committed versions of one store, as :meth:`StoreHistory.load` would find them
        (reads the store's newest manifest, if it has one; once per store).

        Raises:
            CorruptStateError: no manifest of the store is readable.
            StorageError: reading the manifest failed.
        """
        found = self._histories.get((operator, partition))
        if found is None:
            keys = [m.key for m in self.metas(operator, partition)]
            found = StoreHistory.from_keys(
                operator, partition, keys, blobs=self.source, root_id=self.root_id
            )
            self._histories[(operator, partition)] = found
        return found


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
class ChangeStretch:
    """Versions ``start + 1 .. end`` of a store, as a change feed reads them."""

    start: int
    end: int
    from_changelogs: bool
    """True: the changelog of each version, in order. False: those versions have no
    changelog (collected by GC, or committed as snapshots in ``mode="snapshot"``), so only
    the net difference between the restored versions ``start`` and ``end`` is known."""


@dataclass(frozen=True)
class StoreHistory:
    """The committed versions of one store: from its newest manifest (format 2), or from the
    names of its blobs (format 1, ``manifest`` is ``None``)."""

    operator: str
    partition: int
    changelogs: frozenset[int]
    snapshots: frozenset[int] = frozenset()
    manifest: StoreManifest | None = None
    empty_base: bool | None = None
    """Whether the empty store (version 0) is a base; ``None``: derived as format 1 does."""
    keys: dict[int, str] = field(default_factory=dict, compare=False)
    """Version -> changelog blob key, where it is not format 1's name."""
    index_keys: dict[int, str] = field(default_factory=dict, compare=False)
    """Version -> snapshot index key, where it is not format 1's name."""
    attempts: dict[int, str] = field(default_factory=dict, compare=False)
    """Version -> the attempt whose content it is (format 1: :data:`LEGACY_ATTEMPT`)."""
    skipped_manifests: tuple[str, ...] = field(default=(), compare=False)
    """Newer manifests that failed their checks and were skipped (see
    :func:`read_newest_manifest`): a version only they recorded is not restorable."""

    @classmethod
    def load(cls, blobs: BlobStore, operator: str, partition: int, *, root_id: str) -> StoreHistory:
        """The store's newest manifest (one listing, one read) or, for a store without one,
        a listing of its changelogs and snapshot indexes (not its many file blobs).

        Raises:
            CorruptStateError: the store has manifests and none is readable, or has lost
                them (:func:`lost_manifests`).
            StorageError: a listing or read failed.
        """
        skipped: list[str] = []
        manifest = read_newest_manifest(
            blobs, root_id=root_id, operator=operator, partition=partition, skipped=skipped
        )
        if manifest is not None:
            return cls.from_manifest(manifest, skipped=skipped)
        metas = [
            *blobs.list(layout.changelog_prefix(operator, partition)),
            *blobs.list(layout.snapshot_prefix(operator, partition)),
        ]
        return cls.from_keys(operator, partition, (m.key for m in metas))

    @classmethod
    def from_keys(
        cls,
        operator: str,
        partition: int,
        keys: Iterable[str],
        *,
        blobs: BlobStore | None = None,
        root_id: str = "",
    ) -> StoreHistory:
        """The history the blob keys ``keys`` of one store describe (other keys ignored);
        with ``blobs``, a store with manifests is read from its newest one.

        Raises:
            CorruptStateError: the store has manifests and none is readable, or has lost
                them (:func:`lost_manifests`).
            StorageError: reading a manifest failed.
        """
        keys = list(keys)
        if blobs is not None:
            skipped: list[str] = []
            manifest = read_newest_manifest(
                blobs, root_id=root_id, operator=operator, partition=partition, keys=keys,
                skipped=skipped,
            )  # fmt: skip
            if manifest is not None:
                return cls.from_manifest(manifest, skipped=skipped)
        if (lost := lost_manifests(operator, partition, keys)) is not None:
            raise CorruptStateError(lost)
        changelogs: set[int] = set()
        snapshots: set[int] = set()
        for key in keys:
            if (v := layout.parse_changelog_key(key)) is not None:
                changelogs.add(v)
            elif (v := layout.parse_snapshot_key(key)) is not None:
                snapshots.add(v)
        return cls(operator, partition, frozenset(changelogs), frozenset(snapshots))

    @classmethod
    def from_manifest(cls, manifest: StoreManifest, *, skipped: Sequence[str] = ()) -> StoreHistory:
        """The history one manifest states (``skipped``: the newer, damaged manifests
        skipped to reach it)."""
        entries = manifest.versions
        snapshots = {s.version: s for s in manifest.snapshots}
        attempts = {e.version: e.attempt for e in entries}
        attempts.update({v: s.attempt for v, s in snapshots.items() if v not in attempts})
        return cls(
            manifest.operator,
            manifest.partition,
            frozenset(e.version for e in entries if e.kind == "changelog"),
            frozenset(snapshots),
            manifest=manifest,
            empty_base=manifest.base == 0,
            keys={e.version: e.blob for e in entries if e.kind == "changelog"},
            index_keys={v: s.index_blob for v, s in snapshots.items()},
            attempts=attempts,
            skipped_manifests=tuple(skipped),
        )

    def changelog_key(self, version: int) -> str:
        """The key of the changelog of ``version``."""
        key = self.keys.get(version)
        return key or layout.changelog_key(self.operator, self.partition, version)

    def index_key(self, version: int) -> str:
        """The key of the snapshot index of ``version``."""
        key = self.index_keys.get(version)
        return key or layout.snapshot_index_key(self.operator, self.partition, version)

    def attempt(self, version: int) -> str:
        """The attempt whose content ``version`` is (``""`` for the empty store)."""
        if version == 0:
            return ""
        # A version a manifest does not retain has no known attempt: no local copy matches.
        return self.attempts.get(version, LEGACY_ATTEMPT if self.manifest is None else "")

    def changelog_identity(self, version: int, root_id: str) -> tuple[ChangelogIdentity, bool]:
        """What the changelog of ``version`` must say it is (root, store, attempt), and
        whether a blob without identity is acceptable there (a version of statekeeper 0.1)."""
        attempt = self.attempt(version)
        identity = ChangelogIdentity(root_id, self.operator, self.partition, attempt)
        return identity, attempt == LEGACY_ATTEMPT

    def as_manifest(self, root_id: str) -> StoreManifest:
        """The manifest a store's first format-2 commit builds on: this history's own, or,
        for a format-1 store, seq 0 stating the same versions (never written as such: the
        commit writes seq 1 with its own entry added).

        Raises:
            StateNotFoundError: the format-1 store has no restorable version.
        """
        if self.manifest is not None:
            return self.manifest
        empty = StoreManifest(0, root_id, self.operator, self.partition)
        if not (self.changelogs or self.snapshots):
            return empty
        latest = self.latest()
        base = self.plan(latest, None).base
        versions = tuple(
            VersionEntry(
                version=v,
                attempt=LEGACY_ATTEMPT,
                order=PLAIN_ORDER,
                kind="changelog" if v in self.changelogs else "snapshot",
                blob=self.changelog_key(v) if v in self.changelogs else self.index_key(v),
                parent_attempt="" if v == 1 else LEGACY_ATTEMPT,
                committed_time_ms=0,
            )
            for v in range(base + 1, latest + 1)
        )
        snapshots = tuple(
            SnapshotEntry(v, LEGACY_ATTEMPT, self.index_key(v))
            for v in sorted(self.snapshots)
            if base <= v <= latest
        )
        return StoreManifest(
            0, root_id, self.operator, self.partition, base=base, versions=versions,
            snapshots=snapshots,
        )  # fmt: skip

    @property
    def newest_snapshot(self) -> int | None:
        """The newest snapshot version, if any."""
        return max(self.snapshots) if self.snapshots else None

    def _bases(self) -> list[int]:
        """Versions a rebuild can start from without a local copy."""
        bases = set(self.snapshots)
        if self.empty_base is None:
            if 1 in self.changelogs or not (self.changelogs or self.snapshots):
                bases.add(0)
        elif self.empty_base:
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

    def plan(self, version: int, local: tuple[int, str] | None) -> RestorePlan:
        """The cheapest way to bring a copy holding ``local`` (version, attempt) to ``version``.

        The base is the newest of: the local copy, a snapshot, the empty store — among those
        at or below ``version`` from which the changelogs reach it; on a tie the local copy
        wins (nothing to download). A local copy is used only if it holds the attempt that
        is the authority for its version (after a re-run replaced it, it holds content that
        lost); one ahead of ``version`` is never used: it holds changes of later commits.

        Raises:
            StateNotFoundError: ``version`` was never committed or is no longer restorable.
        """
        candidates: list[tuple[int, int, str]] = []
        if (
            local is not None
            and local[1] == self.attempt(local[0])
            and local[0] <= version <= self._chain_end(local[0])
        ):
            candidates.append((local[0], 2, "local"))
        for base in self._bases():
            if base <= version <= self._chain_end(base):
                candidates.append((base, 1, "snapshot" if base in self.snapshots else "empty"))
        if candidates:
            base, _, kind = max(candidates)
            return RestorePlan(version, base, kind, tuple(range(base + 1, version + 1)))
        raise StateNotFoundError(
            f"version {version} of store {self.operator}/{self.partition} does not exist: "
            f"restorable versions are {ranges(set(self.restorable_versions())) or 'none'}"
            + self._what_is_missing(version)
        )

    def change_stretches(self, from_version: int, to_version: int) -> tuple[ChangeStretch, ...]:
        """How to read the changes that turn ``from_version`` into ``to_version`` (versions
        ``from_version + 1 .. to_version``): runs of versions whose changelogs this history
        names (the attempts the manifest records, so along the store's lineage), and, in
        between, runs without changelogs, bridged by the difference of two restored versions.

        Raises:
            ValueError: ``from_version`` is after ``to_version``.
            StateNotFoundError: ``from_version``, ``to_version`` or a version that ends a run
                without changelogs is not restorable (GC collected it, or it was never
                committed); the message names the restorable versions.
        """
        if from_version > to_version:
            raise ValueError(
                f"expected from_version <= to_version, got {from_version} > {to_version}"
            )
        self.plan(from_version, None)
        self.plan(to_version, None)
        stretches: list[ChangeStretch] = []
        v = from_version
        while v < to_version:
            start, logged = v, v + 1 in self.changelogs
            while v < to_version and (v + 1 in self.changelogs) == logged:
                v += 1
            if not logged:
                self.plan(v, None)
            stretches.append(ChangeStretch(start, v, logged))
        return tuple(stretches)

    def _what_is_missing(self, version: int) -> str:
        """For an error: what a restore of the committed ``version`` lacks (the first
        changelog missing after the newest base below it, or a base); ``""`` if ``version``
        was never committed."""
        committed = self.changelogs | self.snapshots
        if not committed or version > max(committed):
            if self.skipped_manifests:
                return (
                    f"; the store's newest manifest {self.skipped_manifests[0]} failed its "
                    "checks and was skipped: a version only it recorded cannot be restored "
                    "(`statekeeper verify` names the damage)"
                )
            return ""
        below = [b for b in self._bases() if b <= version]
        if not below:
            return f"; no snapshot at or below version {version} (nor changelog 1) exists"
        base = max(below)
        gap = next((v for v in range(base + 1, version + 1) if v not in self.changelogs), None)
        if gap is None:
            return ""
        return f"; changelog {self.changelog_key(gap)} (version {gap}) is missing"


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
