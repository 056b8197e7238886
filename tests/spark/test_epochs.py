"""Epoch manifests, task reports and their aggregation into batch metrics."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from statekeeper import (
    CommitConflictError,
    ConfigMismatchError,
    CorruptStateError,
    StateBackend,
    StoreConfig,
    layout,
)
from statekeeper.epochs import build_manifest, write_manifest
from statekeeper.reports import (
    TaskReport,
    decode_report,
    encode_report,
    read_reports,
    write_report,
)
from statekeeper.spark import EpochManifest, latest_epoch, read_manifest
from statekeeper.spark._metrics import aggregate
from statekeeper.storage import open_blob_store
from tests.blobstores import store_history


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[StateBackend]:
    config = StoreConfig(local_dir=str(tmp_path / "local"))
    with StateBackend(str(tmp_path / "root"), config=config) as backend:
        yield backend


def _commit(backend: StateBackend, partition: int, times: int) -> None:
    for v in range(times):
        with backend.open("op", partition, v) as store:
            store.put(b"k", str(v).encode())
            store.commit()
    backend.snapshot("op", partition)  # of the latest version


def _root_id(backend: StateBackend) -> str:
    meta = backend.root_metadata()
    assert meta is not None
    return meta.root_id


def test_a_manifest_names_versions_commits_and_snapshots(backend: StateBackend) -> None:
    _commit(backend, 0, 2)
    _commit(backend, 1, 2)
    histories = [store_history(backend, "op", p) for p in (0, 1)]
    manifest, why = build_manifest(
        backend.blobs, epoch=1, query_id="q", run_id="r",
        operators={"op": 2}, root_id=_root_id(backend),
    )  # fmt: skip
    assert manifest is not None, why
    assert write_manifest(backend.blobs, manifest)
    read = read_manifest(backend.blobs, 1)
    assert read.versions() == {"op": [2, 2]}
    assert [e.commit_blob for e in read.stores["op"]] == [
        h.changelog_key(2)
        for h in histories  # from each partition's history
    ]
    assert [e.snapshot_index for e in read.stores["op"]] == [h.index_key(2) for h in histories]
    assert latest_epoch(backend.blobs) == 1
    assert not write_manifest(backend.blobs, manifest)  # a re-run of the epoch: no change
    other = dataclasses.replace(manifest, stores={"op": manifest.stores["op"][:1]})
    with pytest.raises(CommitConflictError, match="exists with other versions"):
        write_manifest(backend.blobs, other)


def test_an_incomplete_epoch_gets_no_manifest(backend: StateBackend) -> None:
    _commit(backend, 0, 1)
    manifest, why = build_manifest(
        backend.blobs,
        epoch=0,
        query_id="q",
        run_id=None,
        operators={"op": 2},
        root_id=_root_id(backend),
    )
    assert manifest is None
    assert why == "partition 1 of operator 'op' has not committed version 1"
    assert latest_epoch(backend.blobs) is None


def test_unknown_or_newer_manifests_are_refused() -> None:
    with pytest.raises(CorruptStateError, match="epoch manifest x is not valid"):
        EpochManifest.from_json(b"[]", blob="x")
    newer = b'{"format": "statekeeper.epoch", "formatVersion": 99}'
    with pytest.raises(ConfigMismatchError, match="format version 99"):
        EpochManifest.from_json(newer, blob="x")


def _report(partition: int, batch: int = 3, **changes: object) -> TaskReport:
    base = TaskReport(
        query_id="q", batch_id=batch, root="file:///r", operator="op", partition=partition,
        attempt=0, version=batch + 1, commit_blob="b", commit_s=0.01 * (partition + 1),
        bytes_uploaded=100, puts=2, deletes=1, snapshot_scheduled=False, reused=True,
        open_s=0.0, restored=False, restore_s=0.0, restore_bytes=0, rows_in=10, rows_out=5,
        keys=5, expired=0, task_s=0.1,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_report_blobs_round_trip_and_a_re_run_replaces_its_report(tmp_path: Path) -> None:
    blobs = open_blob_store(str(tmp_path / "root"))
    write_report(blobs, _report(1))
    write_report(blobs, _report(0, rows_in=1))
    write_report(blobs, _report(0, rows_in=2))  # the re-run's report replaces the first
    write_report(blobs, _report(0, batch=1))
    found = read_reports(blobs, "op", 3)
    assert [(r.partition, r.rows_in) for r in found] == [(0, 2), (1, 10)]
    assert all(r.written_ms > 0 for r in found)
    assert [r.batch_id for r in read_reports(blobs, "op", 1)] == [1]


def test_aggregation_counts_each_partition_once() -> None:
    reports = [
        _report(0, commit_s=0.5),
        _report(0, commit_s=0.01),  # the same partition reported again: the latest counts
        _report(1, reused=False, restored=True, restore_s=2.0, restore_bytes=7),
        _report(2, reused=False),
    ]
    m = aggregate(reports, partitions=4, query_id="q", batch_id=3)
    assert (m.partitions, m.partitions_committed, m.version) == (4, 3, 4)
    assert m.commit_latency_p50_s == pytest.approx(0.02)
    assert m.commit_latency_max_s == pytest.approx(0.03)
    assert (m.stores_reused, m.stores_opened, m.stores_restored) == (1, 2, 1)
    assert (m.restore_time_s, m.restore_bytes, m.bytes_uploaded) == (2.0, 7, 300)
    assert "3/4 partitions committed version 4" in m.summary()


def test_report_keys_parse_back_and_newer_reports_are_refused() -> None:
    key = layout.report_key("op", 7, 3)
    assert key == "_reports/op/00000000000000000007/000003.json"
    assert layout.parse_report_key(key) == ("op", 7, 3)
    assert layout.parse_report_key("op/3/changelog/x.changelog") is None
    assert layout.parse_store_key(key) is None  # never mistaken for a store's blob
    newer = encode_report(_report(0)).replace(b'"formatVersion": 1', b'"formatVersion": 9')
    with pytest.raises(ConfigMismatchError, match="format version 9"):
        decode_report(newer, blob=key)
    with pytest.raises(CorruptStateError, match=r"not a statekeeper\.task-report"):
        decode_report(b"{}", blob=key)
    # A report of a release before late rows and timers were counted reads them as 0.
    doc = json.loads(encode_report(_report(0)))
    del doc["lateRows"], doc["timersFired"]
    older = decode_report(json.dumps(doc).encode(), blob=key)
    assert (older.late_rows, older.timers_fired) == (0, 0)
    del doc["rowsIn"]
    with pytest.raises(CorruptStateError, match="lacks a field"):
        decode_report(json.dumps(doc).encode(), blob=key)
