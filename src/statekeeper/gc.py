"""Garbage collection: keep every retained version restorable, delete the rest.

Reachability is re-derived from the blob store on every run (the Samza design's REMOVE_TTL
step, expressed as "delete only what is unreachable and old"), so a run that dies half way
is completed by the next one, and nothing depends on in-memory state.

Per store, with ``latest`` its newest restorable version and ``oldest = latest -
retain_versions + 1``, or, if lower, the oldest version the newest epoch manifest of some
query names (:func:`statekeeper.epochs.pinned_versions`): that is the consistent cut
``read_state`` and the CLI read, and it must stay restorable however far one partition
committed ahead of the others, or however long ago the query stopped:

* the *base* is the newest snapshot at or below ``oldest`` from which the changelogs reach
  ``latest`` (or the empty store, version 0, when there is none: then nothing is expired);
* kept: changelogs after the base, snapshot indexes from the base on, and every file blob
  those indexes reference;
* expired (deleted at once): changelogs up to the base, indexes before it;
* file blobs referenced only by expired indexes are deleted at once: a new snapshot only
  ever reuses files of the newest snapshot, which is always kept;
* file blobs no index references (orphans of snapshots that died half way, or still
  uploading) are deleted only once older than ``orphan_ttl_s`` and not part of a snapshot
  this process is uploading, so an upload in flight never loses its files.

Deletion order makes a crash at any point harmless: indexes and changelogs go first, so no
listed snapshot ever references a deleted file.

A store with manifests (format 2) is collected from its newest manifest, never from what a
listing suggests (a listing is not atomic: commits and snapshots land between its pages):

* the new base is the newest registered snapshot at or below ``oldest``, adopted only after
  its index and every file it names were checked to exist; a new manifest records it (if
  another writer wrote one first, the base stays for this run);
* kept: every blob the authority names (changelogs, snapshot indexes and their files), the
  files of the snapshots it names as *retired* (an upload that read an older manifest may
  reuse them; a manifest names at most the 16 most recent, retired less than
  ``orphan_ttl_s`` ago, and a snapshot that reused files of one it no longer names is not
  registered), and every blob younger than ``orphan_ttl_s`` (uploads in flight, commits
  newer than the manifest read);
* a manifest is deleted once its successor is older than ``orphan_ttl_s`` or
  :data:`~statekeeper.manifest.MANIFEST_GRACE_S`, whichever is smaller (a reader that
  listed the manifests may still be reading it); the newest is never deleted;
* everything else of the store (losing attempts, unregistered snapshots, format-1 blobs the
  authority no longer names) is deleted once older than ``orphan_ttl_s``.

**Blobs shared between stores.** A store made by a rescale (:mod:`statekeeper.repartition`)
reuses its parents' SST blobs in place: its snapshot indexes name blobs under another store's
``files/``. Every run first reads the retained (and recently retired) snapshots of every store
of the operators the root records as rescaled (``shared_from``) and keeps each blob of
another store they name, whatever that store's own manifest says: once a parent's old
snapshots are retired, those blobs may be named by nothing else.

Ages are measured by the blob store's clock (:mod:`statekeeper.clock`): a GC host whose
clock runs ahead must not take young blobs for old ones. The snapshots a run retires are
stamped the other way, with the latest "now" any GC can take: a GC host whose clock runs
behind must not shorten their grace for the runs on other hosts.

An ``orphan_ttl_s`` below :data:`MIN_ORPHAN_TTL_S` is raised to it, with a warning: a blob is
written before a manifest names it, and a grace shorter than that window would sweep a
commit's changelog just before the commit lands (a committed version with no blob).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from statekeeper import layout
from statekeeper.clock import gc_now, gc_times, sweep_probes
from statekeeper.config import StoreConfig
from statekeeper.epochs import pinned_versions
from statekeeper.errors import (
    CommitConflictError,
    CorruptStateError,
    StateKeeperError,
    StateNotFoundError,
)
from statekeeper.history import StoreHistory, lost_manifests
from statekeeper.manifest import (
    LEGACY_ATTEMPT,
    MANIFEST_GRACE_S,
    StoreManifest,
    read_newest_after_conflict,
    read_newest_manifest,
    with_base,
    write_manifest,
)
from statekeeper.reports import sweep_reports
from statekeeper.snapshot import (
    SnapshotIndex,
    load_index,
    referenced_blob_ids,
    referenced_blob_keys,
)
from statekeeper.storage import BlobMeta, BlobStore

__all__ = ["GcReport", "StoreGc", "collect_garbage", "resumable_age_s"]

_log = logging.getLogger("statekeeper.gc")
_MIN_TEMP_AGE_S = 3600.0
_warned: set[float] = set()  # orphan_ttl_s values warned about (once per process each)
MIN_ORPHAN_TTL_S = 300.0
"""The least grace GC gives a blob nothing names yet: between writing a blob and naming it
in a manifest, a commit takes a PUT or two and a snapshot its whole upload; a blob swept in
that window would be named once deleted. A smaller ``orphan_ttl_s`` is raised to this."""
_ADVANCE_TRIES = 5
ManifestUpdate = Callable[[Callable[[StoreManifest], StoreManifest | None]], StoreManifest]
"""Writes ``change(newest)`` as a store's next manifest, returns the newest known after."""


@dataclass
class StoreGc:
    """What garbage collection did (or would do) to one store."""

    store: str
    latest: int | None = None
    oldest_retained: int | None = None
    base: int | None = None
    deleted_blobs: int = 0
    deleted_bytes: int = 0
    kept_blobs: int = 0
    kept_bytes: int = 0
    skipped: str | None = None
    """Why the store was left alone, if it was."""


@dataclass
class GcReport:
    """The result of one garbage collection run over a root."""

    dry_run: bool
    stores: dict[str, StoreGc] = field(default_factory=dict)
    deleted_keys: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    complete: bool = True
    """False when the time budget ran out before every store was visited."""
    incomplete_writes: int = 0
    """Leftovers of writes that died half way (local temporary files) removed."""

    @property
    def deleted_blobs(self) -> int:
        """Blobs deleted (or that would be) in all stores."""
        return sum(s.deleted_blobs for s in self.stores.values())

    @property
    def deleted_root_blobs(self) -> int:
        """Blobs deleted (or that would be) outside the stores: epoch manifests, task
        reports and clock probes past their retention."""
        return len(self.deleted_keys) - self.deleted_blobs

    @property
    def deleted_bytes(self) -> int:
        """Bytes deleted (or that would be) in all stores."""
        return sum(s.deleted_bytes for s in self.stores.values())


def collect_garbage(
    blobs: BlobStore,
    config: StoreConfig,
    operators: Iterable[str],
    *,
    dry_run: bool = False,
    only: tuple[str, int] | None = None,
    busy: frozenset[tuple[str, int]] = frozenset(),
    budget_s: float | None = None,
    now: float | None = None,
    root_id: str = "",
    shared_from: Iterable[str] = (),
    updates: Mapping[tuple[str, int], ManifestUpdate] | None = None,
    configs: Mapping[str, StoreConfig] | None = None,
) -> GcReport:
    """Collect garbage in every store of ``operators`` (or only the store ``only``).

    Args:
        blobs: the root's blob store.
        config: retention (``retain_versions``) and grace (``orphan_ttl_s``).
        configs: per operator, the config to apply to its stores instead of ``config``.
            What belongs to the whole root (epoch manifests, temporary files) gets the
            most patient of them all: the longest history and the longest grace.
        operators: operator names to visit.
        dry_run: report what would be deleted, delete nothing.
        only: restrict the run to one (operator, partition).
        busy: stores with a snapshot upload in flight in this process: their unreferenced
            blobs are kept whatever their age.
        budget_s: stop visiting further stores after this many seconds.
        now: the current time (seconds since the epoch), for tests; by default the earlier
            of this host's clock and the blob store's (:func:`statekeeper.clock.gc_now`; a
            dry run writes no probe and takes this host's).
        root_id: the root's id (manifests of another root are refused).
        shared_from: operators whose stores' snapshots may name other stores' blobs (the
            root's rescaled operators): those blobs are kept while such a snapshot is.
        updates: per store open in this process, how to write its next manifest (taking
            turns with its commits, instead of racing them through the blob store).

    Raises:
        StorageError: a listing or a delete failed (what was deleted stays deleted; a
            later run finishes the job).
    """
    started = time.monotonic()
    updates = {} if updates is None else updates
    latest: tuple[float, float] | None = None
    if now is None and not dry_run:
        now, at = gc_times(blobs)
        latest = (at, time.monotonic())
    elif now is None:
        now = gc_now(blobs, probe=False)  # a dry run writes no probe
    config = _clamped(config)
    per_operator = {name: _clamped(c) for name, c in (configs or {}).items()}

    def config_of(operator: str) -> StoreConfig:
        return per_operator.get(operator, config)

    root_wide = _most_patient([config, *per_operator.values()])
    report = GcReport(dry_run=dry_run)
    pins = pinned_versions(blobs)
    shared = _shared_blobs(blobs, config_of, list(shared_from), root_id, now)
    for operator in operators:
        for partition, metas in _store_blobs(blobs, operator, only).items():
            if budget_s is not None and time.monotonic() - started > budget_s:
                report.complete = False
                break
            is_busy = (operator, partition) in busy
            pin = pins.get((operator, partition))
            where = _Store(
                blobs, config_of(operator), operator, partition, root_id, now, dry_run, pin,
                shared, updates.get((operator, partition)), latest,
            )  # fmt: skip
            if any(layout.parse_manifest_key(m.key) is not None for m in metas):
                store_report, doomed = _plan_manifest_store(where, metas, is_busy)
            else:
                store_report, doomed = _plan_store(where, metas, is_busy)
            report.stores[store_report.store] = store_report
            if not dry_run:
                _delete_in_order(blobs, doomed)
            report.deleted_keys.extend(doomed)
    if only is None and not busy:
        # A temporary file may belong to a put still running in another process or thread:
        # however small the orphan TTL, it gets at least an hour.
        older_than = max(root_wide.orphan_ttl_s, _MIN_TEMP_AGE_S)
        report.incomplete_writes = blobs.sweep_incomplete(older_than, dry_run=dry_run)
        report.deleted_keys.extend(sweep_probes(blobs, now, dry_run=dry_run))
        report.deleted_keys.extend(_expire_epochs(blobs, root_wide, dry_run=dry_run))
        report.deleted_keys.extend(sweep_reports(blobs, dry_run=dry_run))
    report.duration_s = time.monotonic() - started
    _log.info(
        "gc%s: %d blobs, %d bytes %s in %d stores (%.2fs)",
        " (dry run)" if dry_run else "",
        report.deleted_blobs,
        report.deleted_bytes,
        "would be deleted" if dry_run else "deleted",
        len(report.stores),
        report.duration_s,
    )
    return report


def resumable_age_s(config: StoreConfig) -> float:
    """How old a blob nothing names may be for a snapshot to still name it (one an upload
    that was cut off left behind, see :mod:`statekeeper.snapshot._resume`): the grace GC
    gives it, less the :data:`MIN_ORPHAN_TTL_S` a fresh blob gets between its upload and its
    naming. Zero (never) at the least grace."""
    return max(config.orphan_ttl_s, MIN_ORPHAN_TTL_S) - MIN_ORPHAN_TTL_S


def _most_patient(configs: list[StoreConfig]) -> StoreConfig:
    """The first of ``configs`` with the largest ``retain_versions`` and ``orphan_ttl_s``
    among them all."""
    return dataclasses.replace(
        configs[0],
        retain_versions=max(c.retain_versions for c in configs),
        orphan_ttl_s=max(c.orphan_ttl_s for c in configs),
    )


def _clamped(config: StoreConfig) -> StoreConfig:
    """``config`` with an ``orphan_ttl_s`` of at least :data:`MIN_ORPHAN_TTL_S` (warned)."""
    if config.orphan_ttl_s >= MIN_ORPHAN_TTL_S:
        return config
    if config.orphan_ttl_s not in _warned:
        _warned.add(config.orphan_ttl_s)
        _log.warning(
            "gc: orphan_ttl_s=%s is shorter than a commit or snapshot upload may take "
            "between writing a blob and naming it; using %.0f s so no version is named "
            "after its blob was swept",
            config.orphan_ttl_s,
            MIN_ORPHAN_TTL_S,
        )
    return dataclasses.replace(config, orphan_ttl_s=MIN_ORPHAN_TTL_S)


def _store_blobs(
    blobs: BlobStore, operator: str, only: tuple[str, int] | None
) -> dict[int, list[BlobMeta]]:
    """Every blob of each store of ``operator``, by partition (one listing)."""
    if only is not None:
        if only[0] != operator:
            return {}
        return {only[1]: blobs.list(layout.store_prefix(*only))}
    by_partition: dict[int, list[BlobMeta]] = defaultdict(list)
    for meta in blobs.list(layout.operator_prefix(operator)):
        store = layout.parse_store_key(meta.key)
        if store is not None and store[0] == operator:
            by_partition[store[1]].append(meta)
    return dict(sorted(by_partition.items()))


def _plan_store(st: _Store, metas: list[BlobMeta], busy: bool) -> tuple[StoreGc, list[str]]:
    """Decide what to delete in a format-1 store; returns the report and the doomed keys."""
    blobs, config, operator, partition = st.blobs, st.config, st.operator, st.partition
    report = StoreGc(store=f"{operator}/{partition}")
    if (lost := lost_manifests(operator, partition, (m.key for m in metas))) is not None:
        report.skipped = lost  # its snapshots' files look unreferenced: keep them all
        _log.warning("gc skipped store %s: %s", report.store, lost)
        return report, []
    changelogs = {v: m for m in metas if (v := layout.parse_changelog_key(m.key)) is not None}
    indexes = {v: m for m in metas if (v := layout.parse_snapshot_key(m.key)) is not None}
    files = [m for m in metas if m.key.startswith(layout.files_prefix(operator, partition))]
    history = StoreHistory(operator, partition, frozenset(changelogs), frozenset(indexes))
    try:
        report.latest = history.latest()
    except StateNotFoundError as exc:
        report.skipped = f"nothing restorable, left untouched: {exc}"
        _log.warning("gc skipped store %s: %s", report.store, exc)
        return report, []
    restorable = history.restorable_versions()
    report.oldest_retained = min(
        v
        for v in restorable
        if v > report.latest - config.retain_versions or (st.pin is not None and v >= st.pin)
    )
    report.base = history.plan(report.oldest_retained, None).base
    try:
        kept_indexes = [v for v in indexes if v >= report.base]
        referenced = _referenced(blobs, operator, partition, kept_indexes)
    except StateKeeperError as exc:
        report.skipped = f"a retained snapshot index cannot be read, left untouched: {exc}"
        _log.warning("gc skipped store %s: %s", report.store, exc)
        return report, []
    expired = _expired_references(
        blobs, operator, partition, [v for v in indexes if v < report.base]
    )
    doomed: list[BlobMeta] = [m for v, m in changelogs.items() if v <= report.base]
    doomed += [m for v, m in indexes.items() if v < report.base]
    doomed += [
        m
        for m in metas
        if (v := layout.parse_metrics_key(m.key)) is not None and v < report.oldest_retained
    ]
    for m in files:
        blob_id = m.key.rsplit("/", 1)[-1]
        if blob_id in referenced or m.key in st.shared:
            continue
        # Files of expired snapshots go now (a new snapshot only ever reuses files of the
        # newest one, which is kept); orphans wait out the grace period.
        if blob_id in expired or (not busy and st.now - m.last_modified >= config.orphan_ttl_s):
            doomed.append(m)
    return report, _tally(report, metas, {m.key for m in doomed})


@dataclass(frozen=True)
class _Store:
    blobs: BlobStore
    config: StoreConfig
    operator: str
    partition: int
    root_id: str
    now: float
    dry_run: bool
    pin: int | None = None
    """The oldest version an epoch manifest names: kept restorable."""
    shared: frozenset[str] = frozenset()
    """Keys of this root's blobs that snapshots of other stores name (:func:`_shared_blobs`)."""
    update: ManifestUpdate | None = None
    """How to write the store's next manifest when it is open in this process: through its
    commit point (:meth:`statekeeper.store._commit_point.CommitPoint.update`)."""
    latest: tuple[float, float] | None = None
    """The latest "now" any GC could take when this run began, and the monotonic time then
    (``None``: ``now`` is given, by a test or a dry run): what the snapshots this run
    retires are stamped with, moved on to the moment they are (:func:`_retired_at`)."""


def _plan_manifest_store(
    st: _Store, metas: list[BlobMeta], busy: bool
) -> tuple[StoreGc, list[str]]:
    """Decide what to delete in a format-2 store, from its newest manifest."""
    report = StoreGc(store=f"{st.operator}/{st.partition}")
    try:
        manifest = read_newest_manifest(
            st.blobs, root_id=st.root_id, operator=st.operator, partition=st.partition,
            keys=[m.key for m in metas],
        )  # fmt: skip
        assert manifest is not None  # the caller saw a manifest key
        manifest = _advance_base(st, manifest, metas)
        protected = _protected(st, manifest)
    except StateKeeperError as exc:
        report.skipped = f"its manifest or a snapshot it names cannot be read: {exc}"
        _log.warning("gc skipped store %s: %s", report.store, exc)
        return report, []
    report.latest, report.base = manifest.latest, manifest.base
    report.oldest_retained = _oldest_retained(manifest, st)
    old = st.now - st.config.orphan_ttl_s
    grace = st.now - min(st.config.orphan_ttl_s, MANIFEST_GRACE_S)
    superseded = _superseded(metas, grace, upto=manifest.seq)
    doomed: list[BlobMeta] = []
    for m in metas:
        if (metrics_version := layout.parse_metrics_key(m.key)) is not None:
            if metrics_version < report.oldest_retained:
                doomed.append(m)
            continue
        if layout.parse_manifest_key(m.key) is not None:
            if m.key in superseded:
                doomed.append(m)
            continue
        if m.key in protected or m.key in st.shared or busy:
            continue
        if m.last_modified <= old or _expired_version(m.key, manifest.base):
            doomed.append(m)
    return report, _tally(report, metas, {m.key for m in doomed})


def _oldest_retained(manifest: StoreManifest, st: _Store) -> int:
    oldest = manifest.latest - st.config.retain_versions + 1
    if st.pin is not None:
        oldest = min(oldest, st.pin)
    return max(manifest.base, oldest)


def _expired_version(key: str, base: int) -> bool:
    """Whether ``key`` is a changelog or snapshot index of a version the store no longer
    retains (at or below the base; an index of the base itself is named if it is kept):
    deleted at once, as format 1 did; the files of such a snapshot wait out the grace."""
    version = layout.commit_blob_version(key)
    return version is not None and version <= base


def _advance_base(st: _Store, manifest: StoreManifest, metas: list[BlobMeta]) -> StoreManifest:
    """The authority after moving the base up to the newest complete snapshot at or below
    the oldest retained version, and forgetting retired snapshots past their grace (the
    manifest as it is if there is nothing to do, or if writers kept winning the next
    sequence number)."""
    present = {m.key for m in metas}
    checked: set[str] = set()
    now_ms = _retired_at(st)
    forget = int((st.now - st.config.orphan_ttl_s) * 1000)

    def advanced(m: StoreManifest) -> StoreManifest | None:
        base = _new_base(st, m, present, checked)
        if base is None:
            # Retired snapshots past their grace are forgotten even if the base stays: GC
            # keeps the files of every retired snapshot the manifest names.
            if all(r.time_ms >= forget for r in m.retired):
                return None
            base = m.base
        return with_base(m, base, now_ms=now_ms, forget_before_ms=forget)

    if st.dry_run:
        return advanced(manifest) or manifest
    if st.update is not None:
        # The store is open in this process: take turns with its commits. The base's
        # snapshot is checked (read) first, outside their turn, then found checked.
        advanced(manifest)
        return st.update(advanced)
    for _ in range(_ADVANCE_TRIES):
        new = advanced(manifest)
        if new is None:
            return manifest
        try:
            write_manifest(st.blobs, new)
        except CommitConflictError:
            # A commit or a snapshot won the sequence number: decide again on the newest.
            manifest = read_newest_after_conflict(st.blobs, new, root_id=st.root_id)
            continue
        return new
    return manifest


def _retired_at(st: _Store) -> int:
    """When snapshots retired now stopped being named, in ms: the latest "now" any GC can
    take (:func:`statekeeper.clock.latest_now`), from the run's probe. Every later run, on
    any host, measures their grace from this stamp while a reader may still be restoring
    from a manifest that named them: a stamp by a clock that runs behind (``now`` takes the
    earlier of this host's and the store's) would shorten it for the others."""
    if st.latest is None:
        return int(st.now * 1000)
    at, taken = st.latest
    return int((at + time.monotonic() - taken) * 1000)


def _new_base(
    st: _Store, manifest: StoreManifest, present: set[str], checked: set[str]
) -> int | None:
    """The newest snapshot at or below the oldest retained version whose index and files
    all exist (``checked``: index keys found complete already), if it is above the base."""
    oldest = _oldest_retained(manifest, st)
    candidates = [s for s in manifest.snapshots if manifest.base < s.version <= oldest]
    for snap in reversed(candidates):
        if snap.index_blob in checked:
            return snap.version
        try:
            # Checked to be this root's and this attempt's, as a restore will check it.
            index = load_index(
                st.blobs, st.operator, st.partition, snap.version, key=snap.index_blob,
                root_id=st.root_id or None, attempt=snap.attempt or None,
                anonymous_ok=snap.attempt in (LEGACY_ATTEMPT, ""),
            )  # fmt: skip
        except StateKeeperError as exc:
            _log.warning("gc: snapshot %s is unusable as a base: %s", snap.index_blob, exc)
            continue
        files = _file_keys(st, index)
        if not files <= present:
            # Files uploaded after the listing are not in it: such a snapshot waits a run.
            _log.info(
                "gc: snapshot %s is not a base yet: %d of its files are not in the listing",
                snap.index_blob, len(files - present),
            )  # fmt: skip
            continue
        checked.add(snap.index_blob)
        return snap.version
    return None


def _protected(st: _Store, manifest: StoreManifest) -> set[str]:
    """Keys of every blob the authority names, and of files of recently retired snapshots.

    Raises:
        StateKeeperError: a named or recently retired snapshot index cannot be read.
    """
    keys = {e.blob for e in manifest.versions}
    keys |= {s.index_blob for s in manifest.snapshots}
    indexes = [(s.version, s.index_blob) for s in manifest.snapshots]
    # Every retired snapshot the manifest still names, whatever its age: registering a
    # snapshot that reused its files checks that the newest manifest names it (with_snapshot),
    # so what a manifest no longer names no new snapshot can name.
    for retired in manifest.retired:
        found = layout.commit_blob_version(retired.index_blob)
        if found is not None:
            keys.add(retired.index_blob)
            indexes.append((found, retired.index_blob))
    for version, key in indexes:
        try:
            index = load_index(st.blobs, st.operator, st.partition, version, key=key)
        except StateNotFoundError:
            continue  # deleted already: nothing of it to keep
        except CorruptStateError as exc:
            # No restore can use it (its checksum or identity fails): its files are kept
            # only by the snapshots that name them too, or by their age. Skipping the whole
            # store instead would let its changelogs pile up forever.
            _log.warning("gc: snapshot %s is unusable, its files are not protected: %s", key, exc)
            continue
        keys |= _file_keys(st, index)
    return keys


def _file_keys(st: _Store, index: SnapshotIndex) -> set[str]:
    return referenced_blob_keys(index)


def _shared_blobs(
    blobs: BlobStore,
    config_of: Callable[[str], StoreConfig],
    operators: list[str],
    root_id: str,
    now: float,
) -> frozenset[str]:
    """Keys of blobs held in one store that a snapshot of another store names, among the
    snapshots each store of ``operators`` retains or retired less than ``orphan_ttl_s`` ago
    (its operator's, ``config_of(operator)``; an unreadable index is skipped: no restore can
    use it either).

    Raises:
        StorageError: a listing or read failed.
    """
    shared: set[str] = set()
    for operator in operators:
        for partition, metas in _store_blobs(blobs, operator, None).items():
            st = _Store(blobs, config_of(operator), operator, partition, root_id, now, dry_run=True)
            if not any(layout.parse_manifest_key(m.key) is not None for m in metas):
                continue  # format 1: made before rescales existed
            try:
                manifest = read_newest_manifest(
                    blobs, root_id=root_id, operator=operator, partition=partition,
                    keys=[m.key for m in metas],
                )  # fmt: skip
                assert manifest is not None
                own = layout.files_prefix(operator, partition)
                shared |= {
                    k for k in _protected(st, manifest) if "/files/" in k and not k.startswith(own)
                }
            except StateKeeperError as exc:
                _log.warning("gc: store %s/%s: %s", operator, partition, exc)
    return frozenset(shared)


def _superseded(metas: list[BlobMeta], old: float, *, upto: int) -> set[str]:
    """Manifests below sequence number ``upto`` (that of the manifest this run read, the
    newest readable one) whose successor was written before ``old``. Never the one read nor
    any above it: with the newest manifest damaged, the one before it is all readers have."""
    manifests = sorted(
        (seq, m)
        for m in metas
        if (seq := layout.parse_manifest_key(m.key)) is not None and seq <= upto
    )
    return {
        m.key
        for (_, m), (_, successor) in itertools.pairwise(manifests)
        if successor.last_modified <= old
    }


def _tally(report: StoreGc, metas: list[BlobMeta], doomed: set[str]) -> list[str]:
    """Count deleted and kept blobs into ``report``; the doomed keys in deletion order."""
    for m in metas:
        if m.key in doomed:
            report.deleted_blobs += 1
            report.deleted_bytes += m.size
        else:
            report.kept_blobs += 1
            report.kept_bytes += m.size
    return _ordered(doomed)


def _referenced(blobs: BlobStore, operator: str, partition: int, versions: list[int]) -> set[str]:
    """Blob ids referenced by the snapshot indexes of ``versions``."""
    referenced: set[str] = set()
    for version in versions:
        referenced |= referenced_blob_ids(load_index(blobs, operator, partition, version))
    return referenced


def _expired_references(
    blobs: BlobStore, operator: str, partition: int, versions: list[int]
) -> set[str]:
    """Blob ids referenced by expired snapshot indexes (unreadable ones are skipped: their
    files are then orphans, collected after the grace period)."""
    referenced: set[str] = set()
    for version in versions:
        try:
            referenced |= referenced_blob_ids(load_index(blobs, operator, partition, version))
        except StateKeeperError as exc:
            _log.info(
                "expired snapshot %s of %s/%s not readable: %s", version, operator, partition, exc
            )
    return referenced


def _ordered(keys: set[str]) -> list[str]:
    """Indexes and changelogs before file blobs: no listed index ever misses a file."""
    return sorted(keys, key=lambda k: ("/files/" in k, k))


def _delete_in_order(blobs: BlobStore, keys: list[str]) -> None:
    metadata = [k for k in keys if "/files/" not in k]
    if metadata:
        blobs.delete_many(metadata)
    files = [k for k in keys if "/files/" in k]
    if files:
        blobs.delete_many(files)


def _expire_epochs(blobs: BlobStore, config: StoreConfig, *, dry_run: bool) -> list[str]:
    """Delete each query's epoch manifests beyond its newest ``retain_versions`` (or, in a
    dry run, only name them)."""
    by_query: dict[str | None, list[tuple[int, str]]] = defaultdict(list)
    for m in blobs.list(layout.epochs_prefix()):
        if (parsed := layout.parse_epoch_key(m.key)) is not None:
            by_query[parsed[0]].append((parsed[1], m.key))
    doomed = [
        key
        for epochs in by_query.values()
        for _, key in sorted(epochs)[: max(0, len(epochs) - config.retain_versions)]
    ]
    if doomed and not dry_run:
        blobs.delete_many(doomed)
    return doomed
