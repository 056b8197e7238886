"""Output conformance: strict types, lossless adjustments only, errors name the column."""

from __future__ import annotations

import collections
import datetime as dt
import itertools
import time
from collections.abc import Iterator
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest
from pyspark.sql import Row

from statekeeper.keyed import row_class
from statekeeper.keyed.output import OutputWriter, conform_batch, conform_frame
from statekeeper.spark import OutputSchemaError

SCHEMA = pa.schema(
    [
        pa.field("k", pa.string(), nullable=False),
        pa.field("n", pa.int32()),
        pa.field("x", pa.float64()),
    ]
)


def test_exact_and_lossless_columns_pass() -> None:
    frame = pd.DataFrame({"x": [0.5, None], "k": ["a", "b"], "n": [1, 2]})  # any column order
    batch = conform_frame(frame, SCHEMA, "here")
    assert batch.schema == SCHEMA
    assert batch.to_pylist() == [{"k": "a", "n": 1, "x": 0.5}, {"k": "b", "n": 2, "x": None}]
    nulls = conform_frame(pd.DataFrame({"k": ["a"], "n": [None], "x": [None]}), SCHEMA, "here")
    assert nulls.column("n").null_count == 1


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (
            {"k": ["a"], "n": [1], "x": [1]},
            "column 'x' has type int64, but output_schema declares double",
        ),
        (
            {"k": ["a"], "n": ["1"], "x": [1.0]},
            "column 'n' has type string, but output_schema declares int32",
        ),
        (
            {"k": ["a"], "n": [2**40], "x": [1.0]},
            "column 'n' has type int64 whose values do not fit",
        ),
        (
            {"k": [None], "n": [1], "x": [1.0]},
            "column 'k' holds 1 nulls, but output_schema declares it NOT NULL",
        ),
        ({"k": ["a"], "x": [1.0]}, r"missing \['n'\]"),
        ({"k": ["a"], "n": [1], "x": [1.0], "y": [0]}, r"not declared \['y'\]"),
        ({"k": ["a"], "n": [[1]], "x": [1.0]}, "column 'n' has type list<item: int64>"),
    ],
)
def test_mismatches_name_the_column(frame: dict[str, list[object]], message: str) -> None:
    with pytest.raises(OutputSchemaError, match=message):
        conform_frame(pd.DataFrame(frame), SCHEMA, "operator 'op'")


def test_arrow_batches_are_checked_too() -> None:
    good = pa.RecordBatch.from_pydict({"k": ["a"], "n": pa.array([1], pa.int64()), "x": [1.0]})
    assert conform_batch(good, SCHEMA, "here").schema == SCHEMA
    bad = pa.RecordBatch.from_pydict({"k": ["a"], "n": [1], "x": ["1.0"]})
    with pytest.raises(OutputSchemaError, match="column 'x' has type string"):
        conform_batch(bad, SCHEMA, "here")
    with pytest.raises(OutputSchemaError, match="must yield pyarrow RecordBatches, got dict"):
        conform_batch({"k": "a"}, SCHEMA, "here")


def test_the_writer_batches_frames_and_refuses_what_is_not_a_row() -> None:
    writer = OutputWriter(SCHEMA, "here")
    out = []
    for i in range(3):
        out.extend(writer.extend([pd.DataFrame({"k": [str(i)], "n": [i], "x": [float(i)]})]))
    out.extend(writer.flush())
    assert sum(b.num_rows for b in out) == writer.rows_out == 3
    with pytest.raises(OutputSchemaError, match=r"must yield rows .* or DataFrames, got int"):
        list(writer.extend([3]))
    with pytest.raises(OutputSchemaError, match=r"must return an iterator .*, got dict"):
        list(writer.extend({"k": "a", "n": 1, "x": 1.0}))
    rows_only = OutputWriter(SCHEMA, "here", frames=False)
    with pytest.raises(OutputSchemaError, match=r"must yield rows \(tuples, Rows or dicts\), got"):
        list(rows_only.extend([pd.DataFrame({"k": ["a"], "n": [1], "x": [1.0]})]))


def test_rows_of_every_shape_become_one_batch_in_schema_order() -> None:
    Named = collections.namedtuple("Named", ["x", "k", "n"])
    writer = OutputWriter(SCHEMA, "here")
    items = [
        ("a", 1, 1.5),
        {"n": 2, "x": 2.5, "k": "b"},
        Row(k="c", n=3, x=3.5),
        Named(4.5, "d", 4),
        row_class(("k", "n", "x"))("e", 5, 5.5),
    ]
    out = [*writer.extend(iter(items)), *writer.flush()]
    assert len(out) == 1
    assert out[0].schema == SCHEMA
    assert out[0].to_pylist() == [
        {"k": k, "n": n, "x": n + 0.5} for k, n in zip("abcde", range(1, 6), strict=True)
    ]


def test_rows_and_frames_keep_their_order() -> None:
    writer = OutputWriter(SCHEMA, "here")
    frame = pd.DataFrame({"k": ["b"], "n": [2], "x": [2.0]})
    out = [*writer.extend([("a", 1, 1.0), frame, ("c", 3, 3.0)]), *writer.flush()]
    assert [r["k"] for b in out for r in b.to_pylist()] == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (("a", 1), "output rows have 2 values, but output_schema has 3 columns"),
        (("a", "1", 1.0), "column 'n' \\(declared int64\\) cannot hold a value"),
        ((None, 1, 1.0), "column 'k' holds 1 nulls, but output_schema declares it NOT NULL"),
        ({"k": "a", "n": 1}, "missing \\['x'\\]"),
        ({"k": "a", "n": 1, "x": 1.0, "y": 2}, "not declared \\['y'\\]"),
    ],
)
def test_a_bad_row_is_named_by_its_column(row: Any, message: str) -> None:
    schema = pa.schema([pa.field("k", pa.string(), nullable=False), ("n", pa.int64()),
                        ("x", pa.float64())])  # fmt: skip
    writer = OutputWriter(schema, "here")
    with pytest.raises(OutputSchemaError, match=message):
        list(itertools.chain(writer.extend([row]), writer.flush()))


@pytest.fixture
def worker_in_new_york(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's local time zone is New York's (as a worker's ``TZ`` may be)."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.usefixtures("worker_in_new_york")
def test_a_naive_datetime_in_a_row_is_local_time_of_the_worker() -> None:
    # Spark's Row-based API converts with datetime.astimezone: naive means process-local.
    schema = pa.schema([("at", pa.timestamp("us", "Europe/Paris")), ("n", pa.int64())])
    writer = OutputWriter(schema, "here")
    naive = dt.datetime(2024, 1, 1, 12)
    aware = dt.datetime(2024, 1, 1, 12, tzinfo=dt.UTC)
    rows = [(naive, 1), (aware, 2), (pd.Timestamp(naive), 3), (None, 4), (pd.NaT, 5)]
    rows.append((dt.datetime.min, 6))  # no local time before it: read as UTC, not a failure
    batches = list(writer.extend(rows))
    batches += list(writer.flush())
    (batch,) = batches
    in_utc = batch.column("at").cast(pa.timestamp("us", "UTC")).to_pylist()
    assert in_utc == [
        dt.datetime(2024, 1, 1, 17, tzinfo=dt.UTC),  # 12:00 in New York
        aware,
        dt.datetime(2024, 1, 1, 17, tzinfo=dt.UTC),
        None,
        None,
        dt.datetime.min.replace(tzinfo=dt.UTC),
    ]
