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

The initial state is routed the same way, see :mod:`statekeeper.spark._initial`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]
from pyspark.sql import Column
from pyspark.sql import functions as F

from statekeeper.errors import StateKeeperError
from statekeeper.keyed import key_group_range, partition_of_group
from statekeeper.keyed.runner import KEY_GROUP_COLUMN

__all__ = [
    "KEY_GROUP_COLUMN",
    "PART_COLUMN",
    "TS_COLUMN",
    "Partitioning",
    "TaskInput",
    "collect",
    "column_ref",
    "key_group_of",
    "peek_partition",
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
    return F.pmod(F.hash(*[F.col(column_ref(k)) for k in keys]), F.lit(key_groups))


def target_partition(partitioning: Partitioning) -> Column:
    """The state partition of a row tagged with :data:`KEY_GROUP_COLUMN`: ``kg * P div G``."""
    partitions, groups = partitioning.partitions, partitioning.key_groups
    # kg * P < 2^31 since P <= G <= 65280
    return F.expr(f"CAST((`{KEY_GROUP_COLUMN}` * {partitions}) div {groups} AS INT)")


def column_ref(name: str) -> str:
    """``name`` quoted for ``F.col`` (a column name may hold dots or backticks)."""
    return "`" + name.replace("`", "``") + "`"


class TaskInput:
    """A task's input batches without the timestamp and partition columns (the key-group
    column stays); iterating them learns the timestamp and the state partition.

    Attributes:
        now_ms: the batch timestamp (``None`` without ``ts_column``, or before a row).
        partition: the state partition of the rows (``None`` before a row).
    """

    def __init__(
        self,
        batches: Iterator[Any],
        ts_column: str | None,
        partitioning: Partitioning = _LEGACY,
        *,
        skip_empty: bool = True,
    ) -> None:
        """Read ``batches``, tagged as ``partitioning`` says, with the timestamp in
        ``ts_column`` (if not ``None``); ``skip_empty=False`` passes empty batches on."""
        self._skip_empty = skip_empty
        self._batches = batches
        self._ts_column = ts_column
        self._partitioning = partitioning
        self.now_ms: int | None = None
        self.partition: int | None = None

    def __iter__(self) -> Iterator[Any]:
        """The batches (the non-empty ones, by default), our columns dropped.

        Raises:
            StateKeeperError: rows of several state partitions.
        """
        ts_column, partitioning = self._ts_column, self._partitioning
        dropped = [*([] if ts_column is None else [ts_column]), *partitioning.dropped]
        for batch in self._batches:
            found = partitioning.of_batch(batch)
            if found is None:
                if not self._skip_empty:
                    yield batch.drop_columns(dropped) if dropped else batch
                continue
            if self.partition is not None and found != self.partition:
                raise StateKeeperError(
                    f"one task received rows of state partitions {self.partition} and {found}"
                )
            self.partition = found
            if self.now_ms is None and ts_column is not None:
                # On the heartbeats alone (null on data rows), or on every row (no heartbeats).
                column = batch.column(ts_column)
                raw = pc.max(column.cast(pa.int64())).as_py()
                if raw is not None:
                    self.now_ms = round(raw * _UNIT_MS[column.type.unit])
            yield batch.drop_columns(dropped) if dropped else batch


def collect(
    batches: Iterator[Any], ts_column: str | None, partitioning: Partitioning = _LEGACY
) -> tuple[Any, int | None, int | None]:
    """The partition's input as one table without the timestamp and partition columns (the
    key-group column stays), the timestamp (``None`` without ``ts_column``), the partition.

    Raises:
        StateKeeperError: rows of several state partitions.
    """
    source = TaskInput(batches, ts_column, partitioning)
    kept = list(source)
    table = pa.Table.from_batches(kept) if kept else pa.table({})
    return table, source.now_ms, source.partition


def peek_partition(
    batches: Iterator[Any], partitioning: Partitioning = _LEGACY
) -> tuple[int | None, Iterator[Any]]:
    """The state partition of a streamed input, and the input without the partition column
    (the key-group column stays; empty batches too).

    Only batches up to the first non-empty one are read ahead.

    Raises:
        StateKeeperError: rows of several state partitions (also while streaming later).
    """
    source = TaskInput(batches, None, partitioning, skip_empty=False)
    stream = iter(source)
    head: list[Any] = []
    for batch in stream:
        head.append(batch)
        if source.partition is not None:
            break
    return source.partition, _chain(head, stream)


def _chain(head: list[Any], rest: Iterator[Any]) -> Iterator[Any]:
    yield from head
    yield from rest
