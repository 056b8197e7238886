"""The local RocksDB working copy of one store.

User keys live in the database as they are; the committed version, the id of the root the
copy belongs to, a dirty flag and the undo record of the last commit live under the empty key
``b""`` (:mod:`statekeeper.store._label`), which users cannot write (keys must be non-empty)
and which scans skip. Every change is applied in one ``WriteBatch`` together with the new
label, and there is one column family, so whatever a flush or a crash leaves on disk is some
committed version, labelled correctly, with the undo record that steps it back to its parent
(invariant 3). (A separate column family would need every flush to cover both families
atomically, and rocksdict's ``flush`` covers only the default one.)

The write-ahead log is disabled: durability comes from the changelogs in the blob store. A
hard crash may therefore set the local copy back to its last flush; ``flush_if_due`` bounds
that distance in time (the Kafka Streams checkpoint interval), and the store catches up by
replaying changelogs on the next open.

The copy is a cache of the blob store: one that RocksDB cannot open or read, for any reason
but another process holding it or the process being out of file handles, is set aside and
rebuilt (:mod:`statekeeper.store._local_disk` tells the causes apart). Reads raise
:class:`DamagedCopyError` for the store to rebuild. Writes, flushes and checkpoints raise it
only when RocksDB reports corruption (a flush or compaction met a damaged block, after which
RocksDB fails every write of the copy); otherwise a :class:`StateKeeperError` that says how
much room the disk has left.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import operator
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import rocksdict

from statekeeper.changelog import Columns
from statekeeper.errors import StateKeeperError
from statekeeper.store import _rocks
from statekeeper.store._label import (
    MAX_UNDO_KEYS,
    Label,
    decode_undo,
    encode_undo,
    pack_label,
    parse_label,
)
from statekeeper.store._local_disk import (
    LOW_SPACE_BYTES,
    DamagedCopyError,
    disk_note,
    free_bytes,
    holding_lock,
    read_failure,
    set_aside,
    write_failure,
)
from statekeeper.store._overlap import submit

__all__ = [
    "DamagedCopyError",
    "WorkingCopy",
    "copy_exists",
    "delete_copy_folder",
    "forget_lineage",
    "remove_unused_copy",
    "unmark_copy",
]

_log = logging.getLogger(__name__)

LABEL_KEY = b""
# multi_get reads a range in order, not key by key, when it asks for at least 1 / _SCAN_DENSITY
# of the copy's keys, or 1 / _SCAN_DENSITY_IN_ORDER for keys in ascending order (no sort to
# pay for; RocksDB's key count adds up overwritten keys once per file, so it can be several
# times the real one). The ordered pass steps over at most _SCAN_GRACE items plus _SCAN_LIMIT
# per key answered, and leaves the rest to gets where the keys are sparser than that. The
# costs these are drawn from are in _rocks.read_values.
_SCAN_DENSITY = 2
_SCAN_DENSITY_IN_ORDER = 8
_SCAN_LIMIT = 3
_SCAN_GRACE = 1024


# Directories with an open working copy in this process: RocksDB refuses a second handle on
# one directory, and a clear error is better than its LOCK message. It also keeps the lock
# probe of _local_disk away from a directory this process holds.
_open_paths: set[str] = set()
_open_paths_lock = threading.Lock()


@dataclass(slots=True)
class _Behind:
    """A write running on a helper thread (:meth:`WorkingCopy.write_behind`)."""

    version: int
    future: Future[None] | None = None
    thread: int | None = None
    """The helper thread's id while the write runs: its own calls on the copy do not wait."""


class WorkingCopy:
    """An open RocksDB working copy labelled with the committed version it holds.

    Not thread-safe; one instance per directory per process.
    """

    def __init__(
        self,
        path: str,
        *,
        write_buffer_mb: int,
        memory_mb: int,
        checkpoint_interval_s: float,
        compactions: bool = True,
        write_mb_s: int = 0,
    ) -> None:
        """Open (creating if needed) the working copy at ``path``; one that RocksDB cannot
        open, or whose label cannot be read, is set aside and a new one created.

        Its RocksDB memory comes from the process's shared budget
        (:data:`statekeeper.store._rocks.SHARED_MEMORY`), grown to ``memory_mb`` if smaller;
        its memtable is at most ``write_buffer_mb``, and its flushes and compactions write at
        most ``write_mb_s`` MiB/s (0: no limit).

        Raises:
            StateKeeperError: the directory is already open in this process or in use by
                another process, the disk is full, or a new copy cannot be created either.
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
            self._opts = _rocks.options(
                write_buffer_mb=write_buffer_mb, memory_mb=memory_mb, write_mb_s=write_mb_s
            )
            # Off for a copy whose files must stay those of its snapshot (a rescale's parent).
            self._opts.set_disable_auto_compactions(not compactions)
            self._db, self._label = self._open_db()
            try:
                self._incarnation = _incarnation(self.path)
            except OSError as exc:
                self._db.close()
                raise StateKeeperError(
                    f"cannot open the local working copy {self.path}: {exc}; {disk_note(self.path)}"
                ) from exc
        except BaseException:
            with _open_paths_lock:
                _open_paths.discard(self.path)
            raise
        self._write_opts = rocksdict.WriteOptions()
        # A property at runtime, though rocksdict's stub declares a method.
        self._write_opts.disable_wal = True  # type: ignore[method-assign,assignment]
        self._last_flush = time.monotonic()
        self._closed = False
        self._damage: DamagedCopyError | None = None
        # Serializes writes, checkpoints and close: a checkpoint taken by the background
        # snapshot thread must hold exactly one labelled version.
        self._lock = threading.Lock()
        self._behind: _Behind | None = None

    def _open_db(self) -> tuple[rocksdict.Rdict, Label | None]:
        """Open the database and read its label; a copy that fails either is set aside and
        a new one created (the copy is a cache: damage costs a download, never state)."""
        for fresh in (False, True):
            try:
                os.makedirs(self.path, exist_ok=True)
                # rocksdict opens an existing database's column family with the options of
                # its OPTIONS file unless given them: without this a reopened copy would keep
                # the settings it was created with (another release's, or RocksDB's own), its
                # own block cache outside the shared budget, and automatic compactions on.
                families = {"default": self._opts}
                db = rocksdict.Rdict(self.path, self._opts, column_families=families)
            except Exception as exc:  # noqa: BLE001 - rocksdict raises a bare Exception
                failure: Exception = exc
            else:
                try:
                    raw = db.get(LABEL_KEY)
                    return db, None if raw is None else parse_label(bytes(raw))[0]
                except Exception as exc:  # noqa: BLE001 - damage met at the first read
                    failure = exc
                    try:
                        db.close()
                    except Exception as closing:  # noqa: BLE001 - a compaction met it too
                        _log.warning("closing the damaged copy %s: %s", self.path, closing)
            if fresh:
                raise StateKeeperError(
                    f"cannot create the local working copy {self.path}: {failure}; "
                    f"{disk_note(self.path)}"
                ) from failure
            free = free_bytes(self.path)
            if free is not None and free < LOW_SPACE_BYTES:
                raise StateKeeperError(
                    f"cannot open the local working copy {self.path}: {failure}; "
                    f"{disk_note(self.path)}"
                ) from failure
            problem = read_failure(self.path, failure)
            if not isinstance(problem, DamagedCopyError):
                raise problem from failure
            with holding_lock(self.path, failure):  # raises if another process has it
                set_aside(self.path, failure)
            self.set_lineage(None, 0)
        raise AssertionError("unreachable")

    def report_damage(self, damage: DamagedCopyError) -> None:
        """Take note that the copy is damaged where nothing read it yet (a snapshot found a
        file that fails its checksums): from now on every call raises ``damage``, so the
        store rebuilds the copy, and closing it sets it aside (another process must not
        reopen it as it is). A copy closed already (its snapshot uploads after the close)
        is set aside now, unless this process opened it again meanwhile (that copy's own
        snapshot finds the damage)."""
        self._damage = damage
        with self._lock:
            closed = self._closed
        if closed:
            self._set_aside_if_damaged()

    def _set_aside_if_damaged(self) -> None:
        damage, self._damage = self._damage, None
        if damage is None:
            return
        with _open_paths_lock:
            if self.path in _open_paths:
                return  # open again in this process
            _open_paths.add(self.path)
        try:
            with holding_lock(self.path, damage):
                set_aside(self.path, damage)
            self.set_lineage(None, 0)
        except StateKeeperError as exc:
            _log.warning("%s; the next open of %s may find it damaged", exc, self.path)
        finally:
            with _open_paths_lock:
                _open_paths.discard(self.path)

    def set_aside(self, reason: BaseException | str) -> str:
        """Close (without flushing) and rename the copy out of the way, kept for inspection;
        returns its new name. The next open at :attr:`path` starts a new copy.

        Raises:
            StateKeeperError: the rename failed, or another process opened the copy.
        """
        self._damage = None  # set aside here, not again by close
        self.close(flush=False)
        with holding_lock(self.path, reason if isinstance(reason, BaseException) else None):
            aside = set_aside(self.path, reason)
        self.set_lineage(None, 0)
        return aside

    # -- labels ---------------------------------------------------------------------------

    @property
    def attempt(self) -> str:
        """The attempt whose content the labelled version is (``""`` if unlabelled or 0)."""
        self.wait()
        return "" if self._label is None else self._label.attempt

    @property
    def version(self) -> int | None:
        """The committed version this copy holds, or ``None`` if fresh or not trustworthy."""
        self.wait()
        label = self._label
        return None if label is None or label.dirty else label.version

    @property
    def label(self) -> int | None:
        """The version label as written, committed or not."""
        self.wait()
        return None if self._label is None else self._label.version

    @property
    def dirty(self) -> bool:
        """True if the data holds a version not yet committed to the blob store."""
        self.wait()
        return self._label is not None and self._label.dirty

    @property
    def root_id(self) -> str | None:
        """The id of the checkpoint root this copy was built from, if labelled."""
        self.wait()
        return None if self._label is None else self._label.root_id

    @property
    def can_step_back(self) -> bool:
        """True if the copy keeps the undo record of the commit that made its version."""
        self.wait()
        return self._label is not None and self._label.has_undo

    # -- reads ----------------------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        """The committed value of ``key``.

        Raises:
            DamagedCopyError: RocksDB failed the read.
            StateKeeperError: the process is out of file handles (not damage).
        """
        self.wait()
        try:
            value: bytes | None = self._db.get(key)  # raw mode: bytes, nothing to convert
        except Exception as exc:  # rocksdict raises a bare Exception for every failure
            raise read_failure(self.path, exc) from exc
        return value

    def multi_get(self, keys: list[bytes]) -> list[bytes | None]:
        """Committed values of ``keys``, in order.

        Raises:
            DamagedCopyError: RocksDB failed the read.
            StateKeeperError: the process is out of file handles (not damage).
        """
        self.wait()
        if not keys:
            return []
        try:
            held = self._db.property_int_value("rocksdb.estimate-num-keys") or 0
        except Exception as exc:  # rocksdict raises a bare Exception for every failure
            raise read_failure(self.path, exc) from exc
        # The order is checked only where it could matter (0.1 µs a key); the check stops at
        # the first pair out of order, so keys in no order cost nearly nothing.
        in_order = len(keys) * _SCAN_DENSITY_IN_ORDER >= held and all(
            map(operator.le, keys, itertools.islice(keys, 1, None))
        )
        if in_order or len(keys) * _SCAN_DENSITY >= held:
            return self._multi_get_by_scan(keys, in_order)
        return self._gets(keys)

    def _gets(self, keys: list[bytes]) -> list[bytes | None]:
        """One get per key: rocksdict's list form (RocksDB's unbatched MultiGet) costs more
        per key than a loop of gets; raw mode returns bytes, so nothing is converted."""
        get = self._db.get
        try:
            return [get(k) for k in keys]
        except Exception as exc:  # rocksdict raises a bare Exception for every failure
            raise read_failure(self.path, exc) from exc

    def _multi_get_by_scan(self, keys: list[bytes], in_order: bool) -> list[bytes | None]:
        """:meth:`multi_get` of many of the copy's keys: one ordered pass merging the keys
        (sorted first unless ``in_order``) with the items (:func:`_rocks.read_values`). Where
        the keys turn out sparser than the key count said (it is an estimate), the pass
        stops, and the keys past that point are read one by one."""
        ordered = keys if in_order else sorted(set(keys))
        try:
            values, answered = _rocks.read_values(self._db, ordered, _SCAN_LIMIT, _SCAN_GRACE)
        except Exception as exc:  # rocksdict raises a bare Exception for every failure
            raise read_failure(self.path, exc) from exc
        if answered < len(ordered):
            values.extend(self._gets(ordered[answered:]))
        if in_order:
            return values
        found = dict(zip(ordered, values, strict=True))
        return list(map(found.__getitem__, keys))

    def scan(
        self, prefix: bytes, *, after: bytes | None = None, start: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """Committed items whose key starts with ``prefix`` (and is above ``after`` and at or
        above ``start``, if given), sorted by key.

        Reads in chunks (:func:`statekeeper.store._rocks.scan`), so no RocksDB iterator
        outlives a chunk (an abandoned generator must not keep the database open).

        Raises:
            DamagedCopyError: RocksDB failed the read (never a silently shorter scan).
            StateKeeperError: the process is out of file handles, or the copy was closed
                before the scan ended (neither is damage: the folder may hold another copy
                by now).
        """
        self.wait()
        try:
            for item in _rocks.scan(self._db, prefix, after, start):
                if item[0] != LABEL_KEY:
                    yield item
        except Exception as exc:  # rocksdict raises a bare Exception for every failure
            if self._closed:
                raise StateKeeperError(
                    f"the local working copy {self.path} was closed before this scan ended"
                ) from exc
            raise read_failure(self.path, exc) from exc

    def _raw_label(self) -> bytes | None:
        raw = self.get(LABEL_KEY)
        return None if raw is None else bytes(raw)

    # -- writes ---------------------------------------------------------------------------

    def apply(
        self,
        changes: Iterable[tuple[bytes, bytes | None]] | Columns,
        *,
        version: int,
        root_id: str,
        attempt: str,
        dirty: bool = False,
        undo: bool = False,
    ) -> None:
        """Apply puts (value) and deletes (``None``) and label the copy ``version`` of
        ``attempt``, atomically (one write batch holds the changes and the label).

        ``changes`` are ``(key, value)`` pairs (value ``None``: a delete; a key may repeat,
        the last wins), or the :class:`Columns` a commit encoded (keys unique, as a
        commit's are: then puts and deletes need not interleave). With ``dirty`` the copy
        is also marked as holding a version not yet durable in the blob store, until
        :meth:`mark_clean`. With ``undo`` (a commit on top of the labelled version) the
        label also keeps the old values of the changed keys, so that :meth:`step_back` can
        return to the labelled version without a download.

        Raises:
            DamagedCopyError: reading the old values failed.
            StateKeeperError: the process is out of file handles (not damage).
            StateKeeperError: RocksDB failed the write; the copy keeps its previous version.
        """
        self.wait()
        batch = rocksdict.WriteBatch(raw_mode=True)
        if isinstance(changes, Columns):
            keys = changes.keys
            _rocks.fill_columns(batch, keys, changes.values, changes.deletes)
        else:
            pairs = list(changes)
            keys = [key for key, _ in pairs] if undo else []
            _rocks.fill_pairs(batch, pairs)
        record = self._undo_record(keys) if undo else None
        label = pack_label(version, dirty=dirty, root_id=root_id, attempt=attempt, undo=record)
        batch.put(LABEL_KEY, label)
        self._write(batch, parse_label(label)[0])
        self._flush_if_over_share()

    def write_behind(self, columns: Columns, *, version: int, root_id: str, attempt: str) -> None:
        """:meth:`apply` a committed version's ``columns`` with its undo record, then
        :meth:`flush_if_due`, on a helper thread (:mod:`statekeeper.store._overlap`), and
        return at once.

        Every other method waits for the write first, from any thread, so whoever uses the
        copy next sees the new version, and a crash before the write lands leaves the
        previous one (the blob store has the new one: the next open catches up). If the
        write fails, the next call raises its error, as does every call after it.
        """
        # Not wait(): a copy reported damaged meanwhile (by a snapshot) takes this write all
        # the same, the version being committed; the store rebuilds it at its next call.
        self._wait_behind()
        job = _Behind(version)

        def run() -> None:
            job.thread = threading.get_ident()
            try:
                self.apply(columns, version=version, root_id=root_id, attempt=attempt, undo=True)
                self.flush_if_due()
            finally:
                # Run in the caller's own thread (at Python's exit), its later calls must
                # still see a failure.
                job.thread = None

        job.future = submit(run)
        self._behind = job

    def wait(self) -> None:
        """Wait for the write :meth:`write_behind` started, if any (every other method
        calls this first; the helper's own calls go on).

        Raises:
            StateKeeperError: that write (or the flush after it) failed, and every later
                call raises this too: close the copy (what lands on disk is a version it
                labelled, which the next open catches up from); a
                :class:`DamagedCopyError` if RocksDB found the copy damaged, or a
                snapshot did (:meth:`report_damage`): set it aside.
        """
        job = self._behind
        if job is not None and job.thread == threading.get_ident():
            return  # the write's own calls
        if self._damage is not None:
            raise self._damage
        self._wait_behind()

    def _wait_behind(self) -> None:
        """:meth:`wait` for the write only, whether or not the copy was reported damaged."""
        job = self._behind
        if job is None or job.thread == threading.get_ident():
            return
        assert job.future is not None
        try:
            job.future.result()
        except DamagedCopyError:
            raise  # as it was: the store sets the copy aside
        except Exception as exc:  # whatever it was, the write did not land
            raise StateKeeperError(
                f"the write of version {job.version} to the local working copy {self.path} "
                f"failed: {exc}"
            ) from exc
        if self._behind is job:
            self._behind = None

    def _flush_if_over_share(self) -> None:
        """Flush this copy's memtable if the process's memtables are over their bound and
        its active one holds more than its share (RocksDB itself would wait for its next
        write). Memtables already switched out are being flushed: they do not count.

        Raises:
            StateKeeperError: the flush failed (a full disk, say).
        """
        held = self._db.property_int_value("rocksdb.cur-size-active-mem-table") or 0
        with _open_paths_lock:
            open_copies = len(_open_paths)
        if _rocks.SHARED_MEMORY.over_share(held, open_copies):
            self.flush()

    def _undo_record(self, keys: list[bytes]) -> bytes | None:
        """The undo record of changing ``keys`` on top of the labelled version, if it has
        one (none for a commit of more than :data:`MAX_UNDO_KEYS` keys)."""
        parent = self._label
        if parent is None or parent.dirty or len(keys) > MAX_UNDO_KEYS:
            return None
        old = zip(keys, self.multi_get(keys), strict=True)
        return encode_undo(parent.version, parent.attempt, old)

    def step_back(self, *, version: int, attempt: str) -> bool:
        """Return the copy to ``version`` of ``attempt`` with one write, if its last commit
        was built on exactly that and kept its undo record; True if it did.

        Raises:
            DamagedCopyError: reading the label failed.
            StateKeeperError: the process is out of file handles (not damage).
            StateKeeperError: RocksDB failed the write; the copy is unchanged.
        """
        self.wait()
        label = self._label
        if label is None or not label.has_undo or label.version != version + 1:
            return False
        raw = self._raw_label()
        record = None if raw is None else parse_label(raw)[1]
        undo = None if record is None else decode_undo(record)
        if undo is None or (undo.parent_version, undo.parent_attempt) != (version, attempt):
            return False
        self.apply(undo.changes, version=version, root_id=label.root_id, attempt=attempt)
        _log.info(
            "stepped the local working copy %s back from version %s (attempt %s) to %s "
            "(attempt %s): %s keys restored, nothing downloaded",
            self.path, label.version, label.attempt, version, attempt, len(undo.changes),
        )  # fmt: skip
        return True

    def mark_clean(self) -> None:
        """Record that the labelled version is durable in the blob store (its undo record
        is kept).

        Raises:
            StateKeeperError: the copy is unlabelled, or RocksDB failed the write.
        """
        self.wait()
        label = self._label
        raw = self._raw_label()
        if label is None or raw is None:
            raise StateKeeperError(f"the local working copy {self.path} holds no version")
        record = parse_label(raw)[1]
        batch = rocksdict.WriteBatch(raw_mode=True)
        batch.put(LABEL_KEY, pack_label(
            label.version, dirty=False, root_id=label.root_id, attempt=label.attempt,
            undo=record,
        ))  # fmt: skip
        self._write(
            batch, Label(label.version, False, label.root_id, label.attempt, label.has_undo)
        )

    def _write(self, batch: rocksdict.WriteBatch, label: Label) -> None:
        """Write ``batch`` and take ``label`` (the one it holds) as the copy's, under the lock
        a background checkpoint takes: it must never see the data of one version with the
        label of another."""
        try:
            with self._lock:
                self._db.write(batch, self._write_opts)
                self._label = label
        except Exception as exc:  # rocksdict raises a bare Exception for every failure
            raise write_failure(
                self.path, f"cannot write to the local working copy {self.path}", exc
            ) from exc

    def checkpoint(self, path: str, *, dirty_ok: bool = False) -> tuple[int, str]:
        """Create a RocksDB checkpoint (hard links) at ``path``; returns its version label
        and attempt.

        A copy labelled dirty holds a version not yet whole or not yet committed (between
        the slices of a commit of several parts, or a snapshot-mode commit before its
        upload): only that commit's own snapshot may check it out (``dirty_ok``).

        Raises:
            StateKeeperError: the copy is unlabelled, dirty (without ``dirty_ok``) or
                closed, or RocksDB failed.
        """
        self.wait()
        with self._lock:
            if self._closed:
                raise StateKeeperError(f"the local working copy {self.path} is closed")
            label = self._label
            if label is None:
                raise StateKeeperError(f"the local working copy {self.path} holds no version")
            if label.dirty and not dirty_ok:
                raise StateKeeperError(
                    f"the local working copy {self.path} is in the middle of the commit of "
                    f"version {label.version}: it holds no whole version to snapshot"
                )
            try:
                rocksdict.Checkpoint(self._db).create_checkpoint(path)
            except Exception as exc:  # rocksdict raises a bare Exception for every failure
                raise write_failure(
                    self.path, f"cannot create a checkpoint of {self.path} at {path}", exc
                ) from exc
            # The checkpoint flushed the memtables: the copy is durable up to here too.
            self._last_flush = time.monotonic()
        return label.version, label.attempt

    def flush_if_due(self) -> bool:
        """Flush the memtables if the local checkpoint interval has passed; True if flushed.

        The flush runs in RocksDB's background: a commit does not wait for it (a flush
        writes whole write batches, so whatever it leaves is a labelled version). Only when
        the disk has little more room than the memtable does the commit wait, so that a
        full disk is this commit's error, with its message, not a later write's.

        Raises:
            StateKeeperError: the flush failed, or could not be started.
        """
        self.wait()
        if time.monotonic() - self._last_flush < self._checkpoint_interval_s:
            return False
        held = self._db.property_int_value("rocksdb.cur-size-active-mem-table") or 0
        free = free_bytes(self.path)
        self.flush(wait=free is None or free < LOW_SPACE_BYTES + held)
        return True

    def flush(self, *, wait: bool = True) -> None:
        """Make the current committed version durable on local disk (with ``wait=False``:
        switch to a new memtable and flush the old one in the background).

        Raises:
            StateKeeperError: RocksDB failed the flush; the message says how full the disk is.
        """
        self.wait()
        try:
            with self._lock:
                self._db.flush(wait=wait)
        except Exception as exc:  # rocksdict raises a bare Exception for every failure
            raise write_failure(
                self.path, f"cannot flush the local working copy {self.path} to disk", exc
            ) from exc
        self._last_flush = time.monotonic()

    def close(self, *, flush: bool = True) -> None:
        """Flush (unless told not to) and release the database, always. Idempotent.

        A failed flush is logged, not raised: the versions it would have made durable
        locally are durable in the blob store, and the next open catches up from there.
        ``flush=False`` skips only this method's own flush: rocksdict's close flushes the
        memtables all the same (whole write batches, so what lands is a labelled version).
        """
        if self._closed:
            return
        try:
            self._wait_behind()  # also when damaged: never close under the write's feet
        except StateKeeperError as exc:
            _log.warning("%s; closing the copy anyway: the next open catches up", exc)
            self._behind = None
        try:
            if flush and self._damage is None:
                try:
                    self.flush()
                except StateKeeperError as exc:
                    _log.warning("%s; closing it anyway: the next open catches up", exc)
        finally:
            try:
                with self._lock:
                    self._closed = True
                    self._db.close()
            except Exception as exc:  # noqa: BLE001 - rocksdict raises a bare Exception
                # rocksdict has released the database all the same (its LOCK is free): a
                # close after a failed flush reports that flush's error again.
                _log.warning("closing the local working copy %s reported: %s", self.path, exc)
            finally:
                with _open_paths_lock:
                    _open_paths.discard(self.path)
        self._set_aside_if_damaged()

    def destroy(self) -> None:
        """Close and delete the working copy directory, its lineage record and its upload
        journal (which names files of this database only).

        Raises:
            StateKeeperError: the directory could not be deleted whole.
        """
        self.close(flush=False)
        delete_copy_folder(self.path)
        _remove_records_beside(self.path)
        _log.debug("removed local working copy %s", self.path)

    # -- snapshot lineage -----------------------------------------------------------------

    @property
    def lineage_path(self) -> str:
        """File beside the copy naming the snapshot its files descend from."""
        return _lineage_path(self.path)

    @property
    def lineage(self) -> tuple[str, int] | None:
        """(checkpoint id, version) of the snapshot this copy last uploaded or restored.

        RocksDB numbers its files per database, so file names are comparable with that
        snapshot's index only while this holds. The record names the database it was
        written for (its incarnation, see :func:`_incarnation`): a record of another
        database at this path (a snapshot of a copy since set aside, or closed and rebuilt
        by another backend, that ended late) reads as ``None``, as does an unknown one.
        """
        try:
            with open(self.lineage_path, encoding="utf-8") as fh:
                doc = json.load(fh)
            checkpoint_id, version = doc["checkpointId"], doc["version"]
            incarnation = doc["incarnation"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not isinstance(checkpoint_id, str) or not isinstance(version, int):
            return None
        if incarnation != self._incarnation:
            return None
        return checkpoint_id, version

    def set_lineage(self, checkpoint_id: str | None, version: int) -> None:
        """Record (or forget, with ``None``) the snapshot the copy's files descend from.

        Raises:
            StateKeeperError: the record cannot be written (a full disk, say).
        """
        if checkpoint_id is None:
            forget_lineage(self.path)
            return
        tmp = f"{self.lineage_path}.tmp"
        doc = {"checkpointId": checkpoint_id, "version": version, "incarnation": self._incarnation}
        try:
            with _LINEAGE_LOCK:  # a background snapshot and snapshot_now may finish together
                with open(tmp, "w", encoding="utf-8") as fh:
                    json.dump(doc, fh)
                os.replace(tmp, self.lineage_path)
        except OSError as exc:
            raise StateKeeperError(
                f"cannot record the lineage of the local working copy {self.path}: {exc}; "
                f"{disk_note(self.path)}"
            ) from exc


_LINEAGE_LOCK = threading.Lock()
"""Serialises the writes of lineage records (one temporary name per copy)."""


def _lineage_path(path: str) -> str:
    return path + ".lineage.json"


def upload_journal_path(path: str) -> Path:
    """The upload journal of the working copy at ``path``, beside it (see
    :mod:`statekeeper.snapshot._resume`)."""
    return Path(path + ".uploads.jsonl")


def forget_lineage(path: str) -> None:
    """Delete the lineage record of the working copy at ``path``, if any."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_lineage_path(os.path.abspath(path)))


_INCARNATION = "STATEKEEPER-INCARNATION"
"""A file of ours inside the copy's folder (RocksDB leaves files it does not name alone, and
a checkpoint, hence a snapshot, does not take it)."""


def _incarnation(path: str) -> str:
    """The random id of the database at ``path``, made when first asked for after the
    database was created or its files replaced (:func:`unmark_copy`): lineage records name
    it, so a record written for another database at this path is not trusted. A copy of
    an older release gets one now (its record, naming none, is not trusted once).

    Raises:
        OSError: the id cannot be read or written.
    """
    marker = os.path.join(path, _INCARNATION)
    try:
        with open(marker, encoding="ascii") as fh:
            found = fh.read().strip()
        if found:
            return found
    except FileNotFoundError:
        pass
    made = uuid.uuid4().hex
    tmp = f"{marker}.tmp"
    with open(tmp, "w", encoding="ascii") as fh:
        fh.write(made)
    os.replace(tmp, marker)
    return made


def copy_exists(path: str) -> bool:
    """Whether ``path`` holds a RocksDB database (its ``CURRENT`` file); a restore that
    replaces every file of a copy anyway need not create an empty database there first."""
    return os.path.exists(os.path.join(path, "CURRENT"))


def unmark_copy(path: str) -> None:
    """Take the database's ``CURRENT`` away (durably) before its files are replaced in
    place: a restore cut short then leaves a folder that holds no database
    (:func:`copy_exists` is false), which the next restore resumes into, keeping the files
    already there that match, instead of an old ``CURRENT`` over new files, which RocksDB
    cannot open and which was set aside whole."""
    with contextlib.suppress(FileNotFoundError):  # the files are another database's
        os.unlink(os.path.join(path, _INCARNATION))
    try:
        os.unlink(os.path.join(path, "CURRENT"))
    except FileNotFoundError:
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def delete_copy_folder(path: str) -> None:
    """Delete the folder of a working copy whole, or fail: a restore that opens the folder
    again next must never find part of the old database in it (changelogs replayed onto
    it would read back as the version, with another version's keys mixed in).

    Raises:
        StateKeeperError: something in it could not be deleted (what, and why).
    """

    def refuse(name: str, error: BaseException) -> None:
        if not isinstance(error, FileNotFoundError):  # gone already: that is the goal
            raise StateKeeperError(
                f"could not delete the local working copy {path}: {name}: {error}"
            ) from error

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda _f, name, error: refuse(name, error))
    else:
        shutil.rmtree(path, onerror=lambda _f, name, info: refuse(name, info[1]))


def _remove_records_beside(path: str) -> None:
    """Delete the lineage record and the upload journal beside a deleted copy: both name
    files of that database only."""
    for beside in (_lineage_path(path), upload_journal_path(path)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(beside)


def remove_unused_copy(path: str) -> bool:
    """Delete the working copy at ``path`` (with its lineage record and stale checkpoint
    folders) unless a process has it open; True if deleted. Folders set aside as damaged
    and the Spark layer's lock file beside it are kept.

    "Open" is told as :mod:`statekeeper.store._local_disk` tells it: this process's own set
    of open copies first (which also keeps the lock probe away from a lock this process
    holds), then RocksDB's ``LOCK``. The path is reserved meanwhile, so this process cannot
    open the copy while it is being deleted.
    """
    path = os.path.abspath(path)
    with _open_paths_lock:
        if path in _open_paths:
            return False
        _open_paths.add(path)
    try:
        try:
            with holding_lock(path, None):
                shutil.rmtree(path, ignore_errors=True)
        except StateKeeperError as exc:  # in use by another process, or cannot be told
            _log.debug("kept the local working copy %s: %s", path, exc)
            return False
        _remove_records_beside(path)
        # Imported here: the snapshot module imports this one. It keeps the folders of
        # uploads still running in this process.
        from statekeeper.store._snapshots import remove_stale_checkpoints

        remove_stale_checkpoints(path)
        with contextlib.suppress(OSError):  # not empty: an upload of this process runs
            os.rmdir(f"{path}.checkpoints")
    finally:
        with _open_paths_lock:
            _open_paths.discard(path)
    return not os.path.exists(path)
