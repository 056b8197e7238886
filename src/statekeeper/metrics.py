"""Per-commit metrics: the one durable source of commit latency, and per-commit accounting.

:func:`commit_history` tells, for every commit of a store, the bytes and records it wrote
(from the committed blobs) and its latency (from the commit-metrics blobs below).

Changelog blobs tell how many bytes and records each commit wrote, but not how long it took.
Commit latency is kept, best effort, in small **commit-metrics blobs**: a store buffers the
:class:`CommitMetrics` of its commits in memory and writes them as one blob, create-only, at
``<operator>/<partition>/metrics/<last version:020d>.json``, whenever it takes a snapshot,
when ``StoreConfig.metrics_every`` commits are buffered, and when it closes. So a store pays
one small PUT per ``metrics_every`` commits at most, never one per commit; a crash loses the
buffered entries (only metrics, never state). Garbage collection may delete a metrics blob
once its last version is older than the oldest retained version.

Document (UTF-8 JSON, keys sorted)::

    {"format": "statekeeper-commit-metrics", "formatVersion": 2,
     "operator": "sessions", "partition": 3,
     "commits": [{"version": 12, "durationMs": 8.4, "bytes": 5120, "records": 100,
                  "committedTimeMs": 1700000000000,
                  "phasesMs": {"encode": 1.2, "compress": 2.0, ..., "other": 0.3}}, ...],
     "crc32c": ...}

Readers reject a newer ``formatVersion`` with a clear error. ``phasesMs`` (where the
commit's time went, :attr:`statekeeper.CommitInfo.phases_ms`) is optional: entries written
before it existed have none, and readers that predate it ignore it, so adding it needed no
new format version.

Keys come from ``layout.metrics_key`` / ``metrics_prefix`` / ``parse_metrics_key``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from statekeeper import layout
from statekeeper.changelog import part_headers
from statekeeper.checksum import canonical_json, check_sealed, seal
from statekeeper.errors import CorruptStateError, StateNotFoundError
from statekeeper.history import RootListing, StoreHistory
from statekeeper.snapshot import SnapshotIndex, load_index, referenced_blob_ids
from statekeeper.storage import BlobStore

__all__ = [
    "FORMAT_VERSION",
    "CommitMetrics",
    "CommitRecord",
    "commit_history",
    "decode_commit_metrics",
    "encode_commit_metrics",
    "from_commit",
    "read_commit_metrics",
    "write_commit_metrics",
]

_log = logging.getLogger(__name__)

FORMAT_VERSION = 2
"""2 adds a CRC32C of the document (format 1 is still read)."""
_FORMAT_NAME = "statekeeper-commit-metrics"


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitMetrics:
    """What one commit cost.

    Attributes:
        version: the version the commit created.
        duration_ms: wall time of ``StateStore.commit`` (upload included).
        bytes: bytes uploaded by the commit.
        records: puts and deletes in the commit.
        committed_time_ms: when it finished, milliseconds since the epoch.
        phases_ms: where the time went, milliseconds by phase (``None`` if not recorded).
    """

    version: int
    duration_ms: float
    bytes: int
    records: int
    committed_time_ms: int
    phases_ms: Mapping[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        """The entry's JSON object."""
        out: dict[str, Any] = {
            "version": self.version,
            "durationMs": self.duration_ms,
            "bytes": self.bytes,
            "records": self.records,
            "committedTimeMs": self.committed_time_ms,
        }
        if self.phases_ms is not None:
            out["phasesMs"] = dict(self.phases_ms)
        return out


def encode_commit_metrics(operator: str, partition: int, commits: Sequence[CommitMetrics]) -> bytes:
    """The blob holding ``commits`` (in version order).

    Raises:
        ValueError: ``commits`` is empty.
    """
    if not commits:
        raise ValueError("a commit-metrics blob holds at least one commit")
    doc = {
        "format": _FORMAT_NAME,
        "formatVersion": FORMAT_VERSION,
        "operator": layout.validate_operator(operator),
        "partition": layout.validate_partition(partition),
        "commits": [c.to_json() for c in sorted(commits, key=lambda c: c.version)],
    }
    return canonical_json(seal(doc))


def decode_commit_metrics(data: bytes, *, blob: str) -> list[CommitMetrics]:
    """Parse a commit-metrics blob; when ``blob`` is a metrics key, also check the blob is
    that store's and ends at the version its name says.

    Raises:
        CorruptStateError: not a commit-metrics document, a checksum mismatch, another
            store's or version's blob, or written by a newer format version; the message
            names ``blob``.
    """
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT_NAME:
            raise ValueError(f"expected format {_FORMAT_NAME!r}")
        version = doc["formatVersion"]
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ValueError(
                f"written by a newer statekeeper: expected formatVersion <= {FORMAT_VERSION}, "
                f"found {version!r}"
            )
        if version >= 2:
            check_sealed(doc, what=f"commit-metrics blob {blob!r}")
        entries = [_entry(c) for c in doc["commits"]]
        _check_identity(doc, entries, blob)
        return entries
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptStateError(f"commit-metrics blob {blob!r} is not valid: {exc}") from exc


def _check_identity(doc: dict[str, Any], entries: list[CommitMetrics], blob: str) -> None:
    store, last = layout.parse_store_key(blob), layout.parse_metrics_key(blob)
    if store is None or last is None:
        return  # not read from its place in a root: nothing to compare
    found = (doc.get("operator"), doc.get("partition"), entries[-1].version if entries else None)
    if found != (*store, last):
        raise ValueError(
            f"expected the commits of store {store[0]}/{store[1]} up to version {last}, found "
            f"those of store {found[0]}/{found[1]} up to version {found[2]}"
        )


def _entry(obj: Any) -> CommitMetrics:
    phases = obj.get("phasesMs")
    if phases is not None and not isinstance(phases, dict):
        raise ValueError(f"phasesMs must be an object, found {phases!r}")
    metrics = CommitMetrics(
        version=int(obj["version"]),
        duration_ms=float(obj["durationMs"]),
        bytes=int(obj["bytes"]),
        records=int(obj["records"]),
        committed_time_ms=int(obj["committedTimeMs"]),
        phases_ms=None if phases is None else {str(k): float(v) for k, v in phases.items()},
    )
    if metrics.version < 1 or metrics.duration_ms < 0 or metrics.bytes < 0:
        raise ValueError(f"entry out of range: {obj!r}")
    return metrics


def write_commit_metrics(
    blobs: BlobStore, operator: str, partition: int, commits: Sequence[CommitMetrics]
) -> str:
    """Write ``commits`` as one blob, create-only; returns its key.

    Raises:
        ValueError: ``commits`` is empty.
        CommitConflictError: a blob with that last version exists (a re-run): nothing lost.
        StorageError: the upload failed.
    """
    data = encode_commit_metrics(operator, partition, commits)
    key = layout.metrics_key(operator, partition, max(c.version for c in commits))
    blobs.put(key, data)
    return key


def read_commit_metrics(
    blobs: BlobStore, operator: str, partition: int, *, since: int = 0
) -> dict[int, CommitMetrics]:
    """Every recorded commit of a store with version >= ``since``, by version.

    When two blobs record one version (a re-run), the newer blob's entry wins. A blob that
    is not valid is left out with a WARNING naming it: metrics are not state, and one
    damaged blob must not hide a store's other commits (``statekeeper stats``).

    Raises:
        StorageError: listing or reading failed.
    """
    keys = sorted(
        (v, m.key)
        for m in blobs.list(layout.metrics_prefix(operator, partition))
        if (v := layout.parse_metrics_key(m.key)) is not None and v >= since
    )
    out: dict[int, CommitMetrics] = {}
    datas = blobs.get_many([k for _, k in keys])
    for (_, key), data in zip(keys, datas, strict=True):
        try:
            commits = decode_commit_metrics(data, blob=key)
        except CorruptStateError as exc:
            _log.warning("left out of the commit metrics: %s", exc)
            continue
        out.update((c.version, c) for c in commits if c.version >= since)
    return out


def from_commit(
    version: int,
    duration_s: float,
    bytes_uploaded: int,
    records: int,
    *,
    phases_ms: Mapping[str, float] | None = None,
) -> CommitMetrics:
    """A :class:`CommitMetrics` for a commit that just finished (stamped now)."""
    return CommitMetrics(
        version=version,
        duration_ms=duration_s * 1000.0,
        bytes=bytes_uploaded,
        records=records,
        committed_time_ms=int(time.time() * 1000),
        phases_ms=phases_ms,
    )


@dataclass(frozen=True, slots=True)
class CommitRecord:
    """What one commit of a store wrote, and how long it took where that was recorded.

    Attributes:
        version: the version the commit created.
        kind: ``"changelog"`` or ``"snapshot"`` (a snapshot-mode commit).
        bytes: bytes the commit uploaded: the changelog blob, or the snapshot index plus
            the file blobs new in it.
        records: puts and deletes (from the changelog header, or the commit metrics).
        latency_ms: commit wall time, only where a commit-metrics blob recorded it.
        phases_ms: where that time went, where the commit-metrics blob recorded it.
    """

    version: int
    kind: str
    bytes: int
    records: int | None
    latency_ms: float | None
    phases_ms: Mapping[str, float] | None = None


def commit_history(
    blobs: BlobStore,
    listing: RootListing,
    operator: str,
    partition: int,
    *,
    last: int | None = None,
    io_threads: int = 8,
    on_header: Callable[[], None] | None = None,
) -> list[CommitRecord]:
    """Every commit of one store (the newest ``last``), in version order.

    Bytes and records come from the commits themselves: a changelog commit's size is its
    blob's and its record count is in its header (one ranged read of
    :data:`~statekeeper.changelog.MAX_HEADER_SIZE` bytes at most each, ``io_threads`` at a time); a
    snapshot-mode commit's bytes are its index plus the file blobs it added over the
    previous snapshot. Latency is not derivable from blobs (their modification times measure
    the gaps between batches, not commits): it comes from commit-metrics blobs only.

    Args:
        blobs: the root's blob store.
        listing: one listing of the root (sizes and the store's history come from it).
        operator: the operator.
        partition: the partition.
        last: only the newest ``last`` versions.
        io_threads: parallel header reads.
        on_header: called after each changelog header is read (progress).

    Raises:
        CorruptStateError: a changelog header or metrics blob is not valid.
        StorageError: a read failed.
    """
    history = listing.history(operator, partition)
    versions = sorted(v for v in history.changelogs | history.snapshots if v > 0)
    if last is not None:
        versions = versions[-last:]
    if not versions:
        return []
    logged = [v for v in versions if v in history.changelogs]
    sizes = listing.sizes(operator, partition)
    records = _record_counts(blobs, history, logged, io_threads, on_header)
    recorded = read_commit_metrics(blobs, operator, partition, since=versions[0])
    snapshots = _SnapshotBytes(blobs, history, sizes)
    out = []
    for v in versions:
        if v in records:
            size = sizes[history.changelog_key(v)]
            commit = CommitRecord(v, "changelog", size, records[v], None)
        else:
            commit = CommitRecord(v, "snapshot", snapshots.bytes_of(v), None, None)
        metrics = recorded.get(v)
        if metrics is not None:  # latency, and the record count a snapshot cannot tell
            commit = dataclasses.replace(
                commit,
                records=metrics.records if commit.records is None else commit.records,
                latency_ms=metrics.duration_ms,
                phases_ms=metrics.phases_ms,
            )
        out.append(commit)
    return out


def _record_counts(
    blobs: BlobStore,
    history: StoreHistory,
    versions: list[int],
    io_threads: int,
    on_header: Callable[[], None] | None,
) -> dict[int, int]:
    """Record count of each changelog, from its header alone, read in parallel."""

    def count(v: int) -> int:
        key = history.changelog_key(v)
        parts = part_headers(lambda start, length: blobs.get_range(key, start, length), blob=key)
        records = sum(header.record_count for _, header in parts)
        if on_header is not None:
            on_header()
        return records

    with ThreadPoolExecutor(max(1, io_threads)) as pool:
        return dict(zip(versions, pool.map(count, versions), strict=True))


class _SnapshotBytes:
    """Bytes a snapshot-mode commit uploaded: its index plus the file blobs new in it."""

    def __init__(self, blobs: BlobStore, history: StoreHistory, sizes: dict[str, int]) -> None:
        self._blobs, self._history = blobs, history
        self._operator, self._partition = history.operator, history.partition
        self._sizes = sizes
        self._snapshots = sorted(history.snapshots)
        self._indexes: dict[int, SnapshotIndex | None] = {}

    def _index(self, version: int) -> SnapshotIndex | None:
        if version not in self._indexes:
            try:
                self._indexes[version] = load_index(
                    self._blobs, self._operator, self._partition, version,
                    key=self._history.index_key(version),
                )  # fmt: skip
            except StateNotFoundError:
                self._indexes[version] = None
        return self._indexes[version]

    def bytes_of(self, version: int) -> int:
        index = self._index(version)
        own = self._sizes.get(self._history.index_key(version), 0)
        if index is None:
            return own
        older = [v for v in self._snapshots if v < version]
        previous = self._index(older[-1]) if older else None
        known = referenced_blob_ids(previous) if previous is not None else set()
        new = referenced_blob_ids(index) - known
        return own + sum(
            self._sizes.get(layout.file_blob_key(self._operator, self._partition, b), 0)
            for b in new
        )
