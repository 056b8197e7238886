"""The streaming query of the demo: session, input stream, one phase's run, its metrics.

Each phase starts the same query (the same ``checkpointLocation``) with ``availableNow``:
it reads the input files not yet processed, one per micro-batch, and stops. While it runs,
the state listener's :class:`~statekeeper.spark.BatchMetrics` of every finished micro-batch
become a :class:`BatchRow`; the open sessions in state are counted by a driver-side
:class:`StateMonitor` that follows the root.

The operator runs in event time on ``event_time`` (the click's ``ts`` as a timestamp), with
the options' watermark delay: late clicks are dropped, and sessions close on timers.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

from statekeeper.cli.demo._clicks import INPUT_SCHEMA
from statekeeper.cli.demo._options import OPERATOR, DemoError, DemoOptions, DemoPaths
from statekeeper.cli.demo._rows import BatchRow
from statekeeper.cli.demo._sessionizer import OPEN, OUTPUT_SCHEMA, Sessionizer
from statekeeper.config import StoreConfig
from statekeeper.keyed import iter_state
from statekeeper.spark import BatchMetrics, StateListener, state_listener, transform_with_state
from statekeeper.store import StateBackend

__all__ = ["EVENT_TIME", "StateMonitor", "build_session", "run_phase", "store_config"]

SNAPSHOT_EVERY = 3
EVENT_TIME = "event_time"
"""The input column of event times: the click's ``ts`` (seconds) as a timestamp."""
_POLL_S = 0.1
_METRICS_TIMEOUT_S = 60.0
Emit = Callable[[BatchRow], None]


def build_session(paths: DemoPaths, options: DemoOptions) -> SparkSession:
    """A ``local[2]`` SparkSession whose JVM (and its Python workers) log to a file.

    The JVM inherits this process's stderr when it starts: pointing that at
    ``<logs>/spark-<pid>.log`` for the moment of the start keeps Spark's output out of the
    demo's, without touching Python's own stderr.
    """
    paths.logs.mkdir(parents=True, exist_ok=True)
    with _stderr_to(paths.logs / f"spark-{os.getpid()}.log"):
        spark = (
            SparkSession.builder.master("local[2]")
            .appName("statekeeper-demo")
            .config("spark.sql.shuffle.partitions", str(options.partitions))
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.session.timeZone", "UTC")
            .config("spark.driver.memory", "1g")
            .config("spark.sql.streaming.stopTimeout", "30s")
            .getOrCreate()
        )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Point file descriptor 2 at ``path`` (appending) until the block ends."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with path.open("ab") as f:
            os.dup2(f.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def store_config(local_dir: str) -> StoreConfig:
    """The demo's store configuration.

    Snapshots come every few versions, so that restores use them. The working copies are
    flushed at every commit (``local_checkpoint_interval_s=0``; the default flushes at most
    once a minute and lets the changelogs catch a copy up after a crash), so that the
    restart after the crash shows plain local reuse.
    """
    return StoreConfig(
        local_dir=local_dir, snapshot_every=SNAPSHOT_EVERY, local_checkpoint_interval_s=0
    )


def _input_stream(spark: SparkSession, options: DemoOptions, folder: Path) -> DataFrame:
    reader = spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1)
    if options.file_format == "csv":
        reader = reader.option("header", "true")
    clicks = reader.format(options.file_format).load(str(folder))
    return clicks.withColumn(EVENT_TIME, F.timestamp_seconds("ts"))


def run_phase(
    spark: SparkSession, options: DemoOptions, phase: str, local_dir: str, emit: Emit
) -> None:
    """Run the query until the input files present now are processed; emit every batch.

    Raises:
        DemoError: the query failed.
        StateKeeperError: the root failed.
    """
    paths = options.paths()
    out = transform_with_state(
        _input_stream(spark, options, paths.input),
        keys="user",
        processor=Sessionizer(options.gap_s),
        output_schema=OUTPUT_SCHEMA,
        checkpoint=paths.root,
        name=OPERATOR,
        partitions=options.partitions,
        config=store_config(local_dir),
        storage_options=options.storage_options or None,
        time_mode="event_time",
        event_time_column=EVENT_TIME,
        watermark_delay=options.delay_s,
    )
    listener = state_listener(spark)
    done = max((m.batch_id for m in listener.metrics(operator=OPERATOR)), default=-1)
    query = (
        out.writeStream.format("parquet")
        .option("path", str(paths.output))
        .option("checkpointLocation", str(paths.checkpoint))
        .queryName(f"sessions-{phase}")
        .trigger(availableNow=True)
        .start()
    )
    monitor = StateMonitor(options, str(paths.monitor / phase))
    try:
        _follow(query, listener, done, lambda m: emit(_row(phase, m, query, monitor)))
    finally:
        monitor.close()
    listener.flush()


def _follow(
    query: StreamingQuery, listener: StateListener, done: int, on: Callable[[BatchMetrics], None]
) -> None:
    """Hand every batch after ``done`` to ``on`` as its metrics come in, until the end."""
    while True:
        finished = not query.isActive
        if not finished:
            time.sleep(_POLL_S)
        if finished:
            error = query.exception()
            if error is not None:
                raise DemoError(f"the streaming query failed: {error}")
            last = query.lastProgress
            if last is not None and last.batchId > done:
                listener.wait_for(str(query.id), last.batchId, timeout=_METRICS_TIMEOUT_S)
        for metrics in listener.metrics(str(query.id), OPERATOR):
            if metrics.batch_id > done:
                on(metrics)
                done = metrics.batch_id
        if finished:
            return


def _row(phase: str, m: BatchMetrics, query: StreamingQuery, monitor: StateMonitor) -> BatchRow:
    durations = [p.durationMs for p in query.recentProgress if p.batchId == m.batch_id]
    duration = durations[-1].get("triggerExecution") if durations else None
    return BatchRow(
        phase=phase,
        batch_id=m.batch_id,
        version=m.version,
        partitions=m.partitions,
        partitions_committed=m.partitions_committed,
        rows_in=m.rows_in,
        late_rows=m.late_rows,
        sessions_closed=m.rows_out,
        open_sessions=monitor.open_sessions(m.version),
        commit_p50_ms=m.commit_latency_p50_s * 1000,
        commit_max_ms=m.commit_latency_max_s * 1000,
        bytes_uploaded=m.bytes_uploaded,
        snapshots=m.snapshots_scheduled,
        stores_opened=m.stores_opened,
        stores_restored=m.stores_restored,
        restore_bytes=m.restore_bytes,
        restore_s=m.restore_time_s,
        duration_ms=None if duration is None else int(duration),
    )


class StateMonitor:
    """Counts open sessions at a version, following the root with its own local copies.

    Each call opens every partition at the version asked for; its local copy is then one
    version behind, so only the newest changelog is downloaded and replayed. It never writes
    to the root, and never touches the query's working copies.
    """

    def __init__(self, options: DemoOptions, local_dir: str) -> None:
        """Follow the root of ``options``, keeping copies in ``local_dir``."""
        self._backend = StateBackend(
            options.paths().root,
            config=StoreConfig(local_dir=local_dir),
            storage_options=options.storage_options or None,
        )
        self._partitions = options.partitions

    def open_sessions(self, version: int) -> int:
        """Sessions in the ``open`` states at ``version``, over all partitions.

        Raises:
            StateNotFoundError: a partition lacks ``version``.
        """
        total = 0
        for partition in range(self._partitions):
            with self._backend.open(OPERATOR, partition, version) as store:
                total += sum(len(entry.value) for entry in iter_state(store, state=OPEN))
        return total

    def close(self) -> None:
        """Release the backend."""
        self._backend.close()
