"""Offline repartition of a real streaming query's state (issue 16 item 2): 4 partitions,
stop, repartition to 7, restart with partitions=7, more batches, stop, repartition to 3,
restart, more batches; the state equals a batch groupBy of all input."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from statekeeper import StateBackend, StoreConfig
from statekeeper.repartition import repartition
from statekeeper.spark import read_state, transform_with_state
from tests.spark.helpers import (
    OUTPUT_SCHEMA,
    batch_totals,
    make_input,
    read_stream,
    run_to_end,
    sink_latest,
    state_totals,
    wait_for_epoch,
    write_files,
)
from tests.spark.processors import RunningCountSum

pytestmark = pytest.mark.spark

NAME = "counts"


def test_repartition_4_to_7_to_3_between_runs_of_a_query(
    spark: SparkSession, tmp_path: Path
) -> None:
    inp, root = tmp_path / "in", str(tmp_path / "state")
    sink, ckpt = tmp_path / "sink", tmp_path / "ckpt"
    data = make_input(seed=16, files=9, rows=40, keys=40)

    def run(partitions: int, first_file: int) -> None:
        write_files(inp, data[first_file : first_file + 3], start=first_file)
        out = transform_with_state(
            read_stream(spark, inp), "k", RunningCountSum(), OUTPUT_SCHEMA, root, NAME,
            partitions, config=StoreConfig(local_dir=str(tmp_path / "local"), snapshot_every=2),
        )  # fmt: skip
        query = run_to_end(out, sink, ckpt)
        wait_for_epoch(spark, query, first_file + 2)

    run(4, 0)
    report = repartition(root, NAME, partitions=7, work_dir=str(tmp_path))
    assert (report.from_partitions, report.partitions, report.version) == (4, 7, 3)
    # A split of 4 into 7 moves whole key-group ranges; the state a batch groupBy gives.
    assert state_totals(read_state(spark, root, NAME)) == batch_totals(spark, inp)

    run(7, 3)  # restarted with the new count: batch 3 loads version 3 of the new stores
    report = repartition(root, NAME, partitions=3, work_dir=str(tmp_path))
    assert (report.from_partitions, report.partitions, report.version) == (7, 3, 6)
    assert report.keys_ingested > 0

    run(3, 6)
    expected = batch_totals(spark, inp)
    assert len(expected) == 40
    assert state_totals(read_state(spark, root, NAME)) == expected
    assert sink_latest(spark, sink) == expected
    with StateBackend(root) as backend:
        assert backend.operators()[NAME] == 3
        assert backend.versions(NAME, 2)[-1] == 9
