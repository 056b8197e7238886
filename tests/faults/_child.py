"""The process a SIGKILL trial kills: commits version after version and prints each ack.

.venv/bin/python -m tests.faults._child ROOT LOCAL MODE KILL_AT MAX_COMMITS

``KILL_AT`` > 0 SIGKILLs the process at that blob call (FaultyBlobStore); 0 leaves the kill
to the parent's timer. Every 4th commit runs a gc; snapshots run in the background.
"""

from __future__ import annotations

import sys

import statekeeper as sk
from statekeeper.storage import BlobStore, LocalBlobStore
from tests.blobstores import FaultyBlobStore
from tests.faults.common import apply

OPERATOR = "crash"
RETAIN = 6


def config(local_dir: str, mode: str) -> sk.StoreConfig:
    """The child's config; the checking process uses the same one."""
    return sk.StoreConfig(
        local_dir=local_dir,
        mode=mode,  # type: ignore[arg-type]
        snapshot_every=3,
        retain_versions=RETAIN,
        local_checkpoint_interval_s=0.02,
        write_buffer_mb=1,
        io_threads=2,
    )


def main(root: str, local: str, mode: str, kill_at: int, max_commits: int) -> None:
    blobs: BlobStore = LocalBlobStore(root)
    if kill_at > 0:
        blobs = FaultyBlobStore(blobs, fail_at=kill_at, kind="kill")
    backend = sk.StateBackend(blobs, config=config(local, mode))
    print("open", flush=True)
    with backend.open(OPERATOR, 0, partitions=1) as store:
        for n in range(max_commits):
            apply(store, store.version + 1)
            print("ack", store.commit().version, flush=True)
            if n % 4 == 3:
                backend.gc()
    backend.wait_for_snapshots()
    backend.close()
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
