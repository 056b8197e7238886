"""Key encoding of Arrow columns; lives in :mod:`statekeeper.keyed._arrow_keys` (no pyspark)."""

from __future__ import annotations

from statekeeper.keyed._arrow_keys import encode_keys

__all__ = ["encode_keys"]
