"""How processor state is laid out inside one store (keys of the store, not blob keys).

An operator created by statekeeper 0.2 or later has **key groups** (``G``, recorded in the
root, 4096 by default): every grouping key belongs to key group
``pmod(hash(key columns), G)`` (Spark's Murmur3 ``hash``, computed by Spark in the plan and
carried to the task with the rows, so no Python reimplementation is needed), and partition
``p`` of ``P`` owns the contiguous key groups ``g`` with ``g * P // G == p``. Every data key
then starts with its key group, 2 bytes big-endian, so a later rescale moves whole ranges of
keys (an SST range filter, disjoint ingests) instead of rewriting them::

    0x00 "statekeeper.spark"                          operator record (JSON), one per store
    <kg:u16> 0x01 <state> <grouping key>              value state
    <kg:u16> 0x01 <state> <grouping key> <map key>    map state entry
    <kg:u16> 0x01 <state> <grouping key> 0x00         list state: next sequence number (u64)
    <kg:u16> 0x01 <state> <grouping key> 0x01 <seq:u64>   list state element
    <kg:u16> 0x03 <grouping key> <expiry ms:u64>      timer of a key (empty value)
    0xFF 0x02 <state> <expiry ms:u64> <data key>      TTL index entry (empty value)
    0xFF 0x04 <expiry ms:u64> <kg:u16> <grouping key> timer index entry (empty value)
    0xFF 0x05 "maxEventTimeMs"                        largest event time seen (i64), event time
    0xFF 0x06 <index prefix without 0xFF>             index floor (u64 floor, u64 version)

Operators created by statekeeper 0.1 have no key groups and keep the original layout::

    0x00 "statekeeper.spark"                      operator record (JSON): key columns, states
    0x01 <state> <grouping key>                   value state
    0x01 <state> <grouping key> <map key>         map state entry
    0x01 <state> <grouping key> 0x00              list state: next sequence number (uint64)
    0x01 <state> <grouping key> 0x01 <seq:u64>    list state element
    0x02 <state> <expiry ms:u64> <data key>       TTL index entry (empty value)
    0x03 <grouping key> <expiry ms:u64>           timer of a key (empty value)
    0x04 <expiry ms:u64> <grouping key>           timer index entry (empty value)
    0x05 "maxEventTimeMs"                         largest event time seen (i64), event time
    0x06 <index prefix>                           index floor (u64 floor, u64 version)

The operator record says which layout a store uses (``keyGroups``; record format version 2),
so a reader decodes a store without the root.

**The TTL index is not prefixed by key group**, on purpose. Expiry reads the index of a state
as one sorted scan that stops at the first entry not yet due: its cost is what expires. Split
per key group, it would cost ``G / P`` scans per state per micro-batch even when nothing
expires. The index is derived data: every value with a TTL carries its expiry, and every
index entry ends with the data key it covers, whose first two bytes are its key group. So a
rescale moves the data by key-group ranges and rebuilds the index of each new store by one
pass over the old index (keep the entries whose data key falls in the store's range) — work
proportional to the entries with a TTL, never a rewrite of the data. The index lives under
``0xFF``, above every key-group prefix (key groups are at most :data:`MAX_KEY_GROUPS`), so a
key-group range never holds an index entry. The operator record's key also falls outside
the data keys of every key group (its third byte is not ``0x01``); a rescale copies it per
store and excludes it from range filters by name.

**Timers** follow the TTL index's design. A timer is two entries written and deleted
together: one under its key's key group (``list_timers`` of a key is one prefix scan; a
rescale moves it with the key's range), and one in the **timer index**, ordered by expiry
and then by key, above every key-group prefix: finding the due timers of a micro-batch is
one sorted scan that stops at the first timer not yet due, so its cost is what fires, never
the number of timers registered. Like the TTL index, the timer index is derived data: each
entry ends with the key group and key it fires for, so a rescale rebuilds it per store by one
pass (keep the entries whose key group falls in the store's range). The largest event time
seen (``maxEventTimeMs``, a signed 64-bit big-endian int) is the whole operator's (every
partition records the same value, see :mod:`statekeeper.keyed._timers`); a rescale copies it
to every new store.

**Index floors** keep those scans from paying for what fired before. A fired timer or an
expired TTL entry is deleted, and its RocksDB tombstone stays at the head of the index until
a compaction drops it: a scan from the head steps over every one (measured: the find of 10,000
due timers among 1M grew from 7 to 105 ms over 69 micro-batches, then fell back when a
compaction ran). So each index has a floor, ``0x06`` followed by the index's prefix (after
``0xFF`` with key groups): no entry of the index lies below the floor's expiry, and the scan
seeks there. A micro-batch that took every entry at or before ``t`` (and deletes them) raises
the floor to ``t + 1``; writing an entry below it lowers it. The value also holds the version
whose commit wrote it, and a floor is trusted only in that version: a commit made without
keeping the floor (an earlier release, any writer that does not know it) leaves it untrusted,
and the scan starts at the head, as before. A rescale deletes the floors of the new stores
(their indexes merge other stores' entries), so they too start at the head once.

``<state>``, ``<grouping key>`` and ``<map key>`` use the tuple encoding of ``_tuples`` (self
delimiting, so one key's prefix never matches another key). Every value written by a handle
starts with a TTL byte: ``0x00`` (no expiry) or ``0x01`` followed by the expiry in
milliseconds since the epoch (uint64), then the codec's bytes (for a state declared with a
schema, its schema version first: see ``_schema``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from statekeeper.errors import ConfigMismatchError, CorruptStateError
from statekeeper.keyed._shapes import RecordedSchema
from statekeeper.keyed._tuples import encode_element

__all__ = [
    "DATA",
    "EVENT_TIME",
    "GROUPED_TIMER_INDEX",
    "GROUPED_TTL_INDEX",
    "INDEX_FLOOR",
    "KEY_GROUP",
    "KINDS",
    "LIST_ITEM",
    "LIST_META",
    "MAX_KEY_GROUPS",
    "META_KEY",
    "NO_TTL",
    "TIMER",
    "TIMER_INDEX",
    "TTL_INDEX",
    "U64",
    "OperatorRecord",
    "StateDecl",
    "check_key_groups",
    "check_keys",
    "floor_key",
    "group_prefix",
    "key_group_range",
    "partition_of_group",
    "state_prefix",
    "ttl_prefix",
    "unwrap",
    "validate_key_groups",
    "validate_state_name",
    "wrap",
]

META_KEY = b"\x00statekeeper.spark"
DATA = b"\x01"
TTL_INDEX = b"\x02"
LIST_META = b"\x00"
LIST_ITEM = b"\x01"
U64 = struct.Struct(">Q")
KEY_GROUP = struct.Struct(">H")
"""A key group as the first two bytes of a data key."""
GROUPED_TTL_INDEX = b"\xff" + TTL_INDEX
"""The TTL index of a store with key groups: above every key-group prefix."""
MAX_KEY_GROUPS = 0xFF00
"""Key groups fit in two bytes whose first is below ``0xFF`` (the TTL index's area)."""

TIMER = b"\x03"
"""A key's timer entries (after its key group)."""
TIMER_INDEX = b"\x04"
GROUPED_TIMER_INDEX = b"\xff" + TIMER_INDEX
"""The timer index of a store with key groups: above every key-group prefix."""
INDEX_FLOOR = b"\x06"
"""The area of the index floors: ``INDEX_FLOOR`` + the index's prefix, after ``0xFF`` with
key groups (:func:`floor_key`)."""
EVENT_TIME = b"\x05maxEventTimeMs"
"""The key of the largest event time seen (the watermark's source); after ``0xFF`` with key
groups."""

NO_TTL = b"\x00"
"""The TTL byte of a value without expiry."""
_WITH_TTL = 0x01
_RECORD_FORMAT = "statekeeper.spark.operator"
_RECORD_VERSION = 3
"""Version 2 records ``keyGroups``; a record without key groups is still written as 1, so a
store of a 0.1 operator keeps the record 0.1 reads. Version 3 (written only once a state
declares a schema) records ``schemas``, whose values earlier readers cannot decode."""
_STATE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
KINDS = ("value", "map", "list")
_PT = "processing_time"
_TIME_MODES = (_PT, "event_time")


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


def ttl_prefix(name: str, *, grouped: bool = False) -> bytes:
    """Prefix of the TTL index entries of state ``name`` (in a store with key groups if
    ``grouped``)."""
    return (GROUPED_TTL_INDEX if grouped else TTL_INDEX) + encode_element(name)


def floor_key(index: bytes) -> bytes:
    """The key of the floor of the index whose entries start with ``index`` (the timer
    index, or a state's :func:`ttl_prefix`)."""
    if index[:1] == b"\xff":
        return b"\xff" + INDEX_FLOOR + index[1:]
    return INDEX_FLOOR + index


def validate_key_groups(key_groups: object) -> int:
    """Return ``key_groups`` if it is a valid number of key groups.

    Raises:
        ValueError: not an int in ``[1, MAX_KEY_GROUPS]``.
    """
    if (
        isinstance(key_groups, bool)
        or not isinstance(key_groups, int)
        or not 1 <= key_groups <= MAX_KEY_GROUPS
    ):
        raise ValueError(
            f"key groups must be an int from 1 to {MAX_KEY_GROUPS} (two bytes of every key), "
            f"got {key_groups!r}"
        )
    return key_groups


def group_prefix(key_group: int) -> bytes:
    """The two bytes a data key of ``key_group`` starts with."""
    return KEY_GROUP.pack(key_group)


def partition_of_group(key_group: int, partitions: int, key_groups: int) -> int:
    """The partition (of ``partitions``) that owns ``key_group`` (of ``key_groups``)."""
    return key_group * partitions // key_groups


def key_group_range(partition: int, partitions: int, key_groups: int) -> range:
    """The contiguous key groups partition ``partition`` of ``partitions`` owns: those
    ``g`` with ``g * partitions // key_groups == partition``."""
    start = -(-partition * key_groups // partitions)
    stop = -(-(partition + 1) * key_groups // partitions)
    return range(start, stop)


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
    ttl_on: str = "processing_time"
    """The clock its TTL runs on: ``"processing_time"`` or ``"event_time"``."""
    schemas: tuple[RecordedSchema, ...] = ()
    """Every schema version the state was declared with, ascending (none: no schema)."""
    ttl_removed: bool = False
    """The state had a processing-time TTL that was removed since: entries written then
    still carry expiries on that clock (an event-time TTL keeps ``ttl_on`` for that)."""

    @property
    def stamped(self) -> bool:
        """Whether entries of the state may carry expiries (on :attr:`ttl_on`)."""
        return self.ttl_ms is not None or self.ttl_on != _PT or self.ttl_removed

    def to_json(self) -> dict[str, Any]:
        """The JSON form stored in the operator record (``ttlOn`` only for event time,
        ``ttlRemoved`` only when true and ``schemas`` only with a schema, so other records
        stay as earlier releases wrote them)."""
        doc: dict[str, Any] = {"kind": self.kind, "ttlMs": self.ttl_ms, "codec": self.codec}
        if self.ttl_on != "processing_time":
            doc["ttlOn"] = self.ttl_on
        if self.ttl_removed:
            doc["ttlRemoved"] = True
        if self.schemas:
            doc["schemas"] = [schema.to_json() for schema in self.schemas]
        return doc


@dataclass(frozen=True)
class OperatorRecord:
    """What a store records about the processor using it: key columns and states."""

    keys: tuple[str, ...]
    key_schema: str | None
    """Spark JSON of the key columns' struct type, for typed inspection."""
    states: dict[str, StateDecl] = field(default_factory=dict)
    key_groups: int | None = None
    """The operator's key groups: every data key starts with its key group. ``None``: an
    operator of statekeeper 0.1, whose keys carry none."""
    time_mode: str | None = None
    """The time mode its timers were registered under (``"processing_time"`` or
    ``"event_time"``); ``None``: none recorded (no time mode, or a record written before
    releases recorded it)."""

    def to_bytes(self) -> bytes:
        """The stored JSON document."""
        doc: dict[str, Any] = {
            "format": _RECORD_FORMAT,
            "formatVersion": self._format_version(),
            "keys": list(self.keys),
            "keySchema": self.key_schema,
            "states": {name: decl.to_json() for name, decl in sorted(self.states.items())},
        }
        if self.key_groups is not None:
            doc["keyGroups"] = self.key_groups
        if self.time_mode is not None:
            doc["timeMode"] = self.time_mode
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")

    def _format_version(self) -> int:
        if any(decl.schemas for decl in self.states.values()):
            return _RECORD_VERSION
        return 1 if self.key_groups is None else 2

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
                str(name): StateDecl(
                    str(s["kind"]),
                    s["ttlMs"],
                    str(s["codec"]),
                    str(s.get("ttlOn", _PT)),
                    tuple(RecordedSchema.from_json(d) for d in s.get("schemas", ())),
                    s.get("ttlRemoved") is True,
                )
                for name, s in doc["states"].items()
            }
            groups = doc.get("keyGroups")
            groups = None if groups is None else validate_key_groups(groups)
            mode = doc.get("timeMode")
            if mode not in (None, *_TIME_MODES):
                raise ValueError(f"timeMode {mode!r} is none of {list(_TIME_MODES)}")
            return cls(tuple(doc["keys"]), doc.get("keySchema"), states, groups, mode)
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
        return dataclasses.replace(self, states=states)


def check_time_mode(record: OperatorRecord, time_mode: str | None, operator: str) -> None:
    """Refuse a time mode other than the one the store's timers were registered under
    (Spark refuses any change of an operator's time mode too).

    Raises:
        ConfigMismatchError: the record names a time mode, and ``time_mode`` is another.
    """
    if record.time_mode is None or record.time_mode == time_mode:
        return
    raise ConfigMismatchError(
        f"operator {operator!r} ran with time_mode={record.time_mode!r} in this checkpoint "
        f"root, but now runs with time_mode={time_mode!r}: its timers and clocks were "
        "recorded for the first and would fire at the wrong times (Spark refuses this "
        f"change too). Run it with time_mode={record.time_mode!r}, or give the operator "
        "another name (or state root) to start from empty state"
    )


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


def check_key_groups(
    record: OperatorRecord, key_groups: int | None, operator: str, partition: int
) -> None:
    """Refuse to write a store in another key layout than the one it holds.

    Raises:
        ConfigMismatchError: the store's record and the root disagree on the key groups.
    """
    if record.key_groups != key_groups:
        raise ConfigMismatchError(
            f"operator {operator!r} partition {partition} holds keys laid out with "
            f"{_show_groups(record.key_groups)}, but the checkpoint root records "
            f"{_show_groups(key_groups)} for the operator: the store and the root do not "
            "belong together"
        )


def _show_groups(key_groups: int | None) -> str:
    return "no key groups (statekeeper 0.1)" if key_groups is None else f"{key_groups} key groups"
