"""The driver side of metrics and epoch manifests: one listener per SparkSession.

Tasks add a :class:`TaskReport` to an accumulator after they commit; Spark merges the updates
of successful attempts on the driver before the micro-batch ends. When the query's progress
event for that batch arrives, the listener takes the batch's reports, logs one line per
operator (logger ``statekeeper.spark``), keeps a :class:`BatchMetrics` for users to read, and
hands the epoch manifest to a background thread (listing snapshot folders must not hold up
Spark's listener bus). A failure here is logged and never affects the query.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pyspark import Accumulator
from pyspark.sql import SparkSession
from pyspark.sql.streaming.listener import StreamingQueryListener

from statekeeper.epochs import build_manifest, write_manifest
from statekeeper.errors import StateKeeperError
from statekeeper.spark._metrics import BatchMetrics, aggregate
from statekeeper.spark._reports import ReportParam, ReportSink, TaskReport
from statekeeper.storage import BlobStore

__all__ = ["StateListener", "state_listener"]

_log = logging.getLogger("statekeeper.spark")
_HISTORY = 1000


@dataclass(frozen=True)
class _Operator:
    blobs: BlobStore
    name: str
    partitions: int


class StateListener(StreamingQueryListener):
    """Collects per-batch metrics of statekeeper operators and writes epoch manifests.

    Get the session's instance with :func:`state_listener`.
    """

    def __init__(self, accumulator: Accumulator[Any], sink: ReportSink) -> None:
        """Listen for reports arriving in ``sink`` through ``accumulator``."""
        super().__init__()
        self.accumulator = accumulator
        self._sink = sink
        self._operators: dict[tuple[str, str], _Operator] = {}
        self._history: deque[BatchMetrics] = deque(maxlen=_HISTORY)
        self._cond = threading.Condition()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="statekeeper-epochs")
        self._pending: list[Future[None]] = []
        self.manifests: deque[tuple[str, int]] = deque(maxlen=_HISTORY)
        """(root URI, epoch) of the epoch manifests this listener wrote (the newest 1000)."""

    def register(self, blobs: BlobStore, name: str, partitions: int) -> None:
        """Tell the listener about an operator (its root and partition count).

        The listener keeps ``blobs`` to write epoch manifests with, or closes it if it
        already has a blob store for that root.
        """
        with self._cond:
            known = next(
                (op.blobs for op in self._operators.values() if op.blobs.uri == blobs.uri), None
            )
            self._operators[(blobs.uri, name)] = _Operator(known or blobs, name, partitions)
        if known is not None and known is not blobs:
            blobs.close()

    # -- StreamingQueryListener -----------------------------------------------------------

    def onQueryStarted(self, event: Any) -> None:
        """Nothing to do."""

    def onQueryIdle(self, event: Any) -> None:
        """Nothing to do."""

    def onQueryTerminated(self, event: Any) -> None:
        """Nothing to do."""

    def onQueryProgress(self, event: Any) -> None:
        """Turn the batch's task reports into metrics and an epoch manifest."""
        try:
            progress = event.progress
            self.handle_batch(str(progress.id), int(progress.batchId), str(progress.runId))
        except Exception:  # noqa: BLE001 - a listener must never take the query down
            _log.exception("statekeeper could not process a query progress event")

    # -- public ---------------------------------------------------------------------------

    def handle_batch(self, query_id: str, batch_id: int, run_id: str | None = None) -> None:
        """Process the reports of one finished micro-batch (called per progress event)."""
        reports = self._sink.pop(query_id, batch_id)
        if not reports:
            return
        groups: dict[tuple[str, str], list[TaskReport]] = defaultdict(list)
        for report in reports:
            groups[(report.root, report.operator)].append(report)
        metrics = []
        by_root: dict[str, dict[str, tuple[int, dict[int, str]]]] = defaultdict(dict)
        for (root, name), group in sorted(groups.items()):
            op = self._operators.get((root, name))
            count = op.partitions if op else max(r.partition for r in group) + 1
            m = aggregate(group, partitions=count, query_id=query_id, batch_id=batch_id)
            _log.info("statekeeper %s", m.summary())
            metrics.append(m)
            if op is not None:
                by_root[root][name] = (count, {r.partition: r.commit_blob for r in group})
        with self._cond:
            self._history.extend(metrics)
            for root, operators in by_root.items():
                blobs = self._operators[(root, next(iter(operators)))].blobs
                args = (blobs, query_id, batch_id, run_id, operators)
                self._pending.append(self._pool.submit(self._write_epoch, *args))
            self._cond.notify_all()

    def metrics(
        self, query_id: str | None = None, operator: str | None = None
    ) -> list[BatchMetrics]:
        """Metrics of recent micro-batches (the newest 1000), oldest first."""
        with self._cond:
            return [
                m
                for m in self._history
                if (query_id is None or m.query_id == query_id)
                and (operator is None or m.operator == operator)
            ]

    def wait_for(self, query_id: str, batch_id: int, timeout: float = 30.0) -> list[BatchMetrics]:
        """Wait until the metrics of ``batch_id`` of ``query_id`` are in; return them.

        Raises:
            TimeoutError: they did not arrive within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [
                    m for m in self._history if m.query_id == query_id and m.batch_id == batch_id
                ]
                remaining = deadline - time.monotonic()
                if found or remaining <= 0:
                    break
                self._cond.wait(remaining)
        if not found:
            raise TimeoutError(f"no statekeeper metrics for batch {batch_id} of query {query_id}")
        return found

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every epoch manifest scheduled so far is written (or failed).

        Raises:
            TimeoutError: writes are still running after ``timeout`` seconds.
        """
        with self._cond:
            pending, self._pending = self._pending, []
        deadline = time.monotonic() + timeout
        for future in pending:
            future.exception(timeout=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop the manifest thread (after the writes already scheduled)."""
        self._pool.shutdown(wait=False)

    def _write_epoch(
        self,
        blobs: BlobStore,
        query_id: str,
        epoch: int,
        run_id: str | None,
        operators: dict[str, tuple[int, dict[int, str]]],
    ) -> None:
        try:
            manifest, why = build_manifest(
                blobs, epoch=epoch, query_id=query_id, run_id=run_id, operators=operators
            )
            if manifest is None:
                _log.warning("no epoch manifest for batch %s of %s: %s", epoch, blobs.uri, why)
                return
            if write_manifest(blobs, manifest):
                with self._cond:
                    self.manifests.append((blobs.uri, epoch))
            else:
                _log.info("epoch %s of %s was recorded already (a re-run)", epoch, blobs.uri)
        except StateKeeperError as exc:
            _log.warning("could not write the epoch manifest %s of %s: %s", epoch, blobs.uri, exc)


_listeners: dict[int, tuple[SparkSession, StateListener]] = {}
_listeners_lock = threading.Lock()


def state_listener(spark: SparkSession) -> StateListener:
    """The statekeeper listener of ``spark`` (added to ``spark.streams`` on first use)."""
    with _listeners_lock:
        for key, (session, old) in list(_listeners.items()):
            if getattr(session.sparkContext, "_jsc", None) is None:  # stopped
                old.close()
                del _listeners[key]
        found = _listeners.get(id(spark))
        if found is not None and found[0] is spark:
            return found[1]
        sink = ReportSink()
        accumulator = spark.sparkContext.accumulator(sink, ReportParam())
        listener = StateListener(accumulator, sink)
        spark.streams.addListener(listener)
        _listeners[id(spark)] = (spark, listener)
        return listener
