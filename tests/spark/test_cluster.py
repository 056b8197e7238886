"""Two executors on separate JVMs (``local-cluster[2,1,1024]``) with the state root on S3 (moto).

Each executor keeps its working copies in its own Spark local directory, so a partition that
lands on the other executor (or on the executor started after one was killed) restores from
S3. The module shares one cluster session; the suite's ``local[2,4]`` session is stopped
first (one SparkContext per process) and started again by whoever needs it next.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from statekeeper.spark import (
    StatefulProcessorHandle,
    batch_metrics,
    read_state,
    read_state_changes,
    transform_with_state,
)
from tests.spark.conftest import SparkHolder
from tests.spark.helpers import (
    OUTPUT_SCHEMA,
    batch_totals,
    executor_pids,
    local_cluster,
    make_input,
    read_stream,
    run_to_end,
    sink_latest,
    state_totals,
    wait_for_epoch,
    write_files,
)
from tests.spark.processors import RunningCountSum

pytestmark = [pytest.mark.spark, pytest.mark.cluster, pytest.mark.s3, pytest.mark.slow]

PARTITIONS = 4
KILL_BATCH = 2


class SlowBatch(RunningCountSum):
    """RunningCountSum that, in one micro-batch, says so in a file and then dawdles: the
    window in which the test kills an executor."""

    def __init__(self, batch: int, signal_dir: str) -> None:
        self.batch = batch
        self.signal_dir = signal_dir

    def init(self, handle: StatefulProcessorHandle) -> None:
        super().init(handle)
        if handle.batch_id == self.batch:
            Path(self.signal_dir, f"{handle.partition}-{os.getpid()}").touch()
            time.sleep(4)


@pytest.fixture(scope="module")
def cluster(no_classic_session: SparkHolder) -> Iterator[SparkSession]:
    """A ``local-cluster[2,1,1024]`` session for the module."""
    with local_cluster("statekeeper-cluster-tests", sys.modules[__name__]) as session:
        yield session


def kill_when_signalled(signal_dir: Path, app_id: str, killed: list[int]) -> None:
    """Wait for the slow batch to start, then SIGKILL one executor JVM running it."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not killed:
        if any(signal_dir.iterdir()):
            pids = executor_pids(app_id)
            if pids:
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
                return
        time.sleep(0.1)


def test_a_killed_executor_mid_batch_loses_nothing(
    cluster: SparkSession, s3_root: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    """Five batches; in the third, one executor JVM is SIGKILLed while its tasks run. The
    query goes on (tasks and lost shuffle output are redone elsewhere, stores restore from
    S3), and the state and the sink equal a batch groupBy."""
    root, options = s3_root
    inp, signals = tmp_path / "in", tmp_path / "signals"
    signals.mkdir()
    write_files(inp, make_input(seed=31, files=5, rows=40, keys=12))
    assert len(executor_pids(cluster.sparkContext.applicationId)) == 2
    killed: list[int] = []
    killer = threading.Thread(
        target=kill_when_signalled,
        args=(signals, cluster.sparkContext.applicationId, killed),
        daemon=True,
    )
    killer.start()
    out = transform_with_state(
        read_stream(cluster, inp), ["k"], SlowBatch(KILL_BATCH, str(signals)), OUTPUT_SCHEMA,
        root, "counts", PARTITIONS, storage_options=options,
    )  # fmt: skip
    query = run_to_end(out, tmp_path / "out", tmp_path / "ck", timeout=400)
    killer.join(timeout=5)
    wait_for_epoch(cluster, query, 4)
    assert len(killed) == 1
    expected = batch_totals(cluster, inp)
    assert state_totals(read_state(cluster, root, "counts", storage_options=options)) == expected
    assert sink_latest(cluster, tmp_path / "out") == expected
    metrics = [
        batch_metrics(root, "counts", b, storage_options=options, query_id=str(query.id))
        for b in range(5)
    ]
    assert [m.partitions_committed if m else 0 for m in metrics] == [PARTITIONS] * 5
    # The killed executor's partitions were opened again elsewhere, from S3.
    assert sum(m.stores_restored for m in metrics[KILL_BATCH:] if m) >= 1


def test_two_queries_on_one_root_run_concurrently(
    cluster: SparkSession, s3_root: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    """Two streaming queries, each with its own operator, on one S3 root at once."""
    root, options = s3_root
    inputs = {"left": make_input(seed=32, files=3), "right": make_input(seed=33, files=3)}
    queries: dict[str, Any] = {}
    for name, data in inputs.items():
        write_files(tmp_path / name, data)
        out = transform_with_state(
            read_stream(cluster, tmp_path / name), ["k"], RunningCountSum(), OUTPUT_SCHEMA,
            root, name, 3, storage_options=options,
        )  # fmt: skip
        queries[name] = (
            out.writeStream.format("parquet")
            .option("path", str(tmp_path / f"{name}-out"))
            .option("checkpointLocation", str(tmp_path / f"{name}-ck"))
            .trigger(availableNow=True)
            .start()
        )
    for name, query in queries.items():
        assert query.awaitTermination(300), name
        assert query.exception() is None, name
    for name in inputs:
        wait_for_epoch(cluster, queries[name], 2)
        expected = batch_totals(cluster, tmp_path / name)
        state = read_state(cluster, root, name, storage_options=options)
        assert state_totals(state) == expected, name
        assert sink_latest(cluster, tmp_path / f"{name}-out") == expected, name


def test_a_relative_local_root_is_read_as_the_driver_resolved_it(
    cluster: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Executors of a cluster run in their own working folders: read_state and
    read_state_changes given a relative path read the root the driver resolved (they once
    failed, having made an empty root in each executor's folder)."""
    monkeypatch.chdir(tmp_path)
    write_files(tmp_path / "in", make_input(seed=34, files=3, rows=30, keys=8))
    out = transform_with_state(
        read_stream(cluster, tmp_path / "in"), ["k"], RunningCountSum(), OUTPUT_SCHEMA,
        "rel/root", "counts", 2,
    )  # fmt: skip
    query = run_to_end(out, tmp_path / "out", tmp_path / "ck", timeout=300)
    wait_for_epoch(cluster, query, 2)
    expected = batch_totals(cluster, tmp_path / "in")
    assert state_totals(read_state(cluster, "rel/root", "counts")) == expected
    changes = read_state_changes(cluster, "rel/root", "counts", from_version=0)
    assert changes.count() > 0
