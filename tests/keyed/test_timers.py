"""Timers and event time, run through the processor test harness (the Spark task's path)."""

from __future__ import annotations

import datetime as dt
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from statekeeper import ConfigMismatchError, StateKeeperError
from statekeeper.keyed import (
    ExpiredTimerInfo,
    StatefulProcessor,
    StatefulProcessorHandle,
    TimerValues,
)
from statekeeper.keyed.testing import ProcessorTester

OUT = pa.schema([("k", pa.string()), ("n", pa.int64()), ("what", pa.string())])
UTC = dt.UTC


class Session(StatefulProcessor):
    """Counts a key's rows; (re)arms one timer 10 ms after the clock; the timer emits and
    clears the count."""

    rows = "row"

    def __init__(self, clock: str = "processing") -> None:
        self.clock = clock

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.n = handle.value_state("n")

    def _now(self) -> int:
        values = self.handle.timer_values
        if self.clock == "processing":
            return values.processing_time_ms
        return values.watermark_ms

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        n = (self.n.get() or 0) + len(rows)
        self.n.update(n)
        for old in self.handle.list_timers():
            self.handle.delete_timer(old)
        if self.clock == "event":
            latest = max(r.ts for r in rows)
            self.handle.register_timer(int(latest.timestamp() * 1000) + 10)
        else:
            self.handle.register_timer(self._now() + 10)
        yield (key[0], n, "in")

    def handle_expired_timer(
        self, key: tuple[Any, ...], timer_values: TimerValues, expired_timer_info: ExpiredTimerInfo
    ) -> Iterator[Any]:
        yield (key[0], self.n.get(), f"timer@{expired_timer_info.get_expiry_time_in_ms()}")
        self.n.clear()


def _ts(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, UTC)


def test_processing_time_timers_fire_once_in_order_of_expiry_without_input() -> None:
    with ProcessorTester(Session(), keys="k", output_schema=OUT, time_mode="processing_time") as t:
        t.processing_time_ms = 100
        assert t.run([{"k": "b"}, {"k": "a"}]) == [
            {"k": "a", "n": 1, "what": "in"},
            {"k": "b", "n": 1, "what": "in"},
        ]
        t.processing_time_ms = 105
        t.run([{"k": "a"}])  # re-arms a at 115
        assert t.timers() == [(("b",), 110), (("a",), 115)]
        t.processing_time_ms = 110  # due: expiry <= batch timestamp
        assert t.run([]) == [{"k": "b", "n": 1, "what": "timer@110"}]
        assert t.stats.timers_fired == 1
        assert t.timers() == [(("a",), 115)]
        t.processing_time_ms = 1_000
        assert t.run([]) == [{"k": "a", "n": 2, "what": "timer@115"}]
        assert t.run([]) == []  # fired once
        assert t.timers() == []
        assert t.state() == []


def test_timers_survive_a_restart_on_an_empty_local_dir(tmp_path: Path) -> None:
    def tester() -> ProcessorTester:
        return ProcessorTester(
            Session(), keys="k", output_schema=OUT, time_mode="processing_time",
            directory=tmp_path,
        )  # fmt: skip

    with tester() as t:
        t.run([{"k": str(i)} for i in range(50)])
    shutil.rmtree(tmp_path / "local")
    with tester() as t:
        assert sorted(t.timers()) == sorted(((str(i),), 10) for i in range(50))
        t.processing_time_ms = 10
        fired = t.run([])
    assert sorted(r["k"] for r in fired) == sorted(str(i) for i in range(50))


def test_a_timer_without_a_time_mode_is_refused_and_nothing_is_committed() -> None:
    with ProcessorTester(Session(), keys="k", output_schema=OUT) as t:
        with pytest.raises(StateKeeperError, match="time_mode='processing_time'"):
            t.run([{"k": "a"}])
        assert t.batch_id == 0


def test_timer_arguments_are_checked() -> None:
    class Bad(Session):
        def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
            self.handle.register_timer(-1)
            yield from ()

    tester = ProcessorTester(Bad(), keys="k", output_schema=OUT, time_mode="processing_time")
    with tester as t, pytest.raises(ValueError, match=r"got -1"):
        t.run([{"k": "a"}])


def test_event_time_watermark_late_rows_and_timers() -> None:
    tester = ProcessorTester(
        Session("event"), keys="k", output_schema=OUT, time_mode="event_time",
        event_time_column="ts", watermark_delay=0.005,
    )  # fmt: skip
    with tester as t:
        out = t.run([{"k": "a", "ts": _ts(100)}, {"k": "b", "ts": _ts(50)}])
        assert [r["n"] for r in out] == [1, 1]  # watermark 0: nothing late
        # watermark = 100 - 5 = 95, but rows are late only at or before the previous batch's
        # watermark (0), as in Spark: c at 40 is processed and its timer (50) fires at once,
        # before b's (60)
        out = t.run([{"k": "c", "ts": _ts(40)}, {"k": "d", "ts": _ts(96)}])
        assert out == [
            {"k": "c", "n": 1, "what": "in"},
            {"k": "d", "n": 1, "what": "in"},
            {"k": "c", "n": 1, "what": "timer@50"},
            {"k": "b", "n": 1, "what": "timer@60"},
        ]
        assert t.stats.late_rows == 0
        # watermark stays 95 (max event time is still 100); the previous one was 95 too: a
        # row at 95 is late, 96 is not
        out = t.run([{"k": "e", "ts": _ts(95)}, {"k": "f", "ts": _ts(96)}])
        assert out == [{"k": "f", "n": 1, "what": "in"}]
        assert t.stats.late_rows == 1
        assert t.run([]) == []  # nothing due at 95
        t.watermark_ms = 200  # set by hand
        assert [r["what"] for r in t.run([])] == ["timer@106", "timer@106", "timer@110"]


def test_bad_time_arguments_fail_before_any_state() -> None:
    with pytest.raises(ValueError, match="watermark_delay must be 0 or more"):
        ProcessorTester(
            Session(), keys="k", output_schema=OUT, time_mode="event_time",
            event_time_column="ts", watermark_delay=-1,
        )  # fmt: skip
    with pytest.raises(ValueError, match="needs event_time_column"):
        ProcessorTester(Session(), keys="k", output_schema=OUT, time_mode="event_time")
    with pytest.raises(ValueError, match="time_mode must be"):
        ProcessorTester(Session(), keys="k", output_schema=OUT, time_mode="wall")
    tester = ProcessorTester(
        Session("event"), keys="k", output_schema=OUT, time_mode="event_time",
        event_time_column="ts",
    )  # fmt: skip
    with tester as t:
        with pytest.raises(TypeError, match="must be a timestamp, found int64"):
            t.run([{"k": "a", "ts": 5}])
        assert t.batch_id == 0


@pytest.mark.parametrize("grouped", [True, False])
def test_due_reads_the_index_in_expiry_order_up_to_the_clock(tmp_path: Path, grouped: bool) -> None:
    """``Timers.due`` returns every timer at or before the clock, in order of expiry then key
    group and key, with the group prefix and key split as registered; it sees the batch's own
    registrations and deletions before the commit, and the same after it."""
    from statekeeper import StateBackend, StoreConfig
    from statekeeper.keyed import encode_key, group_prefix
    from statekeeper.keyed._timers import Timers

    group = (lambda g: group_prefix(g)) if grouped else (lambda g: b"")
    config = StoreConfig(local_dir=str(tmp_path / "local"))
    with (
        StateBackend(str(tmp_path / "root"), config=config) as backend,
        backend.open("t", 0, partitions=1) as store,
    ):
        timers = Timers(store, grouped=grouped)
        a, b, c = (encode_key((k,)) for k in ("a", "b", "c"))
        for g, key, at in [(7, c, 30), (2, b, 20), (2, a, 20), (1, c, 10), (3, a, 40)]:
            timers.register(group(g), key, at)
        timers.register(group(1), c, 10)  # twice: one timer
        store.commit()
        timers.delete(group(2), b, 20)
        timers.register(group(0), b, 30)
        expected = [(10, group(1), c), (20, group(2), a), (30, group(0), b), (30, group(7), c)]
        assert timers.due(30) == expected
        assert timers.due(29) == expected[:2]
        assert timers.due(9) == []
        store.commit()
        assert timers.due(30) == expected
        assert timers.due(2**64 - 1) == [*expected, (40, group(3), a)]
        # without key groups a key's timers are all of its timers
        assert timers.of_key(group(3), a) == ([40] if grouped else [20, 40])


class Scripted(StatefulProcessor):
    """Each input row registers or deletes one timer of its key; a fired timer is emitted,
    and one whose expiry is a multiple of 3 registers a timer 2 ms before it (in the past),
    which must fire in a later batch. With ``boom`` the third fired timer raises."""

    rows = "row"
    boom = False

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.fired = 0

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        for row in rows:
            if row.op == "reg":
                self.handle.register_timer(row.at)
            else:
                self.handle.delete_timer(row.at)
        yield from ()

    def handle_expired_timer(
        self, key: tuple[Any, ...], timer_values: TimerValues, expired_timer_info: ExpiredTimerInfo
    ) -> Iterator[Any]:
        expiry = expired_timer_info.get_expiry_time_in_ms()
        self.fired += 1
        if self.boom and self.fired == 3:
            raise RuntimeError("boom")
        if expiry % 3 == 0 and expiry >= 2:
            self.handle.register_timer(expiry - 2)
        yield (key[0], expiry)


FIRED = pa.schema([("k", pa.string()), ("at", pa.int64())])


@pytest.mark.parametrize("seed", range(6))
def test_timers_fire_as_a_model_says_through_floors_restarts_and_failed_batches(
    tmp_path: Path, seed: int
) -> None:
    """The timer index's floor (the scan starts past what fired) never hides a timer: timers
    registered in the past, by input or by a firing handler, a clock that goes back, a
    failed batch (aborted, then run again) and a reopened store, checked batch by batch
    against a model of the runner's rules."""
    import random

    rnd = random.Random(seed)
    model: set[tuple[str, int]] = set()
    clock = 1_000

    processor = Scripted()  # the tester runs a copy of it in each batch

    def tester() -> ProcessorTester:
        return ProcessorTester(
            processor, keys="k", output_schema=FIRED, time_mode="processing_time",
            directory=tmp_path,
        )  # fmt: skip

    t = tester()
    try:
        for _ in range(40):
            clock = max(0, clock + rnd.choice([-40, 5, 20, 20, 35, 60]))
            rows = []
            for k in rnd.sample([f"k{i}" for i in range(12)], rnd.randint(0, 8)):
                mine = sorted(at for key, at in model if key == k)
                if mine and rnd.random() < 0.3:
                    rows.append({"k": k, "op": "del", "at": rnd.choice(mine)})
                else:
                    rows.append({"k": k, "op": "reg", "at": max(0, clock + rnd.randint(-30, 90))})
            # The model: input first, then every timer at or before the clock, in order of
            # expiry then key; each handler's new timer waits for a later batch.
            for row in rows:
                (model.add if row["op"] == "reg" else model.discard)((row["k"], row["at"]))
            due = sorted((at, k) for k, at in model if at <= clock)
            added = {(k, at - 2) for at, k in due if at % 3 == 0 and at >= 2}
            model -= {(k, at) for at, k in due}
            model |= added
            if rnd.random() < 0.15:
                t.close()
                t = tester()  # a new process: the floor is read back from the store
            t.processing_time_ms = clock
            if len(due) >= 3 and rnd.random() < 0.3:
                processor.boom = True
                with pytest.raises(RuntimeError, match="boom"):
                    t.run(rows)
                processor.boom = False
            got = t.run(rows)
            assert sorted((r["at"], r["k"]) for r in got) == due, (seed, clock)
            assert sorted(t.timers()) == sorted(((k,), at) for k, at in model), (seed, clock)
    finally:
        t.close()


def test_the_index_floor_is_trusted_only_in_the_version_whose_commit_wrote_it(
    tmp_path: Path,
) -> None:
    """``due`` seeks to the floor (an entry below it is not even read), and only while the
    floor was kept by the last commit: a commit by a writer that does not keep it (an
    earlier release) sends the scan back to the head of the index."""
    from statekeeper import StateBackend, StoreConfig
    from statekeeper.keyed import encode_key, group_prefix
    from statekeeper.keyed._layout import GROUPED_TIMER_INDEX, U64
    from statekeeper.keyed._timers import Timers

    a, b, c = (encode_key((k,)) for k in ("a", "b", "c"))
    g = group_prefix(1)
    config = StoreConfig(local_dir=str(tmp_path / "local"))
    with (
        StateBackend(str(tmp_path / "root"), config=config) as backend,
        backend.open("t", 0, partitions=1) as store,
    ):
        batch = Timers(store, grouped=True)
        for key, at in [(a, 10), (b, 20), (c, 30)]:
            batch.register(g, key, at)
        store.commit()
        batch = Timers(store, grouped=True)
        due = batch.due(20)
        batch.firing(20, due)
        for expiry, group, key in due:
            batch.delete(group, key, expiry)
        store.commit()
        # A batch that keeps the floor (21), and an index entry written around it.
        batch = Timers(store, grouped=True)
        batch.firing(20, batch.due(20))
        store.put(GROUPED_TIMER_INDEX + U64.pack(15) + g + a, b"")
        store.commit()
        assert Timers(store, grouped=True).due(30) == [(30, g, c)]  # 15 lies below the floor
        # A commit that does not keep the floor: it is no longer trusted.
        store.put(GROUPED_TIMER_INDEX + U64.pack(16) + g + b, b"")
        store.commit()
        assert Timers(store, grouped=True).due(30) == [(15, g, a), (16, g, b), (30, g, c)]
        # The next batch that reads the index writes the floor anew (its scan began at the
        # head), though nothing fired: an entry put below it in that commit is not read.
        batch = Timers(store, grouped=True)
        assert batch.due(14) == []
        batch.firing(14, [])
        store.put(GROUPED_TIMER_INDEX + U64.pack(12) + g + c, b"")
        store.commit()
        assert Timers(store, grouped=True).due(30) == [(15, g, a), (16, g, b), (30, g, c)]


@pytest.mark.parametrize(
    ("first", "then"),
    [("event_time", "processing_time"), ("processing_time", "event_time"),
     ("processing_time", None)],
)  # fmt: skip
def test_another_time_mode_on_a_restart_is_refused(
    tmp_path: Path, first: str, then: str | None
) -> None:
    """Found by review: the time mode was recorded nowhere, so a restart with another one
    read the stored timers on the other clock (event-time timers an hour ahead fired at once
    on the processing clock); Spark refuses the change. No time mode before is no timers."""

    def tester(mode: str | None) -> ProcessorTester:
        event = mode == "event_time"
        return ProcessorTester(
            Session("event" if event else "processing"), keys="k", output_schema=OUT,
            time_mode=mode, event_time_column="ts" if event else None, directory=tmp_path,
        )  # fmt: skip

    with tester(first) as t:
        t.processing_time_ms = 1_000
        t.run([{"k": "a", "ts": _ts(3_600_000)}])
    with tester(then) as t:
        t.processing_time_ms = 10_000_000
        with pytest.raises(ConfigMismatchError, match=f"time_mode='{first}'"):
            t.run([{"k": "b", "ts": _ts(1)}])
    with tester(first) as t:  # the recorded mode still runs
        t.processing_time_ms = 2_000
        assert {"k": "c", "n": 1, "what": "in"} in t.run([{"k": "c", "ts": _ts(3_600_001)}])


def test_a_time_mode_given_to_an_operator_that_had_none_is_taken(tmp_path: Path) -> None:
    class Counts(Session):
        def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
            n = (self.n.get() or 0) + len(rows)
            self.n.update(n)
            yield (key[0], n, "in")

    for mode in (None, "processing_time"):
        tester = ProcessorTester(
            Counts(), keys="k", output_schema=OUT, time_mode=mode, directory=tmp_path
        )
        with tester as t:
            assert t.run([{"k": "a"}])[0]["n"] == (1 if mode is None else 2)
