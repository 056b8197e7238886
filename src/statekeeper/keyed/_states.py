"""The state kinds behind a handle: value, map and list state, with their TTL upkeep.

Each state reads and writes through its :class:`~statekeeper.keyed.StatefulProcessorHandle`,
which knows the current grouping key, its key group and the prefetch window; the keys
they write are laid out as ``_layout`` describes.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from statekeeper.keyed._floor import IndexFloor
from statekeeper.keyed._layout import (
    LIST_ITEM,
    LIST_META,
    NO_TTL,
    U64,
    state_prefix,
    ttl_prefix,
    unwrap,
    wrap,
)
from statekeeper.keyed._tuples import decode_element, encode_element
from statekeeper.keyed._values import Codec

if TYPE_CHECKING:
    from statekeeper.keyed._handles import StatefulProcessorHandle

__all__ = ["TTL_CLOCKS", "ListState", "MapState", "Ttl", "ValueState", "ttl_ms"]

Ttl = float | int | dt.timedelta | None
TTL_CLOCKS = ("processing_time", "event_time")
"""What a TTL can be measured against (``ttl_on=`` of the state handles)."""


def ttl_ms(ttl: Ttl) -> int | None:
    """``ttl`` in milliseconds (``None``: no expiry).

    Raises:
        TypeError: not seconds or a timedelta.
        ValueError: not a positive finite duration.
    """
    if ttl is None:
        return None
    if isinstance(ttl, dt.timedelta):
        seconds = ttl.total_seconds()
    elif isinstance(ttl, int | float) and not isinstance(ttl, bool):
        seconds = float(ttl)
    else:
        raise TypeError(f"ttl must be seconds or a timedelta, got {type(ttl).__name__}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"ttl must be a positive duration, got {ttl!r}")
    return max(1, round(seconds * 1000))


class _State:
    """Shared machinery: key prefixes, TTL envelope, TTL index upkeep."""

    kind: ClassVar[str] = ""

    def __init__(
        self,
        handle: StatefulProcessorHandle,
        name: str,
        ttl_ms: int | None,
        codec: Codec,
        ttl_on: str = "processing_time",
    ) -> None:
        self._handle = handle
        self._store = handle._store
        self.name = name
        self.ttl_ms = ttl_ms
        self.ttl_on = ttl_on
        self.codec = codec
        self._prefix = state_prefix(name)
        self._ttl_prefix = ttl_prefix(name, grouped=handle.key_groups is not None)
        self._ttl_floor = IndexFloor(self._store, self._ttl_prefix)
        # Bound once: a read or write costs no attribute lookups on the codec.
        self._encode = codec.encode
        self._decode = codec.decode

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, ttl_ms={self.ttl_ms}, ttl_on={self.ttl_on!r})"

    def _base(self) -> bytes:
        handle = self._handle
        key = handle.current_key_bytes()
        return handle._group + self._prefix + key

    def _read(self, data_key: bytes) -> tuple[bool, Any]:
        raw = self._handle._get(data_key)
        if raw is None:
            return False, None
        return self._live(raw)

    def _live(self, raw: bytes) -> tuple[bool, Any]:
        if raw[:1] == NO_TTL:
            return True, self._decode(raw[1:])
        expiry, payload = unwrap(raw)
        if expiry is not None and expiry <= self._handle.ttl_now_ms(self.ttl_on):
            return False, None
        return True, self._decode(payload)

    def _write(self, data_key: bytes, value: Any) -> None:
        payload = self._encode(value)
        if self.ttl_ms is None:
            self._handle._put(data_key, NO_TTL + payload)
            return
        self._drop_index(data_key)
        expiry = self._handle.ttl_stamp_ms(self.ttl_on) + self.ttl_ms
        self._store.put(self._ttl_prefix + U64.pack(expiry) + data_key, b"")
        self._ttl_floor.lower(expiry)
        self._handle._put(data_key, wrap(payload, expiry))

    def _delete(self, data_key: bytes) -> None:
        if self.ttl_ms is not None:
            self._drop_index(data_key)
        self._handle._delete(data_key)

    def _drop_index(self, data_key: bytes) -> None:
        raw = self._handle._get(data_key)
        if raw is not None:
            expiry, _ = unwrap(raw)
            if expiry is not None:
                self._store.delete(self._ttl_prefix + U64.pack(expiry) + data_key)

    def _scan_live(self, prefix: bytes) -> Iterator[tuple[bytes, Any]]:
        for key, raw in list(self._store.scan(prefix)):
            alive, value = self._live(raw)
            if alive:
                yield key, value

    def expire(self, now_ms: int) -> int:
        """Delete entries of this state whose expiry is at or before ``now_ms`` (on the
        state's TTL clock); the index is read from its floor (``_floor``)."""
        expired: list[tuple[bytes, int, bytes]] = []
        start = len(self._ttl_prefix)
        for index_key, _ in self._store.scan(self._ttl_prefix, start=self._ttl_floor.start()):
            expiry = U64.unpack_from(index_key, start)[0]
            if expiry > now_ms:
                break  # the index is sorted by expiry
            expired.append((index_key, expiry, index_key[start + U64.size :]))
        self._ttl_floor.passed(now_ms, found=bool(expired))  # each one is deleted below
        deleted = 0
        for index_key, expiry, data_key in expired:
            self._store.delete(index_key)
            raw = self._handle._get(data_key)
            if raw is not None and unwrap(raw)[0] == expiry:
                self._handle._delete(data_key)
                deleted += 1
                self._after_expire(data_key)
        return deleted

    def _after_expire(self, data_key: bytes) -> None:
        """Hook for states with bookkeeping records (lists)."""


class ValueState(_State):
    """One value per grouping key."""

    kind = "value"

    def _current(self) -> tuple[bool, Any]:
        handle = self._handle
        key = handle.current_key_bytes()
        data_key = handle._group + self._prefix + key
        raw = handle._prefetched(data_key, self._prefix, b"")
        if raw is None:
            return False, None
        return self._live(raw)

    def get(self) -> Any:
        """The value, or ``None`` if unset or expired."""
        return self._current()[1]

    def exists(self) -> bool:
        """True if a live value is set."""
        return self._current()[0]

    def update(self, value: Any) -> None:
        """Set the value (and restart its TTL).

        Raises:
            TypeError: the codec cannot encode ``value``.
        """
        self._write(self._base(), value)

    def clear(self) -> None:
        """Remove the value."""
        self._delete(self._base())


class MapState(_State):
    """A map per grouping key, iterated in map-key order."""

    kind = "map"

    def get(self, key: Any, default: Any = None) -> Any:
        """The value under ``key``, or ``default``.

        Raises:
            TypeError: ``key`` has a type map keys cannot hold.
        """
        alive, value = self._read(self._base() + encode_element(key))
        return value if alive else default

    def contains(self, key: Any) -> bool:
        """True if ``key`` holds a live value."""
        return self._read(self._base() + encode_element(key))[0]

    def put(self, key: Any, value: Any) -> None:
        """Set ``key`` to ``value`` (and restart that entry's TTL).

        Raises:
            TypeError: ``key`` or ``value`` cannot be encoded.
        """
        self._write(self._base() + encode_element(key), value)

    def remove(self, key: Any) -> None:
        """Remove ``key`` (a no-op if absent)."""
        self._delete(self._base() + encode_element(key))

    def items(self) -> Iterator[tuple[Any, Any]]:
        """Live (key, value) pairs in key order."""
        base = self._base()
        for data_key, value in self._scan_live(base):
            yield decode_element(data_key, len(base))[0], value

    def keys(self) -> Iterator[Any]:
        """Live keys in order."""
        return (k for k, _ in self.items())

    def values(self) -> Iterator[Any]:
        """Live values in key order."""
        return (v for _, v in self.items())

    def exists(self) -> bool:
        """True if the map holds a live entry."""
        return next(iter(self.items()), None) is not None

    def clear(self) -> None:
        """Remove every entry."""
        base = self._base()
        for data_key, _ in list(self._store.scan(base)):
            self._delete(data_key)


class ListState(_State):
    """A list per grouping key. Appends write only the new elements and a counter."""

    kind = "list"

    def get(self) -> list[Any]:
        """The live elements in append order."""
        return [value for _, value in self._scan_live(self._base() + LIST_ITEM)]

    def exists(self) -> bool:
        """True if the list holds a live element."""
        return next(self._scan_live(self._base() + LIST_ITEM), None) is not None

    def append(self, value: Any) -> None:
        """Append one element.

        Raises:
            TypeError: the codec cannot encode ``value``.
        """
        self.extend((value,))

    def extend(self, values: Iterable[Any]) -> None:
        """Append elements in order; writes one key per element plus the counter.

        Raises:
            TypeError: the codec cannot encode a value.
        """
        base = self._base()
        meta_key = base + LIST_META
        raw = self._handle._prefetched(meta_key, self._prefix, LIST_META)
        seq = 0 if raw is None else U64.unpack(raw)[0]
        start = seq
        for value in values:
            self._write(base + LIST_ITEM + U64.pack(seq), value)
            seq += 1
        if seq != start:
            self._handle._put(meta_key, U64.pack(seq))

    def put(self, values: Iterable[Any]) -> None:
        """Replace the whole list.

        Raises:
            TypeError: the codec cannot encode a value.
        """
        items = list(values)
        self.clear()
        self.extend(items)

    def clear(self) -> None:
        """Remove every element."""
        base = self._base()
        for data_key, _ in list(self._store.scan(base + LIST_ITEM)):
            self._delete(data_key)
        self._handle._delete(base + LIST_META)

    def _after_expire(self, data_key: bytes) -> None:
        base = data_key[: -(len(LIST_ITEM) + U64.size)]
        if next(iter(self._store.scan(base + LIST_ITEM)), None) is None:
            self._handle._delete(base + LIST_META)  # the whole list expired
