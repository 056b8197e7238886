"""Timers, event time and TTL on Spark: timers fire in partitions without input, late rows are
dropped, a restart on an empty local dir keeps every timer, event-time TTL expires entries by
the watermark in partitions without input; bad arguments fail early."""

from __future__ import annotations

import datetime as dt
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark import cloudpickle
from pyspark.sql import DataFrame, SparkSession

from statekeeper import StateBackend, StoreConfig
from statekeeper.errors import StateKeeperError
from statekeeper.keyed import iter_timers
from statekeeper.spark import StatefulProcessor, batch_metrics, read_state, transform_with_state
from tests.spark.helpers import T0, has_heartbeats, run_to_end, write_event_files
from tests.spark.processors import EventSessions

SCHEMA = "k string, ts timestamp"
OUT = "k string, n long, what string, batch long"


def _stream(spark: SparkSession, folder: Path) -> DataFrame:
    folder.mkdir(parents=True, exist_ok=True)
    return spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(folder))


def _sessions(spark: SparkSession, tmp: Path, root: Path, local: str) -> DataFrame:
    return transform_with_state(
        _stream(spark, tmp / "in"), keys="k", processor=EventSessions(), output_schema=OUT,
        checkpoint=str(root), name="sessions", partitions=4, time_mode="event_time",
        event_time_column="ts", watermark_delay=5,
        config=StoreConfig(local_dir=str(tmp / local)),
    )  # fmt: skip


def _rows(spark: SparkSession, sink: Path) -> list[tuple[Any, ...]]:
    return sorted(
        (r["batch"], r["what"], r["k"], r["n"]) for r in spark.read.parquet(str(sink)).collect()
    )


@pytest.mark.spark
def test_event_time_timers_fire_without_input_and_survive_a_restart(
    spark: SparkSession, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    keys = [f"u{i}" for i in range(12)]  # spread over the 4 partitions
    # batch 0: every key at t=0..11; batches 1-4: only "z", moving event time on
    write_event_files(
        tmp_path / "in", [[(k, i) for i, k in enumerate(keys)], [("z", 12)], [("z", 19)]]
    )
    run_to_end(_sessions(spark, tmp_path, root, "local1"), tmp_path / "sink", tmp_path / "cp")
    timers = _timers(root, tmp_path / "reader1")
    # watermark of batch 2 = 12 - 5 = 7 s: u0 (timer at 10 s) .. none yet; all still armed
    assert len(timers) == len(keys) + 1
    # A restart with an empty local dir: every timer is restored from the root. A row of
    # u0 at 3 s in batch 4 is late (watermark 25 s): dropped, u0 does not reopen.
    shutil.rmtree(tmp_path / "local1")
    write_event_files(
        tmp_path / "in", [[("z", 30)], [("z", 100), ("u0", 3)], [("z", 101)]], start=3
    )
    run_to_end(_sessions(spark, tmp_path, root, "local2"), tmp_path / "sink", tmp_path / "cp")
    rows = _rows(spark, tmp_path / "sink")
    closed = {(k, b) for b, what, k, _ in rows if what == "closed"}
    # batch 3 sees watermark 19 - 5 = 14 s: the timers of u0..u4 (10..14 s) fire; batch 4
    # (watermark 25 s) those of u5..u11; z is re-armed by each of its rows, never due
    assert {k for k, b in closed if b == 3} == {"u0", "u1", "u2", "u3", "u4"}
    assert {k for k, b in closed if b == 4} == {f"u{i}" for i in range(5, 12)}
    assert len(closed) == len(keys)
    assert [k for b, what, k, _ in rows if what == "open" and b > 0] == ["z"] * 5
    assert all(n == 1 for b, what, k, n in rows if what == "closed" and k != "z")
    left = _timers(root, tmp_path / "reader2")
    assert [(t.key, t.expiry_ms) for t in left] == [(("z",), _ms(111))]
    # read_state shows the timer that is left, as a row of state "$timer".
    timer_rows = [
        r for r in read_state(spark, str(root), "sessions").collect() if r["state"] == "$timer"
    ]
    assert [(r["k"], int(r["entry"]), r["value"]) for r in timer_rows] == [("z", _ms(111), None)]
    assert timer_rows[0]["expires_at"].timestamp() * 1000 == _ms(111)
    # The per-batch metrics count the late row and the timers that fired.
    metrics = [batch_metrics(str(root), "sessions", b) for b in (3, 4)]
    assert [(m.late_rows, m.timers_fired) for m in metrics if m is not None] == [(0, 5), (1, 7)]


def _timers(root: Path, local: Path) -> list[Any]:
    found = []
    with StateBackend(str(root), config=StoreConfig(local_dir=str(local))) as backend:
        for partition in range(4):
            with backend.open("sessions", partition) as store:
                found += list(iter_timers(store))
    return found


def _ms(seconds: int) -> int:
    return int((T0 + dt.timedelta(seconds=seconds)).timestamp() * 1000)


@pytest.mark.spark
def test_bad_time_arguments_fail_before_any_state(spark: SparkSession, tmp_path: Path) -> None:
    df = _stream(spark, tmp_path / "in")
    root = tmp_path / "root"
    base = dict(keys="k", processor=EventSessions(), output_schema=OUT, checkpoint=str(root),
                name="s", partitions=2)  # fmt: skip
    with pytest.raises(ValueError, match="'nope' is not in the DataFrame"):
        transform_with_state(df, **base, time_mode="event_time", event_time_column="nope")
    with pytest.raises(ValueError, match="must be a timestamp column, found string"):
        transform_with_state(df, **base, time_mode="event_time", event_time_column="k")
    with pytest.raises(ValueError, match="watermark_delay must be 0 or more"):
        transform_with_state(
            df, **base, time_mode="event_time", event_time_column="ts", watermark_delay=-1
        )
    with pytest.raises(ValueError, match="time_mode must be None"):
        transform_with_state(df, **base, time_mode="wall_clock")
    assert not root.exists()


class Remember(StatefulProcessor):
    """Keeps each key's latest event time for 10 s of event time (``ttl_on="event_time"``)."""

    rows = "row"

    def init(self, handle: Any) -> None:
        self.last = handle.value_state("last", ttl=10, ttl_on="event_time")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        self.last.update(max(int(r.ts.timestamp()) for r in rows))
        return iter(())


@pytest.fixture
def _remember_by_value() -> Iterator[None]:
    """Spark's workers cannot import this test module: its processor travels by value."""
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    yield
    cloudpickle.unregister_pickle_by_value(module)


@pytest.mark.spark
@pytest.mark.usefixtures("_remember_by_value")
def test_event_time_ttl_expires_by_the_watermark_in_partitions_without_input(
    spark: SparkSession, tmp_path: Path
) -> None:
    keys = [f"u{i}" for i in range(12)]  # spread over the 4 partitions
    # batch 0 stamps every entry with its largest event time, 11 s: expiry 21 s. Then only
    # z: watermarks 11 s (batch 1), 15 s (batch 2), 30 s (batch 3)
    batches = [[(k, i) for i, k in enumerate(keys)], [("z", 15)], [("z", 30)], [("z", 31)]]
    write_event_files(tmp_path / "in", batches)
    root = tmp_path / "root"
    out = transform_with_state(
        _stream(spark, tmp_path / "in"), keys="k", processor=Remember(), output_schema=OUT,
        checkpoint=str(root), name="ttl", partitions=4, time_mode="event_time",
        event_time_column="ts", config=StoreConfig(local_dir=str(tmp_path / "local")),
    )  # fmt: skip
    run_to_end(out, tmp_path / "sink", tmp_path / "cp")

    def state(version: int) -> dict[str, tuple[int, int]]:
        rows = read_state(spark, str(root), "ttl", version=version).collect()
        t0 = T0.timestamp()
        return {r["k"]: (r["partition"], int(r["expires_at"].timestamp() - t0)) for r in rows}

    before = state(3)  # after batch 2: watermark 15 s, nothing expired
    assert {k: at for k, (_, at) in before.items()} == {**dict.fromkeys(keys, 21), "z": 40}
    z_partition = before["z"][0]
    idle = {p for k, (p, _) in before.items() if k != "z"} - {z_partition}
    assert idle, "every key landed in z's partition: the test lost its point"
    assert state(4) == {"z": (z_partition, 41)}  # batch 3 (watermark 30 s) expired all u*
    metrics = [batch_metrics(str(root), "ttl", b) for b in range(4)]
    assert [m.expired for m in metrics if m is not None] == [0, 0, 0, len(keys)]


class Expiring(StatefulProcessor):
    """Counts each key's rows in a value state with a 2 s TTL in processing time (in an
    operator without a time mode: Spark refuses that, we allow it)."""

    rows = "row"

    def init(self, handle: Any) -> None:
        self.count = handle.value_state("count", ttl=2)

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        self.count.update((self.count.get() or 0) + len(rows))
        return iter(())


@pytest.mark.spark
@pytest.mark.usefixtures("_remember_by_value")
def test_processing_time_ttl_expires_in_partitions_without_input(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Every partition gets the batch clock (on the heartbeats alone), so TTL expires where
    no row arrives too, also in an operator without a time mode (issue 12 item 6)."""
    keys = [f"u{i}" for i in range(12)]  # spread over the 4 partitions
    root = tmp_path / "root"

    def run(batches: list[list[tuple[str, int]]], start: int) -> None:
        write_event_files(tmp_path / "in", batches, start=start)
        out = transform_with_state(
            _stream(spark, tmp_path / "in"), keys="k", processor=Expiring(),
            output_schema=OUT, checkpoint=str(root), name="expiring", partitions=4,
            config=StoreConfig(local_dir=str(tmp_path / "local")),
        )  # fmt: skip
        run_to_end(out, tmp_path / "sink", tmp_path / "cp")

    run([[(k, 0) for k in [*keys, "z"]]], 0)
    before = {r["k"]: r["partition"] for r in read_state(spark, str(root), "expiring", 1).collect()}
    assert set(before) == {*keys, "z"}
    idle = {before[k] for k in keys} - {before["z"]}
    assert idle, "every key landed in z's partition: the test lost its point"
    time.sleep(3)  # beyond the TTL of every entry written by batch 0
    run([[("z", 1)]], 1)
    after = read_state(spark, str(root), "expiring", 2).collect()
    assert [(r["k"], r["value"]) for r in after] == [("z", "1")]  # z's entry expired too
    metric = batch_metrics(str(root), "expiring", 1)
    assert metric is not None
    assert metric.expired == len(keys)  # z's expired entry was replaced by its new write


# -- which operators need heartbeats -------------------------------------------------------


class Stamping(StatefulProcessor):
    """Counts each key's rows, no TTL; outputs the batch timestamp it saw."""

    rows = "row"

    def init(self, handle: Any) -> None:
        self.handle = handle
        self.count = handle.value_state("count")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        n = (self.count.get() or 0) + len(rows)
        self.count.update(n)
        yield (key[0], n, str(self.handle.batch_timestamp_ms), self.handle.batch_id)


def test_only_a_clock_in_idle_partitions_needs_heartbeats() -> None:
    from statekeeper.spark._time import TimeSpec, needs_heartbeats

    none = TimeSpec()
    assert not needs_heartbeats({"count": None}, none, initial_state=False)
    assert not needs_heartbeats({}, none, initial_state=False)
    assert needs_heartbeats({"count": None, "seen": 2000}, none, initial_state=False)  # a TTL
    assert needs_heartbeats(None, none, initial_state=False)  # init could not tell
    assert needs_heartbeats({}, none, initial_state=True)
    assert needs_heartbeats({}, TimeSpec("processing_time"), initial_state=False)
    assert needs_heartbeats({}, TimeSpec("event_time", "ts"), initial_state=False)


class BadlyDeclared(Stamping):
    def init(self, handle: Any) -> None:
        self.count = handle.value_state("count", ttl=-5)


class DeclaredTwice(Stamping):
    def init(self, handle: Any) -> None:
        self.count = handle.value_state("count")
        self.counts = handle.map_state("count")


@pytest.mark.spark
@pytest.mark.parametrize(
    ("processor", "error", "message"),
    [
        # a timer handler without a time mode
        (EventSessions(), ValueError, "EventSessions defines handle_expired_timer"),
        # a malformed declaration in init (checked on a copy, on the driver)
        (BadlyDeclared(), ValueError, "ttl must be a positive duration, got -5"),
        # one name declared as two kinds of state (likewise)
        (DeclaredTwice(), StateKeeperError, "'count' is already declared as a value state"),
    ],
)
def test_a_wrong_processor_is_refused_before_the_root_is_touched(
    spark: SparkSession,
    tmp_path: Path,
    processor: StatefulProcessor,
    error: type[Exception],
    message: str,
) -> None:
    with pytest.raises(error, match=message):
        transform_with_state(
            _stream(spark, tmp_path / "in"), keys="k", processor=processor,
            output_schema=OUT, checkpoint=str(tmp_path / "root"), name="s", partitions=2,
        )  # fmt: skip
    assert not (tmp_path / "root").exists()


@pytest.mark.spark
@pytest.mark.usefixtures("_remember_by_value")
def test_an_operator_without_ttl_or_time_has_no_heartbeats_and_every_partition_commits(
    spark: SparkSession, tmp_path: Path
) -> None:
    """No heartbeat pass in the plan; the timestamp rides on every row, and a partition
    without input still commits its version (it learns its partition from its task id)."""
    root = tmp_path / "root"

    def plan(processor: StatefulProcessor) -> DataFrame:
        return transform_with_state(
            _stream(spark, tmp_path / "in"), keys="k", processor=processor,
            output_schema="k string, n long, now string, batch long", checkpoint=str(root),
            name=type(processor).__name__.lower(), partitions=4,
            config=StoreConfig(local_dir=str(tmp_path / "local")),
        )  # fmt: skip

    assert has_heartbeats(plan(Expiring()))  # the probe is what differs
    out = plan(Stamping())
    assert not has_heartbeats(out)
    write_event_files(tmp_path / "in", [[("a", 0), ("b", 1)], [("a", 2)]])
    started_ms = time.time() * 1000
    run_to_end(out, tmp_path / "sink", tmp_path / "cp")
    rows = spark.read.parquet(str(tmp_path / "sink")).collect()
    counted = sorted((r["batch"], r["k"], r["n"]) for r in rows)
    assert counted == [(0, "a", 1), (0, "b", 1), (1, "a", 2)]
    # The batch timestamp, from the column every row carries now.
    assert all(r["now"] != "None" and int(r["now"]) >= started_ms - 1000 for r in rows)
    with StateBackend(str(root)) as backend:
        assert [backend.versions("stamping", p)[-1] for p in range(4)] == [2, 2, 2, 2]
