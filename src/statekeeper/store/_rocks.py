"""RocksDB as statekeeper opens, reads and writes it, below any one working copy.

- :func:`options`: the options of every working copy, their memory drawn from the process's
  shared budget (:data:`SHARED_MEMORY`) and their compactions on low-priority threads.
- :func:`read_range` and :func:`scan`: the ordered read of items, checked so that it never
  comes out shorter without an error; :func:`checked_items` for readers of a whole database
  other than a store; :func:`read_values`, the values of many keys in one ordered pass
  (dense multi-gets), which never answers a key as absent past an error either.
- :func:`fill_columns` and :func:`fill_pairs`: a commit's changes into a write batch.
- :func:`damaged_tables`: which of some SST files fail their block checksums, read whole
  (before a snapshot uploads them).

:mod:`statekeeper.store._working_copy` builds the labelled copy of one store on these.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import threading
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import rocksdict

from statekeeper.errors import StateKeeperError

__all__ = [
    "SCAN_CHUNK",
    "SHARED_MEMORY",
    "SharedMemory",
    "checked_items",
    "damaged_tables",
    "fill_columns",
    "fill_pairs",
    "options",
    "read_range",
    "read_values",
    "scan",
]

_log = logging.getLogger(__name__)

SCAN_CHUNK = 1024
"""Items a scan reads at a time: no RocksDB iterator outlives a chunk."""


def _prefix_end(prefix: bytes) -> bytes | None:
    """The smallest key above every key that starts with ``prefix`` (``None``: there is
    none, the prefix is empty or all 0xFF)."""
    stem = prefix.rstrip(b"\xff")
    return stem[:-1] + bytes([stem[-1] + 1]) if stem else None


def read_range(
    db: rocksdict.Rdict, start: bytes, upper: bytes | None, limit: int
) -> list[tuple[bytes, bytes]]:
    """Up to ``limit`` items of ``db`` from ``start`` (inclusive) below ``upper``
    (exclusive; ``None``: to the end), in key order: all there are, unless ``limit`` are
    returned. The ordered read of items (scans, whole-database reads), so its check is in
    one place; :func:`read_values` reads values of given keys with RocksDB's own iterator,
    whose ``status()`` it checks directly.

    rocksdict's item iterator ends quietly where RocksDB's iterator meets an error (seen:
    1,476 of 3,000 items and no exception, at a flipped SST byte), so a read shorter than
    ``limit`` is trusted only once a fresh iterator finds nothing after its last item and
    reports no error: a key must never read as absent because a block failed to read.

    Raises:
        RuntimeError: the read stopped early.
        Exception: RocksDB failed the read (rocksdict raises a bare Exception).
    """
    bounded = rocksdict.ReadOptions()
    if upper is not None:
        bounded.set_iterate_upper_bound(upper)
    # Raw mode: bytes keys and values (rocksdict's stubs type them for any mode). The item
    # iterator is never named: a frame that an error keeps alive would keep it, and with it
    # the database, open.
    items = list(
        itertools.islice(
            cast(Iterator[tuple[bytes, bytes]], db.items(from_key=start, read_opt=bounded)),
            limit,
        )
    )
    if len(items) == limit:
        return items
    it = db.iter(bounded)
    try:
        it.seek(items[-1][0] if items else start)
        if items and it.valid():
            it.next()  # past the last item read
        if it.valid():
            raise RuntimeError(
                f"RocksDB's iterator stopped before the end of the range, at {len(items)} "
                "items, with more after them"
            )
        it.status()  # the error the read met, if any
    finally:
        del it
    return items


def read_values(
    db: rocksdict.Rdict, keys: list[bytes], per_key: int, grace: int
) -> tuple[list[bytes | None], int]:
    """The values of ``keys`` (ascending, repeats allowed, not empty) by one ordered pass
    over ``db`` from the first key to the last: the keys merged with the items, no lookup
    per key and no item kept that was not asked for. The pass steps over at most ``grace``
    items plus ``per_key`` for each key it has answered; where it would step over more, the
    keys are too sparse for it and it stops. It returns the values of the keys it answered,
    in order, and their number (all of them unless it stopped: the caller reads the rest
    another way).

    Measured with the pipeline benchmark's keys and 16-byte values: 0.23 µs per item
    stepped over in a compacted database, 0.4-0.6 µs over a few sorted runs (memtable, L0
    files), plus 0.1 µs per key, against 1.25 µs per key for a get; so it pays for keys that
    are a third of the items in their range or more. Half the cost of :func:`read_range`
    and a dictionary of its items.

    RocksDB's iterator becomes invalid at the end of its range and at an error, which
    ``status()`` then raises: keys past the point where it became invalid are answered as
    absent only once it reports none.

    Raises:
        Exception: RocksDB failed the read (rocksdict raises a bare Exception).
    """
    bounded = rocksdict.ReadOptions()
    bounded.set_iterate_upper_bound(keys[-1] + b"\x00")  # exclusive: just above the last
    it: Any = db.iter(bounded)
    # Bound methods keep the iterator alive: all are dropped in ``finally``, so that a
    # traceback keeping this frame does not keep the database open (see read_range).
    valid: Any = None
    key: Any = None
    value: Any = None
    step: Any = None
    try:
        it.seek(keys[0])
        valid, key, value, step = it.valid, it.key, it.value, it.next
        values: list[bytes | None] = []
        append = values.append
        have: bytes | None = key() if valid() else None
        allowance = grace
        for want in keys:
            while have is not None and have < want:
                if not allowance:
                    return values, len(values)
                allowance -= 1
                step()
                have = key() if valid() else None
            append(value() if have == want else None)
            allowance += per_key
        if have is None:
            it.status()  # the error that ended the pass early, if any
        return values, len(values)
    finally:
        it = valid = key = value = step = None


def scan(
    db: rocksdict.Rdict, prefix: bytes, after: bytes | None = None, start: bytes | None = None
) -> Iterator[tuple[bytes, bytes]]:
    """The items of ``db`` whose key starts with ``prefix`` (and is above ``after``, and at
    or above ``start``), in key order, read in chunks of :data:`SCAN_CHUNK`
    (:func:`read_range`).

    Raises:
        RuntimeError, Exception: as :func:`read_range`.
    """
    upper = _prefix_end(prefix)
    first = prefix if start is None or start < prefix else start
    start, skip = (first, None) if after is None or after < first else (after, after)
    while True:
        chunk = read_range(db, start, upper, SCAN_CHUNK + (skip is not None))
        full = len(chunk) == SCAN_CHUNK + (skip is not None)
        if chunk and chunk[0][0] == skip:
            chunk = chunk[1:]
        yield from chunk
        if not full:
            return
        start = skip = chunk[-1][0]


def checked_items(db: rocksdict.Rdict, prefix: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
    """Every item of a raw-mode database whose key starts with ``prefix``, in key order,
    for readers of a whole database other than a store (a rescale, the change feed): the
    store's own ordered read (:func:`scan`), so it never comes out shorter without an
    error, where rocksdict's ``items()`` ends quietly at a damaged block.

    Raises:
        StateKeeperError: RocksDB failed the read.
    """
    read = 0
    try:
        for item in scan(db, prefix):
            yield item
            read += 1
    except Exception as exc:  # rocksdict raises a bare Exception for every failure
        raise StateKeeperError(
            f"reading the RocksDB database {db.path()} failed after {read} items: {exc}"
        ) from exc


class SharedMemory:
    """The RocksDB memory of this process, shared by all its working copies (issue 12).

    One LRU block cache holds the data, index and filter blocks of every open copy, and one
    write-buffer manager charges their memtables against that cache, so RocksDB's memory
    grows with the budget, not with the number of open stores (each store's own 32 MB
    default cache and 64 MB memtable would be 19 GB for 200 stores). The manager never
    stalls writes: a stall waits for *another* store to flush, and an idle store never
    writes again. RocksDB flushes a store over the bound only at its next write, so an
    idle one would keep its memtable; ``WorkingCopy.apply`` also flushes the writing store
    at once when it holds more than its share (see :meth:`over_share`).

    Stores opened with different budgets share the largest: the cache and the manager are
    resized (both through rocksdict's public setters), never shrunk under a store that
    asked for more.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.memory_mb = 0
        self.cache: rocksdict.Cache | None = None
        self.buffers: rocksdict.WriteBufferManager | None = None

    def reserve(self, memory_mb: int) -> tuple[rocksdict.Cache, rocksdict.WriteBufferManager]:
        """The shared cache and write-buffer manager, grown to ``memory_mb`` if smaller."""
        with self._lock:
            if self.cache is None or self.buffers is None:
                self.cache = rocksdict.Cache(memory_mb << 20)
                self.buffers = rocksdict.WriteBufferManager.new_write_buffer_manager_with_cache(
                    self.memtable_bytes(memory_mb), False, self.cache
                )
            elif memory_mb > self.memory_mb:
                _log.info(
                    "RocksDB memory of this process grown from %s MB to %s MB: a store was "
                    "opened with a larger StoreConfig.rocksdb_memory_mb (the largest wins)",
                    self.memory_mb, memory_mb,
                )  # fmt: skip
                self.cache.set_capacity(memory_mb << 20)
                self.buffers.set_buffer_size(self.memtable_bytes(memory_mb))
            self.memory_mb = max(self.memory_mb, memory_mb)
            return self.cache, self.buffers

    @staticmethod
    def memtable_bytes(memory_mb: int) -> int:
        """The memtables' part of a budget: half, as RocksDB's own guidance has it."""
        return (memory_mb << 20) // 2

    def over_share(self, memtable_bytes: int, open_copies: int) -> bool:
        """True if the memtables are over their bound and one holding ``memtable_bytes``
        holds more than its share of it (so flushing that one is worth a small SST file)."""
        buffers = self.buffers
        if buffers is None:
            return False
        bound = buffers.get_buffer_size()
        return buffers.get_usage() > bound and memtable_bytes * max(1, open_copies) >= bound

    def usage(self) -> tuple[int, int]:
        """Bytes held by the shared cache (memtable charges included) and by memtables."""
        if self.cache is None or self.buffers is None:
            return 0, 0
        return self.cache.get_usage(), self.buffers.get_usage()


SHARED_MEMORY = SharedMemory()
"""RocksDB memory shared by the working copies of this process."""


# Commits must not wait for background work (issue 14): a commit's write lands in a memtable
# whatever flushes and compactions are behind. Room for three memtables waiting to be
# flushed (a full memtable never stops writes while the previous one is still being
# written), and level-0 files tolerated far beyond the compaction trigger before RocksDB
# slows writes down (reads check each level-0 file's pinned bloom filter first: cheap).
_MAX_WRITE_BUFFERS = 4
_L0_SLOWDOWN_FILES = 48
_L0_STOP_FILES = 96
# RocksDB writes out its table files a megabyte at a time as it writes them, instead of
# leaving gigabytes of a compaction's output dirty in the page cache: ext4 (ordered mode)
# writes such data out before it commits a journal transaction, so the fsync of a commit's
# changelog waited behind it (p99 at 10M keys: 250-330 ms, all of it fsync).
_BYTES_PER_SYNC = 1 << 20
_env_lock = threading.Lock()
_env: rocksdict.Env | None = None


def damaged_tables(tables: Sequence[Path]) -> list[str]:
    """The names of those of ``tables`` (SST files of one folder) that RocksDB cannot read
    whole: a block whose checksum fails, a file cut short.

    A RocksDB file is checked only when something reads it, and a block no read and no
    compaction touched since it went bad on disk would be uploaded into a snapshot as it
    is, under a checksum of the damaged bytes: committed state lost once GC drops the
    changelogs below that snapshot. RocksDB's public API has no check of one file (rocksdict
    has no ``VerifyChecksum`` nor a table reader), but its repairer reads every table of a
    folder whole and moves each it cannot read to ``lost/``. So the tables are hard-linked
    into a scratch folder beside them (the files are only read: the links leave them as
    they are) and repaired there.

    Raises:
        StateKeeperError: the check itself failed (the scratch folder cannot be made, say).
    """
    if not tables:
        return []
    scratch = tables[0].parent.with_name(f"{tables[0].parent.name}.verify-{uuid.uuid4().hex}")
    try:
        os.mkdir(scratch)
        for table in tables:
            os.link(table, scratch / table.name)
        rocksdict.Rdict.repair(str(scratch), rocksdict.Options(raw_mode=True))
        lost = scratch / "lost"
        refused = sorted(os.listdir(lost)) if lost.is_dir() else []
        return [name for name in refused if not _whole_once_ingested(lost / name, scratch)]
    except Exception as exc:  # rocksdict raises a bare Exception; OSError from the links
        raise StateKeeperError(
            f"cannot check the SST files of {tables[0].parent} before their upload: {exc}"
        ) from exc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def read_checkpoint(path: Path, key: bytes) -> bytes | None:
    """The value of ``key`` in the database checkpointed at ``path``, opened read-only: RocksDB
    opens every table file then and checks it against the MANIFEST (its unique id), so a
    folder holding files of another database (one that replaced the copy's folder under
    a live store, say), which every file's own checksums pass, does not open.

    Raises:
        StateKeeperError: RocksDB cannot open the checkpoint, or read it (the message is
            RocksDB's).
    """
    opts = rocksdict.Options(raw_mode=True)
    try:
        db = rocksdict.Rdict(
            str(path), opts, column_families={"default": opts},
            access_type=rocksdict.AccessType.read_only(False),
        )  # fmt: skip
    except Exception as exc:
        raise StateKeeperError(f"the checkpoint {path} does not open: {exc}") from exc
    try:
        raw = db.get(key)
        return None if raw is None else bytes(raw)
    except Exception as exc:
        raise StateKeeperError(f"the checkpoint {path} cannot be read: {exc}") from exc
    finally:
        db.close()


def _whole_once_ingested(table: Path, scratch: Path) -> bool:
    """Whether ``table``, which the repairer refused, reads whole once ingested into a
    database of its own. The repairer also refuses the intact files of ``SstFileWriter``
    (a rescale ingests them): they name no column family. Ingestion takes only those
    (a database's own files lack its version property), and a full read of the database
    then checks every block of the file."""
    db_path = scratch / f"ingest-{table.name}"
    db = rocksdict.Rdict(str(db_path), rocksdict.Options(raw_mode=True))
    try:
        try:
            db.ingest_external_file([str(table)])
        except Exception:  # noqa: BLE001 - not a file SstFileWriter made: damaged
            return False
        try:
            for _ in checked_items(db):
                pass
        except StateKeeperError:
            return False
        return True
    finally:
        db.close()


def background_env() -> rocksdict.Env:
    """The process's RocksDB environment, its compaction threads at low CPU and I/O
    priority.

    On a machine whose cores the commit shares with RocksDB's compactions (a Spark executor
    runs tasks on every core), a compaction at normal priority takes the core a commit
    waits for; at low priority it takes only what the foreground leaves. Its writes (issued
    by the compaction thread itself: see ``_BYTES_PER_SYNC``) go to the disk at idle I/O
    priority where the scheduler honours one. Flushes (the high pool) keep normal priority:
    they free memtables, which writes need.
    """
    global _env
    with _env_lock:
        if _env is None:
            env = rocksdict.Env()
            env.lower_thread_pool_cpu_priority()
            env.lower_thread_pool_io_priority()
            _env = env
        return _env


_KEEP_INFO_LOGS = 2
_INFO_LOG_BYTES = 1 << 20


def options(*, write_buffer_mb: int, memory_mb: int, write_mb_s: int = 0) -> rocksdict.Options:
    cache, buffers = SHARED_MEMORY.reserve(memory_mb)
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.create_missing_column_families(True)
    opts.set_env(background_env())
    opts.set_write_buffer_size(min(write_buffer_mb << 20, SharedMemory.memtable_bytes(memory_mb)))
    opts.set_write_buffer_manager(buffers)
    opts.set_max_write_buffer_number(_MAX_WRITE_BUFFERS)
    opts.set_level_zero_slowdown_writes_trigger(_L0_SLOWDOWN_FILES)
    opts.set_level_zero_stop_writes_trigger(_L0_STOP_FILES)
    opts.set_bytes_per_sync(_BYTES_PER_SYNC)
    # No memtable bloom filter: it saved 6-15% of a large multi-get's CPU, but its bits (a
    # tenth of write_buffer_mb) are allocated with every memtable, empty or not, so 100 idle
    # stores in a worker held 244 MB of memtable memory against a 128 MB bound
    # (tests/spark/test_memory.py).
    if write_mb_s:  # flushes and compactions (StoreConfig.background_write_mb_s)
        opts.set_ratelimiter(write_mb_s << 20, 100_000, 10)
    opts.set_max_background_jobs(2)
    # RocksDB's info log rolls at every open and keeps 1,000 old logs by default: a store a
    # worker reopened often held 27 MB of them, more than its data.
    opts.set_keep_log_file_num(_KEEP_INFO_LOGS)
    opts.set_max_log_file_size(_INFO_LOG_BYTES)
    opts.set_level_compaction_dynamic_level_bytes(True)
    opts.set_compression_type(rocksdict.DBCompressionType.lz4())
    opts.set_bottommost_compression_type(rocksdict.DBCompressionType.zstd())
    table = rocksdict.BlockBasedOptions()
    table.set_bloom_filter(10, False)
    table.set_block_cache(cache)
    # Index and filter blocks in the shared cache too, or every open SST file holds its
    # own outside any bound; level-0 ones pinned, as they are read on every lookup.
    table.set_cache_index_and_filter_blocks(True)
    table.set_pin_l0_filter_and_index_blocks_in_cache(True)
    opts.set_block_based_table_factory(table)
    return opts


def fill_columns(
    batch: rocksdict.WriteBatch, keys: list[bytes], values: list[bytes | None], deletes: int
) -> None:
    """Add a commit's changes to ``batch``: without deletes, one C-level ``map`` over the
    columns, no Python code per key (about half the time of a loop)."""
    put = batch.put
    if not deletes:
        deque(map(put, keys, values), maxlen=0)
        return
    delete = batch.delete
    for key, value in zip(keys, values, strict=True):
        if value is None:
            delete(key)
        else:
            put(key, value)


def fill_pairs(batch: rocksdict.WriteBatch, pairs: list[tuple[bytes, bytes | None]]) -> None:
    """Add ``(key, value)`` pairs to ``batch`` in order (a key may repeat: the last wins)."""
    put, delete = batch.put, batch.delete
    for key, value in pairs:
        if value is None:
            delete(key)
        else:
            put(key, value)
