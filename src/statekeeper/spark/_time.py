"""The batch clock in every partition, and the watermark's source.

TTL entries must expire, and timers fire, in every partition in every micro-batch, also in a
partition that receives no row; with event time, every partition must also agree on the
largest event time of the batch (the next batch's watermark derives from it, see
:mod:`statekeeper.keyed._timers`). There is no driver-side hook on Spark Connect, so both
travel **with the data**: every operator with key groups (all that statekeeper 0.2 and later
create) that needs them (see below) inserts, before its shuffle, a ``mapInArrow`` that
passes every row through and then emits one **heartbeat** row per state partition (key group
= the first one the partition owns, every user column null except the event-time column,
which holds the largest event time of that input task, and ``__statekeeper_heartbeat``
true). The shuffle routes heartbeats like any row, so every state partition receives one
from every input task: it gets the batch timestamp, which is added after the shuffle on the
heartbeats alone (:func:`batch_clock`), even without data, and the batch's largest event
time as the max over its heartbeats. Spark re-runs a batch over the same input, so a re-run
sees the same heartbeats.

The price is one pass of the input through Python before the shuffle, and ``P`` rows per
input task. (A heartbeat made in the JVM instead, from each input task's first row, is out
of reach: Spark refuses ``monotonically_increasing_id`` in streaming plans.) So an operator
pays it only when something needs the clock in a partition without input
(:func:`needs_heartbeats`): a time mode, an initial state, or a state with a TTL. Whether
the processor declares one is learnt on the driver, before the plan is built, by calling its
``init`` (then ``close``) on a copy with a handle that only records declarations, as Spark's
own ``transformWithState`` calls ``init`` and ``close`` on the driver to learn its state
schemas; when that fails or ``init`` asks the handle for anything but a declaration, the
operator keeps its heartbeats. (That run also checks each declaration as the handle does, so
a malformed one fails ``transform_with_state`` itself, before the query starts, and not its
first tasks.) Without heartbeats the timestamp rides on every row (added after the shuffle:
no shuffle bytes), so a processor still reads ``batch_timestamp_ms``, and an empty partition
learns its partition from its task id (the operator's stage ends with its own exchange, see
:mod:`statekeeper.spark._transform`). (An ``init`` that declares a TTL on the workers only,
say behind an environment variable, loses the expiry in partitions without input, as an
operator of statekeeper 0.1 does: its reads still hide expired entries.) The pass costs
about 2% of a 100k-row micro-batch of two columns, 8-10% of one with 20 more (``local[2]``,
Row form). The vectorized form has no TTL or timers and no heartbeats. An operator of
statekeeper 0.1 (no key groups) cannot address a partition by key group: it has none, and
its rows carry the timestamp.

The task splits the heartbeats off before the processor sees the input. Each store records
the running largest event time at commit, and batch ``b`` reads its watermark from version
``b`` of its own store: the same in every partition, also after a restart.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from statekeeper.errors import ConfigMismatchError
from statekeeper.keyed import StatefulProcessor, key_group_range, validate_delay, validate_time_mode
from statekeeper.keyed.runner import KEY_GROUP_COLUMN, TimeSpec, event_times_ms
from statekeeper.spark._arrow_types import arrow_schema
from statekeeper.spark._partition import Partitioning

__all__ = [
    "HEARTBEAT_COLUMN",
    "TimeSpec",
    "batch_clock",
    "needs_heartbeats",
    "refuse_legacy_time",
    "refuse_unused_timers",
    "split_heartbeats",
    "time_spec",
    "with_heartbeats",
]

HEARTBEAT_COLUMN = "__statekeeper_heartbeat"
_TIMESTAMPS = (T.TimestampType, T.TimestampNTZType)
_PER_MS = {"s": None, "ms": 1, "us": 1_000, "ns": 1_000_000}


def time_spec(
    df: DataFrame, time_mode: object, event_time_column: object, watermark_delay: object
) -> TimeSpec:
    """Check the time arguments against ``df``'s schema (before any state is touched).

    Raises:
        ValueError: an unknown mode, a negative delay, an event-time column that is missing,
            not a timestamp, or given without ``time_mode="event_time"`` (or the reverse).
        TypeError: a delay that is not seconds or a timedelta, a column name that is not str.
    """
    mode = validate_time_mode(time_mode)
    delay = validate_delay(watermark_delay)
    if event_time_column is not None:
        if not isinstance(event_time_column, str):
            raise TypeError(f"event_time_column must be a str, got {event_time_column!r}")
        fields = {f.name: f for f in df.schema.fields}
        field = fields.get(event_time_column)
        if field is None:
            raise ValueError(
                f"event_time_column {event_time_column!r} is not in the DataFrame; its "
                f"columns are {list(fields)}"
            )
        if not isinstance(field.dataType, _TIMESTAMPS):
            raise ValueError(
                f"event_time_column {event_time_column!r} must be a timestamp column, found "
                f"{field.dataType.simpleString()}"
            )
    return TimeSpec(mode, event_time_column, delay)


def refuse_unused_timers(processor: StatefulProcessor, time_mode: str | None) -> None:
    """Refuse a processor that handles timers in an operator without a time mode (its
    timers could never fire; registering one would fail the batch).

    Raises:
        ValueError: the processor overrides ``handle_expired_timer`` and ``time_mode`` is
            ``None``.
    """
    overridden = type(processor).handle_expired_timer is not StatefulProcessor.handle_expired_timer
    if time_mode is None and overridden:
        raise ValueError(
            f"{type(processor).__name__} defines handle_expired_timer, but the operator has "
            "time_mode=None, where timers never fire: pass time_mode='processing_time' or "
            "time_mode='event_time'"
        )


def refuse_legacy_time(metadata: Any, name: str, timing: TimeSpec) -> None:
    """Refuse a time mode for an operator of statekeeper 0.1 (no key groups: its partitions
    cannot be addressed by a heartbeat).

    Raises:
        ConfigMismatchError: the operator exists without key groups.
    """
    if timing.time_mode is None or metadata is None or name not in metadata.operators:
        return
    if metadata.key_groups.get(name) is None:
        raise ConfigMismatchError(
            f"operator {name!r} was created by statekeeper 0.1 (no key groups) and cannot "
            f"run with time_mode={timing.time_mode!r}: start a new operator name"
        )


def needs_heartbeats(
    ttls: Mapping[str, int | None] | None, timing: TimeSpec, *, initial_state: bool
) -> bool:
    """Whether an operator needs the batch clock in partitions without input (see the
    module docstring): a time mode, an initial state still to apply, or a state with a TTL
    among ``ttls`` (:func:`~statekeeper.keyed.declared_ttls`; ``None``: unknown, so yes)."""
    if timing.time_mode is not None or initial_state or ttls is None:
        return True
    return any(ttl is not None for ttl in ttls.values())


def batch_clock(heartbeats: bool) -> Column:
    """The micro-batch timestamp column, added after the shuffle: on the heartbeats alone
    when the operator has them (every partition receives one), else on every row."""
    now = F.current_timestamp()
    return F.when(F.col(HEARTBEAT_COLUMN), now) if heartbeats else now


def _partition_starts(partitions: int, groups: int) -> list[int]:
    """The first key group of every partition that owns one."""
    return [r.start for p in range(partitions) if (r := key_group_range(p, partitions, groups))]


def with_heartbeats(df: DataFrame, *, timing: TimeSpec, partitioning: Partitioning) -> DataFrame:
    """``df`` (with its key-group column) plus one heartbeat per state partition and input
    task, see the module docstring.

    Raises:
        ConfigMismatchError: the operator has no key groups.
    """
    if partitioning.key_groups is None:
        raise ConfigMismatchError("a time mode needs an operator with key groups")
    fields = [T.StructField(f.name, f.dataType, True) for f in df.schema.fields]
    schema = T.StructType([*fields, T.StructField(HEARTBEAT_COLUMN, T.BooleanType(), True)])
    arrow = arrow_schema(df.sparkSession, schema)
    beat = functools.partial(
        _beat_task, arrow, timing.event_time_column, partitioning.partitions,
        partitioning.key_groups,
    )  # fmt: skip
    return df.mapInArrow(beat, schema)


def _beat_task(
    schema: Any, column: str | None, partitions: int, key_groups: int, batches: Iterator[Any]
) -> Iterator[Any]:
    top: int | None = None
    for batch in batches:
        if column is not None and batch.num_rows:
            found = pc.max(event_times_ms(batch.column(column))).as_py()
            if found is not None:
                top = found if top is None else max(top, found)
        flags = pa.array([False] * batch.num_rows, pa.bool_())
        yield batch.append_column(pa.field(HEARTBEAT_COLUMN, pa.bool_()), flags)
        # Spark's own types (string or large string, the time zone) for the heartbeats.
        schema = pa.schema([f.with_nullable(True) for f in batch.schema]).append(
            pa.field(HEARTBEAT_COLUMN, pa.bool_())
        )
    yield _beats(schema, column, top, partitions, key_groups)


def _beats(schema: Any, column: str | None, top: int | None, partitions: int, groups: int) -> Any:
    """One heartbeat row per partition that owns a key group."""
    starts = _partition_starts(partitions, groups)
    n = len(starts)
    arrays = []
    for field in schema:
        if field.name == KEY_GROUP_COLUMN:
            arrays.append(pa.array(starts, pa.int64()).cast(field.type))
        elif field.name == HEARTBEAT_COLUMN:
            arrays.append(pa.array([True] * n, pa.bool_()))
        elif field.name == column and top is not None:
            per_ms = _PER_MS[field.type.unit]
            value = top // 1000 if per_ms is None else top * per_ms
            arrays.append(pa.array([value] * n, pa.int64()).cast(field.type))
        else:
            arrays.append(pa.nulls(n, field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def split_heartbeats(batch: Any, timing: TimeSpec) -> tuple[Any, int | None]:
    """One input batch without its heartbeats, and the largest event time they carry
    (``None``: none, or no event time); the batch's largest event time is the max over all."""
    if HEARTBEAT_COLUMN not in batch.schema.names:
        return batch, None
    mask = pc.fill_null(batch.column(HEARTBEAT_COLUMN), False)
    if not pc.any(mask).as_py():
        return batch.drop_columns([HEARTBEAT_COLUMN]), None
    beats = batch.filter(mask)
    data = batch.filter(pc.invert(mask)).drop_columns([HEARTBEAT_COLUMN])
    top = None
    if timing.event_time_column is not None:
        top = pc.max(event_times_ms(beats.column(timing.event_time_column))).as_py()
    return data, top
