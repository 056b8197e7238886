"""Incremental snapshots: background in changelog mode, every commit in snapshot mode."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import statekeeper as sk
from statekeeper import layout
from statekeeper.manifest import decode_manifest
from statekeeper.metrics import read_commit_metrics
from statekeeper.snapshot import SnapshotIndex, iter_files
from statekeeper.storage import BlobStore, LocalBlobStore, open_blob_store
from statekeeper.store import _snapshots
from statekeeper.store._working_copy import WorkingCopy
from tests.blobstores import RecordingBlobStore, SimulatedCrash, store_history


class GatedBlobStore(RecordingBlobStore):
    """Holds every put of a snapshot file blob until ``gate`` is set."""

    def __init__(self, inner: BlobStore) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.file_put_started = threading.Event()

    def put(
        self, key: str, data: bytes, *, overwrite: bool = False, if_match: str | None = None
    ) -> None:
        if "/files/" in key:
            self.file_put_started.set()
            assert self.gate.wait(timeout=60), "the test never opened the gate"
        super().put(key, data, overwrite=overwrite, if_match=if_match)


def _config(tmp: Path, name: str, **kwargs: object) -> sk.StoreConfig:
    return sk.StoreConfig(local_dir=str(tmp / name), **kwargs)  # type: ignore[arg-type]


def _fill(store: sk.StateStore, start: int, count: int, tag: bytes = b"v") -> None:
    for i in range(start, start + count):
        store.put(b"key%08d" % i, tag + b"%d" % i * 10)


def _state(store: sk.StateStore) -> dict[bytes, bytes]:
    return dict(store.scan())


def test_background_snapshot_every_n_versions_and_restore_from_it(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    backend = sk.StateBackend(root, config=_config(tmp_path, "a", snapshot_every=5))
    with backend.open("op", 0) as store:
        infos = []
        for v in range(12):
            _fill(store, v * 100, 100)
            infos.append(store.commit())
            backend.wait_for_snapshots()  # else the next one is due only when this is done
        expected = _state(store)
    backend.wait_for_snapshots()
    assert [i.version for i in infos if i.snapshot_scheduled] == [5, 10]
    keys = [m.key for m in backend.blobs.list(layout.snapshot_prefix("op", 0))]
    assert [layout.parse_attempt_snapshot_key(k)[0] for k in keys] == [5, 10]  # type: ignore[index]
    assert sorted(store_history(backend, "op", 0).index_keys.values()) == keys
    cold = sk.StateBackend(root, config=_config(tmp_path, "cold"))
    with cold.open("op", 0) as store:
        info = store.restore_info
        assert (info.base_kind, info.base, info.changelogs_replayed) == ("snapshot", 10, 2)
        assert info.files_downloaded > 0
        assert _state(store) == expected
    with cold.open("op", 0, version=7) as store:  # newest snapshot <= 7, then changelogs
        assert (store.restore_info.base, store.restore_info.changelogs_replayed) == (5, 2)
        assert len(_state(store)) == 700


def test_commit_path_does_not_wait_for_a_snapshot_upload(tmp_path: Path) -> None:
    blobs = GatedBlobStore(LocalBlobStore(str(tmp_path / "root")))
    backend = sk.StateBackend(blobs, config=_config(tmp_path, "a", snapshot_every=2))
    try:
        with backend.open("op", 0) as store:
            for v in range(2):
                _fill(store, v * 10, 10)
                store.commit()
            assert blobs.file_put_started.wait(timeout=60)  # the snapshot is uploading
            for v in range(2, 8):  # ... and is held there: commits still go through
                _fill(store, v * 10, 10)
                info = store.commit()
                assert not info.snapshot_scheduled  # one snapshot per store at a time
            assert store.version == 8
            assert not blobs.inner.list(layout.snapshot_prefix("op", 0))
            blobs.gate.set()
        backend.wait_for_snapshots()
        keys = [m.key for m in blobs.inner.list(layout.snapshot_prefix("op", 0))]
        assert [layout.parse_attempt_snapshot_key(k)[0] for k in keys] == [2]  # type: ignore[index]
    finally:
        blobs.gate.set()
        backend.close()


def test_waiting_for_one_stores_snapshots_does_not_wait_for_another_stores(
    tmp_path: Path,
) -> None:
    blobs = GatedBlobStore(LocalBlobStore(str(tmp_path / "root")))
    backend = sk.StateBackend(blobs, config=_config(tmp_path, "a", snapshot_every=1))
    try:
        with backend.open("op", 1) as other:
            _fill(other, 0, 10)
            other.commit()  # its snapshot is held at the gate too: let it through
            assert blobs.file_put_started.wait(timeout=60)
            blobs.gate.set()
            backend.wait_for_snapshots("op", 1)
            blobs.gate.clear()
            blobs.file_put_started.clear()
            with backend.open("op", 0) as store:
                _fill(store, 0, 10)
                assert store.commit().snapshot_scheduled
                assert blobs.file_put_started.wait(timeout=60)  # op/0's upload is held
                waited = threading.Thread(target=backend.wait_for_snapshots, args=("op", 1))
                waited.start()
                waited.join(timeout=10)
                assert not waited.is_alive()  # op/1 has nothing in flight
                everything = threading.Thread(target=backend.wait_for_snapshots)
                everything.start()
                everything.join(timeout=0.5)
                assert everything.is_alive()  # op/0's upload still is
                blobs.gate.set()
                everything.join(timeout=60)
        assert [
            layout.parse_attempt_snapshot_key(m.key)[0]  # type: ignore[index]
            for m in blobs.inner.list(layout.snapshot_prefix("op", 0))
        ] == [1]
        with pytest.raises(ValueError, match="both name and partition"):
            backend.wait_for_snapshots("op")
    finally:
        blobs.gate.set()
        backend.close()


def test_a_store_waited_for_has_its_queued_snapshot_uploaded_next(tmp_path: Path) -> None:
    # A store handed over waits for its own snapshot: it must not wait for every snapshot
    # queued before it too (one upload thread per backend).
    blobs = GatedBlobStore(LocalBlobStore(str(tmp_path / "root")))
    backend = sk.StateBackend(blobs, config=_config(tmp_path, "a", snapshot_every=1))
    stores = [backend.open("op", p) for p in range(3)]
    try:
        for store in stores:
            _fill(store, 0, 10)
            assert store.commit().snapshot_scheduled
        assert blobs.file_put_started.wait(timeout=60)  # op/0's upload holds the thread
        queue = backend._snapshotter._queue  # scheduled, not started
        assert [job.partition for job, _ in queue] == [1, 2]
        waited = threading.Thread(target=backend.wait_for_snapshots, args=("op", 2))
        waited.start()
        deadline = time.monotonic() + 60
        while [job.partition for job, _ in queue] != [2, 1]:
            assert time.monotonic() < deadline, "op/2's snapshot was never moved up"
            time.sleep(0.01)
        assert waited.is_alive()  # op/2's own upload is yet to run
        blobs.gate.set()
        waited.join(timeout=60)
        assert not waited.is_alive()
        backend.wait_for_snapshots()
    finally:
        blobs.gate.set()
        for store in stores:
            store.close()
        backend.close()
    indexes = [
        partition
        for op, key in blobs.calls
        if op == "put" and layout.parse_attempt_snapshot_key(key) is not None
        for partition in range(3)
        if key.startswith(layout.snapshot_prefix("op", partition))
    ]
    assert indexes == [0, 2, 1]  # op/2 went before op/1, scheduled first


def test_snapshot_of_a_few_changed_keys_uploads_only_new_sst_and_mutable_files(
    tmp_path: Path,
) -> None:
    config = _config(tmp_path, "a", snapshot_every=10_000, write_buffer_mb=1)
    backend = sk.StateBackend(str(tmp_path / "root"), config=config)
    with backend.open("op", 0) as store:
        for batch in range(4):  # several SST files, 1 MB memtables
            _fill(store, batch * 20_000, 20_000)
            store.commit()
        _settle(store)
        first = backend.snapshot("op", 0)
        assert first is not None
        _settle(store)  # no compaction may rewrite files between the two snapshots
        for i in range(5):
            store.put(b"key%08d" % (i * 997), b"changed")
        store.commit()
        second = backend.snapshot("op", 0)
        assert second is not None
        assert backend.snapshot("op", 0) is None  # that version has one already
    first_files = _index_files(tmp_path, first.index_blob)
    second_files = _index_files(tmp_path, second.index_blob)
    mutable = {n for n in second_files if not n.endswith(".sst")}
    new_sst = {n for n in second_files if n.endswith(".sst")} - set(first_files)
    kept_sst = {n for n in second_files if n.endswith(".sst")} & set(first_files)
    assert len(kept_sst) >= 1
    assert len(new_sst) >= 1
    assert second.files_uploaded == len(mutable) + len(new_sst)
    assert second.files_reused == len(kept_sst)
    assert all(second_files[n] == first_files[n] for n in kept_sst)  # same blobs referenced
    assert second.bytes_reused > 10 * second.bytes_uploaded


def _settle(store: sk.StateStore) -> None:
    """Compact everything now and wait until no compaction runs (white box: background
    compactions are timing-dependent, and one between two snapshots rewrites the files)."""
    store._copy.wait()  # the last commit's write runs behind it
    db = store._copy._db
    db.compact_range(None, None)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        running = db.property_int_value("rocksdb.num-running-compactions")
        pending = db.property_int_value("rocksdb.compaction-pending")
        if not running and not pending:
            return
        time.sleep(0.05)
    raise AssertionError("RocksDB compactions did not settle")


def _index_files(tmp_path: Path, key: str) -> dict[str, tuple[str, ...]]:
    """File name -> blob ids of a snapshot index."""
    index = SnapshotIndex.from_json((tmp_path / "root" / key).read_bytes(), blob=key)
    return {name: tuple(b.blob_id for b in f.blobs) for name, f in iter_files(index.dir_index)}


def test_local_copy_at_the_snapshot_skips_remote_restore(tmp_path: Path) -> None:
    blobs = RecordingBlobStore(LocalBlobStore(str(tmp_path / "root")))
    backend = sk.StateBackend(blobs, config=_config(tmp_path, "a", snapshot_every=10_000))
    with backend.open("op", 0) as store:
        _fill(store, 0, 500)
        store.commit()
    assert backend.snapshot("op", 0) is not None
    blobs.reset()
    with backend.open("op", 0) as store:
        assert store.restore_info.base_kind == "local"
        assert len(_state(store)) == 500
    gets = [key for op, key in blobs.calls if op == "get"]
    assert [layout.parse_manifest_key(k) for k in gets] == [2]  # the newest manifest only


def test_local_copy_ahead_restores_the_snapshot_reusing_identical_files(tmp_path: Path) -> None:
    backend = sk.StateBackend(
        str(tmp_path / "root"), config=_config(tmp_path, "a", snapshot_every=10_000)
    )
    with backend.open("op", 0) as store:
        _fill(store, 0, 5000)
        store.commit()
        store.snapshot_now()
        _fill(store, 5000, 10, tag=b"w")
        store.commit()
        _fill(store, 5010, 10, tag=b"x")
        store.commit()  # two commits ahead: one would step back without any restore
    with backend.open("op", 0, version=1) as store:
        info = store.restore_info
        assert (info.base_kind, info.base) == ("snapshot", 1)
        assert info.files_reused >= 1  # the SST written before version 2 is still there
        assert len(_state(store)) == 5000


@pytest.mark.parametrize("first", ["changelog", "snapshot"])
def test_switching_mode_keeps_all_state_both_ways(tmp_path: Path, first: str) -> None:
    root = str(tmp_path / "root")
    second = "snapshot" if first == "changelog" else "changelog"
    expected: dict[bytes, bytes] = {}
    for round_, mode in enumerate([first, second, first]):
        backend = sk.StateBackend(root, config=_config(tmp_path, f"l{round_}", mode=mode))
        with backend.open("op", 0) as store:
            assert _state(store) == expected
            for v in range(3):
                key, value = b"k%d-%d" % (round_, v), b"%s" % mode.encode()
                store.put(key, value)
                store.delete(b"k%d-%d" % (round_ - 1, v))
                expected[key] = value
                expected.pop(b"k%d-%d" % (round_ - 1, v), None)
                info = store.commit()
                assert info.snapshot == (mode == "snapshot")
        backend.close()
    cold = sk.StateBackend(root, config=_config(tmp_path, "cold"))
    with cold.open("op", 0) as store:
        assert store.version == 9
        assert _state(store) == expected
    for v in cold.versions("op", 0):
        with cold.open("op", 0, version=v) as store:
            assert store.version == v


def test_snapshot_mode_commits_are_snapshots_and_conflicts_are_detected(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    a = sk.StateBackend(root, config=_config(tmp_path, "a", mode="snapshot"))
    b = sk.StateBackend(root, config=_config(tmp_path, "b", mode="snapshot"))
    first, second = a.open("op", 0), b.open("op", 0)
    first.put(b"k", b"a")
    info = first.commit()
    assert layout.parse_attempt_snapshot_key(info.blob)[0] == 1  # type: ignore[index]
    assert store_history(a, "op", 0).index_key(1) == info.blob
    assert not a.blobs.list(layout.changelog_prefix("op", 0))
    second.put(b"k", b"b")
    with pytest.raises(sk.CommitConflictError, match="version 1"):
        second.commit()
    first.close()
    second.close()
    with b.open("op", 0) as store:  # b's local copy holds an uncommitted version: rebuilt
        assert store.restore_info.base_kind == "snapshot"
        assert _state(store) == {b"k": b"a"}


def test_a_corrupt_previous_index_means_a_full_upload_not_a_stuck_store(tmp_path: Path) -> None:
    """Issue 13 item 5: snapshots go on (in full, said in their metrics), verify names the
    damaged index, and GC moves past it instead of skipping the store forever."""
    config = _config(tmp_path, "w", snapshot_every=1000, retain_versions=2)
    backend = sk.StateBackend(str(tmp_path / "root"), config=config)
    with backend.open("op", 0, partitions=1) as store:
        _fill(store, 0, 50)
        store.commit()
        first = store.snapshot_now()
        assert first is not None
        broken = first.index_blob
        data = bytearray(backend.blobs.get(broken))
        data[len(data) // 2] ^= 0xFF
        backend.blobs.put(broken, bytes(data), overwrite=True)
        for version in (2, 3, 4):
            _fill(store, version * 10, 5)
            store.commit()
        metrics = store.snapshot_now()
        for version in (5, 6):
            _fill(store, version * 10, 5)
            store.commit()
    assert metrics is not None
    assert metrics.files_reused == 0
    assert metrics.files_uploaded > 0
    assert metrics.full_upload_reason is not None
    assert broken in metrics.full_upload_reason
    report = backend.verify(deep=False)
    assert [p.blob for p in report.problems] == [broken]
    assert backend.gc().stores["op/0"].base == 4
    assert backend.verify(deep=True).ok
    cold = sk.StateBackend(str(tmp_path / "root"), config=_config(tmp_path, "cold"))
    with cold.open("op", 0) as store:
        assert (store.restore_info.base_kind, store.restore_info.base) == ("snapshot", 4)
        assert store.version == 6


def test_a_store_and_its_background_snapshots_never_race_for_a_manifest(
    tmp_path: Path,
) -> None:
    """A store committing in a tight loop while its snapshots upload in the background and
    GC moves its base after each: every registration, base move and commit writes the next
    manifest on the one the others just wrote (they take turns in-process), so no manifest
    write is ever refused, no commit has to list the manifests again, and the manifest
    keeps to the retained versions. Racing through the blob store instead, registrations
    and base moves lost to a commit every few milliseconds until they gave up, and the
    retained versions (and every manifest with them) grew without bound.

    How far the base gets while the loop runs depends on how fast the uploads are (one
    still uploading makes the next commits skip theirs): the test checks that it moved, and
    that one more GC takes it exactly to the newest registered snapshot it may."""
    blobs = RecordingBlobStore(LocalBlobStore(str(tmp_path / "root")))
    config = _config(tmp_path, "w", snapshot_every=2, retain_versions=4)
    backend = sk.StateBackend(blobs, config=config)
    with backend.open("op", 0) as store:
        for v in range(1, 61):
            store.put(b"k%d" % (v % 7), b"v%d" % v)
            store.commit()
    backend.wait_for_snapshots()
    prefix = layout.manifest_prefix("op", 0)
    written = [key for op, key in blobs.calls if op == "put" and key.startswith(prefix)]
    assert len(written) == len(set(written))  # no create-only manifest write was refused
    assert len(written) == len(blobs.list(prefix))
    manifest = store_history(backend, "op", 0).manifest
    assert manifest is not None
    assert manifest.latest == 60
    assert manifest.base > 0  # GC moved the base along while the store committed
    registered = {
        s.version
        for key in written
        for s in decode_manifest(
            blobs.get(key), blob=key, root_id=manifest.root_id, operator="op", partition=0
        ).snapshots
    }
    backend.gc()
    manifest = store_history(backend, "op", 0).manifest
    assert manifest is not None
    assert manifest.base == max(v for v in registered if v <= 60 - 4 + 1)
    assert [e.version for e in manifest.versions] == list(range(manifest.base + 1, 61))
    backend.close()


SLOW_UPLOAD_CHILD = r"""
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
import statekeeper as sk
from statekeeper.storage import LocalBlobStore
from tests.blobstores import RecordingBlobStore
from tests.store.test_snapshots import _resume_config


class Slow(RecordingBlobStore):
    def put(self, key, data, **kw):
        if "/files/" in key:
            if any(p.read_text().strip() for p in Path(sys.argv[2]).rglob("*.uploads.jsonl")):
                time.sleep(3600)  # a file is journaled: wait here for the parent's SIGKILL
            time.sleep(0.02)
        super().put(key, data, **kw)


backend = sk.StateBackend(Slow(LocalBlobStore(sys.argv[1])), config=_resume_config(sys.argv[2]))
with backend.open("op", 0) as store:
    print("snapshotting", flush=True)
    store.snapshot_now()
print("DONE", flush=True)
"""


def _resume_config(local: str) -> sk.StoreConfig:
    return sk.StoreConfig(
        local_dir=local, write_buffer_mb=1, snapshot_every=10**6, chunk_size=64 * 1024,
        io_threads=1,
    )  # fmt: skip


def _three_level_0_files(store: sk.StateStore) -> dict[bytes, bytes]:
    """Three commits of 1 MB (with ``_resume_config``: three level-0 files of 17 chunks
    each), fewer files than a compaction waits for, so a later checkpoint holds the same
    files; returns the state."""
    for c in range(3):
        for i in range(4000):
            store.put(b"k%02d%06d" % (c, i), os.urandom(250))
        store.commit()
    return _state(store)


@pytest.mark.slow
def test_a_snapshot_upload_killed_half_way_is_resumed_by_the_next_process(tmp_path: Path) -> None:
    """A worker SIGKILLed in the middle of a snapshot upload (as Spark ends an idle Python
    worker): the next process on that working copy names the files the killed one finished
    instead of uploading them again, and the snapshot restores exactly."""
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    backend = sk.StateBackend(root, config=_resume_config(local))
    with backend.open("op", 0) as store:
        expected = _three_level_0_files(store)
    backend.close()
    child = subprocess.Popen(
        [sys.executable, "-c", SLOW_UPLOAD_CHILD, root, local, str(Path(__file__).parents[2])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    journal: list[str] = []
    while time.monotonic() < deadline and child.poll() is None:
        journal = [
            ln for p in Path(local).rglob("*.uploads.jsonl") for ln in p.read_text().splitlines()
        ]
        if journal:
            child.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    out, err = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL, (out, err[-3000:])
    assert "DONE" not in out
    killed_files = len(backend.blobs.list(layout.files_prefix("op", 0)))

    again = sk.StateBackend(root, config=_resume_config(local))
    with again.open("op", 0) as store:
        assert store.restore_info.base_kind == "local"  # the copy the killed process left
        metrics = store.snapshot_now()
    again.close()
    assert metrics is not None
    assert metrics.files_resumed >= len(journal) >= 1
    assert metrics.bytes_resumed > 0
    total = metrics.bytes_uploaded + metrics.bytes_resumed
    print(f"resumed {metrics.files_resumed} files, {metrics.bytes_resumed} of {total} bytes; "
          f"{killed_files} blobs were written before the kill")  # fmt: skip
    fresh = sk.StateBackend(root, config=_resume_config(str(tmp_path / "fresh")))
    assert fresh.verify(deep=True).ok
    with fresh.open("op", 0) as store:
        assert (store.restore_info.base_kind, store.restore_info.base) == ("snapshot", 3)
        assert _state(store) == expected
    fresh.close()


class _CutOff(RecordingBlobStore):
    """Fails every snapshot file put after the first ``after`` (``after`` < 0: none)."""

    def __init__(self, inner: BlobStore) -> None:
        super().__init__(inner)
        self.after = -1
        self.file_puts = 0

    def put(
        self, key: str, data: bytes, *, overwrite: bool = False, if_match: str | None = None
    ) -> None:
        if "/files/" in key and self.after >= 0:
            self.file_puts += 1
            if self.file_puts > self.after:
                raise sk.StorageError(f"cut off at {key}")
        super().put(key, data, overwrite=overwrite, if_match=if_match)


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_snapshot_upload_cut_off_resumes_on_the_local_filesystem_and_s3(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The store-level path end to end on each kind of root: the age check reads the
    store's listing and its clock probe (S3 stamps to the second), and the resumed chunks
    restore exactly on a fresh host."""
    uri, options = request.getfixturevalue(f"{where}_root")
    blobs = _CutOff(open_blob_store(uri, storage_options=options))
    backend = sk.StateBackend(blobs, config=_resume_config(str(tmp_path / "local")))
    with backend.open("op", 0) as store:
        expected = _three_level_0_files(store)
        blobs.after = 20  # the first 1 MB SST (17 chunks) and a few of the second
        with pytest.raises(sk.StorageError, match="cut off"):
            store.snapshot_now()
        blobs.after = -1
        metrics = store.snapshot_now()
    assert metrics is not None
    assert metrics.files_resumed >= 1
    assert metrics.bytes_resumed >= 1_000_000
    fresh = sk.StateBackend(
        uri, config=_resume_config(str(tmp_path / "fresh")), storage_options=options
    )
    with fresh.open("op", 0) as store:
        assert (store.restore_info.base_kind, store.restore_info.base) == ("snapshot", 3)
        assert _state(store) == expected
    assert fresh.verify(deep=True).ok
    fresh.close()
    backend.close()


def test_a_snapshot_from_another_thread_never_checks_out_half_a_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``backend.snapshot`` from another thread while the store's own thread applies a
    commit of several changelog parts slice by slice: the copy between the slices holds
    part of the version, labelled dirty. Checked out then, the snapshot was registered as
    the version and a fresh host restored 2 of its 201 keys."""
    config = _config(tmp_path, "w", changelog_part_bytes=64, snapshot_every=1000, io_threads=1)
    backend = sk.StateBackend(str(tmp_path / "root"), config=config)
    store = backend.open("op", 0)
    store.put(b"seed", b"x")
    store.commit()
    between_slices, done = threading.Event(), threading.Event()
    apply = WorkingCopy.apply

    def pausing_apply(self: WorkingCopy, *args: object, **kwargs: object) -> None:
        apply(self, *args, **kwargs)  # type: ignore[arg-type]
        if kwargs.get("dirty") and not between_slices.is_set():
            between_slices.set()
            assert done.wait(60)

    monkeypatch.setattr(WorkingCopy, "apply", pausing_apply)
    got: list[object] = []

    def snapshot_from_another_thread() -> None:
        assert between_slices.wait(60)
        try:
            got.append(backend.snapshot("op", 0))
        finally:
            done.set()

    other = threading.Thread(target=snapshot_from_another_thread)
    other.start()
    store.put_many([(b"k%04d" % i, b"v" * 20) for i in range(200)])
    info = store.commit()
    other.join(60)
    monkeypatch.undo()
    assert info.version == 2
    assert got == [None]  # the dirty copy was not checked out
    store.close()
    backend.close()
    fresh = sk.StateBackend(str(tmp_path / "root"), config=_config(tmp_path, "fresh"))
    with fresh.open("op", 0, 2) as restored:
        assert len(_state(restored)) == 201
    assert fresh.verify(deep=True).ok
    fresh.close()


class _FailingFileUploads(RecordingBlobStore):
    """Every snapshot file upload fails (changelogs, manifests and metrics go through)."""

    def put(
        self, key: str, data: bytes, *, overwrite: bool = False, if_match: str | None = None
    ) -> None:
        if "/files/" in key:
            raise sk.StorageError(f"injected: cannot write {key}")
        super().put(key, data, overwrite=overwrite, if_match=if_match)


@pytest.mark.parametrize("case", ["snapshot fails", "snapshot done before the handover"])
def test_commit_metrics_handed_to_a_background_snapshot_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """A commit that schedules a background snapshot hands it the buffered commit metrics,
    to write after the upload. They were lost when the upload failed, and when the job had
    already written its (then empty) list before the commit handed them over."""
    inner = LocalBlobStore(str(tmp_path / "root"))
    blobs = _FailingFileUploads(inner) if case == "snapshot fails" else RecordingBlobStore(inner)
    if case != "snapshot fails":
        schedule = sk.StateStore._maybe_schedule_snapshot

        def job_done_first(store: sk.StateStore) -> bool:
            scheduled = schedule(store)
            if scheduled:
                store._snapshotter.wait(("op", 0))
            return scheduled

        monkeypatch.setattr(sk.StateStore, "_maybe_schedule_snapshot", job_done_first)
    config = _config(tmp_path, "w", snapshot_every=3, metrics_every=100)
    backend = sk.StateBackend(blobs, config=config)
    with backend.open("op", 0) as store:
        for v in range(1, 7):
            store.put(b"k", b"%d" % v)
            store.commit()
    backend.wait_for_snapshots()
    backend.close()
    assert sorted(read_commit_metrics(inner, "op", 0)) == [1, 2, 3, 4, 5, 6]


def test_a_reopen_waits_for_the_closed_store_s_snapshot_before_rebuilding_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store closed while its background snapshot uploads, reopened at an older version
    in the same process: the copy is rebuilt. The old job recorded its lineage when done,
    over the rebuilt copy's, so the next upload trusted file names against another
    database's files."""
    upload, wait = _snapshots.upload_snapshot, _snapshots.Snapshotter.wait
    gate, waiting = threading.Event(), threading.Event()

    def gated_upload(*args: object, **kwargs: object) -> object:
        assert gate.wait(60)
        return upload(*args, **kwargs)  # type: ignore[arg-type]

    def seen_wait(self: _snapshots.Snapshotter, store: tuple[str, int] | None = None) -> None:
        if store == ("op", 0):
            waiting.set()
        wait(self, store)

    monkeypatch.setattr(_snapshots, "upload_snapshot", gated_upload)
    monkeypatch.setattr(_snapshots.Snapshotter, "wait", seen_wait)
    backend = sk.StateBackend(
        str(tmp_path / "root"), config=_config(tmp_path, "w", snapshot_every=2, io_threads=1)
    )
    first = backend.open("op", 0)
    for v in range(2):
        first.put(b"k%d" % v, b"v")
        first.commit()  # version 2 schedules a snapshot, held at the gate
    first.close()  # without waiting for it
    opened: list[sk.StateStore] = []
    reopen = threading.Thread(target=lambda: opened.append(backend.open("op", 0, 0)))
    reopen.start()  # the copy is two commits ahead: rebuilt empty
    # The upload goes on once the reopen waits for it, or, were it not to wait, has rebuilt
    # the copy: then the job records its lineage over the rebuilt copy's, as it once did.
    deadline = time.monotonic() + 60
    while not waiting.is_set() and reopen.is_alive():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    gate.set()
    reopen.join(60)
    (again,) = opened
    backend.wait_for_snapshots()
    assert again.restore_info.base_kind != "local"
    lineage = again._copy.lineage
    assert lineage is None or lineage[1] == 0, lineage  # not the closed store's version 2
    again.close()
    backend.close()


class _CrashAtChunk(RecordingBlobStore):
    """Raises SimulatedCrash (a process killed, as far as the library can tell) at the
    ``at``-th read of a snapshot file blob, once armed."""

    def __init__(self, inner: BlobStore, at: int) -> None:
        super().__init__(inner)
        self.at, self.reads, self.armed = at, 0, False

    def get(self, key: str) -> bytes:
        if self.armed and "/files/" in key:
            self.reads += 1
            if self.reads == self.at:
                raise SimulatedCrash(f"killed while restoring, at {key}")
        return super().get(key)


def test_a_restore_into_a_copy_killed_half_way_is_resumed_not_set_aside(tmp_path: Path) -> None:
    """A copy behind by many versions is restored from a snapshot in place, keeping the
    files that match. Killed half way, the folder held the old CURRENT over the new files:
    RocksDB could not open it, so the next open set it all aside (kept, never deleted) and
    downloaded every file again."""

    def fill(store: sk.StateStore, commits: int, seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(commits):
            store.put_many(
                [(b"k%07d" % rng.randrange(10**7), rng.randbytes(100)) for _ in range(4000)]
            )
            store.commit()
            store._copy.flush()

    def config(host: str) -> sk.StoreConfig:
        return _config(tmp_path, host, snapshot_every=10**6, chunk_size=1 << 16, io_threads=1)

    def backend(host: str) -> sk.StateBackend:
        return sk.StateBackend(str(tmp_path / "root"), config=config(host))

    with backend("a") as behind, behind.open("op", 0, partitions=1) as store:
        fill(store, 2, 1)
    with backend("b") as ahead, ahead.open("op", 0) as store:
        fill(store, 6, 2)
        store.snapshot_now()
        expected = dict(store.scan())
    crashing = _CrashAtChunk(LocalBlobStore(str(tmp_path / "root")), at=4)
    with sk.StateBackend(crashing, config=config("a")) as killed:
        path = killed.local_path("op", 0)
        crashing.armed = True
        with pytest.raises(SimulatedCrash):
            killed.open("op", 0)
    with backend("a") as again, again.open("op", 0) as store:
        assert store.restore_info.base_kind == "snapshot"
        assert store.restore_info.files_reused > 0  # what the killed restore finished
        assert dict(store.scan()) == expected
    beside = sorted(p.name for p in Path(path).parent.iterdir())
    assert not [name for name in beside if ".damaged-" in name], beside
