"""The checks an index field must pass, shared by the dataclasses and the JSON parser.

Each check returns why a value is refused ("expected ..., found ...") or ``None``, so the
dataclasses can raise ``ValueError`` and the parser a ``CorruptStateError`` naming the blob.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Sequence
from pathlib import PureWindowsPath

from statekeeper import layout

__all__ = [
    "MAX_ATTRIBS",
    "MAX_CRC",
    "MAX_TIME_MS",
    "blob_id_problem",
    "checkpoint_id_problem",
    "int_problem",
    "name_problem",
    "offsets_problem",
    "prev_index_problem",
    "store_problem",
]

MAX_CRC = 2**32 - 1
MAX_ATTRIBS = 0o777
"""Permission bits only: a restore must never set setuid, setgid or sticky bits."""
MAX_TIME_MS = (2**63 - 1) // 1_000_000
"""``os.utime`` takes int64 nanoseconds."""

_MAX_NAME_BYTES = 255  # NAME_MAX of every filesystem we restore onto
_CHECKPOINT_ID_CHARS = frozenset("0123456789abcdefABCDEF-_.")
# file_blob_key checks the blob id independently of the store it belongs to; any valid
# operator works as the probe.
_PROBE_OPERATOR = "probe"


def name_problem(name: object) -> str | None:
    """Why ``name`` is not a safe file or directory name, or ``None`` if it is.

    A safe name is exactly one relative path component on every platform we run on: not
    empty, not ``.`` or ``..``, without ``/``, ``\\``, NUL or a drive, encodable by the
    filesystem encoding and at most 255 bytes long.
    """
    if not isinstance(name, str):
        return f"expected a str name, found {type(name).__name__}"
    if name in ("", ".", ".."):
        return f"expected a plain file name, found {name!r}"
    if "/" in name or "\\" in name or "\x00" in name:
        return f"expected a single path component without '/', '\\' or NUL, found {name!r}"
    if PureWindowsPath(name).drive:
        return f"expected a relative name without a drive, found {name!r}"
    try:
        encoded = os.fsencode(name)
    except UnicodeError:
        return f"expected a name the filesystem can encode, found {name!r}"
    if len(encoded) > _MAX_NAME_BYTES:
        return f"expected a name of at most {_MAX_NAME_BYTES} bytes, found {len(encoded)} bytes"
    return None


def blob_id_problem(blob_id: object) -> str | None:
    """Why ``blob_id`` is not one that :func:`layout.file_blob_key` accepts, or ``None``."""
    if not isinstance(blob_id, str):
        return f"expected a str blob id, found {type(blob_id).__name__}"
    try:
        layout.file_blob_key(_PROBE_OPERATOR, 0, blob_id)
    except ValueError as exc:
        return str(exc)
    return None


def int_problem(value: object, what: str, low: int, high: int | None = None) -> str | None:
    """Why ``value`` is not an int (bools refused) in ``[low, high]``, or ``None``."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"expected {what} to be an int, found {type(value).__name__}"
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        return f"expected {what} {bound}, found {value}"
    return None


def offsets_problem(offsets: Sequence[int], size: int) -> str | None:
    """Why chunk ``offsets`` do not tile a file of ``size`` bytes, or ``None``.

    Chunk sizes are derived from consecutive offsets (the last chunk runs to ``size``), so
    the offsets must start at 0 and strictly increase below ``size``; an empty file has none.
    """
    if not offsets:
        return None if size == 0 else f"expected blobs covering {size} bytes, found no blobs"
    if size == 0:
        return f"expected no blobs for an empty file, found {len(offsets)}"
    if offsets[0] != 0:
        return f"expected the first blob at offset 0, found offset {offsets[0]}"
    for before, after in itertools.pairwise(offsets):
        if after <= before:
            return f"expected strictly increasing offsets, found {after} after {before}"
    if offsets[-1] >= size:
        return (
            f"expected blob offsets to add up to sizeInBytes {size}, found the last blob "
            f"at offset {offsets[-1]}"
        )
    return None


def checkpoint_id_problem(value: object) -> str | None:
    """Why ``value`` is not a checkpoint id (a uuid, hex or dashed), or ``None``."""
    if not isinstance(value, str):
        return f"expected checkpointId to be a str, found {type(value).__name__}"
    if not 1 <= len(value) <= 64 or not set(value) <= _CHECKPOINT_ID_CHARS:
        return f"expected checkpointId to be a uuid hex, found {value!r}"
    return None


def prev_index_problem(prev: object, operator: str, partition: int, version: int) -> str | None:
    """Why ``prev`` is not the index key of an earlier snapshot of the same store, or ``None``.

    Holding this keeps the ``prevSnapshotIndexBlobId`` chain of a store finite and inside it.
    """
    if prev is None:
        return None
    if not isinstance(prev, str):
        return f"expected prevSnapshotIndexBlobId to be a str or null, found {type(prev).__name__}"
    prev_version = layout.parse_snapshot_key(prev)
    expected = None if prev_version is None else layout.snapshot_index_key
    if prev_version is None and (parsed := layout.parse_attempt_snapshot_key(prev)) is not None:
        prev_version = parsed[0]  # format 2: a name unique to the upload
        expected = functools.partial(layout.attempt_snapshot_key, attempt=parsed[1])
    if (
        prev_version is None
        or expected is None
        or prev_version >= version
        or prev != expected(operator, partition, prev_version)
    ):
        return (
            "expected prevSnapshotIndexBlobId to be a snapshot index key of "
            f"{operator}/{partition} below version {version}, found {prev!r}"
        )
    return None


def store_problem(store: object) -> str | None:
    """Why ``store`` is not an (operator, partition) pair naming a store, or ``None``."""
    if not isinstance(store, tuple) or len(store) != 2:
        return f"expected store to be an (operator, partition) pair, found {store!r}"
    try:
        layout.store_prefix(store[0], store[1])
    except (TypeError, ValueError) as exc:
        return f"expected store to name a store, found {store!r}: {exc}"
    return None
