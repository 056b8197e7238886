"""Timers and event time: time modes, the timer entries and index, the watermark's source.

A timer is state: two entries (see ``_layout``), the key's (``<kg> 0x03 <key> <expiry>``)
and the index's (``0xFF 0x04 <expiry> <kg> <key>``), always written and deleted together in
the same micro-batch, so they commit, restore and re-run with the rest of the state. Due
timers are found by one scan of the index that starts at its floor (``_floor``: past the
timers fired earlier) and stops at the first timer not yet due.

**Time modes** (after Spark's ``transformWithState``): ``None`` (no timers), and
``"processing_time"``, where a timer fires in the first micro-batch whose timestamp is at or
after its expiry, and ``"event_time"``, where it fires in the first micro-batch whose
watermark is at or after its expiry.

**The watermark of micro-batch b** is ``max(0, E - delay)``, where ``E`` is the largest event
time of the rows of batches ``0 .. b-1`` (0 before any event time was seen), as Spark
derives it. Every store records ``E`` (:data:`_layout.EVENT_TIME`) in the commit of each
batch, with the watermark that batch used, and the engine makes the value the same in every
partition: it feeds each
partition the largest event time of the *whole* batch (the Spark layer carries it to every
partition with the data, see ``statekeeper.spark._transform``). So a task reads batch b's
watermark from its own store at version b: no driver, no listener (Spark Connect has none),
the same value on every partition and on every re-run of b.

**Late rows** are those at or before the watermark of the *previous* micro-batch (Spark's
"watermark for late events"; the current one is its "watermark for eviction", which timers
compare with). So a row may be processed in a batch whose watermark it trails, and register
a timer that fires in that same batch: that is what Spark 4's ``transformWithState`` does
(checked against it by ``tests/spark/test_timers_vs_spark.py``). The previous batch's
watermark is the second half of the value at :data:`_layout.EVENT_TIME` (a value of an
earlier release holds only ``E``; then the current watermark serves, as it did there).
"""

from __future__ import annotations

import datetime as dt
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from statekeeper.keyed._floor import IndexFloor
from statekeeper.keyed._layout import (
    EVENT_TIME,
    GROUPED_TIMER_INDEX,
    KEY_GROUP,
    META_KEY,
    TIMER,
    TIMER_INDEX,
    U64,
    OperatorRecord,
)
from statekeeper.keyed._tuples import decode_key
from statekeeper.store import StateStore

__all__ = [
    "TIME_MODES",
    "EventClock",
    "ExpiredTimerInfo",
    "TimerEntry",
    "TimerValues",
    "Timers",
    "iter_timers",
    "read_event_clock",
    "read_max_event_time",
    "validate_delay",
    "validate_time_mode",
    "validate_timer",
    "watermark_of",
    "write_event_clock",
]

TIME_MODES = (None, "processing_time", "event_time")
_I64 = struct.Struct(">q")
_CLOCK = struct.Struct(">qq")
_NO_EVENT = -(2**63)
_MAX_U64 = 2**64 - 1


def validate_time_mode(time_mode: object) -> str | None:
    """Return ``time_mode`` if it is one of :data:`TIME_MODES`.

    Raises:
        ValueError: anything else.
    """
    if time_mode not in TIME_MODES:
        raise ValueError(
            f"time_mode must be None, 'processing_time' or 'event_time'; got {time_mode!r}"
        )
    return None if time_mode is None else str(time_mode)


def validate_delay(delay: object) -> int:
    """The watermark delay in ms: seconds (int or float) or a timedelta, at least 0.

    Raises:
        TypeError: not a number or a timedelta.
        ValueError: negative.
    """
    if isinstance(delay, dt.timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, int | float) and not isinstance(delay, bool):
        seconds = float(delay)
    else:
        raise TypeError(f"watermark_delay must be seconds (a number) or a timedelta, got {delay!r}")
    if not seconds >= 0:
        raise ValueError(f"watermark_delay must be 0 or more seconds, got {delay!r}")
    return round(seconds * 1000)


def validate_timer(expiry_ms: object) -> int:
    """Return ``expiry_ms`` if it is a valid timer time (ms since the epoch).

    Raises:
        TypeError: not an int.
        ValueError: negative or beyond 64 bits.
    """
    if isinstance(expiry_ms, bool) or not isinstance(expiry_ms, int):
        raise TypeError(f"a timer is an int of ms since the epoch, got {expiry_ms!r}")
    if not 0 <= expiry_ms <= _MAX_U64:
        raise ValueError(f"a timer is ms since the epoch in [0, 2**64), got {expiry_ms}")
    return expiry_ms


def watermark_of(max_event_ms: int | None, delay_ms: int) -> int:
    """The watermark given the largest event time seen before the batch (Spark starts at 0)."""
    return 0 if max_event_ms is None else max(0, max_event_ms - delay_ms)


@dataclass(frozen=True)
class TimerValues:
    """The clocks of a micro-batch, after Spark's ``TimerValues``.

    Attributes:
        processing_time_ms: the micro-batch timestamp (ms since the epoch); -1 if unknown.
        watermark_ms: the event-time watermark (ms); -1 outside ``time_mode="event_time"``.
    """

    processing_time_ms: int = -1
    watermark_ms: int = -1

    def get_current_processing_time_in_ms(self) -> int:
        """Spark's name for :attr:`processing_time_ms`."""
        return self.processing_time_ms

    def get_current_watermark_in_ms(self) -> int:
        """Spark's name for :attr:`watermark_ms`."""
        return self.watermark_ms


@dataclass(frozen=True)
class ExpiredTimerInfo:
    """The timer that fired, after Spark's ``ExpiredTimerInfo``."""

    expiry_time_ms: int

    def get_expiry_time_in_ms(self) -> int:
        """Spark's name for :attr:`expiry_time_ms`."""
        return self.expiry_time_ms


class Timers:
    """The timer entries of one store: per key, and the index ordered by expiry."""

    def __init__(self, store: StateStore, *, grouped: bool) -> None:
        """Timers of ``store``, laid out with key groups if ``grouped``. One instance per
        micro-batch writes them all (it keeps the index's floor)."""
        self._store = store
        self._index = GROUPED_TIMER_INDEX if grouped else TIMER_INDEX
        self._floor = IndexFloor(store, self._index)

    def register(self, group: bytes, key: bytes, expiry_ms: int) -> None:
        """Add the timer (idempotent): ``group`` is the key-group prefix, ``key`` encoded."""
        at = U64.pack(expiry_ms)
        self._store.put(group + TIMER + key + at, b"")
        self._store.put(self._index + at + group + key, b"")
        self._floor.lower(expiry_ms)

    def delete(self, group: bytes, key: bytes, expiry_ms: int) -> None:
        """Remove the timer (nothing if absent)."""
        at = U64.pack(expiry_ms)
        self._store.delete(group + TIMER + key + at)
        self._store.delete(self._index + at + group + key)

    def of_key(self, group: bytes, key: bytes) -> list[int]:
        """The key's timers, ascending."""
        prefix = group + TIMER + key
        return [U64.unpack_from(k, len(prefix))[0] for k, _ in self._store.scan(prefix)]

    def due(self, upto_ms: int) -> list[tuple[int, bytes, bytes]]:
        """Every timer at or before ``upto_ms`` as (expiry, group prefix, key), in order of
        expiry then key; reads the index from its floor, and only up to the first timer
        not due. A list: firing them changes the index."""
        return list(self.scan_due(upto_ms))

    def scan_due(self, upto_ms: int) -> Iterator[tuple[int, bytes, bytes]]:
        """:meth:`due` as it is read, for a reader that leaves the index alone."""
        at = len(self._index)
        group_at = at + U64.size
        key_at = group_at + (KEY_GROUP.size if len(self._index) > 1 else 0)
        unpack = U64.unpack_from
        for index_key, _ in self._store.scan(self._index, start=self._floor.start()):
            expiry = unpack(index_key, at)[0]
            if expiry > upto_ms:
                return
            yield expiry, index_key[group_at:key_at], index_key[key_at:]

    def firing(self, upto_ms: int, due: list[tuple[int, bytes, bytes]]) -> None:
        """The timers ``due`` that :meth:`due` found for ``upto_ms`` are all deleted in this
        micro-batch: the next scan starts after them (timers registered later lower its
        start again)."""
        self._floor.passed(upto_ms, found=bool(due))


def _event_time_key(grouped: bool) -> bytes:
    return (b"\xff" + EVENT_TIME) if grouped else EVENT_TIME


@dataclass(frozen=True)
class EventClock:
    """What a store recorded of event time at its last commit.

    Attributes:
        max_event_ms: the largest event time of every batch committed; ``None`` if none.
        watermark_ms: the watermark the last committed batch used; ``None`` at version 0
            or in a store of an earlier release (which did not record it).
    """

    max_event_ms: int | None = None
    watermark_ms: int | None = None

    def late_watermark(self, delay_ms: int) -> int:
        """The watermark rows are late against in the next batch: the last batch's."""
        if self.watermark_ms is not None:
            return self.watermark_ms
        # Version 0 (Spark's first batch drops nothing), or a value of an earlier release.
        return watermark_of(self.max_event_ms, delay_ms)


def read_event_clock(store: StateStore, *, grouped: bool) -> EventClock:
    """The event time and watermark the store recorded (an empty clock if none)."""
    raw = store.get(_event_time_key(grouped))
    if raw is None:
        return EventClock()
    if len(raw) == _I64.size:
        return EventClock(int(_I64.unpack(raw)[0]))
    top, watermark = _CLOCK.unpack(raw)
    return EventClock(None if top == _NO_EVENT else int(top), int(watermark))


def read_max_event_time(store: StateStore, *, grouped: bool) -> int | None:
    """The largest event time (ms) the store recorded, ``None`` if none."""
    return read_event_clock(store, grouped=grouped).max_event_ms


def write_event_clock(
    store: StateStore, max_ms: int | None, watermark_ms: int, *, grouped: bool
) -> int | None:
    """Record ``max(recorded, max_ms)`` and the watermark of the batch being committed;
    returns the largest event time now recorded."""
    old = read_event_clock(store, grouped=grouped).max_event_ms
    tops = [t for t in (old, max_ms) if t is not None]
    top = max(tops) if tops else None
    value = _CLOCK.pack(_NO_EVENT if top is None else top, watermark_ms)
    store.put(_event_time_key(grouped), value)
    return top


@dataclass(frozen=True, slots=True)
class TimerEntry:
    """One registered timer of a keyed store.

    Attributes:
        key: the grouping key.
        expiry_ms: when it fires (ms: processing time or event time, per the time mode).
        key_group: the key's key group; ``None`` without key groups.
    """

    key: tuple[Any, ...]
    expiry_ms: int
    key_group: int | None = None


def iter_timers(store: StateStore) -> Iterator[TimerEntry]:
    """Every timer of a keyed store, in order of expiry (a scan of the timer index).

    Raises:
        StateKeeperError: the store holds no operator record.
        CorruptStateError: the record is not valid.
    """
    from statekeeper.errors import StateKeeperError

    raw = store.get(META_KEY)
    if raw is None:
        raise StateKeeperError(
            f"store {store.operator}/{store.partition} holds no operator record: it was not "
            "written by a keyed processor"
        )
    record = OperatorRecord.from_bytes(raw)
    grouped = record.key_groups is not None
    for expiry, group, key in Timers(store, grouped=grouped).scan_due(_MAX_U64):
        key_group = KEY_GROUP.unpack(group)[0] if grouped else None
        yield TimerEntry(decode_key(key, len(record.keys))[0], expiry, key_group)
