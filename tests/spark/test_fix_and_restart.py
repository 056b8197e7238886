"""Fix and restart (issue 11): a batch whose state was committed but whose sink failed is
re-run by a changed processor after a restart; the query goes on, and the new attempt's
state replaces the old one's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession

from statekeeper import StoreConfig
from statekeeper.spark import read_state, transform_with_state
from tests.spark.helpers import OUTPUT_SCHEMA, Rows, make_input, read_stream, write_files
from tests.spark.processors import AppendScaled

pytestmark = pytest.mark.spark

NAME = "fixed"


def _expected(batches: list[Rows], scales: list[int]) -> dict[str, list[int]]:
    """Each key's list: its values in arrival order, batch ``b`` scaled by ``scales[b]``."""
    found: dict[str, list[int]] = {}
    for rows, scale in zip(batches, scales, strict=True):
        for k, v in rows:
            found.setdefault(k, []).append(v * scale)
    return found


def _lists(spark: SparkSession, root: str, version: int | None = None) -> dict[str, list[int]]:
    """Each key's list state, in list order, and check its "last" value state agrees."""
    rows = read_state(spark, root, NAME, version=version).collect()
    lists: dict[str, dict[int, int]] = {}
    last: dict[str, int] = {}
    for r in rows:
        if r["state"] == "values":
            lists.setdefault(r["k"], {})[int(r["entry"])] = json.loads(r["value"])
        else:
            last[r["k"]] = json.loads(r["value"])
    ordered = {k: [v for _, v in sorted(items.items())] for k, items in lists.items()}
    assert last == {k: values[-1] for k, values in ordered.items()}
    return ordered


def _start(spark: SparkSession, tmp_path: Path, scale: int, sink: Any) -> Any:
    out = transform_with_state(
        read_stream(spark, tmp_path / "in"), "k", AppendScaled(scale), OUTPUT_SCHEMA,
        str(tmp_path / "state"), NAME, 2, config=StoreConfig(local_dir=str(tmp_path / "local")),
    )  # fmt: skip
    return (
        out.writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(availableNow=True)
        .start()
    )


def test_a_changed_processor_re_runs_a_batch_whose_sink_failed(
    spark: SparkSession, tmp_path: Path
) -> None:
    batches = make_input(seed=41, files=3, rows=16, keys=5)
    write_files(tmp_path / "in", batches)
    root, out = str(tmp_path / "state"), str(tmp_path / "out")
    seen: list[int] = []

    def failing_sink(batch: Any, batch_id: int) -> None:
        batch.write.mode("append").parquet(out)  # runs the tasks: state b + 1 is committed
        seen.append(batch_id)
        if batch_id == 1:
            raise RuntimeError("the sink failed after writing batch 1")

    query = _start(spark, tmp_path, 1, failing_sink)
    with pytest.raises(StreamingQueryException, match="the sink failed after writing batch 1"):
        query.awaitTermination(120)
    assert seen == [0, 1]
    # The old processor's state of batch 1 is committed: version 2 holds it.
    assert _lists(spark, root, version=2) == _expected(batches[:2], [1, 1])

    def sink(batch: Any, batch_id: int) -> None:
        batch.write.mode("append").parquet(out)
        seen.append(batch_id)

    query = _start(spark, tmp_path, 10, sink)  # the fixed processor
    assert query.awaitTermination(120)
    assert query.exception() is None
    assert seen == [0, 1, 1, 2]  # batch 1 ran again, then the query went on

    expected = _expected(batches, [1, 10, 10])
    assert _lists(spark, root) == expected
    assert _lists(spark, root, version=2) == _expected(batches[:2], [1, 10])
    written = {(r["k"], r["count"], r["sum"]) for r in spark.read.parquet(out).collect()}
    assert {(k, len(v), sum(v)) for k, v in expected.items()} <= written
