"""Differential tests: the same processor on Spark's own Row-based ``transformWithState``
and on statekeeper's ``transform_with_state``, over the same files, one file per micro-batch.

Each query writes its output through ``foreachBatch`` with the batch id, and the rows of
every batch are compared as multisets; then the final state (values and timers) is compared,
read with Spark's state data source and with :func:`read_state`.

What agrees (event time, delay 5 s): the first batch's watermark is 0; batch ``b``'s
watermark is the largest event time of batches ``0 .. b-1`` minus the delay; a row is late
(dropped) when its event time is at or before the watermark of the *previous* batch (Spark's
"watermark for late events"), so a row that trails the current watermark is still processed
and a timer it registers that is already due fires in the same batch; a timer fires when its
expiry is at or before the watermark, after the batch's input, in order of expiry within a
key; the handler still sees the firing timer in ``list_timers``. The timers that fire are
those due when firing starts: a due timer that a handler deletes (another of its key) still
fires, without being listed; a due timer that a handler registers fires in the next batch.

What differs, by design: Spark runs a **no-data micro-batch** when the watermark moved and no
input is left, to fire timers; Spark does not know that a statekeeper operator holds state
(it is a ``mapInArrow`` to Spark), so it runs none for it, and the same timers fire in the
next micro-batch that has input (any input, in any partition). The tests show it: Spark's
trailing no-data batch emits exactly what statekeeper's next batch emits besides its input.
``list_timers`` order: statekeeper's is ascending, Spark's is not ordered (compared sorted).

Processing time: Spark's batch timestamp comes from the wall clock and cannot be fixed
through public APIs (a manual clock exists only for Spark's own Scala tests), so the
processing-time test compares only what is deterministic: timers registered relative to the
batch timestamp (in the past, exactly at it, 1 ms after it, an hour after it) fire in the
same batches on both, and the same ones stay registered.
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql.streaming.stateful_processor import StatefulProcessor as SparkProcessor

from statekeeper import StoreConfig
from statekeeper.spark import StatefulProcessor, read_state, transform_with_state
from tests.spark import differential
from tests.spark.differential import T0, assert_agree, ms, run, spark_tws, stream, write_batches
from tests.spark.helpers import pickled_by_value

pytestmark = pytest.mark.spark

EVENT_OUT = "k string, what string, n long, at long, wm long, timers string"
STATE = "n long, fired long, latest long"
PROC_OUT = "k string, what string, same_batch boolean"
OFFSETS = {"past": -1000, "now": 0, "next": 1, "hour": 3_600_000}


@pytest.fixture(scope="module", autouse=True)
def _pickled_by_value() -> Iterator[None]:
    """Spark's workers cannot import the test modules: the processors (and the helpers they
    call) travel by value."""
    with pickled_by_value(sys.modules[__name__]), pickled_by_value(differential):
        yield


# -- the processor logic, shared: sessions of event time ------------------------------------


def _arm(state: Any, times: list[int], timers: Iterable[int], delete: Any, register: Any) -> int:
    """Count a key's rows (seconds after T0) into the session ``(n, fired, latest)`` in
    ``state`` (a value state of Spark's or of ours) and re-arm its timers: ``timers`` those
    it has, ``delete`` and ``register`` the handle's calls. Arms a warning at latest + 5 s
    and the close at latest + 10 s; returns the new ``n``."""
    old = state.get()
    n, fired = (old[0], old[1]) if old is not None else (0, 0)
    latest = max(times)
    state.update((n + len(times), fired, latest))
    for at in list(timers):
        delete(at)
    for at in (ms(latest + 10), ms(latest + 5)):
        register(at)
    return n + len(times)


def _fire(state: Any, timers: Iterable[int], expiry: int) -> tuple[int, str]:
    """Fire the timer at ``expiry`` of the session in ``state`` (a value state of Spark's or
    of ours: both get, update and clear), whose key has ``timers`` registered: the close
    timer clears the session, the warning counts. Returns the row's ``n`` and the timers."""
    seen = str(sorted(_seconds(t) for t in timers))
    n, fired, latest = state.get() or (0, 0, -1)
    if expiry == ms(latest + 10):
        state.clear()
        return n, seen
    state.update((n, fired + 1, latest))
    return fired + 1, seen


def _seconds(ms: int) -> int:
    return (ms - T0) // 1000


class SparkSessions(SparkProcessor):
    """The session logic on Spark's Row-based API."""

    def init(self, handle: Any) -> None:
        self.handle = handle
        self.state = handle.getValueState("count", STATE)

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        times = [r.t for r in rows]
        h = self.handle
        n = _arm(self.state, times, h.listTimers(), h.deleteTimer, h.registerTimer)
        wm = timerValues.getCurrentWatermarkInMs()
        yield Row(k=key[0], what="in", n=n, at=max(times), wm=wm, timers="")

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Any:
        expiry = expiredTimerInfo.getExpiryTimeInMs()
        n, seen = _fire(self.state, self.handle.listTimers(), expiry)
        wm = timerValues.getCurrentWatermarkInMs()
        yield Row(k=key[0], what="fire", n=n, at=_seconds(expiry), wm=wm, timers=seen)

    def close(self) -> None:
        pass


class SkSessions(StatefulProcessor):
    """The same logic on statekeeper's Row form."""

    rows = "row"

    def init(self, handle: Any) -> None:
        self.handle = handle
        self.state = handle.value_state("count")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        times = [r.t for r in rows]
        h = self.handle
        n = _arm(self.state, times, h.list_timers(), h.delete_timer, h.register_timer)
        yield (key[0], "in", n, max(times), self.handle.timer_values.watermark_ms, "")

    def handle_expired_timer(self, key: Any, timer_values: Any, expired_timer_info: Any) -> Any:
        expiry = expired_timer_info.get_expiry_time_in_ms()
        n, seen = _fire(self.state, self.handle.list_timers(), expiry)
        wm = timer_values.get_current_watermark_in_ms()
        yield (key[0], "fire", n, _seconds(expiry), wm, seen)


# -- the processor logic, shared: timers relative to the batch timestamp ---------------------


class SparkRelative(SparkProcessor):
    """Arms one timer per offset of :data:`OFFSETS` from the batch timestamp; a firing timer
    says which it was and whether it fires in the batch that armed it."""

    def init(self, handle: Any) -> None:
        self.handle = handle
        self.armed = handle.getValueState("armed", "at long")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        now = timerValues.getCurrentProcessingTimeInMs()
        self.armed.update((now,))
        for offset in OFFSETS.values():
            self.handle.registerTimer(now + offset)
        yield Row(k=key[0], what="in", same_batch=True)

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Any:
        armed = self.armed.get()[0]
        label = _label(expiredTimerInfo.getExpiryTimeInMs() - armed)
        now = timerValues.getCurrentProcessingTimeInMs()
        yield Row(k=key[0], what=label, same_batch=now == armed)

    def close(self) -> None:
        pass


class SkRelative(StatefulProcessor):
    """The same on statekeeper."""

    rows = "row"

    def init(self, handle: Any) -> None:
        self.handle = handle
        self.armed = handle.value_state("armed")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        now = self.handle.timer_values.processing_time_ms
        self.armed.update(now)
        for offset in OFFSETS.values():
            self.handle.register_timer(now + offset)
        yield (key[0], "in", True)

    def handle_expired_timer(self, key: Any, timer_values: Any, expired_timer_info: Any) -> Any:
        armed = self.armed.get()
        label = _label(expired_timer_info.get_expiry_time_in_ms() - armed)
        yield (key[0], label, timer_values.get_current_processing_time_in_ms() == armed)


def _label(offset: int) -> str:
    return {v: k for k, v in OFFSETS.items()}[offset]


# -- reading the state back ------------------------------------------------------------------


def _spark_state(spark: SparkSession, checkpoint: Path, var: str) -> dict[str, tuple[int, ...]]:
    rows = spark.read.format("statestore").option("stateVarName", var).load(str(checkpoint))
    return {r["key"]["k"]: tuple(r["value"]) for r in rows.collect()}


def _spark_timers(spark: SparkSession, checkpoint: Path) -> list[tuple[str, int]]:
    reader = spark.read.format("statestore").option("readRegisteredTimers", "true")
    rows = reader.load(str(checkpoint)).collect()
    return sorted((r["key"]["k"], r["expiration_timestamp_ms"]) for r in rows)


def _sk_state(spark: SparkSession, root: Path) -> tuple[dict[str, Any], list[tuple[str, int]]]:
    values, timers = {}, []
    for r in read_state(spark, str(root), "ops").collect():
        if r["state"] == "$timer":
            timers.append((r["k"], int(r["entry"])))
        else:
            values[r["k"]] = json.loads(r["value"])
    return values, sorted(timers)


# Seconds after T0, delay 5 s. Comments give each batch's watermark (wm) and the previous
# batch's (late: rows at or before it are dropped).
EVENT_BATCHES = [
    [("a", 3), ("b", 1), ("a", 0)],  # wm 0 (the first batch's), late 0
    [("a", 20), ("c", 3), ("b", 2)],  # wm 3 - 5 = -2 s, late 0
    # wm 15, late -2: -3 and -2 (== late) are dropped; b at 14 trails wm and is processed
    [("b", 14), ("c", 15), ("d", 16), ("e", 30), ("x", -3), ("y", -2)],
    # wm 25, late 15: i at 10, j at 15 dropped; k at 16 arms 21 (fires now) and 26; timers
    # at 25 (== wm) fire; b's warning (19) fires before its close (24)
    [("f", 21), ("g", 25), ("h", 26), ("i", 10), ("j", 15), ("k", 16)],
    # wm 25, late 25: a at 24 dropped, b at 26 opens a new session
    [("z", 40), ("a", 24), ("b", 26)],
]


def test_event_time_timers_agree_with_spark_batch_by_batch(
    spark: SparkSession, tmp_path: Path
) -> None:
    write_batches(tmp_path / "in", EVENT_BATCHES)
    # statekeeper gets one more file: Spark's trailing no-data batch (wm 35) has no
    # statekeeper counterpart, its timers fire in the next batch with input
    write_batches(tmp_path / "in-sk", [*EVENT_BATCHES, [("zz", 36)]])

    def spark_plan() -> DataFrame:
        df = stream(spark, tmp_path / "in").withWatermark("ts", "5 seconds")
        return df.groupBy("k").transformWithState(SparkSessions(), EVENT_OUT, "Append", "EventTime")

    theirs = spark_tws(spark, tmp_path, "spark", spark_plan)
    ours_df = transform_with_state(
        stream(spark, tmp_path / "in-sk"), keys="k", processor=SkSessions(),
        output_schema=EVENT_OUT, checkpoint=str(tmp_path / "root"), name="ops", partitions=3,
        time_mode="event_time", event_time_column="ts", watermark_delay=5,
        config=StoreConfig(local_dir=str(tmp_path / "local")),
    )  # fmt: skip
    ours = run(ours_df, tmp_path, "sk")

    data_batches = range(len(EVENT_BATCHES))
    assert sorted(theirs) == [*data_batches, len(EVENT_BATCHES)]  # + Spark's no-data batch
    assert sorted(ours) == [*data_batches, len(EVENT_BATCHES)]
    for b in data_batches:
        assert ours[b] == theirs[b], f"micro-batch {b}"
    # The late rows were dropped on both, the edge cases hit as the comments say.
    assert {r[0] for b in data_batches for r in ours[b]} == set("abcdefghkz")
    assert ("c", "fire", 2, 25, ms(25), "[25]") in theirs[3]  # expiry == watermark
    assert ("k", "fire", 1, 21, ms(25), "[21, 26]") in theirs[3]  # armed and fired in b3
    assert ("b", "fire", 3, 24, ms(25), "[24]") in theirs[3]  # the close, after the warning
    # Spark's no-data batch fires what statekeeper fires in its next batch with input.
    last = len(EVENT_BATCHES)
    assert theirs[last], "Spark's no-data batch fired no timer: the test lost its point"
    assert ours[last] - theirs[last] == Counter({("zz", "in", 1, 36, ms(35), ""): 1})
    assert theirs[last] - ours[last] == Counter()

    spark_values = _spark_state(spark, tmp_path / "cp-spark", "count")
    sk_values, sk_timers = _sk_state(spark, tmp_path / "root")
    assert {k: tuple(v) for k, v in sk_values.items() if k != "zz"} == spark_values
    assert [t for t in sk_timers if t[0] != "zz"] == _spark_timers(spark, tmp_path / "cp-spark")


def test_processing_time_timers_agree_with_spark_where_deterministic(
    spark: SparkSession, tmp_path: Path
) -> None:
    batches = [[("p", 0), ("q", 0)], [("r", 0)], [("s", 0)]]
    write_batches(tmp_path / "in", batches)

    def spark_plan() -> DataFrame:
        return (
            stream(spark, tmp_path / "in")
            .groupBy("k")
            .transformWithState(SparkRelative(), PROC_OUT, "Append", "ProcessingTime")
        )

    # With no-data batches, Spark runs batch after batch while a processing-time timer is
    # registered (availableNow never ends): off, its batches are the files, as ours.
    theirs = spark_tws(spark, tmp_path, "spark", spark_plan, no_data=False)
    ours_df = transform_with_state(
        stream(spark, tmp_path / "in"), keys="k", processor=SkRelative(),
        output_schema=PROC_OUT, checkpoint=str(tmp_path / "root"), name="ops", partitions=3,
        time_mode="processing_time", config=StoreConfig(local_dir=str(tmp_path / "local")),
    )  # fmt: skip
    ours = run(ours_df, tmp_path, "sk")

    assert_agree(theirs, ours, len(batches))
    # A timer at or before the batch timestamp fires in the batch that armed it; 1 ms later
    # in the next batch
    assert theirs[0] == Counter({(k, w, True): 1 for k in "pq" for w in ("in", "past", "now")})
    assert ("q", "next", False) in theirs[1]
    spark_timers = _spark_timers(spark, tmp_path / "cp-spark")
    sk_values, sk_timers = _sk_state(spark, tmp_path / "root")
    spark_armed = {k: v[0] for k, v in _spark_state(spark, tmp_path / "cp-spark", "armed").items()}

    def relative(timers: list[tuple[str, int]], armed: dict[str, Any]) -> list[tuple[str, str]]:
        return sorted((k, _label(at - armed[k])) for k, at in timers)

    assert relative(sk_timers, sk_values) == relative(spark_timers, spark_armed)
    assert relative(spark_timers, spark_armed) == [
        ("p", "hour"), ("q", "hour"), ("r", "hour"), ("s", "hour"), ("s", "next")
    ]  # fmt: skip


# -- initial state ------------------------------------------------------------------------------

SEED_OUT = "k string, n long, seed long"
SEED_STATE = "n long, seed long"
# a: two initial rows and input in batch 0; b: input from batch 1; c: input in batch 2;
# d: input only; e: initial only
INITIAL_ROWS = [("a", 10), ("b", 5), ("c", 7), ("a", 1), ("e", 100)]
SEED_BATCHES = [[("a", 1), ("d", 1)], [("b", 2), ("a", 3)], [("c", 5)]]


class SparkSeeded(SparkProcessor):
    """A count of input rows, seeded with the sum of the key's initial ``v``: Spark's Row
    form calls ``handleInitialState`` once per initial row."""

    def init(self, handle: Any) -> None:
        self.state = handle.getValueState("count", SEED_STATE)

    def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
        n, seed = self.state.get() or (0, 0)
        self.state.update((n, seed + initialState.v))

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        n, seed = self.state.get() or (0, 0)
        n += sum(1 for _ in rows)
        self.state.update((n, seed))
        yield Row(k=key[0], n=n, seed=seed)

    def close(self) -> None:
        pass


class SkSeeded(StatefulProcessor):
    """The same on statekeeper: ``handle_initial_state`` gets all of a key's initial rows."""

    rows = "row"

    def init(self, handle: Any) -> None:
        self.state = handle.value_state("count")

    def handle_initial_state(self, key: Any, rows: Any, timer_values: Any) -> None:
        n, seed = self.state.get() or (0, 0)
        self.state.update((n, seed + sum(r.v for r in rows)))

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        n, seed = self.state.get() or (0, 0)
        n += len(rows)
        self.state.update((n, seed))
        yield (key[0], n, seed)


def test_initial_state_agrees_with_spark_batch_by_batch(
    spark: SparkSession, tmp_path: Path
) -> None:
    write_batches(tmp_path / "in", SEED_BATCHES)
    initial = spark.createDataFrame(INITIAL_ROWS, "k string, v long")

    def spark_plan() -> DataFrame:
        return (
            stream(spark, tmp_path / "in")
            .groupBy("k")
            .transformWithState(
                SparkSeeded(), SEED_OUT, "Append", "None", initialState=initial.groupBy("k")
            )
        )

    theirs = spark_tws(spark, tmp_path, "spark", spark_plan)
    ours_df = transform_with_state(
        stream(spark, tmp_path / "in"), keys="k", processor=SkSeeded(), output_schema=SEED_OUT,
        checkpoint=str(tmp_path / "root"), name="ops", partitions=3, initial_state=initial,
        config=StoreConfig(local_dir=str(tmp_path / "local")),
    )  # fmt: skip
    ours = run(ours_df, tmp_path, "sk")

    assert_agree(theirs, ours, 3)
    assert theirs[0] == Counter({("a", 1, 11): 1, ("d", 1, 0): 1})
    spark_values = _spark_state(spark, tmp_path / "cp-spark", "count")
    sk_values, _ = _sk_state(spark, tmp_path / "root")
    assert {k: tuple(v) for k, v in sk_values.items()} == spark_values
    assert spark_values == {"a": (2, 11), "b": (1, 5), "c": (1, 7), "d": (1, 0), "e": (0, 100)}


def test_event_time_timers_agree_with_spark_across_a_restart(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Both queries stop after three files and restart on their checkpoints when two more
    arrive (statekeeper from an empty local folder: every store comes from the root): the
    watermark, the late-row cut and the timers carry over alike. Spark runs no no-data
    batches here, so batch ids match, and timers fire only in batches with input on both."""
    write_batches(tmp_path / "in", EVENT_BATCHES[:3])

    def spark_plan() -> DataFrame:
        df = stream(spark, tmp_path / "in").withWatermark("ts", "5 seconds")
        return df.groupBy("k").transformWithState(SparkSessions(), EVENT_OUT, "Append", "EventTime")

    def ours_plan(local: str) -> DataFrame:
        return transform_with_state(
            stream(spark, tmp_path / "in"), keys="k", processor=SkSessions(),
            output_schema=EVENT_OUT, checkpoint=str(tmp_path / "root"), name="ops",
            partitions=3, time_mode="event_time", event_time_column="ts", watermark_delay=5,
            config=StoreConfig(local_dir=str(tmp_path / local)),
        )  # fmt: skip

    first_theirs = spark_tws(spark, tmp_path, "spark", spark_plan, no_data=False)
    first_ours = run(ours_plan("local"), tmp_path, "sk")
    assert sorted(first_theirs) == sorted(first_ours) == [0, 1, 2]
    write_batches(tmp_path / "in", EVENT_BATCHES[3:], start=3)

    theirs = spark_tws(spark, tmp_path, "spark", spark_plan, no_data=False)
    ours = run(ours_plan("local-after-restart"), tmp_path, "sk")

    assert_agree(theirs, ours, len(EVENT_BATCHES))
    # The restart's first batch has the watermark of the batches before it (wm 25, late
    # 15: i and j dropped), and timers armed before the restart fire after it.
    assert not {r[0] for r in theirs[3]} & {"i", "j"}
    assert ("c", "fire", 2, 25, ms(25), "[25]") in theirs[3]
    spark_values = _spark_state(spark, tmp_path / "cp-spark", "count")
    sk_values, sk_timers = _sk_state(spark, tmp_path / "root")
    assert {k: tuple(v) for k, v in sk_values.items()} == spark_values
    assert sk_timers == _spark_timers(spark, tmp_path / "cp-spark")


# -- seeded random timer operations -----------------------------------------------------------

OPS_OUT = "k string, what string, at long, wm long, timers string"
TIMER_OPS = 5


def _timer_batches(seed: int, batches: int, rows: int) -> list[list[tuple[str, int]]]:
    """``batches`` files of ``rows`` rows on random keys, event time moving forward about
    10 s a batch with rows up to 12 s behind (some late, some trailing the watermark)."""
    rng = random.Random(seed)
    return [
        [(rng.choice("abcde"), 10 * b + rng.randrange(-12, 8)) for _ in range(rows)]
        for b in range(batches)
    ]


TIMER_BATCHES = _timer_batches(20261128, 6, 14)


def _timer_op(k: str, t: int) -> int:
    """The operation of the row ``(k, t)``, the same on both engines."""
    return (t * 31 + ord(k)) % TIMER_OPS


def _on_row(k: str, t: int, timers: Any, register: Any, delete: Any) -> str:
    """Apply the row's operation to its key's timers (``timers()`` lists them, in ms);
    returns its name. Expiries are whole seconds after T0."""
    op = _timer_op(k, t)
    if op == 0:  # in the future, or already due when the row trails the watermark
        register(ms(t + 3))
    elif op == 1:  # behind the row: due at once unless the watermark is behind it
        register(ms(t - 2))
    elif op == 2:  # one an earlier row may have armed (or nothing to delete)
        delete(ms(t - 7))
    elif op == 3:
        for at in list(timers()):
            delete(at)
    else:  # the same timer twice: one timer
        register(ms(t + 3))
        register(ms(t + 3))
    return f"op{op}"


def _on_fire(expiry: int, timers: Any, register: Any, delete: Any) -> str:
    """What a firing timer does besides reporting: arm one 1 s later (maybe due in the same
    batch), delete the key's next other timer (maybe due too), or register itself again."""
    at = _seconds(expiry)
    if at % 3 == 0:
        register(ms(at + 1))
        return "fire+1"
    if at % 3 == 1:
        others = sorted(t for t in timers() if t != expiry)
        if others:
            delete(others[0])
        return "fire-next"
    register(expiry)
    return "fire-again"


def _listed(timers: Iterable[int]) -> str:
    return str(sorted(_seconds(t) for t in timers))


class SparkTimerOps(SparkProcessor):
    """Row operations on Spark's Row-based API, reporting the key's timers after each."""

    def init(self, handle: Any) -> None:
        self.handle = handle

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        h, wm = self.handle, timerValues.getCurrentWatermarkInMs()
        for t in sorted(r.t for r in rows):
            what = _on_row(key[0], t, h.listTimers, h.registerTimer, h.deleteTimer)
            yield Row(k=key[0], what=what, at=t, wm=wm, timers=_listed(h.listTimers()))

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Any:
        h, expiry = self.handle, expiredTimerInfo.getExpiryTimeInMs()
        seen = _listed(h.listTimers())
        what = _on_fire(expiry, h.listTimers, h.registerTimer, h.deleteTimer)
        wm = timerValues.getCurrentWatermarkInMs()
        yield Row(k=key[0], what=what, at=_seconds(expiry), wm=wm, timers=seen)
        yield Row(
            k=key[0], what="after", at=_seconds(expiry), wm=wm, timers=_listed(h.listTimers())
        )

    def close(self) -> None:
        pass


class SkTimerOps(StatefulProcessor):
    """The same on statekeeper's Row form."""

    rows = "row"

    def init(self, handle: Any) -> None:
        self.handle = handle

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        h, wm = self.handle, self.handle.timer_values.watermark_ms
        for t in sorted(r.t for r in rows):
            what = _on_row(key[0], t, h.list_timers, h.register_timer, h.delete_timer)
            yield (key[0], what, t, wm, _listed(h.list_timers()))

    def handle_expired_timer(self, key: Any, timer_values: Any, expired_timer_info: Any) -> Any:
        h, expiry = self.handle, expired_timer_info.get_expiry_time_in_ms()
        seen = _listed(h.list_timers())
        what = _on_fire(expiry, h.list_timers, h.register_timer, h.delete_timer)
        wm = timer_values.get_current_watermark_in_ms()
        yield (key[0], what, _seconds(expiry), wm, seen)
        yield (key[0], "after", _seconds(expiry), wm, _listed(h.list_timers()))


def test_random_timer_operations_agree_with_spark(spark: SparkSession, tmp_path: Path) -> None:
    """Seeded rows, each registering, deleting or clearing its key's event-time timers, and
    firing timers that arm or delete others: both engines report the same timers after every
    operation and fire the same ones, batch by batch (no no-data batches on either)."""
    write_batches(tmp_path / "in", TIMER_BATCHES)

    def spark_plan() -> DataFrame:
        df = stream(spark, tmp_path / "in").withWatermark("ts", "5 seconds")
        return df.groupBy("k").transformWithState(SparkTimerOps(), OPS_OUT, "Append", "EventTime")

    theirs = spark_tws(spark, tmp_path, "spark", spark_plan, no_data=False)
    ours_df = transform_with_state(
        stream(spark, tmp_path / "in"), keys="k", processor=SkTimerOps(),
        output_schema=OPS_OUT, checkpoint=str(tmp_path / "root"), name="ops", partitions=3,
        time_mode="event_time", event_time_column="ts", watermark_delay=5,
        config=StoreConfig(local_dir=str(tmp_path / "local")),
    )  # fmt: skip
    ours = run(ours_df, tmp_path, "sk")

    assert_agree(theirs, ours, len(TIMER_BATCHES))
    _, sk_timers = _sk_state(spark, tmp_path / "root")
    assert sk_timers == _spark_timers(spark, tmp_path / "cp-spark")
    # The seed covers what the test says: every row operation and every firing branch ran,
    # and rows were dropped as late.
    rows = [r for batch in theirs.values() for r in batch]
    whats = Counter(r[1] for r in rows)
    ops = {f"op{i}" for i in range(TIMER_OPS)}
    assert set(whats) == {*ops, "fire+1", "fire-next", "fire-again", "after"}
    read = sum(len(batch) for batch in TIMER_BATCHES)
    assert sum(whats[f"op{i}"] for i in range(TIMER_OPS)) < read
    # The edge cases of firing, on Spark: the due timers are fixed when firing starts.
    deleted_but_fired = armed_due_but_waited = 0
    for batch in theirs.values():
        fired = {(r[0], r[2]) for r in batch if r[1].startswith("fire")}
        for k, what, at, wm, seen in batch:
            if what == "fire-next" and len(json.loads(seen)) > 1:
                gone = min(t for t in json.loads(seen) if t != at)
                deleted_but_fired += gone <= _seconds(wm) and (k, gone) in fired
            if what == "fire+1" and at + 1 <= _seconds(wm):
                armed_due_but_waited += (k, at + 1) not in fired
    assert deleted_but_fired > 0  # a handler deleted another due timer: it still fired
    assert armed_due_but_waited > 0  # a handler armed a due timer: not fired in that batch
    # A timer that registers itself again is still deleted after its handler: the key's
    # first row of the next batch (unless it clears every timer) no longer lists it.
    checked = 0
    for b, batch in theirs.items():
        for k, what, at, _, _ in batch:
            later = sorted((r[2], r[1], r[4]) for r in theirs.get(b + 1, ()) if r[0] == k)
            first = next((r for r in later if r[1].startswith("op")), None)
            if what == "fire-again" and first is not None and first[1] != "op3":
                assert at not in json.loads(first[2]), (b, k, at)
                checked += 1
    assert checked > 0
