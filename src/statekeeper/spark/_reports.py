"""Task reports: what each successful task did, carried to the driver by an accumulator.

Why an accumulator and not report blobs: Spark merges accumulator updates of *successful*
task attempts only, on the driver, before the job (hence the micro-batch) completes — so when
the listener sees a batch's progress event, exactly one report per committed partition is
there, failed attempts are excluded for free, and tasks write nothing extra to the blob store.
The update travels with the task result (a few hundred bytes per task).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from pyspark.accumulators import AccumulatorParam

__all__ = ["ReportParam", "ReportSink", "TaskReport"]


@dataclass(frozen=True, slots=True)
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


class ReportSink:
    """Driver-side accumulator value: reports grouped by (query id, batch id). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reports: dict[tuple[str, int], list[TaskReport]] = {}

    def add(self, reports: list[TaskReport]) -> None:
        """File reports (called by PySpark's accumulator server thread)."""
        with self._lock:
            for report in reports:
                self._reports.setdefault((report.query_id, report.batch_id), []).append(report)

    def pop(self, query_id: str, batch_id: int) -> list[TaskReport]:
        """Take the reports of one micro-batch, dropping those of earlier ones of that query.

        Earlier batches' leftovers exist only when a progress event was missed; they can no
        longer be matched to one.
        """
        with self._lock:
            found = self._reports.pop((query_id, batch_id), [])
            for key in [k for k in self._reports if k[0] == query_id and k[1] < batch_id]:
                del self._reports[key]
        return found

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._reports.values())


class ReportParam(AccumulatorParam[Any]):
    """Workers accumulate a list of reports; the driver files them into a ReportSink."""

    def zero(self, value: Any) -> list[TaskReport]:
        """Each task starts with an empty list."""
        return []

    def addInPlace(self, value1: Any, value2: Any) -> Any:
        """Worker: append one report; driver: file a task's list into the sink."""
        if isinstance(value1, ReportSink):
            value1.add(list(value2))
            return value1
        if isinstance(value2, TaskReport):
            value1.append(value2)
        else:
            value1.extend(value2)
        return value1
