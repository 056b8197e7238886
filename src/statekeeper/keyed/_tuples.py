"""Order-preserving, unambiguous byte encoding of grouping keys (tuples of column values).

The encoding follows the FoundationDB tuple layer: every element starts with a type tag and
is self-delimiting (variable-length bytes and strings are terminated by ``0x00 0x01``, with
a ``0x00`` inside escaped as ``0x00 0xFF``), so

* two different tuples of the same arity never encode to the same bytes, and neither is a
  prefix of the other (prefix scans of one key never see another key's entries);
* within one element type, byte order is value order (ints, floats, strings as UTF-8
  bytes, bytes, booleans, dates, timestamps), so a scan returns keys sorted.

Floats are normalized first (``-0.0`` becomes ``0.0``, every NaN the same NaN), as Spark
does for grouping keys. Decimals are ordered among decimals of one scale (a Spark decimal
column has a fixed scale).
"""

from __future__ import annotations

import datetime as dt
import math
import struct
from collections.abc import Iterable
from decimal import Decimal
from typing import Any

__all__ = [
    "KeyValue",
    "decode_element",
    "decode_key",
    "encode_element",
    "encode_key",
]

KeyValue = None | bool | int | float | str | bytes | dt.date | dt.datetime | Decimal
"""The Python types a grouping key element may have."""

_NULL = 0x00
_BYTES = 0x01
_STR = 0x02
_INT_ZERO = 0x14  # ints: 0x0C..0x1C for -8..8 bytes of magnitude, 0x0B/0x1D beyond
_NEG_BIG = 0x0B
_POS_BIG = 0x1D
_DOUBLE = 0x21
_FALSE = 0x26
_TRUE = 0x27
_DATE = 0x30
_TS_UTC = 0x31
_TS_NAIVE = 0x32
_DECIMAL = 0x33

_DOUBLE_STRUCT = struct.Struct(">d")
_U64 = struct.Struct(">Q")
_EPOCH_DATE = dt.date(1970, 1, 1)
_EPOCH_UTC = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_EPOCH_NAIVE = dt.datetime(1970, 1, 1)
_CANONICAL_NAN = _DOUBLE_STRUCT.pack(math.nan)


def encode_key(values: Iterable[Any]) -> bytes:
    """Encode a tuple of key column values.

    Raises:
        TypeError: an element has a type keys cannot hold (see :data:`KeyValue`).
    """
    out = bytearray()
    for value in values:
        _encode(value, out)
    return bytes(out)


def encode_element(value: Any) -> bytes:
    """Encode one key element (also used for map-state keys).

    Raises:
        TypeError: ``value`` has a type keys cannot hold.
    """
    out = bytearray()
    _encode(value, out)
    return bytes(out)


def decode_key(data: bytes, arity: int) -> tuple[tuple[Any, ...], int]:
    """Decode ``arity`` elements from the start of ``data``.

    Returns:
        The tuple and the offset just after it.

    Raises:
        ValueError: ``data`` does not start with ``arity`` well-formed elements.
    """
    values: list[Any] = []
    pos = 0
    for _ in range(arity):
        value, pos = decode_element(data, pos)
        values.append(value)
    return tuple(values), pos


def _encode(value: Any, out: bytearray) -> None:
    kind = type(value)
    if value is None:
        out.append(_NULL)
    elif kind is str:
        out.append(_STR)
        _escaped(value.encode("utf-8"), out)
    elif kind is int:
        _encode_int(value, out)
    elif kind is bool:
        out.append(_TRUE if value else _FALSE)
    elif kind is float:
        _encode_float(value, out)
    else:
        _encode_other(value, out)


def _encode_other(value: Any, out: bytearray) -> None:
    if isinstance(value, bytes | bytearray | memoryview):
        out.append(_BYTES)
        _escaped(bytes(value), out)
    elif isinstance(value, dt.datetime):
        _encode_datetime(value, out)
    elif isinstance(value, dt.date):
        out.append(_DATE)
        _encode_int((value - _EPOCH_DATE).days, out)
    elif isinstance(value, Decimal):
        if not value.is_finite():
            raise TypeError(f"a key cannot hold the decimal {value}")
        sign, digits, exponent = value.as_tuple()
        unscaled = int("".join(map(str, digits)) or "0") * (-1 if sign else 1)
        out.append(_DECIMAL)
        _encode_int(int(exponent), out)
        _encode_int(unscaled, out)
    elif isinstance(value, bool):
        out.append(_TRUE if value else _FALSE)
    elif isinstance(value, int):  # numpy integers and other Integral types
        _encode_int(int(value), out)
    elif isinstance(value, float):
        _encode_float(float(value), out)
    elif type(value).__module__ == "numpy" and hasattr(value, "item"):
        _encode(value.item(), out)
    else:
        raise TypeError(
            f"a key element cannot be of type {type(value).__name__}: use None, bool, int, "
            "float, str, bytes, date, datetime or Decimal"
        )


def _escaped(data: bytes, out: bytearray) -> None:
    # Terminated by 0x00 0x01, not a lone 0x00 as in FoundationDB: with a lone 0x00 the
    # encoding of "" (02 00) is a prefix of that of "\x00" (02 00 FF 00), and a prefix scan
    # of one key would see another key's state. Here a 0x00 is always followed by 0xFF
    # (escaped) or 0x01 (the end), so no encoding is a prefix of another, and order holds
    # (0x01 < 0xFF and 0x00 0x01 sorts before any longer string's next byte).
    out += data.replace(b"\x00", b"\x00\xff")
    out += b"\x00\x01"


def _encode_int(value: int, out: bytearray) -> None:
    if value == 0:
        out.append(_INT_ZERO)
        return
    magnitude = abs(value)
    size = (magnitude.bit_length() + 7) // 8
    if value > 0:
        body = magnitude.to_bytes(size, "big")
        if size <= 8:
            out.append(_INT_ZERO + size)
        else:
            out.append(_POS_BIG)
            out.append(size)
        out += body
        return
    # Negative: one's complement of the magnitude, so larger magnitudes sort first.
    body = (magnitude ^ ((1 << (8 * size)) - 1)).to_bytes(size, "big")
    if size <= 8:
        out.append(_INT_ZERO - size)
    else:
        out.append(_NEG_BIG)
        out.append(size ^ 0xFF)
    out += body


def _encode_float(value: float, out: bytearray) -> None:
    out.append(_DOUBLE)
    # -0.0 + 0.0 == 0.0: both zeros encode alike, as do all NaNs.
    raw = _CANONICAL_NAN if math.isnan(value) else _DOUBLE_STRUCT.pack(value + 0.0)
    bits = _U64.unpack(raw)[0]
    # Positive: flip the sign bit; negative: flip every bit (FoundationDB's order trick).
    bits = bits ^ 0xFFFFFFFFFFFFFFFF if bits >> 63 else bits | (1 << 63)
    out += _U64.pack(bits)


def _encode_datetime(value: dt.datetime, out: bytearray) -> None:
    if value.tzinfo is not None and value.utcoffset() is not None:
        out.append(_TS_UTC)
        delta = value - _EPOCH_UTC
    else:
        out.append(_TS_NAIVE)
        delta = value.replace(tzinfo=None) - _EPOCH_NAIVE
    micros = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    _encode_int(micros, out)


def decode_element(data: bytes, pos: int = 0) -> tuple[Any, int]:
    """Decode one element at ``pos``; returns it and the offset after it.

    Raises:
        ValueError: malformed or truncated data.
    """
    try:
        tag = data[pos]
    except IndexError:
        raise ValueError(f"truncated key at offset {pos}") from None
    pos += 1
    if tag == _NULL:
        return None, pos
    if tag in (_BYTES, _STR):
        raw, pos = _unescape(data, pos)
        return (raw.decode("utf-8") if tag == _STR else raw), pos
    if _NEG_BIG <= tag <= _POS_BIG:
        return _decode_int(data, pos, tag)
    if tag == _DOUBLE:
        return _decode_float(data, pos)
    if tag in (_FALSE, _TRUE):
        return tag == _TRUE, pos
    return _decode_temporal(data, pos, tag)


def _decode_temporal(data: bytes, pos: int, tag: int) -> tuple[Any, int]:
    if tag == _DATE:
        days, pos = _decode_int(data, pos + 1, data[pos])
        return _EPOCH_DATE + dt.timedelta(days=days), pos
    if tag in (_TS_UTC, _TS_NAIVE):
        micros, pos = _decode_int(data, pos + 1, data[pos])
        epoch = _EPOCH_UTC if tag == _TS_UTC else _EPOCH_NAIVE
        return epoch + dt.timedelta(microseconds=micros), pos
    if tag == _DECIMAL:
        exponent, pos = _decode_int(data, pos + 1, data[pos])
        unscaled, pos = _decode_int(data, pos + 1, data[pos])
        return Decimal(unscaled).scaleb(exponent), pos
    raise ValueError(f"unknown key element tag 0x{tag:02x} at offset {pos - 1}")


def _unescape(data: bytes, pos: int) -> tuple[bytes, int]:
    out = bytearray()
    while True:
        end = data.find(b"\x00", pos)
        if end < 0:
            raise ValueError("unterminated string or bytes in key")
        out += data[pos:end]
        follower = data[end + 1] if end + 1 < len(data) else None
        if follower == 0xFF:
            out.append(0x00)
            pos = end + 2
            continue
        if follower != 0x01:
            raise ValueError(f"malformed string or bytes terminator in key at offset {end}")
        return bytes(out), end + 2


def _decode_int(data: bytes, pos: int, tag: int) -> tuple[int, int]:
    if not _NEG_BIG <= tag <= _POS_BIG:
        raise ValueError(f"expected an int in key at offset {pos - 1}, found tag 0x{tag:02x}")
    if tag == _INT_ZERO:
        return 0, pos
    if tag == _POS_BIG:
        size, pos = data[pos], pos + 1
    elif tag == _NEG_BIG:
        size, pos = data[pos] ^ 0xFF, pos + 1
    else:
        size = abs(tag - _INT_ZERO)
    body = data[pos : pos + size]
    if len(body) != size:
        raise ValueError("truncated int in key")
    value = int.from_bytes(body, "big")
    if tag < _INT_ZERO:
        value = -(value ^ ((1 << (8 * size)) - 1))
    return value, pos + size


def _decode_float(data: bytes, pos: int) -> tuple[float, int]:
    raw = data[pos : pos + 8]
    if len(raw) != 8:
        raise ValueError("truncated float in key")
    bits = _U64.unpack(raw)[0]
    bits = bits ^ (1 << 63) if bits >> 63 else bits ^ 0xFFFFFFFFFFFFFFFF
    return float(_DOUBLE_STRUCT.unpack(_U64.pack(bits))[0]), pos + 8
