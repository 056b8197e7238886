"""Differential runs: the same input files through Spark's own ``transformWithState`` and
through statekeeper, each written by ``foreachBatch`` with its batch id and read back as a
multiset of rows per micro-batch (``tests/spark/test_*_vs_spark.py``)."""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

T0 = int(dt.datetime(2024, 1, 1, tzinfo=dt.UTC).timestamp() * 1000)
"""The event time of second 0 of the input, in ms since the epoch."""
SCHEMA = "k string, t long, ts timestamp"
"""The input: a key, seconds after :data:`T0`, and that time as a timestamp."""
ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"


def ms(seconds: int) -> int:
    """Second ``seconds`` of the input in ms since the epoch."""
    return T0 + seconds * 1000


def write_batches(folder: Path, batches: list[list[tuple[str, int]]], start: int = 0) -> None:
    """One JSON-lines file per batch of (key, seconds after T0), in read order; files are
    numbered from ``start`` (more files for a restarted query read after the earlier ones)."""
    folder.mkdir(parents=True, exist_ok=True)
    base = time.time() - 1000
    for i, rows in enumerate(batches, start):
        lines = [
            json.dumps({"k": k, "t": s, "ts": dt.datetime.fromtimestamp(ms(s) / 1000, dt.UTC)
                        .isoformat()})
            for k, s in rows
        ]  # fmt: skip
        tmp = folder / f".{i}.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        os.utime(tmp, (base + i, base + i))
        tmp.rename(folder / f"part-{i:04d}.json")


def stream(spark: SparkSession, folder: Path) -> DataFrame:
    """The files of ``folder`` as a stream of :data:`SCHEMA`, one file per micro-batch."""
    return spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(folder))


def run(out: DataFrame, tmp: Path, name: str) -> dict[int, Counter[tuple[Any, ...]]]:
    """Run ``out`` to the end of its input; its rows per batch id, as multisets."""
    sink = tmp / f"sink-{name}"

    def write(df: DataFrame, batch_id: int) -> None:
        df.withColumn("batch", F.lit(batch_id)).write.mode("append").parquet(str(sink))

    query = (
        out.writeStream.foreachBatch(write)
        .option("checkpointLocation", str(tmp / f"cp-{name}"))
        .trigger(availableNow=True)
        .start()
    )
    if not query.awaitTermination(90):
        query.stop()
        raise AssertionError(f"{name} did not finish")
    assert query.exception() is None, f"{name} failed: {query.exception()}"
    batches: dict[int, Counter[tuple[Any, ...]]] = {}
    for p in query.recentProgress:
        batches.setdefault(p.batchId, Counter())
    spark = out.sparkSession
    if sink.exists():
        for r in spark.read.parquet(str(sink)).collect():
            d = r.asDict()
            batches.setdefault(d.pop("batch"), Counter())[tuple(map(_hashable, d.values()))] += 1
    return batches


def assert_agree(
    theirs: dict[int, Counter[tuple[Any, ...]]],
    ours: dict[int, Counter[tuple[Any, ...]]],
    batches: int,
) -> None:
    """Both engines ran micro-batches ``0 .. batches - 1``, and no other, and emitted the
    same rows in each (the message names the rows only one of them emitted: assertions in
    this module are not rewritten by pytest)."""
    assert sorted(theirs) == sorted(ours) == list(range(batches)), (sorted(theirs), sorted(ours))
    for b in range(batches):
        only_ours, only_theirs = ours[b] - theirs[b], theirs[b] - ours[b]
        assert ours[b] == theirs[b], (
            f"micro-batch {b}: only statekeeper emitted {dict(only_ours)}, only Spark "
            f"emitted {dict(only_theirs)}"
        )


def _hashable(value: Any) -> Any:
    """A map column's ``dict`` as its sorted items, so that rows can be counted."""
    return tuple(sorted(value.items())) if isinstance(value, dict) else value


def spark_tws(
    spark: SparkSession, tmp: Path, name: str, build: Any, *, no_data: bool = True
) -> Any:
    """Run Spark's own operator (RocksDB provider, which its transformWithState needs),
    with or without no-data micro-batches."""
    conf = {
        "spark.sql.streaming.stateStore.providerClass": ROCKSDB,
        "spark.sql.streaming.noDataMicroBatches.enabled": str(no_data).lower(),
    }
    for key, value in conf.items():
        spark.conf.set(key, value)
    try:
        return run(build(), tmp, name)
    finally:
        for key in conf:
            spark.conf.unset(key)
