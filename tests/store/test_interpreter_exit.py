"""A store used while Python exits: commits still made then, and uploads still running then.

Once the main thread returns, ``concurrent.futures`` pools refuse new work, before Python
waits for the other threads and runs ``atexit`` handlers. A program whose worker thread goes
on committing after that, or that ends with a background snapshot upload still running,
must lose neither a commit nor that snapshot. Each case runs in a child interpreter.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import statekeeper as sk
from statekeeper.manifest import read_newest_manifest
from statekeeper.metrics import read_commit_metrics

# The thread commits only once the main thread has returned: it waits for the main
# thread to end before its first write.
THREAD_CHILD = r"""
import sys, threading
import statekeeper as sk
main = threading.main_thread()
def work():
    main.join()
    config = sk.StoreConfig(local_dir=sys.argv[2], snapshot_every=2, io_threads=4,
                            chunk_size=64 * 1024)
    with sk.StateBackend(sys.argv[1], config=config) as backend:
        with backend.open("op", partition=0) as store:
            for v in range(1, 5):
                for i in range(4000):
                    store.put(b"k%06d" % (v * 4000 + i), b"v%d" % v * 50)
                print(store.commit().version, flush=True)
threading.Thread(target=work).start()
"""

# The snapshot of version 1 is far from uploaded when the main thread returns: about 12 MB
# of SST in 64 KiB chunks over 4 transfer threads, each chunk's write slowed by 20 ms (at
# least a second in all). The child prints whether the root named the snapshot when its
# main thread returned. The store is never closed.
EXIT_CHILD = r"""
import sys, time
import statekeeper as sk
from statekeeper.storage import LocalBlobStore
class SlowFiles(LocalBlobStore):
    def put(self, key, data, **kw):
        if "/files/" in key:
            time.sleep(0.02)
        return super().put(key, data, **kw)
config = sk.StoreConfig(local_dir=sys.argv[2], snapshot_every=1, io_threads=4,
                        chunk_size=64 * 1024, compression="none")
backend = sk.StateBackend(SlowFiles(sys.argv[1], io_threads=4), config=config)
store = backend.open("op", partition=0)
for i in range(100_000):
    store.put(b"k%08d" % i, bytes([i % 251]) * 120)
info = store.commit()
print(info.version, info.snapshot_scheduled, flush=True)
print("snapshot-at-exit", backend.blobs.list("op/0/snapshot/") != [], flush=True)
"""


def _run(code: str, tmp_path: Path) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "root"), str(tmp_path / "local")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "failed" not in proc.stderr, proc.stderr
    return proc.stdout.split()


def _snapshots(backend: sk.StateBackend) -> list[int]:
    root_id = backend.root_metadata().root_id  # type: ignore[union-attr]
    manifest = read_newest_manifest(backend.blobs, root_id=root_id, operator="op", partition=0)
    assert manifest is not None
    return sorted(s.version for s in manifest.snapshots)


@contextlib.contextmanager
def _reopened(tmp_path: Path) -> Iterator[sk.StateStore]:
    """The store opened from the root alone, in a fresh local folder."""
    config = sk.StoreConfig(local_dir=str(tmp_path / "fresh"))
    with (
        sk.StateBackend(str(tmp_path / "root"), config=config) as backend,
        backend.open("op", partition=0) as store,
    ):
        yield store


def test_a_thread_committing_after_the_main_thread_returned_commits_and_snapshots(
    tmp_path: Path,
) -> None:
    assert _run(THREAD_CHILD, tmp_path) == ["1", "2", "3", "4"]
    with sk.StateBackend(str(tmp_path / "root")) as backend:
        assert backend.versions("op", 0)[-1] == 4
        # Taken in the committing thread, as the snapshot pool took no new work.
        assert _snapshots(backend) == [2, 4]
        assert sorted(read_commit_metrics(backend.blobs, "op", 0)) == [1, 2, 3, 4]
        assert backend.verify().ok
    with _reopened(tmp_path) as store:
        assert store.version == 4
        assert (store.restore_info.base_kind, store.restore_info.base) == ("snapshot", 4)
        assert len(dict(store.scan())) == 16_000
        assert store.get(b"k%06d" % 4000) == b"v1" * 50


def test_a_snapshot_still_uploading_when_the_program_ends_is_finished(tmp_path: Path) -> None:
    assert _run(EXIT_CHILD, tmp_path) == ["1", "True", "snapshot-at-exit", "False"]
    with sk.StateBackend(str(tmp_path / "root")) as backend:
        assert _snapshots(backend) == [1]
        assert backend.verify().ok
    with _reopened(tmp_path) as store:
        assert (store.restore_info.base_kind, store.restore_info.base) == ("snapshot", 1)
        assert store.get(b"k%08d" % 99_999) == bytes([99_999 % 251]) * 120
