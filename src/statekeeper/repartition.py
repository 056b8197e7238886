"""Offline repartition: move an operator's state to another partition count by key groups.

An operator with key groups (``G``, recorded in the root) keeps every data key prefixed by its
key group, and partition ``p`` of ``P`` owns the contiguous key groups ``g`` with
``g * P // G == p`` (see :mod:`statekeeper.keyed._layout`). Repartitioning to ``N`` moves whole
key-group ranges, never re-encoding a key:

1. **The cut.** The operator's consistent cut (:func:`statekeeper.epochs.consistent_cut`: the
   versions the newest epoch manifest names, unless batches finished since outran it, else the
   newest version every partition has);
   every partition must be at one version ``v``, which every new store starts at, so a query
   restarted with ``partitions=N`` loads ``v`` in its next micro-batch and continues. Where
   every partition is at one version that a query committed and no manifest names, the
   batch that committed it may have finished or failed after its commits, and new stores at
   the wrong one would stop the restarted query for good: the caller names the version then.
2. **Parents.** Every old store is restored at ``v`` into a work folder (in parallel).
3. **New stores** (in parallel). New store ``q`` owns key groups ``R``; its *primary* parent is
   the old store that holds most of ``R``. The new store starts as a RocksDB checkpoint of the
   primary (hard links), then: ``delete_range`` drops the key groups outside ``R`` (one range
   tombstone each side, no rewrite); one pass over the TTL and timer indexes (under ``0xFF``)
   drops the entries of keys outside ``R``; the key groups of ``R`` other parents hold are
   written to an SST file (``SstFileWriter``) and ingested, with their index entries (a
   *merge*, or a split whose new boundaries fall inside an old range); the operator record
   and ``maxEventTimeMs`` are the primary's. The new store is uploaded as a snapshot whose
   index names the primary's own blobs for every file it still holds (schema 3, see
   ``docs/format.md``): a split uploads only the small files, the tombstones and the index
   edits; a merge uploads the ranges it ingested.
4. **Commit.** One compare-and-swap on the root metadata switches the operator to ``N``
   partitions and a new run generation (refused if a query started on it since step 1);
   then each new store's manifest is written (:mod:`statekeeper.store._rescale`; any opener
   finishes that should the process die first).

Never destructive: until step 4 nothing names what was uploaded (GC sweeps it after
``orphan_ttl_s``), and the root is as it was; the old stores' blobs stay until GC finds no
retained snapshot of any store naming them.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import rocksdict

from statekeeper import layout
from statekeeper.config import StoreConfig
from statekeeper.epochs import consistent_cut
from statekeeper.errors import CommitConflictError, ConfigMismatchError, StateKeeperError
from statekeeper.history import StoreHistory
from statekeeper.keyed import (
    EVENT_TIME,
    GROUPED_TIMER_INDEX,
    GROUPED_TTL_INDEX,
    INDEX_FLOOR,
    KEY_GROUP,
    META_KEY,
    U64,
    OperatorRecord,
    group_prefix,
    key_group_range,
    ttl_prefix,
)
from statekeeper.storage import BlobStore
from statekeeper.store import (
    ParentCopy,
    RootMetadata,
    StateBackend,
    StoreRescale,
    check_progress,
    checked_items,
    finish_pending_rescale,
    latest_versions,
)

_log = logging.getLogger(__name__)

__all__ = ["Progress", "RepartitionReport", "check_request", "plan_parents", "repartition"]

Progress = Callable[[str, int, int], None]
"""Called with (phase, done, total): ``"restore"`` counts old stores, ``"build"`` new ones."""
_EVENT_TIME_KEY = b"\xff" + EVENT_TIME
_FLOORS = b"\xff" + INDEX_FLOOR


@dataclass(frozen=True)
class RepartitionReport:
    """What a repartition did."""

    operator: str
    """The operator written (``source`` itself unless ``to`` was given)."""
    source: str
    from_partitions: int
    partitions: int
    version: int
    """The version every new store starts at (the cut's)."""
    generation: int
    attempt: str
    state_bytes: int
    """Size of the old stores' files at the cut (their snapshots', or what their restore
    downloaded where they had none): the state's bytes."""
    new_store_bytes: int
    """Size of every file of the new stores' snapshots (a file two new stores share with
    their parent counts twice)."""
    bytes_uploaded: int
    """Bytes of files uploaded (reused blobs of the parents not counted)."""
    bytes_reused: int
    bytes_downloaded: int
    """Bytes the parents' restore downloaded."""
    keys_ingested: int
    """Keys written again (ranges other parents held); 0 for a split along old boundaries."""
    restore_s: float
    build_s: float
    duration_s: float

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON object (camelCase-free: field names as they are)."""
        return asdict(self)


def plan_parents(
    partition: int, partitions: int, old_partitions: int, key_groups: int
) -> list[tuple[int, range]]:
    """The old stores that hold the key groups of new store ``partition`` of ``partitions``,
    each with the key groups it contributes; the primary (most key groups, then lowest
    partition) first."""
    wanted = key_group_range(partition, partitions, key_groups)
    found = []
    for p in range(old_partitions):
        held = key_group_range(p, old_partitions, key_groups)
        overlap = range(max(held.start, wanted.start), min(held.stop, wanted.stop))
        if len(overlap):
            found.append((p, overlap))
    return sorted(found, key=lambda item: (-len(item[1]), item[0]))


def repartition(
    root: str | os.PathLike[str] | BlobStore | StateBackend,
    operator: str,
    *,
    partitions: int,
    to: str | None = None,
    version: int | None = None,
    config: StoreConfig | None = None,
    storage_options: dict[str, str] | None = None,
    work_dir: str | os.PathLike[str] | None = None,
    workers: int | None = None,
    progress: Progress | None = None,
) -> RepartitionReport:
    """Move ``operator``'s state to ``partitions`` partitions (into operator ``to`` if given,
    leaving ``operator`` as it is), by key-group ranges; see the module docstring.

    The query using the operator must be stopped; restart it with ``partitions=N`` (and
    ``name=to`` if given). Safe to interrupt at any point: before the commit the root is as
    it was; after it, any opener of the operator finishes the new stores' manifests.

    Args:
        root: the checkpoint root (a URI, a path, a blob store or a backend).
        operator: the operator to rescale.
        partitions: the new partition count, at most the operator's key groups.
        to: write the result as this new operator instead (the root must not hold it).
        version: the version to read every old store at, which the new stores start at
            (default: the consistent cut's; see the module docstring).
        config: transfer settings (``io_threads``, ``chunk_size``); the backend's if
            ``root`` is one.
        storage_options: for a URI root.
        work_dir: where the old stores are restored (a temporary folder under it, removed
            at the end); the system's temporary folder by default. It needs room for the
            whole operator's state. Folders there that killed repartitions left are
            deleted first.
        workers: old and new stores handled at once (default: ``min(4, io_threads)``).
        progress: called as work proceeds (see :data:`Progress`).

    Raises:
        TypeError, ValueError: a malformed argument.
        ConfigMismatchError: the operator is not in the root, has no key groups (made by
            statekeeper 0.1), already has that partition count, its partitions are not at
            one version, the cut cannot tell the version a restarted query goes on at (the
            message says how to choose ``version``), ``version`` is above a partition's
            newest or (without ``to``) not one a restarted query can go on at, or ``to``
            exists.
        CommitConflictError: a query started on the operator during the repartition
            (nothing was changed).
        StateNotFoundError, CorruptStateError, StorageError: restoring an old store failed.
    """
    started = time.perf_counter()
    if config is not None and not isinstance(config, StoreConfig):
        raise TypeError(f"config must be a StoreConfig or None, got {type(config).__name__}")
    if workers is not None and (
        isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
    ):
        raise ValueError(f"workers must be an int >= 1 or None, got {workers!r}")
    check_progress(progress)
    if version is not None:
        layout.validate_version(version)
    backend = root if isinstance(root, StateBackend) else StateBackend(
        root, config=config, storage_options=storage_options
    )  # fmt: skip
    try:
        cfg = config or backend.config
        job = _Job.prepare(backend, cfg, operator, partitions, to, version)
        with _work_folder(work_dir) as tmp:
            return job.run(tmp, workers or min(4, cfg.io_threads), progress, started)
    finally:
        if backend is not root:
            backend.close()


_WORK_PREFIX = "statekeeper-repartition-"
_OWNER = ".owner.lock"
_UNLOCKED_GRACE_S = 3600.0
"""A work folder without an owner lock (made by a release before it had one) is taken for
abandoned once this old."""


@contextlib.contextmanager
def _work_folder(work_dir: str | os.PathLike[str] | None) -> Iterator[Path]:
    """A new work folder under ``work_dir`` (the system's temporary folder by default),
    deleted at the end, after deleting the folders there that killed repartitions left: each
    holds a restored copy of a whole operator, and repeated kills would fill the disk.

    A folder is owned by an ``flock`` on its lock file, which the OS releases when its
    process dies. The lock file is locked under a temporary name and then renamed into
    place, so no other process ever sees it unlocked while its owner lives.
    """
    base = Path(tempfile.gettempdir() if work_dir is None else work_dir)
    base.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(base)
    folder = Path(tempfile.mkdtemp(prefix=_WORK_PREFIX, dir=base))
    unlocked = folder / f"{_OWNER}.{uuid.uuid4().hex}"
    fd = os.open(unlocked, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(unlocked, folder / _OWNER)
        yield folder
    finally:
        try:
            shutil.rmtree(folder)
        except OSError as exc:  # the next repartition here deletes what is left
            _log.warning("could not delete the work folder %s: %s", folder, exc)
        os.close(fd)


def _remove_abandoned(base: Path) -> None:
    """Delete the work folders under ``base`` whose owner is dead (their lock is free), and
    those without a lock older than ``_UNLOCKED_GRACE_S``; a failure is logged, not raised."""
    folders: list[str] = []
    with contextlib.suppress(OSError), os.scandir(base) as entries:
        for entry in entries:
            if entry.name.startswith(_WORK_PREFIX) and entry.is_dir(follow_symlinks=False):
                folders.append(entry.path)
    for folder in folders:
        try:
            fd = os.open(os.path.join(folder, _OWNER), os.O_RDWR)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                if time.time() - os.stat(folder).st_mtime > _UNLOCKED_GRACE_S:
                    _remove_work_folder(folder)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a running repartition's
        else:
            _remove_work_folder(folder)
        finally:
            os.close(fd)


def _remove_work_folder(folder: str) -> None:
    size = 0
    for parent, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                size += os.lstat(os.path.join(parent, name)).st_size
    try:
        shutil.rmtree(folder)
    except OSError as exc:
        _log.warning("could not delete %s, left by a killed repartition: %s", folder, exc)
    else:
        _log.info("deleted %s (%s bytes), left by a killed repartition", folder, f"{size:,}")


def _cut_version(
    blobs: BlobStore,
    operator: str,
    partitions: int,
    history: Callable[[int], StoreHistory],
    latest: list[int],
) -> int:
    """The version every old store is read at: the consistent cut's, when it says which.

    Raises:
        ConfigMismatchError: the cut is not one version, it is 0, or it is ambiguous (see
            :func:`_ambiguous`).
    """
    cut = consistent_cut(blobs, operator, partitions, history)
    versions = set(cut.versions.values())
    if len(versions) != 1:
        raise _refuse(
            f"the partitions of operator {operator!r} are at different versions "
            f"({cut.versions}, from {cut.describe()}): a repartition needs one cut; run "
            "the query until a micro-batch completes, then stop it"
        )
    version = versions.pop()
    if version == 0:
        raise _refuse(f"operator {operator!r} holds no committed state to repartition")
    newest = latest[0]
    if _ambiguous(cut.manifest is not None and version == newest, latest, history):
        raise _refuse(
            f"every partition of operator {operator!r} is at version {newest}, committed by "
            f"micro-batch {newest - 1} of a streaming query, and nothing in the root says "
            "whether that micro-batch finished (no epoch manifest names it: the query ran "
            "from Spark Connect, or its driver stopped before writing one). New stores at "
            "the wrong version would stop the restarted query for good, so name the "
            f"version: {newest} if micro-batch {newest - 1} finished (the query's last "
            f"progress reported batchId {newest - 1}; the newest file in its "
            f"checkpointLocation's commits folder is named {newest - 1}), else {newest - 1} "
            "(CLI: --version V; library: version=V). With --to NEW_OPERATOR (to=...) the "
            "old stores stay as they are"
        )
    return version


def _ambiguous(named: bool, latest: list[int], history: Callable[[int], StoreHistory]) -> bool:
    """Whether the cut cannot say at which version a restarted query goes on. Spark runs
    micro-batch ``b`` once ``b - 1`` finished, and every task of a batch commits: partitions
    at different versions show that the newest batch failed. All at one version ``v`` that
    no epoch manifest names, committed by a query, do not show whether the batch that
    committed ``v`` finished (the query goes on at ``v``) or failed after its commits (it
    runs that batch again, from ``v - 1``); each version made the other's restart fail for
    good. Commits of the store API (no owner) are the state as it is."""
    if named or len(set(latest)) != 1:
        return False
    newest = latest[0]
    for p in range(len(latest)):
        manifest = history(p).manifest
        entry = None if manifest is None else manifest.entry(newest)
        if entry is not None and entry.owner:  # "" for the store API
            return True
    return False


def _restart_versions(latest: list[int]) -> set[int]:
    """The versions a query restarted on stores at ``latest`` may load: with all at one
    ``v``, ``v`` (its last batch finished) or ``v - 1`` (it failed after its commits); else
    the oldest (the newest batch failed half way)."""
    if len(set(latest)) == 1:
        return {v for v in (latest[0], latest[0] - 1) if v >= 1}
    return {min(latest)}


def _refuse(message: str) -> ConfigMismatchError:
    return ConfigMismatchError(message)


def check_request(
    backend: StateBackend, operator: str, partitions: int, to: str | None = None
) -> tuple[RootMetadata, int, int]:
    """Check a repartition request against the root (what :func:`repartition` checks
    before any work); returns the root metadata, the old partition count and the
    operator's key groups.

    Raises:
        TypeError, ValueError: a malformed argument.
        ConfigMismatchError: the operator is not in the root, has no partition count or no
            key groups, already has that count, has fewer key groups, or ``to`` exists.
    """
    layout.validate_operator(operator)
    if to is not None:
        layout.validate_operator(to)
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise ValueError(f"partitions must be an int >= 1, got {partitions!r}")
    meta = backend.root_metadata()
    if meta is None or operator not in meta.operators:
        known = sorted(meta.operators) if meta is not None else []
        raise _refuse(f"operator {operator!r} is not in the root (it holds {known})")
    old = meta.operators[operator]
    groups = meta.key_groups.get(operator)
    if old is None:
        raise _refuse(f"operator {operator!r} has no partition count recorded yet")
    if groups is None:
        raise _refuse(
            f"operator {operator!r} has no key groups (it was made by statekeeper 0.1): "
            "a repartition moves key-group ranges; rewrite its state into a new operator"
        )
    if partitions > groups:
        raise _refuse(f"operator {operator!r} has {groups} key groups, so at most {groups} "
                      f"partitions; {partitions} were asked for")  # fmt: skip
    if to is None and partitions == old:
        raise _refuse(f"operator {operator!r} already has {old} partitions")
    if to is not None and (to in meta.operators or backend.blobs.list(layout.operator_prefix(to))):
        raise _refuse(f"operator {to!r} exists in the root: give a new operator name")
    return meta, old, groups


@dataclass
class _Job:
    backend: StateBackend
    config: StoreConfig
    source: str
    target: str
    old: int
    new: int
    groups: int
    version: int
    latest: list[int]
    """Each old store's newest version when the cut was read: if one moves, a query is
    running on the operator, and the rescale would lose its commits."""

    @classmethod
    def prepare(
        cls, backend: StateBackend, cfg: StoreConfig, operator: str, partitions: int,
        to: str | None, version: int | None,
    ) -> _Job:  # fmt: skip
        """Check the request against the root and read the cut (unless ``version``)."""
        meta, old, groups = check_request(backend, operator, partitions, to)
        target = operator if to is None else to
        blobs = backend.blobs
        finish_pending_rescale(blobs, operator, io_threads=cfg.io_threads)
        histories = functools.cache(
            lambda p: StoreHistory.load(blobs, operator, p, root_id=meta.root_id)
        )
        latest = latest_versions(blobs, meta.root_id, operator, old, history=histories)
        if version is None:
            version = _cut_version(blobs, operator, old, histories, latest)
        elif version < 1 or version > min(latest):
            raise _refuse(
                f"version {version} of operator {operator!r} cannot be repartitioned: its "
                f"partitions' newest versions are {latest}; expected a version from 1 to "
                f"{min(latest)}"
            )
        elif to is None and version not in _restart_versions(latest):
            raise _refuse(
                f"version {version} of operator {operator!r} is not one a restarted query "
                f"can go on at (its partitions' newest versions are {latest}, so "
                f"{' or '.join(map(str, sorted(_restart_versions(latest))))}): new stores "
                "at it would stop the query for good. To copy another version, pass --to "
                "NEW_OPERATOR (to=...)"
            )
        return cls(backend, cfg, operator, target, old, partitions, groups, version, latest)

    def run(
        self, work: Path, workers: int, progress: Progress | None, started: float
    ) -> RepartitionReport:
        meta = self.backend.root_metadata()
        assert meta is not None
        rescale = StoreRescale(
            self.backend.blobs, self.config, meta, source=self.source, target=self.target,
            version=self.version, attempt=uuid.uuid4().hex, work_dir=work,
        )  # fmt: skip
        notify = _Notifier(progress)
        parents: dict[int, ParentCopy] = {}
        try:
            with ThreadPoolExecutor(max(1, workers), thread_name_prefix="sk-repartition") as pool:
                notify("restore", 0, self.old)
                for parent in pool.map(rescale.restore_parent, range(self.old)):
                    parents[parent.partition] = parent
                    _check_parent(parent, self.source, self.groups)
                    notify.step("restore", self.old)
                restored = time.perf_counter()
                notify("build", 0, self.new)
                built = []
                for result in pool.map(lambda q: self._build(rescale, parents, q), range(self.new)):
                    built.append(result)
                    notify.step("build", self.new)
        finally:
            for parent in parents.values():
                parent.copy.close(flush=False)
        done = time.perf_counter()
        now = latest_versions(self.backend.blobs, meta.root_id, self.source, self.old)
        if now != self.latest:
            raise CommitConflictError(
                f"operator {self.source!r} was committed to while it was being rescaled (its "
                f"stores' newest versions went from {self.latest} to {now}): is a query still "
                "running on it? Stop it and run the repartition again; nothing was changed"
            )
        after = rescale.commit(self.new)
        return RepartitionReport(
            operator=self.target, source=self.source, from_partitions=self.old,
            partitions=self.new, version=self.version,
            generation=after.rescales[self.target].generation, attempt=rescale.attempt,
            state_bytes=sum(p.state_bytes for p in parents.values()),
            new_store_bytes=sum(b.state for b in built),
            bytes_uploaded=sum(b.uploaded for b in built),
            bytes_reused=sum(b.reused for b in built),
            bytes_downloaded=sum(p.bytes_downloaded for p in parents.values()),
            keys_ingested=sum(b.ingested for b in built),
            restore_s=restored - started, build_s=done - restored,
            duration_s=time.perf_counter() - started,
        )  # fmt: skip

    def _build(self, rescale: StoreRescale, parents: dict[int, ParentCopy], q: int) -> _Built:
        """Make new store ``q`` from its parents and upload it."""
        plan = plan_parents(q, self.new, self.old, self.groups)
        primary = parents[plan[0][0]]
        owned = key_group_range(q, self.new, self.groups)
        db = rescale.open_child(q, primary)
        try:
            record = _record(db)
            _drop_outside(db, owned, record)
            ingested = 0
            for p, groups in plan[1:]:
                ingested += _ingest(db, parents[p], groups, record, rescale.child_path(q))
        except BaseException:
            db.close()
            raise
        _, metrics = rescale.upload_child(q, db, primary)
        shutil.rmtree(rescale.child_path(q), ignore_errors=True)
        state = metrics.bytes_uploaded + metrics.bytes_reused
        return _Built(state, metrics.bytes_uploaded, metrics.bytes_reused, ingested)


@dataclass(frozen=True)
class _Built:
    state: int
    uploaded: int
    reused: int
    ingested: int


class _Notifier:
    def __init__(self, progress: Progress | None) -> None:
        self._progress = progress
        self._done: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, phase: str, done: int, total: int) -> None:
        if self._progress is not None:
            self._progress(phase, done, total)

    def step(self, phase: str, total: int) -> None:
        with self._lock:
            self._done[phase] = self._done.get(phase, 0) + 1
            self(phase, self._done[phase], total)


def _check_parent(parent: ParentCopy, operator: str, groups: int) -> None:
    """Refuse a store holding keys that belong to no key group (keys the plain store API
    wrote, say): moving key-group ranges would drop them.

    Raises:
        ConfigMismatchError: such a key, named.
    """
    where = f"store {operator}/{parent.partition}"
    stray = next(parent.copy.scan(b"", after=group_prefix(groups)), None)
    if stray is not None and stray[0] < b"\xff":
        raise _refuse(
            f"{where} holds key {stray[0][:40]!r}, outside the operator's {groups} key groups "
            "(the first two bytes of a key are its key group): it was not written by the keyed "
            "layer, and a repartition by key-group ranges would drop it"
        )
    for key, _ in parent.scan(b"\xff"):
        known = key.startswith((GROUPED_TTL_INDEX, GROUPED_TIMER_INDEX, _FLOORS))
        if not known and key != _EVENT_TIME_KEY:
            raise _refuse(
                f"{where} holds key {key[:40]!r} under 0xFF, which is neither a TTL or timer "
                "index entry, an index floor nor maxEventTimeMs: a repartition would not "
                "know its key group"
            )


def _record(db: rocksdict.Rdict) -> OperatorRecord | None:
    raw = db.get(META_KEY)
    return None if raw is None else OperatorRecord.from_bytes(bytes(raw))


def _ttl_prefixes(record: OperatorRecord | None) -> list[bytes]:
    names = [] if record is None else sorted(record.states)
    return [ttl_prefix(name, grouped=True) for name in names]


def _index_group(key: bytes, prefixes: list[bytes]) -> int | None:
    """The key group of the data key a TTL or timer index entry covers (``None``: the key
    is no index entry, e.g. ``maxEventTimeMs``)."""
    if key.startswith(GROUPED_TIMER_INDEX):
        start = len(GROUPED_TIMER_INDEX) + U64.size
        return int(KEY_GROUP.unpack_from(key, start)[0])
    if key.startswith(GROUPED_TTL_INDEX):
        for prefix in prefixes:
            if key.startswith(prefix):
                return int(KEY_GROUP.unpack_from(key, len(prefix) + U64.size)[0])
        raise StateKeeperError(
            f"TTL index entry {key!r} names a state the operator record does not declare"
        )
    return None


def _index_entries(
    items: Iterator[tuple[bytes, bytes]], prefixes: list[bytes], keep: Callable[[int], bool]
) -> Iterator[tuple[bytes, bytes]]:
    for key, value in items:
        group = _index_group(key, prefixes)
        if group is not None and keep(group):
            yield key, value


def _drop_outside(db: rocksdict.Rdict, owned: range, record: OperatorRecord | None) -> None:
    """Delete the key groups outside ``owned`` (range tombstones) and the index entries of
    their keys; the operator record, which sorts among the key groups, is written back.
    The index floors go too: the new store's indexes also get other stores' entries."""
    batch = rocksdict.WriteBatch(raw_mode=True)
    if owned.start > 0:
        batch.delete_range(group_prefix(0), group_prefix(owned.start))
    batch.delete_range(group_prefix(owned.stop), b"\xff")
    for key, _ in checked_items(db, _FLOORS):
        batch.delete(key)
    raw = db.get(META_KEY)
    if raw is not None:
        batch.put(META_KEY, bytes(raw))
    prefixes = _ttl_prefixes(record)
    for area in (GROUPED_TTL_INDEX, GROUPED_TIMER_INDEX):
        for key, _ in _index_entries(checked_items(db, area), prefixes, lambda g: g not in owned):
            batch.delete(key)
    db.write(batch)


def _ingest(
    db: rocksdict.Rdict, parent: ParentCopy, groups: range, record: OperatorRecord | None,
    folder: Path,
) -> int:  # fmt: skip
    """Write the key groups ``groups`` of ``parent`` (data and index entries) to an SST file
    and ingest it into ``db``; returns the number of keys."""
    path = folder.with_name(f"{folder.name}.from-{parent.partition}.sst")
    writer = rocksdict.SstFileWriter(rocksdict.Options(raw_mode=True))
    writer.open(str(path))
    count = 0
    prefixes = _ttl_prefixes(record)
    for g in groups:
        for key, value in parent.scan(group_prefix(g)):
            if key != META_KEY:
                writer[key] = value
                count += 1
    for area in (GROUPED_TTL_INDEX, GROUPED_TIMER_INDEX):
        for key, value in _index_entries(parent.scan(area), prefixes, lambda g: g in groups):
            writer[key] = value
            count += 1
    if db.get(_EVENT_TIME_KEY) is None and (found := list(parent.scan(_EVENT_TIME_KEY))):
        writer[found[0][0]] = found[0][1]
        count += 1
    if count == 0:
        return 0
    writer.finish()
    db.ingest_external_file([str(path)], rocksdict.IngestExternalFileOptions())
    path.unlink(missing_ok=True)
    return count
