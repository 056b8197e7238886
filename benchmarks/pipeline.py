"""Pipeline benchmark: one stateful streaming workload, statekeeper against Spark's own state.

The workload keeps a running count and sum of ``v`` per key ``k`` over a file source:
``--batches`` Parquet files of ``--rows`` rows over ``--keys`` random keys, one file per
micro-batch, each new total emitted to a Parquet sink. The same input runs, side by side in
one process, through the variants named by ``--variants``:

* ``sk_row``: statekeeper ``transform_with_state``, Row form (``rows = "row"``);
* ``sk_pandas``: statekeeper ``transform_with_state``, pandas form (yields rows);
* ``sk_arrow``: statekeeper ``transform_with_state_arrow`` (vectorized, whole Arrow batches);
* ``sk_arrow_no_state``: the same operator and the same per-batch aggregation, but it reads
  and writes no state (its stores commit empty versions; its totals are per batch): what the
  vectorized form costs with the state taken out, between it and the ceiling;
* ``spark_tws_row``: Spark's Row-based ``transformWithState`` (4.1+), RocksDB state store
  provider with changelog checkpointing;
* ``spark_tws_pandas``: Spark's ``transformWithStateInPandas`` on the same provider;
* ``spark_apply``: Spark's ``applyInPandasWithState`` on the same provider;
* ``ceiling``: the same source, ``repartition`` by key, a pass-through ``mapInArrow`` and the
  same sink, no state: the physical limit of this pipeline shape.

Spark's own operators are slow per key, so they may read only the first ``--peer-batches``
files (default: all); their rows/s are per row they read. Each variant runs in a
SparkSession of its own (``local[2]``, shuffle partitions = state partitions = 4; Python
workers die with the session). The JVM outlives the sessions, so before any variant is
measured each one runs its query over the first ``--warm-batches`` files (default 2) in a
folder of its own: otherwise the variant run first pays alone for compiling the code
paths that the others reuse. Measured per variant: wall time, per-batch latency
(``triggerExecution`` and ``addBatch`` of the query progress), rows/s, bytes on disk of the
durable state and of the query checkpoint, and two restarts, each in a new session that
processes one more file: ``restart_warm`` keeps statekeeper's local working copies,
``restart_cold`` gives statekeeper a fresh local directory (everything restored from the
root, on the local filesystem with a warm page cache; Spark's provider always loads from its
checkpoint in a new session). Finally every stateful variant's latest sink row per key is
compared with a batch ``groupBy`` over the input it read (``sk_arrow_no_state``'s counts
with the rows it read). ``ratios`` divides each variant's steady rows/s by the best Spark
peer's, and the vectorized form's (with and without state) by the ceiling's.

    .venv/bin/python benchmarks/pipeline.py [--rows 100000] [--keys 1000000] [--batches 10]
        [--peer-batches 3] [--variants sk_row sk_pandas sk_arrow sk_arrow_no_state
        spark_tws_row spark_tws_pandas spark_apply ceiling] [--restarts warm cold] [--rounds 1]
        [--warm-batches 2] [--anatomy] [--out FILE]

``--anatomy`` turns Spark's UI on (for every variant alike) and adds to each variant where
its micro-batches spend their time, read from Spark's monitoring REST API: the Spark jobs
of a batch and their durations, the driver's time between them, and its time after the
batch's last job until the next batch's first (sink commit, offset and commit logs,
planning); for statekeeper's forms also how many stores each batch had to open (a partition
whose task ran in another Python worker than last time) and the commit p50. Medians over
the batches after the first.

``--rounds N`` runs the variants N times in turn (the first round is the one reported in
full) and adds the per-round rows/s, their medians and the median of each round's
vectorized / ceiling ratio: on a machine whose load swings, a ratio of two variants run
next to each other is steadier than one of two runs minutes apart.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import itertools
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd  # type: ignore[import-untyped]
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
from _output import emit

PARTITIONS = 4
MASTER = "local[2]"
INPUT_SCHEMA = "k string, v long"
OUTPUT_SCHEMA = "k string, count long, sum long"
STATE_SCHEMA = "count long, sum long"
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
SPARK_CONF = {
    "spark.sql.shuffle.partitions": str(PARTITIONS),
    "spark.default.parallelism": "2",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.session.timeZone": "UTC",
    "spark.driver.memory": "3g",
    "spark.sql.streaming.stopTimeout": "60s",
    "spark.sql.streaming.noDataMicroBatches.enabled": "false",
    "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
    "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
}
VARIANTS = {
    "sk_row": "statekeeper transform_with_state, Row form",
    "sk_pandas": "statekeeper transform_with_state, pandas form",
    "sk_arrow": "statekeeper transform_with_state_arrow (vectorized)",
    "sk_arrow_no_state": "the same operator and aggregation, no state read or written",
    "spark_tws_row": "Spark transformWithState, Row-based (RocksDB, changelog checkpointing)",
    "spark_tws_pandas": "Spark transformWithStateInPandas (RocksDB, changelog checkpointing)",
    "spark_apply": "Spark applyInPandasWithState (RocksDB, changelog checkpointing)",
    "ceiling": "no state: repartition by key + pass-through mapInArrow (the ceiling)",
}
PEERS = ("spark_tws_row", "spark_tws_pandas", "spark_apply")
STATELESS = ("ceiling",)
PER_BATCH = ("sk_arrow_no_state",)
"""Variants whose output is per-batch totals: checked by counting every input row once."""
TO_CEILING = ("sk_arrow", "sk_arrow_no_state")
"""Variants whose steady rows/s are also divided by the ceiling's."""
_TOTALS = np.dtype("<i8")
_VALUE = np.dtype("V16")  # (count, sum): the raw 16 bytes, trailing zeros kept

# -- the workload, once per API (run inside Spark's Python workers) ------------------------


def _make_sk_processor(form: str) -> Any:
    from statekeeper.spark import StatefulProcessor

    class RowTotals(StatefulProcessor):
        """Running count and sum per key, Row form: one value state holding ``(count, sum)``."""

        rows = "row"

        def init(self, handle: Any) -> None:
            self.totals = handle.value_state("totals")

        def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
            n, s = self.totals.get() or (0, 0)
            n, s = n + len(rows), s + sum(row.v for row in rows)
            self.totals.update((n, s))
            yield (key[0], n, s)

    class PandasTotals(StatefulProcessor):
        """The same, pandas form: ``rows`` is a DataFrame; the output row is a tuple."""

        def init(self, handle: Any) -> None:
            self.totals = handle.value_state("totals")

        def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
            n, s = self.totals.get() or (0, 0)
            n, s = n + len(rows), s + int(rows["v"].sum())
            self.totals.update((n, s))
            yield (key[0], n, s)

    return RowTotals() if form == "row" else PandasTotals()


def sk_arrow_totals(store: Any, batches: Iterator[Any]) -> Iterator[Any]:
    """Vectorized running totals: one group-by, one multi_get and one put_many per partition.

    State values are ``(count, sum)`` as two little-endian int64 (16 bytes). Keys are encoded
    by Arrow kernels (``store.state_keys``: the key group Spark computed, then the key); the
    only Python loops are the store calls.
    """
    from statekeeper.spark import KEY_GROUP_COLUMN

    table = pa.Table.from_batches(list(batches))
    if table.num_rows == 0:
        return
    # Sorted by key group then key: the store's key order, which RocksDB's multi-get and the
    # commit's sort are fastest on. One thread: Spark runs a task per core already.
    grouped = (
        table.group_by([KEY_GROUP_COLUMN, "k"], use_threads=False)
        .aggregate([("v", "count"), ("v", "sum")])
        .sort_by([(KEY_GROUP_COLUMN, "ascending"), ("k", "ascending")])
    )
    names = grouped.column("k")
    keys = store.state_keys(grouped, ["k"])
    zero = bytes(16)
    old = np.frombuffer(b"".join([v or zero for v in store.multi_get(keys)]), dtype=_TOTALS)
    totals = old.reshape(-1, 2) + np.column_stack(
        [grouped.column("v_count").to_numpy(), grouped.column("v_sum").to_numpy()]
    ).astype(_TOTALS)
    # One 16-byte value per row, as bytes objects made by numpy (no Python loop).
    values = np.ascontiguousarray(totals).view(_VALUE).ravel().tolist()
    store.put_many(keys, values)
    yield pa.RecordBatch.from_arrays(
        [names.combine_chunks(), pa.array(totals[:, 0]), pa.array(totals[:, 1])],
        names=["k", "count", "sum"],
    )


def sk_arrow_no_state(store: Any, batches: Iterator[Any]) -> Iterator[Any]:
    """``sk_arrow_totals`` without the state: the same group-by, per-batch totals out; the
    store is not touched (the operator still commits its empty version)."""
    table = pa.Table.from_batches(list(batches))
    if table.num_rows == 0:
        return
    grouped = table.group_by("k", use_threads=False).aggregate([("v", "count"), ("v", "sum")])
    yield pa.RecordBatch.from_arrays(
        [grouped.column(n).combine_chunks() for n in ("k", "v_count", "v_sum")],
        names=["k", "count", "sum"],
    )


def passthrough(batches: Iterator[Any]) -> Iterator[Any]:
    """The ceiling's ``mapInArrow`` function: every batch out as it came in."""
    yield from batches


def _make_spark_processor(form: str) -> Any:
    from pyspark.sql import Row
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class SparkRowTotals(StatefulProcessor):
        """The Row-based API (``transformWithState``): rows and output are ``Row``\\ s."""

        def init(self, handle: Any) -> None:
            self.totals = handle.getValueState("totals", STATE_SCHEMA)

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            n = s = 0
            for row in rows:
                n, s = n + 1, s + row.v
            old = self.totals.get()
            if old is not None:
                n, s = n + old[0], s + old[1]
            self.totals.update((n, s))
            yield Row(k=key[0], count=n, sum=s)

        def close(self) -> None:
            pass

    class SparkRunningTotals(StatefulProcessor):
        """The same totals with Spark's own handle: one value state ``(count, sum)``."""

        def init(self, handle: Any) -> None:
            self.totals = handle.getValueState("totals", STATE_SCHEMA)

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            n = s = 0
            for frame in rows:
                n, s = n + len(frame), s + int(frame["v"].sum())
            old = self.totals.get()  # None when absent: one call instead of exists() + get()
            if old is not None:
                n, s = n + old[0], s + old[1]
            self.totals.update((n, s))
            yield pd.DataFrame({"k": [key[0]], "count": [n], "sum": [s]})

        def close(self) -> None:
            pass

    return SparkRowTotals() if form == "row" else SparkRunningTotals()


def spark_apply_totals(key: Any, frames: Iterator[Any], state: Any) -> Iterator[Any]:
    """The same totals with ``applyInPandasWithState``'s GroupState."""
    n = s = 0
    for frame in frames:
        n, s = n + len(frame), s + int(frame["v"].sum())
    if state.exists:
        n0, s0 = state.get
        n, s = n + n0, s + s0
    state.update((n, s))
    yield pd.DataFrame({"k": [key[0]], "count": [n], "sum": [s]})


# -- input, sessions, queries ----------------------------------------------------------------


def write_input(folder: Path, files: range, rows: int, keys: int, seed: int) -> None:
    """Parquet files of ``rows`` random (k, v) rows, mtimes increasing (the read order)."""
    folder.mkdir(parents=True, exist_ok=True)
    base = time.time() - 100_000
    for i in files:
        rng = np.random.default_rng([seed, i])
        ids = rng.integers(0, keys, rows)
        table = pa.table(
            {
                "k": pa.array([f"k{i}" for i in ids.tolist()], pa.string()),
                "v": pa.array(rng.integers(0, 1000, rows), pa.int64()),
            }
        )
        tmp, path = folder / f".part-{i:05d}.tmp", folder / f"part-{i:05d}.parquet"
        pq.write_table(table, tmp)
        os.utime(tmp, (base + i, base + i))
        tmp.rename(path)


def _session(local_dir: Path) -> Any:
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(MASTER).appName("statekeeper-bench-pipeline")
    for key, value in {**SPARK_CONF, "spark.local.dir": str(local_dir)}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _stateful(spark: Any, variant: str, inp: Path, work: Path, local: str) -> Any:
    """The streaming DataFrame of ``variant`` over the input folder."""
    from pyspark.sql.streaming.state import GroupStateTimeout

    import statekeeper as sk
    from statekeeper.spark import transform_with_state, transform_with_state_arrow

    df = spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(inp))
    root, config = str(work / "sk-root" / variant), sk.StoreConfig(local_dir=local)
    if variant in ("sk_row", "sk_pandas"):
        processor = _make_sk_processor("row" if variant == "sk_row" else "pandas")
        return transform_with_state(
            df, "k", processor, OUTPUT_SCHEMA, root, "totals", PARTITIONS, config=config
        )
    if variant in ("sk_arrow", "sk_arrow_no_state"):
        fn = sk_arrow_totals if variant == "sk_arrow" else sk_arrow_no_state
        return transform_with_state_arrow(
            df, "k", fn, OUTPUT_SCHEMA, root, "totals", PARTITIONS, config=config
        )
    if variant == "ceiling":
        return df.repartition(PARTITIONS, "k").mapInArrow(passthrough, INPUT_SCHEMA)
    if variant in ("spark_tws_row", "spark_tws_pandas"):
        grouped = df.groupBy("k")
        api = (
            grouped.transformWithState
            if variant == "spark_tws_row"
            else (grouped.transformWithStateInPandas)
        )
        return api(
            statefulProcessor=_make_spark_processor("row" if variant == "spark_tws_row" else ""),
            outputStructType=OUTPUT_SCHEMA,
            outputMode="Append",
            timeMode="None",
        )
    return df.groupBy("k").applyInPandasWithState(
        spark_apply_totals, OUTPUT_SCHEMA, STATE_SCHEMA, "Append", GroupStateTimeout.NoTimeout
    )


def _input_of(work: Path, variant: str) -> Path:
    """The folder ``variant`` reads: Spark's peers may read only the first files."""
    return work / ("input-peers" if variant in PEERS else "input")


def _run_query(spark: Any, variant: str, work: Path, local: str) -> dict[str, Any]:
    """Run ``variant`` until every input file is processed; time it and its batches."""
    out = _stateful(spark, variant, _input_of(work, variant), work, local)
    started_epoch, started = time.time(), time.perf_counter()
    query = (
        out.writeStream.format("parquet")
        .option("path", str(work / "sink" / variant))
        .option("checkpointLocation", str(work / "ckpt" / variant))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    wall_s = time.perf_counter() - started
    if query.exception() is not None:
        raise RuntimeError(f"{variant}: the query failed: {query.exception()}")
    progress = query.recentProgress
    first = progress[0]
    first_done = _epoch_s(first.timestamp) + first.durationMs["triggerExecution"] / 1000
    result: dict[str, Any] = {
        "wall_s": round(wall_s, 2),
        "first_batch_s": round(first_done - started_epoch, 2),
        "rows": sum(p.numInputRows for p in progress),
        "batch_rows": [p.numInputRows for p in progress],
        "batch_ms": [p.durationMs.get("triggerExecution", 0) for p in progress],
        "add_batch_ms": [p.durationMs.get("addBatch", 0) for p in progress],
    }
    if variant.startswith("sk_"):
        result.update(_sk_state_metrics(spark, str(query.id), [p.batchId for p in progress]))
    elif variant in PEERS:
        result.update(_spark_state_metrics(progress))
    else:
        result["commit_ms"] = [0.0 for _ in progress]
    if _anatomy_on():
        result["anatomy"] = _anatomy(spark, str(query.runId), result)
    return result


def _anatomy(spark: Any, run_id: str, run: dict[str, Any]) -> dict[str, Any]:
    """Where the steady micro-batches of run ``run_id`` spent their time (see the module
    docstring), from Spark's monitoring REST API."""
    url = spark.sparkContext.uiWebUrl
    app = spark.sparkContext.applicationId
    with urllib.request.urlopen(f"{url}/api/v1/applications/{app}/jobs") as response:
        jobs = json.load(response)
    by_batch: dict[int, list[tuple[float, float]]] = {}
    for job in jobs:
        # A streaming job's description names its run and micro-batch.
        described = job.get("description") or ""
        found = re.search(r"batch = (\d+)", described)
        if run_id in described and found and "completionTime" in job:
            span = (_rest_time(job["submissionTime"]), _rest_time(job["completionTime"]))
            by_batch.setdefault(int(found.group(1)), []).append(span)
    batches = sorted(by_batch)
    per_batch = []
    for batch in batches[1:]:  # the first batch also starts the Python workers
        spans = sorted(by_batch[batch])
        following = by_batch.get(batch + 1)
        per_batch.append(
            {
                "jobs_ms": [round((end - start) * 1000) for start, end in spans],
                "between_jobs_ms": round(
                    sum(b[0] - a[1] for a, b in itertools.pairwise(spans)) * 1000
                ),
                "after_last_job_ms": None
                if following is None
                else round((min(following)[0] - spans[-1][1]) * 1000),
            }
        )

    def median(values: list[Any]) -> float | None:
        values = [v for v in values if v is not None]
        return round(statistics.median(values)) if values else None

    jobs_per_batch = max((len(b["jobs_ms"]) for b in per_batch), default=0)
    out: dict[str, Any] = {
        "jobs_per_batch": jobs_per_batch,
        "job_ms_median": [
            median([b["jobs_ms"][i] for b in per_batch if len(b["jobs_ms"]) > i])
            for i in range(jobs_per_batch)
        ],
        "between_jobs_ms_median": median([b["between_jobs_ms"] for b in per_batch]),
        "after_last_job_ms_median": median([b["after_last_job_ms"] for b in per_batch]),
        "batch_ms_median": median(run["batch_ms"][1:]),
        "batches": per_batch,
    }
    if "stores_opened" in run:
        out["stores_opened_per_batch"] = run["stores_opened"][1:]
        out["state_commit_p50_ms_median"] = median(run["commit_ms"][1:])
    return out


def _anatomy_on() -> bool:
    """``--anatomy``: every session has Spark's UI, whose REST API tells the jobs' times."""
    return SPARK_CONF["spark.ui.enabled"] == "true"


def _rest_time(stamp: str) -> float:
    """Seconds since the epoch of a monitoring API time (``2026-11-24T04:23:01.123GMT``)."""
    parsed = dt.datetime.strptime(stamp.removesuffix("GMT"), "%Y-%m-%dT%H:%M:%S.%f")
    return parsed.replace(tzinfo=dt.UTC).timestamp()


def _sk_state_metrics(spark: Any, query_id: str, batch_ids: list[int]) -> dict[str, Any]:
    """Commit latency per batch and what opening the stores cost in the first batch."""
    from statekeeper.spark import state_listener

    listener = state_listener(spark)
    metrics = [listener.wait_for(query_id, b)[0] for b in batch_ids]
    opened = metrics[0]
    return {
        "commit_ms": [round(m.commit_latency_p50_s * 1000, 1) for m in metrics],
        # Stores a batch had to open: its task ran in another Python worker than last time.
        "stores_opened": [m.stores_opened for m in metrics],
        # The slowest task of the operator's stage (our part of the batch), per batch.
        "task_max_ms": [round(m.task_time_max_s * 1000) for m in metrics],
        "restore": {
            "stores_restored": opened.stores_restored,
            "restore_time_max_s": round(opened.restore_time_max_s, 3),
            "restore_bytes": opened.restore_bytes,
        },
    }


def _spark_state_metrics(progress: list[Any]) -> dict[str, Any]:
    """The RocksDB provider's commit latency per batch (its metrics are sums over the
    partitions: divided by the partition count here) and what the first batch loaded."""
    metrics = [p.stateOperators[0].customMetrics for p in progress]
    parts = ("Flush", "Compact", "Checkpoint")
    commit = [
        (
            m.get("rocksdbCommitFileSyncLatencyMs", 0)
            + sum(m.get(f"rocksdbCommit{x}Latency", 0) for x in parts)
        )
        / PARTITIONS
        for m in metrics
    ]
    first = metrics[0]
    return {
        "commit_ms": [round(c, 1) for c in commit],
        "state_rows": int(progress[-1].stateOperators[0].numRowsTotal),
        "restore": {
            "stores_loaded_from_checkpoint": first.get("rocksdbNumLoadedFromDfs", 0),
            "changelogs_replayed": first.get("rocksdbNumReplayChangelogFiles", 0),
            "load_time_per_store_s": round(
                first.get("rocksdbLoadLatencyMs", 0) / PARTITIONS / 1000, 3
            ),
        },
    }


def _epoch_s(timestamp: str) -> float:
    """Seconds since the epoch of a progress timestamp (ISO 8601, UTC)."""
    return dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _dir_bytes(path: Path, exclude: str | None = None) -> int:
    """Bytes of the files under ``path`` (hard links counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        if exclude is not None and Path(dirpath) == path and exclude in dirnames:
            dirnames.remove(exclude)
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def _in_session(work: Path, fn: Callable[[Any], Any]) -> Any:
    """Run ``fn(spark)`` in a new SparkSession, stopped afterwards (its workers with it)."""
    spark = _session(work / "spark-local")
    try:
        return fn(spark)
    finally:
        spark.stop()


def _summarize(variant: str, run: dict[str, Any], work: Path) -> dict[str, Any]:
    """Latency percentiles, throughput and bytes on disk of a variant's main run.

    Percentiles are over the batches after the first (the first one also starts the Python
    workers and opens every store), which is reported on its own.
    """
    ckpt, is_sk = work / "ckpt" / variant, variant.startswith("sk_")
    batch_ms, add_ms, rows = run["batch_ms"], run.pop("add_batch_ms"), run.pop("batch_rows")
    steady, steady_add = batch_ms[1:] or batch_ms, add_ms[1:] or add_ms
    steady_rows = sum(rows[1:]) if len(rows) > 1 else sum(rows)
    run.pop("restore", None)
    commit_ms = run["commit_ms"]
    return {
        "label": VARIANTS[variant],
        **run,
        "rows_per_s": round(run["rows"] / run["wall_s"]),
        "steady_rows_per_s": round(steady_rows / max(sum(steady), 1) * 1000),
        "batches": len(batch_ms),
        "first_batch_ms": batch_ms[0],
        "batch_p50_ms": _percentile(steady, 0.5),
        "batch_p99_ms": _percentile(steady, 0.99),
        "add_batch_p50_ms": _percentile(steady_add, 0.5),
        "add_batch_p99_ms": _percentile(steady_add, 0.99),
        "state_commit_p50_ms": _percentile(commit_ms[1:] or commit_ms, 0.5),
        "durable_state_bytes": None
        if variant in STATELESS
        else _dir_bytes(work / "sk-root" / variant if is_sk else ckpt / "state"),
        "query_checkpoint_bytes": _dir_bytes(ckpt, exclude="state"),
        "local_state_bytes": _dir_bytes(work / "sk-local" / variant) if is_sk else None,
        # The machine is shared: the load right after the run says how much others used it.
        "load_average_1m_after": round(os.getloadavg()[0], 2),
    }


def _restart(run: dict[str, Any]) -> dict[str, Any]:
    """What a restart cost: time from start() to its first batch done, and that batch."""
    restart = {"first_batch_s": run["first_batch_s"], "batch_ms": run["batch_ms"][0]}
    if "restore" in run:
        restart["restore"] = run["restore"]
    return restart


def _verify(spark: Any, work: Path, variants: list[str]) -> dict[str, Any]:
    """Compare each stateful variant's latest sink row per key with a batch groupBy over the
    input it read; the ceiling must have written every row it read, and a per-batch variant's
    counts must add up to the rows it read."""
    from pyspark.sql import functions as F

    found: dict[str, Any] = {}
    truths: dict[Path, Any] = {}
    for variant in variants:
        inp = _input_of(work, variant)
        sink = spark.read.parquet(str(work / "sink" / variant))
        if variant in STATELESS:
            rows = spark.read.parquet(str(inp)).count()
            found[variant] = {"keys": None, "mismatched_keys": 0 if sink.count() == rows else 1}
            continue
        if variant in PER_BATCH:
            rows, counted = spark.read.parquet(str(inp)).count(), sink.agg(F.sum("count")).first()
            found[variant] = {"keys": None, "mismatched_keys": 0 if counted[0] == rows else 1}
            continue
        if inp not in truths:
            truths[inp] = (
                spark.read.parquet(str(inp))
                .groupBy("k")
                .agg(F.count("*").alias("n"), F.sum("v").alias("s"))
            )
            found[inp.name] = truths[inp].count()
        latest = (
            sink.groupBy("k")
            .agg(F.max(F.struct("count", "sum")).alias("m"))
            .select("k", F.col("m.count").alias("count"), F.col("m.sum").alias("sum"))
        )
        same = F.col("count").eqNullSafe(F.col("n")) & F.col("sum").eqNullSafe(F.col("s"))
        mismatched = latest.join(truths[inp], "k", "full_outer").where(~same).count()
        found[variant] = {"keys": latest.count(), "mismatched_keys": mismatched}
    return found


def _warm_up(spark: Any, work: Path, variants: list[str], batches: int) -> dict[str, int]:
    """Warm the JVM's JIT for every variant alike: a batch job over the input, then each
    variant's own query over the first ``batches`` input files, in a folder of its own
    (deleted with the work folder). The micro-batches each variant ran, by variant.

    The JVM outlives the SparkSessions (one per variant), so without this the variant run
    first compiles the code paths that the later ones reuse (Arrow, the Python runners, the
    shuffle, the state store). On a quiet machine, with only the batch job as warm-up, the
    vectorized form's batch median was 1,104 ms when it ran first and 741 ms when it ran
    last; the ceiling's was 639 ms first and 447 ms last.
    """
    from pyspark.sql import functions as F

    df = spark.read.parquet(str(work / "input"))
    df.groupBy("k").agg(F.sum("v")).write.format("noop").mode("overwrite").save()
    if not batches:
        return {}
    warm = work / "warm"
    for name in ("input", "input-peers"):
        (warm / name).mkdir(parents=True)
        for i in range(batches):
            file = f"part-{i:05d}.parquet"
            os.link(work / "input" / file, warm / name / file)
    # The folder stays until the work folder goes: this session's Python workers still hold
    # the warm-up's stores open, and RocksDB may write into them (a removal raced it:
    # "Directory not empty").
    return {
        variant: len(_run_query(spark, variant, warm, str(warm / "sk-local" / variant))["batch_ms"])
        for variant in variants
    }


def _write_inputs(work: Path, files: range, args: argparse.Namespace) -> None:
    """Input files for every variant; the peers' folder links the first ``peer_batches``
    files and every restart file."""
    write_input(work / "input", files, args.rows, args.keys, args.seed)
    peers = work / "input-peers"
    peers.mkdir(exist_ok=True)
    for i in files:
        if i < args.peer_batches or i >= args.batches:
            name = f"part-{i:05d}.parquet"
            os.link(work / "input" / name, peers / name)  # same mtime: the same read order


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """Steady rows/s of each variant / the best Spark peer's, and vectorized / ceiling."""
    speed = {name: r["steady_rows_per_s"] for name, r in results.items()}
    peers = {name: speed[name] for name in PEERS if name in speed}
    out: dict[str, Any] = {}
    if peers:
        best = max(peers, key=lambda name: peers[name])
        out["best_peer"] = best
        out["to_best_peer"] = {
            name: round(value / max(peers[best], 1), 2) for name, value in speed.items()
        }
    for name in TO_CEILING:
        if "ceiling" in speed and name in speed:
            out[f"{name}_to_ceiling"] = round(speed[name] / max(speed["ceiling"], 1), 2)
    return out


def _more_rounds(args: argparse.Namespace, work: Path, first: dict[str, Any]) -> dict[str, Any]:
    """Run every variant ``args.rounds - 1`` more times, in turn, each from a new checkpoint
    over the same input: on a shared machine whose load swings, variants run next to each
    other are compared round by round. Steady rows/s per round and variant, and the medians
    of the rows/s and of each round's vectorized / ceiling ratios."""
    speeds = {v: [first[v]["steady_rows_per_s"]] for v in args.variants}
    loads = [[first[v]["load_average_1m_after"] for v in args.variants]]
    for n in range(1, args.rounds):
        again = work / f"round-{n}"
        again.mkdir()
        for name in ("input", "input-peers"):
            (again / name).symlink_to(work / name)
        loads.append([])
        for variant in args.variants:
            local = str(again / "sk-local" / variant)
            job = functools.partial(_run_query, variant=variant, work=again, local=local)
            summary = _summarize(variant, _in_session(work, job), again)
            speeds[variant].append(summary["steady_rows_per_s"])
            loads[-1].append(summary["load_average_1m_after"])
            _log(f"round {n} {variant}: {summary['steady_rows_per_s']} rows/s")
    out: dict[str, Any] = {
        "steady_rows_per_s": speeds,
        "load_average_1m_after": loads,
        "median_steady_rows_per_s": {v: round(np.median(x)) for v, x in speeds.items()},
    }
    for name in TO_CEILING:
        if "ceiling" in speeds and name in speeds:
            paired = [a / c for a, c in zip(speeds[name], speeds["ceiling"], strict=True)]
            out[f"{name}_to_ceiling_per_round"] = [round(r, 2) for r in paired]
            out[f"{name}_to_ceiling_median"] = round(float(np.median(paired)), 2)
    return out


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Write the input, run every phase of every variant, verify; the JSON document."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    _write_inputs(work, range(args.batches), args)
    warm = args.warm_batches
    warmed = _in_session(work, lambda spark: _warm_up(spark, work, args.variants, warm))
    results: dict[str, Any] = {}
    for variant in args.variants:
        local = str(work / "sk-local" / variant)
        job = functools.partial(_run_query, variant=variant, work=work, local=local)
        main = _in_session(work, job)
        results[variant] = _summarize(variant, main, work)
        _log(f"{variant}: {results[variant]}")
    rounds = _more_rounds(args, work, results) if args.rounds > 1 else None
    for n, phase in enumerate(args.restarts):
        file = args.batches + n
        _write_inputs(work, range(file, file + 1), args)
        for variant in args.variants:
            # A cold restart gets a fresh local folder: every store comes from the root.
            local = work / ("sk-local-cold" if phase == "cold" else "sk-local") / variant
            job = functools.partial(_run_query, variant=variant, work=work, local=str(local))
            again = _in_session(work, job)
            results[variant][f"restart_{phase}"] = _restart(again)
            _log(f"{variant} restart_{phase}: {results[variant][f'restart_{phase}']}")
    check = _in_session(work, lambda spark: _verify(spark, work, args.variants))
    for variant in args.variants:
        results[variant]["final_keys"] = check[variant]["keys"]
        results[variant]["mismatched_keys"] = check[variant]["mismatched_keys"]
    agree = all(check[v]["mismatched_keys"] == 0 for v in args.variants)
    return {
        "warm_up_batches": warmed,
        "variants": results,
        "ratios": ratios(results),
        **({"rounds": rounds} if rounds is not None else {}),
        "expected_keys": check.get("input"),
        "expected_keys_peers": check.get("input-peers"),
        "all_agree": agree,
    }


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _machine() -> dict[str, Any]:
    import pyspark

    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "spark": pyspark.__version__,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the benchmark, print (and optionally write) the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000, help="rows per micro-batch")
    parser.add_argument("--keys", type=int, default=1_000_000, help="distinct keys drawn from")
    parser.add_argument("--batches", type=int, default=10, help="micro-batches (input files)")
    parser.add_argument(
        "--peer-batches", type=int, help="micro-batches Spark's own operators run (default: all)"
    )
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument(
        "--restarts",
        nargs="*",
        choices=["warm", "cold"],
        default=["warm", "cold"],
        help="restarts to time, in order (each processes one more file)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the variants this many times in turn (a loaded machine: compare medians)",
    )
    parser.add_argument(
        "--anatomy",
        action="store_true",
        help="turn Spark's UI on and add where each variant's batches spend their time",
    )
    parser.add_argument(
        "--warm-batches",
        type=int,
        default=2,
        help="micro-batches each variant runs, unmeasured, before any is measured (0: none)",
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.anatomy:  # for every variant alike (the JSON's spark_conf says so)
        SPARK_CONF.update({"spark.ui.enabled": "true", "spark.ui.port": "0"})
    if args.peer_batches is None or args.peer_batches > args.batches:
        args.peer_batches = args.batches
    if args.warm_batches < 0:
        parser.error(f"--warm-batches must be 0 or more, got {args.warm_batches}")
    args.warm_batches = min(args.warm_batches, args.batches)
    started, load_before = time.perf_counter(), round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="sk-bench-pipeline-") as tmp:
        outcome = run(args, Path(tmp))
    summary = {
        "benchmark": "pipeline",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {**_machine(), "load_average_1m_before": load_before},
        "workload": {
            "rows_per_batch": args.rows,
            "keys": args.keys,
            "batches": args.batches,
            "peer_batches": args.peer_batches,
            "warm_batches": args.warm_batches,
            "restarts": args.restarts,
            "partitions": PARTITIONS,
            "master": MASTER,
            "spark_conf": SPARK_CONF,
        },
        **outcome,
        "total_s": round(time.perf_counter() - started, 1),
    }
    emit(summary, args.out)
    _log("all variants agree" if outcome["all_agree"] else "VARIANTS DISAGREE")
    return 0 if outcome["all_agree"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
