"""The pandas form's values both ways, as Spark's pandas API gives and takes them (the same
against Spark itself: ``tests/spark/test_pandas_vs_spark.py``)."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from statekeeper.keyed._pandas import frame_of, maps_from_dicts, zoned
from statekeeper.keyed.grouping import iter_groups
from statekeeper.keyed.output import OutputSchemaError, conform_frame

ZONE = "America/New_York"
ZONED = pa.timestamp("us", ZONE)
UTC = dt.UTC
NOON_UTC = dt.datetime(2024, 1, 1, 12, tzinfo=UTC)  # 07:00 in New York (EST)
JULY_UTC = dt.datetime(2024, 7, 1, 12, tzinfo=UTC)  # 08:00 in New York (EDT)
ITEM = pa.struct([("a", pa.int32()), ("at", ZONED)])


def _table() -> pa.Table:
    return pa.table(
        {
            "ts": pa.array([NOON_UTC, None, JULY_UTC, NOON_UTC], ZONED),
            "ntz": pa.array([dt.datetime(2024, 1, 1, 1, 2)] * 4, pa.timestamp("us")),
            "far": pa.array([dt.datetime(3000, 1, 1, tzinfo=UTC)] * 4, ZONED),
            "n": pa.array([1, None, 3, 4], pa.int64()),
            "took": pa.array([dt.timedelta(seconds=1), None, None, None], pa.duration("us")),
            "d": pa.array([Decimal("1.25")] * 4, pa.decimal128(10, 2)),
            "st": pa.array(
                [{"a": 1, "at": NOON_UTC}, None, {"a": None, "at": JULY_UTC}, {"a": 3}], ITEM
            ),
            "lst": pa.array([[1, None], None, [], [4]], pa.list_(pa.int32())),
            "mp": pa.array(
                [[("k", NOON_UTC)], None, [("x", None), ("y", JULY_UTC)], []],
                pa.map_(pa.string(), ZONED),
            ),
            "deep": pa.array([[{"a": 1, "at": JULY_UTC}], None, [None], []], pa.list_(ITEM)),
        }
    )


def test_values_arrive_as_sparks_pandas_api_gives_them() -> None:
    frame = frame_of(_table())
    # timestamps: naive wall-clock time of the column's (the session's) zone, in ns
    assert str(frame["ts"].dtype) == "datetime64[ns]"
    assert frame["ts"].tolist()[0] == pd.Timestamp("2024-01-01 07:00")
    assert frame["ts"].tolist()[2] == pd.Timestamp("2024-07-01 08:00")
    assert pd.isna(frame["ts"][1])
    assert str(frame["ntz"].dtype) == "datetime64[ns]"
    # beyond the nanosecond range: microseconds, the batch does not fail
    assert str(frame["far"].dtype) == "datetime64[us]"
    assert frame["far"][0] == pd.Timestamp("2999-12-31 19:00")
    assert str(frame["took"].dtype) == "timedelta64[ns]"
    assert frame["took"][0] == pd.Timedelta(seconds=1)
    # plain columns as before: a long column with a null is float64
    assert str(frame["n"].dtype) == "float64"
    assert frame["d"][0] == Decimal("1.25")
    # structs and maps are dicts; nested integers stay integers beside nulls
    assert frame["st"].tolist() == [
        {"a": 1, "at": dt.datetime(2024, 1, 1, 7)},
        None,
        {"a": None, "at": dt.datetime(2024, 7, 1, 8)},
        {"a": 3, "at": None},
    ]
    assert [None if v is None else list(v) for v in frame["lst"]] == [[1, None], None, [], [4]]
    assert frame["mp"].tolist() == [
        {"k": dt.datetime(2024, 1, 1, 7)},
        None,
        {"x": None, "y": dt.datetime(2024, 7, 1, 8)},
        {},
    ]
    assert list(frame["deep"][0]) == [{"a": 1, "at": dt.datetime(2024, 7, 1, 8)}]


@pytest.mark.parametrize("start", [1, 2, 3])
def test_a_slice_converts_like_the_same_rows_of_the_whole(start: int) -> None:
    whole = frame_of(_table())
    part = frame_of(_table().slice(start, 4 - start))
    assert list(part.index) == list(range(4 - start))
    # Dtypes follow the nulls of the slice ("n" is float64 only where its slice has a null,
    # a nested array an object array only where it holds one): the values must agree.
    for column in whole.columns.drop("n"):
        assert _plain(part[column]) == _plain(whole[column])[start:], column


def _plain(series: pd.Series) -> list[str]:
    """The values of ``series``, numpy arrays as lists, one ``repr`` per row."""
    return [repr(v.tolist() if isinstance(v, np.ndarray) else v) for v in series]


def test_a_naive_timestamp_out_is_wall_clock_time_of_the_session_zone() -> None:
    schema = pa.schema([("at", ZONED), ("exact", ZONED)])
    frame = pd.DataFrame(
        {"at": [pd.Timestamp("2024-01-01 12:00"), pd.NaT], "exact": [NOON_UTC, JULY_UTC]}
    )
    batch = conform_frame(frame, schema, "here")
    assert batch.schema == schema
    assert batch.column("at").to_pylist()[0] == dt.datetime(2024, 1, 1, 17, tzinfo=UTC)
    assert batch.column("at").null_count == 1
    assert batch.column("exact").cast(pa.timestamp("us", "UTC")).to_pylist() == [
        NOON_UTC,
        JULY_UTC,
    ]


def test_daylight_saving_edges_as_spark_reads_them() -> None:
    # repeated by the change back: the later (standard-time) one, like pandas' ambiguous=False
    fall = zoned(pa.array([pd.Timestamp("2024-11-03 01:30")]), ZONED)
    in_utc = fall.cast(pa.timestamp("us", "UTC")).to_pylist()
    assert in_utc == [dt.datetime(2024, 11, 3, 6, 30, tzinfo=UTC)]
    with pytest.raises(OutputSchemaError, match=r"column 'at' cannot be converted.*gap"):
        conform_frame(
            pd.DataFrame({"at": [pd.Timestamp("2024-03-10 02:30")]}),
            pa.schema([("at", ZONED)]),
            "here",
        )
    naive = pa.array([pd.Timestamp("2024-01-01")])
    assert zoned(naive, pa.timestamp("us")) is naive  # a naive column stays naive


def test_dicts_fill_a_declared_map_strictly() -> None:
    schema = pa.schema([("m", pa.map_(pa.string(), pa.int32()))])
    frame = pd.DataFrame({"m": [{"a": 1, "b": 2}, None, {}]})
    batch = conform_frame(frame, schema, "here")
    assert batch.schema == schema
    assert batch.column("m").to_pylist() == [[("a", 1), ("b", 2)], None, []]
    assert maps_from_dicts(pd.Series([{"a": 1}, "not a dict"])) is None
    with pytest.raises(OutputSchemaError, match="column 'm' has type map<string, double> whose"):
        conform_frame(pd.DataFrame({"m": [{"a": 2.5}]}), schema, "here")
    with pytest.raises(OutputSchemaError, match="column 'm' cannot be converted"):
        conform_frame(pd.DataFrame({"m": [{"a": 1, "b": "x"}]}), schema, "here")
    with pytest.raises(OutputSchemaError, match="column 'm' has type string"):
        conform_frame(pd.DataFrame({"m": ["a"]}), schema, "here")


def test_a_keys_column_has_a_null_dtype_only_if_that_key_has_a_null() -> None:
    big = 2**60 + 1  # not a float64
    table = pa.table(
        {
            "k": ["a", "a", "b", "c"],
            "n": pa.array([1, None, big, 3], pa.int64()),
            "flag": pa.array([True, False, None, True]),
        }
    )
    frames = dict(iter_groups(table, ["k"]))
    a, b, c = frames[("a",)], frames[("b",)], frames[("c",)]
    assert str(a["n"].dtype) == "float64"
    assert str(b["n"].dtype) == "int64"
    assert b["n"].tolist() == [big]
    assert str(c["n"].dtype) == "int64"
    assert str(a["flag"].dtype) == "bool"
    assert str(b["flag"].dtype) == "object"
    assert list(b.index) == [2]  # a key's rows keep their place in the chunk
