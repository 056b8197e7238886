"""The vectorized form: a function over a partition's Arrow batches and its store."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from statekeeper import StoreConfig
from statekeeper.spark import decode_key, read_state, state_listener, transform_with_state_arrow
from tests.spark.helpers import (
    OUTPUT_SCHEMA,
    batch_totals,
    make_input,
    read_stream,
    run_to_end,
    sink_latest,
    write_files,
)
from tests.spark.processors import arrow_count_sum

pytestmark = pytest.mark.spark


def test_vectorized_running_totals_match_a_batch_group_by(
    spark: SparkSession, tmp_path: Path
) -> None:
    root = str(tmp_path / "state")
    write_files(tmp_path / "in", make_input(seed=4, files=3, rows=50, keys=15))
    out = transform_with_state_arrow(
        read_stream(spark, tmp_path / "in"), ["k"], arrow_count_sum, OUTPUT_SCHEMA, root,
        "vector", 2, config=StoreConfig(local_dir=str(tmp_path / "local")),
    )  # fmt: skip
    query = run_to_end(out, tmp_path / "out", tmp_path / "ck")

    expected = batch_totals(spark, tmp_path / "in")
    assert sink_latest(spark, tmp_path / "out") == expected
    raw = read_state(spark, root, "vector").collect()
    assert {
        decode_key(r["key"], 1)[0][0]: tuple(map(int, r["value"].split(b","))) for r in raw
    } == (expected)
    metrics = state_listener(spark).wait_for(str(query.id), 2)[0]
    assert metrics.partitions_committed == 2
    assert metrics.rows_in == 50
    assert metrics.puts == metrics.rows_out  # one put per key that had input
