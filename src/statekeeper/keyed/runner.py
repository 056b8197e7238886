"""Running one partition of one micro-batch of a keyed processor: grouping, late rows, the
initial state, the processor, the timers.

The partition's input is grouped with bounded memory (:mod:`statekeeper.keyed.grouping`:
spilled runs, chunks of whole key groups); each chunk is sorted by key, and each key gets
its rows as a slice: a pandas DataFrame cut by one groupby over the sorted chunk (the pandas
form) or a list of lightweight rows sliced from one list built column-wise (the Row form).
A chunk's keys are encoded once and announced to the handle, which prefetches the states
the processor reads.
In the operator's first micro-batch (the store at version 0) the initial rows, grouped the
same way, go to ``handle_initial_state`` first, key by key. Then every timer due by the
batch's clock fires, in order of expiry and key, whether or not
its key (or the partition) had input; a timer is deleted as it fires.

Nothing here knows Spark (it needs pyarrow and pandas): the Spark tasks feed it their input
(a :class:`~statekeeper.keyed.grouping.KeyedInput`) and a leased store, and
:mod:`statekeeper.keyed.testing` drives the very same function.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow.compute as pc  # type: ignore[import-untyped]

from statekeeper.keyed._handles import StatefulProcessorHandle
from statekeeper.keyed._processor import StatefulProcessor, input_form
from statekeeper.keyed._timers import (
    ExpiredTimerInfo,
    TimerValues,
    read_event_clock,
    validate_time_mode,
    watermark_of,
    write_event_clock,
)
from statekeeper.keyed._tuples import decode_key
from statekeeper.keyed.grouping import (
    KEY_GROUP_COLUMN,
    Grouped,
    KeyedInput,
    event_times_ms,
    iter_groups,
)
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


def _late(table: Any, time: TimeSpec, watermark_ms: int, stats: RunStats) -> Any:
    """``table`` without its late rows (event time at or before ``watermark_ms``, the
    previous batch's watermark, as Spark drops them)."""
    if time.event_time_column is None or table.num_rows == 0:
        return table
    ms = event_times_ms(table.column(time.event_time_column))
    kept = table.filter(pc.fill_null(pc.greater(ms, watermark_ms), True))
    stats.late_rows += table.num_rows - kept.num_rows
    return kept


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
    handlers wait for a later batch. So do all due timers in a batch without a timestamp
    when a state has a processing-time TTL, which their handlers could not touch: they
    fire in the next batch that has one, as timers of no-data batches do."""
    values = handle.timer_values
    upto = values.watermark_ms if time.time_mode == "event_time" else values.processing_time_ms
    if time.time_mode is None or upto < 0 or handle.lacks_ttl_clock():
        return
    timers = handle._timers  # the batch's one writer of timers: it keeps the index's floor
    due = timers.due(upto)
    timers.firing(upto, due)
    for expiry, group, key_bytes in due:
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
    initial_only: bool = False,
) -> Iterator[Any]:
    """Run ``processor`` over one partition's input; yields checked output batches.

    ``table`` is the input: an Arrow table, or a :class:`KeyedInput` that was fed the
    partition's batches (bounded memory; closed here).

    ``initial`` (an Arrow table with the key columns, and :data:`KEY_GROUP_COLUMN` with key
    groups) holds the partition's rows of the operator's initial state: if ``store`` is at
    version 0 (the operator's first micro-batch) they go to ``handle_initial_state``, one
    call per key in key order, before any input; at a later version they are ignored.

    With ``initial_only`` only ``init``, the operator record and ``handle_initial_state``
    run (no input, no timers, no expiry; nothing is yielded): a micro-batch 0 that an
    engine applies late, whose due timers fire in the batch it runs next.

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
    source = _input_of(table, time)
    try:
        yield from _run(
            store, processor, source, keys=keys, output_schema=output_schema,
            operator=operator, batch_id=batch_id, partition=partition, now_ms=now_ms,
            key_schema=key_schema, stats=stats, key_groups=key_groups, time=time,
            batch=batch, initial=initial, initial_only=initial_only,
        )  # fmt: skip
    finally:
        source.close()


def _input_of(table: Any, time: TimeSpec) -> KeyedInput:
    if isinstance(table, KeyedInput):
        return table
    grouped = KEY_GROUP_COLUMN in table.column_names
    return KeyedInput.of(table, grouped=grouped, event_time_column=time.event_time_column)


def _run(
    store: StateStore,
    processor: StatefulProcessor,
    source: KeyedInput,
    *,
    keys: Sequence[str],
    output_schema: Any,
    operator: str,
    batch_id: int,
    partition: int,
    now_ms: int | None,
    key_schema: str | None,
    stats: RunStats,
    key_groups: int | None,
    time: TimeSpec,
    batch: BatchTime,
    initial: Any,
    initial_only: bool = False,
) -> Iterator[Any]:
    stats.rows_in += source.num_rows
    form = input_form(processor)
    grouped_layout = key_groups is not None
    values, late_watermark, seen = _clocks(store, time, now_ms, batch, grouped_layout)
    top = source.max_event_ms
    known = [t for t in (seen, top, batch.batch_max_event_ms) if t is not None]
    handle = StatefulProcessorHandle(
        store, now_ms=now_ms, batch_id=batch_id, partition=partition, key_groups=key_groups,
        time_mode=time.time_mode, timer_values=values, event_time_ms=max(known, default=None),
    )  # fmt: skip
    processor.init(handle)
    handle.record_operator(keys, key_schema=key_schema, operator=operator)
    if initial is not None and store.version == 0:
        _apply_initial(handle, processor, initial, keys, form, stats)
    if initial_only:
        handle.set_key(None)
        processor.close()
        return
    where = f"operator {operator!r} partition {partition} micro-batch {batch_id}"
    writer = OutputWriter(output_schema, where, frames=form == "pandas")
    for chunk in source.chunks():
        chunk = _late(chunk, time, late_watermark, stats)
        yield from _run_keys(handle, processor, writer, chunk, keys, form, stats)
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
    grouped = Grouped.of(table, keys, grouped=handle.key_groups is not None)
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
    grouped = Grouped.of(table, keys, grouped=handle.key_groups is not None)
    if grouped is None:
        return
    handle.visit_keys(grouped.encoded, grouped.groups)
    inputs = grouped.rows() if form == "row" else grouped.frames()
    select, handle_rows, extend = handle.select, processor.handle_input_rows, writer.extend
    for position, (key, rows) in enumerate(zip(grouped.keys, inputs, strict=True)):
        select(position, key)
        yield from extend(handle_rows(key, rows))
    stats.keys += len(grouped.keys)
