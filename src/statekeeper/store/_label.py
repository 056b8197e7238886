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

Record (columnar, big-endian): ``magic | parent version (uint64) | attempt length (uint16) |
parent attempt (UTF-8) | count (uint32) | count key lengths (uint32) | count value lengths
(int32, -1: absent) | the keys | the values present``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

from statekeeper.manifest import LEGACY_ATTEMPT

__all__ = [
    "MAX_UNDO_BYTES",
    "MAX_UNDO_KEYS",
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
MAX_UNDO_KEYS = 4096
"""A commit of more changed keys keeps no undo record either. The record costs a read of
every changed key's old value on the commit path (about 2 µs a key: 20 ms for 10,000 keys,
a third of such a commit), paid on every commit to save a few hundred milliseconds on a
rare re-run; up to this many keys it costs a few milliseconds."""

_LABEL = struct.Struct(">QB")
_UNDO_MARK = b"\x01"  # never in a root id or an attempt id (hex, or "format1")
_MAGIC = b"SKU2"
_HEAD = struct.Struct(">QH")
_COUNT = struct.Struct(">I")


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
    """The undo record, or ``None`` if it would exceed :data:`MAX_UNDO_BYTES`.

    On the commit path: columnar, so every loop over the entries runs in C (``struct`` and
    ``bytes.join``), not one Python append per field.
    """
    pairs = list(old)
    keys = [key for key, _ in pairs]
    values = [value for _, value in pairs]
    key_lengths = list(map(len, keys))
    value_lengths = [-1 if value is None else len(value) for value in values]
    count = len(pairs)
    size = sum(key_lengths) + sum(value_lengths) + 2 * count + 8 * count
    if size > MAX_UNDO_BYTES:
        return None
    attempt = parent_attempt.encode("utf-8")
    return b"".join(
        (
            _MAGIC,
            _HEAD.pack(parent_version, len(attempt)),
            attempt,
            _COUNT.pack(count),
            struct.pack(f">{count}I", *key_lengths),
            struct.pack(f">{count}i", *value_lengths),
            b"".join(keys),
            b"".join([value for value in values if value is not None]),
        )
    )


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
        key_lengths = struct.unpack_from(f">{count}I", raw, pos)
        pos += 4 * count
        value_lengths = struct.unpack_from(f">{count}i", raw, pos)
        pos += 4 * count
        changes: list[tuple[bytes, bytes | None]] = []
        values_at = pos + sum(key_lengths)
        for key_length, value_length in zip(key_lengths, value_lengths, strict=True):
            key = raw[pos : pos + key_length]
            pos += key_length
            if value_length < 0:
                changes.append((key, None))
            else:
                changes.append((key, raw[values_at : values_at + value_length]))
                values_at += value_length
    except (struct.error, UnicodeDecodeError):
        return None
    if values_at != len(raw):  # truncated, or trailing bytes: not a record we wrote
        return None
    return Undo(version, attempt, changes)
