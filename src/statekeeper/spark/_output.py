"""Output checks: every batch a processor emits must match the declared output schema.

Spark reads ``mapInArrow`` output by position and fails late and cryptically on a mismatch,
so every batch is checked here, column by column, and a mismatch names the column, the type
found and the type declared. The rule is strict: a column must have the declared Arrow type,
with three lossless exceptions that pandas makes unavoidable — an all-null column (pandas
cannot type it), a narrower or wider type of the same kind that converts without loss
(``int64`` values into ``int``, ``string`` into ``large_string``, timestamp units), and
``None`` in a nullable column. An ``int`` column for a ``double`` field is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pandas as pd  # type: ignore[import-untyped]
import pyarrow as pa  # type: ignore[import-untyped]

from statekeeper.errors import StateKeeperError

__all__ = ["OutputSchemaError", "OutputWriter", "conform_batch", "conform_frame"]

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
        try:
            array = pa.Array.from_pandas(frame[field.name])
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


class OutputWriter:
    """Collects the DataFrames a processor yields into checked Arrow batches."""

    def __init__(self, schema: Any, where: str) -> None:
        """Emit batches of ``schema``; ``where`` prefixes error messages."""
        self._schema = schema
        self._where = where
        self._frames: list[Any] = []
        self._rows = 0
        self.rows_out = 0

    def add(self, frame: Any) -> Iterator[Any]:
        """Queue ``frame``; yields a batch when enough rows are queued.

        Raises:
            OutputSchemaError: ``frame`` is not a DataFrame, or a batch does not conform.
        """
        if not isinstance(frame, pd.DataFrame):
            raise OutputSchemaError(
                f"{self._where}: handle_input_rows must yield pandas DataFrames, got "
                f"{type(frame).__name__}"
            )
        if len(frame) == 0:
            return
        self._frames.append(frame)
        self._rows += len(frame)
        if self._rows >= _MAX_ROWS or len(self._frames) >= _MAX_FRAMES:
            yield self._drain()

    def flush(self) -> Iterator[Any]:
        """Yield whatever is still queued.

        Raises:
            OutputSchemaError: a batch does not conform.
        """
        if self._frames:
            yield self._drain()

    def _drain(self) -> Any:
        frames, self._frames, self._rows = self._frames, [], 0
        for frame in frames:
            _check_names([str(c) for c in frame.columns], self._schema, self._where)
        frame = frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
        batch = conform_frame(frame, self._schema, self._where)
        self.rows_out += batch.num_rows
        return batch
