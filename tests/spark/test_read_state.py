"""read_state runs on the executors and reads the consistent cut from the epoch manifests.

One root holds two streaming queries, each with its own operator (``first``: 3 partitions,
``second``: 2), each run for two micro-batches on a classic session, whose listener writes
their epoch manifests. A batch that failed half way is simulated by committing one more
version (every data key deleted) to some partitions of ``first`` after the fact.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from statekeeper import StateBackend, StoreConfig
from statekeeper.errors import StateNotFoundError
from statekeeper.keyed import read_operator_record
from statekeeper.spark import latest_manifest, read_state, state_listener, transform_with_state
from statekeeper.spark._read import _read_partition, _ReadSpec
from tests.spark.conftest import SparkHolder
from tests.spark.helpers import (
    OUTPUT_SCHEMA,
    batch_totals,
    make_input,
    read_stream,
    run_to_end,
    state_totals,
    write_files,
)
from tests.spark.processors import RunningCountSum

pytestmark = pytest.mark.spark

# Newer than any attempt a Spark task made: the store refuses older ones.
_AFTER_SPARK = (1_000_000, 0, 0, 0)


@dataclass
class TwoQueries:
    root: str
    expected: dict[str, dict[str, tuple[int, int]]]
    """Operator -> count and sum per key over its query's whole input."""
    query_ids: dict[str, str]
    tmp: Path


@pytest.fixture(scope="module")
def two_queries(spark_holder: SparkHolder, tmp_path_factory: pytest.TempPathFactory) -> TwoQueries:
    spark = spark_holder.get()
    tmp = tmp_path_factory.mktemp("read_state")
    root = str(tmp / "state")
    expected, query_ids = {}, {}
    for seed, (name, partitions) in enumerate((("first", 3), ("second", 2))):
        inp = tmp / f"in-{name}"
        write_files(inp, make_input(seed=seed, files=2))
        out = transform_with_state(
            read_stream(spark, inp), ["k"], RunningCountSum(), OUTPUT_SCHEMA, root, name,
            partitions, config=StoreConfig(local_dir=str(tmp / "local")),
        )  # fmt: skip
        query_id = str(run_to_end(out, tmp / f"out-{name}", tmp / f"ck-{name}").id)
        listener = state_listener(spark)
        listener.wait_for(query_id, 1)
        listener.flush()
        expected[name] = batch_totals(spark, inp)
        query_ids[name] = query_id
    return TwoQueries(root, expected, query_ids, tmp)


def _half_failed_batch(root: str, local: Path, partitions: list[int]) -> None:
    """Commit version 3 of ``first`` in ``partitions``: every data key deleted (the
    operator record kept), as a third micro-batch that died before it finished would."""
    with StateBackend(root, config=StoreConfig(local_dir=str(local))) as backend:
        for p in partitions:
            with backend.open("first", p) as store:
                assert store.version == 2
                record = read_operator_record(store)
                assert record is not None
                kept = record.to_bytes()
                for key, value in list(store.scan()):
                    if value != kept:
                        store.delete(key)
                store.commit(order=_AFTER_SPARK)


def test_read_state_is_one_task_per_partition_and_the_driver_restores_one_store(
    spark: SparkSession, two_queries: TwoQueries, caplog: pytest.LogCaptureFixture
) -> None:
    sc = spark.sparkContext
    caplog.set_level(logging.INFO, logger="statekeeper")
    sc.setJobGroup("read-state-tasks", "read_state of second")
    try:
        state = read_state(spark, two_queries.root, "second")
        found = state_totals(state)
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
    assert found == two_queries.expected["second"]
    tracker = sc.statusTracker()
    jobs = [tracker.getJobInfo(j) for j in tracker.getJobIdsForGroup("read-state-tasks")]
    stages = [tracker.getStageInfo(s) for job in jobs if job is not None for s in job.stageIds]
    assert None not in jobs
    assert None not in stages
    assert [s.numTasks for s in stages if s is not None] == [2]  # one task per partition
    # The driver opened one store to learn the schema; the executors read both.
    restored = [r.getMessage() for r in caplog.records if r.getMessage().startswith("restored")]
    assert len(restored) == 1, restored
    assert restored[0].startswith("restored second/0:")
    assert {r["partition"] for r in state.collect()} == {0, 1}


def test_the_cut_is_the_last_finished_batch_of_the_operators_query(
    spark: SparkSession, two_queries: TwoQueries
) -> None:
    root = two_queries.root
    with StateBackend(root, config=StoreConfig(local_dir=str(two_queries.tmp / "x"))) as b:
        assert latest_manifest(b.blobs, "first").query_id == two_queries.query_ids["first"]  # type: ignore[union-attr]
        assert latest_manifest(b.blobs, "second").query_id == two_queries.query_ids["second"]  # type: ignore[union-attr]
    before = sorted(map(tuple, read_state(spark, root, "first").collect()))
    assert state_totals(read_state(spark, root, "first")) == two_queries.expected["first"]

    # Partition 0 committed a third batch, the others did not: the manifest's cut.
    _half_failed_batch(root, two_queries.tmp / "half-0", [0])
    assert sorted(map(tuple, read_state(spark, root, "first").collect())) == before
    # Every partition committed it, but the query never finished the batch: still the cut,
    # where the newest version every partition has would now be the empty third one.
    _half_failed_batch(root, two_queries.tmp / "half-rest", [1, 2])
    assert sorted(map(tuple, read_state(spark, root, "first").collect())) == before
    assert sorted(map(tuple, read_state(spark, root, "first", version=2).collect())) == before
    assert state_totals(read_state(spark, root, "first", version=3)) == {}
    # The other query's operator is read from its own manifests.
    assert state_totals(read_state(spark, root, "second")) == two_queries.expected["second"]


def test_without_manifests_the_newest_common_version_is_read(
    spark: SparkSession, two_queries: TwoQueries, caplog: pytest.LogCaptureFixture
) -> None:
    """A copy of the root without its ``_epochs/`` (as a root written from Spark Connect or
    by the store API): the newest version every partition has, and the reason is logged."""
    copy = two_queries.tmp / "no-epochs"
    shutil.copytree(two_queries.root, copy)
    shutil.rmtree(copy / "_epochs")
    caplog.set_level(logging.INFO, logger="statekeeper.epochs")
    assert state_totals(read_state(spark, str(copy), "second")) == two_queries.expected["second"]
    assert "no epoch manifest names operator 'second'" in caplog.text
    # In ``first`` some partitions may be at version 3 already (the test before): the
    # newest version all of them have is read, consistent whichever it is.
    with StateBackend(str(copy), config=StoreConfig(local_dir=str(copy) + "-local")) as b:
        common = min(b.versions("first", p)[-1] for p in range(3))
    totals = state_totals(read_state(spark, str(copy), "first"))
    assert totals == ({} if common == 3 else two_queries.expected["first"])


def test_a_read_task_that_finds_no_such_operator_fails_without_creating_a_root(
    tmp_path: Path,
) -> None:
    """An executor that sees the root otherwise than the driver (a local root not on a
    shared disk) must say so, not register the operator in a new root of its own."""
    missing = tmp_path / "not-the-root"
    spec = _ReadSpec(
        checkpoint=str(missing), operator="counts", versions={0: 3}, arrow_schema=None,
        typed=False, grouped=True, allow_pickle=False, schema_partition=0,
    )  # fmt: skip
    with pytest.raises(StateNotFoundError, match=r"as this executor reads it, holds no operator"):
        list(_read_partition(spec, 0))
    assert not (missing / "_statekeeper.json").exists()
