"""Worker-side store reuse and the cross-process working copy lock."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from statekeeper import (
    ConfigMismatchError,
    StateKeeperError,
    StateNotFoundError,
    StateStore,
    StoreConfig,
    layout,
)
from statekeeper.metrics import read_commit_metrics
from statekeeper.spark import StoreBusyError
from statekeeper.spark._cache import (
    IDLE_CLOSE_S,
    IDLE_FLUSH_S,
    Lease,
    StoreCache,
    StoreSpec,
    _RequestWatch,
)
from statekeeper.spark._filelock import StoreLock
from tests.small_tmpfs import run_on_small_tmpfs


@pytest.fixture
def spec(tmp_path: Path) -> StoreSpec:
    config = StoreConfig(local_dir=str(tmp_path / "local"))
    return StoreSpec(str(tmp_path / "root"), "op", 2, config, (), lock_timeout_s=60.0)


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


def test_a_restarted_run_reopens_a_store_that_a_re_run_may_have_replaced(
    tmp_path: Path,
) -> None:
    """Executor 1's worker keeps version 1 open (run 1). The query restarts (run 2) and
    batch 0 re-runs on executor 2, replacing version 1. Run 2's batch 1 on executor 1 must
    read the re-run's version 1: its cached store is opened again, not reused."""
    root = str(tmp_path / "root")
    one, two = (
        StoreSpec(root, "op", 2, StoreConfig(local_dir=str(tmp_path / name)), (), 5.0)
        for name in ("executor1", "executor2")
    )
    worker1, worker2 = StoreCache(), StoreCache()
    try:
        lease = worker1.acquire(one, 0, 0, generation=1)
        lease.store.put(b"k", b"run 1")
        lease.store.commit(order=(1, 0, 0, 0))
        worker1.release(lease, ok=True)
        same_run = worker1.acquire(one, 0, 1, generation=1)
        assert same_run.reused
        worker1.release(same_run, ok=True)

        rerun = worker2.acquire(two, 0, 0, generation=2)
        rerun.store.put(b"k", b"run 2")
        rerun.store.commit(order=(2, 0, 0, 0))  # replaces version 1: nothing built on it
        worker2.release(rerun, ok=True)

        lease = worker1.acquire(one, 0, 1, generation=2)
        assert not lease.reused
        assert lease.store.get(b"k") == b"run 2"
        lease.store.put(b"k", b"run 2, batch 1")
        assert lease.store.commit(order=(2, 1, 0, 0)).version == 2
        worker1.release(lease, ok=True)
    finally:
        worker1.close_all()
        worker2.close_all()


def test_a_failed_task_leaves_nothing_behind(cache: StoreCache, spec: StoreSpec) -> None:
    lease = cache.acquire(spec, 0, 0)
    lease.store.put(b"k", b"half done")
    cache.release(lease, ok=False)
    assert lease.store.closed
    again = cache.acquire(spec, 0, 0)
    assert not again.reused
    assert again.store.get(b"k") is None
    cache.release(again, ok=True)


def test_a_store_not_kept_is_closed_with_its_snapshot_uploaded_when_released(
    cache: StoreCache, tmp_path: Path
) -> None:
    """Without Python worker reuse a task's process ends right after the task, background
    threads and all: a store acquired with ``keep_open=False`` is closed, its due snapshot
    uploaded and its working copy unlocked before ``release`` returns."""
    config = StoreConfig(local_dir=str(tmp_path / "local"), snapshot_every=1)
    spec = StoreSpec(str(tmp_path / "root"), "op", 2, config, (), 5.0, keep_open=False)
    lease = cache.acquire(spec, 0, 0)
    lease.store.put(b"k", b"v")
    lease.store.commit()
    cache.release(lease, ok=True)  # closed: the spec does not keep it open
    keys = [m.key for m in cache.backend(spec).blobs.list(layout.snapshot_prefix("op", 0))]
    assert [layout.parse_attempt_snapshot_key(k)[0] for k in keys] == [1]  # type: ignore[index]
    _assert_closed_and_durable(cache, spec, lease)


_IDLE_HOLDER = """
import sys
from statekeeper import StoreConfig
from statekeeper.spark._cache import StoreCache, StoreSpec
config = StoreConfig(local_dir=sys.argv[2], metrics_every=100)
spec = StoreSpec(sys.argv[1], "op", 2, config, (), 60.0)
cache = StoreCache(idle_flush_s=0.2)
lease = cache.acquire(spec, 0, 0)
lease.store.put(b"k", b"v")
lease.store.commit()
cache.release(lease, ok=True)
print("released", flush=True)
sys.stdin.readline()
print(len(cache.open_keys()), flush=True)
sys.stdin.readline()  # killed here, as Spark ends an idle worker: no exit handler runs
"""


def test_an_idle_store_is_made_durable_and_kept_open_before_spark_would_end_its_worker(
    tmp_path: Path, spec: StoreSpec
) -> None:
    """Spark ends idle Python workers after a minute without running exit handlers; the
    janitor makes a store idle for ``idle_flush_s`` durable first (its commit on local disk,
    its commit metrics written) and keeps it open for the worker's next task. Killed then,
    the worker leaves a copy the next open reuses with nothing to replay."""
    assert IDLE_FLUSH_S < 60
    assert IDLE_CLOSE_S > 60  # a query triggered every minute reuses its open stores
    args = [sys.executable, "-c", _IDLE_HOLDER, spec.root, str(tmp_path / "local")]
    with subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as holder:
        assert holder.stdin is not None
        assert holder.stdout is not None
        try:
            assert holder.stdout.readline().strip() == "released"
            cache = StoreCache()
            blobs = cache.backend(spec).blobs
            deadline = time.monotonic() + 60
            while not read_commit_metrics(blobs, "op", 0) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sorted(read_commit_metrics(blobs, "op", 0)) == [1]
            holder.stdin.write("\n")
            holder.stdin.flush()
            assert holder.stdout.readline().strip() == "1"  # still open after its flush
        finally:
            holder.kill()  # SIGKILL
            holder.wait()
    try:
        again = cache.acquire(spec, 0, 1)
        assert again.restore is not None
        assert (again.restore.base_kind, again.restore.changelogs_replayed) == ("local", 0)
        assert again.store.get(b"k") == b"v"
        cache.release(again, ok=True)
    finally:
        cache.close_all()


def test_a_store_idle_for_idle_close_s_is_closed_durably(tmp_path: Path) -> None:
    """A store no task used for ``idle_close_s`` (its partition moved to another executor,
    its query stopped) is closed: its copy unlocked, its commit on local disk (nothing to
    replay) and its commit metrics written."""
    config = StoreConfig(local_dir=str(tmp_path / "local"), metrics_every=100)
    spec = StoreSpec(str(tmp_path / "root"), "op", 2, config, (), 5.0)
    cache = StoreCache(idle_close_s=0.3)
    try:
        lease = cache.acquire(spec, 0, 0)
        lease.store.put(b"k", b"v")
        lease.store.commit()
        cache.release(lease, ok=True)
        assert cache.open_keys() != []  # kept open for the next task meanwhile
        deadline = time.monotonic() + 60
        while cache.open_keys() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cache.open_keys() == []  # the janitor took it out to close it
        cache.close_all()  # waits for the close the janitor started
        _assert_closed_and_durable(cache, spec, lease)
    finally:
        cache.close_all()


def _gate_flush(
    store: StateStore, fail: Exception | None = None
) -> tuple[threading.Event, threading.Event]:
    """Make the janitor's flush of ``store`` wait for the returned gate (and then raise
    ``fail``, if given); the other event is set once the flush has started."""
    gate, started = threading.Event(), threading.Event()
    flush = store.flush

    def gated() -> None:
        started.set()
        assert gate.wait(60)
        if fail is not None:
            raise fail
        flush()

    store.flush = gated  # type: ignore[method-assign]
    return gate, started


def _acquire_while_flushing(
    holder: StoreCache, taker: StoreCache, spec: StoreSpec, fail: Exception | None = None
) -> tuple[Lease, Lease]:
    """Commit ``k = v`` at version 0 in ``holder`` and release the store; while the
    janitor's flush of it is held, acquire it at version 1 from ``taker`` on another
    thread, which must wait; then let the flush end (raising ``fail``, if given). Returns
    the holder's lease and the taker's."""
    lease = holder.acquire(spec, 0, 0)
    gate, started = _gate_flush(lease.store, fail=fail)
    lease.store.put(b"k", b"v")
    lease.store.commit()
    holder.release(lease, ok=True)
    assert started.wait(60)
    got: list[Lease] = []
    task = threading.Thread(target=lambda: got.append(taker.acquire(spec, 0, 1)))
    task.start()
    task.join(0.3)
    assert task.is_alive()  # waits for the flush, and does not fail as "in use"
    gate.set()
    task.join(60)
    assert len(got) == 1
    return lease, got[0]


def test_a_task_that_wants_a_store_being_flushed_waits_for_it_and_reuses_it(
    tmp_path: Path,
) -> None:
    config = StoreConfig(local_dir=str(tmp_path / "local"), metrics_every=100)
    spec = StoreSpec(str(tmp_path / "root"), "op", 2, config, (), 5.0)
    cache = StoreCache(idle_flush_s=0.0)
    try:
        lease, taken = _acquire_while_flushing(cache, cache, spec)
        assert taken.reused
        assert taken.store is lease.store
        assert sorted(read_commit_metrics(cache.backend(spec).blobs, "op", 0)) == [1]
        taken.store.put(b"k", b"w")
        assert taken.store.commit().version == 2
        cache.release(taken, ok=True)
    finally:
        cache.close_all()


@pytest.mark.parametrize(
    "error",
    [
        StateKeeperError("the local disk is full (injected)"),
        RuntimeError("a bug (injected)"),  # found by review: the store stayed busy for good
    ],
)
def test_an_idle_store_that_cannot_be_flushed_is_closed_and_the_next_task_reopens_it(
    tmp_path: Path, error: Exception
) -> None:
    config = StoreConfig(local_dir=str(tmp_path / "local"))
    spec = StoreSpec(str(tmp_path / "root"), "op", 2, config, (), 5.0)
    cache = StoreCache(idle_flush_s=0.0)
    try:
        lease, taken = _acquire_while_flushing(cache, cache, spec, fail=error)
        assert lease.store.closed
        assert not taken.reused
        assert taken.store.get(b"k") == b"v"
        cache.release(taken, ok=True)
    finally:
        cache.close_all()


def test_a_task_waits_for_a_flush_no_longer_than_for_a_lock(tmp_path: Path) -> None:
    """A flush that meets damage rebuilds the copy from the root, which can take long: a
    task wanting the store waits ``lock_timeout_s`` for it, as for another process's lock,
    then fails busy (Spark retries it); once the flush ends, the store is reused."""
    config = StoreConfig(local_dir=str(tmp_path / "local"))
    spec = StoreSpec(str(tmp_path / "root"), "op", 2, config, (), 0.5)
    cache = StoreCache(idle_flush_s=0.0)
    try:
        lease = cache.acquire(spec, 0, 0)
        gate, started = _gate_flush(lease.store)
        lease.store.put(b"k", b"v")
        lease.store.commit()
        cache.release(lease, ok=True)
        assert started.wait(60)
        began = time.monotonic()
        with pytest.raises(StoreBusyError, match=r"op/0 is still being flushed .* after 0.5 s"):
            cache.acquire(spec, 0, 1)
        assert time.monotonic() - began < 30
        gate.set()
        again = cache.acquire(spec, 0, 1)
        assert again.reused
        assert again.store is lease.store
        cache.release(again, ok=True)
    finally:
        gate.set()
        cache.close_all()


def test_stores_going_idle_together_are_flushed_one_at_a_time(tmp_path: Path) -> None:
    """Found by review: each idle store got a flush thread of its own, so 200 stores going
    idle together started 200 threads and a task wanting one waited for the whole wave."""
    config = StoreConfig(local_dir=str(tmp_path / "local"), metrics_every=100)
    spec = StoreSpec(str(tmp_path / "root"), "op", 40, config, (), 5.0)
    cache = StoreCache(idle_flush_s=0.2)
    running, most, flushed = [0], [0], []
    count = threading.Lock()
    try:
        leases = [cache.acquire(spec, p, 0) for p in range(40)]

        def counted(flush: Callable[[], None], partition: int) -> None:
            with count:
                running[0] += 1
                most[0] = max(most[0], running[0])
            try:
                time.sleep(0.005)
                flush()
            finally:
                with count:
                    running[0] -= 1
                flushed.append(partition)

        for lease in leases:
            counting = functools.partial(counted, lease.store.flush, lease.store.partition)
            lease.store.flush = counting  # type: ignore[method-assign]
            lease.store.put(b"k", b"v")
            lease.store.commit()
        for lease in leases:
            cache.release(lease, ok=True)
        deadline = time.monotonic() + 60
        while len(flushed) < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(flushed) == list(range(40))
        assert most[0] == 1
        assert [t for t in threading.enumerate() if t.name == "statekeeper-flush"] == []
        blobs = cache.backend(spec).blobs
        assert all(sorted(read_commit_metrics(blobs, "op", p)) == [1] for p in range(40))
    finally:
        cache.close_all()


def test_a_worker_out_of_threads_still_flushes_closes_and_hands_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a flush or close thread that could not start killed the janitor and
    left the store busy for good (a task wanting it waited forever)."""
    config = StoreConfig(local_dir=str(tmp_path / "local"))
    spec = StoreSpec(str(tmp_path / "root"), "op", 2, config, (), 10.0)
    start = threading.Thread.start

    def refuse(thread: threading.Thread) -> None:
        if thread.name in ("statekeeper-flush", "statekeeper-close"):
            raise RuntimeError("can't start new thread (injected)")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    first, second = StoreCache(idle_close_s=3600, idle_flush_s=0.0), StoreCache()
    try:
        lease = first.acquire(spec, 0, 0)
        lease.store.put(b"k", b"v")
        lease.store.commit()
        first.release(lease, ok=True)
        time.sleep(0.3)  # the janitor tried to flush it
        again = first.acquire(spec, 0, 1)  # not left busy
        assert again.reused
        first.release(again, ok=True)
        handed = second.acquire(spec, 0, 1)  # the janitor lives on and closes it itself
        assert handed.store.get(b"k") == b"v"
        assert first.open_keys() == []
        second.release(handed, ok=True)
    finally:
        monkeypatch.undo()
        first.close_all()
        second.close_all()


def test_a_store_whose_flush_and_close_fail_stops_no_later_flush(tmp_path: Path) -> None:
    """Found by review: an error the failed flush's close raised ended the flusher thread
    for good, and no idle store was flushed again."""
    config = StoreConfig(local_dir=str(tmp_path / "local"), metrics_every=100)
    spec = StoreSpec(str(tmp_path / "root"), "op", 2, config, (), 5.0)
    cache = StoreCache(idle_flush_s=0.0)
    try:
        broken = cache.acquire(spec, 0, 0)
        gate, started = _gate_flush(broken.store, fail=StateKeeperError("injected"))
        close = broken.store.close

        def failing_close() -> None:
            close()
            raise RuntimeError("a bug in close (injected)")

        broken.store.close = failing_close  # type: ignore[method-assign]
        broken.store.put(b"k", b"v")
        broken.store.commit()
        cache.release(broken, ok=True)
        assert started.wait(60)
        gate.set()
        deadline = time.monotonic() + 60
        while cache.open_keys() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cache.open_keys() == []  # closed after its flush failed
        lease = cache.acquire(spec, 1, 0)
        lease.store.put(b"k", b"v")
        lease.store.commit()
        cache.release(lease, ok=True)
        blobs = cache.backend(spec).blobs
        while not read_commit_metrics(blobs, "op", 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(read_commit_metrics(blobs, "op", 1)) == [1]  # flushed
        assert cache.open_keys() != []  # and kept open
    finally:
        cache.close_all()


_HIGH_DESCRIPTOR = """
import os, resource, time
from statekeeper.spark._cache import _Waker
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
waker = _Waker()
waker.listen()
assert waker.listening and waker._socket.fileno() >= 1024, waker._socket
started = time.monotonic()
woken = waker.wait(0.5)
print(woken, time.monotonic() - started >= 0.4, flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's abstract sockets")
def test_the_janitor_sleeps_with_its_socket_above_descriptor_1024() -> None:
    """Found by review: select() cannot watch a descriptor above 1024, the error was
    suppressed, and the janitor of a worker holding many files never slept."""
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1200:
        pytest.skip("the hard open-file limit is below 1200")
    done = subprocess.run(
        [sys.executable, "-c", _HIGH_DESCRIPTOR], capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["False", "True"]  # not woken, and it waited


def test_a_polling_janitor_sees_a_request_for_a_store_it_skipped_while_flushing(
    spec: StoreSpec,
) -> None:
    """A janitor that polls (its socket's name taken, or not on Linux) watches the folders
    of the idle stores only; a store being flushed is busy, so its folder dropped out, and
    the janitor, not woken when the flush ended, missed a later request until its next
    sweep, a minute on."""
    listener, holder, taker = StoreCache(), StoreCache(idle_flush_s=0.0), StoreCache()
    try:
        lease = listener.acquire(spec, 1, 0)  # its janitor takes this process's socket
        listener.release(lease, ok=True)
        lease = holder.acquire(spec, 0, 0)
        gate, started = _gate_flush(lease.store)
        lease.store.put(b"k", b"v")
        lease.store.commit()
        holder.release(lease, ok=True)
        assert started.wait(60)
        time.sleep(0.3)  # the holder's janitor passes: the store is busy
        assert not holder._wake.listening
        gate.set()
        time.sleep(0.3)  # the flush ends
        taken = taker.acquire(dataclass_replace(spec, lock_timeout_s=20.0), 0, 1)
        assert taken.store.get(b"k") == b"v"
        taker.release(taken, ok=True)
    finally:
        for cache in (listener, holder, taker):
            cache.close_all()


def test_an_idle_store_is_flushed_once_until_a_task_uses_it_again(spec: StoreSpec) -> None:
    cache = StoreCache(idle_flush_s=0.0)
    try:
        flushes: list[int] = []
        for version in (0, 1):
            lease = cache.acquire(spec, 0, version)
            if version == 0:
                flush = lease.store.flush

                def counted(
                    flush: Callable[[], None] = flush, store: StateStore = lease.store
                ) -> None:
                    flush()
                    flushes.append(store.version)

                lease.store.flush = counted  # type: ignore[method-assign]
            lease.store.put(b"k", b"v%d" % version)
            lease.store.commit()
            cache.release(lease, ok=True)
            deadline = time.monotonic() + 60
            while len(flushes) <= version and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)  # many janitor passes
            assert flushes == [1, 2][: version + 1]
        assert cache.open_keys() != []
    finally:
        cache.close_all()


def test_a_request_for_a_store_being_flushed_is_served_once_the_flush_ends(
    spec: StoreSpec,
) -> None:
    first, second = StoreCache(idle_close_s=3600, idle_flush_s=0.0), StoreCache()
    try:
        _, taken = _acquire_while_flushing(first, second, spec)
        assert taken.store.get(b"k") == b"v"
        assert taken.restore is not None
        assert (taken.restore.base_kind, taken.restore.changelogs_replayed) == ("local", 0)
        assert first.open_keys() == []
        second.release(taken, ok=True)
    finally:
        first.close_all()
        second.close_all()


def _assert_closed_and_durable(cache: StoreCache, spec: StoreSpec, lease: Lease) -> None:
    """The store of ``lease`` (partition 0, version 1 committed with ``k = v``) is closed,
    its commit metrics are written, its working copy is unlocked, and the next open finds
    version 1 on local disk: nothing replayed from the root."""
    assert lease.store.closed
    assert cache.open_keys() == []
    backend = cache.backend(spec)
    assert sorted(read_commit_metrics(backend.blobs, "op", 0)) == [1]
    lock = StoreLock(backend.local_path("op", 0))
    assert lock.try_acquire()
    lock.release()
    again = cache.acquire(spec, 0, 1)
    assert again.restore is not None
    assert again.restore.base_kind == "local"
    assert again.restore.changelogs_replayed == 0
    assert again.store.get(b"k") == b"v"
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
    """Two caches act as two worker processes (flock locks conflict across open files).
    The holder closes no store for idleness: only the handover can let the store go."""
    first, second = StoreCache(idle_close_s=3600), StoreCache()
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
        handed = second.acquire(spec, 0, 1)  # idle now: the first one's janitor lets go
        assert handed.store.get(b"k") == b"v"
        assert handed.restore is not None
        assert handed.restore.base_kind == "local"
        assert first.open_keys() == []
        second.release(handed, ok=True)
    finally:
        first.close_all()
        second.close_all()


def test_a_store_is_handed_over_without_waiting_for_another_stores_snapshot_upload(
    tmp_path: Path,
) -> None:
    """A worker holds stores 0 and 1; store 0's background snapshot upload hangs. Another
    worker asks for store 0 (its handover must wait for that upload, whose checkpoint lies
    beside the copy), then for store 1: store 1 is handed over at once, not after store 0's
    upload, and store 0 once the upload ends."""
    config = StoreConfig(local_dir=str(tmp_path / "local"), snapshot_every=1)
    spec = StoreSpec(str(tmp_path / "root"), "op", 2, config, (), lock_timeout_s=30.0)
    first, second = StoreCache(), StoreCache()
    gate, uploading = threading.Event(), threading.Event()
    snapshotter = first.backend(spec)._snapshotter
    after = snapshotter.after_upload

    def hang_store_0(operator: str, partition: int) -> None:
        if partition == 0:
            uploading.set()
            gate.wait(60)
        if after is not None:
            after(operator, partition)

    snapshotter.after_upload = hang_store_0
    got: dict[int, tuple[float, bytes | None]] = {}

    def take(partition: int, timeout_s: float) -> None:
        started = time.monotonic()
        lease = second.acquire(dataclass_replace(spec, lock_timeout_s=timeout_s), partition, 1)
        got[partition] = (time.monotonic() - started, lease.store.get(b"k"))
        second.release(lease, ok=True)

    try:
        for partition in (1, 0):  # store 1's snapshot is done before store 0's starts
            lease = first.acquire(spec, partition, 0)
            lease.store.put(b"k", b"v%d" % partition)
            lease.store.commit()
            first.release(lease, ok=True)
            if partition == 1:
                first.backend(spec).wait_for_snapshots("op", 1)
        assert uploading.wait(30)
        taker = threading.Thread(target=take, args=(0, 30.0))
        taker.start()
        deadline = time.monotonic() + 10
        while len(first.open_keys()) == 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        # Store 0 is being handed over (its close waits for its upload); store 1 is idle.
        assert first.open_keys() == [(first.backend(spec).local_path("op", 1), "op", 1)]
        take(1, 10.0)  # StoreBusyError if store 1 waited for store 0's upload
        assert got[1][1] == b"v1"
        assert 0 not in got  # store 0 still waits for its own upload
        gate.set()
        taker.join(30)
        assert got[0][1] == b"v0"
        assert first.open_keys() == []
    finally:
        gate.set()
        first.close_all()
        second.close_all()
        first.backend(spec).close()
        second.backend(spec).close()


def dataclass_replace(spec: StoreSpec, **changes: float) -> StoreSpec:
    import dataclasses

    return dataclasses.replace(spec, **changes)


_HOLDER = """
import sys, time
from statekeeper import StoreConfig
from statekeeper.spark import _cache
from statekeeper.spark._cache import CACHE, StoreSpec
nudged_only = sys.argv[3] == "nudged"
if nudged_only:
    _cache._LOOK_ALL_EVERY_S = 3600.0  # no look of its own: only a nudge gets the store
spec = StoreSpec(sys.argv[1], "op", 2, StoreConfig(local_dir=sys.argv[2]), (), 60.0)
lease = CACHE.acquire(spec, 0, 0)
lease.store.put(b"k", b"from the other process")
lease.store.commit()
CACHE.release(lease, ok=True)  # kept open and locked for its next task
deadline = time.monotonic() + 30
while nudged_only and not CACHE._wake.listening and time.monotonic() < deadline:
    time.sleep(0.01)  # its janitor binds the socket when it starts
print("listening" if nudged_only and CACHE._wake.listening else "ready", flush=True)
sys.stdin.readline()
print("still open" if CACHE.open_keys() else "released", flush=True)
"""


def _take_from_another_process(
    tmp_path: Path, spec: StoreSpec, *, nudged_only: bool = False
) -> None:
    """A holder process keeps the store open and idle; this process takes it over: the
    holder lets go and stays alive, and the copy is reused with nothing to replay. With
    ``nudged_only`` the holder never looks for requests by itself (Linux)."""
    mode = "nudged" if nudged_only else "polls"
    args = [sys.executable, "-c", _HOLDER, spec.root, str(tmp_path / "local"), mode]
    with subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as holder:
        assert holder.stdin is not None
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == ("listening" if nudged_only else "ready")
        cache = StoreCache()
        try:
            lease = cache.acquire(dataclass_replace(spec, lock_timeout_s=30.0), 0, 1)
            assert lease.store.get(b"k") == b"from the other process"
            assert lease.restore is not None
            assert (lease.restore.base_kind, lease.restore.changelogs_replayed) == ("local", 0)
            cache.release(lease, ok=True)
        finally:
            cache.close_all()
            holder.stdin.write("\n")
            holder.stdin.flush()
        assert holder.stdout.readline().strip() == "released"  # alive, and it let go


def test_another_process_gets_the_working_copy(tmp_path: Path, spec: StoreSpec) -> None:
    _take_from_another_process(tmp_path, spec)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's abstract sockets")
def test_an_idle_holder_is_nudged_by_the_process_asking_and_polls_for_nothing(
    tmp_path: Path, spec: StoreSpec
) -> None:
    """The holder's janitor sleeps (a worker holding hundreds of idle stores for minutes
    spent a share of a core polling for requests); the asking process wakes it."""
    _take_from_another_process(tmp_path, spec, nudged_only=True)


_LOCKER = """
import sys
from statekeeper.spark._filelock import StoreLock
from tests.small_tmpfs import run_on_small_tmpfs
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


# -- bounded per worker: the open-store budget and the local-copy sweep -----------------------


def _wait_until(check: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _commit(cache: StoreCache, spec: StoreSpec, partition: int, version: int) -> None:
    lease = cache.acquire(spec, partition, version)
    lease.store.put(b"k", b"%d" % partition)
    lease.store.commit()
    cache.release(lease, ok=True)


def test_stores_beyond_the_budget_are_closed_least_recently_used_first(
    cache: StoreCache, tmp_path: Path
) -> None:
    config = StoreConfig(local_dir=str(tmp_path / "local"), max_open_stores=2)
    spec = StoreSpec(str(tmp_path / "root"), "op", 4, config, (), lock_timeout_s=5.0)
    paths = {p: cache.backend(spec).local_path("op", p) for p in range(4)}
    _commit(cache, spec, 0, 0)
    _commit(cache, spec, 1, 0)
    busy = cache.acquire(spec, 2, 0)  # a running task's store is never closed
    assert _wait_until(lambda: [k[2] for k in cache.open_keys()] == [1, 2])  # 0 was oldest
    _commit(cache, spec, 3, 0)
    assert _wait_until(lambda: [k[2] for k in cache.open_keys()] == [2, 3])
    assert not busy.store.closed
    busy.store.put(b"k", b"2")
    busy.store.commit()
    cache.release(busy, ok=True)
    assert _wait_until(lambda: len(cache.open_keys()) == 2)

    again = cache.acquire(spec, 0, 1)  # closed, not forgotten: its copy is still on disk
    assert not again.reused
    assert again.restore is not None
    assert again.restore.base_kind == "local"
    assert again.store.get(b"k") == b"0"
    cache.release(again, ok=True)
    assert all(os.path.isdir(path) for path in paths.values())


@contextlib.contextmanager
def _locked_by_another_process(path: str) -> Iterator[None]:
    args = [sys.executable, "-c", _LOCKER, path]
    with subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as locker:
        assert locker.stdin is not None
        assert locker.stdout is not None
        assert locker.stdout.readline().strip() == "locked"
        try:
            yield
        finally:
            locker.stdin.write("\n")
            locker.stdin.flush()
            locker.wait(timeout=30)


def test_copies_unused_for_the_ttl_are_deleted_but_held_ones_are_not(
    cache: StoreCache, tmp_path: Path
) -> None:
    local = str(tmp_path / "local")
    config = StoreConfig(local_dir=local, local_copy_ttl_s=3600.0)
    spec = StoreSpec(str(tmp_path / "root"), "op", 4, config, (), lock_timeout_s=5.0)
    other = StoreSpec(str(tmp_path / "other-root"), "op", 4, config, (), lock_timeout_s=5.0)
    for partition in range(3):
        _commit(cache, spec, partition, 0)
    other_cache = StoreCache()  # another root's copy under the same local_dir
    _commit(other_cache, other, 0, 0)
    other_cache.close_all()
    cache.close_all()
    path = {p: cache.backend(spec).local_path("op", p) for p in range(3)}
    kept_open = cache.acquire(spec, 2, 1)  # 2 stays open (and locked) in this worker
    cache.release(kept_open, ok=True)

    assert cache.sweep_local_copies() == []  # nothing is an hour old yet
    later = time.time() + 2 * 3600
    with _locked_by_another_process(path[1]):
        assert cache.sweep_local_copies(now=later) == [path[0]]
    assert not os.path.exists(path[0])
    assert not os.path.exists(f"{path[0]}.lineage.json")
    assert os.path.isdir(path[1])
    assert os.path.isdir(path[2])
    assert os.path.isdir(cache.backend(other).local_path("op", 0))  # never another root's
    assert cache.open_keys() == [(path[2], "op", 2)]

    restored = cache.acquire(spec, 0, 1)  # gone from disk: restored from the root
    assert restored.restore is not None
    assert restored.restore.base_kind != "local"
    assert restored.store.get(b"k") == b"0"
    cache.release(restored, ok=True)
    assert cache.sweep_local_copies(now=later) == [path[1]]  # released by the other process


def test_the_lock_file_of_a_store_held_for_days_is_kept_fresh_for_age_based_cleaners(
    cache: StoreCache, spec: StoreSpec
) -> None:
    """A store in steady use stays open (and its lock file untouched) for days; an
    age-based cleaner of ``/tmp`` (Spark's default local dir) would delete that file and
    let another process lock the copy under this one. The janitor's sweep refreshes it."""
    _commit(cache, spec, 0, 0)
    lock = StoreLock(cache.backend(spec).local_path("op", 0)).path
    old = time.time() - 30 * 86400
    os.utime(lock, (old, old))
    assert cache.keep_locks() == []
    assert time.time() - os.stat(lock).st_mtime < 60


@pytest.mark.parametrize("found_by", ["sweep", "task"])
def test_a_store_whose_lock_file_was_deleted_is_closed_and_reopened_under_a_new_one(
    cache: StoreCache, spec: StoreSpec, found_by: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The lock file of an idle store deleted (a cleaner of temporary files): another
    process could take a lock of that name and open the copy under this one. The store is
    closed when the janitor's sweep or the next task finds it, and the next task opens the
    copy again under a lock that guards it."""
    _commit(cache, spec, 0, 0)
    path = cache.backend(spec).local_path("op", 0)
    os.unlink(StoreLock(path).path)
    if found_by == "sweep":
        assert cache.keep_locks() == [StoreLock(path).path]
        assert cache.open_keys() == []
    lease = cache.acquire(spec, 0, 1)
    assert not lease.reused
    assert lease.restore is not None
    assert lease.restore.base_kind == "local"
    assert lease.store.get(b"k") == b"0"
    assert not StoreLock(path).try_acquire()  # guarded again
    cache.release(lease, ok=True)
    assert "was deleted or replaced" in caplog.text


def test_copies_set_aside_as_damaged_are_deleted_after_the_ttl(
    cache: StoreCache, tmp_path: Path
) -> None:
    """Set-aside copies are not working copies (their names are not partition numbers):
    the sweep once never looked at them, and they stayed until the executor went away."""
    config = StoreConfig(local_dir=str(tmp_path / "local"), local_copy_ttl_s=3600.0)
    spec = StoreSpec(str(tmp_path / "root"), "op", 4, config, (), lock_timeout_s=5.0)
    _commit(cache, spec, 0, 0)
    lease = cache.acquire(spec, 0, 1)  # the copy itself stays in use
    path = cache.backend(spec).local_path("op", 0)
    aside = f"{path}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-0123abcd"
    os.mkdir(aside)
    assert cache.sweep_local_copies() == []
    assert cache.sweep_local_copies(now=time.time() + 2 * 3600) == [aside]
    assert not os.path.exists(aside)
    assert lease.store.get(b"k") == b"0"
    cache.release(lease, ok=True)
    # One whose copy is gone (its partition moved to another executor) goes too.
    cache.close_all()
    os.rename(path, aside)
    assert cache.sweep_local_copies(now=time.time() + 2 * 3600) == [aside]
    assert not os.path.exists(aside)


def test_asking_ahead_hands_an_idle_store_over_before_the_acquire(spec: StoreSpec) -> None:
    """A task asks for its store before reading its input: the worker holding it idle lets
    go meanwhile, so the acquire after the input finds the lock free."""
    first, second = StoreCache(idle_close_s=3600), StoreCache()
    try:
        lease = first.acquire(spec, 0, 0)
        lease.store.put(b"k", b"v")
        lease.store.commit()
        first.release(lease, ok=True)
        first.ask(spec, 0)  # its own store: nothing is asked, the store stays open
        path = first.backend(spec).local_path("op", 0)
        assert not StoreLock(path).requested()
        first._close_doomed(time.monotonic())  # what the janitor does next: closes nothing
        assert len(first.open_keys()) == 1
        second.ask(spec, 0)  # another worker's task starts reading its input
        # The holder's janitor takes the store out of its cache, then closes it and unlocks
        # on a thread of its own: wait for the lock to be free, with no acquire pending.
        lock, deadline = StoreLock(path), time.monotonic() + 60
        while not lock.try_acquire() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lock.held  # handed over before the acquire: the acquire will not wait
        lock.release()
        assert first.open_keys() == []
        handed = second.acquire(spec, 0, 1)
        assert handed.store.get(b"k") == b"v"
        assert not StoreLock(path).requested()  # the acquire served the request
        second.release(handed, ok=True)
    finally:
        first.close_all()
        second.close_all()


def test_a_failed_reopen_keeps_the_copy_locked_until_the_old_store_s_snapshot_is_done(
    tmp_path: Path,
) -> None:
    """A task of a new run reopens the cached store and fails before its open waits for
    the store's snapshot (here: it states another partition count): the cached store is
    closed, its background snapshot still uploading from the checkpoint beside the copy.
    The copy's lock was released at once, so another worker's open deleted that
    checkpoint as stale under the upload."""
    config = StoreConfig(local_dir=str(tmp_path / "local"), snapshot_every=1)
    spec = StoreSpec(str(tmp_path / "root"), "op", 2, config, (), lock_timeout_s=60.0)
    cache = StoreCache(idle_close_s=3600)
    snapshotter = cache.backend(spec)._snapshotter
    after, gate, uploading = snapshotter.after_upload, threading.Event(), threading.Event()

    def hang(operator: str, partition: int) -> None:
        uploading.set()
        assert gate.wait(60)
        if after is not None:
            after(operator, partition)

    snapshotter.after_upload = hang
    failed: list[BaseException] = []

    def acquire_with_another_count() -> None:
        try:
            cache.acquire(dataclasses.replace(spec, partitions=3), 0, 1, generation=2)
        except BaseException as exc:  # noqa: BLE001 - checked below
            failed.append(exc)

    # The moment that matters: the reopen has failed. Then the copy must stay locked
    # until the upload is done, so the task either waits for it (as it should) or, were
    # it to let go at once, ends with the lock released: either is seen, not raced.
    backend = cache.backend(spec)
    reopen_failed, waiting = threading.Event(), threading.Event()
    opener, waiter = backend.open, backend.wait_for_snapshots

    def open_noting_failure(*args: Any, **kwargs: Any) -> Any:
        try:
            return opener(*args, **kwargs)
        except ConfigMismatchError:
            reopen_failed.set()
            raise

    def wait_noting_it(*args: Any, **kwargs: Any) -> None:
        if reopen_failed.is_set():
            waiting.set()
        waiter(*args, **kwargs)

    backend.open = open_noting_failure  # type: ignore[method-assign]
    backend.wait_for_snapshots = wait_noting_it  # type: ignore[method-assign]
    try:
        lease = cache.acquire(spec, 0, 0, generation=1)
        lease.store.put(b"k", b"v")
        lease.store.commit()  # schedules a snapshot, held in hang()
        cache.release(lease, ok=True)
        assert uploading.wait(60)
        task = threading.Thread(target=acquire_with_another_count)
        task.start()
        deadline = time.monotonic() + 60
        while not waiting.is_set() and task.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert reopen_failed.is_set()
        lock = StoreLock(backend.local_path("op", 0))
        assert not lock.try_acquire(), "the copy was unlocked under its snapshot upload"
        gate.set()
        task.join(60)
        assert len(failed) == 1
        assert isinstance(failed[0], ConfigMismatchError)
        assert lock.try_acquire()  # released once the upload was done
        lock.release()
    finally:
        gate.set()
        cache.close_all()


def test_a_query_defined_again_with_another_config_opens_its_stores_with_it(
    cache: StoreCache, spec: StoreSpec
) -> None:
    """The cached store was reused with the backend of the first definition, so a new
    snapshot_every (retention, compression, mode, ...) never applied to a partition whose
    store stayed open in a worker."""
    lease = cache.acquire(spec, 0, 0)
    lease.store.put(b"k", b"1")
    assert not lease.store.commit().snapshot_scheduled  # snapshot_every is 10
    cache.release(lease, ok=True)
    often = dataclasses.replace(spec, config=dataclasses.replace(spec.config, snapshot_every=1))
    lease = cache.acquire(often, 0, 1)
    assert lease.entry.backend.config.snapshot_every == 1
    assert lease.store.get(b"k") == b"1"
    lease.store.put(b"k", b"2")
    assert lease.store.commit().snapshot_scheduled
    cache.release(lease, ok=True)


# A worker's cached store whose last commit could not be written to its full local disk.
FULL_DISK_CHILD = r"""
import json, os, sys
sys.path.insert(0, sys.argv[3])
from statekeeper import StoreConfig
from statekeeper.spark._cache import StoreCache, StoreSpec
from tests.small_tmpfs import fill

root, local = sys.argv[1], sys.argv[2]
config = StoreConfig(
    local_dir=local, snapshot_every=10_000, write_buffer_mb=1, io_threads=2,
    local_checkpoint_interval_s=0,  # flush on every commit: the full disk shows at once
)
spec = StoreSpec(root, "op", 1, config, (), lock_timeout_s=60.0)
cache = StoreCache()
out = {}
lease = cache.acquire(spec, 0, 0)
lease.store.put(b"a", b"1")
lease.store.commit()
cache.release(lease, ok=True)
lease = cache.acquire(spec, 0, 1)
out["first_reused"] = lease.reused
filler = os.path.join(local, "filler")
out["filled"] = fill(filler)
for i in range(64):
    lease.store.put(b"big%02d" % i, os.urandom(16 << 10))
out["committed"] = lease.store.commit().version  # durable; the local write fails behind it
cache.release(lease, ok=True)
try:  # the next task of the partition in this worker, the disk still full
    lease = cache.acquire(spec, 0, 2)
    out["second"] = "reused" if lease.reused else "opened"
    cache.release(lease, ok=False)
except Exception as exc:
    out["second"] = f"failed: {type(exc).__name__}: {exc}"
os.unlink(filler)
lease = cache.acquire(spec, 0, 2)  # space freed
out["third_reused"] = lease.reused
out["read"] = [lease.store.get(b"a").decode(), len(lease.store.get(b"big63"))]
cache.release(lease, ok=True)
cache.close_all()
print("RESULT " + json.dumps(out), flush=True)
"""


def test_a_store_whose_last_commit_failed_to_reach_its_local_disk_is_reopened_not_reused(
    tmp_path: Path,
) -> None:
    # The commit is durable, but writing it to the full local disk failed behind it: the
    # next task must get the store opened again (caught up from the root), not the failed
    # one, whose first call would fail the task (and, with local[N]'s one attempt, the query).
    out = run_on_small_tmpfs(FULL_DISK_CHILD, tmp_path / "root", tmp_path / "local")
    assert out["first_reused"] is True
    assert out["filled"] == 28  # ENOSPC: the filesystem really was full
    assert out["committed"] == 2
    # Opened again (or, the disk still full, failing to open, saying so): never the failed
    # store, which would fail every call with "it is failed".
    assert out["second"] == "opened" or "No space left" in str(out["second"]), out["second"]
    assert out["third_reused"] is False
    assert out["read"] == ["1", 16 << 10]


def test_a_request_for_one_of_many_idle_stores_is_served_and_the_others_kept(
    spec: StoreSpec,
) -> None:
    """The janitor looks for requests by the time of each operator's folder, not by each
    idle store's request file: a request for one of a dozen idle stores in two operators'
    folders, made well after the last release, is served; the other stores stay open."""
    first, second = StoreCache(idle_close_s=3600), StoreCache()
    other = dataclasses.replace(spec, operator="op2")
    try:
        for s in (spec, other):
            for partition in range(6):
                lease = first.acquire(dataclasses.replace(s, partitions=6), partition, 0)
                first.release(lease, ok=True)
        time.sleep(1.5)  # past the janitor's look at every store after the last release
        handed = second.acquire(dataclasses.replace(other, partitions=6), 4, 0)
        assert handed.reused is False
        second.release(handed, ok=True)
        held = {(operator, partition) for _, operator, partition in first.open_keys()}
        assert held == {(o, p) for o in ("op", "op2") for p in range(6)} - {("op2", 4)}
    finally:
        first.close_all()
        second.close_all()


def test_a_request_made_in_the_tick_of_the_last_look_is_still_seen(tmp_path: Path) -> None:
    """A folder's time may not change again within one tick of its coarse clock: a folder
    changed lately is looked in on every pass, one left alone is not."""
    folder = tmp_path / "op"
    folder.mkdir()
    watch = _RequestWatch()
    assert watch.folders({str(folder)}, everything=True) is None  # look in all
    StoreLock(str(folder / "0")).ask()  # the folder's time changes
    assert watch.folders({str(folder)}, everything=False) == {str(folder)}
    recent = time.time_ns() + 60 * 10**9  # "recent" without a race against the clock
    os.utime(folder, ns=(recent, recent))
    assert watch.folders({str(folder)}, everything=False) == {str(folder)}  # changed
    # The same time as before, but recent: looked in again, as a second request could
    # have come in the same tick.
    assert watch.folders({str(folder)}, everything=False) == {str(folder)}
    old = time.time_ns() - 10**9
    os.utime(folder, ns=(old, old))
    assert watch.folders({str(folder)}, everything=False) == {str(folder)}  # changed
    assert watch.folders({str(folder)}, everything=False) == set()  # old and unchanged
    assert watch.folders({str(folder)}, everything=True) is None


def test_close_all_stops_the_janitor_and_the_next_acquire_starts_one(
    cache: StoreCache, spec: StoreSpec
) -> None:
    lease = cache.acquire(spec, 0, 0)
    cache.release(lease, ok=False)  # closed: no idle store left
    assert cache._janitor is not None
    thread = cache._janitor[0]
    time.sleep(0.2)  # the janitor sleeps until its next sweep, 60 s away
    closing = threading.Thread(target=cache.close_all)
    closing.start()
    closing.join(30)  # once, a janitor waiting on its socket was not woken
    assert not closing.is_alive()
    assert not thread.is_alive()
    lease = cache.acquire(spec, 0, 0)
    assert cache._janitor is not None
    assert cache._janitor[0].is_alive()
    cache.release(lease, ok=True)


_FEW_FILES_CHILD = """
import os, resource, sys
from statekeeper import StoreConfig
from statekeeper.spark._cache import StoreCache, StoreSpec
root, local = sys.argv[1], sys.argv[2]
spec = StoreSpec(root, "op", 60, StoreConfig(local_dir=local), (), lock_timeout_s=60.0)
cache = StoreCache()
lease = cache.acquire(spec, 59, 0)  # threads, the backend, the first store: then the squeeze
cache.release(lease, ok=True)
limit = len(os.listdir("/proc/self/fd")) + 150
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
for partition in range(59):
    lease = cache.acquire(spec, partition, 0)
    lease.store.put(b"k", b"v%d" % partition)
    lease.store.commit()
    cache.release(lease, ok=True)
print(len(cache.open_keys()), len(os.listdir("/proc/self/fd")), limit)
cache.close_all()
"""


def test_a_worker_under_a_low_open_file_limit_closes_idle_stores_before_opening_more(
    tmp_path: Path,
) -> None:
    """Found by review: with 200 partitions per worker under ulimit -n 1024, the stores a
    worker kept open (up to max_open_stores=256, about 7 handles each plus SST files) ran
    it out of file handles and the task failed. Before an open, the least recently used idle
    stores are now closed while the process holds over 70% of its limit."""
    args = [str(tmp_path / "root"), str(tmp_path / "local")]
    child = subprocess.run(
        [sys.executable, "-c", _FEW_FILES_CHILD, *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    stores, held, limit = map(int, child.stdout.split())
    assert 0 < stores < 60  # some were closed, and the rest kept for their next task
    assert held <= limit


_NO_FILES_LEFT_CHILD = """
import os, resource
from statekeeper.spark._cache import _under_file_pressure
held = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (held + 20, held + 20))
opened = []
try:
    while True:
        opened.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
print(_under_file_pressure())
"""


def test_a_worker_with_no_file_handle_left_is_under_pressure() -> None:
    """Found by review: listing the open handles takes one, so at the limit the listing
    failed and the check said "no pressure", in exactly the case it is for."""
    child = subprocess.run(
        [sys.executable, "-c", _NO_FILES_LEFT_CHILD], capture_output=True, text=True, timeout=60
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "True"


# A lock taken on a full local disk (the lock file is made, writing the pid into it fails).
FULL_DISK_LOCK_CHILD = r"""
import json, os, subprocess, sys
sys.path.insert(0, sys.argv[3])
from statekeeper.spark._filelock import StoreLock
from tests.small_tmpfs import fill

local = sys.argv[2]
copy = os.path.join(local, "op", "3")
os.makedirs(os.path.dirname(copy))
out = {"filled": fill(os.path.join(local, "filler"))}
lock = StoreLock(copy)
try:
    lock.acquire(1.0)
    out["full"] = "acquired"
    lock.release()
except Exception as exc:
    out["full"] = f"{type(exc).__name__}: {exc}"
other = subprocess.run(
    [sys.executable, "-c", "import sys; from statekeeper.spark._filelock import StoreLock; "
     "StoreLock(sys.argv[1]).acquire(2.0); print('acquired')", copy],
    capture_output=True, text=True, env={**os.environ, "PYTHONPATH": sys.argv[3]},
)
out["other"] = other.stdout.strip() or other.stderr.strip()[-300:]
print("RESULT " + json.dumps(out), flush=True)
"""


def test_a_lock_taken_on_a_full_disk_is_taken_and_released(tmp_path: Path) -> None:
    """Writing the holder's pid into the lock file failed with ENOSPC after the lock was
    taken, and the failed acquire kept it: every task of the partition then timed out on
    "locked by another process", also after space was freed."""
    out = run_on_small_tmpfs(FULL_DISK_LOCK_CHILD, tmp_path / "root", tmp_path / "local")
    assert out["filled"] == 28  # ENOSPC: the filesystem really was full
    assert out["full"] == "acquired"
    assert out["other"] == "acquired"
