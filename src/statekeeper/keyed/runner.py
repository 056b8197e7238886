"""Running one partition of one micro-batch of a keyed processor: grouping, late rows, the
initial state, the processor, the timers.

The per-key path sorts the partition's input by key once, then hands each key its rows as a
slice: a pandas DataFrame cut by one groupby over the sorted table (the pandas form) or a
list of lightweight rows sliced from one list built column-wise (the Row form). The keys are
encoded once and announced to the handle, which prefetches the states the processor reads.
In the operator's first micro-batch (the store at version 0) the initial rows, grouped the
same way, go to ``handle_initial_state`` first, key by key. Then every timer due by the
batch's clock fires, in order of expiry and key, whether or not
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

from statekeeper.keyed._handles import StatefulProcessorHandle
from statekeeper.keyed._processor import StatefulProcessor, input_form
from statekeeper.keyed._row_type import build_rows
from statekeeper.keyed._timers import (
    ExpiredTimerInfo,
    Timers,
    TimerValues,
    read_event_clock,
    validate_time_mode,
    watermark_of,
    write_event_clock,
)
from statekeeper.keyed._tuples import decode_key
from statekeeper.keyed.arrow_keys import encode_keys
from statekeeper.keyed.output import OutputWriter
from statekeeper.store import StateStore

__all__ = [
    "KEY_GROUP_COLUMN",
    "BatchTime",
    "RunStats",
    "TimeSpec",
    "check_initial_columns",
    "event_times_ms",
    "iter_groups",
    "run_processor",
]

KEY_GROUP_COLUMN = "__statekeeper_key_group"
"""The input column that carries each row's key group (dropped before the processor)."""


@dataclass
class RunStats:
    """Counters of one partition's run."""

    rows_in: int = 0
    rows_out: int = 0
    keys: int = 0
    expired: int = 0
    late_rows: int = 0
    """Input rows dropped because their event time was at or before the previous
    micro-batch's watermark (as Spark drops them)."""
    timers_fired: int = 0
    initial_rows: int = 0
    """Rows of the initial state handed to ``handle_initial_state`` (first batch only)."""


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


@dataclass(frozen=True)
class TimeSpec:
    """An operator's time mode and event time (fixed per operator).

    Attributes:
        time_mode: ``None``, ``"processing_time"`` or ``"event_time"``.
        event_time_column: the input column of event times (a timestamp); event time only.
        watermark_delay_ms: how far the watermark trails the largest event time seen.
    """

    time_mode: str | None = None
    event_time_column: str | None = None
    watermark_delay_ms: int = 0

    def __post_init__(self) -> None:
        """Check the combination.

        Raises:
            ValueError: an unknown mode, a column without event time or event time without
                a column, or a negative delay.
        """
        validate_time_mode(self.time_mode)
        event = self.time_mode == "event_time"
        if event != (self.event_time_column is not None):
            raise ValueError(
                "time_mode='event_time' needs event_time_column=<a timestamp column>, and "
                "event_time_column needs time_mode='event_time'; got time_mode="
                f"{self.time_mode!r}, event_time_column={self.event_time_column!r}"
            )
        if self.watermark_delay_ms < 0:
            raise ValueError(f"watermark_delay must be >= 0, got {self.watermark_delay_ms} ms")


@dataclass(frozen=True)
class BatchTime:
    """One micro-batch's clocks, given by the engine.

    Attributes:
        batch_max_event_ms: the largest event time of the whole micro-batch (every
            partition's rows); ``None``: this partition's rows only (one partition).
        watermark_ms: overrides the watermark derived from the store (tests).
    """

    batch_max_event_ms: int | None = None
    watermark_ms: int | None = None


_NO_TIME = TimeSpec()


def event_times_ms(column: Any) -> Any:
    """An Arrow timestamp column as int64 ms since the epoch (rounded down).

    Raises:
        TypeError: not a timestamp column.
    """
    if not pa.types.is_timestamp(column.type):
        raise TypeError(f"the event-time column must be a timestamp, found {column.type}")
    raw = column.cast(pa.int64())
    unit = column.type.unit
    if unit == "ms":
        return raw
    if unit == "s":
        return pc.multiply(raw, 1000)
    per_ms = 1000.0 if unit == "us" else 1_000_000.0
    return pc.floor(pc.divide(raw.cast(pa.float64()), per_ms)).cast(pa.int64())


def _late(table: Any, time: TimeSpec, watermark_ms: int, stats: RunStats) -> tuple[Any, int | None]:
    """``table`` without its late rows (event time at or before ``watermark_ms``, the
    previous batch's watermark, as Spark drops them), and the largest event time of all
    its rows."""
    if time.event_time_column is None or table.num_rows == 0:
        return table, None
    ms = event_times_ms(table.column(time.event_time_column))
    top = pc.max(ms).as_py()
    keep = pc.fill_null(pc.greater(ms, watermark_ms), True)
    kept = table.filter(keep)
    stats.late_rows += table.num_rows - kept.num_rows
    return kept, top


def _clocks(
    store: StateStore, time: TimeSpec, now_ms: int | None, batch: BatchTime, grouped: bool
) -> tuple[TimerValues, int, int | None]:
    """The batch's clocks, the watermark its input rows are late against (the previous
    batch's, see :mod:`statekeeper.keyed._timers`), and the largest event time of earlier
    batches."""
    watermark = late = -1
    seen = None
    if time.time_mode == "event_time":
        clock = read_event_clock(store, grouped=grouped)
        seen = clock.max_event_ms
        late = clock.late_watermark(time.watermark_delay_ms)
        if batch.watermark_ms is not None:
            watermark = batch.watermark_ms
        else:
            watermark = watermark_of(clock.max_event_ms, time.watermark_delay_ms)
    return TimerValues(-1 if now_ms is None else now_ms, watermark), late, seen


def check_initial_columns(columns: Sequence[str], keys: Sequence[str]) -> None:
    """Refuse initial rows that lack a key column.

    Raises:
        ValueError: a key column is missing; names the keys expected and the columns found.
    """
    missing = [k for k in keys if k not in columns]
    if missing:
        raise ValueError(
            f"the initial state must hold the key columns {list(keys)}; it lacks {missing} "
            f"(its columns are {list(columns)})"
        )


def _fire_timers(
    handle: StatefulProcessorHandle,
    processor: StatefulProcessor,
    writer: OutputWriter,
    time: TimeSpec,
    arity: int,
    stats: RunStats,
) -> Iterator[Any]:
    """Call ``handle_expired_timer`` for every timer due by the batch's clock (expiry at or
    before it), deleting each after its handler, as Spark does: the handler still sees it
    in ``list_timers``, and re-registering it does not keep it. Timers registered by the
    handlers wait for a later batch."""
    values = handle.timer_values
    upto = values.watermark_ms if time.time_mode == "event_time" else values.processing_time_ms
    if time.time_mode is None or upto < 0:
        return
    timers = Timers(handle._store, grouped=handle.key_groups is not None)
    for expiry, group, key_bytes in timers.due(upto):
        key = decode_key(key_bytes, arity)[0]
        handle.bind_timer_key(key, key_bytes, group)
        yield from writer.extend(
            processor.handle_expired_timer(key, values, ExpiredTimerInfo(expiry))
        )
        timers.delete(group, key_bytes, expiry)
        stats.timers_fired += 1


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
    time: TimeSpec = _NO_TIME,
    batch: BatchTime | None = None,
    initial: Any = None,
) -> Iterator[Any]:
    """Run ``processor`` over one partition's input; yields checked output batches.

    ``initial`` (an Arrow table with the key columns, and :data:`KEY_GROUP_COLUMN` with key
    groups) holds the partition's rows of the operator's initial state: if ``store`` is at
    version 0 (the operator's first micro-batch) they go to ``handle_initial_state``, one
    call per key in key order, before any input; at a later version they are ignored.

    Writes go to ``store`` uncommitted; the caller commits after the last batch. With
    ``key_groups`` (the operator's, as the root records them), ``table`` must hold each
    row's key group in :data:`KEY_GROUP_COLUMN`, and every state key starts with it.
    With event time, late rows (at or before the previous batch's watermark) are dropped
    first (counted in ``stats.late_rows``) and the largest event time seen
    (``batch.batch_max_event_ms``, or this table's) is recorded in the store with this
    batch's watermark, the sources of the next batch's watermarks. After the input, every timer
    due by the batch's clock fires.

    Raises:
        OutputSchemaError: an output batch does not match ``output_schema``.
        ConfigMismatchError: the keys or a state's kind differ from what the store holds.
        TypeError: the event-time column is not a timestamp, or ``handle_initial_state``
            returned something (it emits no rows).
        ValueError: the initial rows lack a key column.
        Exception: whatever the processor raises.
    """
    stats = stats if stats is not None else RunStats()
    batch = batch if batch is not None else BatchTime()
    stats.rows_in += table.num_rows
    form = input_form(processor)
    grouped_layout = key_groups is not None
    values, late_watermark, seen = _clocks(store, time, now_ms, batch, grouped_layout)
    table, top = _late(table, time, late_watermark, stats)
    known = [t for t in (seen, top, batch.batch_max_event_ms) if t is not None]
    handle = StatefulProcessorHandle(
        store, now_ms=now_ms, batch_id=batch_id, partition=partition, key_groups=key_groups,
        time_mode=time.time_mode, timer_values=values, event_time_ms=max(known, default=None),
    )  # fmt: skip
    processor.init(handle)
    handle.record_operator(keys, key_schema=key_schema, operator=operator)
    if initial is not None and store.version == 0:
        _apply_initial(handle, processor, initial, keys, form, stats)
    where = f"operator {operator!r} partition {partition} micro-batch {batch_id}"
    writer = OutputWriter(output_schema, where, frames=form == "pandas")
    yield from _run_keys(handle, processor, writer, table, keys, form, stats)
    yield from _fire_timers(handle, processor, writer, time, len(keys), stats)
    handle.set_key(None)
    processor.close()
    yield from writer.flush()
    stats.rows_out += writer.rows_out
    stats.expired += handle.expire()
    if time.time_mode == "event_time":
        tops = [t for t in (top, batch.batch_max_event_ms) if t is not None]
        write_event_clock(
            store, max(tops) if tops else None, values.watermark_ms, grouped=grouped_layout
        )


def _apply_initial(
    handle: StatefulProcessorHandle,
    processor: StatefulProcessor,
    table: Any,
    keys: Sequence[str],
    form: str,
    stats: RunStats,
) -> None:
    """``handle_initial_state`` for every key of the initial rows, in key order."""
    check_initial_columns(table.column_names, keys)
    grouped = _Grouped.of(table, keys, grouped=handle.key_groups is not None)
    if grouped is None:
        return
    handle.visit_keys(grouped.encoded, grouped.groups)
    inputs = grouped.rows() if form == "row" else grouped.frames()
    values = handle.timer_values
    for position, (key, rows) in enumerate(zip(grouped.keys, inputs, strict=True)):
        handle.select(position, key)
        # A processor's override may wrongly yield: catch that instead of dropping it.
        result: object = processor.handle_initial_state(key, rows, values)  # type: ignore[func-returns-value]
        if result is not None:
            close = getattr(result, "close", None)
            if callable(close):
                close()
            raise TypeError(
                f"{type(processor).__name__}.handle_initial_state must return None: it emits "
                f"no rows (as Spark's handleInitialState), but it returned a "
                f"{type(result).__name__}; remove its yield or return"
            )
    handle.set_key(None)
    stats.initial_rows += table.num_rows


def _run_keys(
    handle: StatefulProcessorHandle,
    processor: StatefulProcessor,
    writer: OutputWriter,
    table: Any,
    keys: Sequence[str],
    form: str,
    stats: RunStats,
) -> Iterator[Any]:
    """``handle_input_rows`` for every key of ``table``, in key order."""
    grouped = _Grouped.of(table, keys, grouped=handle.key_groups is not None)
    if grouped is None:
        return
    handle.visit_keys(grouped.encoded, grouped.groups)
    inputs = grouped.rows() if form == "row" else grouped.frames()
    select, handle_rows, extend = handle.select, processor.handle_input_rows, writer.extend
    for position, (key, rows) in enumerate(zip(grouped.keys, inputs, strict=True)):
        select(position, key)
        yield from extend(handle_rows(key, rows))
    stats.keys += len(grouped.keys)
