"""Statekeeper's Arrow types for Spark SQL types agree with the batches Spark itself sends
to a ``mapInArrow`` task, and Spark reads back batches built with them; in two session
settings (time zone, large types)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from statekeeper.spark._arrow_types import arrow_schema, arrow_schema_of, arrow_type
from tests.spark.helpers import pickled_by_value

pytestmark = pytest.mark.spark

_COLUMNS = {
    "b": "true",
    "i8": "cast(1 as tinyint)",
    "i16": "cast(2 as smallint)",
    "i32": "3",
    "i64": "4L",
    "f32": "cast(1.5 as float)",
    "f64": "2.5D",
    "dec": "cast(12.34 as decimal(20, 3))",
    "s": "'text'",
    "bin": "cast('raw' as binary)",
    "day": "date'2024-02-29'",
    "ts": "timestamp'2024-01-02 03:04:05'",
    "ntz": "timestamp_ntz'2024-01-02 03:04:05'",
    "dur": "interval '1 02:03:04' day to second",
    "nothing": "null",
    "arr": "array(named_struct('k', 'a', 'at', timestamp'2024-01-01 00:00:00'))",
    "m": "map('x', array(cast('y' as binary)))",
    "st": "named_struct('n', 1L, 'in', named_struct('s', 'z', 'ntz', timestamp_ntz'2024-01-01'))",
}
_SETTINGS = [("UTC", "false"), ("America/New_York", "true")]


def _frame(spark: SparkSession) -> DataFrame:
    exprs = [F.expr(sql).alias(name) for name, sql in _COLUMNS.items()]
    if hasattr(T, "TimeType"):
        exprs.append(F.expr("time'12:34:56.789'").alias("tod"))
    return spark.range(3).select(*exprs)


def _schemas_seen(batches: Iterator[Any]) -> Iterator[Any]:
    for batch in batches:
        seen = batch.schema.serialize().to_pybytes()
        yield pa.RecordBatch.from_pylist([{"schema": seen}], pa.schema([("schema", pa.binary())]))


@pytest.fixture(params=_SETTINGS, ids=lambda s: f"{s[0]}-large={s[1]}")
def session(spark: SparkSession, request: pytest.FixtureRequest) -> Iterator[SparkSession]:
    zone, large = request.param
    keys = ("spark.sql.session.timeZone", "spark.sql.execution.arrow.useLargeVarTypes")
    saved = {k: spark.conf.get(k, None) for k in keys}
    spark.conf.set(keys[0], zone)
    spark.conf.set(keys[1], large)
    try:
        with pickled_by_value(sys.modules[__name__]):
            yield spark
    finally:
        for key, value in saved.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)


def test_the_types_are_those_spark_sends_to_a_python_task(session: SparkSession) -> None:
    df = _frame(session)
    rows = df.mapInArrow(_schemas_seen, "schema binary").collect()
    assert rows, "no task saw a batch"
    ours = arrow_schema(session, df.schema)
    for row in rows:
        theirs = pa.ipc.read_schema(pa.py_buffer(bytes(row["schema"])))
        assert theirs.names == ours.names
        for name in ours.names:
            assert ours.field(name).type == theirs.field(name).type, name


def test_spark_reads_back_batches_built_with_them(session: SparkSession) -> None:
    df = _frame(session)
    ours = arrow_schema(session, df.schema)

    def rebuild(batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            yield pa.RecordBatch.from_pylist(batch.to_pylist(), schema=ours)

    assert sorted(df.mapInArrow(rebuild, df.schema).collect()) == sorted(df.collect())


def test_a_type_without_an_arrow_form_is_refused_with_its_path() -> None:
    schema = T.StructType(
        [T.StructField("ok", T.LongType()),
         T.StructField("outer", T.StructType([T.StructField("cal", T.CalendarIntervalType())]))]
    )  # fmt: skip
    with pytest.raises(TypeError, match=r"column 'outer\.cal' has type interval.*expected"):
        arrow_schema_of(schema, timezone="UTC", large=False)
    with pytest.raises(TypeError, match=r"column 'value\[\]' has type"):
        arrow_type(T.ArrayType(T.YearMonthIntervalType()), timezone="UTC", large=False)
