"""Spark Connect: the same code from a thin client, against a local Connect server.

The server is started once for the module (``start-connect-server.sh`` from the pip
PySpark) on a free loopback port and stopped at the end. Nothing here touches a JVM on the
client side: metrics are read from the task reports in the checkpoint root.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from statekeeper import StoreConfig
from statekeeper.epochs import latest_manifest
from statekeeper.repartition import repartition
from statekeeper.spark import (
    batch_metrics,
    decode_key,
    read_state,
    remove_state_listener,
    state_listener,
    transform_with_state,
    transform_with_state_arrow,
)
from statekeeper.spark._listener import listener_of
from statekeeper.storage import open_blob_store
from tests.spark.conftest import SparkHolder
from tests.spark.connect_server import ConnectServer, start_connect_server
from tests.spark.helpers import (
    OUTPUT_SCHEMA,
    T0,
    batch_totals,
    make_input,
    pickled_by_value,
    read_stream,
    run_to_end,
    sink_latest,
    state_totals,
    version_owners,
    write_event_files,
    write_files,
)
from tests.spark.processors import EventSessions, RunningCountSum, arrow_count_sum

pytestmark = [pytest.mark.spark, pytest.mark.connect, pytest.mark.slow]

PARTITIONS = 3
EVENT_OUTPUT = "k string, n long, what string, batch long"


class SeededCountSum(RunningCountSum):
    """RunningCountSum whose totals start from the key's initial rows (``n``, ``s``)."""

    def handle_initial_state(self, key: tuple[Any, ...], rows: Any, timer_values: Any) -> None:
        self.count.update(int(rows["n"].sum()))
        self.total.update(int(rows["s"].sum()))


@pytest.fixture(scope="module", autouse=True)
def _pickled_by_value() -> Iterator[None]:
    """The server's workers cannot import this test module: its processor travels by value."""
    with pickled_by_value(sys.modules[__name__]):
        yield


@pytest.fixture(scope="module")
def server(
    no_classic_session: SparkHolder, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ConnectServer]:
    """One Connect server for the module (processors are pickled by value, see conftest)."""
    running = start_connect_server(tmp_path_factory.mktemp("connect"))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def clients(server: ConnectServer) -> Iterator[Callable[[], SparkSession]]:
    """Makes Connect client sessions, all stopped after the test (a client left open keeps
    retrying a stopped server at interpreter exit)."""
    made: list[SparkSession] = []

    def make() -> SparkSession:
        session = SparkSession.builder.remote(server.url).getOrCreate()
        made.append(session)
        return session

    yield make
    for session in made:
        session.stop()


def test_a_query_restarts_and_reads_state_and_metrics_through_connect(
    clients: Callable[[], SparkSession], tmp_path: Path
) -> None:
    """Two batches, a new client session, two more from the same checkpointLocation: the
    state (read through Connect) and the sink equal a batch groupBy, and every batch's
    metrics come from the root."""
    data = make_input(seed=21, files=4, rows=20, keys=6)
    inp, root = tmp_path / "in", str(tmp_path / "state")
    write_files(inp, data[:2])
    query_ids = []
    for start in (0, 2):
        spark = clients()
        if start:
            write_files(inp, data[2:], start=2)
        out = transform_with_state(
            read_stream(spark, inp), ["k"], RunningCountSum(), OUTPUT_SCHEMA, root, "counts",
            PARTITIONS, config=StoreConfig(local_dir=str(tmp_path / f"local-{start}")),
        )  # fmt: skip
        query_ids.append(str(run_to_end(out, tmp_path / "out", tmp_path / "ck").id))
        if not start:
            spark.stop()
    assert query_ids[0] == query_ids[1]  # resumed, not a new query
    # Tasks through Connect see the query id too: each version is owned by the query.
    assert version_owners(root, "counts", PARTITIONS) == [[query_ids[0]] * 4] * PARTITIONS
    expected = batch_totals(spark, inp)
    assert state_totals(read_state(spark, root, "counts")) == expected
    assert sink_latest(spark, tmp_path / "out") == expected
    metrics = [batch_metrics(root, "counts", b, query_id=query_ids[0]) for b in range(4)]
    assert all(m is not None for m in metrics)
    assert [m.partitions_committed for m in metrics if m] == [PARTITIONS] * 4
    assert [m.version for m in metrics if m] == [1, 2, 3, 4]
    assert sum(m.rows_in for m in metrics if m) == 4 * 20
    assert metrics[2] is not None
    assert metrics[2].stores_restored == PARTITIONS


def test_a_client_that_opts_in_to_the_listener_writes_epoch_manifests(
    clients: Callable[[], SparkSession], tmp_path: Path
) -> None:
    """A root written only from Spark Connect has no epoch manifests: nothing tells whether
    its last micro-batch finished, so a repartition asks which version to use. A client
    that opts in to ``state_listener`` writes them, as a classic driver does, and gets the
    batches' metrics."""
    spark = clients()
    listener = state_listener(spark)
    assert state_listener(spark) is listener
    try:
        inp, root = tmp_path / "in", str(tmp_path / "state")
        write_files(inp, make_input(seed=23, files=2, rows=20, keys=6))
        out = transform_with_state(
            read_stream(spark, inp), ["k"], RunningCountSum(), OUTPUT_SCHEMA, root, "counts",
            PARTITIONS, config=StoreConfig(local_dir=str(tmp_path / "local")),
        )  # fmt: skip
        query_id = str(run_to_end(out, tmp_path / "out", tmp_path / "ck").id)
        (last,) = listener.wait_for(query_id, 1)
        listener.flush()
        assert (last.version, last.partitions_committed) == (2, PARTITIONS)
        manifest = latest_manifest(open_blob_store(root), "counts")
        assert manifest is not None
        assert (manifest.query_id, manifest.epoch) == (query_id, 1)
        report = repartition(root, "counts", partitions=2, work_dir=str(tmp_path / "work"))
        assert report.version == 2
    finally:
        assert remove_state_listener(spark)
    assert state_listener(spark) is not listener  # a new one, followed by Connect again
    assert remove_state_listener(spark)  # its thread would meet the closed channel
    spark.stop()
    later = clients()
    try:  # a stopped session's listener is let go (its session, pool and blob stores)
        assert state_listener(later) is not listener
        assert listener_of(spark) is None
    finally:
        assert remove_state_listener(later)


def test_the_vectorized_form_runs_through_connect(
    clients: Callable[[], SparkSession], tmp_path: Path
) -> None:
    spark = clients()
    root = str(tmp_path / "state")
    write_files(tmp_path / "in", make_input(seed=22, files=2, rows=30, keys=8))
    out = transform_with_state_arrow(
        read_stream(spark, tmp_path / "in"), ["k"], arrow_count_sum, OUTPUT_SCHEMA, root,
        "vector", 2, config=StoreConfig(local_dir=str(tmp_path / "local")),
    )  # fmt: skip
    run_to_end(out, tmp_path / "out", tmp_path / "ck")
    expected = batch_totals(spark, tmp_path / "in")
    assert sink_latest(spark, tmp_path / "out") == expected
    raw = read_state(spark, root, "vector").collect()
    assert {
        decode_key(r["key"], 1)[0][0]: tuple(map(int, r["value"].split(b","))) for r in raw
    } == expected
    metrics = batch_metrics(root, "vector", 1)
    assert metrics is not None
    assert metrics.rows_in == 30


def test_an_initial_state_is_applied_through_connect(
    clients: Callable[[], SparkSession], tmp_path: Path
) -> None:
    """``initial_state`` from a Connect client: the staging job runs on the server, batch 0
    applies it once (two rows of one key are summed; a key without input is kept), and a
    new client session resuming the query does not apply it again."""
    data = make_input(seed=23, files=3, rows=20, keys=5)
    inp, root = tmp_path / "in", str(tmp_path / "state")
    seeds = [("key-00", 10, 1000), ("key-00", 1, 1), ("key-01", 2, 20), ("never", 7, 70)]
    write_files(inp, data[:2])
    for start in (0, 2):
        spark = clients()
        if start:
            write_files(inp, data[2:], start=2)
        initial = spark.createDataFrame(seeds, "k string, n long, s long")
        out = transform_with_state(
            read_stream(spark, inp), ["k"], SeededCountSum(), OUTPUT_SCHEMA, root, "seeded",
            PARTITIONS, config=StoreConfig(local_dir=str(tmp_path / "local")),
            initial_state=initial,
        )  # fmt: skip
        run_to_end(out, tmp_path / "out", tmp_path / "ck")
        if not start:
            spark.stop()
    expected = dict(batch_totals(spark, inp))
    for k, n, s in seeds:
        count, total = expected.get(k, (0, 0))
        expected[k] = (count + n, total + s)
    assert state_totals(read_state(spark, root, "seeded")) == expected
    assert "never" not in sink_latest(spark, tmp_path / "out")  # no input: no output
    assert sink_latest(spark, tmp_path / "out")["key-00"] == expected["key-00"]


def test_event_time_timers_fire_through_connect(
    clients: Callable[[], SparkSession], tmp_path: Path
) -> None:
    """Event time from a Connect client (no driver-side hook there): the watermark derives
    from the data and timers fire in partitions that receive no input, across a new client
    session resuming the query; the timers left show in read_state."""
    keys = [f"u{i}" for i in range(6)]  # spread over the 3 partitions; then only "z"
    write_event_files(tmp_path / "in", [[(k, i) for i, k in enumerate(keys)], [("z", 12)]])
    for start, more in ((0, []), (2, [[("z", 19)], [("z", 30)], [("z", 31)]])):
        spark = clients()
        write_event_files(tmp_path / "in", more, start=start)
        out = transform_with_state(
            spark.readStream.schema("k string, ts timestamp").option("maxFilesPerTrigger", 1)
            .json(str(tmp_path / "in")),
            keys="k", processor=EventSessions(), output_schema=EVENT_OUTPUT,
            checkpoint=str(tmp_path / "state"), name="sessions", partitions=PARTITIONS,
            time_mode="event_time", event_time_column="ts", watermark_delay=5,
            config=StoreConfig(local_dir=str(tmp_path / "local")),
        )  # fmt: skip
        run_to_end(out, tmp_path / "out", tmp_path / "ck")
        if not start:
            spark.stop()
    rows = spark.read.parquet(str(tmp_path / "out")).collect()
    closed = {(r["k"], r["batch"]) for r in rows if r["what"] == "closed"}
    # Timers at last row + 10 s: u0..u5 at 10..15 s. Watermark of batch b = the largest event
    # time of batches before b - 5 s: batch 3 sees 14 s (u0..u4 fire), batch 4 25 s (u5).
    assert closed == {(k, 3) for k in keys[:5]} | {("u5", 4)}
    assert all(r["n"] == 1 for r in rows if r["what"] == "closed")
    timers = [r for r in read_state(spark, str(tmp_path / "state"), "sessions").collect()]
    left = [(r["k"], int(r["entry"])) for r in timers if r["state"] == "$timer"]
    assert left == [("z", int((T0.timestamp() + 41) * 1000))]
