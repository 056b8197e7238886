"""A task's input: its state partition, read from the data and checked, and our columns.

``_transform`` adds two columns after the shuffle: the state partition of each row
(``pmod(hash(keys), partitions)``, Spark's own partitioning function) and the micro-batch
timestamp. Every row of a task must carry the same partition; the columns are dropped before
the processor or the vectorized function sees the input.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]

from statekeeper.errors import StateKeeperError

__all__ = ["PART_COLUMN", "TS_COLUMN", "collect", "peek_partition"]

TS_COLUMN = "__statekeeper_batch_ts"
PART_COLUMN = "__statekeeper_partition"
_UNIT_MS = {"s": 1000.0, "ms": 1.0, "us": 1e-3, "ns": 1e-6}


def _batch_partition(batch: Any) -> int | None:
    """The state partition of every row of an Arrow batch (``None`` if it has no rows).

    Raises:
        StateKeeperError: rows of several partitions.
    """
    if batch.num_rows == 0:
        return None
    bounds = pc.min_max(batch.column(PART_COLUMN))
    low, high = bounds["min"].as_py(), bounds["max"].as_py()
    if low != high:
        raise StateKeeperError(
            f"one task received rows of state partitions {low} to {high}: the input was not "
            "partitioned by the keys as transform_with_state planned it"
        )
    return int(low)


def collect(batches: Iterator[Any], ts_column: str) -> tuple[Any, int | None, int | None]:
    """The partition's input as one table without our columns, the timestamp, the partition.

    Raises:
        StateKeeperError: rows of several state partitions.
    """
    kept: list[Any] = []
    now_ms: int | None = None
    partition: int | None = None
    for batch in batches:
        found = _batch_partition(batch)
        if found is None:
            continue
        if partition is not None and found != partition:
            raise StateKeeperError(
                f"one task received rows of state partitions {partition} and {found}"
            )
        partition = found
        if now_ms is None:
            column = batch.column(ts_column)
            raw = column.cast(pa.int64())[0].as_py()
            now_ms = round(raw * _UNIT_MS[column.type.unit])
        kept.append(batch.drop_columns([ts_column, PART_COLUMN]))
    if not kept:
        return pa.table({}), now_ms, partition
    return pa.Table.from_batches(kept), now_ms, partition


def peek_partition(batches: Iterator[Any]) -> tuple[int | None, Iterator[Any]]:
    """The state partition of a streamed input, and the input without our column.

    Only batches up to the first non-empty one are read ahead.

    Raises:
        StateKeeperError: rows of several state partitions (also while streaming later).
    """
    head: list[Any] = []
    partition: int | None = None
    for batch in batches:
        head.append(batch)
        partition = _batch_partition(batch)
        if partition is not None:
            break

    def stripped() -> Iterator[Any]:
        for batch in _chain(head, batches):
            found = _batch_partition(batch)
            if found is not None and found != partition:
                raise StateKeeperError(
                    f"one task received rows of state partitions {partition} and {found}"
                )
            yield batch.drop_columns([PART_COLUMN])

    return partition, stripped()


def _chain(head: list[Any], rest: Iterator[Any]) -> Iterator[Any]:
    yield from head
    yield from rest
