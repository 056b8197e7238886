"""Running one partition of one micro-batch: the vectorized function, and the keyed path.

The keyed processor's per-partition run lives in :mod:`statekeeper.keyed.runner` (no
pyspark: the processor test harness drives the same function) and is re-exported here; the
vectorized form's run and its :class:`PartitionStore` are here.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from statekeeper.errors import StateKeeperError
from statekeeper.keyed import group_prefix, key_group_range
from statekeeper.keyed.arrow_keys import encode_keys
from statekeeper.keyed.output import conform_batch
from statekeeper.keyed.runner import KEY_GROUP_COLUMN, RunStats, iter_groups, run_processor
from statekeeper.store import StateStore, listed

__all__ = [
    "ArrowFunction",
    "PartitionStore",
    "RunStats",
    "iter_groups",
    "run_arrow",
    "run_processor",
]


class PartitionStore:
    """One partition's store for one micro-batch, as a vectorized function sees it.

    Reads and writes of :class:`~statekeeper.StateStore` plus batched writes; committing is
    left to statekeeper (after the function's last output batch).
    """

    def __init__(
        self,
        store: StateStore,
        *,
        batch_id: int,
        partition: int,
        key_groups: int | None = None,
        partitions: int | None = None,
    ) -> None:
        """Wrap ``store`` for micro-batch ``batch_id``; ``key_groups`` (with
        ``partitions``): the operator's key groups, which every key put must start with."""
        self._store = store
        self.batch_id = batch_id
        self.partition = partition
        self.key_groups = key_groups
        """The operator's key groups: every key put starts with its key group, two bytes
        big-endian, one this partition owns. ``None`` for an operator of statekeeper 0.1,
        whose keys are free."""
        self._owned = (
            None if key_groups is None else key_group_range(partition, partitions or 1, key_groups)
        )
        # Keys this partition may put: group_prefix(first owned) <= key < group_prefix(last
        # owned + 1), compared as bytes (one comparison, also for min and max of many keys).
        owned = self._owned
        self._low = b"" if owned is None else group_prefix(owned.start)
        self._high = None if owned is None else group_prefix(owned.stop)

    def state_keys(self, batch: Any, columns: Sequence[str]) -> list[bytes]:
        """The store keys of a batch's rows: ``encode_key`` of ``columns``, each prefixed
        with the row's key group (the batch's :data:`KEY_GROUP_COLUMN`) if the operator has
        key groups. The way to build keys that :meth:`put` accepts.

        Raises:
            KeyError: a column is not in the batch.
            TypeError: a key element has a type keys cannot hold.
        """
        arrays = [batch.column(c) for c in columns]
        if self.key_groups is None:
            return encode_keys(arrays)
        return encode_keys(arrays, batch.column(KEY_GROUP_COLUMN))

    def _check(self, key: bytes) -> None:
        high = self._high
        if high is None:
            return
        if not isinstance(key, bytes):
            if not isinstance(key, bytearray | memoryview):
                return  # the store's put refuses it with a TypeError
            key = bytes(key)
        if not self._low <= key < high:
            owned = self._owned
            assert owned is not None
            raise StateKeeperError(
                f"partition {self.partition} owns key groups {owned.start} to "
                f"{owned.stop - 1}, and every key put must start with its key group (two "
                f"bytes); got key 0x{bytes(key[:16]).hex()}: build keys with "
                "store.state_keys(...)"
            )

    def __repr__(self) -> str:
        return f"PartitionStore(partition={self.partition}, batch_id={self.batch_id})"

    @property
    def version(self) -> int:
        """The committed version loaded (``batch_id``)."""
        return self._store.version

    def get(self, key: bytes) -> bytes | None:
        """As :meth:`StateStore.get`."""
        return self._store.get(key)

    def multi_get(self, keys: Iterable[bytes]) -> list[bytes | None]:
        """As :meth:`StateStore.multi_get`."""
        return self._store.multi_get(keys)

    def scan(self, prefix: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        """As :meth:`StateStore.scan`."""
        return self._store.scan(prefix)

    def put(self, key: bytes, value: bytes) -> None:
        """As :meth:`StateStore.put`.

        Raises:
            StateKeeperError: with key groups, ``key`` does not start with one this
                partition owns.
        """
        self._check(key)
        self._store.put(key, value)

    def delete(self, key: bytes) -> None:
        """As :meth:`StateStore.delete`."""
        self._store.delete(key)

    def put_many(
        self,
        items: Iterable[tuple[bytes, bytes]] | Iterable[bytes],
        values: Iterable[bytes] | None = None,
    ) -> None:
        """Put every (key, value) pair, or with ``values`` every key of ``items`` with its
        value (two columns: ``store.put_many(keys, values)`` builds no pair per key):
        :meth:`StateStore.put_many`, whose checks run once over all pairs, as the key-group
        check here does (no Python call per pair).

        Raises:
            TypeError, ValueError: as :meth:`StateStore.put_many` (then nothing is put).
            StateKeeperError: with key groups, a key does not start with one this partition
                owns (then nothing is put).
        """
        if values is None:
            pairs = listed(items, "put_many's items", "(key, value) pairs")
            try:
                keys: list[Any] = list(map(operator.itemgetter(0), pairs))
            except (TypeError, IndexError):  # not pairs: the store says what it expected
                keys = []
            self._check_many(keys)
            self._store.put_many(pairs)
            return
        keys = listed(items, "put_many's keys")
        self._check_many(keys)
        self._store.put_many(keys, values)

    def _check_many(self, keys: list[Any]) -> None:
        """:meth:`_check` of every key; the smallest and the largest key decide for all (no
        Python loop per key) unless they are out of range."""
        if self._high is None or not keys:
            return
        try:
            inside = self._low <= min(keys) and max(keys) < self._high
        except TypeError:  # keys of several types: check one by one
            inside = False
        if not inside:
            for key in keys:
                self._check(key)

    def delete_many(self, keys: Iterable[bytes]) -> None:
        """Delete every key.

        Raises:
            TypeError, ValueError: as :meth:`StateStore.delete`, or ``keys`` is not an
                iterable of keys (then nothing is deleted).
        """
        delete = self._store.delete
        for key in listed(keys, "keys"):
            delete(key)


ArrowFunction = Callable[[PartitionStore, Iterator[Any]], Iterable[Any]]
"""``fn(store, batches) -> batches``: a partition's input and output as pyarrow RecordBatches."""


def run_arrow(
    store: StateStore,
    fn: ArrowFunction,
    batches: Iterator[Any],
    *,
    output_schema: Any,
    operator: str,
    batch_id: int,
    partition: int,
    stats: RunStats | None = None,
    key_groups: int | None = None,
    partitions: int | None = None,
) -> Iterator[Any]:
    """Run a vectorized function over one partition; yields checked output batches.

    Input the function leaves unread is drained (and counted) afterwards. With
    ``key_groups`` the batches carry :data:`KEY_GROUP_COLUMN` and the function's keys must
    start with their key group (:meth:`PartitionStore.state_keys`).

    Raises:
        OutputSchemaError: an output batch does not match ``output_schema``.
        Exception: whatever ``fn`` raises.
    """
    stats = stats if stats is not None else RunStats()
    where = f"operator {operator!r} partition {partition} micro-batch {batch_id}"

    def counted() -> Iterator[Any]:
        for batch in batches:
            stats.rows_in += batch.num_rows
            yield batch

    source = counted()
    view = PartitionStore(
        store, batch_id=batch_id, partition=partition, key_groups=key_groups,
        partitions=partitions,
    )  # fmt: skip
    for out in fn(view, source):
        batch = conform_batch(out, output_schema, where)
        stats.rows_out += batch.num_rows
        yield batch
    for _ in source:
        pass
