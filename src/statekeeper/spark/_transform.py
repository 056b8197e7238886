"""``transform_with_state`` and its vectorized form: the driver-side checks and the tasks.

The plan is ``df -> key group -> repartitionById(partitions, kg * P div G) ->
mapInArrow(task) -> repartitionById``:

* Keys map to **key groups**, and key groups to partitions in contiguous ranges (the root
  records ``G`` key groups per operator, :mod:`statekeeper.keyed._layout`): a column
  ``pmod(hash(keys), G)`` (Spark's Murmur3, computed once, in the plan) is the key group;
  ``repartitionById`` sends the row to partition ``kg * P div G``, the same in every
  micro-batch. The key group travels with the row (4 bytes of shuffle) because the task
  prefixes every state key with it, so that a later rescale moves whole key-group ranges.
  The task learns its **state partition from the data**; every row's key group must lie in
  that partition's range, or the task fails with an error instead of touching a wrong store.
* An operator created by statekeeper 0.1 has no key groups: it keeps Spark's hash
  partitioning (``repartition(P, *keys)``, then a column ``pmod(hash(keys), P)`` computed
  after the shuffle) and keys without a prefix, so its state stays where it is.
* An empty partition still runs its task and must still commit its store, but it has no row
  to learn its partition from, only ``TaskContext.partitionId()``. That is the shuffle
  partition only if no narrow operation (``coalesce``, ``union``) shares the stage: with
  ``coalesce(1)`` one task runs the function once per shuffle partition, every time with
  partition id 0. So the output ends with ``repartitionById(partitions,
  spark_partition_id())``, a stage boundary that keeps each row in its partition: whatever
  the user appends runs in a later stage, and the operator's task ids are always its
  shuffle partitions. The boundary also makes a second action over the output (a
  ``foreachBatch`` sink writing the micro-batch twice) read the shuffle's files instead of
  running the operator again: without it each action ran every task of the operator
  once more, each stepping its store back and committing again. And an action that reads
  only part of the output (``first()``, ``show()``, a ``limit``) would stop the operator's
  tasks part-way, before their commit, or never start some: behind the boundary the
  operator's stage always runs whole. The price is one shuffle
  of the *output* (usually far smaller than the input; in ``benchmarks/pipeline.py``,
  with one output row per key, an extra job of 120-130 ms, 14-20% of a 100k-row
  micro-batch). A non-empty task checks that its data and its task id agree.
* A micro-batch whose input to the operator is empty may run no task of it at all: the
  optimizer plans a source with no new data as an empty relation, and adaptive execution
  skips the tasks after an empty shuffle (a filter that drops every row, a union whose
  other source alone has data). No version ``b + 1`` is committed then; the next batch's
  tasks commit the skipped versions empty, each owned by the query, before their own
  (``_tasks._acquire``): an empty batch changes no state.
* Inside a task (:mod:`statekeeper.spark._tasks`) the micro-batch id ``b`` is the local
  property ``streaming.sql.batchId``:
  the task leases its partition's store at version ``b`` (``_cache``), runs the processor,
  yields the output and only then commits version ``b + 1``, so a task that fails or whose
  output is abandoned commits nothing. Then it writes a task report into the root
  (:mod:`statekeeper.reports`): that is how metrics reach a Spark Connect client.
* Commits carry an order ``(generation, stage id, stage attempt, task attempt)``; the
  generation is bumped in the root each time the operator is (re)started, so a re-run
  replaces an older attempt and a zombie task of an earlier run is refused. Speculative
  execution would run two live attempts of one task, so it is refused.

TTL and processing-time timers are measured with the micro-batch timestamp, which Spark
substitutes for ``current_timestamp()`` in streaming plans and records in its offset log: a
re-run of batch ``b`` sees the timestamp of its first run. It is added after the shuffle (no
shuffle bytes), on the heartbeat rows alone, which reach every state partition
(:mod:`statekeeper.spark._time`), so TTL expires and timers fire in partitions without input
too. An operator that needs no clock there (no time mode, no initial state, no state with a
TTL, as its ``init`` declares them on the driver) and an operator of statekeeper 0.1 have no
heartbeats and get it on every row.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from statekeeper import layout
from statekeeper.config import StoreConfig
from statekeeper.keyed import StatefulProcessor, declared_ttls
from statekeeper.spark._arrow_types import arrow_schema
from statekeeper.spark._cache import StoreSpec, worker_root
from statekeeper.spark._initial import (
    STAGED_SCHEMA,
    check_initial,
    stage_for_batch_zero,
)
from statekeeper.spark._listener import register_operator
from statekeeper.spark._partition import (
    KEY_GROUP_COLUMN,
    PART_COLUMN,
    TS_COLUMN,
    Partitioning,
    column_ref,
    key_group_of,
    target_partition,
)
from statekeeper.spark._runner import ArrowFunction
from statekeeper.spark._tasks import TaskSpec, arrow_task, rows_task
from statekeeper.spark._time import (
    HEARTBEAT_COLUMN,
    TimeSpec,
    batch_clock,
    needs_heartbeats,
    refuse_legacy_time,
    refuse_unused_timers,
    time_spec,
    with_heartbeats,
)
from statekeeper.storage import open_blob_store
from statekeeper.store import StateBackend

__all__ = ["transform_with_state", "transform_with_state_arrow"]

_NO_TIME = TimeSpec()
_RESERVED = (TS_COLUMN, PART_COLUMN, KEY_GROUP_COLUMN, HEARTBEAT_COLUMN)
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
    time_mode: str | None = None,
    event_time_column: str | None = None,
    watermark_delay: float | dt.timedelta = 0,
    initial_state: DataFrame | None = None,
) -> DataFrame:
    """Run ``processor`` per key of a streaming DataFrame, with state in ``checkpoint``.

    **Time** (after Spark's ``transformWithState``, see :mod:`statekeeper.spark._time`):
    with ``time_mode="processing_time"`` timers compare with the micro-batch timestamp; with
    ``time_mode="event_time"`` they compare with the watermark, ``max(0, E - delay)`` where
    ``E`` is the largest ``event_time_column`` of earlier micro-batches (0 in the first);
    rows at or before the *previous* micro-batch's watermark are dropped before the
    processor (Spark's watermark for late events), so a row that trails the current one is
    still processed. In both modes a timer is due when its expiry is at or before the
    clock; every due timer fires after the batch's input, in order of expiry, in every
    micro-batch, in every partition, with or without input, and is deleted after its
    handler. ``tests/spark/test_timers_vs_spark.py`` checks all this against Spark's own
    operator.

    **One deliberate difference: no no-data micro-batches.** When the watermark has moved
    (event time) or a timer is registered (processing time) and no input is left, Spark runs
    a micro-batch without data for its own stateful operators, to fire their timers. This
    operator is a ``mapInArrow`` to Spark, and no public API lets it ask for such a batch,
    so Spark runs none for it: timers that Spark would fire in a no-data batch fire in the
    next micro-batch that has input (any input, in any partition), with the same watermark
    and output. The same holds for a micro-batch that Spark ran without any task of this
    operator (its input was empty): its version is committed empty by the next one; and
    for a batch whose tasks get neither input nor the batch timestamp (a no-data batch of a
    downstream stateful operator) while a state has a processing-time TTL, which a timer's
    handler could not touch then. A source that idles therefore delays timers: a query that
    must fire them on time needs input that keeps arriving.

    **TTL in processing time** (``ttl=...``, the default clock): an entry expires by the
    micro-batch timestamp in every partition, with or without input (the timestamp rides on
    the heartbeats every partition receives), whatever the time mode; unlike Spark, which
    refuses a TTL without ``TimeMode.ProcessingTime()``, ``time_mode=None`` allows one. (An
    operator created by statekeeper 0.1 has no key groups, hence no heartbeats: there an
    expired entry is invisible when read but deleted only in partitions with input.)

    **TTL on event time** (statekeeper's own; Spark's TTL is processing time only): a state
    declared with ``ttl=..., ttl_on="event_time"`` in an operator with
    ``time_mode="event_time"`` stamps each write with the largest event time seen so far and
    expires the entry once the watermark reaches that stamp plus the ttl, in every
    partition, with or without input (see :mod:`statekeeper.keyed._handles`); elsewhere the
    declaration fails the batch with a ``ValueError`` before anything is committed.

    **Initial state** (after Spark's ``transformWithState(..., initialState=...)``):
    ``initial_state`` is a batch DataFrame holding the key columns (of the same types as in
    ``df``; other columns are free). In micro-batch 0, and only there, each partition calls
    ``processor.handle_initial_state(key, rows, timer_values)`` once per key of its initial
    rows, before any input (in the processor's row form; see
    :meth:`StatefulProcessor.handle_initial_state`). A restart of the query at a later batch
    does not apply it again (as Spark's), and a re-run of batch 0 starts again from the
    empty version 0, so the committed state holds it once. The rows are routed to their
    partitions by a batch job run by this call and staged in the root under ``_initial/``
    (Spark cannot join a batch DataFrame into a stream otherwise); once batch 1 is committed
    in every partition, a later call skips the job and deletes the staged rows.

    Args:
        df: a streaming DataFrame.
        keys: the grouping key column(s).
        processor: the :class:`StatefulProcessor`; a copy runs per partition and batch.
            Its ``init`` and ``close`` also run once here, on a copy, with a handle that
            only takes declarations, to learn whether a state has a TTL (see
            :mod:`statekeeper.spark._time`; Spark's ``transformWithState`` does the same).
        output_schema: DDL string or StructType of the rows the processor yields.
        checkpoint: the checkpoint root URI (a path, ``file://``, ``s3://``, ...).
        name: the operator's name in the root.
        partitions: state partitions; fixed for the operator once recorded in the root.
        config: store configuration (``local_dir``, snapshots, retention, ...).
        storage_options: object store options (credentials, endpoint); sent to executors.
        lock_timeout_s: how long a task waits for a working copy another process holds.
        time_mode: ``None`` (no timers), ``"processing_time"`` or ``"event_time"``.
        event_time_column: with ``"event_time"``, a timestamp column of ``df``.
        watermark_delay: seconds (or a timedelta) the watermark trails the event time.
        initial_state: a batch DataFrame of initial rows, applied in micro-batch 0.

    Returns:
        A streaming DataFrame of ``output_schema``, usable with any sink.

    Raises:
        ValueError: ``df`` is not streaming, a key column is missing or of an unsupported
            type, the event-time column is missing or not a timestamp, a negative delay, a
            processor with ``handle_expired_timer`` and no time mode, an initial state that
            is streaming, lacks a key column or has it with another type, or is given to a
            processor without ``handle_initial_state``, or an argument is malformed; or
            ``processor.init`` declares a state with a malformed argument (run on a copy
            here: see ``processor`` above).
        TypeError: an argument has the wrong type (also in a declaration of ``init``).
        ConfigMismatchError: the root records another partition count for ``name``, or a
            time mode is asked of an operator of statekeeper 0.1.
        StateKeeperError: the root cannot be read, or ``processor.init`` declares one name
            as two kinds of state.
    """
    if not isinstance(processor, StatefulProcessor):
        raise TypeError(
            f"processor must be a StatefulProcessor instance, got {type(processor).__name__}"
        )
    key_names = _check_input(df, keys)
    schema = _output_struct(output_schema)
    timing = time_spec(df, time_mode, event_time_column, watermark_delay)
    refuse_unused_timers(processor, timing.time_mode)
    # init on a copy: a malformed declaration fails here, before the root is touched.
    ttls = declared_ttls(processor, timing.time_mode)
    if initial_state is not None:
        check_initial(df, initial_state, key_names, processor, _RESERVED)
    spec = _prepare(
        df, key_names, schema, checkpoint, name, partitions, config, storage_options,
        lock_timeout_s, ts_column=TS_COLUMN, timing=timing,
    )  # fmt: skip
    if initial_state is not None:
        staged_schema = arrow_schema(initial_state.sparkSession, _output_struct(STAGED_SCHEMA))
        staged = stage_for_batch_zero(
            initial_state, key_names, spec.partitioning, spec.store, spec.generation,
            staged_schema,
        )  # fmt: skip
        spec = dataclasses.replace(spec, initial=staged)
    task = functools.partial(rows_task, spec, processor)
    # An initial state still to apply (``None`` once batch 1 is committed everywhere).
    beating = needs_heartbeats(ttls, timing, initial_state=spec.initial is not None)
    if spec.partitioning.key_groups is None or not beating:  # the clock on every row
        return _plan(df, key_names, spec.partitioning, task, schema, clock=batch_clock(False))
    beats = functools.partial(with_heartbeats, timing=timing, partitioning=spec.partitioning)
    return _plan(
        df, key_names, spec.partitioning, task, schema, clock=batch_clock(True), before=beats
    )


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
    ``delete``, ``put_many`` (of pairs, or of keys and values), ``delete_many`` on raw bytes,
    at version ``batch_id``) and an iterator of pyarrow RecordBatches (rows of many keys,
    partitioned by ``keys``), and yields RecordBatches of ``output_schema``. Statekeeper
    commits after the last one. Arguments and errors are those of :func:`transform_with_state`.

    In an operator with key groups (every operator this version creates), the batches also
    carry each row's key group (column ``__statekeeper_key_group``) and every key ``fn``
    puts must start with its key group: build keys with
    ``store.state_keys(batch, key_columns)`` (``encode_key`` of the key columns, prefixed).

    Raises:
        ValueError, TypeError, ConfigMismatchError, StateKeeperError: as
            :func:`transform_with_state`.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    key_names = _check_input(df, keys)
    schema = _output_struct(output_schema)
    spec = _prepare(
        df, key_names, schema, checkpoint, name, partitions, config, storage_options,
        lock_timeout_s, ts_column=None,
    )  # fmt: skip
    task = functools.partial(arrow_task, spec, fn)
    return _plan(df, key_names, spec.partitioning, task, schema, clock=None)


def _plan(
    df: DataFrame,
    key_names: list[str],
    partitioning: Partitioning,
    task: Any,
    schema: T.StructType,
    *,
    clock: Column | None,
    before: Any = None,
) -> DataFrame:
    """Shuffle by key group (or by the keys), tag rows with it, add the batch ``clock``
    column (if any) after the shuffle, run, end the stage; ``before(df)`` is applied to the
    tagged input before the shuffle (heartbeats)."""
    keys = [F.col(column_ref(k)) for k in key_names]
    partitions, groups = partitioning.partitions, partitioning.key_groups
    if groups is None:
        shuffled = df.repartition(partitions, *keys)
        # Evaluated after the exchange: not shuffled.
        tagged = shuffled.withColumn(PART_COLUMN, F.pmod(F.hash(*keys), F.lit(partitions)))
    else:
        grouped = df.withColumn(KEY_GROUP_COLUMN, key_group_of(key_names, groups))
        if before is not None:
            grouped = before(grouped)
        tagged = grouped.repartitionById(partitions, target_partition(partitioning))
    if clock is not None:
        tagged = tagged.withColumn(TS_COLUMN, clock)
    out = tagged.mapInArrow(task, schema)
    # A stage boundary that keeps rows in place: see the module docstring.
    return out.repartitionById(partitions, F.spark_partition_id())


def _check_input(df: DataFrame, keys: str | Sequence[str]) -> list[str]:
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
    reserved = [c for c in _RESERVED if c in fields]
    if reserved:
        raise ValueError(f"column names {reserved} are reserved by statekeeper")
    return names


def _output_struct(output_schema: str | T.StructType) -> T.StructType:
    if isinstance(output_schema, str):
        parsed = T.DataType.fromDDL(output_schema)
    elif isinstance(output_schema, T.StructType):
        parsed = output_schema
    else:
        kind = type(output_schema).__name__
        raise TypeError(f"output_schema must be a DDL string or a StructType, got {kind}")
    if not isinstance(parsed, T.StructType) or not parsed.fields:
        raise ValueError(f"output_schema must describe a struct of columns, got {output_schema!r}")
    return parsed


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
    timing: TimeSpec = _NO_TIME,
) -> TaskSpec:
    """Validate, register the operator in the root (checking ``partitions``), start a run."""
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
    spark = df.sparkSession
    _refuse_speculation(spark)
    blobs = open_blob_store(checkpoint, storage_options, io_threads=config.io_threads)
    with StateBackend(blobs, config=config) as backend:
        refuse_legacy_time(backend.root_metadata(), name, timing)
        # Refuses another partition count before any state is touched.
        backend.register(name, partitions)
        generation = backend.start_generation(name)
        metadata = backend.root_metadata()
    key_groups = None if metadata is None else metadata.key_groups.get(name)
    register_operator(spark, blobs, name, partitions)
    root = worker_root(checkpoint, backend)
    store = StoreSpec(
        root, name, partitions, config, StoreSpec.options(storage_options),
        float(lock_timeout_s), keep_open=_reuses_workers(spark),
    )  # fmt: skip
    key_schema = T.StructType([df.schema[k] for k in key_names]).json()
    return TaskSpec(
        store, tuple(key_names), key_schema, arrow_schema(spark, schema), ts_column,
        generation, key_groups, timing,
    )  # fmt: skip


def _refuse_speculation(spark: SparkSession) -> None:
    """Speculative tasks are two live attempts of one partition: refuse them.

    Raises:
        ValueError: ``spark.speculation`` is on.
    """
    if str(spark.conf.get("spark.speculation", "false")).strip().lower() == "true":
        raise ValueError(
            "transform_with_state does not run with spark.speculation=true: a speculative "
            "copy of a task would run a partition's processor twice at once on one store, "
            "and only one of them may commit its state. Turn speculation off for this query"
        )


def _reuses_workers(spark: SparkSession) -> bool:
    """Whether Spark's Python workers run more than one task: only then may a task leave its
    store open for the next one. They do unless ``spark.python.worker.reuse`` is off, or
    ``spark.python.use.daemon`` is (then each task's worker is started for it and exits
    after it: work left to background threads would run only as it exits, after Spark
    counted the task done, holding the store's lock against the partition's next task)."""
    return all(
        str(spark.conf.get(key, "true")).strip().lower() != "false"
        for key in ("spark.python.worker.reuse", "spark.python.use.daemon")
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
