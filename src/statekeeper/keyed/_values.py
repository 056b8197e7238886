"""Value codecs of state handles: a safe, versioned default, and pickle only when asked for.

The default codec (:class:`DefaultCodec`) writes a format byte (``0x01``) and then a tagged
binary form of JSON-like values: ``None``, ``bool``, ``int`` (any size), ``float``, ``str``,
``bytes``, ``list``, ``tuple``, ``dict`` (keys of any supported hashable type),
``datetime``, ``date``, ``time``, ``timedelta`` and ``Decimal``; numpy scalars are stored as
the Python values they stand for (a numpy time in nanoseconds as a ``datetime`` or
``timedelta``, truncated to microseconds, as a pandas ``Timestamp`` is), and pandas' ``NaT``
(a missing time) as ``None``; a numpy array, even of one element, is refused (store
``array.tolist()``). Decoding never executes code. A reader that meets a format byte
it does not know refuses with a clear error instead of guessing.

:class:`PickleCodec` (format byte ``0x80``) stores any picklable object. Unpickling runs
code chosen by whoever wrote the bytes, so it is used only by handles that name it.

A state declared with a schema wraps its codec's bytes in a third format (``0x02``, a schema
version first): see :mod:`statekeeper.keyed._schema`.
"""

from __future__ import annotations

import datetime as dt
import pickle
import struct
from decimal import Decimal
from typing import Any, Protocol, runtime_checkable

from statekeeper.errors import CorruptStateError

__all__ = ["Codec", "DefaultCodec", "PickleCodec", "codec_by_name", "read_varint", "varint"]

DEFAULT_FORMAT = 0x01
SCHEMA_FORMAT = 0x02
"""A value of a state with a declared schema: version, then a codec's bytes (``_schema``)."""
PICKLE_FORMAT = 0x80
_MAX_DEPTH = 100

_NONE, _FALSE, _TRUE, _INT, _BIGINT, _FLOAT, _STR, _BYTES = range(8)
_LIST, _TUPLE, _DICT, _DATETIME, _DATE, _TIME, _TIMEDELTA, _DECIMAL = range(8, 16)

_RAW_TAGS = frozenset((_BIGINT, _BYTES, _DATETIME, _DATE, _TIME, _DECIMAL))

_I64 = struct.Struct(">q")
_F64 = struct.Struct(">d")
_TD = struct.Struct(">qqq")
_INT_HEAD = bytes([DEFAULT_FORMAT, _INT])
_FLOAT_HEAD = bytes([DEFAULT_FORMAT, _FLOAT])
_TAGGED_I64 = struct.Struct(">Bq").pack
_TAGGED_F64 = struct.Struct(">Bd").pack
_FLAT_TAGS = {_INT: "xq", _FLOAT: "xd"}
_NUMBER_TAGS = bytes(_FLAT_TAGS)
_MAX_FLAT = 16
"""Elements of the longest tuple or list of numbers decoded by one cached ``Struct``."""


@runtime_checkable
class Codec(Protocol):
    """Turns state values into bytes and back. Implementations must be picklable."""

    name: str
    """Recorded with each state, so tools know how to read its values."""

    def encode(self, value: Any) -> bytes:
        """Bytes of ``value``.

        Raises:
            TypeError: ``value`` cannot be encoded by this codec.
        """
        ...

    def decode(self, data: bytes) -> Any:
        """The value ``data`` encodes.

        Raises:
            CorruptStateError: ``data`` is not something this codec wrote.
        """
        ...


class DefaultCodec:
    """The safe default: tagged binary JSON-like values with a format byte."""

    name = "default"

    def encode(self, value: Any) -> bytes:
        """Encode ``value``.

        Raises:
            TypeError: a type outside the supported set (the message names it).
            ValueError: nesting deeper than 100 levels (or a reference cycle).
        """
        kind = type(value)
        if kind is int and -(2**63) <= value < 2**63:
            return _INT_HEAD + _I64.pack(value)
        if kind is float:
            return _FLOAT_HEAD + _F64.pack(value)
        out = bytearray((DEFAULT_FORMAT,))
        if kind is tuple or kind is list:
            _encode_container(value, out, 0)
        else:
            _encode(value, out, 0)
        return bytes(out)

    def decode(self, data: bytes) -> Any:
        """Decode bytes written by :meth:`encode`.

        Raises:
            CorruptStateError: an unknown format byte, pickled data, or malformed bytes.
        """
        size = len(data)
        if size >= 3 and data[0] == DEFAULT_FORMAT:  # the common shapes first, as encode
            tag = data[1]
            if size == 10 and (tag == _INT or tag == _FLOAT):  # noqa: SIM109 (no tuple per call)
                return (_I64 if tag == _INT else _F64).unpack_from(data, 2)[0]
            if tag == _TUPLE or tag == _LIST:  # noqa: SIM109
                flat = _decode_flat(data)
                if flat is not None:
                    return flat
        elif not data:
            raise CorruptStateError("state value is empty: expected a format byte")
        fmt = data[0]
        if fmt == PICKLE_FORMAT:
            raise CorruptStateError(
                "state value is pickled; the default codec never unpickles (it can run "
                "arbitrary code): declare the state with codec=PickleCodec() to read it"
            )
        if fmt == SCHEMA_FORMAT:
            raise CorruptStateError(
                "state value carries a schema version (format byte 0x02): read it through its "
                "state's declared schema, or with the schemas the operator record holds"
            )
        if fmt != DEFAULT_FORMAT:
            raise CorruptStateError(
                f"state value has format byte 0x{fmt:02x}; this statekeeper reads 0x01 "
                "(default), 0x02 (with a schema) and 0x80 (pickle): was it written by a newer "
                "version or another codec?"
            )
        try:
            value, end = _decode(memoryview(data), 1)
        except (IndexError, ValueError, TypeError, ArithmeticError, struct.error) as exc:
            raise CorruptStateError(f"state value is malformed: {exc}") from exc
        if end != len(data):
            raise CorruptStateError(f"state value has {len(data) - end} trailing bytes")
        return value

    def __eq__(self, other: object) -> bool:
        return type(other) is DefaultCodec

    def __hash__(self) -> int:
        return hash(DefaultCodec)

    def __repr__(self) -> str:
        return "DefaultCodec()"


class PickleCodec:
    """Stores any picklable object. Only for trusted checkpoint roots: unpickling runs code."""

    name = "pickle"

    def __init__(self, protocol: int = pickle.HIGHEST_PROTOCOL) -> None:
        """Use pickle ``protocol`` for writing."""
        self.protocol = protocol

    def encode(self, value: Any) -> bytes:
        """Pickle ``value``.

        Raises:
            TypeError: ``value`` cannot be pickled.
        """
        try:
            return bytes((PICKLE_FORMAT,)) + pickle.dumps(value, protocol=self.protocol)
        except (pickle.PicklingError, AttributeError) as exc:
            raise TypeError(f"cannot pickle a {type(value).__name__}: {exc}") from exc

    def decode(self, data: bytes) -> Any:
        """Unpickle ``data`` (values written by the default codec are decoded too).

        Raises:
            CorruptStateError: the bytes are neither pickled nor default-encoded.
        """
        if data[:1] == bytes((DEFAULT_FORMAT,)):
            return DefaultCodec().decode(data)
        if data[:1] != bytes((PICKLE_FORMAT,)):
            raise CorruptStateError("state value is not pickled: unexpected format byte")
        try:
            # Safe only because this codec is used solely where a handle names it.
            return pickle.loads(data[1:])
        except Exception as exc:
            raise CorruptStateError(f"pickled state value cannot be loaded: {exc}") from exc

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PickleCodec) and other.protocol == self.protocol

    def __hash__(self) -> int:
        return hash((PickleCodec, self.protocol))

    def __repr__(self) -> str:
        return f"PickleCodec(protocol={self.protocol})"


def codec_by_name(name: str, *, allow_pickle: bool) -> Codec | None:
    """The built-in codec recorded as ``name``; ``None`` for a custom or refused codec."""
    if name == DefaultCodec.name:
        return DefaultCodec()
    if name == PickleCodec.name and allow_pickle:
        return PickleCodec()
    return None


# -- encoding ------------------------------------------------------------------------------


def _encode(value: Any, out: bytearray, depth: int) -> None:
    kind = type(value)
    if value is None:
        out.append(_NONE)
    elif kind is bool:
        out.append(_TRUE if value else _FALSE)
    elif kind is int:
        _encode_int(value, out)
    elif kind is float:
        out += _TAGGED_F64(_FLOAT, value)
    elif kind is str:
        raw = value.encode("utf-8")
        out.append(_STR)
        varint(len(raw), out)
        out += raw
    elif kind in (list, tuple, dict):
        _encode_container(value, out, depth)
    else:
        _encode_other(value, out, depth)


def _encode_int(value: int, out: bytearray) -> None:
    if -(2**63) <= value < 2**63:
        out += _TAGGED_I64(_INT, value)
        return
    raw = value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True)
    out.append(_BIGINT)
    varint(len(raw), out)
    out += raw


def _encode_container(value: Any, out: bytearray, depth: int) -> None:
    if depth >= _MAX_DEPTH:
        raise ValueError(f"state value nests deeper than {_MAX_DEPTH} levels (or is cyclic)")
    if isinstance(value, dict):
        out.append(_DICT)
        varint(len(value), out)
        for key, item in value.items():
            _encode(key, out, depth + 1)
            _encode(item, out, depth + 1)
        return
    out.append(_TUPLE if isinstance(value, tuple) else _LIST)
    varint(len(value), out)
    for item in value:
        # _encode's int and float branches inline: a tuple of numbers is the commonest
        # state value, and a call per element costs as much again.
        kind = type(item)
        if kind is int and -(2**63) <= item < 2**63:
            out += _TAGGED_I64(_INT, item)
        elif kind is float:
            out += _TAGGED_F64(_FLOAT, item)
        else:
            _encode(item, out, depth + 1)


def _encode_other(value: Any, out: bytearray, depth: int) -> None:
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        out.append(_BYTES)
        varint(len(raw), out)
        out += raw
    elif isinstance(value, dt.datetime) and value != value:
        out.append(_NONE)  # pandas' NaT: a missing time, as a null field is in Spark
    elif isinstance(value, dt.datetime | dt.date | dt.time):
        _encode_temporal(value, out)
    elif isinstance(value, dt.timedelta):
        out.append(_TIMEDELTA)
        out += _TD.pack(value.days, value.seconds, value.microseconds)
    elif isinstance(value, Decimal):
        raw = str(value).encode("ascii")
        out.append(_DECIMAL)
        varint(len(raw), out)
        out += raw
    else:
        _encode_coerced(value, out, depth)


def _encode_temporal(value: dt.datetime | dt.date | dt.time, out: bytearray) -> None:
    # The base classes' isoformat: subclasses such as pandas.Timestamp add nanoseconds that
    # fromisoformat cannot read back.
    if isinstance(value, dt.datetime):
        tag, text = _DATETIME, dt.datetime.isoformat(value)
    elif isinstance(value, dt.date):
        tag, text = _DATE, dt.date.isoformat(value)
    else:
        tag, text = _TIME, dt.time.isoformat(value)
    raw = text.encode("ascii")
    out.append(tag)
    varint(len(raw), out)
    out += raw


def _encode_coerced(value: Any, out: bytearray, depth: int) -> None:
    """Subclasses and numpy scalars, stored as the plain value they stand for."""
    if isinstance(value, bool):
        _encode(bool(value), out, depth)
    elif isinstance(value, int):
        _encode_int(int(value), out)
    elif isinstance(value, float):
        _encode(float(value), out, depth)
    elif isinstance(value, str):
        _encode(str(value), out, depth)
    elif isinstance(value, list | tuple | dict):
        _encode_container(value, out, depth)
    elif type(value).__name__ == "ndarray":
        raise TypeError(
            f"the default state codec cannot store a numpy array (shape {value.shape}), even "
            "of one element: store array.tolist() (a list) or array.item() (its one value), "
            "or declare the state with codec=PickleCodec()"
        )
    elif type(value).__module__ == "numpy" and hasattr(value, "item") and depth < _MAX_DEPTH:
        item = value.item()
        kind = getattr(getattr(value, "dtype", None), "kind", "")
        if isinstance(item, int) and kind in ("m", "M"):  # a time finer than µs: item() is int
            item = value.astype(f"{kind}8[us]").item()
        _encode(item, out, depth + 1)
    else:
        raise TypeError(
            f"the default state codec cannot store a {type(value).__name__}: use None, bool, "
            "int, float, str, bytes, list, tuple, dict, datetime, date, time, timedelta or "
            "Decimal, or declare the state with codec=PickleCodec()"
        )


def varint(n: int, out: bytearray) -> None:
    """Append ``n`` (>= 0) to ``out`` as an unsigned LEB128 varint."""
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


# -- decoding ------------------------------------------------------------------------------


def read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` of ``data``, and the position after it.

    Raises:
        IndexError: ``data`` ends inside it.
        ValueError: longer than 64 bits.
    """
    shift = result = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _read_raw(data: memoryview, pos: int) -> tuple[bytes, int]:
    size, pos = read_varint(data, pos)
    end = pos + size
    if end > len(data):
        raise ValueError("length runs past the end of the value")
    return bytes(data[pos:end]), end


class _FlatStructs(dict[bytes, Any]):
    """The element tags of a tuple or list of numbers -> the ``unpack`` of a ``Struct``
    reading its whole value; cleared when it grows past 256 shapes."""

    def __missing__(self, tags: bytes) -> Any:
        if len(self) >= 256:
            self.clear()
        unpack = struct.Struct(">3x" + "".join(_FLAT_TAGS[t] for t in tags)).unpack
        self[tags] = unpack
        return unpack


_flat_structs = _FlatStructs()


def _decode_flat(data: bytes) -> Any:
    """Of a value whose tag (``data[1]``) is a tuple's or a list's: a tuple or list of up
    to :data:`_MAX_FLAT` int64s and floats, read by one ``Struct`` call (half of the
    general decoder's time); ``None`` for any other value. Exactly what :func:`_decode`
    reads there: with a one-byte count, every element is a tag and 8 bytes, so the tags sit
    every 9 bytes from the fourth byte."""
    size = len(data)
    if size > 3 + 9 * _MAX_FLAT or size != 3 + 9 * data[2]:
        return None
    tags = bytes(data[3::9])
    if tags.strip(_NUMBER_TAGS):
        return None
    values = _flat_structs[tags](data)
    return values if data[1] == _TUPLE else list(values)


def _decode(data: memoryview, pos: int, depth: int = 0) -> tuple[Any, int]:
    tag = data[pos]
    pos += 1
    if tag == _INT:
        return _I64.unpack_from(data, pos)[0], pos + 8
    if tag == _FLOAT:
        return _F64.unpack_from(data, pos)[0], pos + 8
    if tag == _STR:
        raw, pos = _read_raw(data, pos)
        return raw.decode("utf-8"), pos
    if tag <= _TRUE:
        return (None, False, True)[tag], pos
    if tag in (_LIST, _TUPLE, _DICT):
        if depth >= _MAX_DEPTH:
            raise ValueError(f"nesting deeper than {_MAX_DEPTH} levels")
        return _decode_container(data, pos, tag, depth)
    return _decode_other(data, pos, tag)


def _decode_container(data: memoryview, pos: int, tag: int, depth: int) -> tuple[Any, int]:
    count, pos = read_varint(data, pos)
    if tag == _DICT:
        out: dict[Any, Any] = {}
        for _ in range(count):
            key, pos = _decode(data, pos, depth + 1)
            out[key], pos = _decode(data, pos, depth + 1)
        return out, pos
    items = []
    for _ in range(count):
        item, pos = _decode(data, pos, depth + 1)
        items.append(item)
    return (tuple(items) if tag == _TUPLE else items), pos


def _decode_other(data: memoryview, pos: int, tag: int) -> tuple[Any, int]:
    if tag not in _RAW_TAGS and tag != _TIMEDELTA:
        raise ValueError(f"unknown value tag {tag} at offset {pos - 1}")
    if tag == _TIMEDELTA:
        days, seconds, micros = _TD.unpack_from(data, pos)
        return dt.timedelta(days=days, seconds=seconds, microseconds=micros), pos + _TD.size
    raw, pos = _read_raw(data, pos)
    if tag == _BYTES:
        return raw, pos
    if tag == _BIGINT:
        return int.from_bytes(raw, "big", signed=True), pos
    text = raw.decode("ascii")
    if tag == _DATETIME:
        return dt.datetime.fromisoformat(text), pos
    if tag == _DATE:
        return dt.date.fromisoformat(text), pos
    if tag == _TIME:
        return dt.time.fromisoformat(text), pos
    return Decimal(text), pos
