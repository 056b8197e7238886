"""Micro-batches in which Spark runs no task of the operator: its input was empty, and the
optimizer (an input with no new data) or adaptive execution (an empty shuffle) dropped its
stage. No version is committed for such a batch; the next batch commits them empty instead
of failing for good (found by a review: the query stopped at the next batch, on every
retry and restart)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from statekeeper import CorruptStateError, StateBackend, StoreConfig, layout
from statekeeper.spark import read_state, transform_with_state, transform_with_state_arrow
from statekeeper.spark._cache import StoreSpec
from statekeeper.spark._reports import TaskIdentity
from statekeeper.spark._tasks import TaskSpec, _skipped_since
from tests.spark.conftest import SparkHolder
from tests.spark.helpers import (
    OUTPUT_SCHEMA,
    read_stream,
    run_to_end,
    state_totals,
    version_owners,
    write_files,
)
from tests.spark.processors import RunningCountSum, arrow_count_sum

pytestmark = pytest.mark.spark

PARTITIONS = 2
KEPT = [("a", 1), ("b", 2), ("a", 3)]
DROPPED = [("drop", 5), ("drop", 6)]


def _versions(root: str, operator: str) -> list[int]:
    with StateBackend(root) as backend:
        return [backend.versions(operator, p)[-1] for p in range(PARTITIONS)]


@pytest.mark.parametrize("form", ["rows", "arrow"])
def test_a_batch_whose_rows_are_all_filtered_out_is_committed_empty(
    spark_holder: SparkHolder, tmp_path: Path, form: str
) -> None:
    """A batch whose every row a filter drops: adaptive execution finds the shuffle into
    the operator empty and runs none of its tasks (seen for the row form with Spark 4.3;
    the vectorized form's stage ran there, and must end the same either way)."""
    spark = spark_holder.get()
    inp, root = tmp_path / "in", str(tmp_path / "state")
    write_files(inp, [KEPT, DROPPED, KEPT])
    kept: DataFrame = read_stream(spark, inp).filter(F.col("k") != "drop")
    config = StoreConfig(local_dir=str(tmp_path / "local"))
    if form == "rows":
        out = transform_with_state(
            kept, ["k"], RunningCountSum(), OUTPUT_SCHEMA, root, "op", PARTITIONS, config=config
        )
    else:
        out = transform_with_state_arrow(
            kept, ["k"], arrow_count_sum, OUTPUT_SCHEMA, root, "op", PARTITIONS, config=config
        )
    query = run_to_end(out, tmp_path / "out", tmp_path / "ck")
    assert [p["batchId"] for p in query.recentProgress] == [0, 1, 2]
    assert _versions(root, "op") == [3, 3]
    owners = version_owners(root, "op", PARTITIONS)
    assert all(set(o) == {str(query.id)} for o in owners), owners
    if form == "rows":
        assert state_totals(read_state(spark, root, "op")) == {"a": (4, 8), "b": (2, 4)}


@pytest.mark.parametrize("form", ["rows", "arrow"])
def test_a_batch_with_data_only_in_another_source_is_committed_empty(
    spark_holder: SparkHolder, tmp_path: Path, form: str
) -> None:
    """The operator's output unioned with a second stream: a batch with new data only in
    the second stream plans the operator's input as an empty relation, here the first
    batch (a gap after version 0) and a later one (after a version of this query)."""
    spark = spark_holder.get()
    first, second = tmp_path / "a", tmp_path / "b"
    root = str(tmp_path / "state")
    config = StoreConfig(local_dir=str(tmp_path / "local"))
    if form == "rows":
        out = transform_with_state(
            read_stream(spark, first), ["k"], RunningCountSum(), OUTPUT_SCHEMA, root, "op",
            PARTITIONS, config=config,
        )  # fmt: skip
    else:
        out = transform_with_state_arrow(
            read_stream(spark, first), ["k"], arrow_count_sum, OUTPUT_SCHEMA, root, "op",
            PARTITIONS, config=config,
        )  # fmt: skip
    other = read_stream(spark, second).select(
        "k", F.lit(-1).cast("long").alias("count"), F.lit(-1).cast("long").alias("sum")
    )
    query = (
        out.unionByName(other)
        .writeStream.format("parquet")
        .option("path", str(tmp_path / "out"))
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(processingTime="1 second")
        .start()
    )
    try:
        for folder, i in ((second, 0), (first, 0), (second, 1), (first, 1)):
            write_files(folder, [KEPT if folder == first else [("x", 1)]], start=i)
            query.processAllAvailable()
        assert query.exception() is None
    finally:
        query.stop()
    assert len(query.recentProgress) == 4
    assert _versions(root, "op") == [4, 4]
    if form == "rows":
        assert state_totals(read_state(spark, root, "op")) == {"a": (4, 8), "b": (2, 4)}
    rows = spark.read.parquet(str(tmp_path / "out")).collect()
    assert {(r["k"], r["count"]) for r in rows if r["k"] == "x"} == {("x", -1)}


def test_a_version_only_a_damaged_manifest_names_is_never_committed_empty(
    spark_holder: SparkHolder, tmp_path: Path
) -> None:
    """Found by review (S3 behind a proxy that cut a manifest's body short three times): the
    newest manifest of a store failed its checks, so its version looked never committed and
    the next micro-batch, taking it for one Spark had skipped, committed it empty over the
    real one: every count silently wrong. A manifest that fails its checks is now read again
    before it is skipped, and a version a skipped manifest may name is never filled: the
    task fails, naming the damaged manifest."""
    spark = spark_holder.get()
    inp, root = tmp_path / "in", str(tmp_path / "state")
    config = StoreConfig(local_dir=str(tmp_path / "local"))

    def run() -> None:
        out = transform_with_state(
            read_stream(spark, inp), ["k"], RunningCountSum(), OUTPUT_SCHEMA, root, "op",
            PARTITIONS, config=config,
        )  # fmt: skip
        run_to_end(out, tmp_path / "out", tmp_path / "ck")

    write_files(inp, [KEPT, KEPT, KEPT])
    run()
    assert _versions(root, "op") == [3, 3]
    manifests = sorted((Path(root) / layout.manifest_prefix("op", 0)).glob("*.json"))
    damaged = manifests[-1]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    write_files(inp, [KEPT], start=3)
    with pytest.raises(StreamingQueryException, match=f"{damaged.name} failed its checks"):
        run()
    assert sorted(damaged.parent.glob("*.json")) == manifests  # nothing written past it


def test_a_store_that_lost_its_manifests_is_never_filled_from_empty_state(tmp_path: Path) -> None:
    """Found by review: with every manifest of a store deleted, the store read as empty at
    version 0, and the next micro-batch took the gap for batches Spark had skipped: it
    committed them empty and the query went on from empty state. Commit metrics show the
    store had registered commits, so the task fails instead, saying what was lost. (No
    Spark: the decision is the task's, taken before it opens the store.)"""
    root = str(tmp_path / "state")
    config = StoreConfig(local_dir=str(tmp_path / "local"), metrics_every=1)
    with StateBackend(root, config=config) as backend, backend.open("op", 0) as store:
        for v in range(3):
            store.put(b"k", b"%d" % v)
            store.commit(owner="query")
    store_spec = StoreSpec(root, "op", 1, config, (), 5.0)
    spec = TaskSpec(store_spec, ("k",), None, None, None, 1, None)
    ctx = TaskIdentity(3, 0, "query", 0, 0, 0)
    assert _skipped_since(spec, ctx) is None  # version 3 is there: no gap to fill
    shutil.rmtree(Path(root) / layout.manifest_prefix("op", 0))
    with pytest.raises(CorruptStateError, match="its manifests were deleted"):
        _skipped_since(spec, ctx)
    shutil.rmtree(Path(root) / layout.metrics_prefix("op", 0))
    assert _skipped_since(spec, ctx) == 0  # orphans alone: an empty store, as before
