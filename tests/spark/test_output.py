"""Output conformance: strict types, lossless adjustments only, errors name the column."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pytest

from statekeeper.spark import OutputSchemaError
from statekeeper.spark._output import OutputWriter, conform_batch, conform_frame

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


def test_the_writer_batches_frames_and_refuses_non_frames() -> None:
    writer = OutputWriter(SCHEMA, "here")
    out = []
    for i in range(3):
        out.extend(writer.add(pd.DataFrame({"k": [str(i)], "n": [i], "x": [float(i)]})))
    out.extend(writer.flush())
    assert sum(b.num_rows for b in out) == writer.rows_out == 3
    with pytest.raises(OutputSchemaError, match="must yield pandas DataFrames, got tuple"):
        list(writer.add(("a", 1)))
