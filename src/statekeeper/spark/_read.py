"""``read_state``: a checkpoint root's state as a DataFrame, for inspection.

The stores are restored on the driver into a temporary folder (never into the working copies
a running query uses), read, and dropped. Without ``version`` the newest version *every*
partition has is read, which is a consistent cut: all partitions commit every micro-batch.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import math
import tempfile
from collections.abc import Iterator, Mapping
from decimal import Decimal
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

from statekeeper.config import StoreConfig
from statekeeper.errors import CorruptStateError, StateNotFoundError
from statekeeper.spark._codec import codec_by_name
from statekeeper.spark._keys import decode_element, decode_key
from statekeeper.spark._statekeys import (
    DATA,
    LIST_ITEM,
    META_KEY,
    OperatorRecord,
    unwrap,
)
from statekeeper.store import StateBackend, StateStore

__all__ = ["read_state"]

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
    ]
)


def read_state(
    spark: SparkSession,
    checkpoint: str,
    name: str,
    version: int | None = None,
    storage_options: Mapping[str, str] | None = None,
    *,
    allow_pickle: bool = False,
) -> DataFrame:
    """The state of operator ``name`` as a DataFrame.

    For a processor's state: one row per value, map entry or list element, with columns
    ``partition``, the key columns, ``state``, ``entry`` (the map key as JSON, or the list
    position; null for value state), ``value`` (JSON) and ``expires_at`` (null without TTL;
    entries past it are kept until a micro-batch of their partition cleans them). State
    written by the vectorized form has columns ``partition``, ``key``, ``value`` (raw bytes).

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
    typed: list[tuple[Any, ...]] = []
    raw: list[tuple[Any, ...]] = []
    record: OperatorRecord | None = None
    for p in range(count):
        with backend.open(name, p, version) as store:
            found = store.get(META_KEY)
            if found is None:
                raw.extend((p, k, v) for k, v in store.scan() if not k.startswith(META_KEY))
                continue
            record = record or OperatorRecord.from_bytes(found)
            typed.extend(_typed_rows(store, p, OperatorRecord.from_bytes(found), allow_pickle))
    if record is None:
        return raw, _RAW_SCHEMA
    return typed, _typed_schema(record)


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


def _typed_rows(
    store: StateStore, partition: int, record: OperatorRecord, allow_pickle: bool
) -> Iterator[tuple[Any, ...]]:
    arity = len(record.keys)
    positions: dict[bytes, int] = {}
    for key, value in store.scan(DATA):
        state, pos = decode_element(key, len(DATA))
        decl = record.states.get(state)
        if decl is None:
            raise CorruptStateError(f"state {state!r} is not in the operator record")
        group, used = decode_key(key[pos:], arity)
        rest = key[pos + used :]
        if decl.kind == "list":
            if not rest.startswith(LIST_ITEM):
                continue  # the list's counter
            prefix = key[: pos + used]
            entry: str | None = str(positions.get(prefix, 0))
            positions[prefix] = positions.get(prefix, 0) + 1
        elif decl.kind == "map":
            entry = _json(decode_element(rest)[0])
        else:
            entry = None
        expiry, payload = unwrap(value)
        expires = None if expiry is None else dt.datetime.fromtimestamp(expiry / 1000, dt.UTC)
        yield (partition, *group, state, entry, _decode(payload, decl.codec, allow_pickle), expires)


def _decode(payload: bytes, codec_name: str, allow_pickle: bool) -> str:
    codec = codec_by_name(codec_name, allow_pickle=allow_pickle)
    if codec is None:
        hint = "pass allow_pickle=True to decode" if codec_name == "pickle" else "custom codec"
        return json.dumps(f"<{codec_name}: {len(payload)} bytes; {hint}>")
    return _json(codec.decode(payload))


def _json(value: Any) -> str:
    return json.dumps(_plain(value), ensure_ascii=False)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k if isinstance(k, str) else _json(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
