"""Commit-metrics blobs: their own flush cadence, and per-commit accounting."""

from __future__ import annotations

from pathlib import Path

import pytest

import statekeeper as sk
from statekeeper import layout
from statekeeper.history import RootListing
from statekeeper.metrics import (
    CommitMetrics,
    commit_history,
    decode_commit_metrics,
    encode_commit_metrics,
    read_commit_metrics,
)


def _metrics_blobs(backend: sk.StateBackend) -> list[int]:
    return sorted(
        v
        for m in backend.blobs.list(layout.metrics_prefix("ops", 0))
        if (v := layout.parse_metrics_key(m.key)) is not None
    )


def test_metrics_are_flushed_every_metrics_every_commits_not_every_snapshot_every(
    tmp_path: Path,
) -> None:
    config = sk.StoreConfig(local_dir=str(tmp_path / "local"), snapshot_every=1000, metrics_every=3)
    with sk.StateBackend(str(tmp_path / "root"), config=config) as backend:
        with backend.open("ops", 0) as store:
            for v in range(1, 8):
                store.put(b"k", str(v).encode())
                store.commit()
            # 7 commits, no snapshot: two full buffers of 3 written, one commit buffered.
            assert _metrics_blobs(backend) == [3, 6]
        assert _metrics_blobs(backend) == [3, 6, 7]  # closing writes the rest
        recorded = read_commit_metrics(backend.blobs, "ops", 0)
    assert sorted(recorded) == list(range(1, 8))
    assert all(m.records == 1 and m.duration_ms > 0 for m in recorded.values())


def test_commit_history_counts_bytes_and_records_from_the_blobs(tmp_path: Path) -> None:
    config = sk.StoreConfig(local_dir=str(tmp_path / "local"), snapshot_every=1000)
    infos = []
    with sk.StateBackend(str(tmp_path / "root"), config=config) as backend:
        with backend.open("ops", 0) as store:
            for v in range(1, 5):
                for i in range(v):
                    store.put(f"k{i}".encode(), b"x" * 10)
                infos.append(store.commit())
        listing = RootListing.of(backend.blobs, root_id=backend.root_metadata().root_id)  # type: ignore[union-attr]
        commits = commit_history(backend.blobs, listing, "ops", 0)
        last_two = commit_history(backend.blobs, listing, "ops", 0, last=2)
    assert [(c.version, c.kind, c.records) for c in commits] == [
        (v, "changelog", v) for v in range(1, 5)
    ]
    assert [c.bytes for c in commits] == [i.bytes_uploaded for i in infos]
    assert all(c.latency_ms is not None and c.latency_ms > 0 for c in commits)
    assert [c.version for c in last_two] == [3, 4]


def test_commit_history_counts_every_part_and_keeps_the_phases(tmp_path: Path) -> None:
    config = sk.StoreConfig(
        local_dir=str(tmp_path / "local"), snapshot_every=1000, changelog_part_bytes=4096
    )
    with sk.StateBackend(str(tmp_path / "root"), config=config) as backend:
        with backend.open("ops", 0) as store:
            for i in range(500):  # ~60 kB of framed changes: many 4 KiB parts
                store.put(b"key%05d" % i, b"v" * 100)
            info = store.commit()
        listing = RootListing.of(backend.blobs, root_id=backend.root_metadata().root_id)  # type: ignore[union-attr]
        (commit,) = commit_history(backend.blobs, listing, "ops", 0)
        (recorded,) = read_commit_metrics(backend.blobs, "ops", 0).values()
    assert (commit.records, commit.bytes) == (500, info.bytes_uploaded)
    phases = commit.phases_ms
    assert phases is not None
    assert phases == recorded.phases_ms == info.phases_ms
    assert {"encode", "compress", "checksum", "upload", "fsync", "apply", "other"} <= set(phases)
    # The phases add up to the recorded latency (other is the remainder).
    assert sum(phases.values()) == pytest.approx(recorded.duration_ms, abs=0.01)


def test_a_metrics_blob_without_phases_is_read_as_before() -> None:
    entry = CommitMetrics(version=3, duration_ms=1.5, bytes=10, records=2, committed_time_ms=1)
    assert "phasesMs" not in entry.to_json()
    (decoded,) = decode_commit_metrics(encode_commit_metrics("ops", 0, [entry]), blob="x")
    assert decoded == entry
    assert decoded.phases_ms is None


def test_a_metrics_blob_is_checksummed_and_named_for_its_store() -> None:
    """A flipped digit still parses as JSON, and another store's blob under this name is
    well formed: only the checksum and the identity check catch them."""
    commits = [CommitMetrics(version=v, duration_ms=1.5, bytes=10, records=2, committed_time_ms=7)
               for v in (3, 4)]  # fmt: skip
    key = layout.metrics_key("op", 0, 4)
    blob = encode_commit_metrics("op", 0, commits)
    assert decode_commit_metrics(blob, blob=key) == commits
    edited = blob.replace(b'"bytes":10', b'"bytes":19', 1)
    assert edited != blob
    with pytest.raises(sk.CorruptStateError, match=f"{key}.*checksum mismatch"):
        decode_commit_metrics(edited, blob=key)
    other = encode_commit_metrics("op", 1, commits)
    with pytest.raises(sk.CorruptStateError, match="store op/0 up to version 4, found those of"):
        decode_commit_metrics(other, blob=key)
    with pytest.raises(sk.CorruptStateError, match="up to version 5, found those of store op/0"):
        decode_commit_metrics(blob, blob=layout.metrics_key("op", 0, 5))


def test_a_damaged_metrics_blob_is_left_out_and_the_rest_is_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: one damaged metrics blob failed ``statekeeper stats`` for the whole
    root, though metrics are not state."""
    config = sk.StoreConfig(local_dir=str(tmp_path / "local"), snapshot_every=1000, metrics_every=3)
    with sk.StateBackend(str(tmp_path / "root"), config=config) as backend:
        with backend.open("ops", 0) as store:
            for v in range(1, 7):
                store.put(b"k", str(v).encode())
                store.commit()
        damaged = tmp_path / "root" / layout.metrics_key("ops", 0, 3)
        damaged.write_bytes(damaged.read_bytes().replace(b'"records":1', b'"records":7', 1))
        recorded = read_commit_metrics(backend.blobs, "ops", 0)
    assert sorted(recorded) == [4, 5, 6]
    assert layout.metrics_key("ops", 0, 3) in caplog.text
