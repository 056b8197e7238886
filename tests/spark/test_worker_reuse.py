"""Spark without Python worker reuse (``spark.python.worker.reuse=false``).

Spark then starts a Python worker for every task and ends it right after the task, without
running its exit handlers: work a store left to background threads (the due snapshot's
upload, the commit metrics it buffers, its memtable's flush) died with it. Before each task
closed its store itself, 8 micro-batches with a snapshot due every 2 versions uploaded 2 and
0 of the 4 snapshots of their two partitions (20 batches, one due every 3: 1 and 2 of 6),
left half-written uploads in the root, and a quarter of the tasks (10 of 38 in the 20-batch
run) replayed changelogs because the previous task's writes never reached the local disk.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from statekeeper import StateBackend, StoreConfig, layout
from statekeeper.metrics import read_commit_metrics
from statekeeper.spark import batch_metrics, transform_with_state, transform_with_state_arrow
from tests.spark.conftest import SparkHolder
from tests.spark.helpers import (
    OUTPUT_SCHEMA,
    batch_totals,
    make_input,
    read_stream,
    run_to_end,
    sink_latest,
    write_files,
)
from tests.spark.processors import RunningCountSum, arrow_count_sum

pytestmark = [pytest.mark.spark, pytest.mark.slow]

PARTITIONS = 2
BATCHES = 8
SNAPSHOT_EVERY = 2


@pytest.fixture(scope="module")
def no_reuse(no_classic_session: SparkHolder) -> Iterator[SparkSession]:
    """A ``local[2]`` session whose Python workers each run one task."""
    session = (
        SparkSession.builder.master("local[2]")
        .appName("statekeeper-no-worker-reuse")
        .config("spark.python.worker.reuse", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()


@pytest.mark.parametrize("form", ["keyed", "vectorized"])
def test_every_task_leaves_its_snapshot_and_its_local_copy_complete(
    no_reuse: SparkSession, tmp_path: Path, form: str
) -> None:
    inp, root, sink, ckpt = (
        tmp_path / "in",
        str(tmp_path / "state"),
        tmp_path / "out",
        tmp_path / "ck",
    )
    write_files(inp, make_input(seed=3, files=BATCHES, rows=400, keys=300))
    config = StoreConfig(local_dir=str(tmp_path / "local"), snapshot_every=SNAPSHOT_EVERY)
    stream = read_stream(no_reuse, inp)
    if form == "keyed":
        out = transform_with_state(
            stream, ["k"], RunningCountSum(), OUTPUT_SCHEMA, root, "counts", PARTITIONS,
            config=config,
        )  # fmt: skip
    else:
        out = transform_with_state_arrow(
            stream, ["k"], arrow_count_sum, OUTPUT_SCHEMA, root, "counts", PARTITIONS,
            config=config,
        )  # fmt: skip
    query_id = str(run_to_end(out, sink, ckpt).id)

    assert sink_latest(no_reuse, sink) == batch_totals(no_reuse, inp)
    metrics = [batch_metrics(root, "counts", b, query_id=query_id) for b in range(BATCHES)]
    # The premise: no task found its store open, so no worker ran two tasks.
    assert [m.stores_opened for m in metrics] == [PARTITIONS] * BATCHES
    # Each task found the local copy where the previous task of its partition left it.
    assert [m.stores_restored for m in metrics[1:]] == [0] * (BATCHES - 1)
    with StateBackend(root, config=config) as backend:
        for partition in range(PARTITIONS):
            keys = [m.key for m in backend.blobs.list(layout.snapshot_prefix("counts", partition))]
            versions = sorted(layout.parse_attempt_snapshot_key(k)[0] for k in keys)  # type: ignore[index]
            assert versions == list(range(SNAPSHOT_EVERY, BATCHES + 1, SNAPSHOT_EVERY)), partition
            # Every commit's metrics were written (a store buffers them until it closes).
            recorded = read_commit_metrics(backend.blobs, "counts", partition)
            assert sorted(recorded) == list(range(1, BATCHES + 1)), partition
    unfinished = [
        os.path.join(folder, name)
        for folder, _, names in os.walk(root)
        for name in names
        if name.startswith(".tmp-")
    ]
    assert unfinished == []
