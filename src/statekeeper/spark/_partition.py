"""A task's input: its state partition, read from the data and checked, and our columns.

``_transform`` tags every row with where its state lives. For an operator with key groups
(every operator statekeeper 0.2 creates) that is the key group, ``pmod(hash(keys), G)``
(Spark's Murmur3), computed before the shuffle that routes the row to partition
``kg * P div G``; the key group travels with the row because the task prefixes its state
keys with it. For an operator of statekeeper 0.1 it is ``pmod(hash(keys), P)``, Spark's own
hash partitioning, computed after the shuffle. Every row of a task must belong to the same
partition (its key group in that partition's range), or the task fails before it touches a
store. The partition column and the batch timestamp are dropped before the processor or the
vectorized function sees the input; the key group is dropped by the runner once it has read
it (the vectorized function keeps it: it prefixes its own keys).

**Initial state** reaches its partition the same way, in a batch job run when the query is
defined: a streaming plan cannot take a batch DataFrame (Spark refuses a union or cogroup of
a stream with a batch DataFrame, and its own ``initialState`` plumbing is not public), so
the initial rows are tagged with their key group, routed by ``repartitionById`` exactly like
the input, and each partition's rows are **staged** in the checkpoint root as one Arrow IPC
blob (:func:`stage_task`, create-only, named per attempt). The driver passes the names and
CRC32C checksums to the tasks, and a task of micro-batch 0 reads its partition's blob
(:func:`read_staged`), checked, on every attempt of that batch.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import google_crc32c
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from statekeeper import layout
from statekeeper.errors import CorruptStateError, StateKeeperError
from statekeeper.keyed import key_group_range, partition_of_group
from statekeeper.keyed.runner import KEY_GROUP_COLUMN
from statekeeper.spark._cache import StoreSpec
from statekeeper.storage import BlobStore, open_blob_store
from statekeeper.store import StateBackend

__all__ = [
    "KEY_GROUP_COLUMN",
    "PART_COLUMN",
    "STAGED_SCHEMA",
    "TS_COLUMN",
    "Partitioning",
    "Staged",
    "batch_zero_done",
    "collect",
    "key_group_of",
    "peek_partition",
    "read_staged",
    "stage_initial",
    "stage_task",
    "target_partition",
]

TS_COLUMN = "__statekeeper_batch_ts"
PART_COLUMN = "__statekeeper_partition"
_UNIT_MS = {"s": 1000.0, "ms": 1.0, "us": 1e-3, "ns": 1e-6}


@dataclass(frozen=True)
class Partitioning:
    """How an operator's rows carry their state partition.

    Attributes:
        partitions: the operator's partition count.
        key_groups: its key groups; ``None`` for an operator of statekeeper 0.1 (rows carry
            their partition in :data:`PART_COLUMN`).
    """

    partitions: int
    key_groups: int | None = None

    @property
    def column(self) -> str:
        """The column a task reads its partition from."""
        return PART_COLUMN if self.key_groups is None else KEY_GROUP_COLUMN

    @property
    def dropped(self) -> list[str]:
        """Our columns that no function sees (the key group is dropped later, if at all)."""
        return [PART_COLUMN] if self.key_groups is None else []

    def of_batch(self, batch: Any) -> int | None:
        """The state partition of every row of an Arrow batch (``None`` if it has no rows).

        Raises:
            StateKeeperError: rows of several partitions, or a key group out of range.
        """
        if batch.num_rows == 0:
            return None
        bounds = pc.min_max(batch.column(self.column))
        low, high = int(bounds["min"].as_py()), int(bounds["max"].as_py())
        groups = self.key_groups
        if groups is None:
            if low != high:
                raise StateKeeperError(
                    f"one task received rows of state partitions {low} to {high}: the input "
                    "was not partitioned by the keys as transform_with_state planned it"
                )
            return low
        if low < 0 or high >= groups:
            raise StateKeeperError(
                f"one task received rows of key groups {low} to {high}; expected key groups "
                f"in [0, {groups})"
            )
        first = partition_of_group(low, self.partitions, groups)
        if partition_of_group(high, self.partitions, groups) != first:
            owned = key_group_range(first, self.partitions, groups)
            raise StateKeeperError(
                f"one task received rows of key groups {low} to {high}, but state partition "
                f"{first} owns key groups {owned.start} to {owned.stop - 1} (of {groups}, "
                f"over {self.partitions} partitions): the input was not partitioned by key "
                "group as transform_with_state planned it"
            )
        return first


_LEGACY = Partitioning(0)


def key_group_of(keys: list[str], key_groups: int) -> Column:
    """The key group of a row: ``pmod(hash(keys), G)``, Spark's Murmur3 of the key columns
    (so the key columns must have the same types wherever the same key must land)."""
    return F.pmod(F.hash(*[F.col(_quote(k)) for k in keys]), F.lit(key_groups))


def target_partition(partitioning: Partitioning) -> Column:
    """The state partition of a row tagged with :data:`KEY_GROUP_COLUMN`: ``kg * P div G``."""
    partitions, groups = partitioning.partitions, partitioning.key_groups
    # kg * P < 2^31 since P <= G <= 65280
    return F.expr(f"CAST((`{KEY_GROUP_COLUMN}` * {partitions}) div {groups} AS INT)")


def _quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def collect(
    batches: Iterator[Any], ts_column: str | None, partitioning: Partitioning = _LEGACY
) -> tuple[Any, int | None, int | None]:
    """The partition's input as one table without the timestamp and partition columns (the
    key-group column stays), the timestamp (``None`` without ``ts_column``), the partition.

    Raises:
        StateKeeperError: rows of several state partitions.
    """
    kept: list[Any] = []
    now_ms: int | None = None
    partition: int | None = None
    dropped = [*([] if ts_column is None else [ts_column]), *partitioning.dropped]
    for batch in batches:
        found = partitioning.of_batch(batch)
        if found is None:
            continue
        if partition is not None and found != partition:
            raise StateKeeperError(
                f"one task received rows of state partitions {partition} and {found}"
            )
        partition = found
        if now_ms is None and ts_column is not None:
            column = batch.column(ts_column)
            raw = column.cast(pa.int64())[0].as_py()
            now_ms = round(raw * _UNIT_MS[column.type.unit])
        kept.append(batch.drop_columns(dropped))
    if not kept:
        return pa.table({}), now_ms, partition
    return pa.Table.from_batches(kept), now_ms, partition


def peek_partition(
    batches: Iterator[Any], partitioning: Partitioning = _LEGACY
) -> tuple[int | None, Iterator[Any]]:
    """The state partition of a streamed input, and the input without the partition column
    (the key-group column stays).

    Only batches up to the first non-empty one are read ahead.

    Raises:
        StateKeeperError: rows of several state partitions (also while streaming later).
    """
    head: list[Any] = []
    partition: int | None = None
    for batch in batches:
        head.append(batch)
        partition = partitioning.of_batch(batch)
        if partition is not None:
            break
    dropped = partitioning.dropped

    def stripped() -> Iterator[Any]:
        for batch in _chain(head, batches):
            found = partitioning.of_batch(batch)
            if found is not None and found != partition:
                raise StateKeeperError(
                    f"one task received rows of state partitions {partition} and {found}"
                )
            yield batch.drop_columns(dropped) if dropped else batch

    return partition, stripped()


def _chain(head: list[Any], rest: Iterator[Any]) -> Iterator[Any]:
    yield from head
    yield from rest


STAGED_SCHEMA = "partition int, blob string, crc long, rows long"
"""What :func:`stage_task` returns per partition, as Spark DDL."""


@dataclass(frozen=True)
class Staged:
    """One partition's staged initial rows: blob key, CRC32C and row count."""

    partition: int
    key: str
    crc: int
    rows: int


def stage_task(
    root: str,
    storage_options: tuple[tuple[str, str], ...],
    operator: str,
    generation: int,
    partitioning: Partitioning,
    schema: Any,
    batches: Iterator[Any],
) -> Iterator[Any]:
    """Stage one partition's initial rows (routed by key group) as an Arrow IPC blob in the
    root; yields one row of :data:`STAGED_SCHEMA` (``schema``), none for an empty partition.

    Raises:
        StateKeeperError: rows of several state partitions.
        StorageError: the blob could not be written.
    """
    table, _, partition = collect(batches, None, partitioning)
    if partition is None:
        return
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue().to_pybytes()
    # A name per attempt: a retried task never meets its failed attempt's blob.
    key = layout.initial_state_key(operator, generation, partition, uuid.uuid4().hex)
    blobs = open_blob_store(root, dict(storage_options))
    try:
        blobs.put(key, data)
    finally:
        blobs.close()
    row = {"partition": [partition], "blob": [key], "crc": [google_crc32c.value(data)]}
    row["rows"] = [table.num_rows]
    yield pa.RecordBatch.from_pydict(row, schema=schema)


def read_staged(blobs: BlobStore, staged: Staged) -> Any:
    """A partition's staged initial rows, checked against their CRC32C.

    Raises:
        CorruptStateError: the blob's checksum or row count differs from what was staged.
        StateNotFoundError: the blob is gone.
    """
    data = blobs.get(staged.key)
    found = google_crc32c.value(data)
    if found != staged.crc:
        raise CorruptStateError(
            f"staged initial state {blobs.uri}/{staged.key}: expected CRC32C {staged.crc}, "
            f"found {found}"
        )
    table = pa.ipc.open_stream(data).read_all()
    if table.num_rows != staged.rows:
        raise CorruptStateError(
            f"staged initial state {blobs.uri}/{staged.key}: expected {staged.rows} rows, "
            f"found {table.num_rows}"
        )
    return table


def batch_zero_done(backend: StateBackend, operator: str, partitions: int) -> bool:
    """True once micro-batch 0 of ``operator`` can no longer run again: every partition has
    committed version 2 (batch 1), which a re-run of batch 0 may not replace. Stops at the
    first partition that has not."""
    for partition in range(partitions):
        versions = backend.versions(operator, partition)
        if not versions or versions[-1] < 2:
            return False
    return True


def stage_initial(
    initial: DataFrame,
    keys: list[str],
    partitioning: Partitioning,
    store: StoreSpec,
    generation: int,
    schema: Any,
) -> tuple[Staged, ...]:
    """Stage ``initial``'s rows per state partition in the root (a Spark batch job, see the
    module docstring), after deleting what earlier runs staged; returns what tasks read.

    Raises:
        StateKeeperError: the job returned two blobs for one partition.
        Exception: whatever the job raises (Spark's errors).
    """
    if partitioning.key_groups is None:
        raise StateKeeperError("an initial state needs an operator with key groups")
    blobs = open_blob_store(store.root, dict(store.storage_options))
    try:
        old = [m.key for m in blobs.list(layout.initial_state_prefix(store.operator))]
        blobs.delete_many(old)
    finally:
        blobs.close()
    task = functools.partial(
        stage_task, store.root, store.storage_options, store.operator, generation,
        partitioning, schema,
    )  # fmt: skip
    tagged = initial.withColumn(KEY_GROUP_COLUMN, key_group_of(keys, partitioning.key_groups))
    routed = tagged.repartitionById(partitioning.partitions, target_partition(partitioning))
    staged = [
        Staged(int(r["partition"]), str(r["blob"]), int(r["crc"]), int(r["rows"]))
        for r in routed.mapInArrow(task, STAGED_SCHEMA).collect()
    ]
    if len({s.partition for s in staged}) != len(staged):
        raise StateKeeperError(
            f"staging the initial state of {store.operator!r} returned several blobs for one "
            f"partition: {sorted(s.partition for s in staged)}"
        )
    return tuple(sorted(staged, key=lambda s: s.partition))
