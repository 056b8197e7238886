"""Decoded state of a keyed store: what a processor's states hold, read without Spark.

A store written by a keyed processor (:mod:`statekeeper.keyed`) holds an operator record
(key columns, states, codecs) and entries laid out as :mod:`statekeeper.keyed._layout`
describes. :func:`iter_state` turns that back into one :class:`StateEntry` per value, map
entry and list element, in key order; :class:`StateDecoder` does the same for a stream of
raw items the caller scans itself (a prefix, a limit). Values are decoded with the codec
each state recorded; a pickled value is decoded only when the caller allows it (unpickling
runs code chosen by whoever wrote the root), and a custom codec's value is left undecoded.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from statekeeper.errors import CorruptStateError, StateKeeperError
from statekeeper.keyed._layout import (
    DATA,
    GROUPED_TTL_INDEX,
    KEY_GROUP,
    LIST_ITEM,
    META_KEY,
    U64,
    OperatorRecord,
    state_prefix,
    unwrap,
    validate_state_name,
)
from statekeeper.keyed._schema import decode_recorded
from statekeeper.keyed._tuples import decode_element, decode_key
from statekeeper.keyed._values import codec_by_name
from statekeeper.store import StateStore

__all__ = [
    "DataKey",
    "StateDecoder",
    "StateEntry",
    "Undecoded",
    "iter_state",
    "jsonable",
    "read_operator_record",
]


@dataclass(frozen=True, slots=True)
class Undecoded:
    """A value this reader does not decode: pickled (not allowed) or of a custom codec."""

    codec: str
    size: int

    def __str__(self) -> str:
        hint = "pass allow_pickle=True to decode" if self.codec == "pickle" else "custom codec"
        return f"<{self.codec}: {self.size} bytes; {hint}>"


@dataclass(frozen=True, slots=True)
class StateEntry:
    """One value, map entry or list element of a keyed store.

    Attributes:
        key: the grouping key, one element per key column.
        state: the state's name.
        kind: ``"value"``, ``"map"`` or ``"list"``.
        entry: the map key, or the list position (0-based, in append order); ``None`` for
            a value state.
        value: the decoded value, or an :class:`Undecoded`.
        expires_at_ms: the TTL expiry (ms since the epoch), ``None`` without TTL. Entries
            past it stay until a micro-batch of their partition removes them.
        key_group: the key's key group; ``None`` in a store of an operator without key
            groups (statekeeper 0.1).
    """

    key: tuple[Any, ...]
    state: str
    kind: str
    entry: Any
    value: Any
    expires_at_ms: int | None
    key_group: int | None = None


@dataclass(frozen=True, slots=True)
class DataKey:
    """What one data key of a keyed store holds (:meth:`StateDecoder.locate`).

    Attributes:
        key: the grouping key.
        state: the state's name.
        kind: ``"value"``, ``"map"`` or ``"list"``.
        entry: the map key; for a list element its sequence number (the list's append
            counter when it was appended: increasing in append order, restarting at 0 once
            the list was emptied); ``None`` for a value state.
        codec: the name of the state's codec.
        key_group: as :attr:`StateEntry.key_group`.
        list_key_length: how many bytes of the key name the list (or value, or map).
    """

    key: tuple[Any, ...]
    state: str
    kind: str
    entry: Any
    codec: str
    key_group: int | None
    list_key_length: int


def read_operator_record(store: StateStore) -> OperatorRecord | None:
    """The operator record of ``store``, or ``None`` if no keyed processor wrote it.

    Raises:
        CorruptStateError: the record is not valid.
        ConfigMismatchError: the record was written by a newer format version.
    """
    found = store.get(META_KEY)
    return None if found is None else OperatorRecord.from_bytes(found)


class StateDecoder:
    """Decodes the raw items of a keyed store, fed in key order (as a scan returns them)."""

    def __init__(self, record: OperatorRecord, *, allow_pickle: bool = False) -> None:
        """Decode entries of the states ``record`` names; see :func:`iter_state`."""
        self._record = record
        self._arity = len(record.keys)
        self._grouped = record.key_groups is not None
        self._allow_pickle = allow_pickle
        self._list: bytes | None = None
        self._position = 0

    def decode(self, key: bytes, raw: bytes) -> StateEntry | None:
        """The entry stored under ``key``; ``None`` for bookkeeping items (the operator
        record, list counters, the TTL index).

        List positions count the elements of one list seen so far: feed a list from its
        first element for them to be positions in the whole list.

        Raises:
            CorruptStateError: the key or value does not follow the layout, or names a
                state the record does not know.
        """
        found = self.locate(key)
        if found is None:
            return None
        entry = found.entry
        if found.kind == "list":
            entry = self._list_position(key[: found.list_key_length])
        expiry, payload = unwrap(raw)
        value = self.value_of(payload, found.codec, found.state)
        return StateEntry(found.key, found.state, found.kind, entry, value, expiry, found.key_group)

    def locate(self, key: bytes) -> DataKey | None:
        """What the data key ``key`` holds (its state, grouping key and entry), without its
        value; ``None`` for bookkeeping items (as :meth:`decode`).

        Raises:
            CorruptStateError: as :meth:`decode`.
        """
        group: int | None = None
        start = len(DATA)
        if self._grouped:
            # <kg:u16> 0x01 ...; the record (0x00 "s...") and the TTL index (0xFF ...)
            # never have 0x01 third, or lie above every key group.
            if key[2:3] != DATA or key[:1] == GROUPED_TTL_INDEX[:1]:
                return None
            group = KEY_GROUP.unpack_from(key)[0]
            start += KEY_GROUP.size
        elif not key.startswith(DATA):
            return None
        try:
            state, pos = decode_element(key, start)
            grouping, used = decode_key(key[pos:], self._arity)
        except ValueError as exc:
            raise CorruptStateError(f"state key 0x{key.hex()} is malformed: {exc}") from exc
        decl = self._record.states.get(state)
        if decl is None:
            raise CorruptStateError(f"state {state!r} is not in the operator record")
        rest = key[pos + used :]
        entry: Any = None
        if decl.kind == "list":
            if not rest.startswith(LIST_ITEM) or len(rest) != len(LIST_ITEM) + U64.size:
                return None  # the list's counter
            entry = U64.unpack_from(rest, len(LIST_ITEM))[0]
        elif decl.kind == "map":
            entry = decode_element(rest)[0]
        return DataKey(grouping, state, decl.kind, entry, decl.codec, group, pos + used)

    def _list_position(self, list_key: bytes) -> int:
        if list_key != self._list:
            self._list, self._position = list_key, 0
        position = self._position
        self._position += 1
        return position

    def value_of(self, payload: bytes, codec_name: str, state: str | None = None) -> Any:
        """``payload`` decoded with codec ``codec_name`` (an :class:`Undecoded` for a pickled
        value when pickles are not allowed, and for a custom codec's); a value of ``state``
        declared with a schema as a dict of the fields of the version it was written in."""
        codec = codec_by_name(codec_name, allow_pickle=self._allow_pickle)
        if codec is None:
            return Undecoded(codec_name, len(payload))
        decl = None if state is None else self._record.states.get(state)
        if decl is not None and decl.schemas:
            return decode_recorded(payload, codec, decl.schemas)
        return codec.decode(payload)


def iter_state(
    store: StateStore, *, state: str | None = None, allow_pickle: bool = False
) -> Iterator[StateEntry]:
    """Every entry of a keyed store (or of one of its states), decoded, in key order.

    Args:
        store: an open store written by a keyed processor.
        state: only the entries of this state (a prefix scan without key groups; with key
            groups, where every key group holds every state, a filter).
        allow_pickle: decode values of states declared with ``PickleCodec`` (runs code from
            the root: only for roots you trust); otherwise they are :class:`Undecoded`.

    Raises:
        StateKeeperError: the store holds no operator record (it was not written by a keyed
            processor, e.g. by the vectorized form, which stores raw bytes).
        CorruptStateError: a record, key or value fails its checks.
        TypeError, ValueError: ``state`` is not a valid state name.
    """
    name = None if state is None else validate_state_name(state)
    record = read_operator_record(store)
    if record is None:
        raise StateKeeperError(
            f"store {store.operator}/{store.partition} holds no operator record: it was not "
            "written by a keyed processor; read its raw items with store.scan()"
        )
    decoder = StateDecoder(record, allow_pickle=allow_pickle)
    if record.key_groups is None:
        prefix = DATA if name is None else state_prefix(name)
        items = store.scan(prefix)
    else:
        items = store.scan()  # every key group holds entries of every state
    for key, raw in items:
        entry = decoder.decode(key, raw)
        if entry is not None and (name is None or entry.state == name):
            yield entry


def jsonable(value: Any) -> Any:
    """``value`` in a form ``json.dumps`` accepts: bytes as base64, dates and times in ISO
    8601, timedeltas in seconds, decimals and non-finite floats as strings, sets as sorted
    lists, dict keys that are not strings as their JSON text, undecoded values as a
    placeholder text, and any other object as its ``repr``."""
    if isinstance(value, dict):
        return {
            k if isinstance(k, str) else json.dumps(jsonable(k), ensure_ascii=False): jsonable(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, Decimal | Undecoded):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, set | frozenset):
        return [jsonable(v) for v in sorted(value, key=repr)]
    if value is None or isinstance(value, str | int | float):
        return value
    return repr(value)  # e.g. an unpickled object of the user's own class
