"""The epoch listener's bookkeeping, without a query (its work runs on one background
thread, and ``flush`` must wait for all of it whoever else flushed), and its removal."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from statekeeper import StoreConfig
from statekeeper.spark import (
    latest_manifest,
    remove_state_listener,
    state_listener,
    transform_with_state_arrow,
)
from statekeeper.spark._listener import StateListener
from statekeeper.storage import BlobMeta, LocalBlobStore
from tests.blobstores import RecordingBlobStore
from tests.spark.helpers import OUTPUT_SCHEMA, make_input, read_stream, run_to_end, write_files
from tests.spark.processors import arrow_count_sum


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


@pytest.mark.spark
def test_a_removed_listener_is_replaced_by_the_next_operator(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Found by review: after ``spark.streams.removeListener`` (the way the docs gave to let
    a Connect client exit) the session kept handing out the removed listener, which got no
    events: no metrics, no epoch manifests. ``remove_state_listener`` lets it go, and the
    next operator gets a listener that follows its query."""
    removed = state_listener(spark)
    assert remove_state_listener(spark)
    assert not remove_state_listener(spark)
    root = str(tmp_path / "state")
    write_files(tmp_path / "in", make_input(seed=5, files=1, rows=20, keys=5))
    out = transform_with_state_arrow(
        read_stream(spark, tmp_path / "in"), ["k"], arrow_count_sum, OUTPUT_SCHEMA, root,
        "vector", 2, config=StoreConfig(local_dir=str(tmp_path / "local")),
    )  # fmt: skip
    query = run_to_end(out, tmp_path / "out", tmp_path / "ck")
    listener = state_listener(spark)
    assert listener is not removed
    assert listener.wait_for(str(query.id), 0)[0].rows_in == 20
    listener.flush()
    manifest = latest_manifest(LocalBlobStore(root), "vector")
    assert manifest is not None
    assert manifest.epoch == 0
