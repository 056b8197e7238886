"""The uncommitted writes of a store (its overlay, a ``dict`` of key to value, ``None`` for a
delete): the checks of what goes in, and how it comes out, as a commit's sorted columns or
merged into a scan of the working copy.

The checks of bulk writes run once over a whole column (no Python call per key), so a
vectorized function's writes cost what the dictionary costs.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Iterable, Iterator
from typing import Any

from statekeeper.changelog import MAX_ITEM_LENGTH, Columns

__all__ = ["as_columns", "as_key", "as_keys", "as_value", "listed", "merge", "sorted_columns"]


def as_key(key: object) -> bytes:
    """``key`` as ``bytes``.

    Raises:
        TypeError: it is not bytes.
        ValueError: it is empty, or 2 GiB or longer.
    """
    if type(key) is bytes and 0 < len(key) <= MAX_ITEM_LENGTH:
        return key  # the common case, in a third of the time of the checks below
    if not isinstance(key, bytes | bytearray | memoryview):
        raise TypeError(f"key must be bytes, got {type(key).__name__}")
    key = bytes(key)
    if not key:
        raise ValueError("key must not be empty")
    if len(key) > MAX_ITEM_LENGTH:
        raise ValueError(f"key must be shorter than 2 GiB, got {len(key)} bytes")
    return key


def as_value(value: object) -> bytes:
    """``value`` as ``bytes``.

    Raises:
        TypeError: it is not bytes.
        ValueError: it is 2 GiB or longer.
    """
    if type(value) is bytes and len(value) <= MAX_ITEM_LENGTH:
        return value
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"value must be bytes, got {type(value).__name__}")
    value = bytes(value)
    if len(value) > MAX_ITEM_LENGTH:
        raise ValueError(f"value must be shorter than 2 GiB, got {len(value)} bytes")
    return value


def as_keys(keys: Iterable[object]) -> list[bytes]:
    """:func:`as_key` of each key; plain bytes of allowed lengths are checked in bulk.

    Raises:
        TypeError, ValueError: as :func:`as_key`, for any key.
    """
    keys = listed(keys, "keys")
    lengths = list(map(len, keys)) if keys and set(map(type, keys)) == {bytes} else None
    if lengths and min(lengths) > 0 and max(lengths) <= MAX_ITEM_LENGTH:
        return keys
    return [as_key(k) for k in keys]


def as_columns(
    items: Iterable[object], values: Iterable[object] | None
) -> tuple[list[bytes], list[bytes]]:
    """The checked keys and values of ``put_many``'s arguments: ``(key, value)`` pairs, or
    keys and ``values``; two lists of equal length.

    Raises:
        TypeError, ValueError: as :func:`as_key` and :func:`as_value`, for any pair; an item
            is not a pair, or ``values`` has another length than the keys.
    """
    keys, column = _split(items, values)
    if not keys:
        return [], []
    checked = as_keys(keys)
    if set(map(type, column)) != {bytes}:
        for value in column:
            if not isinstance(value, bytes | bytearray | memoryview):
                raise TypeError(f"value must be bytes, got {type(value).__name__}")
        column = [bytes(v) for v in column]
    longest = max(map(len, column))
    if longest > MAX_ITEM_LENGTH:
        raise ValueError(f"value must be shorter than 2 GiB, got {longest} bytes")
    return checked, column


def _split(items: Iterable[object], values: Iterable[object] | None) -> tuple[list[Any], list[Any]]:
    """The keys and values of ``put_many``'s arguments, unchecked.

    Raises:
        ValueError: an item is not a pair, or ``values`` has another length than the keys.
    """
    if values is not None:
        keys = listed(items, "put_many's keys")
        column = listed(values, "put_many's values")
        if len(keys) != len(column):
            raise ValueError(
                f"put_many takes one value per key: expected {len(keys)} values, "
                f"found {len(column)}"
            )
        return keys, column
    pairs = listed(items, "put_many's items", "(key, value) pairs")
    try:
        lengths = set(map(len, pairs))
    except TypeError:
        found = next(type(p).__name__ for p in pairs if not hasattr(p, "__len__"))
        raise TypeError(
            f"put_many takes (key, value) pairs, or keys and values; got an item of type {found}"
        ) from None
    if pairs and lengths != {2}:
        raise ValueError("put_many takes (key, value) pairs, or keys and values")
    return list(map(operator.itemgetter(0), pairs)), list(map(operator.itemgetter(1), pairs))


def check_progress(progress: object) -> None:
    """Refuse a ``progress`` argument that is neither ``None`` nor callable.

    Raises:
        TypeError: it is not.
    """
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be callable or None, got {type(progress).__name__}")


def listed(items: Iterable[Any], what: str, of: str = "bytes") -> list[Any]:
    """``items`` as a list.

    Raises:
        TypeError: ``items`` is not iterable, or is one bytes or str object (whose
            iteration would yield ints or characters, not keys).
    """
    if isinstance(items, list):
        return items
    if isinstance(items, bytes | bytearray | memoryview | str):
        raise TypeError(
            f"{what} must be an iterable of {of}, got one {type(items).__name__} object "
            "(wrap a single key in a list)"
        )
    try:
        iterator = iter(items)
    except TypeError:
        raise TypeError(f"{what} must be an iterable of {of}, got {type(items).__name__}") from None
    return list(iterator)


def sorted_columns(pending: dict[bytes, bytes | None]) -> Columns:
    """The overlay as columns sorted by key. Written in key order already (a vectorized
    function's sorted batch), it is taken as it is: checking the order costs a quarter of
    sorting and looking every value up again."""
    keys = list(pending)
    if all(map(operator.lt, keys, itertools.islice(keys, 1, None))):
        return Columns.trusted(keys, list(pending.values()))
    keys.sort()
    return Columns.trusted(keys, list(map(pending.__getitem__, keys)))


_RESORT_AT = 64
"""Keys added since the last scan beyond which they are sorted in at once, not one by one."""


class SortedPending:
    """The keys of a store's uncommitted writes in key order, for scans that see own writes.

    A keyed processor scans its key's list, map or timer entries after writing others: a
    scan that passed over every uncommitted write made a micro-batch's time grow with the
    square of its keys (40,000 keys: 245 s). Keys only join the writes dict (until it is
    replaced at commit or abort), in insertion order, so those added since the last scan are
    its last ones: a few are inserted one by one (a binary search each), many sorted in at
    once; a scan then cuts its range out by binary search. The owner calls :meth:`clear`
    whenever it drops its writes (holding on to the old dict would keep them alive).
    """

    def __init__(self) -> None:
        self._keys: list[bytes] = []

    def clear(self) -> None:
        """Forget every key: the writes were dropped (committed or aborted)."""
        self._keys = []

    def items(
        self, pending: dict[bytes, bytes | None], prefix: bytes, start: bytes | None
    ) -> list[tuple[bytes, bytes | None]]:
        """The items of ``pending`` (the dict whose keys this tracks since the last
        :meth:`clear`) whose key starts with ``prefix`` (and is at or above ``start``),
        sorted by key."""
        keys = self._keys
        added = len(pending) - len(keys)
        if added > _RESORT_AT:
            keys.extend(itertools.islice(reversed(pending), added))
            keys.sort()
        elif added:
            for key in itertools.islice(reversed(pending), added):
                bisect.insort(keys, key)
        at = bisect.bisect_left(keys, prefix if start is None else max(prefix, start))
        found: list[tuple[bytes, bytes | None]] = []
        for i in range(at, len(keys)):  # (islice would step over the first ``at`` keys)
            key = keys[i]
            if not key.startswith(prefix):
                break
            found.append((key, pending[key]))
        return found


def merge(
    committed: Iterator[tuple[bytes, bytes]], overlay: list[tuple[bytes, bytes | None]]
) -> Iterator[tuple[bytes, bytes]]:
    """Merge committed items with the sorted overlay; the overlay wins, ``None`` hides."""
    i = 0
    for key, value in committed:
        while i < len(overlay) and overlay[i][0] < key:
            okey, ovalue = overlay[i]
            i += 1
            if ovalue is not None:
                yield okey, ovalue
        if i < len(overlay) and overlay[i][0] == key:
            ovalue = overlay[i][1]
            i += 1
            if ovalue is not None:
                yield key, ovalue
        else:
            yield key, value
    for okey, ovalue in overlay[i:]:
        if ovalue is not None:
            yield okey, ovalue
