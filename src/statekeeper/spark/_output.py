"""Output checks; they live in :mod:`statekeeper.keyed._output` (no pyspark)."""

from __future__ import annotations

from statekeeper.keyed._output import (
    OutputSchemaError,
    OutputWriter,
    conform_batch,
    conform_frame,
    rows_to_batch,
)

__all__ = ["OutputSchemaError", "OutputWriter", "conform_batch", "conform_frame", "rows_to_batch"]
