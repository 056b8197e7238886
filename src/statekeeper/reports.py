"""Task reports: what one partition's task did in one micro-batch, as a small blob in the root.

Spark Connect has no accumulators, and a driver-side listener exists only on classic
sessions, so tasks report through the checkpoint root itself: after its commit, a task writes
one report blob at ``_reports/<operator>/<batch:020d>/<partition:06d>.json`` (key from
:func:`statekeeper.layout.report_key`). Anyone who can read the root (a listener, a Connect
client, the command line) aggregates a micro-batch's reports into metrics.

Why one fixed key per (operator, batch, partition), overwritten by a re-run: a report is
telemetry, not state. A failed attempt writes nothing (the report follows the commit), and
the attempt that committed last is also the one whose report stays, so a reader finds at
most one report per partition and never has to pick among attempts. A crash between the
commit and the report loses only the report.

Reports are pruned by the tasks themselves: every ``PRUNE_EVERY`` micro-batches a task
deletes its partition's reports older than ``KEEP_BATCHES`` batches (one request). Garbage
collection applies the same window with :func:`sweep_reports` to what no task prunes any
more (a partition or an operator that stopped running).

Document (UTF-8 JSON, keys sorted)::

    {"format": "statekeeper.task-report", "formatVersion": 1, "queryId": "...",
     "batchId": 7, "operator": "counts", "partition": 3, "version": 8, ...}

Readers reject a newer ``formatVersion`` with a clear error.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

from statekeeper import layout
from statekeeper.errors import ConfigMismatchError, CorruptStateError, StateNotFoundError
from statekeeper.storage import BlobStore

__all__ = [
    "FORMAT_VERSION",
    "KEEP_BATCHES",
    "PRUNE_EVERY",
    "TaskReport",
    "decode_report",
    "encode_report",
    "prune_reports",
    "read_reports",
    "sweep_reports",
    "write_report",
]

FORMAT = "statekeeper.task-report"
FORMAT_VERSION = 1
KEEP_BATCHES = 1000
PRUNE_EVERY = 100


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskReport:
    """One partition's work in one micro-batch."""

    query_id: str
    batch_id: int
    root: str
    """Credential-free URI of the checkpoint root."""
    operator: str
    partition: int
    attempt: int
    version: int
    """The version committed."""
    commit_blob: str
    commit_s: float
    bytes_uploaded: int
    puts: int
    deletes: int
    snapshot_scheduled: bool
    reused: bool
    """The store was open in the worker already (no open, no restore)."""
    open_s: float
    restored: bool
    """Opening downloaded snapshot files or replayed changelogs."""
    restore_s: float
    restore_bytes: int
    rows_in: int
    rows_out: int
    keys: int
    expired: int
    task_s: float
    late_rows: int = 0
    """Input rows dropped because their event time was at or before the watermark."""
    timers_fired: int = 0
    """Expired timers whose ``handle_expired_timer`` ran."""
    written_ms: int = 0
    """When the report was written (milliseconds since the epoch); 0 if never written."""


_FIELDS = {f.name: f for f in dataclasses.fields(TaskReport)}


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def encode_report(report: TaskReport) -> bytes:
    """The report's blob content."""
    doc: dict[str, Any] = {"format": FORMAT, "formatVersion": FORMAT_VERSION}
    doc.update({_camel(k): v for k, v in dataclasses.asdict(report).items()})
    return json.dumps(doc, sort_keys=True).encode()


def decode_report(data: bytes, *, blob: str) -> TaskReport:
    """Parse a report blob.

    Raises:
        CorruptStateError: not a task report (names ``blob``).
        ConfigMismatchError: written in a newer format version.
    """
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptStateError(f"task report {blob} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptStateError(f"task report {blob} is not a {FORMAT} document")
    version = doc.get("formatVersion")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ConfigMismatchError(
            f"task report {blob} has format version {version!r}; this statekeeper reads "
            f"versions up to {FORMAT_VERSION}: upgrade statekeeper"
        )
    try:
        return TaskReport(
            **{
                name: doc[_camel(name)]
                for name, f in _FIELDS.items()
                # Fields added after format version 1 was first written have defaults.
                if _camel(name) in doc or f.default is dataclasses.MISSING
            }
        )
    except (KeyError, TypeError) as exc:
        raise CorruptStateError(f"task report {blob} lacks a field: {exc}") from exc


def write_report(blobs: BlobStore, report: TaskReport) -> TaskReport:
    """Write ``report`` (replacing a re-run's) and return it with its write time.

    Raises:
        StorageError: the write failed.
    """
    stamped = dataclasses.replace(report, written_ms=int(time.time() * 1000))
    key = layout.report_key(report.operator, report.batch_id, report.partition)
    blobs.put(key, encode_report(stamped), overwrite=True)
    return stamped


def read_reports(blobs: BlobStore, operator: str, batch_id: int) -> list[TaskReport]:
    """The reports of one micro-batch of ``operator``, by partition (one listing).

    A report deleted between the listing and the read (pruning) is skipped.

    Raises:
        CorruptStateError, ConfigMismatchError: as :func:`decode_report`.
        StorageError: the root cannot be read.
    """
    found = []
    for meta in blobs.list(layout.reports_prefix(operator, batch_id)):
        if layout.parse_report_key(meta.key) is None:
            continue
        try:
            data = blobs.get(meta.key)
        except StateNotFoundError:
            continue
        found.append(decode_report(data, blob=meta.key))
    return sorted(found, key=lambda r: r.partition)


def prune_reports(blobs: BlobStore, operator: str, partition: int, batch_id: int) -> int:
    """Delete ``partition``'s reports of the ``PRUNE_EVERY`` batches that fell out of the
    ``KEEP_BATCHES`` window at ``batch_id``; a no-op except every ``PRUNE_EVERY`` batches.

    Returns the number of keys asked to be deleted (absent ones included).

    Raises:
        StorageError: the delete failed.
    """
    if batch_id % PRUNE_EVERY or batch_id < KEEP_BATCHES:
        return 0
    end = batch_id - KEEP_BATCHES
    keys = [
        layout.report_key(operator, b, partition) for b in range(max(0, end - PRUNE_EVERY), end)
    ]
    blobs.delete_many(keys)
    return len(keys)


def sweep_reports(
    blobs: BlobStore, *, keep: int = KEEP_BATCHES, dry_run: bool = False
) -> list[str]:
    """Delete, per operator, the reports of micro-batches older than ``keep`` batches before
    its newest reported one: the window :func:`prune_reports` keeps, over the whole root.

    Returns the keys deleted (with ``dry_run``: that would be; nothing is deleted).

    Raises:
        StorageError: the listing or a delete failed.
    """
    batches: dict[str, dict[int, list[str]]] = {}
    for meta in blobs.list(layout.reports_prefix()):
        if (parsed := layout.parse_report_key(meta.key)) is not None:
            operator, batch, _ = parsed
            batches.setdefault(operator, {}).setdefault(batch, []).append(meta.key)
    doomed = [
        key
        for by_batch in batches.values()
        for batch, keys in by_batch.items()
        if batch < max(by_batch) - keep
        for key in keys
    ]
    if doomed and not dry_run:
        blobs.delete_many(doomed)
    return doomed
