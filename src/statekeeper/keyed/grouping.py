"""A partition's input, grouped by key with bounded memory: runs spilled by key group, then
handed out in chunks of whole key groups.

A keyed processor sees each key's rows of the micro-batch at once, so nothing can run before
the whole input is read (a key's last row may come last; and with event time the handle
needs the batch's largest event time before the first key). Spark would sort a partition
on the JVM side before handing it over, but refuses ``sortWithinPartitions`` on a streaming
DataFrame ("Sorting is not supported on streaming DataFrames/Datasets"), so the grouping is
done here, as an external sort:

* :meth:`KeyedInput.add` keeps the incoming Arrow batches; when they exceed ``spill_bytes``
  they are sorted by key group (stable: arrival order within a key group is kept) and
  written to a local file as one Arrow IPC **run**; the file is read back memory-mapped, so
  a run costs page cache, not heap.
* :meth:`KeyedInput.chunks` cuts the key groups into contiguous ranges of about
  ``chunk_rows`` rows (one Arrow batch of the input; a key group is never split), and for
  each range concatenates every run's slice in run order (arrival order again): a chunk
  holds every row of its keys. :class:`Grouped` then sorts a chunk by key (stable) and
  converts only that chunk to pandas or Python rows.

So the heap holds at most ``spill_bytes`` of Arrow input plus one chunk (the largest key
group's rows, if it is larger than a chunk) and its pandas or Python form, instead of the
whole partition in Python objects. An input that fits ``spill_bytes`` never touches disk.
Keys are handed out in key order within a chunk and chunks in key-group order; an input of
one chunk is therefore in plain key order. Without key groups (an operator of statekeeper
0.1) the input is one chunk, kept in memory, as before.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd  # type: ignore[import-untyped]
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]

from statekeeper.keyed._pandas import frame_of
from statekeeper.keyed._row_type import build_rows
from statekeeper.keyed.arrow_keys import encode_keys

__all__ = ["KEY_GROUP_COLUMN", "Grouped", "KeyedInput", "iter_groups", "sweep_dead_spills"]

KEY_GROUP_COLUMN = "__statekeeper_key_group"
"""The input column that carries each row's key group (dropped before the processor)."""

_SPILL_PREFIX = "sk-spill-"
"""Spill folders are ``<spill dir>/sk-spill-<pid>-<random>``: the pid of the worker whose
runs they hold, so that the folders of one killed before its ``close`` can be told."""
SPILL_BYTES = 64 * 1024 * 1024
"""Arrow bytes of input a task holds in memory before it spills them as a sorted run."""
MIN_CHUNK_ROWS = 1024
"""Chunks are at least this many rows (tiny input batches would make tiny chunks)."""


def iter_groups(table: Any, keys: Sequence[str]) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Split ``table`` into (key tuple, pandas DataFrame of that key's rows), in key order.

    Rows keep their arrival order within a key (the sort is stable). Nulls form their own
    key, and so do NaNs, as in Spark's grouping. A key-group column is dropped.
    """
    grouped = Grouped.of(table, keys, grouped=KEY_GROUP_COLUMN in table.column_names)
    if grouped is not None:
        yield from zip(grouped.keys, grouped.frames(), strict=True)


@dataclass
class Grouped:
    """A table sorted by its keys: the key tuples, and where each key's rows start."""

    ordered: Any
    starts: Any
    keys: list[tuple[Any, ...]]
    encoded: list[bytes]
    groups: list[int] | None
    """Each key's key group (``None``: the operator has none)."""

    @classmethod
    def of(cls, table: Any, keys: Sequence[str], *, grouped: bool = False) -> Grouped | None:
        """Sort ``table`` by ``keys`` (stable); ``None`` if it has no rows. With ``grouped``,
        each key's key group is read from :data:`KEY_GROUP_COLUMN`, which is then dropped
        (the processor never sees it)."""
        if table.num_rows == 0:
            return None
        # Nulls sort last by default; NaNs just before them.
        order = pc.sort_indices(table, sort_keys=[(k, "ascending") for k in keys])
        ordered = table.take(order)
        starts = _group_starts(ordered, keys)
        at = pa.array(starts)
        groups = None
        if grouped:
            groups = ordered.column(KEY_GROUP_COLUMN).take(at).to_pylist()
            ordered = ordered.drop_columns([KEY_GROUP_COLUMN])
        arrays = [ordered.column(k).take(at) for k in keys]
        columns = [array.to_pylist() for array in arrays]
        keyed = list(zip(*columns, strict=True))
        return cls(ordered, starts, keyed, encode_keys(arrays), groups)

    def bounds(self) -> list[int]:
        """``bounds[i]:bounds[i + 1]`` are the rows of key ``i``."""
        return [*self.starts.tolist(), self.ordered.num_rows]

    def frames(self) -> Iterator[Any]:
        """One pandas DataFrame per key, in key order: slices of one frame (with Spark's
        pandas values, :mod:`statekeeper.keyed._pandas`), cut by a pandas groupby on the
        (already sorted) group numbers, which is cheaper than ``iloc``."""
        frame = frame_of(self.ordered)
        bounds = self.bounds()
        sizes = np.diff(np.asarray(bounds))
        groups = np.repeat(np.arange(len(sizes)), sizes)
        # pandas has no null for an integer or boolean dtype: a column with a null becomes
        # float64 (losing integers beyond 2**53) or object. As in Spark, which converts
        # each key's rows on their own, only the keys with a null get that dtype: the others'
        # rows of such a column are converted again, by themselves.
        redo = [
            (name, column)
            for name, column in zip(self.ordered.column_names, self.ordered.columns, strict=True)
            if column.null_count
            and (pa.types.is_integer(column.type) or pa.types.is_boolean(column.type))
        ]
        for i, (_, rows) in enumerate(frame.groupby(groups, sort=False)):
            if redo:
                start, size = bounds[i], bounds[i + 1] - bounds[i]
                parts = {name: column.slice(start, size) for name, column in redo}
                exact = {
                    name: pd.Series(part.to_pandas().to_numpy(), index=rows.index)
                    for name, part in parts.items()
                    if not part.null_count
                }
                if exact:
                    rows = rows.assign(**exact)
            yield rows

    def rows(self) -> Iterator[list[Any]]:
        """One list of lightweight rows per key, in key order."""
        columns = [column.to_pylist() for column in self.ordered.columns]
        every = build_rows(self.ordered.column_names, columns)
        bounds = self.bounds()
        for i in range(len(bounds) - 1):
            yield every[bounds[i] : bounds[i + 1]]


def _group_starts(table: Any, keys: Sequence[str]) -> Any:
    """Row indices where a new key starts in a table sorted by ``keys``."""
    n = table.num_rows
    change = np.zeros(max(n - 1, 0), dtype=bool)
    for k in keys:
        column = table.column(k).combine_chunks()
        after, before = column.slice(1), column.slice(0, n - 1)
        differs = pc.fill_null(pc.not_equal(after, before), False)
        differs = pc.or_(differs, pc.xor(pc.is_null(after), pc.is_null(before)))
        if pa.types.is_floating(column.type):
            both_nan = pc.fill_null(pc.and_(pc.is_nan(after), pc.is_nan(before)), False)
            differs = pc.and_(differs, pc.invert(both_nan))
        change |= differs.to_numpy(zero_copy_only=False)
    return np.concatenate([[0], np.flatnonzero(change) + 1]).astype(np.int64)


def event_times_ms(column: Any) -> Any:
    """An Arrow timestamp column as int64 ms since the epoch (rounded down).

    Raises:
        TypeError: not a timestamp column.
    """
    if not pa.types.is_timestamp(column.type):
        raise TypeError(f"the event-time column must be a timestamp, found {column.type}")
    raw = column.cast(pa.int64())
    unit = column.type.unit
    if unit == "ms":
        return raw
    if unit == "s":
        return pc.multiply(raw, 1000)
    per_ms = 1000.0 if unit == "us" else 1_000_000.0
    return pc.floor(pc.divide(raw.cast(pa.float64()), per_ms)).cast(pa.int64())


@dataclass
class _Run:
    """Rows sorted by key group, and how many rows each key group has."""

    table: Any
    counts: Any  # np.ndarray of int64, indexed by key group

    @classmethod
    def of(cls, batches: list[Any]) -> _Run:
        table = pa.Table.from_batches(batches)
        groups = table.column(KEY_GROUP_COLUMN)
        order = pc.sort_indices(groups)  # stable: arrival order within a key group
        ordered = table.take(order)
        raw = ordered.column(KEY_GROUP_COLUMN).to_numpy()
        return cls(ordered, np.bincount(raw.astype(np.int64, copy=False)))

    def offsets(self, size: int) -> Any:
        """Row offsets of key groups ``0..size`` (``offsets[g]:offsets[g + 1]`` is group g)."""
        counts = np.zeros(size, np.int64)
        counts[: len(self.counts)] = self.counts
        return np.concatenate([[0], np.cumsum(counts)])


@dataclass
class KeyedInput:
    """One partition's input of a micro-batch, grouped by key with bounded memory (see the
    module docstring). Add every batch, then read :meth:`chunks` once.

    Attributes:
        grouped: whether rows carry :data:`KEY_GROUP_COLUMN` (spilled and chunked by it).
        spill_bytes: Arrow bytes held in memory before a run is spilled.
        spill_dir: where runs are written (a temporary folder inside it); ``None``: the
            system's temporary folder.
        event_time_column: a timestamp column whose largest value (ms) is
            :attr:`max_event_ms`, computed as batches arrive (before any row is dropped).
    """

    grouped: bool
    spill_bytes: int = SPILL_BYTES
    spill_dir: str | None = None
    event_time_column: str | None = None
    num_rows: int = 0
    max_event_ms: int | None = None
    runs_spilled: int = 0
    _pending: list[Any] = field(default_factory=list)
    _pending_bytes: int = 0
    _runs: list[_Run] = field(default_factory=list)
    _folder: str | None = None
    _chunk_rows: int = MIN_CHUNK_ROWS

    @classmethod
    def of(cls, table: Any, *, grouped: bool, event_time_column: str | None = None) -> KeyedInput:
        """An input holding ``table`` (in memory).

        Raises:
            TypeError: the event-time column is not a timestamp.
            KeyError: it is missing.
        """
        made = cls(
            grouped=grouped, spill_bytes=max(table.nbytes, 1) * 2,
            event_time_column=event_time_column,
        )  # fmt: skip
        for batch in table.to_batches():
            made.add(batch)
        return made

    def add(self, batch: Any) -> None:
        """Take one Arrow batch of input (every batch has the same schema); spill what is
        held once it exceeds :attr:`spill_bytes`.

        Raises:
            OSError: a run could not be written.
            TypeError: the event-time column is not a timestamp.
            KeyError: it is missing.
        """
        if batch.num_rows == 0:
            return
        if self.event_time_column is not None:
            found = pc.max(event_times_ms(batch.column(self.event_time_column))).as_py()
            if found is not None:
                top = self.max_event_ms
                self.max_event_ms = found if top is None else max(top, found)
        self.num_rows += batch.num_rows
        self._chunk_rows = max(self._chunk_rows, batch.num_rows)
        self._pending.append(batch)
        self._pending_bytes += batch.nbytes
        if self.grouped and self._pending_bytes > self.spill_bytes:
            self._spill()

    def _spill(self) -> None:
        run = _Run.of(self._pending)
        self._pending, self._pending_bytes = [], 0
        if self._folder is None:
            base = self.spill_dir
            if base is not None:
                os.makedirs(base, exist_ok=True)
            self._folder = tempfile.mkdtemp(prefix=f"{_SPILL_PREFIX}{os.getpid()}-", dir=base)
        path = os.path.join(self._folder, f"run-{len(self._runs)}.arrow")
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, run.table.schema) as writer:
            writer.write_table(run.table)
        # Read back memory-mapped: the run's rows live in the page cache, not the heap.
        mapped = pa.ipc.open_file(pa.memory_map(path)).read_all()
        self._runs.append(_Run(mapped, run.counts))
        self.runs_spilled += 1

    def chunks(self) -> Iterator[Any]:
        """Tables of whole key groups (all rows of their keys, in arrival order), about one
        input batch each; then the spilled runs are deleted. Not sorted by key."""
        try:
            if not self.grouped:
                if self._pending:
                    yield pa.Table.from_batches(self._pending)
                return
            if self._pending:
                self._runs.append(_Run.of(self._pending))
                self._pending = []
            yield from self._chunked()
        finally:
            self.close()

    def _chunked(self) -> Iterator[Any]:
        if not self._runs:
            return
        size = max(len(r.counts) for r in self._runs)
        offsets = [r.offsets(size) for r in self._runs]
        total = sum(o[1:] - o[:-1] for o in offsets)
        for low, high in _ranges(total, self._chunk_rows):
            parts = [
                r.table.slice(o[low], o[high] - o[low])
                for r, o in zip(self._runs, offsets, strict=True)
                if o[high] > o[low]
            ]
            yield parts[0] if len(parts) == 1 else pa.concat_tables(parts)

    def close(self) -> None:
        """Drop what is held and delete the spilled runs (idempotent)."""
        self._pending, self._runs = [], []
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


def sweep_dead_spills(spill_dir: str | None) -> list[str]:
    """Delete the spill folders in ``spill_dir`` (``None``: the system's temporary folder)
    of processes that no longer run (a worker killed by Spark or by the kernel mid-task
    never deletes its own); returns those deleted."""
    base = tempfile.gettempdir() if spill_dir is None else spill_dir
    try:
        names = os.listdir(base)
    except OSError:
        return []
    removed = []
    for name in names:
        pid_text = name[len(_SPILL_PREFIX) :].partition("-")[0]
        if not name.startswith(_SPILL_PREFIX) or not pid_text.isdigit():
            continue  # not a spill folder, or one from before folders named their pid
        if _alive(int(pid_text)):
            continue
        shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        removed.append(os.path.join(base, name))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: running
    return True


def _ranges(counts: Any, target: int) -> Iterator[tuple[int, int]]:
    """Contiguous key-group ranges ``[low, high)`` of at least ``target`` rows each (the
    last may hold fewer), skipping empty groups at the edges."""
    ends = np.cumsum(counts)
    low, done = 0, 0
    while done < ends[-1]:
        # The first group at which the range reaches the target (or the last group).
        high = int(np.searchsorted(ends, done + target, side="left")) + 1
        high = min(high, len(counts))
        yield low, high
        low, done = high, int(ends[high - 1])
