"""A foreachBatch sink with two actions over the micro-batch (issue 11: re-runs are cheap),
or with one that reads only part of it.

The plan ends with a shuffle (the output stage boundary of ``transform_with_state``), so the
second action reuses the stateful stage's shuffle output: the stateful tasks run once per
micro-batch, nothing is restored or committed twice, and every row counts once. (A task that
does run again, a retry, steps its working copy back one commit: tests/store/test_step_back.)
An action that stops reading early (``first()``) still runs every stateful task to its
commit: the stage before the boundary always runs whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pyspark import TaskContext
from pyspark.sql import SparkSession

from statekeeper import StoreConfig
from statekeeper.reports import read_reports
from statekeeper.spark import read_state, transform_with_state
from statekeeper.storage import open_blob_store
from tests.spark.helpers import (
    OUTPUT_SCHEMA,
    batch_totals,
    make_input,
    read_stream,
    state_totals,
    write_files,
)
from tests.spark.processors import RunningCountSum


class _LoggedTasks(RunningCountSum):
    """Appends a line to ``log`` each time a task initializes the processor (not when the
    driver does, once, to learn its declarations)."""

    def __init__(self, log: str) -> None:
        self.log = log

    def init(self, handle: Any) -> None:
        if TaskContext.get() is not None:
            with open(self.log, "a") as f:
                f.write("task\n")
        super().init(handle)


pytestmark = pytest.mark.spark

NAME = "twice"
PARTITIONS = 2


def _run(spark: SparkSession, tmp_path: Path, processor: Any, sink: Any) -> int:
    """Three input files through ``processor`` into the foreachBatch ``sink``, to the end
    (state under ``tmp_path / "state"``); the number of micro-batches."""
    batches = make_input(seed=7, files=3, rows=20, keys=6)
    write_files(tmp_path / "in", batches)
    transformed = transform_with_state(
        read_stream(spark, tmp_path / "in"), "k", processor, OUTPUT_SCHEMA,
        str(tmp_path / "state"), NAME, PARTITIONS,
        config=StoreConfig(local_dir=str(tmp_path / "local")),
    )  # fmt: skip
    query = (
        transformed.writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(180)
    assert query.exception() is None
    return len(batches)


def test_two_actions_per_batch_run_the_stateful_tasks_once(
    spark: SparkSession, tmp_path: Path
) -> None:
    root, out = str(tmp_path / "state"), str(tmp_path / "out")
    counted: list[int] = []

    def sink(batch: Any, batch_id: int) -> None:
        counted.append(batch.count())  # the first action: runs the stateful tasks
        batch.write.mode("append").parquet(out)  # the second: runs them again

    batches = _run(spark, tmp_path, _LoggedTasks(str(tmp_path / "tasks.log")), sink)
    assert len(counted) == batches

    assert state_totals(read_state(spark, root, NAME)) == batch_totals(spark, tmp_path / "in")
    tasks = (tmp_path / "tasks.log").read_text().splitlines()
    assert len(tasks) == batches * PARTITIONS  # not twice that
    blobs = open_blob_store(root)
    try:
        for batch_id in range(batches):
            reports = read_reports(blobs, NAME, batch_id)
            assert sorted(r.partition for r in reports) == list(range(PARTITIONS))
            for report in reports:
                assert report.version == batch_id + 1
                assert not report.restored, report
                assert report.restore_bytes == 0, report
        changelogs = [m.key for m in blobs.list(f"{NAME}/0/changelog/")]
        assert len(changelogs) == batches  # one commit per version
    finally:
        blobs.close()


def test_an_action_reading_one_row_still_commits_every_partition(
    spark: SparkSession, tmp_path: Path
) -> None:
    root = str(tmp_path / "state")
    firsts: list[Any] = []

    def sink(batch: Any, batch_id: int) -> None:
        firsts.append(batch.first())  # reads one row of one partition, then stops

    batches = _run(spark, tmp_path, RunningCountSum(), sink)
    assert len(firsts) == batches
    assert all(row is not None for row in firsts)

    # Every key's rows of every batch were counted once: no task stopped part-way.
    assert state_totals(read_state(spark, root, NAME)) == batch_totals(spark, tmp_path / "in")
    blobs = open_blob_store(root)
    try:
        for batch_id in range(batches):
            reports = read_reports(blobs, NAME, batch_id)
            assert sorted(r.partition for r in reports) == list(range(PARTITIONS))
            assert {r.version for r in reports} == {batch_id + 1}
    finally:
        blobs.close()
