"""Fault injection: fail or kill at every blob store call of a restore, commit, snapshot and
gc, then check the invariants of ARCHITECTURE §5."""

from __future__ import annotations

import functools
import multiprocessing
import os
import shutil
import signal
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

import statekeeper as sk
from statekeeper import layout
from statekeeper.snapshot import SnapshotIndex, referenced_blob_ids
from statekeeper.storage import LocalBlobStore
from tests.blobstores import FaultyBlobStore, RecordingBlobStore, gc_later

RETAIN = 5


def changes(version: int) -> list[tuple[bytes, bytes | None]]:
    """Commit ``version``: 30 puts over 200 keys and one delete, deterministic."""
    out: list[tuple[bytes, bytes | None]] = [
        (b"k%03d" % ((version * 11 + i) % 200), b"%d:%d" % (version, i) * 20) for i in range(30)
    ]
    out.append((b"k%03d" % (version * 5 % 200), None))
    return out


def expected(version: int) -> dict[bytes, bytes]:
    state: dict[bytes, bytes] = {}
    for v in range(1, version + 1):
        for key, value in changes(v):
            if value is None:
                state.pop(key, None)
            else:
                state[key] = value
    return state


def config(local_dir: str, **kwargs: object) -> sk.StoreConfig:
    base: dict[str, object] = {
        "local_dir": local_dir,
        "snapshot_every": 10_000,  # snapshots only where the scenario asks for them
        "retain_versions": RETAIN,
        "orphan_ttl_s": 0,
        "write_buffer_mb": 1,
        "io_threads": 2,
    }
    base.update(kwargs)
    return sk.StoreConfig(**base)  # type: ignore[arg-type]


def apply(store: sk.StateStore, version: int) -> None:
    for key, value in changes(version):
        if value is None:
            store.delete(key)
        else:
            store.put(key, value)


def scenario(backend: sk.StateBackend, ack: list[int]) -> None:
    """Restore (snapshot + changelogs), commit, snapshot, commit, gc."""
    with backend.open("op", 0) as store:
        for _ in range(2):
            apply(store, store.version + 1)
            ack.append(store.commit().version)
            store.snapshot_now()
    backend.gc()


class _SentAcks(list[int]):
    """Acknowledged versions, each also sent to the parent as it is acknowledged (the child
    may be killed at the next call)."""

    def __init__(self, conn: Connection) -> None:
        super().__init__()
        self._conn = conn

    def append(self, version: int) -> None:
        super().append(version)
        self._conn.send(("ack", version))


def _run_killed_at(root: str, local: str, fail_at: int, conn: Connection) -> None:
    """The child of the kill walk: the scenario, SIGKILLed at blob call ``fail_at``."""
    try:
        blobs = FaultyBlobStore(LocalBlobStore(root), fail_at=fail_at, kind="kill")
        backend = sk.StateBackend(blobs, config=config(local))
        scenario(backend, _SentAcks(conn))
        conn.send(("done", blobs.seen))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


_FORKS = multiprocessing.get_context("forkserver")
"""Children forked from a server that imported statekeeper and this module once: a kill
point costs the scenario, not an interpreter's start and imports (a third of a second each,
most of the walk's time as subprocesses)."""
_FORKS.set_forkserver_preload(["statekeeper", __name__])


def _killed_run(root: Path, local: Path, fail_at: int) -> tuple[list[int], bool, int | None]:
    """Run the scenario in a child killed at blob call ``fail_at``: the versions it
    acknowledged, whether it reached the end, and its exit code."""
    ours, theirs = _FORKS.Pipe(duplex=False)
    child = _FORKS.Process(target=_run_killed_at, args=(str(root), str(local), fail_at, theirs))
    child.start()
    theirs.close()
    acks, done, error = [], False, ""
    deadline = time.monotonic() + 120
    try:
        while True:  # until the child's end closes: it finished, failed or was killed
            if not ours.poll(max(0.0, deadline - time.monotonic())):
                child.kill()
                raise AssertionError(f"the child killed at call {fail_at} hung for 120 s")
            kind, value = ours.recv()
            if kind == "ack":
                acks.append(value)
            elif kind == "done":
                done = True
            else:
                error = value
    except EOFError:
        pass
    child.join(timeout=120)
    assert not error, error
    return acks, done, child.exitcode


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root at version 12 with a snapshot at 10."""
    tmp = tmp_path_factory.mktemp("template")
    backend = sk.StateBackend(str(tmp / "root"), config=config(str(tmp / "local")))
    with backend.open("op", 0, partitions=1) as store:
        for v in range(1, 13):
            apply(store, v)
            store.commit()
            if v == 10:
                store.snapshot_now()
    backend.close()
    return tmp / "root"


TEMPLATE_AGE_S = 1000.0
"""How old every blob of the template is in each copy: past every grace GC gives a blob
(``MIN_ORPHAN_TTL_S``, the manifests'), so each run of the scenario makes the same calls
(its GC deletes the template's superseded manifests and expired changelogs), whenever it
runs. ``copytree`` alone kept the template's own times, and a slow run crossed a grace
midway: a run then made a call fewer or more than the run that counted them."""


def copy_template(template: Path, root: Path) -> None:
    shutil.copytree(template, root)
    stamp = time.time() - TEMPLATE_AGE_S
    for path in root.rglob("*"):
        if path.is_file():
            os.utime(path, (stamp, stamp))


def check_invariants(root: Path, tmp: Path, last_ack: int) -> None:
    """The last acknowledged version opens exactly; nothing retained was deleted; after a gc
    past the TTL no orphan is left and everything verifies."""
    fresh = sk.StateBackend(str(root), config=config(str(tmp / "check")))
    with fresh.open("op", 0) as store:
        latest = store.version
        assert last_ack <= latest <= last_ack + 1
        assert dict(store.scan()) == expected(latest)
    versions = fresh.versions("op", 0)
    assert set(range(latest - RETAIN + 1, latest + 1)) <= set(versions)
    for version in (latest - RETAIN + 1, latest - 1):
        with fresh.open("op", 0, version=version) as store:
            assert dict(store.scan()) == expected(version)
    gc_later(fresh)
    referenced: set[str] = set()
    for meta in fresh.blobs.list(layout.snapshot_prefix("op", 0)):
        index = SnapshotIndex.from_json(fresh.blobs.get(meta.key), blob=meta.key)
        referenced |= {layout.file_blob_key("op", 0, b) for b in referenced_blob_ids(index)}
    files = {m.key for m in fresh.blobs.list(layout.files_prefix("op", 0))}
    assert files == referenced, "orphans survived a gc past the TTL"
    report = fresh.verify(deep=True)
    assert report.ok, report.problems
    fresh.close()


@pytest.mark.slow
def test_kill_at_every_call_keeps_every_invariant(template: Path, tmp_path: Path) -> None:
    tried = 0
    for fail_at in range(1, 200):
        work = tmp_path / f"n{fail_at}"
        copy_template(template, work / "root")
        acks, done, code = _killed_run(work / "root", work / "local", fail_at)
        assert done or code == -signal.SIGKILL, f"exit code {code}"
        check_invariants(work / "root", work, acks[-1] if acks else 12)
        shutil.rmtree(work)
        if done:
            break
        tried += 1
    assert done, "the walk never reached the end of the scenario"
    assert tried > 20  # every call of restore, commit, snapshot and gc was a kill point
    print(f"kill points tried: {tried}")


def _calls_of_scenario(template: Path, tmp: Path) -> int:
    copy_template(template, tmp / "root")
    blobs = RecordingBlobStore(LocalBlobStore(str(tmp / "root")))
    backend = sk.StateBackend(blobs, config=config(str(tmp / "local")))
    scenario(backend, [])
    backend.close()
    return len(blobs.calls)


def _fail_at(template: Path, tmp: Path, kind: str, fail_at: int) -> bool:
    """One point of the failure walk, in a worker process that carries on after it, as the
    process of a failed call would: the scenario with blob call ``fail_at`` failing, the
    invariants, then the scenario again and the invariants. True if the failure reached
    the caller (else it was absorbed, e.g. an expired index gc skips)."""
    try:
        work = tmp / f"{kind}{fail_at}"
        copy_template(template, work / "root")
        blobs = FaultyBlobStore(LocalBlobStore(str(work / "root")), fail_at=fail_at, kind=kind)
        acks: list[int] = []
        raised = False
        try:
            backend = sk.StateBackend(blobs, config=config(str(work / "local")))
            try:
                scenario(backend, acks)
            finally:
                backend.close()
        except sk.StorageError:
            raised = True
        assert blobs.seen >= fail_at
        check_invariants(work / "root", work, acks[-1] if acks else 12)
        retry = sk.StateBackend(str(work / "root"), config=config(str(work / "local")))
        scenario(retry, acks)
        retry.close()
        check_invariants(work / "root", work, acks[-1])
        shutil.rmtree(work)
    except AssertionError as exc:
        # The pool re-raises it here with the worker's traceback as its cause.
        raise AssertionError(f"{kind} failure at call {fail_at}: {exc}") from exc
    return raised


@pytest.mark.parametrize("kind", ["transient", "permanent"])
def test_failure_at_every_call_keeps_every_invariant(
    template: Path, tmp_path: Path, kind: str
) -> None:
    total = _calls_of_scenario(template, tmp_path / "count")
    # The points are independent: two at a time, one per core.
    walk = functools.partial(_fail_at, template, tmp_path, kind)
    with ProcessPoolExecutor(max_workers=2, mp_context=_FORKS) as pool:
        raised = sum(pool.map(walk, range(1, total + 1)))
    assert raised > 30
    print(f"{kind} failure points tried: {total}, raised to the caller: {raised}")
