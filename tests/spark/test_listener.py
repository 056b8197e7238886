"""The epoch listener's bookkeeping, without a query: its work runs on one background
thread, and ``flush`` must wait for all of it whoever else is flushing."""

from __future__ import annotations

import threading
from pathlib import Path

from statekeeper.spark._listener import StateListener
from statekeeper.storage import BlobMeta, LocalBlobStore
from tests.blobstores import RecordingBlobStore


class _GatedStore(RecordingBlobStore):
    """Holds every listing until ``gate`` is set, telling ``entered`` when one waits."""

    def __init__(self, root: Path) -> None:
        super().__init__(LocalBlobStore(root))
        self.gate = threading.Event()
        self.entered = threading.Event()

    def list(self, prefix: str = "") -> list[BlobMeta]:
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return super().list(prefix)


def test_a_second_concurrent_flush_waits_for_the_same_work(tmp_path: Path) -> None:
    """The first flush took the pending work for itself, so a second one returned at once
    while a manifest was still being written."""
    blobs = _GatedStore(tmp_path / "root")
    listener = StateListener()
    try:
        listener.register(blobs, "op", 1)
        listener.handle_batch("query", 0)
        assert blobs.entered.wait(30)
        done: list[str] = []
        flushes = [
            threading.Thread(target=lambda n=n: (listener.flush(60), done.append(n)))
            for n in ("first", "second")
        ]
        for thread in flushes:
            thread.start()
        for thread in flushes:
            thread.join(0.5)
        assert done == [], "a flush returned while the batch was still being processed"
        blobs.gate.set()
        for thread in flushes:
            thread.join(30)
        assert sorted(done) == ["first", "second"]
    finally:
        blobs.gate.set()
        listener.close()
