"""``read_state``: a checkpoint root's state as a DataFrame, for inspection.

The state is read on the executors, one Spark task per partition: each task restores its
store into a temporary folder under the executor's Spark local directory (never into the
working copies a running query uses), scans it, and streams Arrow batches of bounded size
(:data:`_BATCH_ROWS` rows or :data:`_BATCH_BYTES` bytes), so state larger than the driver's
memory can be read. The driver only lists the root, picks the versions and opens one store
to learn the operator's schema (the record a keyed processor writes into every store).

Without ``version`` it reads the consistent cut (:func:`statekeeper.epochs.consistent_cut`):
the versions the newest epoch manifest naming the operator records, i.e. the last
micro-batch a query finished, even if some or all partitions committed a batch that failed
after; where the root has no usable manifest, the newest version every partition has. On a
classic session whose listener follows the query, a batch whose tasks committed is first
given up to :data:`_CATCH_UP_S` for its manifest to be written (it is written once the
batch's progress event reaches the listener, a moment after the query moved on).
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

from statekeeper.config import StoreConfig
from statekeeper.epochs import consistent_cut
from statekeeper.errors import ConfigMismatchError, StateNotFoundError
from statekeeper.history import StoreHistory
from statekeeper.keyed import (
    TIMER_STATE,
    OperatorRecord,
    iter_state,
    iter_timers,
    jsonable,
    read_operator_record,
)
from statekeeper.keyed.output import rows_to_batch
from statekeeper.reports import read_reports
from statekeeper.spark._arrow_types import arrow_schema
from statekeeper.spark._cache import worker_config, worker_root
from statekeeper.spark._listener import StateListener, listener_of
from statekeeper.store import StateBackend, StateStore

__all__ = [
    "PartitionRead",
    "as_json",
    "key_fields",
    "read_on_executors",
    "read_state",
    "schema_record",
    "utc",
    "versions_to_read",
]

_log = logging.getLogger("statekeeper.spark")

_CATCH_UP_S = 10.0
"""How long ``read_state`` waits for its session's listener to record a batch whose tasks
committed (a batch that failed after its tasks committed is never recorded)."""
_BATCH_ROWS = 4096
"""Most rows in one Arrow batch a read task yields."""
_BATCH_BYTES = 8 << 20
"""Most bytes of keys and values (roughly) in one Arrow batch a read task yields."""

_TAIL_FIELDS = [
    T.StructField("state", T.StringType()),
    T.StructField("entry", T.StringType()),
    T.StructField("value", T.StringType()),
    T.StructField("expires_at", T.TimestampType()),
]
_RAW_SCHEMA = T.StructType(
    [
        T.StructField("partition", T.IntegerType(), False),
        T.StructField("key", T.BinaryType()),
        T.StructField("value", T.BinaryType()),
        T.StructField("key_group", T.IntegerType()),
    ]
)


def read_state(
    spark: SparkSession,
    checkpoint: str,
    name: str,
    version: int | None = None,
    *,
    storage_options: Mapping[str, str] | None = None,
    allow_pickle: bool = False,
) -> DataFrame:
    """The state of operator ``name`` as a DataFrame, read by one Spark task per partition.

    For a processor's state: one row per value, map entry or list element, with columns
    ``partition``, the key columns, ``state``, ``entry`` (the map key as JSON, or the list
    position; null for value state), ``value`` (JSON) and ``expires_at`` (null without TTL;
    entries past it are kept until a micro-batch of their partition cleans them). Each
    registered timer is a row too: ``state`` is ``"$timer"`` (no state name can be), ``entry``
    its expiry in milliseconds, ``value`` null and ``expires_at`` when it fires. State
    written by the vectorized form has columns ``partition``, ``key``, ``value`` (raw bytes)
    and ``key_group``: in an operator with key groups the key's first two bytes, which
    ``key`` then goes without; null for an operator of statekeeper 0.1.

    The versions are fixed when this is called; every action on the DataFrame restores and
    scans them again on the executors (``cache()`` it to act on it more than once). The
    executors need statekeeper installed, and must reach the root.

    Args:
        spark: the session to build the DataFrame in (classic or Spark Connect).
        checkpoint: the checkpoint root.
        name: the operator.
        version: the version to read in every partition; if ``None``, the consistent cut:
            the versions the newest epoch manifest naming ``name`` records (the last
            micro-batch a query finished), or, in a root without a usable one (written
            without Spark's listener, e.g. from Spark Connect), the newest version every
            partition has; the reason is logged (logger ``statekeeper.epochs``). On a classic
            session, a batch of a query this session runs whose tasks committed is given up
            to 10 s for its manifest to be written (it never is if the batch failed later).
        storage_options: object store options (they travel to the executors with the tasks).
        allow_pickle: decode values of states declared with ``PickleCodec`` (runs code from
            the root: only for roots you trust); otherwise they show as a placeholder.

    Raises:
        StateNotFoundError: the operator is not in the root, or ``version`` is not
            restorable in some partition.
        CorruptStateError: a blob or a stored record fails its checks (raised by the action
            that runs the tasks, if found there).
        StorageError: the root cannot be read.
    """
    listener = listener_of(spark)
    spec, schema = _plan(spark, checkpoint, name, version, storage_options, allow_pickle, listener)
    return read_on_executors(spark, spec, schema)


@dataclass(frozen=True, kw_only=True)
class PartitionRead:
    """What a read task needs to stream the rows of each partition (a subclass says which
    rows); picklable, credentials kept out of repr."""

    checkpoint: str
    operator: str
    versions: dict[int, int]
    """Partition -> the version to read (every partition of the operator has one)."""
    arrow_schema: Any
    storage_options: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    def where(self, partition: int) -> str:
        """What a task reads, for errors."""
        return f"operator {self.operator!r} partition {partition}"

    def rows(self, backend: StateBackend, partition: int) -> Iterator[tuple[Any, ...]]:
        """The rows of ``partition``, read through ``backend`` (a temporary one)."""
        raise NotImplementedError


def read_on_executors(spark: SparkSession, spec: PartitionRead, schema: T.StructType) -> DataFrame:
    """A DataFrame of ``schema`` whose rows ``spec`` reads on the executors, one Spark task
    per partition, each with a temporary backend under the executor's local directory,
    streaming Arrow batches of bounded size."""
    count = len(spec.versions)
    # One row per partition, one partition per row: one task per store.
    ids = spark.range(0, count, 1, numPartitions=count)
    return ids.mapInArrow(functools.partial(_read_task, spec), schema)


@dataclass(frozen=True, kw_only=True)
class _ReadSpec(PartitionRead):
    """``read_state``: the state of each partition at its version."""

    typed: bool
    """Decode a keyed processor's state (else raw key/value rows)."""
    grouped: bool
    """Raw keys start with their key group."""
    allow_pickle: bool
    schema_partition: int | None
    """The partition whose store gave the schema (for errors)."""

    def where(self, partition: int) -> str:
        version = self.versions[partition]
        return f"read_state of {super().where(partition)} version {version}"

    def rows(self, backend: StateBackend, partition: int) -> Iterator[tuple[Any, ...]]:
        with backend.open(self.operator, partition, self.versions[partition]) as store:
            record = read_operator_record(store)
            if self.typed and record is None:
                return  # an empty store, or one no keyed processor wrote to (as before: no rows)
            if not self.typed and record is not None:
                raise ConfigMismatchError(
                    f"{self.where(partition)}: the store holds a keyed processor's operator "
                    f"record, but the store of partition {self.schema_partition} read for the "
                    "schema holds none: the operator's partitions were written by different forms"
                )
            if self.typed:
                yield from _typed_rows(store, partition, self.allow_pickle)
            else:
                yield from _raw_rows(store, partition, grouped=self.grouped)


def _plan(
    spark: SparkSession,
    checkpoint: str,
    name: str,
    version: int | None,
    storage_options: Mapping[str, str] | None,
    allow_pickle: bool,
    listener: StateListener | None,
) -> tuple[_ReadSpec, T.StructType]:
    """Pick the versions and learn the schema, on the driver, opening at most one store."""
    with tempfile.TemporaryDirectory(prefix="statekeeper-read-") as tmp:
        backend = StateBackend(
            checkpoint, config=StoreConfig(local_dir=tmp), storage_options=storage_options
        )
        try:
            versions, grouped = versions_to_read(backend, name, version, listener)
            found = schema_record(backend, name, versions)
            root = worker_root(checkpoint, backend)
        finally:
            backend.close()
    source, record = found
    schema = _RAW_SCHEMA if record is None else _typed_schema(record)
    spec = _ReadSpec(
        checkpoint=root,
        operator=name,
        versions=versions,
        typed=record is not None,
        grouped=grouped,
        allow_pickle=allow_pickle,
        arrow_schema=arrow_schema(spark, schema),
        schema_partition=source,
        storage_options=tuple(sorted((str(k), str(v)) for k, v in (storage_options or {}).items())),
    )
    return spec, schema


def versions_to_read(
    backend: StateBackend, name: str, version: int | None, listener: StateListener | None
) -> tuple[dict[int, int], bool]:
    """Partition -> version to read, and whether raw keys carry a key group.

    Raises:
        StateNotFoundError: the operator is unknown, or ``version`` is not restorable.
    """
    metadata = backend.root_metadata()
    count = None if metadata is None else metadata.operators.get(name)
    if metadata is None or count is None:
        known = [] if metadata is None else sorted(metadata.operators)
        raise StateNotFoundError(
            f"operator {name!r} has no partition count in {backend.blobs.uri} (operators: {known})"
        )
    root_id = metadata.root_id

    @functools.cache
    def history(partition: int) -> StoreHistory:
        return StoreHistory.load(backend.blobs, name, partition, root_id=root_id)

    if version is None:
        cut = consistent_cut(backend.blobs, name, count, history)
        if cut.manifest is not None and listener is not None:
            common = min(_newest(history(p)) for p in range(count))
            if min(cut.versions.values()) < common and _caught_up(listener, backend, name, common):
                cut = consistent_cut(backend.blobs, name, count, history)
        _log.info("read_state of %r: versions of %s", name, cut.describe())
        versions = cut.versions
    else:
        for p in range(count):
            history(p).plan(version, None)  # raises StateNotFoundError, naming what is missing
        versions = dict.fromkeys(range(count), version)
    return versions, name in metadata.key_groups


def _newest(history: StoreHistory) -> int:
    versions = history.restorable_versions()
    return versions[-1] if versions else 0


def _caught_up(listener: StateListener, backend: StateBackend, name: str, version: int) -> bool:
    """Wait for this session's listener to record micro-batch ``version - 1`` of ``name``,
    if a query it follows committed it: the manifest of a batch that finished a moment ago
    is written after its progress event reaches the listener. A batch that failed after its
    tasks committed never gets one: then the wait ends after :data:`_CATCH_UP_S`.

    Returns:
        Whether the listener was waited for (the manifests may have changed).
    """
    batch = version - 1
    queries = {r.query_id for r in read_reports(backend.blobs, name, batch)}
    followed = sorted(q for q in queries if listener.metrics(query_id=q, operator=name))
    for query_id in followed:
        try:
            listener.wait_for(query_id, batch, timeout=_CATCH_UP_S)
        except TimeoutError:
            _log.info("read_state: batch %s of query %s did not finish; not read", batch, query_id)
    if followed:
        try:
            listener.flush(timeout=_CATCH_UP_S)
        except TimeoutError:
            _log.warning("read_state: the listener is still writing epoch manifests")
    return bool(followed)


def schema_record(
    backend: StateBackend, name: str, versions: dict[int, int]
) -> tuple[int | None, OperatorRecord | None]:
    """The operator record of the first partition past version 0 (a keyed processor writes
    it into its store in every task, so that one store tells), and that partition."""
    for p, v in sorted(versions.items()):
        if v > 0:
            with backend.open(name, p, v) as store:
                return p, read_operator_record(store)
    return None, None


def _read_task(spec: PartitionRead, batches: Iterable[Any]) -> Iterator[Any]:
    """mapInArrow function: the rows of every partition id in ``batches``."""
    for batch in batches:
        for partition in batch.column(0).to_pylist():
            yield from _read_partition(spec, int(partition))


def _read_partition(spec: PartitionRead, partition: int) -> Iterator[Any]:
    """Stream one partition's rows as Arrow batches, read through a backend whose working
    copies live in a temporary folder under the executor's local directory (never the
    working copies a running query uses)."""
    base = worker_config(StoreConfig()).local_dir
    if base is not None:
        os.makedirs(base, exist_ok=True)
    options = dict(spec.storage_options) or None
    with (
        tempfile.TemporaryDirectory(prefix="statekeeper-read-", dir=base) as tmp,
        StateBackend(
            spec.checkpoint, config=StoreConfig(local_dir=tmp), storage_options=options
        ) as backend,
    ):
        # Opening a store of an operator the root lacks would register it (a writer's open):
        # a root this executor cannot see as the driver did must fail, not get created.
        if spec.operator not in backend.operators():
            raise StateNotFoundError(
                f"{spec.where(partition)}: the checkpoint root {backend.blobs.uri}, as this "
                f"executor reads it, holds no operator {spec.operator!r}, which the driver "
                "found there: is a local root on a disk every executor shares?"
            )
        yield from _batches(spec.rows(backend, partition), spec.arrow_schema, spec.where(partition))


def _batches(rows: Iterator[tuple[Any, ...]], schema: Any, where: str) -> Iterator[Any]:
    """``rows`` as Arrow batches of at most :data:`_BATCH_ROWS` rows or about
    :data:`_BATCH_BYTES` bytes."""
    chunk: list[tuple[Any, ...]] = []
    size = 0
    for row in rows:
        chunk.append(row)
        size += sum(len(v) for v in row if isinstance(v, bytes | str))
        if len(chunk) >= _BATCH_ROWS or size >= _BATCH_BYTES:
            yield rows_to_batch(chunk, schema, where)
            chunk, size = [], 0
    if chunk:
        yield rows_to_batch(chunk, schema, where)


def _raw_rows(store: StateStore, partition: int, *, grouped: bool) -> Iterator[tuple[Any, ...]]:
    for key, value in store.scan():
        if grouped:
            yield (partition, key[2:], value, int.from_bytes(key[:2], "big"))
        else:
            yield (partition, key, value, None)


def key_fields(record: OperatorRecord) -> list[T.StructField]:
    """The key columns of a keyed processor's state, typed as the record says."""
    if record.key_schema is not None:
        return list(T.StructType.fromJson(json.loads(record.key_schema)).fields)
    return [T.StructField(k, T.StringType()) for k in record.keys]


def _typed_schema(record: OperatorRecord) -> T.StructType:
    return T.StructType(
        [T.StructField("partition", T.IntegerType(), False), *key_fields(record), *_TAIL_FIELDS]
    )


def _typed_rows(store: StateStore, partition: int, allow_pickle: bool) -> Iterator[tuple[Any, ...]]:
    for e in iter_state(store, allow_pickle=allow_pickle):
        entry = (
            None if e.kind == "value" else str(e.entry) if e.kind == "list" else as_json(e.entry)
        )
        yield (partition, *e.key, e.state, entry, as_json(e.value), utc(e.expires_at_ms))
    for timer in iter_timers(store):
        fires = utc(timer.expiry_ms)
        yield (partition, *timer.key, TIMER_STATE, str(timer.expiry_ms), None, fires)


def as_json(value: Any) -> str:
    """A decoded value (or map key) as the JSON text the ``value`` columns hold."""
    return json.dumps(jsonable(value), ensure_ascii=False)


def utc(ms: int | None) -> dt.datetime | None:
    """Milliseconds since the epoch as a UTC timestamp (``None`` stays ``None``)."""
    return None if ms is None else dt.datetime.fromtimestamp(ms / 1000, dt.UTC)
