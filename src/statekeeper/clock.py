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

A snapshot that names blobs an earlier, unfinished upload left behind (nothing names them,
so GC counts their age) needs the opposite bound, :func:`latest_now`: the latest "now" any
GC can take, so that it names only blobs no GC may have swept.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

from statekeeper import layout
from statekeeper.storage import BlobStore

__all__ = ["PROBE_REUSE_S", "gc_now", "gc_times", "latest_now", "sweep_probes"]

PROBE_REUSE_S = 60.0
"""Seconds one probe of a root's clock is reused for."""
_PROBE_MAX_AGE_S = 3600.0
_lock = threading.Lock()
# root URI -> (store time, monotonic time it was read at, how much later the store's clock
# may have been then)
_probes: dict[str, tuple[float, float, float]] = {}
_STAMP_RESOLUTION_S = 1.0  # S3 truncates stamps to the second

wall_clock: Callable[[], float] = time.time
"""This host's clock (seconds since the epoch); replaced by tests to skew it."""


def latest_now(blobs: BlobStore) -> float:
    """The latest "now" any GC of ``blobs`` can take: the later of this host's clock and an
    upper bound of the store's (its probe's stamp plus the probe's round trip and the
    stamp's resolution). A GC on any host takes the earlier of its clock and the store's
    (:func:`gc_now`), so never a later "now" than this at the same moment.

    Raises:
        StorageError: the probe could not be written or read back.
    """
    return gc_times(blobs)[1]


def gc_times(blobs: BlobStore) -> tuple[float, float]:
    """:func:`gc_now` and :func:`latest_now`, from one probe: the "now" a GC compares ages
    with, and the latest any GC can take (what it stamps the snapshots it retires with).

    Raises:
        StorageError: the probe could not be written or read back.
    """
    stamped, read_at, late_by = _probe(blobs)
    local, since = wall_clock(), time.monotonic() - read_at
    return min(local, stamped + since), max(local, stamped + late_by + since)


def _probe(blobs: BlobStore) -> tuple[float, float, float]:
    with _lock:
        cached = _probes.get(blobs.uri)
    if cached is not None and time.monotonic() - cached[1] < PROBE_REUSE_S:
        return cached
    key = layout.clock_probe_key(uuid.uuid4().hex)
    started = time.monotonic()
    blobs.put(key, b"")
    try:
        stamped = blobs.head(key).last_modified
        # The stamp was taken before put returned: measuring from after head returned errs
        # early, as it must; by at most the round trip and the stamp's resolution.
        read_at = time.monotonic()
    finally:
        blobs.delete_many([key])
    probe = (stamped, read_at, read_at - started + _STAMP_RESOLUTION_S)
    with _lock:
        _probes[blobs.uri] = probe
    return probe


def gc_now(blobs: BlobStore, *, probe: bool = True) -> float:
    """The "now" GC compares ages with: the earlier of this host's clock and the store's
    (the probe's stamp, moved on by the monotonic clock: never later than the store's);
    with ``probe`` false (a dry run writes nothing), this host's.

    Raises:
        StorageError: the probe could not be written or read back.
    """
    return gc_times(blobs)[0] if probe else wall_clock()


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
