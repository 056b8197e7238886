"""The task side of task reports: build one after the commit and write it into the root.

The format and its keys live in :mod:`statekeeper.reports` (readable without Spark). A report
is telemetry: failing to write it is logged and never fails a task whose state is committed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from statekeeper.errors import StateKeeperError
from statekeeper.reports import TaskReport, prune_reports, write_report
from statekeeper.spark._cache import Lease
from statekeeper.spark._runner import RunStats
from statekeeper.store import CommitInfo

__all__ = ["TaskIdentity", "TaskReport", "report_task"]

_log = logging.getLogger("statekeeper.spark")


@dataclass(frozen=True)
class TaskIdentity:
    """Who ran: the micro-batch, the state partition and the Spark task attempt."""

    batch_id: int
    partition: int
    query_id: str
    stage_id: int
    stage_attempt: int
    """Spark's task attempt id (unique and growing in an application), see ``_transform``."""
    attempt: int


def report_task(
    lease: Lease, info: CommitInfo, stats: RunStats, ctx: TaskIdentity, task_s: float
) -> TaskReport | None:
    """Write the report of a committed task (and prune old ones); ``None`` if that failed."""
    report = build_report(lease, info, stats, ctx, task_s)
    blobs = lease.entry.backend.blobs
    try:
        written = write_report(blobs, report)
        prune_reports(blobs, report.operator, report.partition, report.batch_id)
    except StateKeeperError as exc:
        _log.warning(
            "could not write the task report of %s/%s batch %s: %s",
            report.operator, report.partition, report.batch_id, exc,
        )  # fmt: skip
        return None
    return written


def build_report(
    lease: Lease, info: CommitInfo, stats: RunStats, ctx: TaskIdentity, task_s: float
) -> TaskReport:
    """The report of one committed task."""
    restore = lease.restore
    # Opening an empty store or a current local copy is no restore; downloading is.
    restored = restore is not None and (
        restore.base_kind == "snapshot" or restore.changelogs_replayed > 0
    )
    return TaskReport(
        query_id=ctx.query_id,
        batch_id=ctx.batch_id,
        root=lease.entry.backend.blobs.uri,
        operator=info.operator,
        partition=ctx.partition,
        attempt=ctx.attempt,
        version=info.version,
        commit_blob=info.blob,
        commit_s=info.duration_s,
        bytes_uploaded=info.bytes_uploaded,
        puts=info.puts,
        deletes=info.deletes,
        snapshot_scheduled=info.snapshot_scheduled,
        reused=lease.reused,
        open_s=lease.open_s,
        restored=restored,
        restore_s=restore.duration_s if restore is not None and restored else 0.0,
        restore_bytes=restore.bytes_downloaded if restore is not None else 0,
        rows_in=stats.rows_in,
        rows_out=stats.rows_out,
        keys=stats.keys,
        expired=stats.expired,
        task_s=task_s,
        late_rows=stats.late_rows,
        timers_fired=stats.timers_fired,
    )
