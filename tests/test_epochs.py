"""Epoch manifests without Spark: keyed by query, checksummed, the cut tools read, expired
per query."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import statekeeper as sk
from statekeeper import layout
from statekeeper.epochs import (
    Cut,
    EpochManifest,
    StoreEntry,
    consistent_cut,
    latest_epoch,
    latest_manifest,
    newest_manifests,
    pinned_versions,
    read_manifest,
    write_manifest,
)
from statekeeper.gc import collect_garbage
from statekeeper.history import StoreHistory
from statekeeper.reports import KEEP_BATCHES, sweep_reports
from statekeeper.storage import LocalBlobStore

Q1, Q2 = "0b5c2f0e-1111-4c1e-9a52-0c6d7a1e0001", "0b5c2f0e-2222-4c1e-9a52-0c6d7a1e0002"


def _manifest(query: str, epoch: int, operator: str, created: int) -> EpochManifest:
    entries = [StoreEntry(p, epoch + 1, f"{operator}/{p}/changelog/x", None, None) for p in (0, 1)]
    return EpochManifest(epoch, query, "run", created, {operator: 2}, {operator: entries})


@pytest.fixture
def blobs(tmp_path: Path) -> LocalBlobStore:
    return LocalBlobStore(str(tmp_path / "root"))


def test_two_queries_on_one_root_each_keep_their_epochs(blobs: LocalBlobStore) -> None:
    for epoch in range(3):
        assert write_manifest(blobs, _manifest(Q1, epoch, "counts", 1000 + epoch))
    for epoch in range(2):
        # The same epoch numbers with other versions: another query, not a conflict.
        assert write_manifest(blobs, _manifest(Q2, epoch, "dedup", 2000 + epoch))
    assert (latest_epoch(blobs, Q1), latest_epoch(blobs, Q2), latest_epoch(blobs)) == (2, 1, 2)
    assert read_manifest(blobs, 1, Q1).stores.keys() == {"counts"}
    assert read_manifest(blobs, 1, Q2).stores.keys() == {"dedup"}
    assert read_manifest(blobs, 2).query_id == Q1  # only one query has epoch 2
    with pytest.raises(ValueError, match="2 queries have an epoch manifest for epoch 1"):
        read_manifest(blobs, 1)
    assert blobs.head(layout.epoch_key(0, Q2)).key == f"_epochs/{Q2}/{0:020d}.json"
    # A re-run of an epoch with the same versions is no conflict; other versions are.
    assert not write_manifest(blobs, _manifest(Q1, 2, "counts", 9999))
    clash = _manifest(Q1, 2, "counts", 1)
    clash.stores["counts"][0] = StoreEntry(0, 7, None, None, None)
    with pytest.raises(sk.CommitConflictError, match=f"another run of query {Q1}"):
        write_manifest(blobs, clash)


def test_the_cut_is_the_newest_manifest_naming_the_operator(blobs: LocalBlobStore) -> None:
    write_manifest(blobs, _manifest(Q1, 0, "counts", 1))
    write_manifest(blobs, _manifest(Q2, 5, "dedup", 2))
    cut = latest_manifest(blobs, "counts")
    assert cut is not None
    assert (cut.query_id, cut.epoch, cut.versions()) == (Q1, 0, {"counts": [1, 1]})
    newest = latest_manifest(blobs)
    assert newest is not None
    assert newest.query_id == Q2
    assert latest_manifest(blobs, "missing") is None


def test_a_damaged_manifest_is_refused_and_the_cut_falls_back(blobs: LocalBlobStore) -> None:
    write_manifest(blobs, _manifest(Q1, 0, "counts", 1))
    write_manifest(blobs, _manifest(Q1, 1, "counts", 2))
    key = layout.epoch_key(1, Q1)
    doc = json.loads(blobs.get(key))
    doc["operators"]["counts"]["stores"][1]["version"] = 99  # a hand edit
    blobs.put(key, json.dumps(doc).encode(), overwrite=True)
    with pytest.raises(sk.CorruptStateError, match=f"epoch manifest {key}.*checksum mismatch"):
        read_manifest(blobs, 1, Q1)
    cut = latest_manifest(blobs, "counts")
    assert cut is not None
    assert cut.epoch == 0


def test_a_format_1_manifest_still_reads(blobs: LocalBlobStore) -> None:
    doc = json.loads(_manifest(Q1, 3, "counts", 1).to_json())
    del doc["crc32c"]
    doc["formatVersion"] = 1
    blobs.put(layout.epoch_key(3), json.dumps(doc).encode())
    assert latest_epoch(blobs) == 3
    assert read_manifest(blobs, 3).versions() == {"counts": [4, 4]}
    assert layout.parse_epoch_key(layout.epoch_key(3)) == (None, 3)


def test_gc_keeps_the_newest_epochs_of_every_query(blobs: LocalBlobStore, tmp_path: Path) -> None:
    for epoch in range(5):
        write_manifest(blobs, _manifest(Q1, epoch, "counts", epoch))
    for epoch in range(3):
        write_manifest(blobs, _manifest(Q2, epoch, "dedup", epoch))
    config = sk.StoreConfig(local_dir=str(tmp_path / "l"), retain_versions=2)
    deleted = collect_garbage(blobs, config, []).deleted_keys
    assert sorted(deleted) == sorted(
        [layout.epoch_key(e, Q1) for e in (0, 1, 2)] + [layout.epoch_key(0, Q2)]
    )
    assert (latest_epoch(blobs, Q1), latest_epoch(blobs, Q2)) == (4, 2)


def test_gc_sweeps_task_reports_past_the_window_tasks_keep(
    blobs: LocalBlobStore, tmp_path: Path
) -> None:
    """Tasks prune their own partition's reports past KEEP_BATCHES; GC applies the same
    window to what no task prunes any more (here the partitions of a stopped operator)."""
    newest = KEEP_BATCHES + 3
    for batch in (0, 2, 3, newest):
        for partition in (0, 1):
            blobs.put(layout.report_key("counts", batch, partition), b"{}")
    blobs.put(layout.report_key("other", 0, 0), b"{}")  # its newest batch: kept
    config = sk.StoreConfig(local_dir=str(tmp_path / "l"), retain_versions=2)
    deleted = collect_garbage(blobs, config, []).deleted_keys
    assert sorted(deleted) == sorted(
        layout.report_key("counts", b, p) for b in (0, 2) for p in (0, 1)
    )
    assert len(blobs.list(layout.reports_prefix())) == 5
    assert sweep_reports(blobs, keep=0) == [layout.report_key("counts", 3, p) for p in (0, 1)]


def _committed(tmp_path: Path, versions: list[int]) -> sk.StateBackend:
    """A root whose operator ``counts`` has partition ``p`` at ``versions[p]``."""
    backend = sk.StateBackend(
        str(tmp_path / "root"), config=sk.StoreConfig(local_dir=str(tmp_path / "wc"))
    )
    for p, count in enumerate(versions):
        with backend.open("counts", p, partitions=len(versions)) as store:
            for v in range(count):
                store.put(b"k", b"%d" % v)
                store.commit()
    return backend


def _cut(backend: sk.StateBackend, only: list[int] | None = None) -> Cut:
    meta = backend.root_metadata()
    assert meta is not None

    def history(p: int) -> StoreHistory:
        return StoreHistory.load(backend.blobs, "counts", p, root_id=meta.root_id)

    return consistent_cut(backend.blobs, "counts", 2, history, only=only)


def test_the_consistent_cut_is_what_the_newest_manifest_names(tmp_path: Path) -> None:
    backend = _committed(tmp_path, [5, 5])
    write_manifest(backend.blobs, _manifest(Q1, 3, "counts", 1))  # names version 4
    write_manifest(backend.blobs, _manifest(Q2, 9, "dedup", 2))  # another query's operator
    cut = _cut(backend)
    # Not 5, the newest both partitions have: micro-batch 4 may have failed after its
    # commits (it runs again on restart).
    assert cut.versions == {0: 4, 1: 4}
    assert cut.manifest is not None
    assert cut.manifest.query_id == Q1
    assert cut.describe() == f"epoch 3 of query {Q1}"
    assert _cut(backend, only=[1]).versions == {1: 4}


def test_a_manifest_older_than_a_finished_micro_batch_is_not_the_cut(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A query run from a classic session (its listener wrote epoch 3) and then from Spark
    Connect (no manifests): partition 0 at version 6 shows that micro-batch 4 finished, so
    the manifest is stale. Readers and repartition once took it, and a rescale then started
    the new stores at version 4 while the query needed 6: it failed for good."""
    backend = _committed(tmp_path, [6, 5])
    write_manifest(backend.blobs, _manifest(Q1, 3, "counts", 1))  # names version 4
    with caplog.at_level("WARNING", logger="statekeeper.epochs"):
        cut = _cut(backend)
    assert (cut.versions, cut.manifest) == ({0: 5, 1: 5}, None)
    assert "names version 4 of partition 0, which is at version 6" in caplog.text
    assert "finished since, with no epoch manifest" in cut.describe()


def test_without_a_usable_manifest_the_cut_is_the_newest_common_version(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = _committed(tmp_path, [6, 5])
    with caplog.at_level("INFO", logger="statekeeper.epochs"):
        cut = _cut(backend)
    assert (cut.versions, cut.manifest) == ({0: 5, 1: 5}, None)
    assert "no epoch manifest names operator 'counts'" in caplog.text
    assert _cut(backend, only=[0]).versions == {0: 6}
    # A manifest naming a version one partition does not have (yet, or any more).
    write_manifest(backend.blobs, _manifest(Q1, 5, "counts", 1))  # names version 6
    caplog.clear()
    with caplog.at_level("WARNING", logger="statekeeper.epochs"):
        cut = _cut(backend)
    assert (cut.versions, cut.manifest) == ({0: 5, 1: 5}, None)
    assert f"epoch manifest 5 of query {Q1} names version 6 of partition 1" in caplog.text
    assert "names version 6 of partition 1" in cut.describe()
    # One recording another partition count (the operator was recreated): not this one's.
    entries = [StoreEntry(0, 2, None, None, None)]
    other = EpochManifest(7, Q2, None, 3, {"counts": 1}, {"counts": entries})
    write_manifest(backend.blobs, other)
    assert (
        _cut(backend).reason == f"epoch manifest 7 of query {Q2} records 1 partitions, the root 2"
    )


def test_pinned_versions_are_the_oldest_each_querys_newest_manifest_names(
    blobs: LocalBlobStore,
) -> None:
    write_manifest(blobs, _manifest(Q1, 2, "counts", 1))  # not Q1's newest: not pinned
    write_manifest(blobs, _manifest(Q1, 8, "counts", 2))
    write_manifest(blobs, _manifest(Q2, 4, "counts", 3))  # a stale query on the same operator
    assert sorted(m.epoch for m in newest_manifests(blobs)) == [4, 8]
    assert pinned_versions(blobs) == {("counts", 0): 5, ("counts", 1): 5}
