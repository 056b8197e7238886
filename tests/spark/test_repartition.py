"""Offline repartition of a real streaming query's state (issue 16 item 2): 4 partitions,
stop, repartition to 7, restart with partitions=7, more batches, stop, repartition to 3,
restart, more batches; the state equals a batch groupBy of all input."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from statekeeper import ConfigMismatchError, StateBackend, StoreConfig
from statekeeper.repartition import repartition
from statekeeper.spark import read_state, transform_with_state
from tests.cli.conftest import run as run_cli
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


def _runner(
    spark: SparkSession, tmp_path: Path, data: list[Any], snapshot_every: int | None = None
) -> Callable[[int, int], None]:
    """``run(partitions, first_file)``: add three input files, run the query over them
    (one checkpoint, sink and root under ``tmp_path``) and wait for its last manifest."""
    inp, root = tmp_path / "in", str(tmp_path / "state")
    extra = {} if snapshot_every is None else {"snapshot_every": snapshot_every}
    config = StoreConfig(local_dir=str(tmp_path / "local"), **extra)

    def run(partitions: int, first_file: int) -> None:
        write_files(inp, data[first_file : first_file + 3], start=first_file)
        out = transform_with_state(
            read_stream(spark, inp), "k", RunningCountSum(), OUTPUT_SCHEMA, root, NAME,
            partitions, config=config,
        )  # fmt: skip
        query = run_to_end(out, tmp_path / "sink", tmp_path / "ckpt")
        wait_for_epoch(spark, query, first_file + 2)

    return run


def test_repartition_4_to_7_to_3_between_runs_of_a_query(
    spark: SparkSession, tmp_path: Path
) -> None:
    inp, root, sink = tmp_path / "in", str(tmp_path / "state"), tmp_path / "sink"
    run = _runner(spark, tmp_path, make_input(seed=16, files=9, rows=40, keys=40), snapshot_every=2)

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


def test_a_query_whose_last_epoch_manifest_is_missing_goes_on_at_the_version_named(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The driver stopped before its listener wrote the manifest of the last batch (or the
    query ran from Spark Connect): every partition is at 3, the newest manifest names 2.
    The rescale started the new stores at 2, and the restarted query, whose micro-batch 3
    needs version 3, failed on every restart. Now the rescale asks which version, and the
    query goes on at the one named."""
    inp, root, sink = tmp_path / "in", str(tmp_path / "state"), tmp_path / "sink"
    run = _runner(spark, tmp_path, make_input(seed=17, files=6, rows=40, keys=40))

    run(4, 0)
    (last,) = (tmp_path / "state" / "_epochs").glob("*/*2.json")
    last.unlink()
    with pytest.raises(ConfigMismatchError, match="name the version: 3 if micro-batch 2"):
        repartition(root, NAME, partitions=2, work_dir=str(tmp_path))
    cli = run_cli("repartition", root, NAME, "-n", "2", "--version", "3", "--json")
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.stdout)["version"] == 3
    run(2, 3)
    assert sink_latest(spark, sink) == batch_totals(spark, inp)
    assert state_totals(read_state(spark, root, NAME)) == batch_totals(spark, inp)
