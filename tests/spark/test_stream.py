"""End to end: running counts and sums over a file stream, restarts, retries, metrics."""

from __future__ import annotations

import datetime as dt
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from statekeeper import StateBackend, StoreConfig
from statekeeper.spark import (
    latest_epoch,
    read_manifest,
    read_state,
    state_listener,
    transform_with_state,
)
from tests.spark.conftest import SparkHolder
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
from tests.spark.processors import FailOnce, RunningCountSum, TtlHistory

pytestmark = pytest.mark.spark

PARTITIONS = 3


def test_restart_in_a_new_session_matches_a_batch_group_by(
    spark_holder: SparkHolder, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Three micro-batches, a new SparkSession with a fresh local_dir, two more: the state
    and the latest sink row per key equal a batch groupBy over all input; every batch is
    logged, the restarted batch restores every partition from the root, and an epoch
    manifest names every partition's version."""
    caplog.set_level(logging.INFO, logger="statekeeper.spark")
    data = make_input(seed=1, files=5)
    inp, root, sink, ckpt = (
        tmp_path / "in",
        str(tmp_path / "state"),
        tmp_path / "out",
        tmp_path / "ck",
    )
    write_files(inp, data[:3])

    def run(local: str) -> str:
        spark = spark_holder.get()
        out = transform_with_state(
            read_stream(spark, inp), ["k"], RunningCountSum(), OUTPUT_SCHEMA, root, "counts",
            PARTITIONS, config=StoreConfig(local_dir=str(tmp_path / local), snapshot_every=2),
        )  # fmt: skip
        return str(run_to_end(out, sink, ckpt).id)

    query_id = run("local-1")
    first = state_listener(spark_holder.get())
    batches = [first.wait_for(query_id, b)[0] for b in range(3)]
    assert [m.partitions_committed for m in batches] == [PARTITIONS] * 3
    assert [m.version for m in batches] == [1, 2, 3]
    assert all(m.bytes_uploaded > 0 and m.commit_latency_max_s > 0 for m in batches)
    assert sum(m.rows_in for m in batches) == 3 * len(data[0])
    for b in range(3):
        assert f"batch {b} operator 'counts': 3/3 partitions committed" in caplog.text
    first.flush()

    spark = spark_holder.restart()
    write_files(inp, data[3:], start=3)
    assert run("local-2") == query_id  # the same query, resumed from its checkpointLocation
    listener = state_listener(spark)
    resumed = listener.wait_for(query_id, 3)[0]
    assert resumed.stores_restored == PARTITIONS  # nothing local: all came from the root
    assert resumed.stores_reused == 0
    assert resumed.restore_time_s > 0
    listener.wait_for(query_id, 4)
    listener.flush()

    expected = batch_totals(spark, inp)
    assert sink_latest(spark, sink) == expected
    assert state_totals(read_state(spark, root, "counts")) == expected

    backend = StateBackend(root)
    assert latest_epoch(backend.blobs) == 4
    manifest = read_manifest(backend.blobs, 4)
    assert manifest.query_id == query_id
    assert manifest.versions() == {"counts": [5] * PARTITIONS}
    assert all(
        e.snapshot_version is None or e.snapshot_version <= 5 for e in manifest.stores["counts"]
    )
    assert [read_manifest(backend.blobs, e).versions() for e in range(4)] == [
        {"counts": [e + 1] * PARTITIONS} for e in range(4)
    ]
    backend.close()


def test_a_retried_task_does_not_count_twice(spark_holder: SparkHolder, tmp_path: Path) -> None:
    """The first attempt of batch 1 raises after updating state; Spark retries the task,
    and the results still equal a batch groupBy."""
    spark = spark_holder.get()
    data = make_input(seed=2, files=3)
    inp, root, markers = tmp_path / "in", str(tmp_path / "state"), tmp_path / "markers"
    markers.mkdir()
    write_files(inp, data)
    out = transform_with_state(
        read_stream(spark, inp), "k", FailOnce(str(markers), fail_batch=1), OUTPUT_SCHEMA,
        root, "retry", 2, config=StoreConfig(local_dir=str(tmp_path / "local")),
    )  # fmt: skip
    run_to_end(out, tmp_path / "out", tmp_path / "ck")

    assert list(markers.iterdir()), "no task failed: the test did not test anything"
    expected = batch_totals(spark, inp)
    assert sink_latest(spark, tmp_path / "out") == expected
    assert state_totals(read_state(spark, root, "retry")) == expected


def test_batches_run_twice_in_foreach_batch_recommit_identical_ttl_state(
    spark_holder: SparkHolder, tmp_path: Path
) -> None:
    """foreachBatch that reads the output twice runs every micro-batch's tasks twice: the
    second run reloads version b and must commit exactly the same version b + 1, TTL expiry
    times included (they come from the batch timestamp, not the wall clock)."""
    spark = spark_holder.get()
    root, sink = str(tmp_path / "state"), tmp_path / "out"
    write_files(tmp_path / "in", make_input(seed=5, files=2, rows=20, keys=5))
    out = transform_with_state(
        read_stream(spark, tmp_path / "in"), "k", TtlHistory(), OUTPUT_SCHEMA, root, "ttl", 2,
        config=StoreConfig(local_dir=str(tmp_path / "local")),
    )  # fmt: skip
    counted: list[int] = []

    def twice(batch: Any, batch_id: int) -> None:
        counted.append(batch.count())
        batch.write.mode("append").parquet(str(sink))

    started = dt.datetime.now()  # naive local time, as collect() returns timestamps
    query = (
        out.writeStream.foreachBatch(twice)
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(120)
    assert query.exception() is None
    assert len(counted) == 2

    expected = batch_totals(spark, tmp_path / "in")
    assert sink_latest(spark, sink) == expected
    state = read_state(spark, root, "ttl").collect()
    counts = {r["k"]: json.loads(r["value"]) for r in state if r["state"] == "count"}
    assert counts == {k: n for k, (n, _) in expected.items()}
    assert sum(1 for r in state if r["state"] == "values") == 40
    assert {json.loads(r["entry"]) for r in state if r["state"] == "last"} == {"batch"}
    for r in state:
        ttl_left = r["expires_at"] - started
        assert dt.timedelta(minutes=55) < ttl_left < dt.timedelta(minutes=65)


@pytest.mark.s3
def test_state_on_an_s3_root(
    spark_holder: SparkHolder, tmp_path: Path, s3_root: tuple[str, dict[str, str]]
) -> None:
    """The same running totals with the root on a loopback S3 server: storage options reach
    the executors, and state, sink and epoch manifests agree with a batch groupBy."""
    spark = spark_holder.get()
    root, options = s3_root
    write_files(tmp_path / "in", make_input(seed=6, files=3))
    out = transform_with_state(
        read_stream(spark, tmp_path / "in"), "k", RunningCountSum(), OUTPUT_SCHEMA, root, "s3op",
        2, config=StoreConfig(local_dir=str(tmp_path / "local")), storage_options=options,
    )  # fmt: skip
    query = run_to_end(out, tmp_path / "out", tmp_path / "ck")
    listener = state_listener(spark)
    listener.wait_for(str(query.id), 2)
    listener.flush()

    expected = batch_totals(spark, tmp_path / "in")
    assert sink_latest(spark, tmp_path / "out") == expected
    assert state_totals(read_state(spark, root, "s3op", storage_options=options)) == expected
    with StateBackend(root, storage_options=options) as backend:
        assert latest_epoch(backend.blobs) == 2
        assert read_manifest(backend.blobs, 2).versions() == {"s3op": [3, 3]}
