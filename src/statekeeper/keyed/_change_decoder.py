"""Decoded changes of a keyed store: what each put and delete of a commit did to a processor's
state, read without Spark.

A change feed (:class:`statekeeper.store.StoreChanges`) yields raw puts and deletes of store
keys; :class:`ChangeDecoder` turns those of a keyed processor's store into
:class:`StateChange` values: one per value, map entry, list element or timer written or
deleted. Everything else a commit writes is **bookkeeping derived from those entries** and
is left out: the TTL index (every value with a TTL carries its expiry), the timer index
(every timer is also an entry of its key), list counters, the operator record and the
largest event time seen. A raw feed shows them all.

List elements are named by their **sequence number**, not their position: a change does not
know how many elements precede it. Sequence numbers grow in append order and restart at 0
once a list was emptied (``put`` or ``clear``, or every element expired), so they equal the
positions :func:`iter_state` gives until elements at the front of a list expire.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from statekeeper.errors import CorruptStateError
from statekeeper.keyed._entries import StateDecoder
from statekeeper.keyed._layout import KEY_GROUP, META_KEY, TIMER, U64, OperatorRecord, unwrap
from statekeeper.keyed._tuples import decode_key

if TYPE_CHECKING:
    from statekeeper.store import StoreChange

__all__ = ["OPERATIONS", "TIMER_STATE", "ChangeDecoder", "StateChange"]

TIMER_STATE = "$timer"
"""The state name of a timer's entry or change (no state name starts with ``$``)."""
OPERATIONS = ("put", "delete")


@dataclass(frozen=True, slots=True)
class StateChange:
    """One put or delete of a value, map entry, list element or timer, decoded.

    Attributes:
        version: the version whose commit made the change.
        operation: ``"put"`` or ``"delete"``.
        key: the grouping key, one element per key column.
        state: the state's name; :data:`TIMER_STATE` for a timer.
        kind: ``"value"``, ``"map"``, ``"list"`` or ``"timer"``.
        entry: the map key, the list element's sequence number (see the module docstring),
            the timer's expiry in ms; ``None`` for a value state.
        value: the decoded value written (or an :class:`~statekeeper.keyed.Undecoded`);
            ``None`` for a delete and for a timer.
        expires_at_ms: the TTL expiry the put wrote; ``None`` without TTL and for a delete.
        key_group: the key's key group; ``None`` in an operator without key groups.
    """

    version: int
    operation: str
    key: tuple[Any, ...]
    state: str
    kind: str
    entry: Any
    value: Any
    expires_at_ms: int | None
    key_group: int | None = None


class ChangeDecoder:
    """Decodes the raw changes of one keyed store, fed in the order the feed yields them."""

    def __init__(self, record: OperatorRecord, *, allow_pickle: bool = False) -> None:
        """Decode changes of the states ``record`` names (a newer record a change writes
        is merged in); ``allow_pickle`` as :func:`~statekeeper.keyed.iter_state`."""
        self._allow_pickle = allow_pickle
        self._use(record)

    def _use(self, record: OperatorRecord) -> None:
        self._record = record
        self._arity = len(record.keys)
        self._grouped = record.key_groups is not None
        self._decoder = StateDecoder(record, allow_pickle=self._allow_pickle)

    def decode(self, change: StoreChange) -> StateChange | None:
        """The decoded change, or ``None`` for bookkeeping (see the module docstring).

        Raises:
            CorruptStateError: the key or value does not follow the layout, or names a
                state no operator record declares.
        """
        key, raw = change.key, change.value
        operation = "delete" if raw is None else "put"
        if key == META_KEY:
            if raw is not None:
                newer = OperatorRecord.from_bytes(raw)
                states = {**self._record.states, **newer.states}
                self._use(dataclasses.replace(newer, states=states))
            return None
        timer = self._timer(key)
        if timer is not None:
            grouping, expiry, group = timer
            return StateChange(
                change.version, operation, grouping, TIMER_STATE, "timer", expiry, None, None,
                group,
            )  # fmt: skip
        found = self._decoder.locate(key)
        if found is None:
            return None
        value: Any = None
        expiry_ms: int | None = None
        if raw is not None:
            expiry_ms, payload = unwrap(raw)
            value = self._decoder.value_of(payload, found.codec, found.state)
        return StateChange(
            change.version, operation, found.key, found.state, found.kind, found.entry, value,
            expiry_ms, found.key_group,
        )  # fmt: skip

    def _timer(self, key: bytes) -> tuple[tuple[Any, ...], int, int | None] | None:
        """(grouping key, expiry, key group) of a key's timer entry, ``None`` for any other
        key (the timer index lies under ``0xFF``, above every key group)."""
        if self._grouped:
            if key[2:3] != TIMER or key[:1] == b"\xff":
                return None
            group: int | None = KEY_GROUP.unpack_from(key)[0]
            start = KEY_GROUP.size + len(TIMER)
        elif key.startswith(TIMER):
            group, start = None, len(TIMER)
        else:
            return None
        try:
            grouping, used = decode_key(key[start:], self._arity)
        except ValueError as exc:
            raise CorruptStateError(f"timer key 0x{key.hex()} is malformed: {exc}") from exc
        rest = key[start + used :]
        if len(rest) != U64.size:
            raise CorruptStateError(
                f"timer key 0x{key.hex()} is malformed: expected an 8-byte expiry after the "
                f"grouping key, found {len(rest)} bytes"
            )
        return grouping, U64.unpack(rest)[0], group
