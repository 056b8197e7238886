"""Worker-side reuse of open stores between tasks, guarded by a cross-process file lock.

Spark keeps Python workers alive between tasks (``spark.python.worker.reuse``). A task of
micro-batch ``b`` needs its partition's store at version ``b``; the previous task of that
partition, if it ran in this worker, left the store open at exactly that version, so the
next one continues without reading anything. Otherwise the store is (re)opened at ``b``: the
local working copy is reused or caught up when it is at or behind ``b``, rebuilt from the
root when it is ahead (a re-run) or belongs to another root.

Where working copies live: ``StoreConfig.local_dir`` if set; otherwise the executor's own
Spark local directory (``SPARK_LOCAL_DIRS``, which Spark sets for its Python workers to the
executor's block manager folders under ``spark.local.dir``), so two executors never share a
working copy even on one host, and an executor's copies go away with it. Outside a Spark
worker the library default applies.

Without worker reuse (``spark.python.worker.reuse=false``, or without Spark's Python daemon)
a worker ends right after its task: the task closes its store before it ends
(:attr:`StoreSpec.keep_open`), so that nothing is left to background threads.

An open store holds its working copy's :class:`StoreLock` for as long as it stays cached.
A janitor thread per worker bounds what the worker holds (issue 12):

* it hands idle stores over to other processes that ask for them, each on a thread of its
  own: closing a store waits for that store's background snapshot upload (it reads a
  checkpoint beside the working copy), and must not hold up another store's handover. On
  Linux the asking process nudges it through a socket (:func:`janitor_address`), and it
  looks for every idle store's request then, and at least every ``_LOOK_ALL_EVERY_S``.
  Elsewhere (or with the socket's name taken) it notices a request within
  ``_JANITOR_POLL_S`` by the time of the folder the request file is made in (one ``stat``
  per operator folder, not one per idle store: a worker may hold hundreds). With no idle
  store it sleeps until its next sweep;
* it makes a store idle for ``IDLE_FLUSH_S`` durable (before Spark ends an idle worker,
  see there) and keeps it open: a task that wants it meanwhile waits for that flush. It
  closes stores idle for longer than ``IDLE_CLOSE_S``, and, while more stores are open than
  ``StoreConfig.max_open_stores`` (the smallest among the open stores' configs), the least
  recently used idle ones (their working copies stay on disk for the next task);
* before a task opens a store, while the process holds over 70% of its open-file limit (a
  store holds about 7 handles plus its SST files), the least recently used quarter of the
  idle stores is closed first, and the first store raises the soft limit to the hard one;
* every ``_SWEEP_EVERY_S`` it refreshes the lock files of the stores held (an age-based
  cleaner of temporary files would delete the lock of a store open for days, and another
  process could then lock its copy under it) and closes an idle store whose lock file is
  gone anyway (a task finds that too, and opens the copy again under a new lock); and it
  deletes the working copies of the roots this worker serves
  that no task has used for ``StoreConfig.local_copy_ttl_s`` (partitions that moved to
  another executor), never one that a process holds: the sweep takes the copy's
  :class:`StoreLock` without waiting, and the store layer checks RocksDB's own lock.

Their RocksDB memory (block cache and memtables) is shared by all stores of the process and
bounded by ``StoreConfig.rocksdb_memory_mb`` (see :class:`~statekeeper.StoreConfig`).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import errno
import logging
import math
import os
import resource
import select
import shutil
import socket
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from statekeeper.config import StoreConfig
from statekeeper.errors import StateKeeperError, StateNotFoundError
from statekeeper.keyed.grouping import sweep_dead_spills
from statekeeper.spark._filelock import StoreBusyError, StoreLock, janitor_address
from statekeeper.store import (
    RestoreInfo,
    StateBackend,
    StateStore,
    remove_unused_copy,
    set_aside_time,
)

__all__ = [
    "CACHE",
    "IDLE_CLOSE_S",
    "IDLE_FLUSH_S",
    "Lease",
    "StoreCache",
    "StoreSpec",
    "spill_dir",
    "worker_config",
    "worker_root",
]

_log = logging.getLogger("statekeeper.spark")
_JANITOR_POLL_S = 0.01
_LOOK_ALL_EVERY_S = 1.0
"""Seconds between the janitor's looks for every idle store's request file, however the
times of their folders look (a folder time too coarse to show a second change, a file
system that does not keep it)."""
_RECENT_NS = 200_000_000
"""A folder changed this recently may change again within one tick of its coarse clock,
which its time would not show: its requests are looked for on every pass."""
IDLE_FLUSH_S = 30.0
"""Seconds without a task after which an open store is made durable (:meth:`StateStore.flush`)
and kept open. Spark stops an executor's idle Python workers (of one Python and environment)
once no task has ended in any of them for a minute, checked every ten seconds, and a worker
ends without running exit handlers: a store not flushed then loses its buffered commit
metrics and the writes not yet flushed to local disk, which the next task has to replay
from the root. Flushing after half that time makes them durable first. The store stays open
(closing it would make every micro-batch reopen every store of a query triggered every
30 to 60 seconds); a worker that lives on serves the next task from it."""
IDLE_CLOSE_S = 600.0
"""Seconds a store stays open without a task: one whose partition moved to another executor,
or of a query that stopped, lets go of its share of the worker's memory and file handles,
and its working copy becomes the local sweep's to delete once unused for long enough."""
_SWEEP_EVERY_S = 60.0


@dataclass(frozen=True)
class StoreSpec:
    """Where a task's stores live; picklable and hashable, credentials kept out of repr."""

    root: str
    operator: str
    partitions: int
    config: StoreConfig
    storage_options: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    lock_timeout_s: float = 120.0
    keep_open: bool = True
    """Whether a task leaves its store open for the worker's next task. ``False`` where
    Spark does not reuse Python workers (``spark.python.worker.reuse=false``, or
    ``spark.python.use.daemon=false``): a worker then ends right after its task (without
    running exit handlers, or, without the daemon, after Spark counted the task done), and
    the work a store leaves to background threads (its due snapshot's upload, its buffered
    commit metrics, its memtable's flush) would end with it or hold the store's lock past
    the task, so each task closes its store itself."""

    @staticmethod
    def options(storage_options: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
        """Storage options in the hashable form this spec holds."""
        return tuple(sorted((str(k), str(v)) for k, v in (storage_options or {}).items()))


@dataclass
class Lease:
    """A store handed to one task; give it back with :meth:`StoreCache.release`."""

    store: StateStore
    reused: bool
    """True if the store was already open in this worker at the version asked for."""
    open_s: float
    """Seconds spent getting the store (lock wait, open and restore)."""
    restore: RestoreInfo | None
    """How the store was opened; ``None`` when reused."""
    entry: _Entry = field(repr=False)
    keep_open: bool = True
    """:attr:`StoreSpec.keep_open` of the spec it was acquired with: whether
    :meth:`StoreCache.release` keeps it open after a successful task."""


@dataclass(eq=False)
class _Entry:
    key: tuple[str, str, int]
    backend: StateBackend
    lock: StoreLock
    store: StateStore | None = None
    partitions: int = 0
    """The operator's partition count the store was opened under: after a rescale
    (``statekeeper repartition``) the store at the same version holds other keys."""
    generation: int | None = None
    """The operator's run (generation) the store was opened in: a restarted query may re-run
    the last batch elsewhere and replace the version this store holds."""
    busy: bool = False
    idle_since: float = field(default_factory=time.monotonic)
    durable: bool = False
    """Flushed since its last task (:data:`IDLE_FLUSH_S`)."""
    queued: bool = False
    """Waiting for the cache's flusher thread."""
    flushing: threading.Event | None = None
    """Set once the flush under way ends (the entry is ``busy`` meanwhile)."""

    @property
    def path(self) -> str:
        """The working copy's folder."""
        return self.key[0]


class StoreCache:
    """Open backends and stores of one worker process. Thread-safe."""

    def __init__(
        self, idle_close_s: float = IDLE_CLOSE_S, idle_flush_s: float = IDLE_FLUSH_S
    ) -> None:
        """An empty cache whose janitor makes stores idle for ``idle_flush_s`` seconds
        durable and closes those idle for ``idle_close_s`` seconds."""
        self._idle_close_s = idle_close_s
        self._idle_flush_s = idle_flush_s
        self._mutex = threading.Lock()
        self._backends: dict[tuple[object, ...], StateBackend] = {}
        self._entries: dict[tuple[str, str, int], _Entry] = {}
        # Folder of each root's working copies this worker served -> their local_copy_ttl_s.
        self._roots: dict[str, float] = {}
        self._wake = _Waker()
        self._janitor: tuple[threading.Thread, threading.Event] | None = None
        self._closing: list[threading.Thread] = []
        """Threads closing stores the janitor took out of the cache."""
        self._flush_queue: collections.deque[_Entry] = collections.deque()
        self._flusher: threading.Thread | None = None
        """The thread flushing the queued idle stores, one at a time (while any is queued)."""

    def backend(self, spec: StoreSpec) -> StateBackend:
        """The (cached) backend of ``spec``'s root and config.

        Raises:
            StateKeeperError, ValueError: as :class:`StateBackend`.
        """
        key = (spec.root, spec.config, spec.storage_options)
        with self._mutex:
            backend = self._backends.get(key)
        if backend is None:
            backend = StateBackend(
                spec.root,
                config=worker_config(spec.config),
                storage_options=dict(spec.storage_options) or None,
            )
            with self._mutex:
                kept = self._backends.setdefault(key, backend)
            if kept is not backend:  # another thread made one first: use it, close ours
                backend.close()
            backend = kept
        return backend

    def acquire(
        self, spec: StoreSpec, partition: int, version: int, generation: int | None = None
    ) -> Lease:
        """The store of (``spec.operator``, ``partition``) at exactly ``version``, for one task
        of the operator's run ``generation``.

        A store left open by an earlier task is reused only at that version and in the same
        run: after a restart, the re-run of the last batch may have run on another executor
        and replaced the version this store holds, so the store is opened again (which checks
        its working copy against the root). Within a run the commit protocol refuses a store
        built on a replaced version (``CommitConflictError``; the task's retry reopens it).
        Nor is a store whose last commit could not be written to its working copy (a full
        local disk): the commit stands, and the store is opened again from the root.

        Raises:
            StoreBusyError: another process kept the working copy locked, or a flush of it
                in this process went on, for longer than ``spec.lock_timeout_s``.
            StateNotFoundError: ``version`` is not in the root (the message says why).
            StateKeeperError: the store is already leased in this process, or opening failed.
        """
        started = time.perf_counter()
        entry = self._checkout(spec, partition)
        try:
            store, info = entry.store, None
            # A query defined again in this application with another StoreConfig: its
            # stores are opened with that config, by its backend.
            backend = self.backend(spec)
            if store is not None and (
                not store.ready()  # closed, or its last commit's local write failed
                or store.version != version
                or entry.partitions != spec.partitions
                or entry.generation != generation
                or entry.backend is not backend
            ):
                store.close()
                store = entry.store = None
            if entry.backend is not backend:
                # The old backend's snapshot of this copy must be done before another
                # backend rebuilds it (its lineage would land on the rebuilt copy).
                entry.backend.wait_for_snapshots(spec.operator, partition)
                entry.backend = backend
            if store is None:
                store = _open(entry.backend, spec, partition, version)
                entry.store, info = store, store.restore_info
                entry.partitions = spec.partitions
                entry.generation = generation
        except BaseException:
            self._evict(entry)
            raise
        return Lease(
            store, info is None, time.perf_counter() - started, info, entry, spec.keep_open
        )

    def ask(self, spec: StoreSpec, partition: int) -> None:
        """Ask ahead for the working copy of (``spec.operator``, ``partition``), which this
        worker's task will :meth:`acquire` once it has read its input: another worker of
        this host holding the store idle hands it over meanwhile instead of after the
        input (a handover costs tens of milliseconds; on ``local[2]`` about half the stores
        of a micro-batch change workers, as Spark gives a task any idle worker). Nothing is
        asked for a store this worker holds. Only a request file is written: should the
        task never acquire, the holder at most reopens its store for its next task.

        Raises:
            StateKeeperError, ValueError: as :class:`StateBackend`.
        """
        backend = self.backend(spec)
        key = _entry_key(backend, spec, partition)
        with self._mutex:
            if key in self._entries:
                return
        StoreLock(key[0]).ask()

    def release(self, lease: Lease, *, ok: bool) -> None:
        """Give a store back: kept open if the task succeeded, closed and forgotten if not.

        A store acquired with :attr:`StoreSpec.keep_open` off is closed after a successful
        task too, before this returns: its write-behind applied, its memtable flushed, its
        metrics written and its due snapshot uploaded. A failure there is logged, not
        raised: the commit stands, and the next open catches the copy up.
        """
        if not ok:
            self._evict(lease.entry)
            return
        if not lease.keep_open:
            self._evict(lease.entry, logged=True)
            return
        with self._mutex:
            lease.entry.busy = False
            lease.entry.durable = lease.entry.queued = False
            lease.entry.idle_since = time.monotonic()
        self._wake.set()  # a request may have come in while the task ran

    def close_all(self) -> None:
        """Close every idle store and release its lock, stop the janitor, and wait for the
        closes and flushes it started (at worker exit, and in tests). The next store
        acquired starts a janitor again."""
        with self._mutex:
            janitor, self._janitor = self._janitor, None
        if janitor is not None:
            thread, stop = janitor
            stop.set()
            self._wake.set()
            if thread is not threading.current_thread():
                thread.join()
        with self._mutex:  # the janitor starts no more threads: wait for those it started
            for entry in self._flush_queue:
                entry.queued = False
            self._flush_queue.clear()
            flusher = self._flusher
            closing, self._closing = self._closing, []
        for thread in [*closing, *([] if flusher is None else [flusher])]:
            thread.join()
        with self._mutex:
            idle = [e for e in self._entries.values() if not e.busy]
            for entry in idle:
                del self._entries[entry.key]
        for entry in idle:
            _shutdown(entry)

    def open_keys(self) -> list[tuple[str, str, int]]:
        """(working copy, operator, partition) of every store open in this process."""
        with self._mutex:
            return sorted(self._entries)

    def _checkout(self, spec: StoreSpec, partition: int) -> _Entry:
        backend = self.backend(spec)
        key = _entry_key(backend, spec, partition)
        path = key[0]
        # <local_dir>/<root key>/<operator>/<partition>: the sweep stays inside this root.
        root_folder = os.path.dirname(os.path.dirname(path))
        ttl = backend.config.local_copy_ttl_s
        deadline = time.monotonic() + spec.lock_timeout_s
        while True:
            lost = None
            with self._mutex:
                self._roots[root_folder] = min(ttl, self._roots.get(root_folder, ttl))
                entry = self._entries.get(key)
                flushing = None if entry is None else entry.flushing
                if entry is not None and flushing is None:
                    if entry.busy:
                        raise StateKeeperError(
                            f"store {spec.operator}/{partition} is already in use by another "
                            "task in this process"
                        )
                    if entry.lock.keep():
                        entry.busy = True
                        return entry
                    lost = entry
                    del self._entries[key]
            if lost is not None:
                _close_lost(lost)  # and open it again below, under a lock that guards it
                break
            if flushing is None:
                break
            # The idle store is being flushed: milliseconds, unless the flush met damage and
            # rebuilds the copy; then as long as a wait for another process's lock.
            if not flushing.wait(max(0.0, deadline - time.monotonic())):
                raise StoreBusyError(
                    f"the working copy of {spec.operator}/{partition} is still being flushed "
                    f"by this process after {spec.lock_timeout_s:g} s (lock_timeout_s)"
                )
        self._relieve_file_pressure()
        lock = StoreLock(path)
        waited = lock.acquire(max(0.0, deadline - time.monotonic()))
        if waited > 0.5:
            _log.info(
                "waited %.2f s for the working copy of %s/%s", waited, spec.operator, partition
            )
        entry = _Entry(key, backend, lock, busy=True)
        with self._mutex:
            self._entries[key] = entry
        self._start_janitor()
        self._wake.set()  # one more open: the budget may be exceeded
        return entry

    def _relieve_file_pressure(self) -> None:
        """Before a store is opened: while this process holds over 70% of its open-file
        limit, close the least recently used quarter of the idle stores (and wait for them).
        Each open store holds about 7 file handles plus its SST files; with many partitions
        per worker, ``max_open_stores`` stores can outgrow a limit of 1024, and RocksDB then
        fails the task (the janitor's closes run in the background: too late for an open
        now)."""
        if not _under_file_pressure():
            return
        with self._mutex:
            idle = sorted((e for e in self._entries.values() if not e.busy), key=_idle_since)
            doomed = idle[: max(1, len(self._entries) // 4)]
            threads, unstarted = self._close_taken_out(doomed)
        for entry in unstarted:
            _shutdown_logged(entry)
        for thread in threads:
            thread.join()
        if doomed:
            _log.info(
                "closed %s idle stores: this process holds over %d%% of its open-file limit",
                len(doomed), int(_FILE_PRESSURE * 100),
            )  # fmt: skip

    def _close_taken_out(self, doomed: list[_Entry]) -> tuple[list[threading.Thread], list[_Entry]]:
        """Take ``doomed`` (idle stores) out of the cache and close each on a thread of its
        own (a store waiting for its snapshot upload must not hold up another); returns the
        threads, and the stores no thread could be started for (the process is out of
        threads): the caller closes those itself, once it let go of the mutex. Called
        holding the mutex, so :meth:`close_all` never misses a close."""
        threads: list[threading.Thread] = []
        unstarted: list[_Entry] = []
        for entry in doomed:
            del self._entries[entry.key]
            thread = threading.Thread(
                target=_shutdown_logged, args=(entry,), name="statekeeper-close"
            )
            try:
                thread.start()
            except RuntimeError as exc:  # "can't start new thread"
                _log.warning("closing the store of %s on this thread: %s", entry.path, exc)
                unstarted.append(entry)
            else:
                threads.append(thread)
        if threads:
            self._closing = [t for t in self._closing if t.is_alive()] + threads
        return threads, unstarted

    def _queue_flushes(self, entries: list[_Entry]) -> None:
        """Queue ``entries`` (idle stores) for the flusher thread, which flushes one at a
        time: a task that wants a store waits at most for that store's own flush, and many
        stores going idle together start no thread each. Called holding the mutex."""
        for entry in entries:
            entry.queued = True
            self._flush_queue.append(entry)
        if not entries or self._flusher is not None:
            return
        flusher = threading.Thread(target=self._flush_queued, name="statekeeper-flush")
        try:
            flusher.start()
        except RuntimeError as exc:  # "can't start new thread": skip this idle spell's flush
            _log.warning("could not flush %s idle stores: %s", len(self._flush_queue), exc)
            for entry in self._flush_queue:
                entry.queued, entry.durable = False, True
            self._flush_queue.clear()
            return
        self._flusher = flusher

    def _flush_queued(self) -> None:
        """The flusher thread: flush the queued stores still idle in the cache, one at a
        time, until none is left (should it fail, the next flush queued starts another)."""
        try:
            while True:
                with self._mutex:
                    entry = None
                    while entry is None and self._flush_queue:
                        queued = self._flush_queue.popleft()
                        held = self._entries.get(queued.key) is queued
                        if queued.queued and not queued.busy and held:
                            entry = queued
                        queued.queued = False  # a task took it, or it is queued again later
                    if entry is None:
                        self._flusher = None  # in this hold: a flush queued next starts one
                        return
                    entry.busy, entry.flushing = True, threading.Event()
                self._flush_one(entry)
        except BaseException:
            with self._mutex:
                if self._flusher is threading.current_thread():
                    self._flusher = None
            raise

    def _flush_one(self, entry: _Entry) -> None:
        """Flush a store marked as being flushed and give it back to the cache; one that
        cannot be flushed (a full local disk, a failed write, any error) is closed: the
        next task reopens it, from the root if need be."""
        failed = True
        try:
            if entry.store is not None:  # always, for an idle store
                entry.store.flush()
            failed = False
        except Exception:  # noqa: BLE001 - whatever it was, the store must not stay busy
            _log.warning("could not flush the idle store of %s; closing it", entry.path,
                         exc_info=True)  # fmt: skip
        finally:
            with self._mutex:
                done, entry.flushing = entry.flushing, None
                entry.busy, entry.durable = False, True
                if failed and self._entries.get(entry.key) is entry:
                    del self._entries[entry.key]
            try:
                if failed:
                    _shutdown_logged(entry)
            finally:
                if done is not None:
                    done.set()
                # Idle again (or closed): the janitor skipped it while it was busy, so its
                # folder is not among those it watches, and a request may have come in.
                self._wake.set()

    def _evict(self, entry: _Entry, *, logged: bool = False) -> None:
        with self._mutex:
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
        (_shutdown_logged if logged else _shutdown)(entry)

    def _start_janitor(self) -> None:
        with self._mutex:
            if self._janitor is not None:
                return
            stop = threading.Event()
            thread = threading.Thread(
                target=self._janitor_loop, args=(stop,), name="statekeeper-janitor", daemon=True
            )
            self._janitor = thread, stop
        _raise_file_limit()  # the first store of this worker (or since close_all)
        thread.start()

    def _janitor_loop(self, stop: threading.Event) -> None:
        listening: socket.socket | None = None  # this janitor's socket, while it has one
        last_sweep, last_listen = time.monotonic(), -math.inf
        watch = _RequestWatch()
        # The folders of the idle stores, and when the first of them is idle too long: as of
        # the last pass over the stores. Stores become idle only in a release, which wakes
        # the janitor, so nothing else needs a pass over them (a worker may hold hundreds).
        folders: set[str] = set()
        due = math.inf
        try:
            while not stop.is_set():
                now = time.monotonic()
                if listening is None and now - last_listen >= _LOOK_ALL_EVERY_S:
                    last_listen = now  # the name may be taken by a janitor still ending
                    listening = self._wake.listen()
                until = last_sweep + _SWEEP_EVERY_S - now
                if folders:  # idle stores: requests to look for, flushes and closes due
                    poll = _LOOK_ALL_EVERY_S if listening is not None else _JANITOR_POLL_S
                    until = min(until, poll, due - now)
                # Cleared only when seen set, and before this pass looks everywhere: a wake
                # that comes later is seen next pass, none is lost in between.
                woken = self._wake.wait(max(until, 0.0))
                if stop.is_set():
                    return
                now = time.monotonic()
                # Woken (a store released or opened, a request made): look everywhere.
                look = watch.folders(folders, everything=woken)
                if look is None or look or now >= due:
                    folders, due = self._close_doomed(now, look)
                if time.monotonic() - last_sweep >= _SWEEP_EVERY_S:
                    last_sweep = time.monotonic()
                    self.keep_locks()
                    try:
                        self.sweep_local_copies()
                    except (StateKeeperError, OSError):
                        _log.exception("could not sweep unused local working copies")
                    if left := sweep_dead_spills(spill_dir()):
                        _log.info("deleted the spilled input of workers that ended: %s", left)
        finally:
            self._wake.unlisten(listening)

    def _close_doomed(
        self, now: float, folders: Collection[str] | None = None
    ) -> tuple[set[str], float]:
        """Take out of the cache the idle stores to close now (asked for by another
        process, idle too long, or the least recently used beyond the open-store budget)
        and close each on a thread of its own: a store waiting for its snapshot upload must
        not hold up the handover of another. The threads start in the same hold of the
        mutex that takes the stores out, so :meth:`close_all` never misses a close under
        way. Of the stores kept, those idle for ``idle_flush_s`` and not flushed since
        their last task are flushed, each on a thread of its own too. Requests are looked
        for only for copies in ``folders`` (default: all).

        Returns:
            The folders of the stores kept idle, and when the first of them is due for a
            flush or a close (``math.inf`` if none).
        """
        doomed: list[_Entry] = []
        keep: list[_Entry] = []
        with self._mutex:
            for entry in sorted(self._entries.values(), key=_idle_since):
                if entry.busy:
                    continue
                look = folders is None or os.path.dirname(entry.path) in folders
                asked = (look and entry.lock.requested()) or (
                    now - entry.idle_since > self._idle_close_s
                )
                (doomed if asked else keep).append(entry)
            budget = min((e.backend.config.max_open_stores for e in self._entries.values()),
                         default=0)  # fmt: skip
            over = keep[: max(0, len(self._entries) - len(doomed) - budget)]  # LRU first
            doomed += over
            _, unstarted = self._close_taken_out(doomed)
            kept = keep[len(over) :]
            self._queue_flushes(
                [e for e in kept
                 if not (e.durable or e.queued) and now - e.idle_since > self._idle_flush_s]
            )  # fmt: skip
            due = min(
                (e.idle_since + (self._idle_close_s if e.durable or e.queued
                                 else self._idle_flush_s)
                 for e in kept),
                default=math.inf,
            )  # fmt: skip
        for entry in unstarted:
            _shutdown_logged(entry)
        if over:
            _log.debug("closing %s idle stores beyond max_open_stores=%s", len(over), budget)
        return {os.path.dirname(e.path) for e in kept}, due

    def keep_locks(self) -> list[str]:
        """Refresh the lock files of every store held (:meth:`StoreLock.keep`: an age-based
        cleaner of temporary files would otherwise delete the lock of a store that stays
        open for days), and close the idle stores whose lock file is gone or replaced; a
        busy one is closed when its task next asks for it. Returns the lock files lost."""
        with self._mutex:
            lost = [e for e in self._entries.values() if not e.lock.keep()]
            idle = [e for e in lost if not e.busy]
            for entry in idle:
                del self._entries[entry.key]
        for entry in idle:
            _close_lost(entry)
        return [e.lock.path for e in lost]

    def sweep_local_copies(self, now: float | None = None) -> list[str]:
        """Delete the working copies of the roots this worker served that no task has used
        for their config's ``local_copy_ttl_s`` (as of ``now``, ``time.time()`` seconds), and
        the copies set aside as damaged that long ago; returns the folders deleted. A copy
        held by any process is kept.
        """
        now = time.time() if now is None else now
        with self._mutex:
            roots = dict(self._roots)
            held = {e.path for e in self._entries.values()}
        removed: list[str] = []
        for folder, ttl in sorted(roots.items()):
            for path in _copies_under(folder):
                if path not in held and _unused_for(path, now) >= ttl and _remove(path, ttl, now):
                    removed.append(path)
            # A copy set aside as damaged is kept for inspection as long as an unused copy
            # is, whether or not its copy is still in use, or still there.
            for aside in _copies_under(folder, set_aside=True):
                when = set_aside_time(aside)
                if when is not None and now - when >= ttl:
                    shutil.rmtree(aside, ignore_errors=True)
                    removed.append(aside)
        if removed:
            _log.info(
                "deleted %s local working copies unused for their local_copy_ttl_s: %s",
                len(removed), ", ".join(removed),
            )  # fmt: skip
        return removed


class _Waker:
    """Wakes the janitor: :meth:`set` in this process; on Linux, once :meth:`listen` bound
    the process's janitor socket, also a datagram another process sent there
    (:meth:`StoreLock.ask`)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._socket: socket.socket | None = None

    @property
    def listening(self) -> bool:
        """Whether other processes can wake the janitor (else it polls for requests)."""
        return self._socket is not None

    def listen(self) -> socket.socket | None:
        """Bind this process's janitor socket, if there is one and it is free (called by
        the janitor thread, which closes it with :meth:`unlisten` when it ends); returns
        it, or ``None``."""
        address = janitor_address(os.getpid())
        if address is None or self._socket is not None:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(address)  # taken: another cache (tests), or a janitor still ending
        except OSError as exc:
            sock.close()
            _log.debug("the janitor polls for requests: %s", exc)
            return None
        sock.setblocking(False)
        self._socket = sock
        return sock

    def unlisten(self, sock: socket.socket | None) -> None:
        """Close ``sock``, a socket :meth:`listen` returned."""
        if sock is None:
            return
        if self._socket is sock:
            self._socket = None
        sock.close()

    def set(self) -> None:
        """Wake the janitor."""
        self._event.set()
        sock = self._socket
        if sock is not None:
            with contextlib.suppress(OSError):  # closed meanwhile, or a full queue: it wakes
                sock.sendto(b"", sock.getsockname())

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a wake; True if woken (and then cleared)."""
        sock = self._socket
        if self._event.is_set() or sock is None:
            woken = self._event.wait(timeout)
        else:
            # poll(), not select(): a worker holding many stores may give the socket a
            # descriptor above select()'s 1024 (then the janitor would never sleep).
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            with contextlib.suppress(OSError, ValueError):  # closed by close_all
                poller.poll(timeout * 1000)
            woken = self._event.is_set()
        if woken:  # cleared only when seen set: a set() after this is seen next time
            self._event.clear()
        if sock is not None:
            with contextlib.suppress(OSError):
                while True:  # drain: one pass answers every wake so far
                    sock.recv(64)
                    woken = True
        return woken


class _RequestWatch:
    """Which folders of idle working copies may hold a request file the janitor has not
    seen: making one changes its folder's time (:meth:`StoreLock.ask`)."""

    def __init__(self) -> None:
        self._seen: dict[str, int | None] = {}
        self._all_at = -math.inf

    def folders(self, folders: set[str], *, everything: bool) -> set[str] | None:
        """Those of ``folders`` to look for requests in now; ``None``: look in all (woken
        with ``everything``, or ``_LOOK_ALL_EVERY_S`` after the last look in all). A folder's
        time is read before its requests are looked for, so a request made after the look
        changes it."""
        now = time.monotonic()
        times = {folder: _mtime_ns(folder) for folder in folders}
        if everything or now - self._all_at >= _LOOK_ALL_EVERY_S:
            self._seen, self._all_at = times, now
            return None
        wall = time.time_ns()
        changed = {
            folder
            for folder, mtime in times.items()
            if mtime is None or mtime != self._seen.get(folder) or wall - mtime < _RECENT_NS
        }
        self._seen = times
        return changed


def _mtime_ns(folder: str) -> int | None:
    try:
        return os.stat(folder).st_mtime_ns
    except OSError:
        return None


def _entry_key(backend: StateBackend, spec: StoreSpec, partition: int) -> tuple[str, str, int]:
    """A store's key in the cache: its working copy's folder (one lock per folder, whichever
    root URI spelling), operator and partition."""
    return (backend.local_path(spec.operator, partition), spec.operator, partition)


def _idle_since(entry: _Entry) -> float:
    return entry.idle_since


def _copies_under(root_folder: str, *, set_aside: bool = False) -> list[str]:
    """Working copy folders of one root: ``<operator>/<partition>`` below its folder (with
    ``set_aside``: the copies set aside as damaged there, ``<partition>.damaged-*``)."""
    copies: list[str] = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(root_folder) as ops:
        for operator in [op for op in ops if op.is_dir(follow_symlinks=False)]:
            with contextlib.suppress(FileNotFoundError), os.scandir(operator.path) as children:
                copies.extend(
                    c.path
                    for c in children
                    if c.is_dir(follow_symlinks=False)
                    and (_is_set_aside(c.name) if set_aside else c.name.isdigit())
                )
    return sorted(copies)


def _is_set_aside(name: str) -> bool:
    partition, mark, _ = name.partition(".damaged-")
    return bool(mark) and partition.isdigit()


def _unused_for(path: str, now: float) -> float:
    """Seconds since the copy at ``path`` was last used: its lock file's time (set when a
    task lets go of it), or the copy's own folder and lineage record if newer."""
    times = [StoreLock(path).last_used()]
    for name in (path, f"{path}.lineage.json"):
        with contextlib.suppress(OSError):
            times.append(os.stat(name).st_mtime)
    return now - max((t for t in times if t is not None), default=now)


def _remove(path: str, ttl: float, now: float) -> bool:
    """Delete the copy at ``path`` if no process holds it and it is still unused (asked
    again under the lock: a task may have used it meanwhile)."""
    lock = StoreLock(path)
    if not lock.try_acquire():
        return False
    try:
        return _unused_for(path, now) >= ttl and remove_unused_copy(path)
    finally:
        lock.release()


_FILE_PRESSURE = 0.7
_FD_FOLDERS = ("/proc/self/fd", "/dev/fd")


def _under_file_pressure() -> bool:
    """Whether this process holds more than :data:`_FILE_PRESSURE` of its open-file limit
    (``False`` where that cannot be told)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return False
    for folder in _FD_FOLDERS:
        try:
            held = len(os.listdir(folder))
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                return True  # listing takes a handle: none is left
            continue
        return held > soft * _FILE_PRESSURE
    return False


def _raise_file_limit() -> None:
    """Raise this process's soft open-file limit to its hard limit, as the JVM does for
    itself: a worker holding many stores needs the handles, and only the hard limit is a
    policy (a failure leaves the limit as it was)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    for wanted in _FILE_LIMITS:  # an unlimited hard limit still has the kernel's cap
        wanted = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
        if soft >= wanted:
            return
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            return
        except (ValueError, OSError) as exc:
            _log.debug("could not raise the open-file limit from %s to %s: %s", soft, wanted, exc)


_FILE_LIMITS = (1 << 20, 10240)
"""Soft limits tried in turn: Linux's usual cap, then macOS's ``OPEN_MAX``."""


def worker_root(checkpoint: str, backend: StateBackend) -> str:
    """The root as workers must open it: a relative local path would resolve in their own
    working folder (another root on every executor), so the absolute one the driver's
    ``backend`` resolved."""
    return checkpoint if "://" in checkpoint else backend.blobs.uri


def worker_config(config: StoreConfig) -> StoreConfig:
    """``config`` with ``local_dir`` defaulted to this executor's Spark local directory."""
    if config.local_dir is not None:
        return config
    spark_dir = spill_dir()
    if spark_dir is None:
        return config
    return dataclasses.replace(config, local_dir=os.path.join(spark_dir, "statekeeper"))


def spill_dir() -> str | None:
    """This executor's Spark local directory (Spark gives its Python workers
    ``SPARK_LOCAL_DIRS``), where a task spills its input; ``None``: not in a Spark worker
    (the system's temporary folder is used)."""
    spark_dirs = [d for d in os.environ.get("SPARK_LOCAL_DIRS", "").split(",") if d.strip()]
    return spark_dirs[0] if spark_dirs else None


def _open(backend: StateBackend, spec: StoreSpec, partition: int, version: int) -> StateStore:
    try:
        return backend.open(spec.operator, partition, version, partitions=spec.partitions)
    except StateNotFoundError as exc:
        versions = backend.versions(spec.operator, partition)
        held = f"versions {versions[0]}..{versions[-1]}" if versions else "no version"
        raise StateNotFoundError(
            f"micro-batch {version} of operator {spec.operator!r} needs version {version} of "
            f"partition {partition}, but the checkpoint root holds {held}: the streaming "
            "query's checkpointLocation and the state root disagree (a new checkpointLocation "
            "on an old root, or the reverse), or an earlier micro-batch did not run this "
            f"operator ({exc})"
        ) from exc


def _shutdown(entry: _Entry) -> None:
    """Close the store, let its snapshot upload finish, then unlock the working copy.

    An upload runs from a checkpoint folder beside the working copy; the next process to
    open the copy deletes such folders as stale, so the lock is held until it is done. Only
    this store's upload is waited for, and run next if queued: the other stores' uploads
    (one thread per backend) do not touch this copy. It is waited for even when the store
    was closed already (an acquire that closed it and failed to reopen) or its close
    failed.
    """
    _, operator, partition = entry.key
    try:
        store, entry.store = entry.store, None
        if store is not None:
            store.close()
    finally:
        try:
            entry.backend.wait_for_snapshots(operator, partition)
        finally:
            entry.lock.release()


def _close_lost(entry: _Entry) -> None:
    """Close an idle store whose lock file was deleted or replaced (:meth:`StoreLock.keep`):
    another process could take a lock of that name. Its close may still flush into the
    folder (unless the idle flush did already); RocksDB's own ``LOCK`` in the folder keeps
    another process from having opened the copy meanwhile, unless that was deleted too."""
    _log.warning(
        "the lock file %s of a working copy this process holds open was deleted or replaced "
        "(by a cleaner of temporary files?): the store is closed and the copy opened again "
        "under a new lock; keep working copies out of such a cleaner's reach "
        "(docs/operations.md)",
        entry.lock.path,
    )
    _shutdown_logged(entry)


def _shutdown_logged(entry: _Entry) -> None:
    try:
        _shutdown(entry)
    except Exception:  # noqa: BLE001 - the janitor and the flusher must survive
        _log.exception("could not release the store of %s", entry.path)


CACHE = StoreCache()
"""The cache of this Python process."""

atexit.register(CACHE.close_all)
