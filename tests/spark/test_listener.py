"""The epoch listener's bookkeeping, without a query: its work runs on one background
thread, and ``flush`` must wait for all of it whoever else flushed."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

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


def test_a_flush_after_another_one_timed_out_still_waits_for_the_same_work(
    tmp_path: Path,
) -> None:
    """A flush took the pending work for itself, so a flush at the same time, or after it
    timed out, returned at once while a manifest was still being written."""
    blobs = _GatedStore(tmp_path / "root")
    listener = StateListener()
    try:
        listener.register(blobs, "op", 1)
        listener.handle_batch("query", 0)
        assert blobs.entered.wait(30)  # the batch is being processed, held at the gate
        for _ in range(2):
            with pytest.raises(TimeoutError):
                listener.flush(0.05)
        blobs.gate.set()
        listener.flush(30)
    finally:
        blobs.gate.set()
        listener.close()
