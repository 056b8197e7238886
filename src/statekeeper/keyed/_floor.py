"""Index floors: where the live entries of an expiry-ordered index begin (see ``_layout``).

The timer index and each state's TTL index are read by one scan, in expiry order, up to the
clock; what it finds is deleted in the same micro-batch. The floor lets the next scan seek
past those deletions' tombstones instead of stepping over them.
"""

from __future__ import annotations

import struct

from statekeeper.keyed._layout import U64, floor_key
from statekeeper.store import StateStore

__all__ = ["IndexFloor"]

_VALUE = struct.Struct(">QQ")  # floor (expiry ms), version whose commit wrote it
_TOP = 2**64 - 1


class IndexFloor:
    """The floor of one index of one store, for one micro-batch's handle.

    The rule it keeps: no entry of the index lies below the floor, in the store's content
    with this batch's writes. So :meth:`lower` must see every entry written, and
    :meth:`passed` may be called only when every entry at or before its clock is being
    deleted in this batch.
    """

    __slots__ = ("_index", "_key", "_known", "_known_at", "_store")

    def __init__(self, store: StateStore, index: bytes) -> None:
        """The floor of the index whose entries start with ``index`` in ``store``."""
        self._store = store
        self._index = index
        self._key = floor_key(index)
        self._known = 0
        """The floor as last read or written here, at store version :attr:`_known_at`:
        never below the store's (an abort only takes writes away), so a write below the
        store's floor is always seen by :meth:`lower`."""
        self._known_at: int | None = None

    def read(self) -> int:
        """The floor the store holds now (0: none, or not trusted)."""
        return self._load()[0]

    def _load(self) -> tuple[int, bool]:
        """The floor the store holds now (0: none, or not trusted), and whether it holds
        one at all, trusted or not."""
        raw = self._store.get(self._key)
        floor = 0
        if raw is not None and len(raw) == _VALUE.size:
            value, written_in = _VALUE.unpack(raw)
            # Written by the commit that made the version read, or by this batch. An older
            # floor is not trusted: a commit in between may have written entries below it
            # without keeping it (an earlier release, say).
            if written_in in (self._store.version, self._store.version + 1):
                floor = value
        self._known, self._known_at = floor, self._store.version
        return floor, raw is not None

    def start(self) -> bytes | None:
        """Where a scan of the index should start (``None``: at its head)."""
        floor = self.read()
        return None if floor == 0 else self._index + U64.pack(floor)

    def lower(self, expiry_ms: int) -> None:
        """An entry at ``expiry_ms`` is being written: keep the floor at or below it."""
        known = self._known if self._known_at == self._store.version else self.read()
        if expiry_ms < known:
            self._write(expiry_ms)

    def passed(self, upto_ms: int, *, found: bool) -> None:
        """Every entry at or before ``upto_ms`` was found (``found``: there were some), and
        is deleted in this batch; entries written after this call go through :meth:`lower`.

        Once an index has a floor it is written in every batch that reads the index, so that
        it stays trusted (one that is not trusted any more is written anew: the scan that
        found the entries started at the head). An index from which nothing ever fired or
        expired has no floor: no tombstones of such deletes lie at its head."""
        floor, stored = self._load()
        if found or stored:
            self._write(max(floor, min(upto_ms + 1, _TOP)))

    def _write(self, floor: int) -> None:
        self._store.put(self._key, _VALUE.pack(floor, self._store.version + 1))
        self._known, self._known_at = floor, self._store.version
