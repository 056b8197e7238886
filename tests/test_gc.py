"""Garbage collection: retention, orphans with a grace TTL, and the upload race."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import pytest

import statekeeper as sk
from statekeeper import clock, layout
from statekeeper.epochs import build_manifest, write_manifest
from statekeeper.manifest import read_newest_manifest
from statekeeper.snapshot import SnapshotIndex, referenced_blob_ids
from statekeeper.storage import BlobStore, LocalBlobStore
from tests.blobstores import (
    FaultyBlobStore,
    RecordingBlobStore,
    SimulatedCrash,
    gc_later,
    store_history,
)


def _value(v: int, k: int) -> bytes:
    return b"v%d-%d" % (v, k)


def _commit_many(backend: sk.StateBackend, count: int) -> None:
    """Version v puts keys v % 50 and (v * 7) % 50, and deletes (v * 3) % 50."""
    with backend.open("op", 0, partitions=1) as store:
        for v in range(store.version + 1, store.version + count + 1):
            store.put(b"k%02d" % (v % 50), _value(v, 0))
            store.put(b"k%02d" % (v * 7 % 50), _value(v, 1))
            store.delete(b"k%02d" % (v * 3 % 50))
            store.commit()
            if v % 10 == 0:
                backend.wait_for_snapshots()  # deterministic: one snapshot every 10


def _expected(version: int) -> dict[bytes, bytes]:
    state: dict[bytes, bytes] = {}
    for v in range(1, version + 1):
        state[b"k%02d" % (v % 50)] = _value(v, 0)
        state[b"k%02d" % (v * 7 % 50)] = _value(v, 1)
        state.pop(b"k%02d" % (v * 3 % 50), None)
    return state


def _config(tmp: Path, name: str, **kwargs: object) -> sk.StoreConfig:
    base: dict[str, object] = {"local_dir": str(tmp / name), "snapshot_every": 10}
    base.update(kwargs)
    return sk.StoreConfig(**base)  # type: ignore[arg-type]


def _referenced_files(blobs: BlobStore) -> set[str]:
    ids: set[str] = set()
    for meta in blobs.list(layout.snapshot_prefix("op", 0)):
        if meta.key.endswith(".index.json"):
            ids |= referenced_blob_ids(SnapshotIndex.from_json(blobs.get(meta.key), blob=meta.key))
    return {layout.file_blob_key("op", 0, i) for i in ids}


def test_gc_on_300_versions_keeps_the_last_100_restorable(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    config = _config(tmp_path, "w", retain_versions=100, orphan_ttl_s=3600)
    writer = sk.StateBackend(root, config=config)
    # no background gc while writing: retain everything until the explicit run
    writer._snapshotter.after_upload = None
    _commit_many(writer, 300)
    before = {m.key for m in writer.blobs.list("")}
    before_history = store_history(writer, "op", 0)
    dry = writer.gc(dry_run=True)
    assert {m.key for m in writer.blobs.list("")} == before  # a dry run deletes nothing
    report = writer.gc()
    store = report.stores["op/0"]
    assert (store.latest, store.oldest_retained, store.base) == (300, 201, 200)
    assert sorted(report.deleted_keys) == sorted(dry.deleted_keys)
    assert store.deleted_blobs == dry.stores["op/0"].deleted_blobs > 200
    after = {m.key for m in writer.blobs.list("")}
    newer = {k for k in after - before if layout.parse_manifest_key(k) is not None}
    assert len(newer) == 1  # the manifest that moved the base
    assert after - newer == before - set(report.deleted_keys)
    history = store_history(writer, "op", 0)
    assert before_history.changelog_key(200) not in after
    assert history.changelog_key(201) in after
    # snapshot 190 is retired: no longer named, its index and files kept for the grace period
    assert 190 not in history.snapshots
    assert before_history.index_key(190) in after
    assert history.index_key(200) in after
    # Only the 16 most recently retired snapshots are named (40..190): the indexes of 10..30
    # are gone, their files wait out the grace like any orphan.
    assert before_history.index_key(40) in after
    assert before_history.index_key(30) not in after
    files = {k for k in after if "/files/" in k}
    assert _referenced_files(writer.blobs) < files
    cold = sk.StateBackend(root, config=_config(tmp_path, "cold"))
    assert cold.versions("op", 0) == list(range(200, 301))
    for version in (200, 201, 255, 300):
        with cold.open("op", 0, version=version) as s:
            assert dict(s.scan()) == _expected(version)
    with pytest.raises(sk.StateNotFoundError, match="version 150"):
        cold.open("op", 0, version=150)
    assert cold.verify(deep=True).ok
    assert writer.gc().deleted_blobs == 0  # idempotent
    gc_later(writer, 3601)
    files = {m.key for m in writer.blobs.list("") if "/files/" in m.key}
    assert files == _referenced_files(writer.blobs)


def test_orphans_are_deleted_only_after_the_ttl(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    backend = sk.StateBackend(root, config=_config(tmp_path, "a", orphan_ttl_s=3600))
    _commit_many(backend, 12)
    orphan = layout.file_blob_key("op", 0, "deadbeef" * 4)  # a snapshot that died half way
    backend.blobs.put(orphan, b"half an upload")
    assert orphan not in backend.gc().deleted_keys
    assert backend.blobs.head(orphan).size == 14
    expired = sk.StateBackend(root, config=_config(tmp_path, "b", orphan_ttl_s=0))
    # A TTL below what an upload may take is raised to the floor: the young orphan stays.
    assert orphan not in expired.gc().deleted_keys
    deleted = gc_later(expired).deleted_keys
    assert orphan in deleted
    # and manifests superseded for longer than the TTL, never the newest
    assert all(layout.parse_manifest_key(k) is not None for k in deleted if k != orphan)
    assert layout.manifest_key("op", 0, store_history(expired, "op", 0).manifest.seq) not in deleted  # type: ignore[union-attr]
    with expired.open("op", 0) as store:
        assert dict(store.scan()) == _expected(12)


class _Gate(RecordingBlobStore):
    def __init__(self, inner: BlobStore) -> None:
        super().__init__(inner)
        self.gate, self.started = threading.Event(), threading.Event()
        self.file_puts = 0

    def put(
        self, key: str, data: bytes, *, overwrite: bool = False, if_match: str | None = None
    ) -> None:
        super().put(key, data, overwrite=overwrite, if_match=if_match)
        if "/files/" in key:
            self.file_puts += 1
            if self.file_puts == 2:  # some files landed, the index is not written yet
                self.started.set()
                assert self.gate.wait(timeout=60)


@pytest.mark.parametrize("same_process", [True, False])
def test_gc_never_deletes_the_files_of_a_snapshot_still_uploading(
    tmp_path: Path, same_process: bool
) -> None:
    blobs = _Gate(LocalBlobStore(str(tmp_path / "root")))
    uploader = sk.StateBackend(blobs, config=_config(tmp_path, "a", orphan_ttl_s=0))
    uploader._snapshotter.after_upload = None
    _commit_many(uploader, 9)
    with uploader.open("op", 0) as store:
        store.put(b"k99", b"x")
        store.commit()  # version 10: a background snapshot starts and is held mid-upload
        assert blobs.started.wait(timeout=60)
    # The files landed 1000 s ago, as far as the root can tell: older than the 300 s floor
    # a TTL of 0 is raised to, so age alone no longer keeps them in the same process.
    landed = time.time() - 1000
    for path in (tmp_path / "root" / "op" / "0" / "files").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a temporary file of a put under way
            os.utime(path, (landed, landed))
    if same_process:  # the same backend knows the upload is in flight, even with TTL 0
        collector = uploader
    else:  # another process only has the TTL to go by
        collector = sk.StateBackend(
            LocalBlobStore(str(tmp_path / "root")),
            config=_config(tmp_path, "b", orphan_ttl_s=3600),
        )
    gc_thread = threading.Thread(target=collector.gc)
    gc_thread.start()
    gc_thread.join(timeout=60)
    assert not gc_thread.is_alive(), "the GC waited for the upload instead of running beside it"
    blobs.gate.set()
    uploader.wait_for_snapshots()
    cold = sk.StateBackend(str(tmp_path / "root"), config=_config(tmp_path, "cold"))
    with cold.open("op", 0) as store:
        assert store.restore_info.base_kind == "snapshot"
        assert store.version == 10
    assert cold.verify(deep=True).ok


def test_a_crash_at_any_delete_of_a_gc_is_completed_by_the_next_run(tmp_path: Path) -> None:
    root = tmp_path / "root"
    setup = sk.StateBackend(str(root), config=_config(tmp_path, "a", retain_versions=15))
    setup._snapshotter.after_upload = None
    _commit_many(setup, 60)
    setup.close()
    total = len(
        sk.StateBackend(str(root), config=_config(tmp_path, "x", retain_versions=15))
        .gc(dry_run=True)
        .deleted_keys
    )
    crashes = 0
    for fail_at in (1, 2):  # the metadata delete batch, then the files batch
        faulty = FaultyBlobStore(
            LocalBlobStore(str(root)), fail_at=fail_at, op="delete", kind="crash"
        )
        backend = sk.StateBackend(faulty, config=_config(tmp_path, "y", retain_versions=15))
        try:
            backend.gc()
        except SimulatedCrash:
            crashes += 1
        for version in (46, 60):
            with sk.StateBackend(str(root), config=_config(tmp_path, f"c{fail_at}{version}")).open(
                "op", 0, version=version
            ) as store:
                assert dict(store.scan()) == _expected(version)
    assert crashes >= 1
    final = sk.StateBackend(str(root), config=_config(tmp_path, "z", retain_versions=15))
    final.gc()
    assert final.gc(dry_run=True).deleted_keys == []
    assert total > 0
    assert final.verify(deep=True).ok


def test_background_gc_runs_after_snapshots(tmp_path: Path) -> None:
    backend = sk.StateBackend(
        str(tmp_path / "root"), config=_config(tmp_path, "a", retain_versions=5, snapshot_every=5)
    )
    _commit_many(backend, 30)
    backend.wait_for_snapshots()
    versions = backend.versions("op", 0)
    assert versions[0] >= 20
    assert versions[-1] == 30
    # the changelog of version 1 is gone (collected, not just no longer named)
    changelogs = backend.blobs.list(layout.changelog_prefix("op", 0))
    assert changelogs
    assert 1 not in {layout.commit_blob_version(m.key) for m in changelogs}


def test_gc_sweeps_temporary_files_of_local_puts_that_died(tmp_path: Path) -> None:
    import os
    import time

    backend = sk.StateBackend(str(tmp_path / "root"), config=_config(tmp_path, "a"))
    _commit_many(backend, 3)
    folder = tmp_path / "root" / "op" / "0" / "changelog"
    leftover = folder / ".tmp-0123456789abcdef"
    leftover.write_bytes(b"half a changelog")
    old = time.time() - 7200
    os.utime(leftover, (old, old))
    fresh = folder / ".tmp-fedcba9876543210"
    fresh.write_bytes(b"still being written")
    keeper = sk.StateBackend(
        str(tmp_path / "root"), config=_config(tmp_path, "b", orphan_ttl_s=3600)
    )
    assert keeper.gc(dry_run=True).incomplete_writes == 1
    assert leftover.exists()
    assert keeper.gc().incomplete_writes == 1
    assert not leftover.exists()
    assert fresh.exists()


class _HoldAfterChangelog(RecordingBlobStore):
    """Holds a commit between writing its changelog and naming it in a manifest."""

    def __init__(self, inner: BlobStore) -> None:
        super().__init__(inner)
        self.gate, self.written = threading.Event(), threading.Event()

    def put(
        self, key: str, data: bytes, *, overwrite: bool = False, if_match: str | None = None
    ) -> None:
        super().put(key, data, overwrite=overwrite, if_match=if_match)
        if "/changelog/" in key and not self.written.is_set():
            self.written.set()
            assert self.gate.wait(timeout=60)


def test_a_zero_orphan_ttl_never_sweeps_a_commit_being_named(tmp_path: Path) -> None:
    """GC with ``orphan_ttl_s=0`` runs between a commit's changelog and its manifest: the
    changelog nothing names yet is young, and the floor keeps it, so the version that the
    manifest then names is restorable."""
    root = str(tmp_path / "root")
    _commit_many(sk.StateBackend(root, config=_config(tmp_path, "setup")), 3)
    blobs = _HoldAfterChangelog(LocalBlobStore(root))
    writer = sk.StateBackend(blobs, config=_config(tmp_path, "w"))
    collector = sk.StateBackend(root, config=_config(tmp_path, "gc", orphan_ttl_s=0))
    with writer.open("op", 0) as store:
        store.put(b"late", b"value")
        committing = threading.Thread(target=store.commit)
        committing.start()
        assert blobs.written.wait(timeout=60)
        swept = collector.gc().deleted_keys
        blobs.gate.set()
        committing.join(timeout=60)
    assert not any("/changelog/" in k for k in swept)
    cold = sk.StateBackend(root, config=_config(tmp_path, "cold"))
    with cold.open("op", 0) as store:
        assert store.version == 4
        assert store.get(b"late") == b"value"


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_gc_host_whose_clock_runs_a_day_ahead_never_sweeps_a_commit_being_named(
    where: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GC runs between a commit's changelog and its manifest on a host whose clock is a day
    ahead of the blob store's: by that clock the unnamed changelog is old, by the store's
    it is a second old. GC measures with the store's clock, so the changelog stays and the
    version the manifest then names is restorable; orphans really older than the grace
    still go."""
    uri, options = request.getfixturevalue(f"{where}_root")
    opened = sk.StateBackend(uri, config=_config(tmp_path, "setup"), storage_options=options)
    _commit_many(opened, 3)
    blobs = _HoldAfterChangelog(opened.blobs)
    writer = sk.StateBackend(blobs, config=_config(tmp_path, "w"))
    collector = sk.StateBackend(
        uri, config=_config(tmp_path, "gc", orphan_ttl_s=3600), storage_options=options
    )
    monkeypatch.setattr(clock, "wall_clock", lambda: time.time() + 86_400)
    with writer.open("op", 0) as store:
        store.put(b"late", b"value")
        committing = threading.Thread(target=store.commit)
        committing.start()
        assert blobs.written.wait(timeout=60)
        report = collector.gc()
        blobs.gate.set()
        committing.join(timeout=60)
    assert not any("/changelog/" in k for k in report.deleted_keys)
    assert collector.blobs.list(layout.clock_prefix()) == []  # the probe was deleted
    cold = sk.StateBackend(uri, config=_config(tmp_path, "cold"), storage_options=options)
    with cold.open("op", 0) as store:
        assert store.version == 4
        assert store.get(b"late") == b"value"
    # Ages are still measured, by the store's clock (this machine's for both roots here).
    assert abs(clock.gc_now(collector.blobs) - time.time()) < 5
    if where == "local":
        orphan = layout.attempt_changelog_key("op", 0, 99, "orphan")
        collector.blobs.put(orphan, b"x")
        two_hours_ago = time.time() - 7200
        os.utime(Path(uri) / orphan, (two_hours_ago, two_hours_ago))
        assert orphan in collector.gc().deleted_keys


def _epoch(backend: sk.StateBackend, query: str, epoch: int) -> None:
    """Write query ``query``'s manifest of micro-batch ``epoch`` (version ``epoch + 1``)."""
    meta = backend.root_metadata()
    assert meta is not None
    manifest, why = build_manifest(
        backend.blobs, epoch=epoch, query_id=query, run_id=None,
        operators={"op": 1}, root_id=meta.root_id,
    )  # fmt: skip
    assert manifest is not None, why
    assert write_manifest(backend.blobs, manifest)


def test_gc_keeps_the_versions_each_querys_newest_epoch_manifest_names(tmp_path: Path) -> None:
    """A stale query's newest epoch manifest names version 10 while the store is at 30 and
    retains 5: version 10 (the cut readers take) stays restorable; the version its older
    manifest named does not."""
    root = str(tmp_path / "root")
    writer = sk.StateBackend(root, config=_config(tmp_path, "w", retain_versions=5))
    writer._snapshotter.after_upload = None  # no background gc while writing
    _commit_many(writer, 30)
    _epoch(writer, "stale", 4)
    _epoch(writer, "stale", 9)
    _epoch(writer, "live", 29)
    report = gc_later(writer)
    store = report.stores["op/0"]
    assert (store.latest, store.oldest_retained, store.base) == (30, 10, 10)
    assert report.deleted_keys  # versions below the cut did go
    cold = sk.StateBackend(root, config=_config(tmp_path, "cold"))
    assert cold.versions("op", 0) == list(range(10, 31))
    for version in (10, 26, 30):
        with cold.open("op", 0, version=version) as s:
            assert dict(s.scan()) == _expected(version)
    with pytest.raises(sk.StateNotFoundError, match="version 5"):
        cold.open("op", 0, version=5)
    assert cold.verify(deep=True).ok


def test_a_gc_host_whose_clock_runs_behind_stamps_what_it_retires_by_the_store_s_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GC on a host whose clock runs an hour behind moves the base and retires snapshot 10.
    Its "now" for ages is its own (the earlier clock), but the retirement is stamped no
    earlier than the store's: a GC on a host with a right clock then keeps snapshot 10
    named and its index for the whole grace, while a reader may still be restoring from a
    manifest that named it. Stamped by the slow clock, it looked an hour old and the next
    run deleted its index at once."""
    root = str(tmp_path / "root")
    config = _config(tmp_path, "w", retain_versions=10, orphan_ttl_s=1800)
    writer = sk.StateBackend(root, config=config)
    writer._snapshotter.after_upload = None  # no GC but the two below
    _commit_many(writer, 30)
    writer.close()
    before = store_history(writer, "op", 0)
    assert {10, 20, 30} <= set(before.snapshots)

    monkeypatch.setattr(clock, "wall_clock", lambda: time.time() - 3600)
    slow = sk.StateBackend(
        root, config=_config(tmp_path, "slow", retain_versions=10, orphan_ttl_s=1800)
    )
    assert slow.gc().stores["op/0"].base == 20
    monkeypatch.undo()
    meta = slow.root_metadata()
    assert meta is not None

    def retired() -> dict[str, int]:
        manifest = read_newest_manifest(
            slow.blobs, root_id=meta.root_id, operator="op", partition=0
        )
        assert manifest is not None
        return {r.index_blob: r.time_ms for r in manifest.retired}

    stamps = retired()
    assert list(stamps) == [before.index_key(10)]
    assert stamps[before.index_key(10)] >= (time.time() - 60) * 1000  # not an hour behind
    right = sk.StateBackend(
        root, config=_config(tmp_path, "right", retain_versions=10, orphan_ttl_s=1800)
    )
    assert before.index_key(10) not in right.gc().deleted_keys
    assert retired() == stamps
    assert slow.blobs.head(before.index_key(10)).size > 0


def test_a_dry_run_names_the_epoch_manifests_the_real_run_deletes(tmp_path: Path) -> None:
    """``gc --dry-run`` must predict the run: it once left out the epoch manifests (and task
    reports) past their retention, which the real run then deleted."""
    root = str(tmp_path / "root")
    writer = sk.StateBackend(root, config=_config(tmp_path, "w", retain_versions=5))
    writer._snapshotter.after_upload = None  # no background gc while writing
    _commit_many(writer, 12)
    for epoch in range(4, 11):
        _epoch(writer, "q", epoch)
    expired = {layout.epoch_key(4, "q"), layout.epoch_key(5, "q")}
    before = {m.key for m in writer.blobs.list("")}
    dry = writer.gc(dry_run=True)
    assert {m.key for m in writer.blobs.list("")} == before
    assert expired <= set(dry.deleted_keys)
    assert dry.deleted_root_blobs == 2
    real = writer.gc()
    assert sorted(real.deleted_keys) == sorted(dry.deleted_keys)
    assert real.deleted_root_blobs == 2
    assert not expired & {m.key for m in writer.blobs.list("")}
    writer.close()
