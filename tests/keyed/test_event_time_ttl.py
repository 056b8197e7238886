"""TTL on event time (``ttl_on="event_time"``) through the processor test harness: a write is
stamped with the largest event time seen, and the entry expires when the watermark reaches
the stamp plus the ttl, also in a batch without input; processing time does not expire it."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from statekeeper.errors import ConfigMismatchError
from statekeeper.keyed import StatefulProcessor, StatefulProcessorHandle
from statekeeper.keyed.testing import ProcessorTester

OUT = pa.schema([("k", pa.string()), ("prev", pa.int64()), ("wm", pa.int64())])
IN = pa.schema([("k", pa.string()), ("ts", pa.timestamp("ms", tz="UTC"))])


class Remember(StatefulProcessor):
    """Keeps each key's latest event time (seconds) for 10 s of event time."""

    rows = "row"

    def __init__(self, ttl_on: str = "event_time", **state_args: Any) -> None:
        self.ttl_on = ttl_on
        self.state_args = state_args or {"ttl": 10}

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.last = handle.value_state("last", ttl_on=self.ttl_on, **self.state_args)

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        prev = self.last.get()
        self.last.update(max(int(r.ts.timestamp()) for r in rows))
        yield (key[0], prev, self.handle.timer_values.watermark_ms)


def _rows(*pairs: tuple[str, int]) -> pa.Table:
    times = [dt.datetime.fromtimestamp(s, dt.UTC) for _, s in pairs]
    return pa.table({"k": [k for k, _ in pairs], "ts": times}, schema=IN)


def _tester(processor: StatefulProcessor, directory: Path | None = None) -> ProcessorTester:
    return ProcessorTester(
        processor, keys="k", output_schema=OUT, time_mode="event_time", event_time_column="ts",
        directory=directory,
    )  # fmt: skip


def test_entries_expire_when_the_watermark_passes_stamp_plus_ttl() -> None:
    with _tester(Remember()) as t:
        assert t.run(_rows(("a", 100))) == [{"k": "a", "prev": None, "wm": 0}]
        expiry_of_a = 110_000  # stamped with event time 100 s, ttl 10 s
        assert [e.expires_at_ms for e in t.state()] == [expiry_of_a]
        t.run(_rows(("b", 105)))  # watermark 100 s; b expires at 115 s
        t.run(_rows(("c", 112)))  # watermark 105 s: a still alive
        assert t.stats.expired == 0
        assert sorted(e.key for e in t.state()) == [("a",), ("b",), ("c",)]
        # No input: the watermark (112 s) passes a's expiry, processing time is irrelevant
        t.processing_time_ms = 10**13
        assert t.run([]) == []
        assert t.stats.expired == 1
        assert sorted(e.key for e in t.state()) == [("b",), ("c",)]
        # b (115 s) is alive at watermark 112 s; read then restamped at 113 s
        assert t.run(_rows(("b", 113))) == [{"k": "b", "prev": 105, "wm": 112_000}]
        assert {e.key: e.expires_at_ms for e in t.state("last")} == {
            ("b",): 123_000,
            ("c",): 122_000,
        }


def test_an_expired_entry_is_invisible_in_the_batch_whose_watermark_passes_it() -> None:
    with _tester(Remember()) as t:
        t.run(_rows(("a", 100)))
        t.run(_rows(("b", 110)))  # watermark 100 s: a (110 s) alive
        # watermark 110 s == a's expiry: a reads as unset, then is written afresh
        assert t.run(_rows(("a", 111))) == [{"k": "a", "prev": None, "wm": 110_000}]
        assert t.stats.expired == 0  # rewritten, not deleted


def test_the_watermark_delay_postpones_expiry() -> None:
    processor = Remember()
    with ProcessorTester(
        processor, keys="k", output_schema=OUT, time_mode="event_time", event_time_column="ts",
        watermark_delay=5,
    ) as t:  # fmt: skip
        t.run(_rows(("a", 100)))
        t.run(_rows(("b", 112)))  # watermark 95 s
        t.run([])  # watermark 107 s < 110 s
        assert t.stats.expired == 0
        t.run(_rows(("c", 115)))  # watermark 107 s
        t.run([])  # watermark 110 s
        assert t.stats.expired == 1
        assert sorted(e.key for e in t.state()) == [("b",), ("c",)]


def test_the_operator_record_says_which_clock_a_ttl_runs_on() -> None:
    from statekeeper.keyed import read_operator_record

    with _tester(Remember()) as t:
        t.run(_rows(("a", 100)))
        with t._open() as store:
            record = read_operator_record(store)
    assert record is not None
    assert record.states["last"].ttl_on == "event_time"
    assert record.states["last"].ttl_ms == 10_000


def test_entries_keep_the_clock_they_were_stamped_on_when_the_ttl_is_removed_or_moved(
    tmp_path: Path,
) -> None:
    """Found by review: with the TTL removed (or moved to processing time) on a restart, the
    entries' event-time expiries were read against the micro-batch time, which runs ahead of
    event time by the stream's lag: every entry read as expired, and the first batch deleted
    them all for good."""
    now = 1_790_000_000  # the micro-batch time; event times lag it by two hours
    with _tester(Remember(), tmp_path) as t:
        t.processing_time_ms = now * 1000
        t.run(_rows(("a", now - 7200), ("b", now - 7200)))  # both expire at event time -7190
    moved = _tester(Remember(ttl_on="processing_time", ttl=3600), tmp_path)
    with moved as t, pytest.raises(ConfigMismatchError, match="TTL runs on event_time"):
        t.run(_rows(("a", now - 7195)))
    with _tester(Remember(ttl_on="processing_time", ttl=None), tmp_path) as t:
        t.processing_time_ms = (now + 60) * 1000
        # Watermark -7200: a is alive, and rewritten without a TTL.
        assert t.run(_rows(("a", now - 7195))) == [
            {"k": "a", "prev": now - 7200, "wm": (now - 7200) * 1000}
        ]
        assert [(e.key, e.expires_at_ms) for e in t.state()] == [
            (("a",), None),
            (("b",), (now - 7190) * 1000),
        ]
        t.run(_rows(("c", now - 7000)))  # watermark -7195: b is still kept
        t.run(_rows(("c", now - 6990)))  # watermark -7000 passes b's expiry, on its clock
        assert t.stats.expired == 1
        assert sorted(e.key for e in t.state()) == [("a",), ("c",)]
    with _tester(Remember(), tmp_path) as t:  # the old code runs on
        assert t.run(_rows(("b", now - 6980)))[0]["prev"] is None


def test_a_processing_time_ttl_removed_and_re_added_on_event_time_is_refused(
    tmp_path: Path,
) -> None:
    """Entries written under a processing-time TTL keep their expiries when the TTL is
    removed; a later event-time TTL would read them on the watermark (hours behind the
    micro-batch time), keeping them long past their promise. Found in an earlier review:
    the record of a state whose processing-time TTL was removed looked like one that never
    had a TTL, so that move was allowed."""
    from statekeeper.keyed import read_operator_record

    now = 1_790_000_000
    with _tester(Remember(ttl_on="processing_time", ttl=3600), tmp_path) as t:
        t.processing_time_ms = now * 1000
        t.run(_rows(("a", now - 7200)))
        assert [e.expires_at_ms for e in t.state()] == [(now + 3600) * 1000]
    with _tester(Remember(ttl_on="processing_time", ttl=None), tmp_path) as t:
        t.processing_time_ms = now * 1000
        t.run(_rows(("b", now - 7100)))
        with t._open() as store:
            record = read_operator_record(store)
    assert record is not None
    assert record.states["last"].ttl_removed
    assert record.states["last"].ttl_ms is None
    with (
        _tester(Remember(), tmp_path) as t,
        pytest.raises(ConfigMismatchError, match="TTL runs on processing_time"),
    ):
        t.run(_rows(("c", now - 7000)))
    with _tester(Remember(ttl_on="processing_time", ttl=60), tmp_path) as t:  # allowed
        t.processing_time_ms = (now + 3601) * 1000
        t.run(_rows(("c", now - 7000)))
        assert t.stats.expired == 1  # a, on the clock it was stamped on
        assert sorted(e.key for e in t.state()) == [("b",), ("c",)]


def test_a_state_that_never_had_a_ttl_may_take_one_on_event_time(tmp_path: Path) -> None:
    with _tester(Remember(ttl_on="processing_time", ttl=None), tmp_path) as t:
        t.run(_rows(("a", 100)))
    with _tester(Remember(), tmp_path) as t:
        t.run(_rows(("b", 105)))
        assert {e.key: e.expires_at_ms for e in t.state()} == {("a",): None, ("b",): 115_000}


@pytest.mark.parametrize(
    ("time_mode", "processor", "message"),
    [
        ("processing_time", Remember(), "only an operator with time_mode='event_time' has"),
        (None, Remember(), "this operator has time_mode=None"),
        ("event_time", Remember(ttl_on="wall"), "ttl_on must be 'processing_time' or 'event_t"),
        ("event_time", Remember(ttl=None), "no ttl was given"),
    ],
)
def test_event_time_ttl_misuse_is_refused_and_nothing_committed(
    time_mode: str | None, processor: StatefulProcessor, message: str
) -> None:
    column = "ts" if time_mode == "event_time" else None
    with ProcessorTester(
        processor, keys="k", output_schema=OUT, time_mode=time_mode, event_time_column=column
    ) as t:
        with pytest.raises(ValueError, match=message):
            t.run(_rows(("a", 100)))
        assert t.batch_id == 0


class TimerTouchesProcessingTtl(StatefulProcessor):
    """Event-time timers whose handler reads and writes a state with a processing-time TTL."""

    rows = "row"

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.seen = handle.value_state("seen", ttl=3600)  # processing time

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        self.seen.update(len(rows))
        self.handle.register_timer(max(int(r.ts.timestamp()) for r in rows) * 1000 + 1)
        yield from ()

    def handle_expired_timer(self, key: tuple[Any, ...], values: Any, info: Any) -> Iterator[Any]:
        self.seen.update((self.seen.get() or 0) + 1)
        yield (key[0], self.seen.get(), values.watermark_ms)


def test_timers_wait_for_a_batch_with_a_clock_when_their_handler_may_need_it() -> None:
    """A micro-batch whose tasks have no input (a no-data batch) has no timestamp: due
    event-time timers fired all the same, and a handler touching a processing-time TTL
    failed the batch ("the micro-batch timestamp is unknown") on every retry and restart.
    Such timers now fire in the next batch that has a timestamp."""
    with _tester(TimerTouchesProcessingTtl()) as t:
        t.processing_time_ms = 5_000
        assert t.run(_rows(("a", 100))) == []
        t.processing_time_ms, t.watermark_ms = None, 200_000  # the timer at 100.001 s is due
        assert t.run(_rows()) == []
        assert t.timers() == [(("a",), 100_001)]
        t.processing_time_ms = 6_000
        assert t.run(_rows()) == [{"k": "a", "prev": 2, "wm": 200_000}]
        assert t.timers() == []
