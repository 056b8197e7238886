"""read_state_changes on a real streaming query, against read_state at both ends; and time
travel: read_state(version=V) for every retained version.

One query (``TtlHistory``: a value, a list and a map state, all with a TTL; 2 partitions)
runs three micro-batches, one input file each, so versions 0..3 exist in every partition.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession

from statekeeper import StateBackend, StateNotFoundError, StoreConfig
from statekeeper.spark import read_state, read_state_changes, transform_with_state
from tests.spark.conftest import SparkHolder
from tests.spark.helpers import (
    OUTPUT_SCHEMA,
    make_input,
    read_stream,
    run_to_end,
    wait_for_epoch,
    write_files,
)
from tests.spark.processors import TtlHistory

pytestmark = pytest.mark.spark

NAME = "history"
PARTITIONS = 2
BATCHES = 3


@dataclass
class Query:
    root: str
    inputs: list[list[tuple[str, int]]]
    tmp: Path


@pytest.fixture(scope="module")
def query(spark_holder: SparkHolder, tmp_path_factory: pytest.TempPathFactory) -> Query:
    spark = spark_holder.get()
    tmp = tmp_path_factory.mktemp("changes")
    root = str(tmp / "state")
    inputs = make_input(seed=16, files=BATCHES, rows=12, keys=6)
    write_files(tmp / "in", inputs)
    out = transform_with_state(
        read_stream(spark, tmp / "in"), ["k"], TtlHistory(), OUTPUT_SCHEMA, root, NAME,
        PARTITIONS, config=StoreConfig(local_dir=str(tmp / "local")),
    )  # fmt: skip
    running = run_to_end(out, tmp / "out", tmp / "ck")
    wait_for_epoch(spark, running, BATCHES - 1)
    return Query(root, inputs, tmp)


Row = tuple[Any, ...]


def _state(frame: DataFrame) -> dict[Row, Row]:
    """read_state rows as (partition, k, state, entry) -> (value, expires_at)."""
    if "state" not in frame.columns:  # version 0 everywhere: no operator record yet
        assert frame.count() == 0
        return {}
    return {
        (r["partition"], r["k"], r["state"], r["entry"]): (r["value"], r["expires_at"])
        for r in frame.collect()
    }


def _apply(state: dict[Row, Row], changes: DataFrame) -> dict[Row, Row]:
    out = dict(state)
    for r in sorted(changes.collect(), key=lambda r: r["version"]):
        where = (r["partition"], r["k"], r["state"], r["entry"])
        if r["operation"] == "delete":
            out.pop(where, None)
        else:
            assert r["operation"] == "put"
            out[where] = (r["value"], r["expires_at"])
    return out


@pytest.mark.parametrize(("a", "b"), [(0, 3), (1, 3), (1, 2), (2, 2)])
def test_changes_of_a_to_b_applied_to_read_state_at_a_give_read_state_at_b(
    spark: SparkSession, query: Query, a: int, b: int
) -> None:
    changes = read_state_changes(spark, query.root, NAME, a, b)
    assert changes.columns == [
        "version", "partition", "k", "state", "operation", "entry", "value", "expires_at",
    ]  # fmt: skip
    rows = changes.collect()
    assert {r["version"] for r in rows} == set(range(a + 1, b + 1))
    before = _state(read_state(spark, query.root, NAME, version=a))
    after = _state(read_state(spark, query.root, NAME, version=b))
    assert _apply(before, changes) == after
    if a < b:
        assert after != before
        # Each batch appends its rows' values to a key's list, one put per element.
        appended = [r for r in rows if r["state"] == "values"]
        assert len(appended) == sum(len(batch) for batch in query.inputs[a:b])


def test_changes_are_one_task_per_partition_and_default_to_the_consistent_cut(
    spark: SparkSession, query: Query
) -> None:
    sc = spark.sparkContext
    sc.setJobGroup("read-state-changes", "read_state_changes")
    try:
        rows = sorted(map(tuple, read_state_changes(spark, query.root, NAME, 1).collect()))
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
    tracker = sc.statusTracker()
    jobs = [tracker.getJobInfo(j) for j in tracker.getJobIdsForGroup("read-state-changes")]
    stages = [tracker.getStageInfo(s) for job in jobs if job is not None for s in job.stageIds]
    assert [s.numTasks for s in stages if s is not None] == [PARTITIONS]
    explicit = read_state_changes(spark, query.root, NAME, 1, BATCHES).collect()
    assert rows == sorted(map(tuple, explicit))
    # The map state "last" holds the batch id each key was last seen in, as JSON.
    last = {(r[2], r[6]) for r in rows if r[3] == "last" and r[4] == "put"}
    assert {json.loads(v) for _, v in last} <= {1, 2}


def test_versions_out_of_range_are_refused_naming_them(spark: SparkSession, query: Query) -> None:
    with pytest.raises(ValueError, match="from_version 3 is after version 2 of partition 0"):
        read_state_changes(spark, query.root, NAME, 3, 2)
    with pytest.raises(StateNotFoundError, match=r"version 7 of store history/0 does not exist"):
        read_state_changes(spark, query.root, NAME, 1, 7)


def test_read_state_travels_to_every_retained_version(spark: SparkSession, query: Query) -> None:
    with StateBackend(query.root, config=StoreConfig(local_dir=str(query.tmp / "tt"))) as b:
        retained = [b.versions(NAME, p) for p in range(PARTITIONS)]
    assert retained == [list(range(BATCHES + 1))] * PARTITIONS
    for version in retained[0]:
        counts = {
            key: json.loads(value)
            for (_, key, state, _), (value, _) in _state(
                read_state(spark, query.root, NAME, version=version)
            ).items()
            if state == "count"
        }
        expected: dict[str, int] = {}
        for batch in query.inputs[:version]:
            for key, _ in batch:
                expected[key] = expected.get(key, 0) + 1
        assert counts == expected, version
