"""``transform_with_state`` and its vectorized form: the driver-side checks and the tasks.

The plan is ``df -> repartition(partitions, *keys) -> mapInArrow(task)``: Spark's hash
partitioning (Murmur3 of the key columns, modulo ``partitions``) sends every row of a key to
the same task in every micro-batch, and the task index is the state partition. Inside a task
the micro-batch id ``b`` is the local property ``streaming.sql.batchId``: the task leases its
partition's store at version ``b`` (``_cache``), runs the processor, yields the output and
only then commits version ``b + 1``, so a task that fails or whose output is abandoned
commits nothing.

TTL is measured with the micro-batch timestamp, which Spark substitutes for
``current_timestamp()`` in streaming plans and records in its offset log: a re-run of batch
``b`` sees the timestamp of its first run, and rewrites identical state.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
from pyspark import Accumulator, TaskContext
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.pandas.types import to_arrow_schema

from statekeeper import layout
from statekeeper.config import StoreConfig
from statekeeper.errors import CommitConflictError, StateKeeperError
from statekeeper.keyed import StatefulProcessor
from statekeeper.spark._cache import CACHE, Lease, StoreSpec
from statekeeper.spark._listener import state_listener
from statekeeper.spark._reports import TaskReport
from statekeeper.spark._runner import ArrowFunction, RunStats, run_arrow, run_processor
from statekeeper.storage import open_blob_store
from statekeeper.store import CommitInfo, StateBackend, StateStore

__all__ = ["transform_with_state", "transform_with_state_arrow"]

_TS_COLUMN = "__statekeeper_batch_ts"
_KEY_TYPES = (
    T.StringType,
    T.BinaryType,
    T.BooleanType,
    T.ByteType,
    T.ShortType,
    T.IntegerType,
    T.LongType,
    T.FloatType,
    T.DoubleType,
    T.DecimalType,
    T.DateType,
    T.TimestampType,
    T.TimestampNTZType,
)
_UNIT_MS = {"s": 1000.0, "ms": 1.0, "us": 1e-3, "ns": 1e-6}


@dataclass(frozen=True)
class _TaskSpec:
    store: StoreSpec
    keys: tuple[str, ...]
    key_schema: str | None
    output_schema: Any  # pa.Schema
    ts_column: str | None


@dataclass(frozen=True)
class _TaskContext:
    batch_id: int
    partition: int
    query_id: str
    attempt: int


# -- driver side ---------------------------------------------------------------------------


def transform_with_state(
    df: DataFrame,
    keys: str | Sequence[str],
    processor: StatefulProcessor,
    output_schema: str | T.StructType,
    checkpoint: str,
    name: str,
    partitions: int,
    *,
    config: StoreConfig | None = None,
    storage_options: Mapping[str, str] | None = None,
    lock_timeout_s: float = 120.0,
) -> DataFrame:
    """Run ``processor`` per key of a streaming DataFrame, with state in ``checkpoint``.

    Args:
        df: a streaming DataFrame.
        keys: the grouping key column(s).
        processor: the :class:`StatefulProcessor`; a copy runs per partition and batch.
        output_schema: DDL string or StructType of the rows the processor yields.
        checkpoint: the checkpoint root URI (a path, ``file://``, ``s3://``, ...).
        name: the operator's name in the root.
        partitions: state partitions; fixed for the operator once recorded in the root.
        config: store configuration (``local_dir``, snapshots, retention, ...).
        storage_options: object store options (credentials, endpoint); sent to executors.
        lock_timeout_s: how long a task waits for a working copy another process holds.

    Returns:
        A streaming DataFrame of ``output_schema``, usable with any sink.

    Raises:
        ValueError: ``df`` is not streaming, a key column is missing or of an unsupported
            type, or an argument is malformed.
        TypeError: an argument has the wrong type.
        ConfigMismatchError: the root records another partition count for ``name``.
        StateKeeperError: the root cannot be read.
    """
    if not isinstance(processor, StatefulProcessor):
        raise TypeError(
            f"processor must be a StatefulProcessor instance, got {type(processor).__name__}"
        )
    key_names = _check_input(df, keys, reserved=_TS_COLUMN)
    schema = _output_struct(df.sparkSession, output_schema)
    spec, accumulator = _prepare(
        df, key_names, schema, checkpoint, name, partitions, config, storage_options,
        lock_timeout_s, ts_column=_TS_COLUMN,
    )  # fmt: skip
    task = functools.partial(_rows_task, spec, processor, accumulator)
    prepared = df.withColumn(_TS_COLUMN, F.current_timestamp())
    return prepared.repartition(partitions, *key_names).mapInArrow(task, schema)


def transform_with_state_arrow(
    df: DataFrame,
    keys: str | Sequence[str],
    fn: ArrowFunction,
    output_schema: str | T.StructType,
    checkpoint: str,
    name: str,
    partitions: int,
    *,
    config: StoreConfig | None = None,
    storage_options: Mapping[str, str] | None = None,
    lock_timeout_s: float = 120.0,
) -> DataFrame:
    """The vectorized form: ``fn(store, batches)`` gets a partition's whole input.

    ``fn`` receives a :class:`PartitionStore` (``get``, ``multi_get``, ``scan``, ``put``,
    ``delete``, ``put_many``, ``delete_many`` on raw bytes, at version ``batch_id``) and an
    iterator of pyarrow RecordBatches (rows of many keys, hash-partitioned by ``keys``), and
    yields RecordBatches of ``output_schema``. Statekeeper commits after the last one.
    Arguments and errors are those of :func:`transform_with_state`.

    Raises:
        ValueError, TypeError, ConfigMismatchError, StateKeeperError: as
            :func:`transform_with_state`.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    key_names = _check_input(df, keys, reserved=None)
    schema = _output_struct(df.sparkSession, output_schema)
    spec, accumulator = _prepare(
        df, key_names, schema, checkpoint, name, partitions, config, storage_options,
        lock_timeout_s, ts_column=None,
    )  # fmt: skip
    task = functools.partial(_arrow_task, spec, fn, accumulator)
    return df.repartition(partitions, *key_names).mapInArrow(task, schema)


def _check_input(df: DataFrame, keys: str | Sequence[str], reserved: str | None) -> list[str]:
    if not isinstance(df, DataFrame):
        raise TypeError(f"df must be a pyspark DataFrame, got {type(df).__name__}")
    if not df.isStreaming:
        raise ValueError(
            "transform_with_state needs a streaming DataFrame (from spark.readStream); got a "
            "batch DataFrame. Micro-batch ids drive the state versions, and a batch "
            "DataFrame has none"
        )
    names = _key_names(keys)
    fields = {f.name: f for f in df.schema.fields}
    missing = [k for k in names if k not in fields]
    if missing:
        raise ValueError(
            f"key columns {missing} are not in the DataFrame; its columns are {list(fields)}"
        )
    for k in names:
        if not isinstance(fields[k].dataType, _KEY_TYPES):
            raise ValueError(
                f"key column {k!r} has type {fields[k].dataType.simpleString()}; keys must be "
                "strings, binary, booleans, numbers, decimals, dates or timestamps"
            )
    if reserved is not None and reserved in fields:
        raise ValueError(f"column name {reserved!r} is reserved by statekeeper")
    return names


def _output_struct(spark: SparkSession, output_schema: str | T.StructType) -> T.StructType:
    if isinstance(output_schema, str):
        from pyspark.sql.types import _parse_datatype_string

        parsed = _parse_datatype_string(output_schema)
    elif isinstance(output_schema, T.StructType):
        parsed = output_schema
    else:
        kind = type(output_schema).__name__
        raise TypeError(f"output_schema must be a DDL string or a StructType, got {kind}")
    if not isinstance(parsed, T.StructType) or not parsed.fields:
        raise ValueError(f"output_schema must describe a struct of columns, got {output_schema!r}")
    return parsed


def _arrow_schema(spark: SparkSession, schema: T.StructType) -> Any:
    large = str(spark.conf.get("spark.sql.execution.arrow.useLargeVarTypes", "false")).lower()
    timezone = spark.conf.get("spark.sql.session.timeZone", "UTC")
    return to_arrow_schema(schema, timezone=timezone, prefers_large_types=large == "true")


def _prepare(
    df: DataFrame,
    key_names: list[str],
    schema: T.StructType,
    checkpoint: str,
    name: str,
    partitions: int,
    config: StoreConfig | None,
    storage_options: Mapping[str, str] | None,
    lock_timeout_s: float,
    *,
    ts_column: str | None,
) -> tuple[_TaskSpec, Accumulator[Any]]:
    """Validate, register the operator in the root (checking ``partitions``), wire metrics."""
    layout.validate_operator(name)
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise ValueError(f"partitions must be an int >= 1, got {partitions!r}")
    if not isinstance(lock_timeout_s, int | float) or lock_timeout_s <= 0:
        raise ValueError(f"lock_timeout_s must be a positive number, got {lock_timeout_s!r}")
    config = StoreConfig() if config is None else config
    if not isinstance(config, StoreConfig):
        raise TypeError(f"config must be a StoreConfig, got {type(config).__name__}")
    if not isinstance(checkpoint, str):
        raise TypeError(f"checkpoint must be a str URI or path, got {type(checkpoint).__name__}")
    blobs = open_blob_store(checkpoint, storage_options, io_threads=config.io_threads)
    # Refuses another partition count before any state is touched.
    StateBackend(blobs, config=config).register(name, partitions)
    listener = state_listener(df.sparkSession)
    listener.register(blobs, name, partitions)
    # Workers must open the same root: a relative local path would resolve in their cwd.
    root = checkpoint if "://" in checkpoint else blobs.uri
    store = StoreSpec(
        root, name, partitions, config, StoreSpec.options(storage_options), float(lock_timeout_s)
    )
    key_schema = T.StructType([df.schema[k] for k in key_names]).json()
    spec = _TaskSpec(
        store, tuple(key_names), key_schema, _arrow_schema(df.sparkSession, schema), ts_column
    )
    return spec, listener.accumulator


# -- task side -----------------------------------------------------------------------------


def _task_context() -> _TaskContext:
    tc = TaskContext.get()
    if tc is None:
        raise StateKeeperError("statekeeper tasks must run inside a Spark task")
    raw = tc.getLocalProperty("streaming.sql.batchId")
    if raw is None:
        raise StateKeeperError(
            "this task has no micro-batch id (local property streaming.sql.batchId): the "
            "output of transform_with_state must be run by a streaming query"
        )
    query = tc.getLocalProperty("sql.streaming.queryId") or ""
    return _TaskContext(int(raw), tc.partitionId(), query, tc.attemptNumber())


def _collect(batches: Iterator[Any], ts_column: str) -> tuple[Any, int | None]:
    """The partition's input as one table, without the timestamp column, and the timestamp."""
    kept: list[Any] = []
    now_ms: int | None = None
    for batch in batches:
        if batch.num_rows == 0:
            continue
        column = batch.column(ts_column)
        if now_ms is None:
            raw = column.cast(pa.int64())[0].as_py()
            now_ms = round(raw * _UNIT_MS[column.type.unit])
        kept.append(batch.drop_columns([ts_column]))
    if not kept:
        return pa.table({}), now_ms
    return pa.Table.from_batches(kept), now_ms


def _commit(store: StateStore, spec: _TaskSpec, ctx: _TaskContext) -> CommitInfo:
    try:
        return store.commit()
    except CommitConflictError as exc:
        raise CommitConflictError(
            f"micro-batch {ctx.batch_id} of operator {spec.store.operator!r} partition "
            f"{ctx.partition} was already committed (version {ctx.batch_id + 1}) with other "
            "state changes. The batch is being re-run and produced different state: the "
            "processor must be deterministic for a given input (use handle.batch_timestamp_ms, "
            "not the wall clock), and the query's checkpointLocation must belong to this "
            f"state root ({exc})"
        ) from exc


def _rows_task(
    spec: _TaskSpec, processor: StatefulProcessor, accumulator: Accumulator[Any], batches: Any
) -> Iterator[Any]:
    started = time.perf_counter()
    ctx = _task_context()
    assert spec.ts_column is not None
    table, now_ms = _collect(batches, spec.ts_column)  # all input first: keys come together
    lease = CACHE.acquire(spec.store, ctx.partition, ctx.batch_id)
    stats = RunStats()
    try:
        yield from run_processor(
            lease.store, processor, table, keys=spec.keys, output_schema=spec.output_schema,
            operator=spec.store.operator, batch_id=ctx.batch_id, partition=ctx.partition,
            now_ms=now_ms, key_schema=spec.key_schema, stats=stats,
        )  # fmt: skip
        info = _commit(lease.store, spec, ctx)
    except BaseException:
        CACHE.release(lease, ok=False)
        raise
    CACHE.release(lease, ok=True)
    accumulator.add(_report(lease, info, stats, ctx, time.perf_counter() - started))


def _arrow_task(
    spec: _TaskSpec, fn: ArrowFunction, accumulator: Accumulator[Any], batches: Any
) -> Iterator[Any]:
    started = time.perf_counter()
    ctx = _task_context()
    lease = CACHE.acquire(spec.store, ctx.partition, ctx.batch_id)
    stats = RunStats()
    try:
        yield from run_arrow(
            lease.store, fn, batches, output_schema=spec.output_schema,
            operator=spec.store.operator, batch_id=ctx.batch_id, partition=ctx.partition,
            stats=stats,
        )  # fmt: skip
        info = _commit(lease.store, spec, ctx)
    except BaseException:
        CACHE.release(lease, ok=False)
        raise
    CACHE.release(lease, ok=True)
    accumulator.add(_report(lease, info, stats, ctx, time.perf_counter() - started))


def _report(
    lease: Lease, info: CommitInfo, stats: RunStats, ctx: _TaskContext, task_s: float
) -> TaskReport:
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
    )


def _key_names(keys: str | Sequence[str]) -> list[str]:
    """Normalize a key column argument to a list of names.

    Raises:
        TypeError: not a str or a sequence of str.
        ValueError: empty, or a name repeats.
    """
    names = [keys] if isinstance(keys, str) else list(keys)
    if not names:
        raise ValueError("keys must name at least one column")
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"key column names must be str, got {type(name).__name__}")
    if len(set(names)) != len(names):
        raise ValueError(f"key columns repeat: {names}")
    return names
