"""Verification of a checkpoint root: every reference, and with ``deep`` every checksum.

Shallow checks read only headers and listings: every changelog's header and size, every
snapshot index (parsed strictly), every file blob an index references (present, with the
chunk size the index implies), and that every committed version is restorable. Deep checks
download everything and verify every CRC32C: changelog envelopes and whole files against
their index.

Identity and lineage: every changelog header and snapshot index must name the root, store,
version and attempt it is stored for (the manifest's entry; for a format-1 store, its key),
so a blob copied over another's name is reported; the newest manifest must be readable (a
damaged newer one, which readers skip, is reported), and its chain of versions is checked
as it is read. A garbage collection that died half way is not damage: blobs of versions
below the oldest base from which the newest version is restorable are what GC removes (its
next run finishes the job), so they are listed in :attr:`VerifyReport.expired`, never as
problems.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TypeVar

import google_crc32c

from statekeeper import layout
from statekeeper.changelog import (
    ChangelogIdentity,
    check_identity,
    part_headers,
    read_changelog,
)
from statekeeper.errors import CorruptStateError, StateKeeperError, StateNotFoundError
from statekeeper.history import StoreHistory, lost_manifests, ranges
from statekeeper.manifest import (
    LEGACY_ATTEMPT,
    StoreManifest,
    decode_manifest,
    read_newest_manifest,
)
from statekeeper.metrics import decode_commit_metrics
from statekeeper.snapshot import (
    FileIndex,
    SnapshotIndex,
    SnapshotMetadata,
    check_metadata,
    iter_files,
)
from statekeeper.storage import BlobMeta, BlobStore

__all__ = ["Problem", "TableCheck", "VerifyReport", "verify_root"]

_T = TypeVar("_T")

TableCheck = Callable[[list[Path]], list[str]]
"""Given SST files, the names of those RocksDB cannot read whole."""

_log = logging.getLogger("statekeeper.verify")

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a root."""

    store: str
    blob: str
    kind: str
    """``"missing"``, ``"corrupt"`` or ``"unrestorable"`` (``"expired"`` in
    :attr:`VerifyReport.expired`)."""
    message: str


@dataclass
class VerifyReport:
    """The result of :func:`verify_root`."""

    deep: bool
    problems: list[Problem] = field(default_factory=list)
    expired: list[Problem] = field(default_factory=list)
    """Not problems: versions below a store's oldest base that a garbage collection has not
    finished removing (a GC in progress, or one that died half way)."""
    stores: int = 0
    blobs_checked: int = 0
    bytes_checked: int = 0
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems


def verify_root(
    blobs: BlobStore,
    operators: Iterable[str],
    *,
    deep: bool = True,
    progress: Progress | None = None,
    root_id: str = "",
    check_tables: TableCheck | None = None,
) -> VerifyReport:
    """Check every store of ``operators`` in the root.

    A store with manifests (format 2) is checked against its newest manifest: every blob it
    names must exist (and, with ``deep``, pass its checksums) and hold the version it is named
    for; blobs it does not name are not problems (losing attempts and what a GC run has not
    removed yet, which the next GC removes). A format-1 store is checked from its listing.

    Args:
        blobs: the root's blob store.
        operators: operator names (from the root metadata).
        deep: also download every blob and verify every checksum.
        progress: called with (blobs done, blobs in total) as the check advances.
        root_id: the root's id (manifests of another root are reported corrupt).
        check_tables: with ``deep``, each snapshot's SST file whose checksum matches is
            also written to a temporary folder and given to this, which returns the names
            of those RocksDB cannot read whole: a file uploaded damaged, under a checksum
            of its damaged bytes, passes the checksum but no restore can read it
            (:func:`statekeeper.store._rocks.damaged_tables`).

    Raises:
        StorageError: a listing or read failed for a reason other than a missing blob.
    """
    started = time.monotonic()
    report = VerifyReport(deep=deep)
    stores = [(op, p, metas) for op in operators for p, metas in _by_partition(blobs, op).items()]
    total = sum(len(metas) for _, _, metas in stores)
    for operator, partition, metas in stores:
        report.stores += 1
        check = _StoreCheck(blobs, operator, partition, metas, report, deep, root_id)
        check.check_tables = check_tables
        if any(layout.parse_manifest_key(m.key) is not None for m in metas):
            check.run_manifest(progress, total)
        else:
            check.run(progress, total)
    if progress is not None:
        progress(total, total)  # blobs no manifest names are not read: done all the same
    report.duration_s = time.monotonic() - started
    _log.info(
        "verify%s: %d stores, %d blobs, %d bytes checked, %d problems (%.2fs)",
        " --deep" if deep else "",
        report.stores,
        report.blobs_checked,
        report.bytes_checked,
        len(report.problems),
        report.duration_s,
    )
    return report


def _by_partition(blobs: BlobStore, operator: str) -> dict[int, list[BlobMeta]]:
    out: dict[int, list[BlobMeta]] = {}
    for meta in blobs.list(layout.operator_prefix(operator)):
        store = layout.parse_store_key(meta.key)
        if store is not None and store[0] == operator:
            out.setdefault(store[1], []).append(meta)
    return dict(sorted(out.items()))


class _StoreCheck:
    """The checks of one store; problems are appended to the shared report."""

    def __init__(
        self,
        blobs: BlobStore,
        operator: str,
        partition: int,
        metas: list[BlobMeta],
        report: VerifyReport,
        deep: bool,
        root_id: str,
    ) -> None:
        self.blobs, self.operator, self.partition = blobs, operator, partition
        self.store = f"{operator}/{partition}"
        self.metas = {m.key: m for m in metas}
        self.foreign: dict[str, BlobMeta] = {}
        self.report, self.deep, self.root_id = report, deep, root_id
        self.check_tables: TableCheck | None = None

    def problem(self, blob: str, kind: str, message: str) -> None:
        self.report.problems.append(Problem(self.store, blob, kind, message))

    def run(self, progress: Progress | None, total: int) -> None:
        """Check a format-1 store from its listing: every blob is named by its version."""
        lost = lost_manifests(self.operator, self.partition, self.metas)
        if lost is not None:
            self.problem(layout.manifest_prefix(self.operator, self.partition), "missing", lost)
            return
        changelogs = {v: k for k in self.metas if (v := layout.parse_changelog_key(k)) is not None}
        indexes = {v: k for k in self.metas if (v := layout.parse_snapshot_key(k)) is not None}
        prev_keys: set[str] = set()
        broken: set[int] = set()
        for version, key in indexes.items():
            index = self._load_index(key, version, LEGACY_ATTEMPT)
            self._advance(progress, total)
            if index is None:
                broken.add(version)
                continue
            if index.prev_snapshot_index_blob_id:
                prev_keys.add(index.prev_snapshot_index_blob_id)
            for rel, entry in iter_files(index.dir_index):
                self._check_file(key, rel, entry)
        for version, key in changelogs.items():
            if not self._check_changelog(key, version, LEGACY_ATTEMPT):
                broken.add(version)
            self._advance(progress, total)
        self._check_all_metrics()
        self._check_restorable(changelogs, indexes, prev_keys - set(self.metas), broken)
        self._advance(progress, total)

    def run_manifest(self, progress: Progress | None, total: int) -> None:
        """Check what the newest manifest names (format 2): its lineage, and that every blob
        it names is there, intact, and of the root, store, version and attempt it says."""
        try:
            manifest = read_newest_manifest(
                self.blobs, root_id=self.root_id, operator=self.operator,
                partition=self.partition, keys=list(self.metas),
            )  # fmt: skip
        except CorruptStateError as exc:
            self.problem(layout.manifest_prefix(self.operator, self.partition), "corrupt", str(exc))
            return
        assert manifest is not None
        self._check_newer_manifests(manifest)
        # Apart: a broken snapshot of version v leaves its changelog (and the other way round).
        broken: set[int] = set()
        broken_changelogs: set[int] = set()
        indexes = {s.version: (s.index_blob, s.attempt) for s in manifest.snapshots}
        for ve in manifest.versions:
            if ve.kind == "snapshot" and ve.version not in indexes:
                indexes[ve.version] = (ve.blob, ve.attempt)
        for version, (key, attempt) in sorted(indexes.items()):
            index = self._load_index(key, version, attempt, manifest.root_id)
            self._advance(progress, total)
            if index is None:
                broken.add(version)
                continue
            before = len(self.report.problems)
            for rel, entry in iter_files(index.dir_index):
                self._check_file(key, rel, entry)
            if len(self.report.problems) > before:
                broken.add(version)
        for ve in manifest.versions:
            if ve.kind == "changelog":
                if not self._check_changelog(ve.blob, ve.version, ve.attempt, manifest.root_id):
                    broken_changelogs.add(ve.version)
                self._advance(progress, total)
        self._check_all_metrics()
        self._check_manifest_restorable(manifest, broken, broken_changelogs)

    def _check_newer_manifests(self, manifest: StoreManifest) -> None:
        """A newer manifest than the one read failed its checks (readers skip it with a
        warning): the store's lineage is damaged there."""
        for key in sorted(self.metas):
            seq = layout.parse_manifest_key(key)
            if seq is None or seq <= manifest.seq:
                continue
            try:
                decode_manifest(
                    self.blobs.get(key), blob=key, root_id=self.root_id,
                    operator=self.operator, partition=self.partition,
                )  # fmt: skip
                why = f"it is readable now, but was not when manifest {manifest.seq} was read"
            except (CorruptStateError, StateNotFoundError) as exc:
                why = str(exc)
            self.problem(
                key, "corrupt",
                f"store {self.store}: manifest {key} is newer than the one readers use "
                f"({manifest.seq}) and is skipped: {why}",
            )  # fmt: skip

    def _check_manifest_restorable(
        self, manifest: StoreManifest, broken: set[int], broken_changelogs: set[int]
    ) -> None:
        history = StoreHistory.from_manifest(manifest)
        # What a restore can still reach, falling back past broken snapshots (invariant 6).
        usable = dataclasses.replace(
            history,
            changelogs=history.changelogs - broken_changelogs,
            snapshots=history.snapshots - broken,
        )
        lost = sorted(set(history.restorable_versions()) - set(usable.restorable_versions()))
        if lost:
            self.problem(
                layout.manifest_key(self.operator, self.partition, manifest.seq),
                "unrestorable",
                f"store {self.store}: versions {ranges(set(lost))} are committed but cannot be "
                "restored (a changelog or snapshot they need is missing or corrupt)",
            )

    def _advance(self, progress: Progress | None, total: int) -> None:
        if progress is not None:
            progress(self.report.blobs_checked, total)

    def _check_restorable(
        self,
        changelogs: dict[int, str],
        indexes: dict[int, str],
        missing_prev: set[str],
        broken: set[int],
    ) -> None:
        """Format 1: every committed version restorable, or below the oldest base GC keeps."""
        usable = StoreHistory(
            self.operator, self.partition, frozenset(changelogs) - broken,
            frozenset(indexes) - broken,
        )  # fmt: skip
        committed = set(changelogs) | set(indexes)
        floor = _oldest_base(usable, max(committed, default=0))
        # Every committed version has a changelog or an index, and gc only removes the
        # oldest ones: a hole between two committed versions is a missing blob, unless it is
        # below the oldest base that reaches the newest version (a gc that died half way).
        for v in range(min(committed, default=0) + 1, max(committed, default=0)):
            if v not in committed:
                key = layout.changelog_key(self.operator, self.partition, v)
                self._lost(v < (floor or 0), key, "missing", f"changelog {key} is missing")
        lost = committed - set(usable.restorable_versions())
        expired = {v for v in lost if floor is not None and v < floor}
        lost -= expired
        if expired:
            self._lost(
                True, layout.changelog_prefix(self.operator, self.partition), "unrestorable",
                f"versions {ranges(expired)} are below the oldest base {floor} that the newest "
                "version is restored from: left by a garbage collection that has not finished "
                "(its next run removes them)",
            )  # fmt: skip
        if lost:
            for key in sorted(missing_prev):  # a newer snapshot names it as its predecessor
                if (layout.parse_snapshot_key(key) or 0) < min(lost):
                    self.problem(key, "missing", f"store {self.store}: snapshot {key} is missing")
            self.problem(
                layout.changelog_prefix(self.operator, self.partition),
                "unrestorable",
                f"store {self.store}: versions {ranges(lost)} are committed but cannot be "
                "restored (a changelog or snapshot they need is missing or corrupt)",
            )

    def _lost(self, expired: bool, blob: str, kind: str, message: str) -> None:
        if expired:
            problem = Problem(self.store, blob, "expired", f"store {self.store}: {message}")
            self.report.expired.append(problem)
        else:
            self.problem(blob, kind, f"store {self.store}: {message}")

    def _check_changelog(
        self, key: str, version: int, attempt: str, root_id: str | None = None
    ) -> bool:
        """Check one changelog; whether it passed."""
        identity = ChangelogIdentity(
            self.root_id if root_id is None else root_id, self.operator, self.partition, attempt
        )
        self.report.blobs_checked += 1
        try:
            if key not in self.metas:
                raise StateNotFoundError(f"changelog {key} is missing")
            expected = (version, identity)
            legacy = attempt == LEGACY_ATTEMPT
            read = functools.partial(self.blobs.get_range, key)
            end = 0
            if self.deep:  # a part at a time: memory is one part's, not the whole blob's
                for part in read_changelog(
                    read, blob=key, expected=expected, anonymous_ok=legacy
                ):  # fmt: skip
                    end = part.offset + part.length
                    self.report.bytes_checked += part.length
            else:  # each part's header: a changelog may have several
                for start, header in part_headers(read, blob=key):
                    check_identity(
                        header, blob=key, version=version, expected=identity, anonymous_ok=legacy
                    )
                    end = start + header.blob_length
            if end != self.metas[key].size:
                raise CorruptStateError(
                    f"changelog {key} is not valid: its parts end at byte {end:,}, the blob "
                    f"holds {self.metas[key].size:,}"
                )
        except StateNotFoundError as exc:
            self.problem(key, "missing", f"store {self.store}: {exc}")
            return False
        except CorruptStateError as exc:
            self.problem(key, "corrupt", f"store {self.store}: {exc}")
            return False
        return True

    def _check_all_metrics(self) -> None:
        """Every commit-metrics blob of the store (no manifest names them: they are listed)."""
        for key in self.metas:
            if layout.parse_metrics_key(key) is not None:
                self._check_metrics(key)

    def _check_metrics(self, key: str) -> None:
        """Commit metrics are not state: only a deep check reads them."""
        self.report.blobs_checked += 1
        if not self.deep:
            return
        try:
            decode_commit_metrics(self.blobs.get(key), blob=key)
        except (CorruptStateError, StateNotFoundError) as exc:
            self.problem(key, "corrupt", f"store {self.store}: {exc}")

    def _load_index(
        self, key: str, version: int, attempt: str, root_id: str | None = None
    ) -> SnapshotIndex | None:
        """The index at ``key`` if it is intact and of this store, version and attempt."""
        self.report.blobs_checked += 1
        root_id = self.root_id if root_id is None else root_id
        identified = bool(root_id) and attempt not in ("", LEGACY_ATTEMPT)
        expected = SnapshotMetadata(
            operator=self.operator, partition=self.partition, version=version,
            root_id=root_id if identified else None, attempt=attempt if identified else None,
        )  # fmt: skip
        try:
            data = self.blobs.get(key)
            self.report.bytes_checked += len(data)
            index = SnapshotIndex.from_json(data, blob=key)
            check_metadata(index, blob=key, expected=expected, anonymous_ok=not identified)
        except StateNotFoundError as exc:
            self.problem(key, "missing", f"store {self.store}: {exc}")
            return None
        except CorruptStateError as exc:
            self.problem(key, "corrupt", f"store {self.store}: {exc}")
            return None
        return index

    def _check_file(self, index_key: str, rel: str, entry: FileIndex) -> None:
        keys = [b.key(self.operator, self.partition) for b in entry.blobs]
        sizes = entry.chunk_sizes()
        for key, size in zip(keys, sizes, strict=True):
            meta = self.metas.get(key)
            if meta is None and layout.parse_store_key(key) != (self.operator, self.partition):
                meta = self._foreign(key)  # a parent store's blob (a rescale reuses it)
            if meta is None:
                self.problem(
                    key, "missing", f"file {rel} of snapshot {index_key}: {key} is missing"
                )
            elif meta.size != size:
                self.problem(
                    key,
                    "corrupt",
                    f"file {rel} of snapshot {index_key}: {key} holds {meta.size} bytes, "
                    f"expected {size}",
                )
        if self.deep and all(k in self.metas or k in self.foreign for k in keys):
            self._check_file_crc(index_key, rel, entry, keys)
        elif not self.deep:
            self.report.blobs_checked += len(keys)  # checked against the listing

    def _foreign(self, key: str) -> BlobMeta | None:
        """The listing entry of a blob of another store (``None`` if it is missing)."""
        if key not in self.foreign:
            try:
                self.foreign[key] = self.blobs.head(key)
            except StateNotFoundError:
                return None
        return self.foreign[key]

    def _check_file_crc(self, index_key: str, rel: str, entry: FileIndex, keys: list[str]) -> None:
        crc = 0
        with tempfile.TemporaryDirectory(prefix="statekeeper-verify-") as scratch:
            copy = _TableCopy(Path(scratch) / Path(rel).name, self.check_tables, rel)
            try:
                for data in self.blobs.get_many(keys):
                    crc = google_crc32c.extend(crc, data)
                    self.report.bytes_checked += len(data)
                    copy.write(data)
            except StateNotFoundError as exc:
                self.problem(keys[0], "missing", f"file {rel} of snapshot {index_key}: {exc}")
                return
            except CorruptStateError as exc:
                self.problem(keys[0], "corrupt", f"file {rel} of snapshot {index_key}: {exc}")
                return
            finally:  # any other read failure (a StorageError) is raised: the root may be fine
                copy.close()
            self.report.blobs_checked += len(keys)
            where = keys[0] if len(keys) == 1 else ", ".join(keys)
            if crc != entry.crc:
                self.problem(
                    where,
                    "corrupt",
                    f"file {rel} of snapshot {index_key}: CRC32C expected {entry.crc:#010x}, "
                    f"found {crc:#010x} (blobs {', '.join(keys)})",
                )
            elif copy.damaged():
                self.problem(
                    where,
                    "corrupt",
                    f"file {rel} of snapshot {index_key}: its checksum matches, but RocksDB "
                    "cannot read it whole (a block fails its own checksum: it was damaged "
                    "on a local disk before its upload), so no restore from this snapshot "
                    "can read it",
                )


class _TableCopy:
    """A temporary copy of a snapshot's SST file for ``check`` to read whole. A copy that
    cannot be written (a full temporary folder) or checked leaves the file to its CRC
    alone, with a WARNING: that is this machine's problem, not the root's."""

    def __init__(self, path: Path, check: TableCheck | None, rel: str) -> None:
        self._path, self._check, self._rel = path, check, rel
        self._out: BinaryIO | None = None
        if check is not None and rel.endswith(".sst"):
            self._out = self._guard(lambda: open(path, "wb"))  # noqa: SIM115 - closed below

    def _guard(self, fn: Callable[[], _T]) -> _T | None:
        try:
            return fn()
        except (OSError, StateKeeperError) as exc:
            _log.warning("verify: %s is checked by its CRC only: %s", self._rel, exc)
            self._check = None
            return None

    def write(self, data: bytes) -> None:
        if self._out is not None and self._check is not None:
            self._guard(lambda: self._out.write(data) if self._out else None)

    def close(self) -> None:
        if self._out is not None:
            self._guard(self._out.close)

    def damaged(self) -> bool:
        check = self._check
        if self._out is None or check is None:
            return False
        return bool(self._guard(lambda: check([self._path])))


def _oldest_base(history: StoreHistory, latest: int) -> int | None:
    """The oldest base (the empty store or a snapshot) from which changelogs reach
    ``latest``; ``None`` if none does (the newest version is itself lost)."""
    if latest not in history.restorable_versions():
        return None
    bases = sorted(history.snapshots | ({0} if 1 in history.changelogs else set()))
    for base in bases:
        if all(v in history.changelogs for v in range(base + 1, latest + 1)):
            return base
    return latest if latest in history.snapshots else None
