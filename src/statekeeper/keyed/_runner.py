"""Running one partition of one micro-batch of a keyed processor: grouping, late rows, the
processor, the timers.

The per-key path sorts the partition's input by key once, then hands each key its rows as a
slice: a pandas DataFrame cut by one groupby over the sorted table (the pandas form) or a
list of lightweight rows sliced from one list built column-wise (the Row form). The keys are
encoded once and announced to the handle, which prefetches the states the processor reads.
Then every timer due by the batch's clock fires, in order of expiry and key, whether or not
its key (or the partition) had input; a timer is deleted as it fires.

Nothing here knows Spark (it needs pyarrow and pandas): the Spark tasks feed it Arrow tables
and a leased store, and :mod:`statekeeper.keyed.testing` drives the very same function.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]

from statekeeper.keyed._arrow_keys import encode_keys
from statekeeper.keyed._handles import StatefulProcessorHandle
from statekeeper.keyed._output import OutputWriter
from statekeeper.keyed._processor import StatefulProcessor, input_form
from statekeeper.keyed._row_type import build_rows
from statekeeper.store import StateStore

__all__ = ["KEY_GROUP_COLUMN", "RunStats", "iter_groups", "run_processor"]

KEY_GROUP_COLUMN = "__statekeeper_key_group"
"""The input column that carries each row's key group (dropped before the processor)."""


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
