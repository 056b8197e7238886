"""Initial state on Spark: the driver's checks, the staging job, and what a task reads.

An initial state reaches its partitions the same way the input does, in a batch job run when
the query is defined: a streaming plan cannot take a batch DataFrame (Spark refuses a union
or cogroup of a stream with a batch DataFrame, and its own ``initialState`` plumbing is not
public), so the initial rows are tagged with their key group, routed by ``repartitionById``
exactly like the input, and each partition's rows are **staged** in the checkpoint root as
one Arrow IPC blob (:func:`stage_task`, create-only, named per attempt). The driver passes
the names and CRC32C checksums to the tasks, and a task of micro-batch 0 reads its
partition's blob (:func:`initial_rows`), checked, on every attempt of that batch (or the
operator's first task, for a batch 0 that ran no task of it: ``_tasks._acquire``). Once
batch 1 is committed in every partition, batch 0 can no longer run: a later definition of
the query skips the job and deletes what earlier runs staged (:func:`stage_for_batch_zero`).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import google_crc32c
import pyarrow as pa  # type: ignore[import-untyped]
from pyspark.sql import DataFrame

from statekeeper import layout
from statekeeper.errors import CorruptStateError, StateKeeperError, StateNotFoundError
from statekeeper.keyed import StatefulProcessor, handles_initial_state
from statekeeper.spark._cache import StoreSpec
from statekeeper.spark._partition import (
    KEY_GROUP_COLUMN,
    Partitioning,
    collect,
    key_group_of,
    target_partition,
)
from statekeeper.storage import BlobStore, open_blob_store
from statekeeper.store import StateBackend

__all__ = [
    "STAGED_SCHEMA",
    "Staged",
    "batch_zero_done",
    "check_initial",
    "initial_rows",
    "read_staged",
    "stage_for_batch_zero",
    "stage_initial",
    "stage_task",
]


def check_initial(
    df: DataFrame,
    initial: DataFrame,
    key_names: Sequence[str],
    processor: StatefulProcessor,
    reserved: Sequence[str],
) -> None:
    """Refuse an initial state that cannot be applied, before any state is touched.

    Raises:
        TypeError: not a DataFrame.
        ValueError: streaming, a key column missing or of another type than in ``df``, a
            ``reserved`` column, or a processor without ``handle_initial_state``.
    """
    if not isinstance(initial, DataFrame):
        raise TypeError(f"initial_state must be a pyspark DataFrame, got {type(initial).__name__}")
    if initial.isStreaming:
        raise ValueError(
            "initial_state must be a batch DataFrame (spark.read, createDataFrame), got a "
            "streaming one: it is read once, for micro-batch 0"
        )
    if not handles_initial_state(processor):
        raise ValueError(
            f"initial_state was given, but {type(processor).__name__} does not define "
            "handle_initial_state: nothing would apply it"
        )
    fields = {f.name: f.dataType for f in initial.schema.fields}
    expected = {k: df.schema[k].dataType for k in key_names}
    wrong = {k: fields.get(k) for k, t in expected.items() if fields.get(k) != t}
    if wrong:
        shown = ", ".join(
            f"{k} {expected[k].simpleString()} (found {'none' if t is None else t.simpleString()})"
            for k, t in wrong.items()
        )
        raise ValueError(
            f"initial_state must hold the key columns with the input's types, so that each "
            f"key reaches the partition that owns it: expected {shown}; its columns are "
            f"{list(fields)}"
        )
    found = [c for c in reserved if c in fields]
    if found:
        raise ValueError(f"initial_state columns {found} are reserved by statekeeper")


def stage_for_batch_zero(
    initial: DataFrame,
    keys: Sequence[str],
    partitioning: Partitioning,
    store: StoreSpec,
    generation: int,
    schema: Any,
) -> tuple[Staged, ...] | None:
    """Stage ``initial`` for micro-batch 0, unless batch 0 can no longer run: then what
    earlier runs staged is deleted, and ``None`` (nothing to apply) is returned.

    ``schema`` is :data:`STAGED_SCHEMA` as the session's Arrow schema.

    Raises:
        StateKeeperError: the root cannot be read, or staging failed.
        Exception: whatever the staging job raises (Spark's errors).
    """
    blobs = open_blob_store(store.root, dict(store.storage_options))
    with StateBackend(blobs, config=store.config) as backend:
        if batch_zero_done(backend, store.operator, store.partitions):
            blobs.delete_many(
                [m.key for m in blobs.list(layout.initial_state_prefix(store.operator))]
            )
            return None
    return stage_initial(initial, list(keys), partitioning, store, generation, schema)


def initial_rows(
    blobs: BlobStore, staged: tuple[Staged, ...] | None, partition: int, batch_id: int
) -> Any:
    """``partition``'s staged initial rows in micro-batch 0 (every attempt reads them again:
    a re-run starts from version 0); ``None`` in later batches or without any.

    Raises:
        CorruptStateError, StateNotFoundError: as :func:`read_staged`.
    """
    if staged is None or batch_id != 0:
        return None
    mine = [s for s in staged if s.partition == partition]
    if not mine:
        return None
    try:
        return read_staged(blobs, mine[0])
    except StateNotFoundError as exc:
        raise StateNotFoundError(
            f"the initial state staged for this definition of the query is gone ({exc}): "
            "two or more later transform_with_state calls for the same operator staged "
            "theirs since, and the root keeps the newest two. Start the query from the "
            "DataFrame of its newest definition"
        ) from exc


STAGED_SCHEMA = "partition int, blob string, crc long, rows long"
"""What :func:`stage_task` returns per partition, as Spark DDL."""


@dataclass(frozen=True)
class Staged:
    """One partition's staged initial rows: blob key, CRC32C and row count."""

    partition: int
    key: str
    crc: int
    rows: int


def stage_task(
    root: str,
    storage_options: tuple[tuple[str, str], ...],
    operator: str,
    generation: int,
    partitioning: Partitioning,
    schema: Any,
    batches: Iterator[Any],
) -> Iterator[Any]:
    """Stage one partition's initial rows (routed by key group) as an Arrow IPC blob in the
    root; yields one row of :data:`STAGED_SCHEMA` (``schema``), none for an empty partition.

    Raises:
        StateKeeperError: rows of several state partitions.
        StorageError: the blob could not be written.
    """
    table, _, partition = collect(batches, None, partitioning)
    if partition is None:
        return
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue().to_pybytes()
    # A name per attempt: a retried task never meets its failed attempt's blob.
    key = layout.initial_state_key(operator, generation, partition, uuid.uuid4().hex)
    blobs = open_blob_store(root, dict(storage_options))
    try:
        blobs.put(key, data)
    finally:
        blobs.close()
    row = {"partition": [partition], "blob": [key], "crc": [google_crc32c.value(data)]}
    row["rows"] = [table.num_rows]
    yield pa.RecordBatch.from_pydict(row, schema=schema)


def read_staged(blobs: BlobStore, staged: Staged) -> Any:
    """A partition's staged initial rows, checked against their CRC32C.

    Raises:
        CorruptStateError: the blob's checksum or row count differs from what was staged.
        StateNotFoundError: the blob is gone.
    """
    data = blobs.get(staged.key)
    found = google_crc32c.value(data)
    if found != staged.crc:
        raise CorruptStateError(
            f"staged initial state {blobs.uri}/{staged.key}: expected CRC32C {staged.crc}, "
            f"found {found}"
        )
    table = pa.ipc.open_stream(data).read_all()
    if table.num_rows != staged.rows:
        raise CorruptStateError(
            f"staged initial state {blobs.uri}/{staged.key}: expected {staged.rows} rows, "
            f"found {table.num_rows}"
        )
    return table


def batch_zero_done(backend: StateBackend, operator: str, partitions: int) -> bool:
    """True once micro-batch 0 of ``operator`` can no longer run again: every partition has
    committed version 2 (batch 1), which a re-run of batch 0 may not replace. Stops at the
    first partition that has not."""
    for partition in range(partitions):
        versions = backend.versions(operator, partition)
        if not versions or versions[-1] < 2:
            return False
    return True


def stage_initial(
    initial: DataFrame,
    keys: list[str],
    partitioning: Partitioning,
    store: StoreSpec,
    generation: int,
    schema: Any,
) -> tuple[Staged, ...]:
    """Stage ``initial``'s rows per state partition in the root (a Spark batch job, see the
    module docstring), after deleting what runs before the previous one staged; returns
    what tasks read. The previous run's stay: a query defined twice (a notebook cell run
    again, a definition for ``explain``) may still be started from the first DataFrame.

    Raises:
        StateKeeperError: the job returned two blobs for one partition.
        Exception: whatever the job raises (Spark's errors).
    """
    if partitioning.key_groups is None:
        raise StateKeeperError("an initial state needs an operator with key groups")
    blobs = open_blob_store(store.root, dict(store.storage_options))
    try:
        prefix = layout.initial_state_prefix(store.operator)
        old = [
            m.key for m in blobs.list(prefix)
            if (layout.initial_state_generation(store.operator, m.key) or 0) < generation - 1
        ]  # fmt: skip
        blobs.delete_many(old)
    finally:
        blobs.close()
    task = functools.partial(
        stage_task, store.root, store.storage_options, store.operator, generation,
        partitioning, schema,
    )  # fmt: skip
    tagged = initial.withColumn(KEY_GROUP_COLUMN, key_group_of(keys, partitioning.key_groups))
    routed = tagged.repartitionById(partitioning.partitions, target_partition(partitioning))
    staged = [
        Staged(int(r["partition"]), str(r["blob"]), int(r["crc"]), int(r["rows"]))
        for r in routed.mapInArrow(task, STAGED_SCHEMA).collect()
    ]
    if len({s.partition for s in staged}) != len(staged):
        raise StateKeeperError(
            f"staging the initial state of {store.operator!r} returned several blobs for one "
            f"partition: {sorted(s.partition for s in staged)}"
        )
    return tuple(sorted(staged, key=lambda s: s.partition))
