"""The tasks of ``transform_with_state`` (keyed forms) and of its vectorized form.

A task learns its state partition from its data (checked against its task id, see
:mod:`statekeeper.spark._transform`), leases the partition's store at version ``b`` (the
micro-batch id, ``_cache``), runs the processor or function, yields the output and only then
commits version ``b + 1`` with the attempt's order, so a task that fails or whose output is
abandoned commits nothing; then it writes its task report into the root. A keyed task reads
its whole input first, with bounded memory (:mod:`statekeeper.keyed.grouping`): a key's
rows may come last, and with event time the handle needs the batch's largest event time.
Before reading anything a task asks for its store (:meth:`StoreCache.ask`), so that a
handover from another Python worker overlaps the reading.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pyspark import TaskContext

from statekeeper import layout
from statekeeper.errors import (
    CommitConflictError,
    CorruptStateError,
    OwnerConflictError,
    StateKeeperError,
    StateNotFoundError,
)
from statekeeper.history import StoreHistory, lost_manifests
from statekeeper.keyed import StatefulProcessor
from statekeeper.keyed.grouping import KeyedInput
from statekeeper.keyed.runner import BatchTime
from statekeeper.spark._cache import CACHE, Lease, StoreSpec, spill_dir
from statekeeper.spark._initial import Staged, initial_rows
from statekeeper.spark._partition import Partitioning, TaskInput, peek_partition
from statekeeper.spark._reports import TaskIdentity, report_task
from statekeeper.spark._runner import ArrowFunction, RunStats, run_arrow, run_processor
from statekeeper.spark._time import TimeSpec, split_heartbeats
from statekeeper.store import CommitInfo, StateStore

__all__ = ["TaskSpec", "arrow_task", "rows_task"]

_NO_TIME = TimeSpec()
_log = logging.getLogger("statekeeper.spark")


@dataclass(frozen=True)
class TaskSpec:
    """What every task of an operator needs, built by the driver (pickled to executors)."""

    store: StoreSpec
    keys: tuple[str, ...]
    key_schema: str | None
    output_schema: Any  # pa.Schema
    ts_column: str | None
    generation: int
    key_groups: int | None
    """The operator's key groups as the root records them (``None``: a 0.1 operator)."""
    time: TimeSpec = _NO_TIME
    """The operator's time mode and event time."""
    initial: tuple[Staged, ...] | None = None
    """The staged initial state, per partition that has rows (``None``: none to apply)."""

    @property
    def partitioning(self) -> Partitioning:
        """How the operator's rows carry their partition."""
        return Partitioning(self.store.partitions, self.key_groups)


def _task_context() -> tuple[TaskContext, int, str]:
    """The Spark task, its micro-batch id and query id.

    Raises:
        StateKeeperError: not in a Spark task, or not in a streaming micro-batch.
    """
    tc = TaskContext.get()
    if tc is None:
        raise StateKeeperError("statekeeper tasks must run inside a Spark task")
    raw = tc.getLocalProperty("streaming.sql.batchId")
    if raw is None:
        raise StateKeeperError(
            "this task has no micro-batch id (local property streaming.sql.batchId): the "
            "output of transform_with_state must be run by a streaming query"
        )
    return tc, int(raw), tc.getLocalProperty("sql.streaming.queryId") or ""


def _identity(spec: TaskSpec, data_partition: int | None) -> TaskIdentity:
    """Who runs this task; the state partition is the data's, checked against the task's.

    Raises:
        StateKeeperError: the data and the task id disagree (the plan was changed so that
            the operator no longer ends its stage), or not in a streaming task.
    """
    tc, batch_id, query_id = _task_context()
    task_partition = tc.partitionId()
    partition = task_partition if data_partition is None else data_partition
    if task_partition != partition or partition >= spec.store.partitions:
        raise StateKeeperError(
            f"operator {spec.store.operator!r} micro-batch {batch_id}: task {task_partition} "
            f"received rows of state partition {partition} (of {spec.store.partitions}). The "
            "operator's stage must end with its own exchange, as transform_with_state plans "
            "it; a changed plan would give empty partitions the wrong state"
        )
    # PySpark's TaskContext has no stage attempt number; the task attempt id serves: it
    # grows with every task attempt of the application, so a retried stage's tasks order
    # after the attempt they retry (and a new application starts a new generation).
    return TaskIdentity(
        batch_id, partition, query_id, tc.stageId(), tc.taskAttemptId(), tc.attemptNumber()
    )


def _commit(store: StateStore, spec: TaskSpec, ctx: TaskIdentity) -> CommitInfo:
    order = (spec.generation, ctx.stage_id, ctx.stage_attempt, ctx.attempt)
    try:
        # The query id owns what the query commits: another query (a fresh
        # checkpointLocation) can neither replace its versions nor build on them.
        return store.commit(order=order, owner=ctx.query_id or None)
    except OwnerConflictError as exc:
        raise OwnerConflictError(
            f"micro-batch {ctx.batch_id} of operator {spec.store.operator!r} partition "
            f"{ctx.partition} of streaming query {ctx.query_id} could not commit version "
            f"{ctx.batch_id + 1}: the operator's state belongs to another streaming query, "
            "whose checkpointLocation is not this query's. A query started with a fresh "
            "checkpointLocation begins again at micro-batch 0 and would overwrite or "
            "continue the other query's state. Restart the other query from its own "
            "checkpointLocation, or give this query its own operator name (or state root) "
            "to start from empty state; `statekeeper versions ROOT OPERATOR` names the query "
            f"that wrote each version ({exc})"
        ) from exc
    except CommitConflictError as exc:
        raise CommitConflictError(
            f"micro-batch {ctx.batch_id} of operator {spec.store.operator!r} partition "
            f"{ctx.partition} could not commit version {ctx.batch_id + 1} (attempt order "
            f"{order}): a newer run of this operator wrote the store (this task is left over "
            "from an earlier run), or the batch was re-run with other state changes by the "
            "same attempt. The processor must be deterministic for a given input (use "
            "handle.batch_timestamp_ms, not the wall clock), and the query's "
            f"checkpointLocation must belong to this state root ({exc})"
        ) from exc


def _acquire(
    spec: TaskSpec, ctx: TaskIdentity, batch_zero: Callable[[Lease], None] | None = None
) -> Lease:
    """The partition's store at version ``b`` (the micro-batch id), after committing an
    empty version for each earlier micro-batch of this query that ran no task of the
    operator; micro-batch 0 among them runs ``batch_zero`` on the store first (a keyed
    task applies its initial state there).

    Spark drops the operator's stage from a micro-batch whose input to it is empty: the
    optimizer replaces an input with no new data by an empty relation, and adaptive
    execution an empty shuffle (a filter that drops every row of a batch, a union whose
    other source alone has data, a no-data batch of a downstream watermark). Spark then
    counts the batch done with no version ``b + 1`` committed, and every later batch would
    fail for good. An empty batch changes no state (timers and TTL that were due act in
    the next batch that runs, as after no-data batches), so the versions it would have
    committed are committed empty here, each owned by this query. A gap after a version of
    another query, or of none (the store API), is refused as before: the query's
    checkpointLocation and the state root disagree. So is one a newer manifest that failed
    its checks may cover (the version would replace the one it names), and one of a store
    that lost its manifests (:func:`~statekeeper.history.lost_manifests`: filling it would
    go on from empty state). A gap after version 0 is filled: nothing tells a query whose
    first micro-batches had no input (or an operator added to a running query) from an old
    checkpointLocation pointed at a new, empty root, which therefore starts from empty
    state (the WARNING says so) instead of failing. An initial state is applied in that
    filled micro-batch 0, as Spark applies it in batch 0 whether or not the operator has
    input there (before, the gap was refused, and the query could never run again).

    Raises:
        StateNotFoundError: version ``b`` is missing, and not for skipped micro-batches.
        CorruptStateError: the store lost its manifests.
        StateKeeperError: as :meth:`StoreCache.acquire`.
    """
    try:
        return CACHE.acquire(spec.store, ctx.partition, ctx.batch_id, spec.generation)
    except StateNotFoundError:
        newest = _skipped_since(spec, ctx)
        if newest is None:
            raise
    if newest == 0 and spec.initial is not None and batch_zero is None:
        raise StateKeeperError(
            f"operator {spec.store.operator!r} partition {ctx.partition}: micro-batch "
            f"{ctx.batch_id} is its first to run, and this form cannot apply an initial state"
        )
    lease = CACHE.acquire(spec.store, ctx.partition, newest, spec.generation)
    try:
        _log.warning(
            "operator %r partition %s: micro-batches %s..%s of query %s ran no task of the "
            "operator (Spark skips it when its input is empty): committing them empty%s "
            "(were they run against another state root, this one starts from its version %s)",
            spec.store.operator, ctx.partition, newest, ctx.batch_id - 1, ctx.query_id,
            ", micro-batch 0 with the initial state" if newest == 0 and spec.initial else "",
            newest,
        )  # fmt: skip
        for batch_id in range(newest, ctx.batch_id):
            if batch_id == 0 and batch_zero is not None:
                batch_zero(lease)
            _commit(lease.store, spec, dataclasses.replace(ctx, batch_id=batch_id))
    except BaseException:
        CACHE.release(lease, ok=False)
        raise
    return lease


def _skipped_since(spec: TaskSpec, ctx: TaskIdentity) -> int | None:
    """The newest version of the task's store if every micro-batch after it, up to this
    one, ran no task of the operator (see :func:`_acquire`); else ``None``."""
    backend = CACHE.backend(spec.store)
    meta = backend.root_metadata()
    if meta is None or not ctx.query_id:
        return None
    store = (spec.store.operator, ctx.partition)
    history = StoreHistory.load(backend.blobs, *store, root_id=meta.root_id)
    newest = history.latest()
    if newest >= ctx.batch_id or history.skipped_manifests:
        # A damaged newer manifest may name the versions that look skipped: committing them
        # empty would replace a micro-batch's state with its predecessor's.
        return None
    if newest == 0:
        if history.manifest is None:  # an empty store, unless it lost its manifests
            prefixes = (layout.changelog_prefix, layout.snapshot_prefix, layout.metrics_prefix)
            keys = [m.key for f in prefixes for m in backend.blobs.list(f(*store))]
            if (lost := lost_manifests(*store, keys)) is not None:
                raise CorruptStateError(lost)  # filling the gap would go on from empty state
        return 0
    entry = None if history.manifest is None else history.manifest.entry(newest)
    return newest if entry is not None and entry.owner == ctx.query_id else None


def _ask_ahead(spec: TaskSpec) -> None:
    """Ask for the store of this task's partition before reading the input
    (:meth:`StoreCache.ask`): the task id is the state partition (``_identity`` checks it
    against the data later)."""
    tc = TaskContext.get()
    if tc is not None and tc.partitionId() < spec.store.partitions:
        CACHE.ask(spec.store, tc.partitionId())


def rows_task(spec: TaskSpec, processor: StatefulProcessor, batches: Any) -> Iterator[Any]:
    started = time.perf_counter()
    _ask_ahead(spec)
    # The whole input is read before the first key runs (a key's rows may come last), into
    # runs spilled by key group beyond a budget: memory stays bounded (keyed.grouping).
    source = KeyedInput(
        grouped=spec.key_groups is not None, spill_dir=spill_dir(),
        event_time_column=spec.time.event_time_column,
    )  # fmt: skip
    try:
        task_input = TaskInput(batches, spec.ts_column, spec.partitioning)
        beats: list[int] = []
        for batch in task_input:
            data, top = split_heartbeats(batch, spec.time)
            source.add(data)
            if top is not None:
                beats.append(top)
        ctx = _identity(spec, task_input.partition)
        stats = RunStats()
        batch_zero = functools.partial(
            _late_batch_zero, spec, processor, ctx, task_input.now_ms, stats
        )
        lease = _acquire(spec, ctx, batch_zero if spec.initial is not None else None)
    except BaseException:
        source.close()
        raise
    try:
        blobs = lease.entry.backend.blobs
        initial = initial_rows(blobs, spec.initial, ctx.partition, ctx.batch_id)
        yield from run_processor(
            lease.store, processor, source, keys=spec.keys, output_schema=spec.output_schema,
            operator=spec.store.operator, batch_id=ctx.batch_id, partition=ctx.partition,
            now_ms=task_input.now_ms, key_schema=spec.key_schema, stats=stats,
            key_groups=spec.key_groups, time=spec.time,
            batch=BatchTime(batch_max_event_ms=max(beats, default=None)), initial=initial,
        )  # fmt: skip
        info = _commit(lease.store, spec, ctx)
    except BaseException:
        CACHE.release(lease, ok=False)
        raise
    finally:
        source.close()
    CACHE.release(lease, ok=True)
    report_task(lease, info, stats, ctx, time.perf_counter() - started)


def _late_batch_zero(
    spec: TaskSpec,
    processor: StatefulProcessor,
    ctx: TaskIdentity,
    now_ms: int | None,
    stats: RunStats,
    lease: Lease,
) -> None:
    """Micro-batch 0 of a keyed operator that ran no task then (:func:`_acquire`), run in
    the operator's first task: the initial state applied to the empty version 0, with no
    input and nothing fired, on the clock of the task's batch (``now_ms``). Timers it makes
    due fire in the task's own batch, whose output a retry of the task computes again
    (batch 0's would be lost: its version is committed before the task yields anything).
    It runs in a partition without initial rows too, as batch 0 would have (the operator
    record it writes is in every partition's version 1)."""
    initial = initial_rows(lease.entry.backend.blobs, spec.initial, ctx.partition, 0)
    empty = KeyedInput(
        grouped=spec.key_groups is not None, spill_dir=spill_dir(),
        event_time_column=spec.time.event_time_column,
    )  # fmt: skip
    run = run_processor(
        lease.store, processor, empty, keys=spec.keys, output_schema=spec.output_schema,
        operator=spec.store.operator, batch_id=0, partition=ctx.partition, now_ms=now_ms,
        key_schema=spec.key_schema, stats=stats, key_groups=spec.key_groups, time=spec.time,
        initial=initial, initial_only=True,
    )  # fmt: skip
    for _ in run:  # yields nothing; closes ``empty``
        pass


def arrow_task(spec: TaskSpec, fn: ArrowFunction, batches: Any) -> Iterator[Any]:
    started = time.perf_counter()
    _ask_ahead(spec)
    data_partition, stripped = peek_partition(iter(batches), spec.partitioning)
    ctx = _identity(spec, data_partition)
    lease = _acquire(spec, ctx)
    stats = RunStats()
    try:
        yield from run_arrow(
            lease.store, fn, stripped, output_schema=spec.output_schema,
            operator=spec.store.operator, batch_id=ctx.batch_id, partition=ctx.partition,
            stats=stats, key_groups=spec.key_groups, partitions=spec.store.partitions,
        )  # fmt: skip
        info = _commit(lease.store, spec, ctx)
    except BaseException:
        CACHE.release(lease, ok=False)
        raise
    CACHE.release(lease, ok=True)
    report_task(lease, info, stats, ctx, time.perf_counter() - started)
