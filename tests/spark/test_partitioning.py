"""The state partition comes from the data: narrow operations after the operator are correct.

With ``coalesce(1)`` one task runs the operator's function once per shuffle partition, and
with ``union`` the task ids are offset; few keys over many partitions leave partitions empty
in every batch, which must still commit their stores.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from statekeeper import StateBackend, StateKeeperError, StoreConfig
from statekeeper.spark import batch_metrics, read_state, transform_with_state
from statekeeper.spark._partition import (
    KEY_GROUP_COLUMN,
    PART_COLUMN,
    Partitioning,
    peek_partition,
)
from tests.spark.helpers import (
    OUTPUT_SCHEMA,
    batch_totals,
    make_input,
    read_stream,
    run_to_end,
    sink_latest,
    state_totals,
    write_files,
)
from tests.spark.processors import RunningCountSum

pytestmark = pytest.mark.spark

PARTITIONS = 5
FILES = 3


def _counts(spark: SparkSession, inp: Path, root: str, name: str, local: Path) -> DataFrame:
    return transform_with_state(
        read_stream(spark, inp), ["k"], RunningCountSum(), OUTPUT_SCHEMA, root, name,
        PARTITIONS, config=StoreConfig(local_dir=str(local)),
    )  # fmt: skip


def test_coalesce_after_the_operator_keeps_exact_state(spark: SparkSession, tmp_path: Path) -> None:
    """Three keys over five partitions, coalesced to one output task: every partition
    commits every batch (the empty ones too), the state and sink equal a batch groupBy, and
    each key's state sits in the partition of its key group: ``pmod(hash(k), 4096)`` by
    Spark's own hash, owned by partition ``kg * 5 div 4096``."""
    inp, root = tmp_path / "in", str(tmp_path / "state")
    write_files(inp, make_input(seed=7, files=FILES, rows=12, keys=3))
    out = _counts(spark, inp, root, "counts", tmp_path / "local").coalesce(1)
    query = run_to_end(out, tmp_path / "out", tmp_path / "ck")
    expected = batch_totals(spark, inp)
    state = read_state(spark, root, "counts")
    assert state_totals(state) == expected
    assert sink_latest(spark, tmp_path / "out") == expected
    with StateBackend(root, config=StoreConfig(local_dir=str(tmp_path / "l2"))) as backend:
        assert {backend.versions("counts", p)[-1] for p in range(PARTITIONS)} == {FILES}
    spark_partition = {
        r["k"]: r["p"]
        for r in spark.createDataFrame([(k,) for k in expected], "k string")
        .select("k", F.expr(f"(pmod(hash(k), 4096) * {PARTITIONS}) div 4096").alias("p"))
        .collect()
    }
    assert {r["k"]: r["partition"] for r in state.collect()} == spark_partition
    metrics = batch_metrics(root, "counts", FILES - 1, query_id=str(query.id))
    assert metrics is not None
    assert metrics.partitions_committed == PARTITIONS
    assert metrics.rows_in == 12


def test_union_of_two_operators_keeps_exact_state(spark: SparkSession, tmp_path: Path) -> None:
    """Two operators on one root whose outputs are unioned (task ids of the second are
    offset by the first's partition count): both states equal a batch groupBy."""
    inp, root = tmp_path / "in", str(tmp_path / "state")
    write_files(inp, make_input(seed=8, files=FILES, rows=12, keys=4))
    first = _counts(spark, inp, root, "first", tmp_path / "local")
    second = _counts(spark, inp, root, "second", tmp_path / "local")
    run_to_end(first.union(second), tmp_path / "out", tmp_path / "ck")
    expected = batch_totals(spark, inp)
    assert state_totals(read_state(spark, root, "first")) == expected
    assert state_totals(read_state(spark, root, "second")) == expected
    rows = spark.read.parquet(str(tmp_path / "out")).count()
    assert rows == 2 * sum(
        len({k for k, _ in batch}) for batch in make_input(seed=8, files=FILES, rows=12, keys=4)
    )


def _batch(partitions: list[int]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(
        {"k": [f"k{p}" for p in partitions], PART_COLUMN: pa.array(partitions, pa.int32())}
    )


def test_a_task_refuses_key_groups_of_another_partition() -> None:
    """With key groups, every row's key group must lie in one partition's range (4 of 16
    key groups each over 4 partitions); the key-group column stays for the runner."""
    layout = Partitioning(4, 16)

    def batch(groups: list[int]) -> pa.RecordBatch:
        return pa.RecordBatch.from_pydict(
            {"k": [f"k{g}" for g in groups], KEY_GROUP_COLUMN: pa.array(groups, pa.int32())}
        )

    partition, rest = peek_partition(iter([batch([]), batch([4, 7]), batch([5])]), layout)
    assert partition == 1
    assert [b.schema.names for b in rest] == [["k", KEY_GROUP_COLUMN]] * 3
    with pytest.raises(StateKeeperError, match="partition 1 owns key groups 4 to 7"):
        peek_partition(iter([batch([7, 8])]), layout)
    with pytest.raises(StateKeeperError, match=r"expected key groups in \[0, 16\)"):
        peek_partition(iter([batch([3, 16])]), layout)
    _, rest = peek_partition(iter([batch([0]), batch([12])]), layout)
    with pytest.raises(StateKeeperError, match="state partitions 0 and 3"):
        list(rest)


def test_a_task_refuses_rows_of_two_state_partitions() -> None:
    """The per-batch check of a 0.1 operator: rows of one task must all carry one state
    partition."""
    with pytest.raises(StateKeeperError, match="state partitions 1 to 2"):
        peek_partition(iter([_batch([1, 2])]))
    partition, rest = peek_partition(iter([_batch([]), _batch([3]), _batch([4])]))
    assert partition == 3
    with pytest.raises(StateKeeperError, match="state partitions 3 and 4"):
        list(rest)
    partition, rest = peek_partition(iter([_batch([]), _batch([5, 5])]))
    assert partition == 5
    assert [b.schema.names for b in rest] == [["k"], ["k"]]  # our column is gone
    assert peek_partition(iter([]))[0] is None  # an empty task learns nothing from its data
