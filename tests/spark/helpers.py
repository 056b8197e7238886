"""Input files, streaming runs and expected results shared by the Spark tests."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from pyspark import cloudpickle
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from statekeeper import StateBackend
from statekeeper.manifest import read_newest_manifest
from statekeeper.spark import state_listener
from tests.spark.connect_server import SPARK_HOME

INPUT_SCHEMA = "k string, v long"
OUTPUT_SCHEMA = "k string, count long, sum long"

Rows = list[tuple[str, int]]


def make_input(seed: int, files: int, rows: int = 30, keys: int = 10) -> list[Rows]:
    """``files`` batches of (key, value) rows; keys repeat within and across batches."""
    rng = random.Random(seed)
    return [
        [(f"key-{rng.randrange(keys):02d}", rng.randrange(-50, 100)) for _ in range(rows)]
        for _ in range(files)
    ]


def write_files(folder: Path, batches: list[Rows], start: int = 0) -> None:
    """One JSON-lines file per batch, with increasing modification times (the order the
    file source reads them in)."""
    folder.mkdir(parents=True, exist_ok=True)
    base = time.time() - 1000
    for i, rows in enumerate(batches, start):
        path = folder / f"part-{i:04d}.json"
        tmp = folder / f".part-{i:04d}.tmp"
        tmp.write_text("".join(json.dumps({"k": k, "v": v}) + "\n" for k, v in rows))
        os.utime(tmp, (base + i, base + i))
        tmp.rename(path)


def read_stream(spark: SparkSession, folder: Path, files_per_batch: int = 1) -> DataFrame:
    """The input folder (created if missing) as a stream, ``files_per_batch`` files per
    micro-batch."""
    folder.mkdir(parents=True, exist_ok=True)
    reader = spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", files_per_batch)
    return reader.json(str(folder))


def run_to_end(
    out: DataFrame, sink: Path, checkpoint: Path, timeout: float = 120
) -> StreamingQuery:
    """Run ``out`` into a parquet sink until every available file is processed."""
    query = (
        out.writeStream.format("parquet")
        .option("path", str(sink))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    finished = query.awaitTermination(timeout)
    assert finished, "the streaming query did not finish in time"
    if query.exception() is not None:
        raise AssertionError(f"query failed: {query.exception()}")
    return query


def wait_for_epoch(
    spark: SparkSession, query: StreamingQuery, batch_id: int, timeout: float = 120
) -> None:
    """Wait until the session's listener has written the epoch manifest of ``batch_id``.

    ``read_state`` without a version reads the newest manifest's cut, and the listener
    writes it on a background thread after the batch's progress event, which Spark delivers
    asynchronously: ``awaitTermination`` may return before the last batch's manifest exists.
    """
    listener = state_listener(spark)
    listener.wait_for(str(query.id), batch_id, timeout)
    listener.flush(timeout)


def batch_totals(spark: SparkSession, folder: Path) -> dict[str, tuple[int, int]]:
    """Count and sum per key over all input, by a batch groupBy."""
    rows = (
        spark.read.schema(INPUT_SCHEMA)
        .json(str(folder))
        .groupBy("k")
        .agg(F.count("*").alias("n"), F.sum("v").alias("s"))
        .collect()
    )
    return {r["k"]: (r["n"], r["s"]) for r in rows}


def sink_latest(spark: SparkSession, sink: Path) -> dict[str, tuple[int, int]]:
    """The latest (highest-count) output row per key in the sink."""
    latest: dict[str, tuple[int, int]] = {}
    for r in spark.read.parquet(str(sink)).collect():
        if r["k"] not in latest or r["count"] > latest[r["k"]][0]:
            latest[r["k"]] = (r["count"], r["sum"])
    return latest


def state_totals(state: DataFrame) -> dict[str, tuple[int, int]]:
    """Count and sum per key from a read_state DataFrame of RunningCountSum."""
    found: dict[str, dict[str, Any]] = {}
    for r in state.collect():
        found.setdefault(r["k"], {})[r["state"]] = json.loads(r["value"])
    return {k: (v["count"], v["sum"]) for k, v in found.items()}


def version_owners(root: str, operator: str, partitions: int) -> list[list[str]]:
    """Per partition, the owner of every version its newest store manifest retains."""
    with StateBackend(root) as backend:
        metadata = backend.root_metadata()
        assert metadata is not None
        owners = []
        for p in range(partitions):
            manifest = read_newest_manifest(
                backend.blobs, root_id=metadata.root_id, operator=operator, partition=p
            )
            assert manifest is not None
            owners.append([e.owner for e in manifest.versions])
        return owners


@contextlib.contextmanager
def pickled_by_value(module: ModuleType) -> Iterator[None]:
    """Spark's workers cannot import a test module: its classes travel by value meanwhile."""
    cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        cloudpickle.unregister_pickle_by_value(module)


@contextlib.contextmanager
def local_cluster(app_name: str, module: ModuleType) -> Iterator[SparkSession]:
    """A ``local-cluster[2,1,1024]`` session (two executor JVMs, 8 attempts per task) whose
    workers unpickle ``module``'s classes by value; the caller has stopped any other
    session (one SparkContext per process)."""
    saved = os.environ.get("SPARK_HOME")
    os.environ["SPARK_HOME"] = SPARK_HOME
    stack = contextlib.ExitStack()
    stack.enter_context(pickled_by_value(module))
    session = (
        SparkSession.builder.master("local-cluster[2,1,1024]")
        .appName(app_name)
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
        .config("spark.task.maxFailures", "8")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        # getOrCreate returns before the workers have launched both executor JVMs (on a
        # loaded machine one came up seconds later): the tests count and kill them.
        app_id = session.sparkContext.applicationId
        deadline = time.monotonic() + 120
        while len(executor_pids(app_id)) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(executor_pids(app_id)) == 2, "local-cluster[2,1,1024] started no 2 executors"
        yield session
    finally:
        session.stop()
        stack.close()
        if saved is None:
            os.environ.pop("SPARK_HOME", None)
        else:
            os.environ["SPARK_HOME"] = saved


def executor_pids(app_id: str) -> list[int]:
    """Pids of this application's executor JVMs (by their command lines)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [w.decode(errors="replace") for w in cmdline]
        if "org.apache.spark.executor.CoarseGrainedExecutorBackend" in words and app_id in words:
            found.append(int(entry.name))
    return sorted(found)


T0 = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)


def write_event_files(folder: Path, batches: list[list[tuple[str, int]]], start: int = 0) -> None:
    """One JSON-lines file per batch of (key, seconds after T0): rows ``k string, ts timestamp``
    for event-time tests, written with increasing mtimes so a stream reads them in order."""
    folder.mkdir(parents=True, exist_ok=True)
    base = time.time() - 1000
    for i, rows in enumerate(batches, start):
        lines = [
            json.dumps({"k": k, "ts": (T0 + dt.timedelta(seconds=s)).isoformat()}) for k, s in rows
        ]
        tmp = folder / f".{i}.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        os.utime(tmp, (base + i, base + i))
        tmp.rename(folder / f"part-{i:04d}.json")


def has_heartbeats(df: DataFrame) -> bool:
    """Whether the plan of ``df`` (an operator's output) holds the heartbeat pass, as
    ``DataFrame.explain`` prints it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        df.explain()
    return "__statekeeper_heartbeat" in out.getvalue()


def json_key_names(doc: object) -> set[str]:
    """Every key of every object in a decoded JSON document, however deep."""
    if isinstance(doc, dict):
        return set(doc) | {k for v in doc.values() for k in json_key_names(v)}
    if isinstance(doc, list):
        return {k for v in doc for k in json_key_names(v)}
    return set()
