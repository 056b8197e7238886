"""Configuration of a state backend: one frozen, keyword-only dataclass."""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from typing import Literal

__all__ = ["Compression", "Mode", "StoreConfig"]

Mode = Literal["changelog", "snapshot"]
Compression = Literal["zstd", "none"]

_MODES = ("changelog", "snapshot")
_COMPRESSIONS = ("zstd", "none")
# A changelog part's body: 64 bytes at least (tests use small parts), 2 GiB at most (the
# changelog format's bound on one body).
_MIN_PART_BYTES = 64
_MAX_PART_BYTES = 2**31
# Upper bounds that no machine reaches, so that a typo fails here and not as an overflow
# deep in RocksDB or a MemoryError mid-upload: a chunk is one PUT (S3 takes at most 5 GiB
# in one); RocksDB's memory settings count bytes in 64 bits, far above a terabyte.
_MAX_CHUNK_BYTES = 5 * 2**30
_MAX_MB = 2**20
_MAX_IO_THREADS = 1024


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """How stores of a backend commit, snapshot, retain and transfer state.

    Every field is checked when the config is made; a wrong one raises ``ValueError`` (or
    ``TypeError`` for ``local_dir``) naming the field, the form expected and the value found.

    Attributes:
        mode: ``"changelog"`` (default): every commit uploads a changelog of its puts and
            deletes; ``"snapshot"``: every commit is an incremental snapshot. Both modes read
            both formats, so switching keeps all state.
        snapshot_every: versions between background snapshots in changelog mode.
        retain_versions: how many of the newest versions stay restorable.
        orphan_ttl_s: grace period before a blob that no committed version references may be
            deleted by garbage collection.
        chunk_size: largest blob a snapshot file is split into, in bytes (at most 5 GiB,
            the most S3 takes in one upload).
        io_threads: parallel transfers per call (uploads, downloads), at most 1024.
        compression: changelog body compression, ``"zstd"`` or ``"none"``.
        compression_level: zstd level for changelog bodies. The default, 1, compresses
            framed changes to within 1% of level 3's size (measured on 10,000 records of
            random and of JSON values) in a third of its time, on the commit path.
        local_dir: folder holding the local RocksDB working copies; ``None`` means a
            ``statekeeper`` folder in the system temp dir.
        local_checkpoint_interval_s: at most this many seconds between durable flushes of a
            local working copy; bounds how far a hard crash can set the local copy back
            (it is then caught up from the changelogs).
        write_buffer_mb: largest RocksDB memtable of one working copy (at most half of
            ``rocksdb_memory_mb`` is used). This and the other sizes in MiB go up to 2**20
            (1 TiB).
        background_write_mb_s: most bytes per second (in MiB) RocksDB's flushes and
            compactions of one working copy write; 0: no limit. Unlimited, a compaction
            (after a bulk load, say) fills the disk queue that the fsync of a commit's
            changelog then waits behind when the root is on the same disk: commit p99 at
            10M keys was 196 ms unlimited, 111 ms at 32 and 77 ms at 24, with the load of
            the 10M keys 48, 50 and 75 s. Raise it for a store that writes more than
            about 2 MiB/s for long: leveled compaction rewrites each byte about ten times.
        rocksdb_memory_mb: RocksDB memory of one process, shared by every working copy it
            opens: one block cache of this size holds data, index and filter blocks, and
            memtables are charged against it, up to half of it; a commit that leaves the
            memtables above that half flushes its own store's memtable if it holds more
            than its share. Stores opened in one process with different values share the
            largest.
        max_open_stores: Spark layer: most stores a Python worker keeps open between tasks;
            when more are open, the least recently used idle ones are closed (their working
            copies stay on disk for the next task).
        local_copy_ttl_s: Spark layer: a Python worker deletes the working copies of the
            roots it serves that no task has used for this long (a partition that moved to
            another executor); never one that is open or locked by a process. Copies set
            aside as damaged go this long after they were.
        metrics_every: most commits whose metrics (latency, bytes, records) a store
            buffers before writing them as one commit-metrics blob; a snapshot or closing
            the store writes them sooner.
        changelog_part_bytes: largest uncompressed body of one part of a changelog: a
            commit whose changes frame to more is written (and replayed) a part at a time,
            so its size is unbounded and the memory it takes beyond the changes is a few
            parts. Readers take any part size.
    """

    mode: Mode = "changelog"
    snapshot_every: int = 10
    retain_versions: int = 100
    orphan_ttl_s: float = 7 * 24 * 3600.0
    chunk_size: int = 64 * 1024 * 1024
    io_threads: int = 8
    compression: Compression = "zstd"
    compression_level: int = 1
    local_dir: str | None = None
    local_checkpoint_interval_s: float = 60.0
    write_buffer_mb: int = 16
    background_write_mb_s: int = 24
    rocksdb_memory_mb: int = 256
    max_open_stores: int = 256
    local_copy_ttl_s: float = 24 * 3600.0
    metrics_every: int = 10
    changelog_part_bytes: int = 16 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"StoreConfig.mode must be one of {_MODES}, got {self.mode!r}")
        if self.compression not in _COMPRESSIONS:
            raise ValueError(
                f"StoreConfig.compression must be one of {_COMPRESSIONS}, got {self.compression!r}"
            )
        _int_at_least("snapshot_every", self.snapshot_every)
        _int_at_least("metrics_every", self.metrics_every)
        if not isinstance(self.changelog_part_bytes, int) or not (
            _MIN_PART_BYTES <= self.changelog_part_bytes <= _MAX_PART_BYTES
        ):
            raise ValueError(
                f"StoreConfig.changelog_part_bytes must be an int in [{_MIN_PART_BYTES}, "
                f"{_MAX_PART_BYTES}], got {self.changelog_part_bytes!r}"
            )
        _int_at_least("retain_versions", self.retain_versions)
        _int_at_least("chunk_size", self.chunk_size, high=_MAX_CHUNK_BYTES)
        _int_at_least("io_threads", self.io_threads, high=_MAX_IO_THREADS)
        _int_at_least("write_buffer_mb", self.write_buffer_mb, high=_MAX_MB)
        _int_at_least("background_write_mb_s", self.background_write_mb_s, low=0, high=_MAX_MB)
        _int_at_least("rocksdb_memory_mb", self.rocksdb_memory_mb, high=_MAX_MB)
        _int_at_least("max_open_stores", self.max_open_stores)
        if (
            isinstance(self.compression_level, bool)
            or not isinstance(self.compression_level, int)
            or not 1 <= self.compression_level <= 22
        ):
            raise ValueError(
                f"StoreConfig.compression_level must be an int in [1, 22], "
                f"got {self.compression_level!r}"
            )
        _non_negative("orphan_ttl_s", self.orphan_ttl_s)
        _non_negative("local_checkpoint_interval_s", self.local_checkpoint_interval_s)
        _non_negative("local_copy_ttl_s", self.local_copy_ttl_s)
        if self.local_dir is not None and not isinstance(self.local_dir, str | os.PathLike):
            raise TypeError(
                f"StoreConfig.local_dir must be a path or None, got {type(self.local_dir).__name__}"
            )
        if self.local_dir is not None and not os.fspath(self.local_dir).strip():
            # "" would silently mean the current folder.
            raise ValueError("StoreConfig.local_dir must be a non-empty path or None, got ''")

    @property
    def resolved_local_dir(self) -> str:
        """The folder of local working copies, with the default filled in."""
        if self.local_dir is None:
            return os.path.join(tempfile.gettempdir(), "statekeeper")
        return os.fspath(self.local_dir)


def _int_at_least(name: str, value: object, *, low: int = 1, high: int | None = None) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        wanted = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"StoreConfig.{name} must be an int {wanted}, got {value!r}")


def _non_negative(name: str, value: object) -> None:
    # nan compares false with everything, so "value < 0" alone would let it through.
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(
            f"StoreConfig.{name} must be a finite number of seconds >= 0, got {value!r}"
        )
