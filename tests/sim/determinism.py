"""What it takes, beyond the baton, for a run to be a function of its seed.

Three sources of nondeterminism sit below the BlobStore, and each is pinned here:

* **uuids.** Blob ids are ``uuid4``; they decide the order of listings (which blob GC deletes
  first, where a page of a listing ends). :func:`seeded_uuids` draws them from streams of the
  seed, one per actor and one for library threads working for it (see :meth:`Sim.uuid4`).
* **RocksDB compaction.** A checkpoint flushes the memtable; the fourth level-0 file triggers a
  compaction on a RocksDB thread, and whether the checkpoint's file list is taken before or
  after it finishes is a race *inside* one call (so the next snapshot uploads 1 or 4 SST
  files). :func:`deterministic_rocksdb` turns automatic compactions off for the working
  copies of a run, and :func:`settle` compacts (synchronously, at a step boundary) once
  RocksDB would have: compaction still happens, at a point the seed decides.
* **Time.** GC compares blob ages with the wall clock: scenarios use an orphan TTL of 0 or
  1e9 s only; the local flush interval is 1e9 s (flushes happen at checkpoints and closes).
  GC reads the blob store's clock from a probe blob, reused for a minute of wall time:
  :func:`probe_every_gc` has every GC probe, so a seed makes the same blob calls however
  fast it runs. A writer re-reads a manifest it has known for a minute: never, or always
  (:func:`manifests_stale_after`).

The first two reach into private names of statekeeper (``store._rocks.options``,
``StateStore._copy._db`` and its ``wait``); if those change, :func:`deterministic_rocksdb`
raises rather than letting runs silently diverge (the determinism test would catch that
too).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import statekeeper as sk
from statekeeper import clock
from tests.sim.scheduler import DeterminismError, Sim

__all__ = [
    "deterministic_rocksdb",
    "manifests_stale_after",
    "probe_every_gc",
    "seeded_uuids",
    "settle",
]

_L0_COMPACTION_TRIGGER = 4  # RocksDB's default level0_file_num_compaction_trigger
_NEVER = 1 << 30


@contextlib.contextmanager
def seeded_uuids(sim: Sim) -> Iterator[None]:
    """``uuid.uuid4`` draws from :meth:`Sim.uuid4` for the duration of a run."""
    original = uuid.uuid4
    uuid.uuid4 = sim.uuid4
    try:
        yield
    finally:
        uuid.uuid4 = original


@contextlib.contextmanager
def probe_every_gc() -> Iterator[None]:
    """Every GC of a run writes its clock probe (none reuses an earlier one)."""
    original = clock.PROBE_REUSE_S
    clock.PROBE_REUSE_S = 0.0
    try:
        yield
    finally:
        clock.PROBE_REUSE_S = original


@contextlib.contextmanager
def manifests_stale_after(seconds: float) -> Iterator[None]:
    """A writer re-reads the newest manifest before writing one if it knew its own for
    longer than ``seconds`` (``STALE_AFTER_S``): 0 where every blob reads as old (a run's
    steps are then far apart), infinity elsewhere, so the wall clock never decides."""
    from statekeeper.store import _commit_point

    original = _commit_point.STALE_AFTER_S
    _commit_point.STALE_AFTER_S = seconds
    try:
        yield
    finally:
        _commit_point.STALE_AFTER_S = original


@contextlib.contextmanager
def deterministic_rocksdb() -> Iterator[None]:
    """Working copies opened meanwhile never compact on their own (see :func:`settle`), and
    open their table files in the calling thread.

    Raises:
        DeterminismError: statekeeper no longer builds RocksDB options where this expects.
    """
    from statekeeper.store import _rocks

    original: Callable[..., Any] | None = getattr(_rocks, "options", None)
    if original is None:
        raise DeterminismError(
            "statekeeper.store._rocks.options is gone: update tests/sim/determinism.py"
        )

    def options(*args: Any, **kwargs: Any) -> Any:
        opts = original(*args, **kwargs)
        opts.set_disable_auto_compactions(True)
        # ``WorkingCopy`` sets ``disable_auto_compactions`` again after this (off only for a
        # rescale's parent), so that alone let RocksDB compact level 0 on its own thread
        # once a checkpoint flushed the fourth file: a seed's snapshot then uploaded one
        # file or five, depending on the race. No level-0 file count triggers a compaction
        # (the stall triggers follow it up: RocksDB keeps them at or above it).
        opts.set_level_zero_file_num_compaction_trigger(_NEVER)
        # Speed only: every open starts this many threads (16 by default; strace shows 15
        # clones per open) to load table handles, which costs more than opening the few files
        # of a sim's copies in the calling thread; they are opened all the same.
        opts.set_max_file_opening_threads(1)
        return opts

    _rocks.options = options  # type: ignore[attr-defined]
    try:
        yield
    finally:
        _rocks.options = original  # type: ignore[attr-defined]


def settle(store: sk.StateStore) -> None:
    """Compact the store's working copy now if RocksDB would have done so by itself (once
    the last commit's write, which runs behind the commit, has landed)."""
    copy = getattr(store, "_copy", None)
    db = getattr(copy, "_db", None)
    if copy is None or db is None or store.closed:
        return
    try:
        copy.wait()
    except sk.StateKeeperError:
        return  # the store raises it at its next use
    if db.property_int_value("rocksdb.num-files-at-level0") >= _L0_COMPACTION_TRIGGER:
        db.compact_range(None, None)
