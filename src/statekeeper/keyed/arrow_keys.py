"""Key encoding of whole Arrow columns: the task runtime's bulk path to ``encode_key``.

It needs pyarrow, so only the per-partition runner imports it; the keyed layer's other
modules need no pyarrow. It writes exactly what :func:`statekeeper.keyed.encode_key` writes,
deriving each element's tag and terminator from :func:`statekeeper.keyed.encode_element`,
so the format stays owned by ``keyed``; ``tests/spark/test_keys.py`` checks the two agree.
Given the rows' key groups, it prefixes each key with :func:`statekeeper.keyed.group_prefix`,
as the in-store layout of an operator with key groups wants.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]

from statekeeper.keyed._tuples import encode_element, encode_key

__all__ = ["encode_keys"]

# A string element is its tag, its UTF-8 bytes with 0x00 escaped as 0x00 0xFF, and a
# terminator; the empty string is tag + terminator. Same for bytes.
_STR_TAG, _END = encode_element("")[:1], encode_element("")[1:]
_BYTES_TAG = encode_element(b"")[:1]


def encode_keys(columns: Sequence[Any], key_groups: Any | None = None) -> list[bytes]:
    """Encode many keys at once: ``columns`` are pyarrow arrays (or chunked arrays), one per
    key column, of equal length; the result is ``encode_key`` of each row, prefixed with the
    row's key group (two bytes big-endian) if ``key_groups`` (an integer array or sequence of
    the same length, e.g. a batch's key-group column) is given.

    String and binary columns without nulls are encoded with Arrow kernels (no Python loop
    over rows); other columns fall back to :func:`encode_key` per row.

    Raises:
        TypeError: an element has a type keys cannot hold.
        ValueError: ``key_groups`` has another length, or holds a null or an out-of-range
            key group.
    """
    if key_groups is None:
        return _encode_keys(columns)
    prefixes = _prefixes(key_groups)
    rows = len(columns[0]) if columns else 0
    if len(prefixes) != rows:
        raise ValueError(f"expected {rows} key groups, one per key; got {len(prefixes)}")
    return _encode_keys(columns, prefixes)


def _prefixes(key_groups: Any) -> Any:
    """Two bytes big-endian per key group, as a fixed-size binary Arrow array (no Python
    loop over rows).

    Raises:
        ValueError: a null, a non-integer or an out-of-range key group.
    """
    if isinstance(key_groups, pa.ChunkedArray):
        key_groups = key_groups.combine_chunks()
    if isinstance(key_groups, pa.Array):
        if key_groups.null_count:
            raise ValueError("key groups must be ints from 0 to 65535: found a null")
        key_groups = key_groups.to_numpy(zero_copy_only=False)
    try:
        groups = np.asarray(key_groups)
        if groups.size and groups.dtype.kind not in "iu":
            raise TypeError(f"found {groups.dtype}")
        groups = groups.astype(np.int64, copy=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"key groups must be ints from 0 to 65535: {exc}") from exc
    if groups.size and (groups.min() < 0 or groups.max() > 0xFFFF):
        raise ValueError(
            f"key groups must be ints from 0 to 65535: found {groups.min()} to {groups.max()}"
        )
    data = pa.py_buffer(groups.astype(">u2").tobytes())
    return pa.Array.from_buffers(pa.binary(2), len(groups), [None, data])


def _encode_keys(columns: Sequence[Any], prefixes: Any = None) -> list[bytes]:
    if not columns:
        return []
    end = pa.scalar(_END, pa.large_binary())
    parts = [] if prefixes is None else [prefixes.cast(pa.large_binary())]
    for column in columns:
        kind = column.type
        text = pa.types.is_string(kind) or pa.types.is_large_string(kind)
        binary = pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
        if column.null_count or not (text or binary):
            keys = [encode_key(key) for key in zip(*(c.to_pylist() for c in columns), strict=True)]
            if prefixes is None:
                return keys
            return [g + k for g, k in zip(prefixes.to_pylist(), keys, strict=True)]
        escaped = pc.replace_substring(column.cast(pa.large_binary()), b"\x00", b"\x00\xff")
        parts += [pa.scalar(_STR_TAG if text else _BYTES_TAG, pa.large_binary()), escaped, end]
    joined = pc.binary_join_element_wise(*parts, pa.scalar(b"", pa.large_binary()))
    return joined.to_pylist()  # type: ignore[no-any-return]
