"""The blob store's clock: what garbage collection measures ages with.

Every age GC compares is "now" minus a blob's ``last_modified``, and the blob store stamps
that: an object store by its own clock, a filesystem by its host's (for a network
filesystem, usually the file server's). A GC host whose clock runs ahead of the store's
by more than ``orphan_ttl_s`` would take young blobs for old ones, and sweep the changelog
of a commit that has not named it yet, or a snapshot's files still uploading: the version
then named has no blob. So GC's "now" is the earlier of this host's clock and the store's,
read from a probe blob it writes, heads and deletes. A probe is reused for a minute, moved
on by the monotonic clock (which NTP steps do not move), so a process whose background GC
runs after every snapshot probes at most once a minute per root.

Both readings can only err early: the store stamped the probe before the write returned,
and S3 truncates stamps to the second. An early "now" keeps blobs longer, never shorter.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

from statekeeper import layout
from statekeeper.storage import BlobStore

__all__ = ["PROBE_REUSE_S", "gc_now", "store_now", "sweep_probes"]

PROBE_REUSE_S = 60.0
"""Seconds one probe of a root's clock is reused for."""
_PROBE_MAX_AGE_S = 3600.0
_lock = threading.Lock()
_probes: dict[str, tuple[float, float]] = {}  # root URI -> (store time, monotonic time)

wall_clock: Callable[[], float] = time.time
"""This host's clock (seconds since the epoch); replaced by tests to skew it."""


def store_now(blobs: BlobStore) -> float:
    """Now by the clock of ``blobs``, never later than it (a fresh probe, or one reused for
    :data:`PROBE_REUSE_S` seconds).

    Raises:
        StorageError: the probe could not be written or read back.
    """
    with _lock:
        cached = _probes.get(blobs.uri)
    if cached is not None and time.monotonic() - cached[1] < PROBE_REUSE_S:
        return cached[0] + (time.monotonic() - cached[1])
    key = layout.clock_probe_key(uuid.uuid4().hex)
    blobs.put(key, b"")
    try:
        stamped = blobs.head(key).last_modified
        # The stamp was taken before put returned: measuring from after head returned errs
        # early, as it must.
        read_at = time.monotonic()
    finally:
        blobs.delete_many([key])
    with _lock:
        _probes[blobs.uri] = (stamped, read_at)
    return stamped


def gc_now(blobs: BlobStore, *, probe: bool = True) -> float:
    """The "now" GC compares ages with: the earlier of this host's clock and the store's
    (:func:`store_now`); with ``probe`` false (a dry run writes nothing), this host's.

    Raises:
        StorageError: the probe could not be written or read back.
    """
    local = wall_clock()
    return min(local, store_now(blobs)) if probe else local


def sweep_probes(blobs: BlobStore, now: float, *, dry_run: bool = False) -> list[str]:
    """Delete probes left by a GC that died between writing and deleting one (an hour old).

    Returns the keys deleted (or that would be).

    Raises:
        StorageError: the listing or the delete failed.
    """
    doomed = [
        m.key for m in blobs.list(layout.clock_prefix()) if now - m.last_modified > _PROBE_MAX_AGE_S
    ]
    if doomed and not dry_run:
        blobs.delete_many(doomed)
    return doomed
