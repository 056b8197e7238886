"""Differential test of the pandas form: the same processor on Spark's own
``transformWithStateInPandas`` and on statekeeper's pandas form, over the same file, in a
session time zone that is not UTC (see :mod:`tests.spark.differential`).

The processor describes the pandas values it receives (each column's values and their
Python types; the dtype of timestamp columns) and yields values of the kinds a pandas
processor yields: a naive timestamp, an input timestamp passed back, a map and a struct
built from dicts. Both must agree on all of it: what is left out by design (Spark's pandas
form widens ``int`` and ``float`` columns to 64 bits) is the dtype of other columns, see
:mod:`statekeeper.keyed._pandas`. Then the event-time sessions of
:mod:`tests.spark.test_timers_vs_spark` run in the pandas form on both: timers, watermarks
and late rows agree batch by batch there too; and ``handle_initial_state`` gets a key's
initial rows with the same values as Spark's ``handleInitialState``.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections import Counter
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.stateful_processor import StatefulProcessor as SparkProcessor

from statekeeper import StoreConfig
from statekeeper.spark import StatefulProcessor, transform_with_state
from tests.spark import differential, test_timers_vs_spark
from tests.spark.differential import ms, run, spark_tws, stream, write_batches
from tests.spark.helpers import pickled_by_value
from tests.spark.test_timers_vs_spark import (
    EVENT_BATCHES,
    EVENT_OUT,
    STATE,
    _arm,
    _fire,
    _seconds,
)

pytestmark = pytest.mark.spark

ZONE = "America/New_York"
SCHEMA = (
    "k string, at timestamp, ntz timestamp_ntz, m map<string,int>, st struct<a:int,b:string>, "
    "n long, day date, amount decimal(10,2)"
)
OUT = (
    "k string, seen string, naive timestamp, back timestamp, m map<string,int>, "
    "st struct<a:int,b:string>"
)
NOON_UTC = dt.datetime(2024, 1, 1, 12, tzinfo=dt.UTC)  # 07:00 in New York
ROWS = [
    ("a", NOON_UTC, dt.datetime(2024, 1, 1, 1, 2), {"x": 1}, (1, "s"), 5, dt.date(2024, 1, 1),
     Decimal("1.25")),
    ("a", None, None, None, None, None, None, None),
    ("b", dt.datetime(2024, 7, 1, 12, tzinfo=dt.UTC), None, {}, (None, None), 7, None,
     Decimal("2.00")),
]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _pickled_by_value() -> Iterator[None]:
    """Spark's workers cannot import the test modules: the processors travel by value."""
    with (
        pickled_by_value(sys.modules[__name__]),
        pickled_by_value(differential),
        pickled_by_value(test_timers_vs_spark),
    ):
        yield


def _describe(rows: Any) -> str:
    """The pandas values of one key's rows, as one comparable string."""
    seen = {}
    for column in rows.columns:
        values = sorted(f"{v!r}:{type(v).__name__}" for v in rows[column].tolist())
        dtype = str(rows[column].dtype) if column in ("at", "ntz") else ""
        seen[column] = [dtype, values]
    return json.dumps(seen, sort_keys=True)


def _answer(key: str, rows: Any) -> Any:
    first = rows.sort_values("at")["at"].iloc[0]
    return pd.DataFrame(
        {
            "k": [key],
            "seen": [_describe(rows)],
            "naive": [pd.Timestamp("2024-01-01 12:00")],  # wall-clock time in the session zone
            "back": [first],
            "m": [{"a": 1, "b": None}],
            "st": [{"a": 2, "b": "t"}],
        }
    )


class SparkDescribe(SparkProcessor):
    def init(self, handle: Any) -> None:
        pass

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        yield _answer(key[0], pd.concat(list(rows), ignore_index=True))

    def close(self) -> None:
        pass


class SkDescribe(StatefulProcessor):
    def init(self, handle: Any) -> None:
        pass

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        yield _answer(key[0], rows.reset_index(drop=True))


@pytest.fixture
def new_york(spark: SparkSession) -> Iterator[None]:
    before = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", ZONE)
    try:
        yield
    finally:
        spark.conf.set("spark.sql.session.timeZone", before)


@pytest.mark.usefixtures("new_york")
def test_pandas_values_agree_with_spark_both_ways(spark: SparkSession, tmp_path: Path) -> None:
    spark.createDataFrame(ROWS, SCHEMA).write.parquet(str(tmp_path / "in"))

    def source() -> DataFrame:
        return spark.readStream.schema(SCHEMA).parquet(str(tmp_path / "in"))

    def spark_plan() -> DataFrame:
        return (
            source().groupBy("k").transformWithStateInPandas(SparkDescribe(), OUT, "Append", "None")
        )

    theirs = spark_tws(spark, tmp_path, "spark", spark_plan, no_data=False)
    ours_df = transform_with_state(
        source(), keys="k", processor=SkDescribe(), output_schema=OUT,
        checkpoint=str(tmp_path / "root"), name="ops", partitions=2,
        config=StoreConfig(local_dir=str(tmp_path / "local")),
    )  # fmt: skip
    ours = run(ours_df, tmp_path, "sk")

    assert sorted(theirs) == sorted(ours) == [0]
    assert ours[0] == theirs[0]
    # What Spark does, so that the test keeps its point: a timestamp arrives naive, as
    # wall-clock time in New York, and a naive one written is read in New York too.
    rows = {row[0]: row for row in theirs[0]}
    seen_a = json.loads(rows["a"][1])
    assert seen_a["at"] == [
        "datetime64[ns]",
        ["NaT:NaTType", "Timestamp('2024-01-01 07:00:00'):Timestamp"],
    ]
    assert seen_a["m"][1] == ["None:NoneType", "{'x': 1}:dict"]
    assert seen_a["st"][1] == ["None:NoneType", "{'a': 1, 'b': 's'}:dict"]
    naive, back = rows["a"][2], rows["a"][3]
    assert naive - back == dt.timedelta(hours=5)  # 12:00 New York is 17:00 UTC, back 12:00 UTC


# -- timers: the event-time sessions of test_timers_vs_spark, in the pandas form -------------


class SparkPandasSessions(SparkProcessor):
    def init(self, handle: Any) -> None:
        self.handle = handle
        self.state = handle.getValueState("count", STATE)

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        times = [int(t) for frame in rows for t in frame["t"]]
        h = self.handle
        n = _arm(self.state, times, h.listTimers(), h.deleteTimer, h.registerTimer)
        wm = timerValues.getCurrentWatermarkInMs()
        yield _session_row(key[0], "in", n, max(times), wm, "")

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Any:
        expiry = expiredTimerInfo.getExpiryTimeInMs()
        n, seen = _fire(self.state, self.handle.listTimers(), expiry)
        wm = timerValues.getCurrentWatermarkInMs()
        yield _session_row(key[0], "fire", n, _seconds(expiry), wm, seen)

    def close(self) -> None:
        pass


class SkPandasSessions(StatefulProcessor):
    def init(self, handle: Any) -> None:
        self.handle = handle
        self.state = handle.value_state("count")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        times = [int(t) for t in rows["t"]]
        h = self.handle
        n = _arm(self.state, times, h.list_timers(), h.delete_timer, h.register_timer)
        wm = self.handle.timer_values.watermark_ms
        yield _session_row(key[0], "in", n, max(times), wm, "")

    def handle_expired_timer(self, key: Any, timer_values: Any, expired_timer_info: Any) -> Any:
        expiry = expired_timer_info.get_expiry_time_in_ms()
        n, seen = _fire(self.state, self.handle.list_timers(), expiry)
        wm = timer_values.get_current_watermark_in_ms()
        yield _session_row(key[0], "fire", n, _seconds(expiry), wm, seen)


def _session_row(k: str, what: str, n: int, at: int, wm: int, timers: str) -> Any:
    return pd.DataFrame({"k": [k], "what": [what], "n": [n], "at": [at], "wm": [wm],
                         "timers": [timers]})  # fmt: skip


def test_pandas_event_time_timers_agree_with_spark(spark: SparkSession, tmp_path: Path) -> None:
    batches = EVENT_BATCHES
    write_batches(tmp_path / "in", batches)
    write_batches(tmp_path / "in-sk", [*batches, [("zz", 36)]])  # see test_timers_vs_spark

    def spark_plan() -> DataFrame:
        df = stream(spark, tmp_path / "in").withWatermark("ts", "5 seconds")
        return df.groupBy("k").transformWithStateInPandas(
            SparkPandasSessions(), EVENT_OUT, "Append", "EventTime"
        )

    theirs = spark_tws(spark, tmp_path, "spark", spark_plan)
    ours_df = transform_with_state(
        stream(spark, tmp_path / "in-sk"), keys="k", processor=SkPandasSessions(),
        output_schema=EVENT_OUT, checkpoint=str(tmp_path / "root"), name="ops",
        partitions=3, time_mode="event_time", event_time_column="ts", watermark_delay=5,
        config=StoreConfig(local_dir=str(tmp_path / "local")),
    )  # fmt: skip
    ours = run(ours_df, tmp_path, "sk")

    last = len(batches)
    assert sorted(theirs) == sorted(ours) == list(range(last + 1))
    for b in range(last):
        assert ours[b] == theirs[b], f"micro-batch {b}"
    assert ("b", "fire", 3, 24, ms(25), "[24]") in theirs[3]  # the close, after the warning
    assert ours[last] - theirs[last] == Counter({("zz", "in", 1, 36, ms(35), ""): 1})
    assert theirs[last] - ours[last] == Counter()


# -- initial state: a key's initial rows as one DataFrame, with the same values ---------------


def _initial_rows(frame: Any) -> str:
    """The initial rows of a key as seen: values with their types, sorted."""
    return json.dumps(sorted(f"{v!r}" for c in ("v", "at") for v in frame[c].tolist()))


class SparkSeeded(SparkProcessor):
    def init(self, handle: Any) -> None:
        self.seed = handle.getValueState("seed", "seen string")

    def handleInitialState(self, key: Any, initialState: Any, timerValues: Any) -> None:
        old = self.seed.get()
        self.seed.update(((old[0] if old else "") + _initial_rows(initialState),))

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        n, old = sum(len(frame) for frame in rows), self.seed.get()
        yield pd.DataFrame({"k": [key[0]], "n": [n], "seed": [old[0] if old else None]})

    def close(self) -> None:
        pass


class SkSeeded(StatefulProcessor):
    def init(self, handle: Any) -> None:
        self.seed = handle.value_state("seed")

    def handle_initial_state(self, key: Any, rows: Any, timer_values: Any) -> None:
        self.seed.update((self.seed.get() or "") + _initial_rows(rows))

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        yield pd.DataFrame({"k": [key[0]], "n": [len(rows)], "seed": [self.seed.get()]})


@pytest.mark.usefixtures("new_york")
def test_pandas_initial_state_agrees_with_spark(spark: SparkSession, tmp_path: Path) -> None:
    spark.createDataFrame([("a", 1), ("b", 2), ("e", 3)], "k string, v long").write.parquet(
        str(tmp_path / "in")
    )
    initial = spark.createDataFrame(
        [("a", 10, NOON_UTC), ("a", None, None), ("b", 5, NOON_UTC), ("c", 7, None)],
        "k string, v long, at timestamp",
    )
    out = "k string, n long, seed string"

    def source() -> DataFrame:
        return spark.readStream.schema("k string, v long").parquet(str(tmp_path / "in"))

    def spark_plan() -> DataFrame:
        return (
            source()
            .groupBy("k")
            .transformWithStateInPandas(
                SparkSeeded(), out, "Append", "None", initialState=initial.groupBy("k")
            )
        )

    theirs = spark_tws(spark, tmp_path, "spark", spark_plan, no_data=False)
    ours_df = transform_with_state(
        source(), keys="k", processor=SkSeeded(), output_schema=out,
        checkpoint=str(tmp_path / "root"), name="ops", partitions=2, initial_state=initial,
        config=StoreConfig(local_dir=str(tmp_path / "local")),
    )  # fmt: skip
    ours = run(ours_df, tmp_path, "sk")

    assert sorted(theirs) == sorted(ours) == [0]
    assert ours[0] == theirs[0]
    # a's rows hold a null: its v is float64 there, b's stays an integer; times are naive
    seeds = {row[0]: row[2] for row in theirs[0]}
    noon = "Timestamp('2024-01-01 07:00:00')"
    assert seeds["a"] == json.dumps(sorted(["10.0", "nan", "NaT", noon]))
    assert seeds["b"] == json.dumps(sorted(["5", noon]))
    assert seeds["e"] is None
