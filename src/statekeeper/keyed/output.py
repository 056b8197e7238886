"""Output checks: every batch a processor emits must match the declared output schema.

Spark reads ``mapInArrow`` output by position and fails late and cryptically on a mismatch,
so every batch is checked here, column by column, and a mismatch names the column, the type
found and the type declared. The rule is strict: a column must have the declared Arrow type,
with three lossless exceptions that pandas makes unavoidable — an all-null column (pandas
cannot type it), a narrower or wider type of the same kind that converts without loss
(``int64`` values into ``int``, ``string`` into ``large_string``, timestamp units), and
``None`` in a nullable column. An ``int`` column for a ``double`` field is an error.

A pandas frame is read as Spark's pandas API reads it (:mod:`statekeeper.keyed._pandas`): a
naive timestamp is wall-clock time of the session time zone, and a column of dicts fills a
map. Rows are read as Spark's Row-based API reads them: a naive ``datetime`` in a timestamp
column is local time of the Python worker's process (its ``TZ``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pandas as pd  # type: ignore[import-untyped]
import pyarrow as pa  # type: ignore[import-untyped]

from statekeeper.errors import StateKeeperError
from statekeeper.keyed._pandas import maps_from_dicts, zoned

__all__ = [
    "OutputSchemaError",
    "OutputWriter",
    "conform_batch",
    "conform_frame",
    "rows_to_batch",
]

_MAX_ROWS = 8192
_MAX_FRAMES = 1024


class OutputSchemaError(StateKeeperError, TypeError):
    """A processor emitted rows that do not match the declared output schema."""


_KIND_TESTS: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("integer", pa.types.is_integer),
    ("floating", pa.types.is_floating),
    ("string", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)),
    ("binary", lambda t: pa.types.is_binary(t) or pa.types.is_large_binary(t)),
    ("timestamp", pa.types.is_timestamp),
    ("date", pa.types.is_date),
    ("decimal", pa.types.is_decimal),
    ("list", lambda t: pa.types.is_list(t) or pa.types.is_large_list(t)),
    ("struct", pa.types.is_struct),
    ("map", pa.types.is_map),
)


def _kind(arrow_type: Any) -> str:
    for name, test in _KIND_TESTS:
        if test(arrow_type):
            return name
    return str(arrow_type)


def _conform_array(array: Any, field: Any, where: str) -> Any:
    """``array`` as ``field.type``, or an :class:`OutputSchemaError` naming the column."""
    if array.type != field.type:
        if pa.types.is_null(array.type):
            array = pa.nulls(len(array), field.type)
        elif _kind(array.type) == _kind(field.type):
            try:
                array = array.cast(field.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise OutputSchemaError(
                    f"{where}: column {field.name!r} has type {array.type} whose values do not "
                    f"fit the declared type {field.type}: {exc}"
                ) from exc
        else:
            raise OutputSchemaError(
                f"{where}: column {field.name!r} has type {array.type}, but output_schema "
                f"declares {field.type}"
            )
    if not field.nullable and array.null_count:
        raise OutputSchemaError(
            f"{where}: column {field.name!r} holds {array.null_count} nulls, but output_schema "
            "declares it NOT NULL"
        )
    return array


def _check_names(found: list[str], schema: Any, where: str) -> None:
    missing = [n for n in schema.names if n not in found]
    extra = [n for n in found if n not in schema.names]
    if missing or extra or len(set(found)) != len(found):
        raise OutputSchemaError(
            f"{where}: output columns {found} do not match output_schema {schema.names}"
            + (f"; missing {missing}" if missing else "")
            + (f"; not declared {extra}" if extra else "")
        )


def conform_frame(frame: Any, schema: Any, where: str) -> Any:
    """Convert a pandas DataFrame to a ``pa.RecordBatch`` of exactly ``schema``.

    Raises:
        OutputSchemaError: a column is missing, extra, or of another type (named).
    """
    if not isinstance(frame, pd.DataFrame):
        raise OutputSchemaError(
            f"{where}: handle_input_rows must yield pandas DataFrames, got {type(frame).__name__}"
        )
    _check_names([str(c) for c in frame.columns], schema, where)
    arrays = []
    for field in schema:
        series = frame[field.name]
        try:
            array = maps_from_dicts(series) if pa.types.is_map(field.type) else None
            if array is None:
                array = pa.Array.from_pandas(series)
            array = zoned(array, field.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
            raise OutputSchemaError(
                f"{where}: column {field.name!r} cannot be converted to Arrow (declared "
                f"{field.type}): {exc}"
            ) from exc
        arrays.append(_conform_array(array, field, where))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def conform_batch(batch: Any, schema: Any, where: str) -> Any:
    """Check (and losslessly adjust) an Arrow record batch against ``schema``.

    Raises:
        OutputSchemaError: not a RecordBatch, or a column is missing, extra or mistyped.
    """
    if isinstance(batch, pa.Table):
        batch = batch.combine_chunks().to_batches()[0] if batch.num_rows else None
        if batch is None:
            return pa.RecordBatch.from_pylist([], schema=schema)
    if not isinstance(batch, pa.RecordBatch):
        raise OutputSchemaError(
            f"{where}: the function must yield pyarrow RecordBatches, got {type(batch).__name__}"
        )
    if batch.schema.equals(schema):
        return batch
    _check_names(list(batch.schema.names), schema, where)
    arrays = [_conform_array(batch.column(f.name), f, where) for f in schema]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def rows_to_batch(rows: list[tuple[Any, ...]], schema: Any, where: str) -> Any:
    """Convert tuples in the order of ``schema`` to a ``pa.RecordBatch`` of exactly it.

    Raises:
        OutputSchemaError: a row has another number of values, or a value does not fit its
            column's type (the column is named).
    """
    widths = set(map(len, rows))
    if widths != {len(schema)}:
        found = sorted(widths - {len(schema)})
        raise OutputSchemaError(
            f"{where}: output rows have {found[0]} values, but output_schema has "
            f"{len(schema)} columns {schema.names}"
        )
    arrays = []
    for field, values in zip(schema, zip(*rows, strict=True), strict=True):
        try:
            if pa.types.is_timestamp(field.type) and field.type.tz is not None:
                values = tuple(map(_naive_as_local, values))
            array = pa.array(values, type=field.type)
        except (pa.ArrowException, TypeError, ValueError, OverflowError, OSError) as exc:
            raise OutputSchemaError(
                f"{where}: column {field.name!r} (declared {field.type}) cannot hold a value "
                f"emitted for it: {exc}"
            ) from exc
        arrays.append(_conform_array(array, field, where))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _naive_as_local(value: Any) -> Any:
    """A naive ``datetime`` as the instant it names in this process's local time zone, as
    Spark's Row-based API reads one (``astimezone``), or as UTC where that has no answer (at
    the ends of the calendar, ``datetime.min`` say, where Spark fails the batch); pandas'
    ``NaT`` as ``None``; anything else unchanged."""
    if isinstance(value, dt.datetime) and value.tzinfo is None:
        if value != value:  # NaT
            return None
        if isinstance(value, pd.Timestamp):
            value = value.to_pydatetime()
        try:
            return value.astimezone(dt.UTC)
        except (OverflowError, ValueError, OSError):
            return value.replace(tzinfo=dt.UTC)
    return value


class OutputWriter:
    """Collects what ``handle_input_rows`` yields into checked Arrow batches, in order.

    Rows (tuples by position; namedtuples, ``pyspark.sql.Row``\\ s with field names, and
    dicts by name) are gathered column by column; DataFrames (if ``frames``) are
    concatenated. Output order is kept: a switch between rows and DataFrames closes a batch.
    """

    def __init__(self, schema: Any, where: str, *, frames: bool = True) -> None:
        """Emit batches of ``schema``; ``where`` prefixes error messages; ``frames``: accept
        pandas DataFrames too (the pandas form)."""
        self._schema = schema
        self._names = tuple(schema.names)
        self._index = {name: i for i, name in enumerate(self._names)}
        self._where = where
        self._accept_frames = frames
        self._rows: list[tuple[Any, ...]] = []
        self._frames: list[Any] = []
        self._frame_rows = 0
        self._orders: dict[tuple[str, ...], tuple[int, ...] | None] = {}
        self.rows_out = 0

    def extend(self, out: Any) -> Iterator[Any]:
        """Queue everything one ``handle_input_rows`` call returned; yields full batches.

        Raises:
            OutputSchemaError: an item is not a row (or DataFrame), or a batch does not
                conform.
        """
        if out is None:
            return
        if isinstance(out, pd.DataFrame) and self._accept_frames:
            out = (out,)  # returned instead of yielded
        if isinstance(out, pd.DataFrame | dict) or not isinstance(out, Iterable):
            raise OutputSchemaError(
                f"{self._where}: handle_input_rows must return an iterator (yield rows), got "
                f"{type(out).__name__}"
            )
        rows = self._rows
        append = rows.append
        for item in out:
            if type(item) is tuple:
                if self._frames:
                    yield from self._drain_frames()
                append(item)
            else:
                yield from self._add_other(item)
        if len(rows) >= _MAX_ROWS:
            yield self._drain_rows()
        elif self._frame_rows >= _MAX_ROWS or len(self._frames) >= _MAX_FRAMES:
            yield from self._drain_frames()

    def flush(self) -> Iterator[Any]:
        """Yield whatever is still queued.

        Raises:
            OutputSchemaError: a batch does not conform.
        """
        if self._rows:
            yield self._drain_rows()
        yield from self._drain_frames()

    def _add_other(self, item: Any) -> Iterator[Any]:
        if isinstance(item, pd.DataFrame) and self._accept_frames:
            if self._rows:
                yield self._drain_rows()
            if len(item):
                _check_names([str(c) for c in item.columns], self._schema, self._where)
                self._frames.append(item)
                self._frame_rows += len(item)
            return
        row = self._as_row(item)
        if self._frames:
            yield from self._drain_frames()
        self._rows.append(row)

    def _as_row(self, item: Any) -> tuple[Any, ...]:
        """A tuple in schema order from a dict, a named row or a tuple subclass."""
        if isinstance(item, dict):
            names = tuple(item)
            order = self._order(names)
            values = tuple(item.values())
        elif isinstance(item, tuple):
            fields = getattr(item, "__fields__", None) or getattr(item, "_fields", None)
            if not fields:
                return tuple(item)
            order = self._order(tuple(fields))
            values = tuple(item)
        else:
            what = "rows (tuples, Rows or dicts)" + (
                " or DataFrames" if self._accept_frames else ""
            )
            raise OutputSchemaError(
                f"{self._where}: handle_input_rows must yield {what}, got {type(item).__name__}"
            )
        return values if order is None else tuple(values[i] for i in order)

    def _order(self, names: tuple[str, ...]) -> tuple[int, ...] | None:
        """Positions that put values named ``names`` in schema order (``None``: as is)."""
        if names == self._names:
            return None
        if names not in self._orders:
            _check_names(list(names), self._schema, self._where)
            where = {name: i for i, name in enumerate(names)}
            self._orders[names] = tuple(where[n] for n in self._names)
        return self._orders[names]

    def _drain_rows(self) -> Any:
        rows = self._rows.copy()
        self._rows.clear()  # in place: extend() holds its append method
        batch = rows_to_batch(rows, self._schema, self._where)
        self.rows_out += batch.num_rows
        return batch

    def _drain_frames(self) -> Iterator[Any]:
        if not self._frames:
            return
        frames, self._frames, self._frame_rows = self._frames, [], 0
        frame = frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
        batch = conform_frame(frame, self._schema, self._where)
        self.rows_out += batch.num_rows
        yield batch
