"""The local RocksDB working copy of one store.

User keys live in the default column family; the committed version and the id of the root
the copy belongs to live in a private ``_statekeeper`` column family. Every change is applied
in one ``WriteBatch`` together with the new version, and the database uses atomic flushes, so
whatever a crash leaves on disk is some committed version, labelled correctly (invariant 3).

The write-ahead log is disabled: durability comes from the changelogs in the blob store. A
hard crash may therefore set the local copy back to its last flush; ``flush_if_due`` bounds
that distance in time (the Kafka Streams checkpoint interval), and the store catches up by
replaying changelogs on the next open.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import threading
import time
from collections.abc import Iterable, Iterator

import rocksdict

from statekeeper.errors import StateKeeperError

__all__ = ["WorkingCopy"]

_log = logging.getLogger(__name__)

_META_CF = "_statekeeper"
_VERSION_KEY = b"version"
_ROOT_ID_KEY = b"root_id"
_U64 = struct.Struct(">Q")
_SCAN_CHUNK = 1024

# Directories with an open working copy in this process: RocksDB refuses a second handle on
# one directory, and a clear error is better than its LOCK message.
_open_paths: set[str] = set()
_open_paths_lock = threading.Lock()


def _options(write_buffer_mb: int) -> rocksdict.Options:
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.create_missing_column_families(True)
    # The version record and the data it labels live in different column families; without
    # atomic flush a memtable flush of one but not the other could persist a mix.
    opts.set_atomic_flush(True)
    opts.set_write_buffer_size(write_buffer_mb * 1024 * 1024)
    opts.set_max_background_jobs(2)
    opts.set_level_compaction_dynamic_level_bytes(True)
    opts.set_compression_type(rocksdict.DBCompressionType.lz4())
    opts.set_bottommost_compression_type(rocksdict.DBCompressionType.zstd())
    table = rocksdict.BlockBasedOptions()
    table.set_bloom_filter(10, False)
    opts.set_block_based_table_factory(table)
    return opts


class WorkingCopy:
    """An open RocksDB working copy labelled with the committed version it holds.

    Not thread-safe; one instance per directory per process.
    """

    def __init__(self, path: str, *, write_buffer_mb: int, checkpoint_interval_s: float) -> None:
        """Open (creating if needed) the working copy at ``path``.

        Raises:
            StateKeeperError: the directory is already open in this process, is locked by
                another process, or RocksDB cannot open it.
        """
        self.path = os.path.abspath(path)
        self._checkpoint_interval_s = checkpoint_interval_s
        with _open_paths_lock:
            if self.path in _open_paths:
                raise StateKeeperError(
                    f"the local working copy {self.path} is already open in this process; "
                    "close the other store first"
                )
            _open_paths.add(self.path)
        try:
            os.makedirs(self.path, exist_ok=True)
            self._opts = _options(write_buffer_mb)
            self._db = rocksdict.Rdict(
                self.path, self._opts, column_families={_META_CF: rocksdict.Options(raw_mode=True)}
            )
        except Exception as exc:
            with _open_paths_lock:
                _open_paths.discard(self.path)
            raise StateKeeperError(
                f"cannot open the local working copy {self.path}: {exc}"
                + (" (is another process using it?)" if "lock" in str(exc).lower() else "")
            ) from exc
        self._write_opts = rocksdict.WriteOptions()
        # A property at runtime, though rocksdict's stub declares a method.
        self._write_opts.disable_wal = True  # type: ignore[method-assign,assignment]
        self._last_flush = time.monotonic()
        self._closed = False

    # -- labels ---------------------------------------------------------------------------

    def _meta_get(self, key: bytes) -> bytes | None:
        meta = self._db.get_column_family(_META_CF)
        try:
            value = meta.get(key)
        finally:
            del meta
        return value if value is None else bytes(value)

    @property
    def version(self) -> int | None:
        """The committed version this copy holds, or ``None`` for a fresh, unlabelled copy."""
        raw = self._meta_get(_VERSION_KEY)
        if raw is None:
            return None
        (version,) = _U64.unpack(raw)
        return int(version)

    @property
    def root_id(self) -> str | None:
        """The id of the checkpoint root this copy was built from, if labelled."""
        raw = self._meta_get(_ROOT_ID_KEY)
        return None if raw is None else raw.decode("utf-8")

    # -- reads ----------------------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        """The committed value of ``key``."""
        value = self._db.get(key)
        return None if value is None else bytes(value)

    def multi_get(self, keys: list[bytes]) -> list[bytes | None]:
        """Committed values of ``keys``, in order (one RocksDB multi-get)."""
        if not keys:
            return []
        values = self._db.get(keys)  # type: ignore[arg-type]
        assert isinstance(values, list)
        return [None if v is None else bytes(v) for v in values]

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Committed items whose key starts with ``prefix``, sorted by key.

        Reads in chunks with a fresh iterator each time, so no RocksDB iterator outlives a
        chunk (an abandoned generator must not keep the database open).
        """
        start = prefix
        inclusive = True
        while True:
            chunk = self._scan_chunk(start, prefix, inclusive)
            yield from chunk
            if len(chunk) < _SCAN_CHUNK:
                return
            start, inclusive = chunk[-1][0], False

    def _scan_chunk(
        self, start: bytes, prefix: bytes, inclusive: bool
    ) -> list[tuple[bytes, bytes]]:
        out: list[tuple[bytes, bytes]] = []
        it = self._db.iter()
        try:
            it.seek(start)
            if not inclusive and it.valid() and bytes(it.key()) == start:
                it.next()
            while it.valid() and len(out) < _SCAN_CHUNK:
                key = bytes(it.key())
                if not key.startswith(prefix):
                    break
                out.append((key, bytes(it.value())))
                it.next()
        finally:
            del it
        return out

    # -- writes ---------------------------------------------------------------------------

    def apply(
        self,
        changes: Iterable[tuple[bytes, bytes | None]],
        *,
        version: int,
        root_id: str,
    ) -> None:
        """Apply puts (value) and deletes (``None``) and label the copy ``version``, atomically.

        Raises:
            StateKeeperError: RocksDB failed the write; the copy keeps its previous version.
        """
        batch = rocksdict.WriteBatch(raw_mode=True)
        for key, value in changes:
            if value is None:
                batch.delete(key)
            else:
                batch.put(key, value)
        meta = self._db.get_column_family_handle(_META_CF)
        batch.put(_VERSION_KEY, _U64.pack(version), meta)
        batch.put(_ROOT_ID_KEY, root_id.encode("utf-8"), meta)
        del meta
        try:
            self._db.write(batch, self._write_opts)
        except Exception as exc:
            raise StateKeeperError(
                f"cannot write to the local working copy {self.path}: {exc}"
            ) from exc

    def flush_if_due(self) -> bool:
        """Flush memtables if the local checkpoint interval has passed; True if flushed."""
        if time.monotonic() - self._last_flush < self._checkpoint_interval_s:
            return False
        self.flush()
        return True

    def flush(self) -> None:
        """Make the current committed version durable on local disk."""
        self._db.flush(wait=True)
        self._last_flush = time.monotonic()

    def close(self, *, flush: bool = True) -> None:
        """Flush (unless told not to) and release the database. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if flush:
                self.flush()
            self._db.close()
        finally:
            with _open_paths_lock:
                _open_paths.discard(self.path)

    def destroy(self) -> None:
        """Close and delete the working copy directory."""
        self.close(flush=False)
        shutil.rmtree(self.path, ignore_errors=True)
        _log.debug("removed local working copy %s", self.path)
