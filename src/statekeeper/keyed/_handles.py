"""State handles: value, map and list state of the current grouping key, with optional TTL.

A handle reads and writes the partition's :class:`~statekeeper.StateStore` directly; writes
become durable when the task commits the micro-batch. TTL is processing time measured by the
micro-batch timestamp (the same on every re-run of a batch, so re-runs write identical
state): an entry expires ``ttl`` after its last write, is invisible from then on, and is
deleted at the end of the first micro-batch that sees it expired (a sorted TTL index makes
that cost proportional to what expires).

**Reads cost what they must.** When the runner tells the handle the batch's keys in the
order it will visit them (:meth:`StatefulProcessorHandle.visit_keys`), the first read of a
value state (or append to a list state) in a window of the next keys fetches that state for
the whole window with one ``multi_get``; later reads of the window are dict lookups. Only the
states a processor touches are fetched. Every write through a handle also lands in that
cache, so a read always sees the latest write (the store keeps the writes themselves until
the commit). Codec methods and TTL choices are bound once per state, not looked up per call.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

from statekeeper.errors import StateKeeperError
from statekeeper.keyed._layout import (
    LIST_ITEM,
    LIST_META,
    META_KEY,
    NO_TTL,
    U64,
    OperatorRecord,
    StateDecl,
    check_keys,
    state_prefix,
    ttl_prefix,
    unwrap,
    validate_state_name,
    wrap,
)
from statekeeper.keyed._tuples import decode_element, encode_element, encode_key
from statekeeper.keyed._values import Codec, DefaultCodec
from statekeeper.store import StateStore

__all__ = ["ListState", "MapState", "StatefulProcessorHandle", "ValueState"]

Ttl = float | int | dt.timedelta | None
_S = TypeVar("_S", bound="_State")
_WINDOW = 2048
"""Keys per prefetch: large enough to amortize a multi_get, small enough to bound memory."""


class StatefulProcessorHandle:
    """Gives a processor its state; passed to :meth:`StatefulProcessor.init`.

    States declared here are bound to the grouping key whose rows are being handled.
    """

    def __init__(
        self, store: StateStore, *, now_ms: int | None, batch_id: int, partition: int
    ) -> None:
        """Wrap ``store`` for one partition and micro-batch; ``now_ms`` is the TTL clock."""
        self._store = store
        self._now_ms = now_ms
        self._batch_id = batch_id
        self._partition = partition
        self._key: tuple[Any, ...] | None = None
        self._key_bytes: bytes | None = None
        self._states: dict[str, _State] = {}
        # Prefetch: the batch's encoded keys, the position of the current one, the window
        # [position, _window_end) cached, and which (state prefix + suffix) were fetched.
        self._keys: list[bytes] = []
        self._position = -1
        self._window_end = 0
        self._cache: dict[bytes, bytes | None] = {}
        self._filled: set[bytes] = set()

    @property
    def batch_id(self) -> int:
        """The micro-batch being processed."""
        return self._batch_id

    @property
    def partition(self) -> int:
        """The state partition being processed."""
        return self._partition

    @property
    def batch_timestamp_ms(self) -> int | None:
        """The micro-batch timestamp (ms since the epoch) TTL is measured with."""
        return self._now_ms

    @property
    def grouping_key(self) -> tuple[Any, ...] | None:
        """The key whose rows are being handled, or ``None`` outside ``handle_input_rows``."""
        return self._key

    def value_state(self, name: str, *, ttl: Ttl = None, codec: Codec | None = None) -> ValueState:
        """Declare a single value per grouping key.

        Args:
            name: the state's name, unique within the processor.
            ttl: seconds (or a timedelta) after its last update when a value expires.
            codec: how values become bytes; the safe :class:`DefaultCodec` if ``None``.

        Raises:
            TypeError, ValueError: a malformed name, ttl or codec.
            StateKeeperError: ``name`` was declared as another kind of state.
        """
        return self._declare(ValueState, name, ttl, codec)

    def map_state(self, name: str, *, ttl: Ttl = None, codec: Codec | None = None) -> MapState:
        """Declare a map per grouping key (map keys: anything a grouping key may hold).

        Raises:
            TypeError, ValueError: a malformed name, ttl or codec.
            StateKeeperError: ``name`` was declared as another kind of state.
        """
        return self._declare(MapState, name, ttl, codec)

    def list_state(self, name: str, *, ttl: Ttl = None, codec: Codec | None = None) -> ListState:
        """Declare an append-friendly list per grouping key (TTL applies per element).

        Raises:
            TypeError, ValueError: a malformed name, ttl or codec.
            StateKeeperError: ``name`` was declared as another kind of state.
        """
        return self._declare(ListState, name, ttl, codec)

    def _declare(self, cls: type[_S], name: str, ttl: Ttl, codec: Codec | None) -> _S:
        validate_state_name(name)
        codec = DefaultCodec() if codec is None else codec
        if not (hasattr(codec, "encode") and hasattr(codec, "decode") and hasattr(codec, "name")):
            raise TypeError(f"codec must have name, encode and decode; got {codec!r}")
        old = self._states.get(name)
        if old is not None and type(old) is not cls:
            raise StateKeeperError(
                f"state {name!r} is already declared as a {old.kind} state in this processor"
            )
        state = cls(self, name, _ttl_ms(ttl), codec)
        self._states[name] = state
        return state

    # -- called by statekeeper around the processor (processors need not call these) -----

    def declared(self) -> dict[str, StateDecl]:
        """The states declared so far, for the operator record."""
        return {
            name: StateDecl(s.kind, s.ttl_ms, str(s.codec.name)) for name, s in self._states.items()
        }

    def record_operator(
        self, keys: Sequence[str], *, key_schema: str | None, operator: str
    ) -> None:
        """Keep the store's operator record (key columns, declared states) up to date.

        Args:
            keys: the grouping key columns.
            key_schema: the key columns' type as the engine describes it (Spark JSON), for
                typed reading; ``None`` keeps what is recorded.
            operator: the operator's name, for errors.

        Raises:
            ConfigMismatchError: the keys or a state's kind differ from what the store holds.
            CorruptStateError: the stored record is not valid.
        """
        raw = self._store.get(META_KEY)
        if raw is None:
            record = OperatorRecord(tuple(keys), key_schema)
        else:
            record = OperatorRecord.from_bytes(raw)
            check_keys(record, tuple(keys), operator)
            if key_schema is not None:
                record = dataclasses.replace(record, key_schema=key_schema)
        data = record.merged(self.declared()).to_bytes()
        if data != raw:
            self._store.put(META_KEY, data)

    def set_key(self, key: tuple[Any, ...] | None) -> None:
        """Bind the states to ``key`` (``None``: unbind), without prefetching.

        Raises:
            TypeError: a key element has a type keys cannot hold.
        """
        self._key = key
        self._key_bytes = None if key is None else encode_key(key)
        self._keys, self._position, self._window_end = [], -1, 0
        self._cache.clear()
        self._filled.clear()

    def visit_keys(self, encoded: list[bytes]) -> None:
        """Announce the encoded keys of the batch, in the order :meth:`select` will visit
        them, so that the states read for them can be prefetched in windows."""
        self.set_key(None)
        self._keys = encoded

    def select(self, position: int, key: tuple[Any, ...]) -> None:
        """Bind the states to the key at ``position`` of :meth:`visit_keys` (``key`` is its
        tuple); positions must not decrease."""
        self._key = key
        self._key_bytes = self._keys[position]
        self._position = position
        if position >= self._window_end:
            self._window_end = position + _WINDOW
            self._cache = {}
            self._filled = set()

    def _prefetched(self, data_key: bytes, prefix: bytes, suffix: bytes) -> bytes | None:
        """The raw value of ``data_key`` = ``prefix`` + current key + ``suffix``, fetching
        ``prefix`` + key + ``suffix`` for the rest of the window on the first read."""
        fill = prefix + suffix
        if fill not in self._filled and self._position >= 0:
            self._filled.add(fill)
            keys = [prefix + k + suffix for k in self._keys[self._position : self._window_end]]
            self._cache.update(zip(keys, self._store.multi_get(keys), strict=True))
        return self._get(data_key)

    def _get(self, data_key: bytes) -> bytes | None:
        cache = self._cache
        if data_key in cache:
            return cache[data_key]
        return self._store.get(data_key)

    def _put(self, data_key: bytes, raw: bytes) -> None:
        self._store.put(data_key, raw)
        self._cache[data_key] = raw

    def _delete(self, data_key: bytes) -> None:
        self._store.delete(data_key)
        self._cache[data_key] = None

    def expire(self) -> int:
        """Delete every entry whose TTL has passed; returns how many entries were deleted."""
        if self._now_ms is None:
            return 0
        return sum(state.expire(self._now_ms) for state in self._states.values())

    def current_key_bytes(self) -> bytes:
        """The encoded grouping key.

        Raises:
            StateKeeperError: called outside ``handle_input_rows``.
        """
        if self._key_bytes is None:
            raise StateKeeperError(
                "state can only be read or written inside handle_input_rows (there is no "
                "current grouping key in init or close)"
            )
        return self._key_bytes

    def now_ms(self) -> int:
        """The TTL clock.

        Raises:
            StateKeeperError: the micro-batch timestamp is unknown.
        """
        if self._now_ms is None:
            raise StateKeeperError("the micro-batch timestamp is unknown: TTL cannot be applied")
        return self._now_ms


def _ttl_ms(ttl: Ttl) -> int | None:
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
        self, handle: StatefulProcessorHandle, name: str, ttl_ms: int | None, codec: Codec
    ) -> None:
        self._handle = handle
        self._store = handle._store
        self.name = name
        self.ttl_ms = ttl_ms
        self.codec = codec
        self._prefix = state_prefix(name)
        self._ttl_prefix = ttl_prefix(name)
        # Bound once: a read or write costs no attribute lookups on the codec.
        self._encode = codec.encode
        self._decode = codec.decode

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, ttl_ms={self.ttl_ms})"

    def _base(self) -> bytes:
        return self._prefix + self._handle.current_key_bytes()

    def _read(self, data_key: bytes) -> tuple[bool, Any]:
        raw = self._handle._get(data_key)
        if raw is None:
            return False, None
        return self._live(raw)

    def _live(self, raw: bytes) -> tuple[bool, Any]:
        if raw[:1] == NO_TTL:
            return True, self._decode(raw[1:])
        expiry, payload = unwrap(raw)
        if expiry is not None and expiry <= self._handle.now_ms():
            return False, None
        return True, self._decode(payload)

    def _write(self, data_key: bytes, value: Any) -> None:
        payload = self._encode(value)
        if self.ttl_ms is None:
            self._handle._put(data_key, NO_TTL + payload)
            return
        self._drop_index(data_key)
        expiry = self._handle.now_ms() + self.ttl_ms
        self._store.put(self._ttl_prefix + U64.pack(expiry) + data_key, b"")
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
        """Delete entries of this state whose expiry is at or before ``now_ms``."""
        expired: list[tuple[bytes, int, bytes]] = []
        start = len(self._ttl_prefix)
        for index_key, _ in self._store.scan(self._ttl_prefix):
            expiry = U64.unpack_from(index_key, start)[0]
            if expiry > now_ms:
                break  # the index is sorted by expiry
            expired.append((index_key, expiry, index_key[start + U64.size :]))
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
        data_key = self._prefix + handle.current_key_bytes()
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
