"""The version label of a working copy, and the undo record of its last commit.

The label is the value of the empty key ``b""`` (users cannot write it: keys are non-empty):
version (uint64), dirty flag (uint8), the root id in UTF-8 and, from format 2, a NUL and the
id of the attempt whose content the version is; then, optionally, a byte 0x01 and the undo
record of the commit that made the version. The dirty flag is set while the data holds a
version not yet durable in the blob store (snapshot mode applies locally before the snapshot
upload that commits it); such a copy is never reused as a committed version.

A re-run of micro-batch ``b`` (a task retry, a restarted query, a fixed processor) opens
version ``b`` while the local copy already holds ``b + 1`` of the failed attempt. Rather than
download a snapshot and replay changelogs, the copy applies the undo record of its last
commit: the old value (or absence) of every key that commit changed, and the version and
attempt it was built on. The record is part of the version label, so it is written in the
same ``WriteBatch`` as the commit's data (see :mod:`statekeeper.store._working_copy`):
whatever a flush or crash leaves on disk, the record describes exactly the step from the
labelled version back to its parent.

Record: ``magic | parent version (uint64) | attempt length (uint16) | parent attempt (UTF-8)
| count (uint32) | entries``; an entry is ``key length (uint32) | key | value length (int32,
-1: absent) | value``, big-endian.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

from statekeeper.manifest import LEGACY_ATTEMPT

__all__ = [
    "MAX_UNDO_BYTES",
    "Label",
    "Undo",
    "decode_undo",
    "encode_undo",
    "pack_label",
    "parse_label",
]

MAX_UNDO_BYTES = 64 * 1024 * 1024
"""A commit whose undo would be larger keeps none: stepping back over it downloads instead
(a value this large would slow every flush and compaction of the label)."""

_LABEL = struct.Struct(">QB")
_UNDO_MARK = b"\x01"  # never in a root id or an attempt id (hex, or "format1")
_MAGIC = b"SKU1"
_HEAD = struct.Struct(">QH")
_COUNT = struct.Struct(">I")
_KEY = struct.Struct(">I")
_VALUE = struct.Struct(">i")
_ABSENT = _VALUE.pack(-1)


@dataclass(frozen=True)
class Label:
    """What the label of a working copy says (its undo record aside)."""

    version: int
    dirty: bool
    root_id: str
    attempt: str
    """The attempt whose content the version is (``""`` for version 0)."""
    has_undo: bool = False


def pack_label(
    version: int, *, dirty: bool, root_id: str, attempt: str, undo: bytes | None = None
) -> bytes:
    """The label value; ``undo`` (from :func:`encode_undo`) steps back to the parent."""
    text = root_id + ("\0" + attempt if attempt else "")
    raw = _LABEL.pack(version, dirty) + text.encode("utf-8")
    return raw if undo is None else raw + _UNDO_MARK + undo


def parse_label(raw: bytes) -> tuple[Label, bytes | None]:
    """The label and the raw undo record (``None`` if there is none).

    Raises:
        ValueError: ``raw`` is not a label.
    """
    if len(raw) < _LABEL.size:
        raise ValueError(f"a label is at least {_LABEL.size} bytes, found {len(raw)}")
    version, dirty = _LABEL.unpack_from(raw)
    text, mark, undo = raw[_LABEL.size :].partition(_UNDO_MARK)
    root_id, _, attempt = text.decode("utf-8").partition("\0")
    if not attempt and version:
        attempt = LEGACY_ATTEMPT  # labelled by statekeeper 0.1
    label = Label(int(version), bool(dirty), root_id, attempt, has_undo=bool(mark))
    return label, (undo if mark else None)


@dataclass(frozen=True)
class Undo:
    """How to step a copy back from its labelled version to its parent."""

    parent_version: int
    parent_attempt: str
    changes: list[tuple[bytes, bytes | None]]
    """Puts (old value) and deletes (``None``: the key did not exist) that restore the
    parent."""


def encode_undo(
    parent_version: int, parent_attempt: str, old: Iterable[tuple[bytes, bytes | None]]
) -> bytes | None:
    """The undo record, or ``None`` if it would exceed :data:`MAX_UNDO_BYTES`."""
    attempt = parent_attempt.encode("utf-8")
    parts = [_MAGIC, _HEAD.pack(parent_version, len(attempt)), attempt, b""]
    append, key_len, value_len = parts.append, _KEY.pack, _VALUE.pack
    size, count = 0, 0
    for key, value in old:  # on the commit path: kept to appends, no per-entry joins
        append(key_len(len(key)))
        append(key)
        if value is None:
            append(_ABSENT)
            size += len(key) + 8
        else:
            append(value_len(len(value)))
            append(value)
            size += len(key) + len(value) + 8
        count += 1
        if size > MAX_UNDO_BYTES:
            return None
    parts[3] = _COUNT.pack(count)
    return b"".join(parts)


def decode_undo(raw: bytes) -> Undo | None:
    """The record ``raw`` holds; ``None`` if it is not one (then nobody steps back)."""
    if not raw.startswith(_MAGIC):
        return None
    try:
        pos = len(_MAGIC)
        version, length = _HEAD.unpack_from(raw, pos)
        pos += _HEAD.size
        attempt = raw[pos : pos + length].decode("utf-8")
        pos += length
        (count,) = _COUNT.unpack_from(raw, pos)
        pos += _COUNT.size
        changes: list[tuple[bytes, bytes | None]] = []
        for _ in range(count):
            (klen,) = _KEY.unpack_from(raw, pos)
            key = raw[pos + _KEY.size : pos + _KEY.size + klen]
            pos += _KEY.size + klen
            (vlen,) = _VALUE.unpack_from(raw, pos)
            pos += _VALUE.size
            value = None if vlen < 0 else raw[pos : pos + vlen]
            pos += max(vlen, 0)
            changes.append((key, value))
    except (struct.error, UnicodeDecodeError):
        return None
    if pos != len(raw):
        return None
    return Undo(version, attempt, changes)
