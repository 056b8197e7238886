"""An order-sensitive processor on two executors with injected failures (issue 12).

A list state appends each row's value in arrival order, and the arrival order of a key's
rows is the shuffle's fetch order: the key's rows come from several input splits, whose map
outputs lie on both executor JVMs, and a reduce task reads its own executor's blocks before
the other's. A re-run of a partition may therefore append the same rows in another order,
and its state must then be that run's, whole: never a mix of two attempts, never a batch
twice. The failures, one kind per micro-batch:

* batch 0: the processor raises in the first attempt of a partition after its first key
  appended to the list (uncommitted writes to drop);
* batch 1: the sink runs the batch (every partition commits version 2), an executor that ran
  some of those tasks is SIGKILLed, and the sink's second action needs the lost shuffle
  output: Spark re-runs those partitions, which replace their committed version 2;
* batch 2: the processor raises from ``close`` (after its last key, just before the commit)
  in the first attempt of a partition; then the sink fails after the batch committed,
  and the query is started again, which re-runs batch 2 on executors that still hold the
  first run's version 3 in their working copies;
* batch 3: runs on whichever executor, from the re-runs' state.

Each attempt logs, from ``close``, the order it appended per key and the Spark task attempt
id. The state of (batch, partition) must equal the order of the newest attempt that got as
far as committing, and each sink row (a key's whole list after its batch) must be a prefix
of the final list. The module starts its own ``local-cluster`` session; it also runs
``coalesce(1)`` and ``union`` after the operator there (tests/spark/test_partitioning.py
runs them on ``local[2]``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark import TaskContext
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession

from statekeeper.spark import (
    StatefulProcessor,
    StatefulProcessorHandle,
    read_state,
    transform_with_state,
)
from tests.spark.conftest import SparkHolder
from tests.spark.helpers import (
    OUTPUT_SCHEMA,
    Rows,
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
BATCHES = 4
FILES_PER_BATCH = 4
ROWS_PER_FILE = 24
KEYS = 12
MID_BATCH, KILL_BATCH, CLOSE_BATCH = 0, 1, 2
MID_PARTITIONS, CLOSE_PARTITIONS = (1,), (2,)
LIST_SCHEMA = "k string, batch long, count long, values string"
NAME = "arrivals"


@pytest.fixture(scope="module")
def cluster(no_classic_session: SparkHolder) -> Iterator[SparkSession]:
    """A ``local-cluster[2,1,1024]`` session for the module."""
    with local_cluster("statekeeper-cluster-order-tests", sys.modules[__name__]) as session:
        yield session


def _first_time(marker_dir: str, name: str) -> bool:
    """True exactly once per ``name`` across all processes (an exclusive create)."""
    try:
        os.close(os.open(os.path.join(marker_dir, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _executor_jvm() -> int:
    """The pid of the executor JVM this Python worker descends from (0 if none)."""
    pid = os.getpid()
    while pid > 1:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return 0
        if b"CoarseGrainedExecutorBackend" in cmdline:
            return pid
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: ppid
    return 0


class AppendInArrivalOrder(StatefulProcessor):
    """Appends each row's ``v`` to the key's list in arrival order; emits the whole list.

    Raises once (across attempts and stage retries) in chosen (batch, partition)s: after the
    first key (``mid``) or from ``close`` (``close``). Every attempt that reaches ``close``
    logs the order it appended, per key, into ``log_dir``."""

    rows = "row"

    def __init__(self, log_dir: str, mid: set[tuple[int, int]], close: set[tuple[int, int]]):
        self.log_dir = log_dir
        self.mid = mid
        self.close_fail = close

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.values = handle.list_state("values")
        self.order: dict[str, list[int]] = {}

    def _inject(self, kind: str) -> bool:
        where = (self.handle.batch_id, self.handle.partition)
        targets = self.mid if kind == "mid" else self.close_fail
        return where in targets and _first_time(self.log_dir, f"{kind}-{where[0]}-{where[1]}")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        arrived = [int(r.v) for r in rows]
        self.values.extend(arrived)
        self.order[key[0]] = arrived
        if self._inject("mid"):
            raise RuntimeError(f"injected failure after key {key[0]}")
        every = self.values.get()
        yield (key[0], self.handle.batch_id, len(every), json.dumps(every))

    def close(self) -> None:
        tc = TaskContext.get()
        assert tc is not None
        raised = self._inject("close")
        log = {
            "batch": self.handle.batch_id,
            "partition": self.handle.partition,
            "task": tc.taskAttemptId(),
            "executor": _executor_jvm(),
            "raised": raised,
            "order": self.order,
        }
        name = f"log-{self.handle.batch_id}-{self.handle.partition}-{tc.taskAttemptId()}.json"
        Path(self.log_dir, name).write_text(json.dumps(log))
        if raised:
            raise RuntimeError("injected failure in close, before the commit")


def _input() -> list[Rows]:
    """One list of rows per file; values are unique and name their batch (``v // 1000``)."""
    rng = random.Random(1212)
    return [
        [(f"key-{rng.randrange(KEYS):02d}", b * 1000 + f * 100 + i) for i in range(ROWS_PER_FILE)]
        for b in range(BATCHES)
        for f in range(FILES_PER_BATCH)
    ]


def _logs(log_dir: Path) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """Each (batch, partition)'s logged attempts, oldest first."""
    found: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for path in log_dir.glob("log-*.json"):
        log = json.loads(path.read_text())
        found.setdefault((log["batch"], log["partition"]), []).append(log)
    return {where: sorted(logs, key=lambda g: g["task"]) for where, logs in found.items()}


def _lists(state: DataFrame) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Each key's list, in list order, and its partition, from ``read_state``."""
    entries: dict[str, dict[int, int]] = {}
    partition: dict[str, int] = {}
    for r in state.collect():
        assert r["state"] == "values", r
        entries.setdefault(r["k"], {})[int(r["entry"])] = json.loads(r["value"])
        partition[r["k"]] = r["partition"]
    return {k: [v for _, v in sorted(e.items())] for k, e in entries.items()}, partition


def _kill_an_executor_of(
    log_dir: Path, batch: int, app_id: str, killed: list[int], timeout: float = 90
) -> None:
    """SIGKILL an executor JVM that ran a task of ``batch``; wait for its replacement."""
    ran = sorted(
        {g["executor"] for (b, _), logs in _logs(log_dir).items() if b == batch for g in logs}
    )
    alive = executor_pids(app_id)
    victim = next(pid for pid in ran if pid in alive)
    os.kill(victim, signal.SIGKILL)
    killed.append(victim)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = executor_pids(app_id)
        if len(pids) == 2 and victim not in pids:
            return  # the driver has heard of the loss: the worker started another
        time.sleep(0.2)
    raise AssertionError(f"no executor replaced the killed {victim} in {timeout} s")


def _finish(query: Any, timeout: float = 420) -> None:
    """Wait for an ``availableNow`` query to end; a query still running then has wedged.

    Raises:
        StreamingQueryException: the query failed.
    """
    if not query.awaitTermination(timeout):
        query.stop()
        pytest.fail(f"the query wedged: not done with every available batch in {timeout} s")


def _segments(values: list[int]) -> dict[int, list[int]]:
    """A list split by the batch each value names, checking each batch's values are
    contiguous (batch after batch)."""
    batches = [v // 1000 for v in values]
    assert batches == sorted(batches), f"batches interleave in the list: {batches}"
    found: dict[int, list[int]] = {}
    for v, b in zip(values, batches, strict=True):
        found.setdefault(b, []).append(v)
    return found


def test_an_order_sensitive_state_is_one_attempts_order_per_batch(
    cluster: SparkSession, s3_root: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    root, options = s3_root
    files = _input()
    write_files(tmp_path / "in", files)
    logs_dir, out = tmp_path / "logs", tmp_path / "out"
    logs_dir.mkdir()
    app_id = cluster.sparkContext.applicationId
    killed: list[int] = []
    sink_failed: list[int] = []

    def sink(batch: DataFrame, batch_id: int) -> None:
        if batch_id == KILL_BATCH and not killed:
            batch.count()  # runs the stateful tasks: every partition commits version 2
            _kill_an_executor_of(logs_dir, batch_id, app_id, killed)
        if batch_id == CLOSE_BATCH and not sink_failed:
            batch.count()
            sink_failed.append(batch_id)
            raise RuntimeError(f"the sink failed after batch {batch_id} committed")
        # The second action: after the kill, the lost map outputs are computed again.
        batch.write.mode("overwrite").parquet(str(out / f"{batch_id}"))

    processor = AppendInArrivalOrder(
        str(logs_dir),
        mid={(MID_BATCH, p) for p in MID_PARTITIONS},
        close={(CLOSE_BATCH, p) for p in CLOSE_PARTITIONS},
    )

    def start() -> Any:
        df = read_stream(cluster, tmp_path / "in", files_per_batch=FILES_PER_BATCH)
        listed = transform_with_state(
            df, "k", processor, LIST_SCHEMA, root, NAME, PARTITIONS, storage_options=options
        )
        return (
            listed.writeStream.foreachBatch(sink)
            .option("checkpointLocation", str(tmp_path / "ck"))
            .trigger(availableNow=True)
            .start()
        )

    # One map task per file (not two files per task), on either executor.
    cluster.conf.set("spark.sql.files.maxPartitionBytes", "1k")
    try:
        query = start()
        with pytest.raises(StreamingQueryException, match=f"sink failed after batch {CLOSE_BATCH}"):
            _finish(query)
        query = start()
        _finish(query)
        assert query.exception() is None
    finally:
        cluster.conf.unset("spark.sql.files.maxPartitionBytes")

    # Every failure was injected, and every batch reached the sink.
    injected = {p.name for p in logs_dir.iterdir() if not p.name.startswith("log-")}
    assert injected == {f"mid-{MID_BATCH}-{p}" for p in MID_PARTITIONS} | {
        f"close-{CLOSE_BATCH}-{p}" for p in CLOSE_PARTITIONS
    }
    assert len(killed) == 1
    assert sorted(int(d.name) for d in out.iterdir()) == list(range(BATCHES))

    expected: dict[tuple[str, int], list[int]] = {}  # (key, batch) -> its values
    for rows in files:
        for k, v in rows:
            expected.setdefault((k, v // 1000), []).append(v)
    wait_for_epoch(cluster, query, BATCHES - 1)
    final, partition_of = _lists(read_state(cluster, root, NAME, storage_options=options))

    # One ordering per batch: a key's list is its batches one after the other, each a
    # permutation of that batch's rows, every row exactly once.
    for k, values in final.items():
        segments = _segments(values)
        assert {b: sorted(s) for b, s in segments.items()} == {
            b: sorted(v) for (key, b), v in expected.items() if key == k
        }, k
    assert set(final) == {k for k, _ in expected}

    # ... and it is the order of the newest attempt that committed, whole, in every
    # partition: not a mix of two attempts.
    logs = _logs(logs_dir)
    for b in range(BATCHES):
        for p in range(PARTITIONS):
            attempts = [g for g in logs.get((b, p), []) if not g["raised"]]
            keys = {k for k, bb in expected if bb == b and partition_of[k] == p}
            if not keys:
                continue
            newest = attempts[-1]["order"]
            assert set(newest) == keys, (b, p)
            assert {k: _segments(final[k])[b] for k in keys} == newest, (b, p, len(attempts))
    # The killed executor's partitions of batch 1 ran again after their commit, and the
    # restart ran batch 2 again everywhere.
    victims = [p for p in range(PARTITIONS) if logs[(KILL_BATCH, p)][0]["executor"] == killed[0]]
    assert victims
    # (At least: a retry for another cause is allowed, the newest attempt's order is checked.)
    runs = {
        (b, p): len([g for g in logs[(b, p)] if not g["raised"]])
        for b, partitions in ((KILL_BATCH, victims), (CLOSE_BATCH, range(PARTITIONS)))
        for p in partitions
    }
    assert min(runs.values()) >= 2, runs

    # The sink saw what the state holds: each (key, batch) once, its whole list then, a
    # prefix of the final list as long as the key's rows up to that batch.
    sink_rows = cluster.read.parquet(*[str(d) for d in sorted(out.iterdir())]).collect()
    written = {(r["k"], r["batch"]): (r["count"], json.loads(r["values"])) for r in sink_rows}
    assert len(written) == len(sink_rows) == len(expected)
    for (k, b), (count, values) in written.items():
        upto = sum(len(v) for (key, bb), v in expected.items() if key == k and bb <= b)
        assert count == upto == len(values), (k, b)
        assert values == final[k][:count], (k, b)

    # The replaced version 2 reads back as the re-run's, the prefix through batch 1.
    v2, _ = _lists(read_state(cluster, root, NAME, version=KILL_BATCH + 1, storage_options=options))
    assert v2 == {
        k: [v for v in values if v // 1000 <= KILL_BATCH]
        for k, values in final.items()
        if any(v // 1000 <= KILL_BATCH for v in values)
    }


def test_coalesce_and_union_after_operators_keep_exact_state(
    cluster: SparkSession, s3_root: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    """Two operators on one S3 root, unioned and coalesced to one output task, on two
    executors: both states and the sink equal a batch groupBy."""
    root, options = s3_root
    inp = tmp_path / "in"
    write_files(inp, make_input(seed=12, files=3, rows=20, keys=5))
    first, second = (
        transform_with_state(
            read_stream(cluster, inp),
            ["k"],
            RunningCountSum(),
            OUTPUT_SCHEMA,
            root,
            name,
            5,
            storage_options=options,
        )
        for name in ("first", "second")
    )
    query = run_to_end(first.union(second).coalesce(1), tmp_path / "out", tmp_path / "ck", 240)
    wait_for_epoch(cluster, query, 2)
    expected = batch_totals(cluster, inp)
    for name in ("first", "second"):
        assert state_totals(read_state(cluster, root, name, storage_options=options)) == expected
    assert sink_latest(cluster, tmp_path / "out") == expected
