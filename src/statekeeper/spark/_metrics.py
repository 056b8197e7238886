"""Per micro-batch, per operator metrics, aggregated on the driver from task reports."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from statekeeper.spark._reports import TaskReport

__all__ = ["BatchMetrics", "aggregate"]


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
            f"in, {self.rows_out} out, {self.keys} keys, {self.expired} expired"
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
    )
