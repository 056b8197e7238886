"""Worker-side store reuse and the cross-process working copy lock."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from statekeeper import StateKeeperError, StateNotFoundError, StoreConfig
from statekeeper.spark import StoreBusyError
from statekeeper.spark._cache import StoreCache, StoreSpec
from statekeeper.spark._filelock import StoreLock


@pytest.fixture
def spec(tmp_path: Path) -> StoreSpec:
    config = StoreConfig(local_dir=str(tmp_path / "local"))
    return StoreSpec(str(tmp_path / "root"), "op", 2, config, (), lock_timeout_s=5.0)


@pytest.fixture
def cache() -> Iterator[StoreCache]:
    cache = StoreCache()
    yield cache
    cache.close_all()


def test_the_next_task_reuses_the_open_store(cache: StoreCache, spec: StoreSpec) -> None:
    lease = cache.acquire(spec, 0, 0)
    assert not lease.reused
    lease.store.put(b"k", b"1")
    lease.store.commit()
    cache.release(lease, ok=True)

    again = cache.acquire(spec, 0, 1)
    assert again.reused
    assert again.store is lease.store
    assert again.restore is None
    cache.release(again, ok=True)

    rerun = cache.acquire(spec, 0, 0)  # batch 0 again: the store is reopened at version 0
    assert not rerun.reused
    assert rerun.store.version == 0
    assert rerun.store.get(b"k") is None
    rerun.store.put(b"k", b"1")
    assert rerun.store.commit().version == 1  # identical content: accepted
    cache.release(rerun, ok=True)


def test_a_failed_task_leaves_nothing_behind(cache: StoreCache, spec: StoreSpec) -> None:
    lease = cache.acquire(spec, 0, 0)
    lease.store.put(b"k", b"half done")
    cache.release(lease, ok=False)
    assert lease.store.closed
    again = cache.acquire(spec, 0, 0)
    assert not again.reused
    assert again.store.get(b"k") is None
    cache.release(again, ok=True)


def test_misuse_and_missing_versions_are_explained(cache: StoreCache, spec: StoreSpec) -> None:
    lease = cache.acquire(spec, 1, 0)
    with pytest.raises(StateKeeperError, match="already in use by another task in this process"):
        cache.acquire(spec, 1, 0)
    cache.release(lease, ok=True)
    with pytest.raises(
        StateNotFoundError, match=r"micro-batch 5 .* needs version 5 .*checkpointLocation"
    ):
        cache.acquire(spec, 0, 5)
    assert cache.open_keys() == [(cache.backend(spec).local_path("op", 1), "op", 1)]


def test_an_idle_store_is_handed_over_but_a_busy_one_is_not(spec: StoreSpec) -> None:
    """Two caches act as two worker processes (flock locks conflict across open files)."""
    first, second = StoreCache(), StoreCache()
    busy = dataclass_replace(spec, lock_timeout_s=0.3)
    try:
        lease = first.acquire(spec, 0, 0)
        lease.store.put(b"k", b"v")
        lease.store.commit()
        with pytest.raises(
            StoreBusyError, match=rf"locked by another process \(pid {os.getpid()}\)"
        ):
            second.acquire(busy, 0, 1)  # the first one's task is still running
        first.release(lease, ok=True)
        started = time.monotonic()
        handed = second.acquire(spec, 0, 1)  # idle now: the first one's janitor lets go
        assert time.monotonic() - started < 3
        assert handed.store.get(b"k") == b"v"
        assert handed.restore is not None
        assert handed.restore.base_kind == "local"
        assert first.open_keys() == []
        second.release(handed, ok=True)
    finally:
        first.close_all()
        second.close_all()


def dataclass_replace(spec: StoreSpec, **changes: float) -> StoreSpec:
    import dataclasses

    return dataclasses.replace(spec, **changes)


_HOLDER = """
import sys
from statekeeper import StoreConfig
from statekeeper.spark._cache import CACHE, StoreSpec
spec = StoreSpec(sys.argv[1], "op", 2, StoreConfig(local_dir=sys.argv[2]), (), 5.0)
lease = CACHE.acquire(spec, 0, 0)
lease.store.put(b"k", b"from the other process")
lease.store.commit()
CACHE.release(lease, ok=True)  # kept open and locked for its next task
print("ready", flush=True)
sys.stdin.readline()
print("still open" if CACHE.open_keys() else "released", flush=True)
"""


def test_another_process_gets_the_working_copy(tmp_path: Path, spec: StoreSpec) -> None:
    args = [sys.executable, "-c", _HOLDER, spec.root, str(tmp_path / "local")]
    with subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as holder:
        assert holder.stdin is not None
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "ready"
        cache = StoreCache()
        lease = cache.acquire(spec, 0, 1)
        assert lease.store.get(b"k") == b"from the other process"
        assert lease.restore is not None
        assert (lease.restore.base_kind, lease.restore.changelogs_replayed) == ("local", 0)
        cache.release(lease, ok=True)
        cache.close_all()
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "released"  # alive, and it let go


_LOCKER = """
import sys
from statekeeper.spark._filelock import StoreLock
StoreLock(sys.argv[1]).acquire(5)
print("locked", flush=True)
sys.stdin.readline()
"""


def test_a_busy_working_copy_times_out_with_a_clear_error(tmp_path: Path) -> None:
    path = str(tmp_path / "copy")
    args = [sys.executable, "-c", _LOCKER, path]
    with subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as locker:
        assert locker.stdin is not None
        assert locker.stdout is not None
        assert locker.stdout.readline().strip() == "locked"
        lock = StoreLock(path)
        started = time.monotonic()
        busy = rf"{path} is locked by another process \(pid {locker.pid}\)"
        with pytest.raises(StoreBusyError, match=busy):
            lock.acquire(0.3)
        assert time.monotonic() - started >= 0.3
        assert os.path.exists(lock.request_path)  # it asked the holder to let go
        locker.stdin.write("\n")
        locker.stdin.flush()
        locker.wait(timeout=30)
    assert lock.acquire(5) < 5  # the holder's exit released it
    assert not os.path.exists(lock.request_path)
    lock.release()
