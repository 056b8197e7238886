"""Spark SQL types as the Arrow types Spark exchanges with its Python workers.

``mapInArrow`` hands a task RecordBatches whose types Spark chose, and reads back the
batches the task yields. Statekeeper builds output batches, empty ones included, so it needs
those same types for an output schema, a state schema or the heartbeat rows. They are
derived here from the public classes of :mod:`pyspark.sql.types` and the two session
settings that change them, following Spark's documented mapping:

* ``spark.sql.session.timeZone`` is the zone of every ``timestamp`` (``timestamp_ntz`` has
  none);
* ``spark.sql.execution.arrow.useLargeVarTypes`` makes strings and binaries the 64-bit
  offset ("large") Arrow types.

A column of a type with no Arrow form that statekeeper knows (a variant, a geometry, an
interval of months, a calendar interval, a type newer than this code) is refused on the
driver, with its path and type, before any task runs.
``tests/spark/test_arrow_types.py`` checks the mapping against the batches Spark itself sends
to a ``mapInArrow`` task.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
from pyspark.sql import SparkSession
from pyspark.sql import types as T

__all__ = ["arrow_schema", "arrow_schema_of", "arrow_type"]

_FIXED: tuple[tuple[type[T.DataType], pa.DataType], ...] = (
    (T.NullType, pa.null()),
    (T.BooleanType, pa.bool_()),
    (T.ByteType, pa.int8()),
    (T.ShortType, pa.int16()),
    (T.IntegerType, pa.int32()),
    (T.LongType, pa.int64()),
    (T.FloatType, pa.float32()),
    (T.DoubleType, pa.float64()),
    (T.DateType, pa.date32()),
    (T.TimestampNTZType, pa.timestamp("us")),
    (T.DayTimeIntervalType, pa.duration("us")),
)
# A time of day (Spark 4.1 and later) is nanoseconds since midnight.
_TIME = getattr(T, "TimeType", None)


def arrow_schema(spark: SparkSession, schema: T.StructType) -> Any:
    """``schema`` as the ``pa.Schema`` of the batches Spark's Python workers exchange in
    ``spark``'s session (its time zone and large-type setting).

    Raises:
        TypeError: a column (or a field nested in one) has a type with no Arrow form here.
    """
    large = str(spark.conf.get("spark.sql.execution.arrow.useLargeVarTypes", "false"))
    timezone = str(spark.conf.get("spark.sql.session.timeZone", "UTC"))
    return arrow_schema_of(schema, timezone=timezone, large=large.lower() == "true")


def arrow_schema_of(schema: T.StructType, *, timezone: str, large: bool) -> Any:
    """``schema`` as a ``pa.Schema``, for the given session time zone and large types."""
    return pa.schema(
        [
            pa.field(f.name, _convert(f.dataType, timezone, large, f.name), f.nullable)
            for f in schema.fields
        ]
    )


def arrow_type(data_type: T.DataType, *, timezone: str, large: bool) -> Any:
    """The Arrow type of one Spark type, for the given session time zone and large types."""
    return _convert(data_type, timezone, large, "value")


def _convert(dt: T.DataType, timezone: str, large: bool, path: str) -> Any:
    for spark_type, arrow in _FIXED:
        if isinstance(dt, spark_type):
            return arrow
    if isinstance(dt, T.DecimalType):
        return pa.decimal128(dt.precision, dt.scale)
    if isinstance(dt, T.StringType):
        return pa.large_string() if large else pa.string()
    if isinstance(dt, T.BinaryType):
        return pa.large_binary() if large else pa.binary()
    if isinstance(dt, T.TimestampType):
        return pa.timestamp("us", tz=timezone)
    if _TIME is not None and isinstance(dt, _TIME):
        return pa.time64("ns")
    if isinstance(dt, T.ArrayType):
        element = _convert(dt.elementType, timezone, large, f"{path}[]")
        return pa.list_(pa.field("element", element, dt.containsNull))
    if isinstance(dt, T.MapType):
        key = _convert(dt.keyType, timezone, large, f"{path}{{key}}")
        value = _convert(dt.valueType, timezone, large, f"{path}{{value}}")
        return pa.map_(pa.field("key", key, False), pa.field("value", value, dt.valueContainsNull))
    if isinstance(dt, T.StructType):
        return pa.struct(
            [
                pa.field(f.name, _convert(f.dataType, timezone, large, f"{path}.{f.name}"),
                         f.nullable)
                for f in dt.fields
            ]
        )  # fmt: skip
    if isinstance(dt, T.UserDefinedType):
        return _convert(dt.sqlType(), timezone, large, path)
    raise TypeError(
        f"column {path!r} has type {dt.simpleString()}, which statekeeper cannot exchange "
        "with Spark's Python workers as Arrow; expected a boolean, number, decimal, string, "
        "binary, date, timestamp, timestamp_ntz, day-time interval, time, or an array, map "
        "or struct of those"
    )
