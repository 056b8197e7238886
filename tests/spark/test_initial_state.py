"""Initial state on Spark: applied once in micro-batch 0 (also when a task of batch 0 is
retried), never again on a restart, staged rows cleaned up once batch 1 is committed; bad
input refused before any state. Agreement with Spark's own operator is checked in
``test_timers_vs_spark.py``."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from pyspark import TaskContext
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from statekeeper import StoreConfig
from statekeeper.spark import StatefulProcessor, read_state, transform_with_state
from tests.spark.helpers import has_heartbeats, pickled_by_value, run_to_end

pytestmark = pytest.mark.spark

OUT = "k string, n long, seed long"


@pytest.fixture(scope="module", autouse=True)
def _pickled_by_value() -> Iterator[None]:
    """Spark's workers cannot import this test module: its processors travel by value."""
    with pickled_by_value(sys.modules[__name__]):
        yield


class PandasSeeded(StatefulProcessor):
    """A count of input rows, seeded with the sum of the key's initial ``v`` (pandas form)."""

    def init(self, handle: Any) -> None:
        self.state = handle.value_state("count")

    def handle_initial_state(self, key: Any, rows: Any, timer_values: Any) -> None:
        n, seed = self.state.get() or (0, 0)
        self.state.update((n, seed + int(rows["v"].sum())))

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        n, seed = self.state.get() or (0, 0)
        n += len(rows)
        self.state.update((n, seed))
        yield pd.DataFrame({"k": [key[0]], "n": [n], "seed": [seed]})


class FailsFirstAttempt(StatefulProcessor):
    """The same in the Row form; every task's first attempt of batch 0 fails after the
    initial state was applied (Spark retries it)."""

    rows = "row"

    def init(self, handle: Any) -> None:
        self.state = handle.value_state("count")

    def handle_initial_state(self, key: Any, rows: Any, timer_values: Any) -> None:
        n, seed = self.state.get() or (0, 0)
        self.state.update((n, seed + sum(r.v for r in rows)))

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        tc = TaskContext.get()
        assert tc is not None
        if tc.getLocalProperty("streaming.sql.batchId") == "0" and tc.attemptNumber() == 0:
            raise RuntimeError("first attempt of batch 0 fails on purpose")
        n, seed = self.state.get() or (0, 0)
        n += len(rows)
        self.state.update((n, seed))
        yield (key[0], n, seed)


def _write(folder: Path, index: int, keys: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{index}.tmp"
    tmp.write_text("".join(f'{{"k": "{k}"}}\n' for k in keys))
    tmp.rename(folder / f"part-{index:04d}.json")


def _query(
    spark: SparkSession, tmp: Path, processor: StatefulProcessor, initial: DataFrame
) -> DataFrame:
    (tmp / "in").mkdir(parents=True, exist_ok=True)
    stream = spark.readStream.schema("k string").option("maxFilesPerTrigger", 1)
    return transform_with_state(
        stream.json(str(tmp / "in")), keys="k", processor=processor, output_schema=OUT,
        checkpoint=str(tmp / "root"), name="ops", partitions=3, initial_state=initial,
        config=StoreConfig(local_dir=str(tmp / "local")),
    )  # fmt: skip


def _state(spark: SparkSession, root: Path, version: int) -> dict[str, tuple[int, int]]:
    rows = read_state(spark, str(root), "ops", version=version).collect()
    return {r["k"]: tuple(json.loads(r["value"])) for r in rows}


def _out(spark: SparkSession, sink: Path) -> set[tuple[str, int, int]]:
    return {(r["k"], r["n"], r["seed"]) for r in spark.read.parquet(str(sink)).collect()}


def test_a_restart_does_not_apply_the_initial_state_again(
    spark: SparkSession, tmp_path: Path
) -> None:
    initial = spark.createDataFrame([("a", 10), ("b", 5), ("a", 1)], "k string, v long")
    other = spark.createDataFrame([("a", 1000), ("c", 1000)], "k string, v long")
    _write(tmp_path / "in", 0, ["a", "d"])
    sink = tmp_path / "sink"  # one file sink across restarts (its log follows the batches)
    run_to_end(_query(spark, tmp_path, PandasSeeded(), initial), sink, tmp_path / "cp")
    first = {("a", 1, 11), ("d", 1, 0)}
    assert _out(spark, sink) == first
    assert _state(spark, tmp_path / "root", 1) == {"a": (1, 11), "b": (0, 5), "d": (1, 0)}

    # Restart at batch 1 with another initial state: staged (batch 0 might still re-run),
    # but batch 1 does not apply it
    _write(tmp_path / "in", 1, ["a", "b"])
    second_query = _query(spark, tmp_path, PandasSeeded(), other)
    assert has_heartbeats(second_query)  # batch 0 might still re-run
    run_to_end(second_query, sink, tmp_path / "cp")
    second = {("a", 2, 11), ("b", 1, 5)}
    assert _out(spark, sink) == first | second
    staged = tmp_path / "root" / "_initial" / "ops"
    assert any(p.suffix == ".arrow" for p in staged.rglob("*"))

    # Once batch 1 is committed everywhere, batch 0 can no longer run: nothing is staged,
    # what was staged is deleted
    _write(tmp_path / "in", 2, ["c"])
    third = _query(spark, tmp_path, PandasSeeded(), other)
    assert not has_heartbeats(third)  # no initial state left to apply, no TTL, no time
    run_to_end(third, sink, tmp_path / "cp")
    assert _out(spark, sink) == first | second | {("c", 1, 0)}
    assert not any(p.is_file() for p in staged.rglob("*"))
    assert _state(spark, tmp_path / "root", 3) == {
        "a": (2, 11), "b": (1, 5), "c": (1, 0), "d": (1, 0)
    }  # fmt: skip


def test_a_retried_batch_0_applies_the_initial_state_once(
    spark: SparkSession, tmp_path: Path
) -> None:
    initial = spark.createDataFrame([("a", 10), ("b", 5), ("a", 1)], "k string, v long")
    _write(tmp_path / "in", 0, ["a", "b", "c"])
    out = _query(spark, tmp_path, FailsFirstAttempt(), initial)
    run_to_end(out, tmp_path / "s0", tmp_path / "cp")
    assert _out(spark, tmp_path / "s0") == {("a", 1, 11), ("b", 1, 5), ("c", 1, 0)}
    assert _state(spark, tmp_path / "root", 1) == {"a": (1, 11), "b": (1, 5), "c": (1, 0)}


def test_bad_initial_state_is_refused_before_any_state(spark: SparkSession, tmp_path: Path) -> None:
    cases = [
        (spark.createDataFrame([("a", 1)], "key string, v long"), "found none"),
        (spark.createDataFrame([(1, 1)], "k int, v long"), r"expected k string \(found int\)"),
        (spark.readStream.format("rate").load(), "must be a batch DataFrame"),
    ]
    for initial, message in cases:
        with pytest.raises(ValueError, match=message):
            _query(spark, tmp_path, PandasSeeded(), initial)

    class NoHook(StatefulProcessor):
        def init(self, handle: Any) -> None:
            pass

        def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
            return iter(())

    good = spark.createDataFrame([("a", 1)], "k string, v long")
    with pytest.raises(ValueError, match="does not define handle_initial_state"):
        _query(spark, tmp_path, NoHook(), good)
    assert not (tmp_path / "root").exists()


class SeededWithDueTimer(StatefulProcessor):
    """:class:`FailsFirstAttempt`'s count and seed, failing the first attempt of batch 1
    instead; the initial state also registers a timer due at once, which emits ``-100``."""

    rows = "row"

    def init(self, handle: Any) -> None:
        self.handle = handle
        self.state = handle.value_state("count")

    def handle_initial_state(self, key: Any, rows: Any, timer_values: Any) -> None:
        n, seed = self.state.get() or (0, 0)
        self.state.update((n, seed + sum(r.v for r in rows)))
        self.handle.register_timer(timer_values.get_current_processing_time_in_ms())

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        tc = TaskContext.get()
        assert tc is not None
        if tc.getLocalProperty("streaming.sql.batchId") == "1" and tc.attemptNumber() == 0:
            raise RuntimeError("first attempt of batch 1 fails on purpose")
        n, seed = self.state.get() or (0, 0)
        self.state.update((n + len(rows), seed))
        yield (key[0], n + len(rows), seed)

    def handle_expired_timer(self, key: Any, timer_values: Any, info: Any) -> Iterator[Any]:
        yield (key[0], -100, (self.state.get() or (0, 0))[1])


def test_an_initial_state_is_applied_when_batch_0_ran_no_task_of_the_operator(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Found by review: the operator's output unioned with a second stream that alone had
    data in micro-batch 0, so Spark ran no task of the operator there. Every later batch
    refused the gap after version 0 (the initial state would be lost), and the query could
    never run again. The operator's first task now applies the initial state as batch 0.
    The timers it makes due fire in that task's own batch, so a retry of the task emits
    them again (found by a second review: fired in the late batch 0, they were lost)."""
    initial = spark.createDataFrame([("a", 10), ("b", 5), ("a", 1)], "k string, v long")
    (tmp_path / "in").mkdir()
    (tmp_path / "other").mkdir()
    other = (
        spark.readStream.schema("k string").json(str(tmp_path / "other"))
        .select("k", F.lit(-1).cast("long").alias("n"), F.lit(-1).cast("long").alias("seed"))
    )  # fmt: skip
    out = transform_with_state(
        spark.readStream.schema("k string").json(str(tmp_path / "in")), keys="k",
        processor=SeededWithDueTimer(), output_schema=OUT, checkpoint=str(tmp_path / "root"),
        name="ops", partitions=3, initial_state=initial, time_mode="processing_time",
        config=StoreConfig(local_dir=str(tmp_path / "local")),
    ).unionByName(other)  # fmt: skip
    query = (
        out.writeStream.format("parquet")
        .option("path", str(tmp_path / "sink"))
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(processingTime="1 second")
        .start()
    )
    try:
        _write(tmp_path / "other", 0, ["x"])
        query.processAllAvailable()
        _write(tmp_path / "in", 0, ["a", "c"])
        query.processAllAvailable()
        assert query.exception() is None
    finally:
        query.stop()
    assert [p["batchId"] for p in query.recentProgress] == [0, 1]
    assert _out(spark, tmp_path / "sink") == {
        ("x", -1, -1), ("a", 1, 11), ("c", 1, 0), ("a", -100, 11), ("b", -100, 5)
    }  # fmt: skip
    rows = read_state(spark, str(tmp_path / "root"), "ops", version=1).collect()
    assert {r["k"]: tuple(json.loads(r["value"])) for r in rows if r["state"] == "count"} == {
        "a": (0, 11), "b": (0, 5)
    }  # fmt: skip


def test_a_query_defined_twice_starts_from_its_first_definition(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Found by review: each definition staged its initial state after deleting every
    earlier one's, so a query defined again (a notebook cell run twice, a definition for
    ``explain``) and started from its first DataFrame failed batch 0 on a missing blob."""
    initial = spark.createDataFrame([("a", 10), ("b", 5)], "k string, v long")
    first = _query(spark, tmp_path, PandasSeeded(), initial)
    _query(spark, tmp_path, PandasSeeded(), initial)
    _write(tmp_path / "in", 0, ["a"])
    run_to_end(first, tmp_path / "sink", tmp_path / "cp")
    assert _out(spark, tmp_path / "sink") == {("a", 1, 10)}
    # Staged rows of the two newest definitions are kept, older ones deleted
    _query(spark, tmp_path, PandasSeeded(), initial)
    staged = tmp_path / "root" / "_initial" / "ops"
    kept = sorted(p.name for p in staged.iterdir() if any(p.iterdir()))
    assert [int(g) for g in kept] == [2, 3]
