"""Running one partition of one micro-batch: grouping, the processor, the vectorized function.

The per-key path sorts the partition's input by key once, then hands each key its rows as a
slice: a pandas DataFrame cut by one groupby over the sorted table (the pandas form) or a
list of lightweight rows sliced from one list built column-wise (the Row form). The keys are
encoded once and announced to the handle, which prefetches the states the processor reads.

Nothing here knows Spark; the task functions in ``_transform`` feed it Arrow batches and a
leased store, and tests drive it directly with an explicit clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]

from statekeeper.errors import StateKeeperError
from statekeeper.keyed import (
    StatefulProcessor,
    StatefulProcessorHandle,
    build_rows,
    input_form,
    key_group_range,
)
from statekeeper.spark._keys import encode_keys
from statekeeper.spark._output import OutputWriter, conform_batch
from statekeeper.spark._partition import KEY_GROUP_COLUMN
from statekeeper.store import StateStore

__all__ = [
    "ArrowFunction",
    "PartitionStore",
    "RunStats",
    "iter_groups",
    "run_arrow",
    "run_processor",
]


@dataclass
class RunStats:
    """Counters of one partition's run."""

    rows_in: int = 0
    rows_out: int = 0
    keys: int = 0
    expired: int = 0


def iter_groups(table: Any, keys: Sequence[str]) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Split ``table`` into (key tuple, pandas DataFrame of that key's rows), in key order.

    Rows keep their arrival order within a key (the sort is stable). Nulls form their own
    key, and so do NaNs, as in Spark's grouping. A key-group column is dropped.
    """
    grouped = _Grouped.of(table, keys, grouped=KEY_GROUP_COLUMN in table.column_names)
    if grouped is not None:
        yield from zip(grouped.keys, grouped.frames(), strict=True)


@dataclass
class _Grouped:
    """A table sorted by its keys: the key tuples, and where each key's rows start."""

    ordered: Any
    starts: Any
    keys: list[tuple[Any, ...]]
    encoded: list[bytes]
    groups: list[int] | None
    """Each key's key group (``None``: the operator has none)."""

    @classmethod
    def of(cls, table: Any, keys: Sequence[str], *, grouped: bool = False) -> _Grouped | None:
        """Sort ``table`` by ``keys`` (stable); ``None`` if it has no rows. With ``grouped``,
        each key's key group is read from :data:`KEY_GROUP_COLUMN`, which is then dropped
        (the processor never sees it)."""
        if table.num_rows == 0:
            return None
        # Nulls sort last by default; NaNs just before them.
        order = pc.sort_indices(table, sort_keys=[(k, "ascending") for k in keys])
        ordered = table.take(order)
        starts = _group_starts(ordered, keys)
        at = pa.array(starts)
        groups = None
        if grouped:
            groups = ordered.column(KEY_GROUP_COLUMN).take(at).to_pylist()
            ordered = ordered.drop_columns([KEY_GROUP_COLUMN])
        arrays = [ordered.column(k).take(at) for k in keys]
        columns = [array.to_pylist() for array in arrays]
        keyed = list(zip(*columns, strict=True))
        return cls(ordered, starts, keyed, encode_keys(arrays), groups)

    def bounds(self) -> list[int]:
        """``bounds[i]:bounds[i + 1]`` are the rows of key ``i``."""
        return [*self.starts.tolist(), self.ordered.num_rows]

    def frames(self) -> Iterator[Any]:
        """One pandas DataFrame per key, in key order: slices of one frame, cut by a pandas
        groupby on the (already sorted) group numbers, which is cheaper than ``iloc``."""
        frame = self.ordered.to_pandas()
        sizes = np.diff(np.asarray(self.bounds()))
        groups = np.repeat(np.arange(len(sizes)), sizes)
        for _, rows in frame.groupby(groups, sort=False):
            yield rows

    def rows(self) -> Iterator[list[Any]]:
        """One list of lightweight rows per key, in key order."""
        columns = [column.to_pylist() for column in self.ordered.columns]
        every = build_rows(self.ordered.column_names, columns)
        bounds = self.bounds()
        for i in range(len(bounds) - 1):
            yield every[bounds[i] : bounds[i + 1]]


def _group_starts(table: Any, keys: Sequence[str]) -> Any:
    """Row indices where a new key starts in a table sorted by ``keys``."""
    n = table.num_rows
    change = np.zeros(max(n - 1, 0), dtype=bool)
    for k in keys:
        column = table.column(k).combine_chunks()
        after, before = column.slice(1), column.slice(0, n - 1)
        differs = pc.fill_null(pc.not_equal(after, before), False)
        differs = pc.or_(differs, pc.xor(pc.is_null(after), pc.is_null(before)))
        if pa.types.is_floating(column.type):
            both_nan = pc.fill_null(pc.and_(pc.is_nan(after), pc.is_nan(before)), False)
            differs = pc.and_(differs, pc.invert(both_nan))
        change |= differs.to_numpy(zero_copy_only=False)
    return np.concatenate([[0], np.flatnonzero(change) + 1]).astype(np.int64)


def run_processor(
    store: StateStore,
    processor: StatefulProcessor,
    table: Any,
    *,
    keys: Sequence[str],
    output_schema: Any,
    operator: str,
    batch_id: int,
    partition: int,
    now_ms: int | None,
    key_schema: str | None = None,
    stats: RunStats | None = None,
    key_groups: int | None = None,
) -> Iterator[Any]:
    """Run ``processor`` over one partition's input; yields checked output batches.

    Writes go to ``store`` uncommitted; the caller commits after the last batch. With
    ``key_groups`` (the operator's, as the root records them), ``table`` must hold each
    row's key group in :data:`KEY_GROUP_COLUMN`, and every state key starts with it.

    Raises:
        OutputSchemaError: an output batch does not match ``output_schema``.
        ConfigMismatchError: the keys or a state's kind differ from what the store holds.
        Exception: whatever the processor raises.
    """
    stats = stats if stats is not None else RunStats()
    stats.rows_in += table.num_rows
    form = input_form(processor)
    where = f"operator {operator!r} partition {partition} micro-batch {batch_id}"
    handle = StatefulProcessorHandle(
        store, now_ms=now_ms, batch_id=batch_id, partition=partition, key_groups=key_groups
    )
    processor.init(handle)
    handle.record_operator(keys, key_schema=key_schema, operator=operator)
    writer = OutputWriter(output_schema, where, frames=form == "pandas")
    grouped = _Grouped.of(table, keys, grouped=key_groups is not None)
    if grouped is not None:
        handle.visit_keys(grouped.encoded, grouped.groups)
        inputs = grouped.rows() if form == "row" else grouped.frames()
        select, handle_rows, extend = handle.select, processor.handle_input_rows, writer.extend
        for position, (key, rows) in enumerate(zip(grouped.keys, inputs, strict=True)):
            select(position, key)
            yield from extend(handle_rows(key, rows))
        stats.keys += len(grouped.keys)
    handle.set_key(None)
    processor.close()
    yield from writer.flush()
    stats.rows_out += writer.rows_out
    stats.expired += handle.expire()


class PartitionStore:
    """One partition's store for one micro-batch, as a vectorized function sees it.

    Reads and writes of :class:`~statekeeper.StateStore` plus batched writes; committing is
    left to statekeeper (after the function's last output batch).
    """

    def __init__(
        self,
        store: StateStore,
        *,
        batch_id: int,
        partition: int,
        key_groups: int | None = None,
        partitions: int | None = None,
    ) -> None:
        """Wrap ``store`` for micro-batch ``batch_id``; ``key_groups`` (with
        ``partitions``): the operator's key groups, which every key put must start with."""
        self._store = store
        self.batch_id = batch_id
        self.partition = partition
        self.key_groups = key_groups
        """The operator's key groups: every key put starts with its key group, two bytes
        big-endian, one this partition owns. ``None`` for an operator of statekeeper 0.1,
        whose keys are free."""
        self._owned = (
            None if key_groups is None else key_group_range(partition, partitions or 1, key_groups)
        )

    def state_keys(self, batch: Any, columns: Sequence[str]) -> list[bytes]:
        """The store keys of a batch's rows: ``encode_key`` of ``columns``, each prefixed
        with the row's key group (the batch's :data:`KEY_GROUP_COLUMN`) if the operator has
        key groups. The way to build keys that :meth:`put` accepts.

        Raises:
            KeyError: a column is not in the batch.
            TypeError: a key element has a type keys cannot hold.
        """
        arrays = [batch.column(c) for c in columns]
        if self.key_groups is None:
            return encode_keys(arrays)
        return encode_keys(arrays, batch.column(KEY_GROUP_COLUMN))

    def _check(self, key: bytes) -> None:
        owned = self._owned
        if owned is not None and int.from_bytes(key[:2], "big") not in owned:
            raise StateKeeperError(
                f"partition {self.partition} owns key groups {owned.start} to "
                f"{owned.stop - 1}, and every key put must start with its key group (two "
                f"bytes); got key 0x{key[:16].hex()}: build keys with store.state_keys(...)"
            )

    def __repr__(self) -> str:
        return f"PartitionStore(partition={self.partition}, batch_id={self.batch_id})"

    @property
    def version(self) -> int:
        """The committed version loaded (``batch_id``)."""
        return self._store.version

    def get(self, key: bytes) -> bytes | None:
        """As :meth:`StateStore.get`."""
        return self._store.get(key)

    def multi_get(self, keys: Iterable[bytes]) -> list[bytes | None]:
        """As :meth:`StateStore.multi_get`."""
        return self._store.multi_get(keys)

    def scan(self, prefix: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        """As :meth:`StateStore.scan`."""
        return self._store.scan(prefix)

    def put(self, key: bytes, value: bytes) -> None:
        """As :meth:`StateStore.put`.

        Raises:
            StateKeeperError: with key groups, ``key`` does not start with one this
                partition owns.
        """
        self._check(key)
        self._store.put(key, value)

    def delete(self, key: bytes) -> None:
        """As :meth:`StateStore.delete`."""
        self._store.delete(key)

    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        """Put every (key, value) pair.

        Raises:
            TypeError, ValueError: as :meth:`StateStore.put`.
            StateKeeperError: with key groups, a key does not start with one this partition
                owns.
        """
        put, check = self._store.put, self._check
        for key, value in items:
            check(key)
            put(key, value)

    def delete_many(self, keys: Iterable[bytes]) -> None:
        """Delete every key."""
        delete = self._store.delete
        for key in keys:
            delete(key)


ArrowFunction = Callable[[PartitionStore, Iterator[Any]], Iterable[Any]]
"""``fn(store, batches) -> batches``: a partition's input and output as pyarrow RecordBatches."""


def run_arrow(
    store: StateStore,
    fn: ArrowFunction,
    batches: Iterator[Any],
    *,
    output_schema: Any,
    operator: str,
    batch_id: int,
    partition: int,
    stats: RunStats | None = None,
    key_groups: int | None = None,
    partitions: int | None = None,
) -> Iterator[Any]:
    """Run a vectorized function over one partition; yields checked output batches.

    Input the function leaves unread is drained (and counted) afterwards. With
    ``key_groups`` the batches carry :data:`KEY_GROUP_COLUMN` and the function's keys must
    start with their key group (:meth:`PartitionStore.state_keys`).

    Raises:
        OutputSchemaError: an output batch does not match ``output_schema``.
        Exception: whatever ``fn`` raises.
    """
    stats = stats if stats is not None else RunStats()
    where = f"operator {operator!r} partition {partition} micro-batch {batch_id}"

    def counted() -> Iterator[Any]:
        for batch in batches:
            stats.rows_in += batch.num_rows
            yield batch

    source = counted()
    view = PartitionStore(
        store, batch_id=batch_id, partition=partition, key_groups=key_groups,
        partitions=partitions,
    )  # fmt: skip
    for out in fn(view, source):
        batch = conform_batch(out, output_schema, where)
        stats.rows_out += batch.num_rows
        yield batch
    for _ in source:
        pass
