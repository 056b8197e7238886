"""``read_state``: a checkpoint root's state as a DataFrame, for inspection.

The stores are restored on the driver into a temporary folder (never into the working copies
a running query uses), read, and dropped. Without ``version`` the newest version *every*
partition has is read, which is a consistent cut: all partitions commit every micro-batch.
"""

from __future__ import annotations

import datetime as dt
import json
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

from statekeeper.config import StoreConfig
from statekeeper.errors import StateNotFoundError
from statekeeper.keyed import (
    OperatorRecord,
    iter_state,
    iter_timers,
    jsonable,
    read_operator_record,
)
from statekeeper.store import StateBackend, StateStore

__all__ = ["TIMER_STATE", "read_state"]

TIMER_STATE = "$timer"
"""The ``state`` of a timer's row in :func:`read_state` (no state name starts with ``$``)."""

_TAIL_FIELDS = [
    T.StructField("state", T.StringType()),
    T.StructField("entry", T.StringType()),
    T.StructField("value", T.StringType()),
    T.StructField("expires_at", T.TimestampType()),
]
_RAW_SCHEMA = T.StructType(
    [
        T.StructField("partition", T.IntegerType(), False),
        T.StructField("key", T.BinaryType()),
        T.StructField("value", T.BinaryType()),
        T.StructField("key_group", T.IntegerType()),
    ]
)


def read_state(
    spark: SparkSession,
    checkpoint: str,
    name: str,
    version: int | None = None,
    *,
    storage_options: Mapping[str, str] | None = None,
    allow_pickle: bool = False,
) -> DataFrame:
    """The state of operator ``name`` as a DataFrame.

    For a processor's state: one row per value, map entry or list element, with columns
    ``partition``, the key columns, ``state``, ``entry`` (the map key as JSON, or the list
    position; null for value state), ``value`` (JSON) and ``expires_at`` (null without TTL;
    entries past it are kept until a micro-batch of their partition cleans them). Each
    registered timer is a row too: ``state`` is ``"$timer"`` (no state name can be), ``entry``
    its expiry in milliseconds, ``value`` null and ``expires_at`` when it fires. State
    written by the vectorized form has columns ``partition``, ``key``, ``value`` (raw bytes)
    and ``key_group``: in an operator with key groups the key's first two bytes, which
    ``key`` then goes without; null for an operator of statekeeper 0.1.

    Args:
        spark: the session to build the DataFrame in.
        checkpoint: the checkpoint root.
        name: the operator.
        version: the version to read in every partition; the newest common one if ``None``.
        storage_options: object store options.
        allow_pickle: decode values of states declared with ``PickleCodec`` (runs code from
            the root: only for roots you trust); otherwise they show as a placeholder.

    Raises:
        StateNotFoundError: the operator is not in the root, or ``version`` is not
            restorable in some partition.
        CorruptStateError: a blob or a stored record fails its checks.
        StorageError: the root cannot be read.
    """
    with tempfile.TemporaryDirectory(prefix="statekeeper-read-") as tmp:
        backend = StateBackend(
            checkpoint, config=StoreConfig(local_dir=tmp), storage_options=storage_options
        )
        try:
            rows, schema = _read_rows(backend, name, version, allow_pickle)
        finally:
            backend.close()
    return spark.createDataFrame(rows, schema)


def _read_rows(
    backend: StateBackend, name: str, version: int | None, allow_pickle: bool
) -> tuple[list[tuple[Any, ...]], T.StructType]:
    operators = backend.operators()
    count = operators.get(name)
    if count is None:
        known = sorted(operators)
        raise StateNotFoundError(
            f"operator {name!r} has no partition count in {backend.blobs.uri} (operators: {known})"
        )
    if version is None:
        version = min(_latest(backend, name, p) for p in range(count))
    metadata = backend.root_metadata()
    groups = None if metadata is None else metadata.key_groups.get(name)
    typed: list[tuple[Any, ...]] = []
    raw: list[tuple[Any, ...]] = []
    record: OperatorRecord | None = None
    for p in range(count):
        with backend.open(name, p, version) as store:
            found = read_operator_record(store)
            if found is None:
                raw.extend(_raw_rows(store, p, grouped=groups is not None))
                continue
            record = record or found
            typed.extend(_typed_rows(store, p, allow_pickle))
    if record is None:
        return raw, _RAW_SCHEMA
    return typed, _typed_schema(record)


def _raw_rows(store: StateStore, partition: int, *, grouped: bool) -> Iterator[tuple[Any, ...]]:
    for key, value in store.scan():
        if grouped:
            yield (partition, key[2:], value, int.from_bytes(key[:2], "big"))
        else:
            yield (partition, key, value, None)


def _latest(backend: StateBackend, name: str, partition: int) -> int:
    versions = backend.versions(name, partition)
    return versions[-1] if versions else 0


def _typed_schema(record: OperatorRecord) -> T.StructType:
    if record.key_schema is not None:
        parsed = T.StructType.fromJson(json.loads(record.key_schema))
        key_fields = list(parsed.fields)
    else:
        key_fields = [T.StructField(k, T.StringType()) for k in record.keys]
    return T.StructType(
        [T.StructField("partition", T.IntegerType(), False), *key_fields, *_TAIL_FIELDS]
    )


def _typed_rows(store: StateStore, partition: int, allow_pickle: bool) -> Iterator[tuple[Any, ...]]:
    for e in iter_state(store, allow_pickle=allow_pickle):
        entry = None if e.kind == "value" else str(e.entry) if e.kind == "list" else _json(e.entry)
        expires = (
            None
            if e.expires_at_ms is None
            else dt.datetime.fromtimestamp(e.expires_at_ms / 1000, dt.UTC)
        )
        yield (partition, *e.key, e.state, entry, _json(e.value), expires)
    for timer in iter_timers(store):
        fires = dt.datetime.fromtimestamp(timer.expiry_ms / 1000, dt.UTC)
        yield (partition, *timer.key, TIMER_STATE, str(timer.expiry_ms), None, fires)


def _json(value: Any) -> str:
    return json.dumps(jsonable(value), ensure_ascii=False)
