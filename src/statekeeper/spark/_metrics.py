"""Per micro-batch, per operator metrics, aggregated from the task reports in the root."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from statekeeper.errors import StateNotFoundError
from statekeeper.reports import TaskReport, read_reports
from statekeeper.storage import open_blob_store
from statekeeper.store import StateBackend

__all__ = ["BatchMetrics", "aggregate", "batch_metrics"]


@dataclass(frozen=True)
class BatchMetrics:
    """What one stateful operator did in one micro-batch, over all its partitions."""

    query_id: str
    batch_id: int
    operator: str
    root: str
    """Credential-free URI of the checkpoint root."""
    partitions: int
    """The operator's partition count."""
    partitions_committed: int
    version: int
    """The version every committed partition created (``batch_id + 1``)."""
    commit_latency_p50_s: float
    commit_latency_max_s: float
    bytes_uploaded: int
    puts: int
    deletes: int
    snapshots_scheduled: int
    stores_reused: int
    """Partitions whose store was still open in the worker (nothing loaded)."""
    stores_opened: int
    """Partitions whose store was opened (from the local copy, possibly after a restore)."""
    stores_restored: int
    """Opened stores that downloaded snapshot files or replayed changelogs."""
    restore_time_s: float
    """Total seconds spent restoring, over the restored stores."""
    restore_time_max_s: float
    restore_bytes: int
    rows_in: int
    rows_out: int
    keys: int
    expired: int
    """State entries deleted because their TTL passed."""
    task_time_max_s: float
    late_rows: int = 0
    """Input rows dropped as late (event time at or before the batch's watermark)."""
    timers_fired: int = 0

    def summary(self) -> str:
        """One log line."""
        return (
            f"batch {self.batch_id} operator {self.operator!r}: "
            f"{self.partitions_committed}/{self.partitions} partitions committed "
            f"version {self.version}, commit p50 {self.commit_latency_p50_s * 1000:.1f} ms "
            f"max {self.commit_latency_max_s * 1000:.1f} ms, {self.bytes_uploaded} bytes "
            f"uploaded ({self.puts} puts, {self.deletes} deletes), {self.stores_restored} "
            f"stores restored in {self.restore_time_s:.3f} s "
            f"(max {self.restore_time_max_s:.3f} s, {self.restore_bytes} bytes), "
            f"{self.stores_reused} reused, {self.stores_opened} opened; {self.rows_in} rows "
            f"in, {self.rows_out} out, {self.keys} keys, {self.expired} expired, "
            f"{self.late_rows} late rows dropped, {self.timers_fired} timers fired"
        )


def _p50(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def aggregate(
    reports: Iterable[TaskReport], *, partitions: int, query_id: str, batch_id: int
) -> BatchMetrics:
    """Combine one operator's task reports of one micro-batch.

    A partition reported twice (its output consumed twice, e.g. in ``foreachBatch``) counts
    once, with its latest report.
    """
    latest: dict[int, TaskReport] = {}
    for report in reports:
        latest[report.partition] = report
    rs = list(latest.values())
    first = rs[0] if rs else None
    commits = [r.commit_s for r in rs]
    restores = [r.restore_s for r in rs if r.restored]
    return BatchMetrics(
        query_id=query_id,
        batch_id=batch_id,
        operator=first.operator if first else "",
        root=first.root if first else "",
        partitions=partitions,
        partitions_committed=len(rs),
        version=batch_id + 1,
        commit_latency_p50_s=_p50(commits),
        commit_latency_max_s=max(commits, default=0.0),
        bytes_uploaded=sum(r.bytes_uploaded for r in rs),
        puts=sum(r.puts for r in rs),
        deletes=sum(r.deletes for r in rs),
        snapshots_scheduled=sum(r.snapshot_scheduled for r in rs),
        stores_reused=sum(r.reused for r in rs),
        stores_opened=sum(not r.reused for r in rs),
        stores_restored=len(restores),
        restore_time_s=sum(restores),
        restore_time_max_s=max(restores, default=0.0),
        restore_bytes=sum(r.restore_bytes for r in rs if r.restored),
        rows_in=sum(r.rows_in for r in rs),
        rows_out=sum(r.rows_out for r in rs),
        keys=sum(r.keys for r in rs),
        expired=sum(r.expired for r in rs),
        task_time_max_s=max((r.task_s for r in rs), default=0.0),
        late_rows=sum(r.late_rows for r in rs),
        timers_fired=sum(r.timers_fired for r in rs),
    )


def batch_metrics(
    checkpoint: str,
    name: str,
    batch_id: int,
    *,
    storage_options: Mapping[str, str] | None = None,
    query_id: str | None = None,
) -> BatchMetrics | None:
    """The metrics of micro-batch ``batch_id`` of operator ``name``, from its task reports.

    Works anywhere the root can be read: a classic session, a Spark Connect client, a plain
    Python process. ``None`` if no task of that batch reported (yet, or the batch did not
    run). With ``query_id``, only reports of that streaming query count.

    Raises:
        StateNotFoundError: the operator is not in the root.
        CorruptStateError, ConfigMismatchError: a report is unreadable or too new.
        StorageError: the root cannot be read.
    """
    blobs = open_blob_store(checkpoint, storage_options)
    try:
        with StateBackend(blobs) as backend:
            partitions = backend.operators().get(name)
        if partitions is None:
            raise StateNotFoundError(f"operator {name!r} has no partition count in {blobs.uri}")
        reports = [
            r
            for r in read_reports(blobs, name, batch_id)
            if query_id is None or r.query_id == query_id
        ]
    finally:
        blobs.close()
    if not reports:
        return None
    return aggregate(
        reports, partitions=partitions, query_id=reports[0].query_id, batch_id=batch_id
    )
