"""The local RocksDB working copy of one store.

User keys live in the database as they are; the committed version, the id of the root the
copy belongs to and a dirty flag live under the empty key ``b""``, which users cannot write
(keys must be non-empty) and which scans skip. Every change is applied in one
``WriteBatch`` together with the new label, and there is one column family, so whatever a
flush or a crash leaves on disk is some committed version, labelled correctly (invariant 3).
(A separate column family would need every flush to cover both families atomically, and
rocksdict's ``flush`` covers only the default one.)

The write-ahead log is disabled: durability comes from the changelogs in the blob store. A
hard crash may therefore set the local copy back to its last flush; ``flush_if_due`` bounds
that distance in time (the Kafka Streams checkpoint interval), and the store catches up by
replaying changelogs on the next open.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import struct
import threading
import time
from collections.abc import Iterable, Iterator

import rocksdict

from statekeeper.errors import StateKeeperError
from statekeeper.manifest import LEGACY_ATTEMPT

__all__ = ["WorkingCopy"]

_log = logging.getLogger(__name__)

LABEL_KEY = b""
# Label value: version (uint64), dirty flag (uint8), then the root id in UTF-8 and, from
# format 2, a NUL and the id of the attempt whose content the version is. The dirty
# flag is set while the data holds a version not yet durable in the blob store (snapshot
# mode applies locally before the snapshot upload that commits it); such a copy is never
# reused as a committed version.
_LABEL = struct.Struct(">QB")
_SCAN_CHUNK = 1024

# Directories with an open working copy in this process: RocksDB refuses a second handle on
# one directory, and a clear error is better than its LOCK message.
_open_paths: set[str] = set()
_open_paths_lock = threading.Lock()


def _options(write_buffer_mb: int) -> rocksdict.Options:
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.create_missing_column_families(True)
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
            self._opts = _options(write_buffer_mb)
            self._db = self._open_db()
        except BaseException:
            with _open_paths_lock:
                _open_paths.discard(self.path)
            raise
        self._write_opts = rocksdict.WriteOptions()
        # A property at runtime, though rocksdict's stub declares a method.
        self._write_opts.disable_wal = True  # type: ignore[method-assign,assignment]
        self._last_flush = time.monotonic()
        self._closed = False
        # Serializes writes, checkpoints and close: a checkpoint taken by the background
        # snapshot thread must hold exactly one labelled version.
        self._lock = threading.Lock()

    def _open_db(self) -> rocksdict.Rdict:
        """Open the database; a directory RocksDB cannot open is discarded and recreated.

        The local copy is only a cache of the blob store, so an unreadable one (a restore
        interrupted half way, a disk error) costs a download, never state.
        """
        for attempt in (1, 2):
            os.makedirs(self.path, exist_ok=True)
            try:
                return rocksdict.Rdict(self.path, self._opts)
            except Exception as exc:
                if "lock" in str(exc).lower() or attempt == 2:
                    busy = " (is another process using it?)" if "lock" in str(exc).lower() else ""
                    raise StateKeeperError(
                        f"cannot open the local working copy {self.path}: {exc}{busy}"
                    ) from exc
                _log.warning("discarding unreadable local working copy %s: %s", self.path, exc)
                shutil.rmtree(self.path, ignore_errors=True)
                self.set_lineage(None, 0)
        raise AssertionError("unreachable")

    # -- labels ---------------------------------------------------------------------------

    def _label(self) -> tuple[int, bool, str, str] | None:
        raw = self._db.get(LABEL_KEY)
        if raw is None:
            return None
        raw = bytes(raw)
        version, dirty = _LABEL.unpack_from(raw)
        root_id, _, attempt = raw[_LABEL.size :].decode("utf-8").partition("\0")
        if not attempt and version:
            attempt = LEGACY_ATTEMPT  # labelled by statekeeper 0.1
        return int(version), bool(dirty), root_id, attempt

    @property
    def attempt(self) -> str:
        """The attempt whose content the labelled version is (``""`` if unlabelled or 0)."""
        label = self._label()
        return "" if label is None else label[3]

    @property
    def version(self) -> int | None:
        """The committed version this copy holds, or ``None`` if fresh or not trustworthy."""
        label = self._label()
        return None if label is None or label[1] else label[0]

    @property
    def label(self) -> int | None:
        """The version label as written, committed or not."""
        label = self._label()
        return None if label is None else label[0]

    @property
    def dirty(self) -> bool:
        """True if the data holds a version not yet committed to the blob store."""
        label = self._label()
        return label is not None and label[1]

    @property
    def root_id(self) -> str | None:
        """The id of the checkpoint root this copy was built from, if labelled."""
        label = self._label()
        return None if label is None else label[2]

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
        start: bytes | None = prefix
        inclusive = True
        while start is not None:
            chunk, start = self._scan_chunk(start, prefix, inclusive)
            inclusive = False
            yield from (item for item in chunk if item[0] != LABEL_KEY)

    def _scan_chunk(
        self, start: bytes, prefix: bytes, inclusive: bool
    ) -> tuple[list[tuple[bytes, bytes]], bytes | None]:
        """Up to one chunk of items from ``start``, and where to go on (``None``: done)."""
        out: list[tuple[bytes, bytes]] = []
        it = self._db.iter()
        try:
            it.seek(start)
            if not inclusive and it.valid() and bytes(it.key()) == start:
                it.next()
            while it.valid() and len(out) < _SCAN_CHUNK:
                key = bytes(it.key())
                if not key.startswith(prefix):
                    return out, None
                out.append((key, bytes(it.value())))
                it.next()
            return out, (out[-1][0] if it.valid() and out else None)
        finally:
            del it

    # -- writes ---------------------------------------------------------------------------

    def apply(
        self,
        changes: Iterable[tuple[bytes, bytes | None]],
        *,
        version: int,
        root_id: str,
        attempt: str,
        dirty: bool = False,
    ) -> None:
        """Apply puts (value) and deletes (``None``) and label the copy ``version`` of
        ``attempt``, atomically.

        With ``dirty`` the copy is also marked as holding a version not yet durable in the
        blob store, until :meth:`mark_clean`.

        Raises:
            StateKeeperError: RocksDB failed the write; the copy keeps its previous version.
        """
        batch = rocksdict.WriteBatch(raw_mode=True)
        for key, value in changes:
            if value is None:
                batch.delete(key)
            else:
                batch.put(key, value)
        label = root_id + ("\0" + attempt if attempt else "")
        batch.put(LABEL_KEY, _LABEL.pack(version, dirty) + label.encode("utf-8"))
        self._write(batch)

    def mark_clean(self) -> None:
        """Record that the labelled version is durable in the blob store.

        Raises:
            StateKeeperError: the copy is unlabelled, or RocksDB failed the write.
        """
        label = self._label()
        if label is None:
            raise StateKeeperError(f"the local working copy {self.path} holds no version")
        self.apply((), version=label[0], root_id=label[2], attempt=label[3])

    def _write(self, batch: rocksdict.WriteBatch) -> None:
        try:
            with self._lock:
                self._db.write(batch, self._write_opts)
        except Exception as exc:
            raise StateKeeperError(
                f"cannot write to the local working copy {self.path}: {exc}"
            ) from exc

    def checkpoint(self, path: str) -> tuple[int, str]:
        """Create a RocksDB checkpoint (hard links) at ``path``; returns its version label
        and attempt.

        Raises:
            StateKeeperError: the copy is unlabelled or closed, or RocksDB failed.
        """
        with self._lock:
            if self._closed:
                raise StateKeeperError(f"the local working copy {self.path} is closed")
            label = self._label()
            if label is None:
                raise StateKeeperError(f"the local working copy {self.path} holds no version")
            try:
                rocksdict.Checkpoint(self._db).create_checkpoint(path)
            except Exception as exc:
                raise StateKeeperError(
                    f"cannot create a checkpoint of {self.path} at {path}: {exc}"
                ) from exc
            # The checkpoint flushed the memtables: the copy is durable up to here too.
            self._last_flush = time.monotonic()
        return label[0], label[3]

    def flush_if_due(self) -> bool:
        """Flush memtables if the local checkpoint interval has passed; True if flushed."""
        if time.monotonic() - self._last_flush < self._checkpoint_interval_s:
            return False
        self.flush()
        return True

    def flush(self) -> None:
        """Make the current committed version durable on local disk."""
        with self._lock:
            self._db.flush(wait=True)
        self._last_flush = time.monotonic()

    def close(self, *, flush: bool = True) -> None:
        """Flush (unless told not to) and release the database. Idempotent."""
        if self._closed:
            return
        try:
            if flush:
                self.flush()
            with self._lock:
                self._closed = True
                self._db.close()
        finally:
            with _open_paths_lock:
                _open_paths.discard(self.path)

    def destroy(self) -> None:
        """Close and delete the working copy directory and its lineage record."""
        self.close(flush=False)
        shutil.rmtree(self.path, ignore_errors=True)
        self.set_lineage(None, 0)
        _log.debug("removed local working copy %s", self.path)

    # -- snapshot lineage -----------------------------------------------------------------

    @property
    def lineage_path(self) -> str:
        """File beside the copy naming the snapshot its files descend from."""
        return self.path + ".lineage.json"

    @property
    def lineage(self) -> tuple[str, int] | None:
        """(checkpoint id, version) of the snapshot this copy last uploaded or restored.

        RocksDB numbers its files per database, so file names are comparable with that
        snapshot's index only while this holds; ``None`` when unknown.
        """
        try:
            with open(self.lineage_path, encoding="utf-8") as fh:
                doc = json.load(fh)
            checkpoint_id, version = doc["checkpointId"], doc["version"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not isinstance(checkpoint_id, str) or not isinstance(version, int):
            return None
        return checkpoint_id, version

    def set_lineage(self, checkpoint_id: str | None, version: int) -> None:
        """Record (or forget, with ``None``) the snapshot the copy's files descend from."""
        if checkpoint_id is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.lineage_path)
            return
        tmp = f"{self.lineage_path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"checkpointId": checkpoint_id, "version": version}, fh)
        os.replace(tmp, self.lineage_path)
