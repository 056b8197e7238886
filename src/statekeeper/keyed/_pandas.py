"""The pandas form's values, as Spark's ``transformWithStateInPandas`` gives and takes them.

A processor written for Spark's pandas API must see the same pandas values here, or it
breaks (a map that is not a ``dict``) or, worse, silently computes other results (a
timestamp compared with a naive one, or written back hours off). Spark documents its
conversions for every pandas UDF ("Apache Arrow in PySpark", timestamp semantics); the ones
that differ from plain ``pyarrow.Table.to_pandas`` are mirrored here:

* **Timestamps** (``TimestampType``, at any depth) arrive as *naive* values of the session
  time zone, the wall-clock time there (Spark's Arrow batches carry that zone, so it is the
  column's own). Top-level timestamp columns (with or without a zone) are ``datetime64[ns]``
  and day-time intervals ``timedelta64[ns]``; one holding a value that nanoseconds cannot
  represent (a time before 1677 or after 2262) stays in microseconds instead of failing the
  batch.
* An integer or boolean column becomes ``float64`` or ``object`` (pandas has no null for
  them) only for the keys whose rows hold a null, as Spark converts each key's rows on their
  own (:meth:`statekeeper.keyed.grouping.Grouped.frames`).
* **Maps** arrive as ``dict``\\ s; **structs** as ``dict``\\ s, and the integers inside nested
  values stay integers when some are null (``None``, not a float ``NaN``).
* Output: a naive timestamp in a timestamp column is read as wall-clock time of the
  session time zone (a zoned one is exact), and a column of ``dict``\\ s fills a declared map.

Not mirrored: Spark's pandas form rebuilds each key's frame from Python rows, so its column
dtypes depend on the data (an ``int`` or ``tinyint`` column arrives as ``int64``, a
``float`` one as ``float64``); here each column keeps the dtype of its Spark type, as in
Spark's other pandas UDFs. Nested timestamps in *output* are converted by Arrow: give them a
time zone (a naive one is read as UTC). The grouping key passed to the handlers holds the
same Python values in both forms, a timestamp as a zoned ``datetime``, in input and in timer
calls alike; Spark's pandas form passes a naive ``pd.Timestamp`` to ``handleInputRows`` and
a naive ``datetime`` to ``handleExpiredTimer`` (its Row form: a zoned one, then a naive UTC
one).
"""

from __future__ import annotations

from typing import Any

import pandas as pd  # type: ignore[import-untyped]
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]

__all__ = ["frame_of", "maps_from_dicts", "zoned"]


def frame_of(table: Any) -> Any:
    """``table`` (an Arrow table) as the pandas DataFrame Spark's pandas API would give."""
    columns = {}
    for name, column in zip(table.column_names, table.columns, strict=True):
        kind = column.type
        if pa.types.is_nested(kind):
            if _has_zone(kind):
                column = pa.chunked_array([_naive(c) for c in column.chunks], _naive_type(kind))
            series = column.to_pandas(
                integer_object_nulls=True, maps_as_pydicts="lossy", date_as_object=True,
                coerce_temporal_nanoseconds=True,
            )  # fmt: skip
        elif pa.types.is_timestamp(kind) or pa.types.is_duration(kind):
            if pa.types.is_timestamp(kind) and kind.tz is not None:
                column = pc.local_timestamp(column)
            try:
                series = column.to_pandas(coerce_temporal_nanoseconds=True)
            except pa.ArrowInvalid:  # out of the nanosecond range: keep microseconds
                series = column.to_pandas()
        else:
            series = column.to_pandas()
        columns[name] = series
    return pd.DataFrame(columns, index=pd.RangeIndex(table.num_rows))


def zoned(array: Any, kind: Any) -> Any:
    """A naive timestamp ``array`` bound for a zoned timestamp type ``kind``, read as
    wall-clock time of ``kind``'s zone; any other array unchanged.

    Raises:
        pa.ArrowInvalid: a wall-clock time that does not exist in that zone (skipped by a
            daylight-saving change). An ambiguous one (repeated by the change back) is
            read as the later of the two, as Spark does.
    """
    if (
        pa.types.is_timestamp(kind)
        and kind.tz is not None
        and pa.types.is_timestamp(array.type)
        and array.type.tz is None
    ):
        return pc.assume_timezone(array, kind.tz, ambiguous="latest", nonexistent="raise")
    return array


def maps_from_dicts(series: Any) -> Any | None:
    """A pandas Series of ``dict``\\ s (or nulls) as an Arrow map array, its key and item
    types inferred (the caller casts them to the declared ones, safely); ``None`` if any
    value is neither."""
    offsets, nulls = [0], []
    keys: list[Any] = []
    items: list[Any] = []
    for value in series:
        if isinstance(value, dict):
            keys.extend(value)
            items.extend(value.values())
            nulls.append(False)
        elif value is None or (isinstance(value, float) and value != value):
            nulls.append(True)
        else:
            return None
        offsets.append(len(keys))
    return pa.MapArray.from_arrays(
        pa.array(offsets, pa.int32()), pa.array(keys), pa.array(items), mask=pa.array(nulls)
    )


def _has_zone(kind: Any) -> bool:
    if pa.types.is_timestamp(kind):
        return kind.tz is not None
    return any(_has_zone(kind.field(i).type) for i in range(kind.num_fields))


def _naive_type(kind: Any) -> Any:
    """``kind`` with every zoned timestamp in it made naive."""
    if pa.types.is_timestamp(kind):
        return pa.timestamp(kind.unit)
    if pa.types.is_struct(kind):
        return pa.struct([f.with_type(_naive_type(f.type)) for f in kind])
    if pa.types.is_map(kind):
        return pa.map_(
            kind.key_field.with_type(_naive_type(kind.key_type)),
            kind.item_field.with_type(_naive_type(kind.item_type)),
        )
    if pa.types.is_large_list(kind):
        return pa.large_list(kind.value_field.with_type(_naive_type(kind.value_type)))
    if pa.types.is_list(kind):
        return pa.list_(kind.value_field.with_type(_naive_type(kind.value_type)))
    return kind


def _naive(array: Any) -> Any:
    """``array`` with every zoned timestamp in it replaced by its naive local time."""
    kind = array.type
    if not _has_zone(kind):
        return array
    if pa.types.is_timestamp(kind):
        return pc.local_timestamp(array)
    if array.offset:  # Arrow rebuilds a nested array from offsets only if it is not a slice
        array = array.take(pa.array(range(len(array)), pa.int64()))
    mask = array.is_null() if array.null_count else None
    if pa.types.is_struct(kind):
        children = [_naive(array.field(i)) for i in range(kind.num_fields)]
        return pa.StructArray.from_arrays(children, fields=list(_naive_type(kind)), mask=mask)
    if pa.types.is_map(kind):
        return pa.MapArray.from_arrays(
            array.offsets, _naive(array.keys), _naive(array.items), type=_naive_type(kind),
            mask=mask,
        )  # fmt: skip
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        cls = pa.LargeListArray if pa.types.is_large_list(kind) else pa.ListArray
        values = _naive(array.values)
        return cls.from_arrays(array.offsets, values, type=_naive_type(kind), mask=mask)
    raise TypeError(f"unexpected nested Arrow type {kind} holding a zoned timestamp")
