"""A partition's input grouped with bounded memory: runs spilled by key group, chunks of whole
key groups, every key's rows in arrival order; a run over spilled input equals one over the
same input in memory, and holds one chunk of Python rows at a time, not the partition."""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from statekeeper import StateBackend, StoreConfig
from statekeeper.keyed import StatefulProcessor, StatefulProcessorHandle
from statekeeper.keyed._layout import META_KEY
from statekeeper.keyed.grouping import KEY_GROUP_COLUMN, KeyedInput, sweep_dead_spills
from statekeeper.keyed.runner import RunStats, TimeSpec, run_processor

GROUPS = 64
OUT = pa.schema([("k", pa.string()), ("n", pa.int64()), ("first", pa.int64())])


def _batches(rows: int, keys: int, per_batch: int, seed: int = 3) -> list[pa.RecordBatch]:
    """Rows ``(k, seq, kg)``: ``seq`` is the arrival position, ``kg`` a function of ``k``."""
    ids = np.random.default_rng(seed).integers(0, keys, rows)
    table = pa.table(
        {
            "k": pa.array([f"key-{i}" for i in ids.tolist()], pa.string()),
            "seq": pa.array(np.arange(rows), pa.int64()),
            KEY_GROUP_COLUMN: pa.array((ids * 7919) % GROUPS, pa.int32()),
        }
    )
    return table.to_batches(max_chunksize=per_batch)


def test_spilled_chunks_hold_whole_keys_in_arrival_order(tmp_path: Path) -> None:
    batches = _batches(rows=20_000, keys=3_000, per_batch=1_000)
    source = KeyedInput(grouped=True, spill_bytes=50_000, spill_dir=str(tmp_path))
    for batch in batches:
        source.add(batch)
    assert source.runs_spilled >= 5
    assert source.num_rows == 20_000
    assert len(os.listdir(tmp_path)) == 1  # one temporary folder of runs
    chunks = list(source.chunks())
    assert os.listdir(tmp_path) == []  # the runs are deleted once read
    seen_keys: set[str] = set()
    last_group = -1
    for chunk in chunks:
        groups = chunk.column(KEY_GROUP_COLUMN).to_pylist()
        assert min(groups) > last_group  # contiguous key-group ranges, in order
        last_group = max(groups)
        by_key: dict[str, list[int]] = {}
        for k, seq in zip(chunk["k"].to_pylist(), chunk["seq"].to_pylist(), strict=True):
            by_key.setdefault(k, []).append(seq)
        assert seen_keys.isdisjoint(by_key)  # a key never spans two chunks
        seen_keys |= set(by_key)
        assert all(seqs == sorted(seqs) for seqs in by_key.values())  # arrival order
    assert sum(c.num_rows for c in chunks) == 20_000
    assert len(chunks) > 1
    # A chunk is about one input batch (1,000 rows, at least 1,024) plus one key group.
    assert max(c.num_rows for c in chunks) < 2 * 1_024 + 2 * 20_000 // GROUPS


def test_an_unspilled_input_is_one_chunk_when_small() -> None:
    table = pa.Table.from_batches(_batches(rows=500, keys=50, per_batch=100))
    source = KeyedInput.of(table, grouped=True)
    chunks = list(source.chunks())
    assert source.runs_spilled == 0
    assert len(chunks) == 1
    assert sorted(chunks[0].column("seq").to_pylist()) == list(range(500))


def test_the_largest_event_time_is_taken_as_batches_arrive() -> None:
    times = pa.array([5_000, None, 9_000_000], pa.timestamp("us"))
    table = pa.table({"k": ["a", "b", "c"], "t": times})
    source = KeyedInput.of(table, grouped=False, event_time_column="t")
    assert source.max_event_ms == 9_000
    with pytest.raises(TypeError, match="must be a timestamp, found string"):
        KeyedInput.of(table, grouped=False, event_time_column="k")


class FirstAndCount(StatefulProcessor):
    """Per key: a running count, and the arrival position of the key's first row ever."""

    rows = "row"

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.state = handle.value_state("s")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        n, first = self.state.get() or (0, rows[0].seq)
        assert [r.seq for r in rows] == sorted(r.seq for r in rows)
        n += len(rows)
        self.state.update((n, first))
        yield (key[0], n, first)


def _run(backend: StateBackend, operator: str, table: Any) -> tuple[list[Any], RunStats]:
    stats = RunStats()
    backend.register(operator, 1)
    with backend.open(operator, 0) as store:
        out = run_processor(
            store, FirstAndCount(), table, keys=["k"], output_schema=OUT, operator=operator,
            batch_id=store.version, partition=0, now_ms=0, stats=stats,
            key_groups=GROUPS, time=TimeSpec(),
        )  # fmt: skip
        rows = [r for batch in out for r in batch.to_pylist()]
        store.commit()
    return rows, stats


def test_a_run_over_spilled_input_equals_one_over_the_table(tmp_path: Path) -> None:
    """One operator gets the input in memory, another spilled: the same output rows, twice
    (the second batch reads the state the first committed), and the same state."""
    config = StoreConfig(local_dir=str(tmp_path / "local"))
    with StateBackend(str(tmp_path / "root"), config=config) as backend:
        for seed in (1, 2):
            batches = _batches(rows=6_000, keys=900, per_batch=500, seed=seed)
            whole, _ = _run(backend, "mem", pa.Table.from_batches(batches))
            source = KeyedInput(grouped=True, spill_bytes=20_000, spill_dir=str(tmp_path / "s"))
            for batch in batches:
                source.add(batch)
            spilled, stats = _run(backend, "spill", source)
            assert source.runs_spilled > 2
            assert sorted(map(tuple, map(dict.values, whole))) == sorted(
                map(tuple, map(dict.values, spilled))
            )
            assert stats.rows_in == 6_000
            assert stats.keys == len(spilled)
        assert os.listdir(tmp_path / "s") == []
        with backend.open("mem", 0) as mem, backend.open("spill", 0) as spill:
            entries = [e for e in mem.scan() if e[0] != META_KEY]
            assert entries == [e for e in spill.scan() if e[0] != META_KEY]
            assert len(entries) > 800


def test_python_rows_are_made_one_chunk_at_a_time(tmp_path: Path) -> None:
    """The Row form builds Python rows per chunk: the Python heap's peak during a run over
    100,000 rows stays far below what the partition's rows take at once as Python objects."""
    batches = _batches(rows=100_000, keys=20_000, per_batch=2_000)
    tracemalloc.start()
    try:
        every_row = pa.Table.from_batches(batches).to_pylist()
        _, whole = tracemalloc.get_traced_memory()
        del every_row
        config = StoreConfig(local_dir=str(tmp_path / "local"))
        with StateBackend(str(tmp_path / "root"), config=config) as backend:
            backend.register("op", 1)
            source = KeyedInput(grouped=True, spill_bytes=1 << 20, spill_dir=str(tmp_path))
            for batch in batches:
                source.add(batch)
            with backend.open("op", 0) as store:
                tracemalloc.reset_peak()
                out = run_processor(
                    store, FirstAndCount(), source, keys=["k"], output_schema=OUT,
                    operator="op", batch_id=0, partition=0, now_ms=0, key_groups=GROUPS,
                )  # fmt: skip
                emitted = sum(batch.num_rows for batch in out)
                _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert source.runs_spilled > 1
    assert emitted > 15_000  # one row per key
    # The store's uncommitted writes (one per key) stay in the heap; the rows do not.
    assert peak < whole / 3, f"peak {peak / 2**20:.1f} MiB, every row {whole / 2**20:.1f} MiB"


def test_the_spill_folders_of_workers_that_ended_are_swept(tmp_path: Path) -> None:
    """A worker killed mid-task (by Spark, or by the kernel for its memory) never deletes
    its spilled input; the folders stayed until the executor went away."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    dead = tmp_path / f"sk-spill-{int(ended.stdout)}-abc"
    mine = tmp_path / f"sk-spill-{os.getpid()}-def"
    older = tmp_path / "sk-spill-x1y2"  # named before folders carried their pid: kept
    for folder in (dead, mine, older):
        folder.mkdir()
        (folder / "run-0.arrow").write_bytes(b"rows")
    assert sweep_dead_spills(str(tmp_path)) == [str(dead)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, older.name])
    source = KeyedInput(grouped=True, spill_bytes=1, spill_dir=str(tmp_path))
    for batch in _batches(rows=100, keys=10, per_batch=50):
        source.add(batch)
    assert source.runs_spilled >= 1
    spilled = [p for p in tmp_path.iterdir() if p.name not in (mine.name, older.name)]
    assert [p.name.split("-")[2] for p in spilled] == [str(os.getpid())]  # named by pid
    assert sweep_dead_spills(str(tmp_path)) == []  # this process runs: its folder stays
    source.close()
