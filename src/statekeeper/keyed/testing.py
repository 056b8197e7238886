"""A test harness for stateful processors: run one without Spark, batch by batch.

After Spark 4's ``TwsTester``::

    tester = ProcessorTester(SessionCounter(), keys=["user"], output_schema=schema,
                             time_mode="processing_time")
    tester.processing_time_ms = 1_000
    assert tester.run([{"user": "a"}, {"user": "a"}]) == [{"user": "a", "count": 2}]
    assert tester.timers() == [(("a",), 31_000)]

Each :meth:`ProcessorTester.run` is one micro-batch of one partition: the rows become an
Arrow table and go through :func:`statekeeper.keyed.runner.run_processor`, the very
function a Spark task runs (grouping, late rows, the initial state in the first batch,
``handle_input_rows``, timers, TTL, the operator record), on a real
:class:`~statekeeper.StateStore` in a temporary root, committed after the batch like a task
commits. The processor is deep-copied for every batch, as Spark sends every task a fresh
copy. Needs pyarrow and pandas (not pyspark).
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]

from statekeeper.config import StoreConfig
from statekeeper.keyed._entries import StateEntry, iter_state
from statekeeper.keyed._processor import StatefulProcessor, handles_initial_state
from statekeeper.keyed._timers import iter_timers, validate_delay
from statekeeper.keyed.arrow_keys import encode_keys
from statekeeper.keyed.runner import (
    KEY_GROUP_COLUMN,
    BatchTime,
    RunStats,
    TimeSpec,
    check_initial_columns,
    run_processor,
)
from statekeeper.store import StateBackend, StateStore

__all__ = ["ProcessorTester"]

_OPERATOR = "tester"


class ProcessorTester:
    """Runs a :class:`StatefulProcessor` on lists of rows, one micro-batch per call.

    Attributes:
        processing_time_ms: the batch timestamp of the next :meth:`run` (TTL, processing-time
            timers); settable.
        watermark_ms: the watermark of the next :meth:`run`; ``None`` (the default) derives
            it as Spark does from the event times of earlier batches and the delay. Rows are
            late against the watermark the previous run used (set or derived), as in Spark.
        stats: the counters of the last batch (rows in and out, late rows, timers fired).
    """

    def __init__(
        self,
        processor: StatefulProcessor,
        *,
        keys: str | Sequence[str],
        output_schema: Any,
        time_mode: str | None = None,
        event_time_column: str | None = None,
        watermark_delay: float = 0,
        directory: str | Path | None = None,
        initial_state: Sequence[Mapping[str, Any]] | Any = None,
    ) -> None:
        """Set up an empty operator state.

        Args:
            processor: the processor to test (deep-copied per batch).
            keys: the grouping key column(s).
            output_schema: a ``pyarrow.Schema`` of the rows the processor yields.
            time_mode: ``None``, ``"processing_time"`` or ``"event_time"``.
            event_time_column: with event time, the timestamp column of event times.
            watermark_delay: seconds (or a timedelta) the watermark trails event time.
            directory: where the root and working copy live; a temporary one by default.
            initial_state: the operator's initial state, dicts or a ``pyarrow.Table`` with
                the key columns: the first :meth:`run` (batch 0) hands each key's rows to
                ``handle_initial_state`` before its input, later runs ignore it.

        Raises:
            TypeError: not a processor, or a schema that is not a ``pyarrow.Schema``.
            ValueError: an invalid combination of time arguments, a negative delay, an
                initial state without the key columns, or one given to a processor that
                does not define ``handle_initial_state``.
        """
        if not isinstance(processor, StatefulProcessor):
            raise TypeError(f"processor must be a StatefulProcessor, got {type(processor)}")
        if not isinstance(output_schema, pa.Schema):
            raise TypeError(f"output_schema must be a pyarrow.Schema, got {output_schema!r}")
        self._processor = processor
        self._keys = [keys] if isinstance(keys, str) else list(keys)
        self._schema = output_schema
        delay = validate_delay(watermark_delay)
        self._time = TimeSpec(time_mode, event_time_column, delay)
        self._owned = directory is None
        self._dir = Path(tempfile.mkdtemp(prefix="sk-tester-") if directory is None else directory)
        config = StoreConfig(local_dir=str(self._dir / "local"))
        self._backend = StateBackend(str(self._dir / "root"), config=config)
        self._backend.register(_OPERATOR, 1)
        meta = self._backend.root_metadata()
        assert meta is not None  # just registered
        # The operator's key groups as its root records them: a directory the tester wrote
        # then reads (inspect, verify) and runs on (a task) as any other root would.
        self._key_groups = meta.key_groups[_OPERATOR]
        try:
            self._initial = self._initial_table(initial_state)
        except BaseException:
            self.close()
            raise
        self.processing_time_ms = 0
        self.watermark_ms: int | None = None
        self.stats = RunStats()

    def __enter__(self) -> ProcessorTester:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Release the store (and delete the temporary directory)."""
        self._backend.close()
        if self._owned:
            shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def batch_id(self) -> int:
        """The micro-batch the next :meth:`run` is (the committed version)."""
        with self._open() as store:
            return store.version

    def run(self, rows: Sequence[Mapping[str, Any]] | Any, *, schema: Any = None) -> list[Any]:
        """Run one micro-batch over ``rows`` and commit it; returns the emitted rows as dicts.

        Args:
            rows: dicts (column -> value) or a ``pyarrow.Table``; may be empty (timers fire).
            schema: the input's ``pyarrow.Schema`` (inferred from the dicts if ``None``).

        Raises:
            OutputSchemaError: the processor yields rows that do not match the schema.
            Exception: whatever the processor raises (nothing is committed then).
        """
        table = rows if isinstance(rows, pa.Table) else _table(rows, schema)
        table = _with_key_groups(table, self._keys, self._key_groups)
        self.stats = RunStats()
        with self._open() as store:
            batches = run_processor(
                store, copy.deepcopy(self._processor), table, keys=self._keys,
                output_schema=self._schema, operator=_OPERATOR, batch_id=store.version,
                partition=0, now_ms=self.processing_time_ms, stats=self.stats,
                key_groups=self._key_groups, time=self._time,
                batch=BatchTime(watermark_ms=self.watermark_ms), initial=self._initial,
            )  # fmt: skip
            try:
                out = [row for batch in batches for row in batch.to_pylist()]
            except BaseException:
                store.abort()
                raise
            store.commit()
        return out

    def state(self, name: str | None = None) -> list[StateEntry]:
        """Every committed state entry (or those of state ``name``), decoded, in key order."""
        with self._open() as store:
            return list(iter_state(store, state=name, allow_pickle=True))

    def timers(self) -> list[tuple[tuple[Any, ...], int]]:
        """Every registered timer as (key, expiry ms), in order of expiry."""
        with self._open() as store:
            return [(t.key, t.expiry_ms) for t in iter_timers(store)]

    def _open(self) -> StateStore:
        return self._backend.open(_OPERATOR, 0)

    def _initial_table(self, rows: Sequence[Mapping[str, Any]] | Any) -> Any:
        """The initial state as the runner takes it (key groups added), checked."""
        if rows is None:
            return None
        if not handles_initial_state(self._processor):
            raise ValueError(
                f"an initial state was given, but {type(self._processor).__name__} does not "
                "define handle_initial_state: nothing would apply it"
            )
        table = rows if isinstance(rows, pa.Table) else _table(rows, None)
        check_initial_columns(table.column_names, self._keys)
        return _with_key_groups(table, self._keys, self._key_groups)


def _table(rows: Sequence[Mapping[str, Any]], schema: Any) -> Any:
    if not rows and schema is None:
        return pa.table({})
    return pa.Table.from_pylist(list(rows), schema=schema)


def _with_key_groups(table: Any, keys: list[str], key_groups: int) -> Any:
    """Tag each row with a key group, as Spark does (any stable function of the key will
    do: one partition owns them all)."""
    if table.num_rows == 0:
        return table
    encoded = encode_keys([table.column(k) for k in keys])
    groups = pa.array([zlib.crc32(k) % key_groups for k in encoded], pa.int32())
    return table.append_column(KEY_GROUP_COLUMN, groups)
