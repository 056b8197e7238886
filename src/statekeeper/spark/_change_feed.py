"""``read_state_changes``: the change feed of an operator's state as a DataFrame.

The changes are read on the executors, one Spark task per partition, by the mechanism
``read_state`` uses (:func:`statekeeper.spark._read.read_on_executors`): each task reads its
store's changelogs (:class:`statekeeper.store.StoreChanges`) and decodes them
(:class:`statekeeper.keyed.ChangeDecoder`), streaming Arrow batches of bounded size. The
driver lists the root, checks that every partition can be read between the two versions,
and opens one store at the newer version to learn the operator's schema.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

from statekeeper import layout
from statekeeper.config import StoreConfig
from statekeeper.keyed import ChangeDecoder, OperatorRecord
from statekeeper.spark._arrow_types import arrow_schema
from statekeeper.spark._cache import worker_root
from statekeeper.spark._listener import listener_of
from statekeeper.spark._read import (
    PartitionRead,
    as_json,
    key_fields,
    read_on_executors,
    schema_record,
    utc,
    versions_to_read,
)
from statekeeper.store import StateBackend, StoreChanges

__all__ = ["read_state_changes"]

_HEAD = [
    T.StructField("version", T.LongType(), False),
    T.StructField("partition", T.IntegerType(), False),
]
_TYPED_TAIL = [
    T.StructField("state", T.StringType(), False),
    T.StructField("operation", T.StringType(), False),
    T.StructField("entry", T.StringType()),
    T.StructField("value", T.StringType()),
    T.StructField("expires_at", T.TimestampType()),
]
_RAW_TAIL = [
    T.StructField("key", T.BinaryType()),
    T.StructField("operation", T.StringType(), False),
    T.StructField("value", T.BinaryType()),
    T.StructField("key_group", T.IntegerType()),
]


def read_state_changes(
    spark: SparkSession,
    checkpoint: str,
    name: str,
    from_version: int,
    to_version: int | None = None,
    *,
    storage_options: Mapping[str, str] | None = None,
    allow_pickle: bool = False,
) -> DataFrame:
    """Every put and delete that turns version ``from_version`` of operator ``name`` into
    ``to_version`` (the commits of versions ``from_version + 1 .. to_version``), read from
    the changelogs by one Spark task per partition.

    Columns, for a keyed processor's state (one row per value, map entry, list element or
    timer written or deleted, in version order within a partition):

    * ``version`` (long): the version whose commit made the change (micro-batch
      ``version - 1``);
    * ``partition`` (int), then the key columns, typed as in :func:`read_state`;
    * ``state``: the state's name, ``"$timer"`` for a timer;
    * ``operation``: ``"put"`` or ``"delete"``;
    * ``entry``: the map key as JSON; for a list element its **sequence number** (its
      list's append counter: increasing in append order, restarting at 0 once the list was
      emptied; equal to :func:`read_state`'s position until elements at the front of the
      list expire); a timer's expiry in ms; null for a value state;
    * ``value``: the value written, as JSON; null for a delete and for a timer;
    * ``expires_at``: the TTL expiry a put wrote (a timer's: when it fires); null without
      TTL and for a delete.

    Applied in order to :func:`read_state` at ``from_version``, the rows give
    :func:`read_state` at ``to_version``: a put sets the row of (partition, key, state,
    entry), a delete removes it. **TTL expiry** shows as the delete the first micro-batch
    that saw an entry expired wrote (as read_state shows an expired entry until then).
    Bookkeeping the state layer derives from these entries is left out: the TTL index, the
    timer index, list counters, the operator record and the largest event time seen. State
    written by the vectorized form has columns ``version``, ``partition``, ``key``,
    ``operation``, ``value`` (raw bytes, null for a delete) and ``key_group`` (as in
    :func:`read_state`), and shows every raw change.

    Where versions of a partition have no changelog (GC collected them before a snapshot,
    or they were committed in ``mode="snapshot"``), the two versions around them are
    restored on the executor and compared: their rows are the net difference, all with the
    later version.

    Args:
        spark: the session to build the DataFrame in (classic or Spark Connect).
        checkpoint: the checkpoint root.
        name: the operator.
        from_version: the version the changes apply to (0: from the empty store).
        to_version: the version they lead to in every partition; if ``None``, the
            version of each partition that :func:`read_state` reads by default (the
            consistent cut).
        storage_options: object store options (they travel to the executors with the tasks).
        allow_pickle: as :func:`read_state`.

    Raises:
        StateNotFoundError: the operator is not in the root, or ``from_version`` or
            ``to_version`` is not restorable in some partition (GC keeps the newest
            ``retain_versions``; see docs/operations.md).
        ValueError: ``from_version`` is after ``to_version`` (or after the consistent cut)
            in some partition.
        CorruptStateError: a blob or a stored record fails its checks (raised by the action
            that runs the tasks, if found there).
        StorageError: the root cannot be read.
    """
    layout.validate_version(from_version)
    if to_version is not None:
        layout.validate_version(to_version)
    listener = listener_of(spark)
    with tempfile.TemporaryDirectory(prefix="statekeeper-changes-") as tmp:
        backend = StateBackend(
            checkpoint, config=StoreConfig(local_dir=tmp), storage_options=storage_options
        )
        try:
            versions, grouped = versions_to_read(backend, name, to_version, listener)
            for partition, version in sorted(versions.items()):
                _check(backend, name, partition, from_version, version)
            _, record = schema_record(backend, name, versions)
            root = worker_root(checkpoint, backend)
        finally:
            backend.close()
    fields = _RAW_TAIL if record is None else [*key_fields(record), *_TYPED_TAIL]
    schema = T.StructType([*_HEAD, *fields])
    spec = _ChangesSpec(
        checkpoint=root,
        operator=name,
        versions=versions,
        arrow_schema=arrow_schema(spark, schema),
        storage_options=tuple(sorted((str(k), str(v)) for k, v in (storage_options or {}).items())),
        from_version=from_version,
        record=None if record is None else record.to_bytes(),
        grouped=grouped,
        allow_pickle=allow_pickle,
    )
    return read_on_executors(spark, spec, schema)


def _check(backend: StateBackend, name: str, partition: int, start: int, end: int) -> None:
    """Raise unless the feed of one partition from ``start`` to ``end`` can be read."""
    try:
        StoreChanges.open(backend, name, partition, from_version=start, to_version=end)
    except ValueError as exc:
        raise ValueError(
            f"read_state_changes of operator {name!r}: from_version {start} is after version "
            f"{end} of partition {partition}, the version the changes would lead to"
        ) from exc


@dataclass(frozen=True, kw_only=True)
class _ChangesSpec(PartitionRead):
    """``read_state_changes``: the changes of each partition from one version to its own."""

    from_version: int
    record: bytes | None
    """The operator record to decode with (``None``: raw rows)."""
    grouped: bool
    allow_pickle: bool

    def where(self, partition: int) -> str:
        to = self.versions[partition]
        return (
            f"read_state_changes of {super().where(partition)} versions {self.from_version}..{to}"
        )

    def rows(self, backend: StateBackend, partition: int) -> Iterator[tuple[Any, ...]]:
        feed = StoreChanges.open(
            backend, self.operator, partition, from_version=self.from_version,
            to_version=self.versions[partition],
        )  # fmt: skip
        if self.record is None:
            return self._raw_rows(feed, partition)
        return self._typed_rows(feed, partition, OperatorRecord.from_bytes(self.record))

    def _raw_rows(self, feed: StoreChanges, partition: int) -> Iterator[tuple[Any, ...]]:
        for change in feed:
            key, group = change.key, None
            if self.grouped:
                key, group = key[2:], int.from_bytes(key[:2], "big")
            operation = "delete" if change.value is None else "put"
            yield (change.version, partition, key, operation, change.value, group)

    def _typed_rows(
        self, feed: StoreChanges, partition: int, record: OperatorRecord
    ) -> Iterator[tuple[Any, ...]]:
        decoder = ChangeDecoder(record, allow_pickle=self.allow_pickle)
        for raw in feed:
            c = decoder.decode(raw)
            if c is None:
                continue  # bookkeeping: TTL and timer indexes, list counters, the record
            entry = None if c.kind == "value" else as_json(c.entry) if c.kind == "map" else c.entry
            put = c.operation == "put"
            value = as_json(c.value) if put and c.kind != "timer" else None
            expires = c.entry if put and c.kind == "timer" else c.expires_at_ms
            yield (
                c.version, partition, *c.key, c.state, c.operation,
                None if entry is None else str(entry), value, utc(expires),
            )  # fmt: skip
