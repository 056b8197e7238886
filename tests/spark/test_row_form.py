"""The Row form, rows as output, and prefetched state: in one partition's run and on Spark."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest
from pyspark.sql import Row, SparkSession

from statekeeper import StateBackend, StoreConfig
from statekeeper.keyed import input_form, iter_state, row_class
from statekeeper.spark import StatefulProcessor, StatefulProcessorHandle, transform_with_state
from statekeeper.spark._runner import run_processor
from tests.spark.helpers import (
    OUTPUT_SCHEMA,
    batch_totals,
    make_input,
    read_stream,
    run_to_end,
    sink_latest,
    write_files,
)
from tests.spark.processors import RowCountSum

SCHEMA = pa.schema([("k", pa.string()), ("count", pa.int64()), ("sum", pa.int64())])


class PandasTotals(StatefulProcessor):
    """Count and sum per key; the pandas form, yielding dicts."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.totals = handle.value_state("totals")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        assert isinstance(rows, pd.DataFrame)
        n, s = self.totals.get() or (0, 0)
        n, s = n + len(rows), s + int(rows["v"].sum())
        self.totals.update((n, s))
        yield {"sum": s, "k": key[0], "count": n}


class RowTotals(StatefulProcessor):
    """The same in the Row form, yielding pyspark Rows; records what it was given."""

    rows = "row"

    def __init__(self) -> None:
        self.seen: dict[str, list[Any]] = {}

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.totals = handle.value_state("totals")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        self.seen[key[0]] = list(rows)
        n, s = self.totals.get() or (0, 0)
        n, s = n + len(rows), s + sum(row.v for row in rows)
        self.totals.update((n, s))
        yield Row(k=key[0], count=n, sum=s)


class Touchy(StatefulProcessor):
    """Reads, writes and re-reads states of some keys only: prefetch must never serve a
    stale value, across windows of keys, with TTL and lists."""

    rows = "row"

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.a = handle.value_state("a")
        self.b = handle.value_state("b", ttl=60)
        self.log = handle.list_state("log")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        i = int(key[0][1:])
        before = self.a.get() or 0
        self.a.update(before + 1)
        assert self.a.get() == before + 1  # a read after a write sees the write
        if i % 3 == 0:
            self.b.update((self.b.get() or 0) + 10)
            self.b.update(self.b.get() + 1)
        if i % 5 == 0:
            self.log.append(i)
            self.log.extend([i, i])
        if i % 7 == 0:
            self.a.clear()
            assert not self.a.exists()
        # (Only where it holds items: a scan costs O(uncommitted writes) in the store.)
        yield (key[0], before + 1, len(self.log.get()) if i % 5 == 0 else 0)


def _run(store: Any, processor: StatefulProcessor, table: Any) -> list[dict[str, Any]]:
    batches = run_processor(
        store, processor, table, keys=["k"], output_schema=SCHEMA, operator="op",
        batch_id=store.version, partition=0, now_ms=1_000,
    )  # fmt: skip
    return pa.Table.from_batches(list(batches), schema=SCHEMA).to_pylist()


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[StateBackend]:
    with StateBackend(str(tmp_path / "root"), config=StoreConfig(local_dir=str(tmp_path))) as b:
        yield b


def test_both_forms_compute_the_same_totals_and_the_row_form_sees_rows_in_order(
    backend: StateBackend,
) -> None:
    batches = [
        pa.table({"k": ["b", "a", "b", "c", "b"], "v": [1, 2, 3, 4, 5]}),
        pa.table({"k": ["c", "a", "a"], "v": [10, 20, 30]}),
    ]
    outputs: dict[str, list[list[dict[str, Any]]]] = {}
    for name, make in (("pandas", PandasTotals), ("row", RowTotals)):
        outputs[name] = []
        for table in batches:
            processor = make()
            with backend.open(name, 0, partitions=1) as store:
                outputs[name].append(_run(store, processor, table))
                store.commit()
        if isinstance(processor, RowTotals):
            rows = processor.seen["a"]
            assert [(r.k, r.v, r["v"], r[1]) for r in rows] == [
                ("a", 20, 20, 20),
                ("a", 30, 30, 30),
            ]
            assert rows[0].asDict() == {"k": "a", "v": 20}
    assert outputs["row"] == outputs["pandas"]
    assert outputs["row"][1] == [
        {"k": "a", "count": 3, "sum": 52},
        {"k": "c", "count": 2, "sum": 14},
    ]


def test_prefetched_reads_see_every_write_across_windows(backend: StateBackend) -> None:
    keys = [f"k{i}" for i in range(5000)]  # more than two prefetch windows
    table = pa.table({"k": keys[::-1], "v": [1] * len(keys)})
    schema = pa.schema([("k", pa.string()), ("count", pa.int64()), ("sum", pa.int64())])
    found: list[list[dict[str, Any]]] = []
    for _ in range(2):
        with backend.open("touchy", 0, partitions=1) as store:
            out = run_processor(
                store, Touchy(), table, keys=["k"], output_schema=schema, operator="touchy",
                batch_id=store.version, partition=0, now_ms=1_000,
            )  # fmt: skip
            found.append(pa.Table.from_batches(list(out)).to_pylist())
            store.commit()
    second = {r["k"]: (r["count"], r["sum"]) for r in found[1]}
    for i in range(5000):
        cleared = i % 7 == 0  # a cleared value starts again from 0
        assert second[f"k{i}"] == (1 if cleared else 2, 6 if i % 5 == 0 else 0), i
    with backend.open("touchy", 0) as store:
        b = {e.key[0]: e.value for e in iter_state(store, state="b")}
    assert b == {f"k{i}": 22 for i in range(0, 5000, 3)}


def test_rows_pickle_by_name_and_take_names_that_are_not_identifiers() -> None:
    cls = row_class(("user id", "count", "v"))
    row = cls("u1", 3, 4.5)
    assert (row["user id"], row.count, row["count"], row[2], row[-1]) == ("u1", 3, 3, 4.5, 4.5)
    assert row.asDict() == {"user id": "u1", "count": 3, "v": 4.5}
    assert repr(row) == "Row(user id='u1', count=3, v=4.5)"
    again = pickle.loads(pickle.dumps(row))
    assert again == row
    assert again["user id"] == "u1"
    with pytest.raises(KeyError, match="no column 'nope'"):
        row["nope"]


def test_an_unknown_form_is_refused() -> None:
    class Odd(PandasTotals):
        rows = "arrow"

    assert input_form(PandasTotals()) == "pandas"
    assert input_form(RowTotals()) == "row"
    with pytest.raises(ValueError, match=r"Odd.rows must be 'pandas' or 'row', got 'arrow'"):
        input_form(Odd())


@pytest.mark.spark
def test_the_row_form_on_spark_matches_a_batch_group_by(
    spark: SparkSession, tmp_path: Path
) -> None:
    write_files(tmp_path / "in", make_input(seed=21, files=3, rows=40, keys=12))
    out = transform_with_state(
        read_stream(spark, tmp_path / "in"), ["k"], RowCountSum(), OUTPUT_SCHEMA,
        str(tmp_path / "state"), "rows", 2, config=StoreConfig(local_dir=str(tmp_path / "l")),
    )  # fmt: skip
    run_to_end(out, tmp_path / "out", tmp_path / "ck")
    assert sink_latest(spark, tmp_path / "out") == batch_totals(spark, tmp_path / "in")
