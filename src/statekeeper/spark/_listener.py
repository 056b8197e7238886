"""Per-batch metrics and epoch manifests on the driver: reports read back from the root.

Tasks write a task report blob after they commit (:mod:`statekeeper.reports`). Anyone may
aggregate a micro-batch's reports: :func:`batch_metrics` does it on demand, from a classic
session, a Spark Connect client or a plain Python process. On classic sessions a listener is
optional sugar: on each query progress event it reads the batch's reports of the operators
built in that session, logs one line per operator (logger ``statekeeper.spark``), keeps a
:class:`BatchMetrics` for users to read, and writes the epoch manifest. All of that runs on a
background thread (listing the root must not hold up Spark's listener bus); a failure is
logged and never affects the query.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql.streaming.listener import StreamingQueryListener

from statekeeper.epochs import build_manifest, write_manifest
from statekeeper.errors import StateKeeperError
from statekeeper.reports import TaskReport, read_reports
from statekeeper.spark._metrics import BatchMetrics, aggregate
from statekeeper.storage import BlobStore
from statekeeper.store import StateBackend

__all__ = [
    "StateListener",
    "listener_of",
    "register_operator",
    "remove_state_listener",
    "state_listener",
]

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

    def __init__(self) -> None:
        """A listener that knows no operator yet (see :meth:`register`)."""
        super().__init__()
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
        """Schedule the processing of one finished micro-batch (called per progress event)."""
        with self._cond:
            operators = list(self._operators.values())
            self._pending = [f for f in self._pending if not f.done()]  # bounded
            future = self._pool.submit(self._process, operators, query_id, batch_id, run_id)
            future.add_done_callback(_log_failure)
            self._pending.append(future)

    def _process(
        self, operators: list[_Operator], query_id: str, batch_id: int, run_id: str | None
    ) -> None:
        metrics = []
        by_root: dict[str, dict[str, int]] = defaultdict(dict)
        stores: dict[str, BlobStore] = {}
        for op in sorted(operators, key=lambda o: (o.blobs.uri, o.name)):
            try:
                found = read_reports(op.blobs, op.name, batch_id)
            except StateKeeperError as exc:
                _log.warning("could not read the task reports of %s: %s", op.name, exc)
                continue
            group: list[TaskReport] = [r for r in found if r.query_id == query_id]
            if not group:
                continue  # an operator of another query
            m = aggregate(group, partitions=op.partitions, query_id=query_id, batch_id=batch_id)
            _log.info("statekeeper %s", m.summary())
            metrics.append(m)
            stores[op.blobs.uri] = op.blobs
            by_root[op.blobs.uri][op.name] = op.partitions
        with self._cond:
            self._history.extend(metrics)
            self._cond.notify_all()
        for root, ops in by_root.items():
            self._write_epoch(stores[root], query_id, batch_id, run_id, ops)

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
        with self._cond:  # a copy: a flush at the same time waits for the same work
            pending = list(self._pending)
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
        operators: dict[str, int],
    ) -> None:
        try:
            # Only the root id is wanted: the backend is not closed, as that would close the
            # listener's blob store (it starts no thread before a store is opened).
            meta = StateBackend(blobs).root_metadata()
            manifest, why = build_manifest(
                blobs, epoch=epoch, query_id=query_id, run_id=run_id, operators=operators,
                root_id="" if meta is None else meta.root_id,
            )  # fmt: skip
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


def _log_failure(future: Future[None]) -> None:
    error = None if future.cancelled() else future.exception()
    if error is not None:
        _log.error("statekeeper could not process a micro-batch", exc_info=error)


_listeners: dict[int, tuple[Any, StateListener]] = {}
_listeners_lock = threading.Lock()


def _is_classic(spark: object) -> bool:
    # Spark Connect's session is another class; its listeners run in the client.
    return isinstance(spark, SparkSession)


def state_listener(spark: Any) -> StateListener:
    """The statekeeper listener of ``spark`` (added to ``spark.streams`` on first use).

    A classic session gets one implicitly, with its first statekeeper operator. On Spark
    Connect it is opt-in: call this before building the queries it should follow. It runs
    in this client, which reads the task reports from the root and writes the epoch
    manifests that tell ``read_state`` and ``statekeeper repartition`` which micro-batch a
    query finished (without them the newest version every partition has is read, and a
    repartition may ask which version to use). Spark Connect's listener thread keeps the
    client process alive until :func:`remove_state_listener` or ``spark.stop()``. Without
    it, read metrics with :func:`batch_metrics`.

    A listener taken off with ``spark.streams.removeListener`` instead stays this session's
    statekeeper listener, and gets no more events: use :func:`remove_state_listener`, after
    which this call adds a new one.
    """
    with _listeners_lock:
        for key, (session, old) in list(_listeners.items()):
            if _stopped(session, spark):
                old.close()
                del _listeners[key]
        found = _listeners.get(id(spark))
        if found is not None and found[0] is spark:
            return found[1]
        listener = StateListener()
        spark.streams.addListener(listener)
        _listeners[id(spark)] = (spark, listener)
        return listener


def remove_state_listener(spark: Any) -> bool:
    """Take ``spark``'s statekeeper listener off ``spark.streams`` and stop its thread, so
    that a Spark Connect client can exit, and the next
    :func:`state_listener` (or a classic session's next operator) adds a new one. Returns
    False if the session had none."""
    with _listeners_lock:
        found = _listeners.get(id(spark))
        if found is None or found[0] is not spark:
            return False
        del _listeners[id(spark)]
    try:
        spark.streams.removeListener(found[1])
    finally:
        found[1].close()
    return True


def _stopped(session: Any, current: Any) -> bool:
    """Whether the listener of ``session`` belongs to a session that is gone: a Spark
    Connect session that was stopped, or a classic one of an earlier, stopped context."""
    if not _is_classic(session):
        return bool(session.is_stopped)
    return _is_classic(current) and session.sparkContext is not current.sparkContext


def listener_of(spark: Any) -> StateListener | None:
    """``spark``'s statekeeper listener: a classic session's (made if need be), or the one a
    Spark Connect client opted in to (``None`` if it did not)."""
    if _is_classic(spark):
        return state_listener(spark)
    with _listeners_lock:
        found = _listeners.get(id(spark))
    return found[1] if found is not None and found[0] is spark else None


def register_operator(spark: Any, blobs: BlobStore, name: str, partitions: int) -> None:
    """Tell ``spark``'s listener about an operator; without one (a Spark Connect client that
    did not opt in) just close ``blobs``."""
    listener = listener_of(spark)
    if listener is not None:
        listener.register(blobs, name, partitions)
    else:
        blobs.close()
