"""How processor state is laid out inside one store (keys of the store, not blob keys).

::

    0x00 "statekeeper.spark"                      operator record (JSON): key columns, states
    0x01 <state> <grouping key>                   value state
    0x01 <state> <grouping key> <map key>         map state entry
    0x01 <state> <grouping key> 0x00              list state: next sequence number (uint64)
    0x01 <state> <grouping key> 0x01 <seq:u64>    list state element
    0x02 <state> <expiry ms:u64> <data key>       TTL index entry (empty value)

``<state>``, ``<grouping key>`` and ``<map key>`` use the tuple encoding of ``_tuples`` (self
delimiting, so one key's prefix never matches another key). Every value written by a handle
starts with a TTL byte: ``0x00`` (no expiry) or ``0x01`` followed by the expiry in
milliseconds since the epoch (uint64), then the codec's bytes.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from statekeeper.errors import ConfigMismatchError, CorruptStateError
from statekeeper.keyed._tuples import encode_element

__all__ = [
    "DATA",
    "KINDS",
    "LIST_ITEM",
    "LIST_META",
    "META_KEY",
    "NO_TTL",
    "TTL_INDEX",
    "U64",
    "OperatorRecord",
    "StateDecl",
    "check_keys",
    "state_prefix",
    "ttl_prefix",
    "unwrap",
    "validate_state_name",
    "wrap",
]

META_KEY = b"\x00statekeeper.spark"
DATA = b"\x01"
TTL_INDEX = b"\x02"
LIST_META = b"\x00"
LIST_ITEM = b"\x01"
U64 = struct.Struct(">Q")

NO_TTL = b"\x00"
"""The TTL byte of a value without expiry."""
_WITH_TTL = 0x01
_RECORD_FORMAT = "statekeeper.spark.operator"
_RECORD_VERSION = 1
_STATE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
KINDS = ("value", "map", "list")


def validate_state_name(name: object) -> str:
    """Return ``name`` if it is a valid state name.

    Raises:
        TypeError: not a str.
        ValueError: empty, too long, or holding characters other than letters, digits,
            ``_``, ``.`` and ``-``.
    """
    if not isinstance(name, str):
        raise TypeError(f"state name must be a str, got {type(name).__name__}")
    if not _STATE_NAME_RE.fullmatch(name):
        raise ValueError(
            "state name must be 1-128 letters, digits, '_', '.' or '-' (not starting with "
            f"'.' or '-'); got {name!r}"
        )
    return name


def state_prefix(name: str) -> bytes:
    """Prefix of every data key of state ``name``."""
    return DATA + encode_element(name)


def ttl_prefix(name: str) -> bytes:
    """Prefix of the TTL index entries of state ``name``."""
    return TTL_INDEX + encode_element(name)


def wrap(payload: bytes, expiry_ms: int | None) -> bytes:
    """A stored value: TTL byte (and expiry), then the codec's bytes."""
    if expiry_ms is None:
        return NO_TTL + payload
    return bytes((_WITH_TTL,)) + U64.pack(expiry_ms) + payload


def unwrap(raw: bytes) -> tuple[int | None, bytes]:
    """Split a stored value into (expiry in ms or ``None``, codec bytes).

    Raises:
        CorruptStateError: an unknown TTL byte or a truncated value.
    """
    if not raw:
        raise CorruptStateError("state value is empty: expected a TTL byte")
    if raw[0] == 0x00:
        return None, raw[1:]
    if raw[0] == _WITH_TTL and len(raw) >= 9:
        return U64.unpack_from(raw, 1)[0], raw[9:]
    raise CorruptStateError(f"state value has an unknown TTL byte 0x{raw[0]:02x}")


@dataclass(frozen=True)
class StateDecl:
    """One state as a processor declared it."""

    kind: str
    ttl_ms: int | None
    codec: str

    def to_json(self) -> dict[str, Any]:
        """The JSON form stored in the operator record."""
        return {"kind": self.kind, "ttlMs": self.ttl_ms, "codec": self.codec}


@dataclass(frozen=True)
class OperatorRecord:
    """What a store records about the processor using it: key columns and states."""

    keys: tuple[str, ...]
    key_schema: str | None
    """Spark JSON of the key columns' struct type, for typed inspection."""
    states: dict[str, StateDecl] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """The stored JSON document."""
        doc = {
            "format": _RECORD_FORMAT,
            "formatVersion": _RECORD_VERSION,
            "keys": list(self.keys),
            "keySchema": self.key_schema,
            "states": {name: decl.to_json() for name, decl in sorted(self.states.items())},
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes) -> OperatorRecord:
        """Parse a stored record.

        Raises:
            CorruptStateError: not an operator record.
            ConfigMismatchError: written by a newer format version.
        """
        try:
            doc = json.loads(data)
            if doc.get("format") != _RECORD_FORMAT:
                raise ValueError("not an operator record")
            version = int(doc["formatVersion"])
            if version > _RECORD_VERSION:
                raise ConfigMismatchError(
                    f"the operator record has format version {version}; this statekeeper "
                    f"reads versions <= {_RECORD_VERSION}: upgrade statekeeper"
                )
            states = {
                str(name): StateDecl(str(s["kind"]), s["ttlMs"], str(s["codec"]))
                for name, s in doc["states"].items()
            }
            return cls(tuple(doc["keys"]), doc.get("keySchema"), states)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptStateError(f"the operator record is not valid: {exc}") from exc

    def merged(self, declared: dict[str, StateDecl]) -> OperatorRecord:
        """This record updated with the states a processor declares now.

        Raises:
            ConfigMismatchError: a state changes kind (its stored entries would be misread).
        """
        states = dict(self.states)
        for name, decl in declared.items():
            old = states.get(name)
            if old is not None and old.kind != decl.kind:
                raise ConfigMismatchError(
                    f"state {name!r} holds a {old.kind} state in this checkpoint root, but the "
                    f"processor now declares it a {decl.kind} state: use another state name"
                )
            states[name] = decl
        return OperatorRecord(self.keys, self.key_schema, states)


def check_keys(record: OperatorRecord, keys: tuple[str, ...], operator: str) -> None:
    """Refuse a processor whose key columns differ from those the state was built with.

    Raises:
        ConfigMismatchError: the key columns differ.
    """
    if record.keys != keys:
        raise ConfigMismatchError(
            f"operator {operator!r} keeps state keyed by {list(record.keys)} in this checkpoint "
            f"root, but keys={list(keys)} were given: use the same keys, or another operator name"
        )
