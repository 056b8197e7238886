"""Record framing of a changelog body (the Spark design; layout in the package docstring).

Both directions are the hot path of commits and restores, so they are written as tight
loops over pre-compiled :class:`struct.Struct` methods bound to locals:

* encoding appends to one :class:`bytearray` (measured faster than joining a list of
  parts, which also keeps every part alive until the join);
* decoding reads lengths with ``unpack_from`` at an offset and slices each key and value
  once out of the ``bytes`` body. Slicing ``bytes`` makes the one copy the caller keeps; a
  ``memoryview`` slice would need a second one (``bytes(view[a:b])``) and measured ~1.5x
  slower. Bounds are checked by ``unpack_from`` itself: every key and value is followed by a
  length field or the end marker, so a length that runs past the body makes the next
  ``unpack_from`` fail.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Final, TypeAlias

from statekeeper.changelog._header import corrupt

__all__ = [
    "MAX_ITEM_LENGTH",
    "BytesLike",
    "Record",
    "Records",
    "decode_records",
    "encode_records",
]

BytesLike: TypeAlias = bytes | bytearray | memoryview
Record: TypeAlias = tuple[bytes, bytes | None]
# Mapping keys are invariant, so only bytes there (bytearray keys are unhashable anyway).
Records: TypeAlias = Iterable[tuple[BytesLike, BytesLike | None]] | Mapping[bytes, BytesLike | None]

_INT32: Final = struct.Struct(">i")
# -1 marks both a delete (in the value length position) and the end of the records (in the
# key length position).
_MINUS_ONE: Final = _INT32.pack(-1)
# Per key or value: below the int32 maximum (2**31 - 1), so that an oversized item gets
# its own message; in practice MAX_BODY_LENGTH, on the whole body, binds first.
MAX_ITEM_LENGTH: Final = 2**31 - 2


def encode_records(records: Records) -> tuple[bytearray, int]:
    """Frame ``records`` (value ``None`` = delete) as a body ending with the end marker.

    Returns:
        The body and the number of records in it.

    Raises:
        TypeError: an item is not a (key, value) pair, or a key or value is not bytes,
            bytearray or memoryview (a value may also be ``None``).
        ValueError: a key is empty, or a key or value is longer than
            :data:`MAX_ITEM_LENGTH`.
    """
    items = records.items() if isinstance(records, Mapping) else records
    pack = _INT32.pack
    minus_one = _MINUS_ONE
    body = bytearray()
    count = 0
    for pair in items:
        try:
            key, value = pair
        except (TypeError, ValueError):
            raise TypeError(
                f"record {count}: expected a (key, value) pair, found {type(pair).__name__}"
            ) from None
        if type(key) is not bytes:
            key = _to_bytes(key, "key", count)
        if not 0 < len(key) <= MAX_ITEM_LENGTH:
            raise _bad_length("key", len(key), count, "1")
        body += pack(len(key))
        body += key
        if value is None:
            body += minus_one
        else:
            if type(value) is not bytes:
                value = _to_bytes(value, "value", count)
            if len(value) > MAX_ITEM_LENGTH:
                raise _bad_length("value", len(value), count, "0")
            body += pack(len(value))
            body += value
        count += 1
    body += minus_one
    return body, count


def _to_bytes(item: object, what: str, index: int) -> bytes:
    if isinstance(item, bytearray | memoryview):
        return bytes(item)
    accepted = "bytes, bytearray, memoryview" + (" or None (delete)" if what == "value" else "")
    raise TypeError(f"record {index}: {what} must be {accepted}, found {type(item).__name__}")


def _bad_length(what: str, length: int, index: int, low: str) -> ValueError:
    return ValueError(
        f"record {index}: {what} length must be in [{low}, {MAX_ITEM_LENGTH}], found {length}"
    )


def decode_records(body: bytes, count: int, blob: str) -> list[Record]:
    """Parse exactly ``count`` records and the end marker that must close ``body``.

    Raises:
        CorruptStateError: a length field is missing or runs past the body, a key length
            is not positive (an early end marker included), a value length is below -1,
            the end marker is missing or wrong, or bytes follow it.
    """
    unpack = _INT32.unpack_from
    records: list[Record] = []
    append = records.append
    pos = 0
    try:
        for _ in range(count):
            (key_length,) = unpack(body, pos)
            if key_length <= 0:
                raise _bad_key_length(blob, key_length, len(records), count, pos)
            start = pos + 4
            pos = start + key_length
            key = body[start:pos]
            (value_length,) = unpack(body, pos)
            pos += 4
            if value_length >= 0:
                start = pos
                pos += value_length
                append((key, body[start:pos]))
            elif value_length == -1:
                append((key, None))
            else:
                raise corrupt(
                    blob, f"value length of record {len(records)}", ">= 0 or -1", value_length
                )
        (marker,) = unpack(body, pos)
    except struct.error:
        raise corrupt(
            blob,
            "record framing runs past the end of the body",
            f"{count} records and the end marker within {len(body)} bytes",
            f"a length field at offset {pos}",
        ) from None
    _check_end(blob, body, count, pos, marker)
    return records


def _bad_key_length(blob: str, length: int, index: int, count: int, pos: int) -> Exception:
    if length == -1:
        return corrupt(blob, "record count", f"{count} records", f"end marker after {index}")
    what = f"key length of record {index} at offset {pos}"
    return corrupt(blob, what, ">= 1 (keys are non-empty)", length)


def _check_end(blob: str, body: bytes, count: int, pos: int, marker: int) -> None:
    if marker != -1:
        raise corrupt(
            blob,
            f"end marker after {count} records (more records than the header counts?)",
            f"-1 at offset {pos}",
            marker,
        )
    if pos + 4 != len(body):
        raise corrupt(
            blob, "bytes after the end marker", 0, f"{len(body) - pos - 4} at offset {pos + 4}"
        )
