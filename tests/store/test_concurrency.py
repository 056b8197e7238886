"""Two writers, zombies and transient failures at the store level."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import statekeeper as sk
from statekeeper.storage import LocalBlobStore
from tests.blobstores import FaultyBlobStore


def _backend(tmp_path: Path, name: str, **kwargs: object) -> sk.StateBackend:
    config = sk.StoreConfig(local_dir=str(tmp_path / name), **kwargs)  # type: ignore[arg-type]
    return sk.StateBackend(str(tmp_path / "root"), config=config)


@pytest.mark.parametrize("mode", ["changelog", "snapshot"])
def test_racing_writers_exactly_one_wins(tmp_path: Path, mode: str) -> None:
    writers = [_backend(tmp_path, f"w{i}", mode=mode) for i in range(4)]
    stores = [w.open("op", 0) for w in writers]
    for i, store in enumerate(stores):
        store.put(b"winner", b"%d" % i)
    barrier = threading.Barrier(len(stores))
    outcomes: list[str] = ["?"] * len(stores)

    def commit(i: int) -> None:
        barrier.wait()
        try:
            stores[i].commit()
            outcomes[i] = "won"
        except sk.CommitConflictError:
            outcomes[i] = "conflict"

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(outcomes) == ["conflict"] * 3 + ["won"]
    for store in stores:
        store.close()
    with _backend(tmp_path, "reader").open("op", 0) as store:
        assert store.version == 1
        assert store.get(b"winner") == b"%d" % outcomes.index("won")


def test_a_zombie_attempt_cannot_make_a_committed_version_unreadable(tmp_path: Path) -> None:
    live, zombie = _backend(tmp_path, "live"), _backend(tmp_path, "zombie")
    with live.open("op", 0) as store:
        store.put(b"k", b"0")
        store.commit()
    stale = zombie.open("op", 0)  # an old task attempt, still running at version 1
    with live.open("op", 0) as store:
        for v in range(2, 5):
            store.put(b"k", b"%d" % v)
            store.commit()
    stale.put(b"k", b"zombie")
    with pytest.raises(sk.CommitConflictError):
        stale.commit()  # version 2 exists: refused, nothing overwritten
    stale.close()
    with _backend(tmp_path, "check").open("op", 0) as store:
        assert (store.version, store.get(b"k")) == (4, b"4")
    assert _backend(tmp_path, "v").verify(deep=True).ok


def test_commit_after_a_transient_failure_keeps_the_writes_and_succeeds(tmp_path: Path) -> None:
    root = tmp_path / "root"
    faulty = FaultyBlobStore(LocalBlobStore(str(root)), fail_at=10**9, op="put", kind="transient")
    backend = sk.StateBackend(faulty, config=sk.StoreConfig(local_dir=str(tmp_path / "l")))
    with backend.open("op", 0) as store:
        store.put(b"k", b"v")
        faulty.fail_at, faulty.seen = 1, 0  # the changelog put fails (retries exhausted)
        with pytest.raises(sk.TransientStorageError):
            store.commit()
        assert store.get(b"k") == b"v"  # nothing lost, nothing applied
        assert store.version == 0
        assert store.commit().version == 1
    with _backend(tmp_path, "check").open("op", 0) as store:
        assert store.get(b"k") == b"v"
