"""Spark whose Python workers each run one task: ``spark.python.worker.reuse=false``, or
``spark.python.use.daemon=false``.

Without reuse Spark starts a Python worker for every task and ends it right after the task,
without running its exit handlers: work a store left to background threads (the due
snapshot's upload, the commit metrics it buffers, its memtable's flush) died with it. Before
each task closed its store itself, 8 micro-batches with a snapshot due every 2 versions
uploaded 2 and 0 of the 4 snapshots of their two partitions (20 batches, one due every 3: 1
and 2 of 6), left half-written uploads in the root, and a quarter of the tasks (10 of 38 in
the 20-batch run) replayed changelogs because the previous task's writes never reached the
local disk. Without the daemon each task's worker exits normally, and then ran what the
store left to background threads only after Spark counted the task done, holding the store's
lock against the partition's next task (before the store's pools ran work refused at exit in
the caller's thread, a snapshot upload still running then failed: 12 batches of 3000 rows,
one snapshot due every 3, uploaded 1 of 4 per partition). Whether work is still running at
that exit is a matter of timing, and a run of the end-to-end test below without the daemon
passed with that setting ignored, so for it only the reading of the setting is tested.
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
from statekeeper.spark._transform import _reuses_workers
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
REUSE, DAEMON = "spark.python.worker.reuse", "spark.python.use.daemon"


@pytest.fixture(scope="module", params=[REUSE, DAEMON])
def no_reuse(
    no_classic_session: SparkHolder, request: pytest.FixtureRequest
) -> Iterator[SparkSession]:
    """A ``local[2]`` session whose Python workers each run one task: the parameter is the
    setting turned off."""
    session = (
        SparkSession.builder.master("local[2]")
        .appName("statekeeper-one-task-workers")
        .config(REUSE, str(request.param != REUSE).lower())
        .config(DAEMON, str(request.param != DAEMON).lower())
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
        # PySpark's builder keeps every option for the sessions built after this one.
        SparkSession.builder.config(REUSE, "true").config(DAEMON, "true")


@pytest.mark.parametrize(
    ("no_reuse", "form"), [(REUSE, "keyed"), (REUSE, "vectorized")], indirect=["no_reuse"]
)
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


def test_tasks_close_their_stores_when_either_setting_is_off(no_reuse: SparkSession) -> None:
    """What the driver reads into ``StoreSpec.keep_open`` (the test above runs with reuse
    off only: see the module docstring)."""
    assert not _reuses_workers(no_reuse)
