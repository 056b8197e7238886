"""Restore without snapshots: rebuild from changelogs, reuse or catch up a local copy."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

import statekeeper as sk
from statekeeper import layout
from statekeeper.storage import LocalBlobStore
from tests.blobstores import RecordingBlobStore, store_history


def _commit_versions(backend: sk.StateBackend, count: int, *, start: int = 0) -> None:
    with backend.open("op", partition=0) as store:
        for v in range(start + 1, start + count + 1):
            store.put(b"k%d" % (v % 7), b"v%d" % v)
            store.put(b"last", b"%d" % v)
            if v % 3 == 0:
                store.delete(b"k%d" % ((v + 1) % 7))
            store.commit()


def _expected(version: int) -> dict[bytes, bytes]:
    state: dict[bytes, bytes] = {}
    for v in range(1, version + 1):
        state[b"k%d" % (v % 7)] = b"v%d" % v
        state[b"last"] = b"%d" % v
        if v % 3 == 0:
            state.pop(b"k%d" % ((v + 1) % 7), None)
    return state


@pytest.fixture
def recorder(tmp_path: Path) -> RecordingBlobStore:
    return RecordingBlobStore(LocalBlobStore(str(tmp_path / "root")))


def _backend(blobs: RecordingBlobStore, local: Path) -> sk.StateBackend:
    # No background snapshots here: these tests are about changelog replay.
    config = sk.StoreConfig(local_dir=str(local), io_threads=4, snapshot_every=10_000)
    return sk.StateBackend(blobs, config=config)


def test_no_local_copy_rebuilds_by_replaying_every_changelog(
    recorder: RecordingBlobStore, tmp_path: Path
) -> None:
    _commit_versions(_backend(recorder, tmp_path / "a"), 25)
    recorder.reset()
    with _backend(recorder, tmp_path / "fresh").open("op", partition=0) as store:
        assert store.version == 25
        assert dict(store.scan()) == _expected(25)
        info = store.restore_info
    assert (info.base_kind, info.base, info.changelogs_replayed) == ("empty", 0, 25)
    fetched = sorted(key for op, key in recorder.calls if op == "get_range" and "changelog" in key)
    history = store_history(_backend(recorder, tmp_path / "a"), "op", 0)
    assert fetched == [history.changelog_key(v) for v in range(1, 26)]
    assert info.bytes_downloaded > 0


def test_current_local_copy_is_reused_without_any_download(
    recorder: RecordingBlobStore, tmp_path: Path
) -> None:
    backend = _backend(recorder, tmp_path / "a")
    _commit_versions(backend, 5)
    recorder.reset()
    with backend.open("op", partition=0) as store:
        assert store.version == 5
        assert dict(store.scan()) == _expected(5)
        assert store.restore_info.base_kind == "local"
        assert store.restore_info.bytes_downloaded == 0
    counts = recorder.counts()
    # one listing and one read of the newest manifest; root metadata is cached
    gets = [key for op, key in recorder.calls if op in ("get", "get_range")]
    assert [layout.parse_manifest_key(k) for k in gets] == [5]
    assert counts["put"] == 0


def test_local_copy_behind_replays_only_the_missing_changelogs(
    recorder: RecordingBlobStore, tmp_path: Path
) -> None:
    _commit_versions(_backend(recorder, tmp_path / "a"), 4)
    _commit_versions(_backend(recorder, tmp_path / "b"), 3, start=4)  # another host moves on
    recorder.reset()
    with _backend(recorder, tmp_path / "a").open("op", partition=0) as store:
        assert store.version == 7
        assert dict(store.scan()) == _expected(7)
        info = store.restore_info
    assert (info.base_kind, info.base, info.changelogs_replayed) == ("local", 4, 3)
    fetched = sorted(key for op, key in recorder.calls if op == "get_range" and "changelog" in key)
    history = store_history(_backend(recorder, tmp_path / "a"), "op", 0)
    assert fetched == [history.changelog_key(v) for v in (5, 6, 7)]


def test_local_copy_ahead_of_the_version_asked_is_never_used(
    recorder: RecordingBlobStore, tmp_path: Path
) -> None:
    backend = _backend(recorder, tmp_path / "a")
    _commit_versions(backend, 6)
    with backend.open("op", partition=0, version=4) as store:  # a re-run of batch 4
        assert store.version == 4
        assert store.restore_info.base_kind == "empty"
        assert dict(store.scan()) == _expected(4)
        store.put(b"k%d" % (5 % 7), b"v5")
        store.put(b"last", b"5")
        assert store.commit().version == 5  # identical re-run accepted
    with backend.open("op", partition=0) as store:
        assert store.version == 6
        assert dict(store.scan()) == _expected(6)


def test_a_copy_that_cannot_be_deleted_whole_fails_the_open_instead_of_mixing_versions(
    recorder: RecordingBlobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy is 4 commits ahead of the version asked, so it is deleted and the version
    rebuilt from the changelogs. A delete that failed part way (EBUSY, EIO, an NFS ``.nfs``
    file) was ignored: the changelogs were replayed onto what was left, and version 2 read
    back with version 6's keys."""
    backend = _backend(recorder, tmp_path / "a")
    _commit_versions(backend, 6)
    copy = backend.local_path("op", 0)
    delete = shutil.rmtree

    def stuck(path: str, ignore_errors: bool = False, **handlers: Any) -> None:
        if os.path.abspath(path) != os.path.abspath(copy):
            return delete(path, ignore_errors=ignore_errors, **handlers)
        error = OSError(errno.EBUSY, "Device or resource busy")
        if ignore_errors:
            return None
        if "onexc" in handlers:
            return handlers["onexc"](os.unlink, f"{path}/000009.sst", error)
        return handlers["onerror"](os.unlink, f"{path}/000009.sst", (OSError, error, None))

    monkeypatch.setattr(shutil, "rmtree", stuck)
    with pytest.raises(sk.StateKeeperError, match="could not delete the local working copy"):
        backend.open("op", partition=0, version=2)
    monkeypatch.undo()
    with backend.open("op", partition=0, version=2) as store:
        assert dict(store.scan()) == _expected(2)


def test_local_copy_of_another_root_with_the_same_uri_is_discarded(tmp_path: Path) -> None:
    local = tmp_path / "local"
    root = tmp_path / "root"
    _commit_versions(_backend(RecordingBlobStore(LocalBlobStore(str(root))), local), 3)
    shutil.rmtree(root)  # the root is deleted and recreated: same URI, new history
    backend = _backend(RecordingBlobStore(LocalBlobStore(str(root))), local)
    with backend.open("op", partition=0) as store:
        assert store.version == 0
        assert list(store.scan()) == []
        store.put(b"fresh", b"1")
        store.commit()
    with backend.open("op", partition=0) as store:
        assert dict(store.scan()) == {b"fresh": b"1"}


def test_missing_changelog_in_the_chain_is_reported(
    recorder: RecordingBlobStore, tmp_path: Path
) -> None:
    _commit_versions(_backend(recorder, tmp_path / "a"), 5)
    missing = store_history(_backend(recorder, tmp_path / "a"), "op", 0).changelog_key(3)
    recorder.inner.delete_many([missing])
    backend = _backend(recorder, tmp_path / "fresh")
    # The manifest states what was committed; the error names the blob that is gone.
    assert backend.versions("op", 0) == [0, 1, 2, 3, 4, 5]
    with pytest.raises(sk.StateNotFoundError, match=re.escape(missing)):
        backend.open("op", partition=0, version=5)
    with backend.open("op", partition=0, version=2) as store:
        assert dict(store.scan()) == _expected(2)


def test_corrupt_changelog_is_reported_naming_the_blob(
    recorder: RecordingBlobStore, tmp_path: Path
) -> None:
    _commit_versions(_backend(recorder, tmp_path / "a"), 3)
    key = store_history(_backend(recorder, tmp_path / "a"), "op", 0).changelog_key(2)
    path = tmp_path / "root" / key
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(sk.CorruptStateError, match=key):
        _backend(recorder, tmp_path / "fresh").open("op", partition=0)


@pytest.mark.s3
def test_commits_and_cold_restore_on_s3(
    s3_root: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    uri, options = s3_root
    writer = sk.StateBackend(
        uri, config=sk.StoreConfig(local_dir=str(tmp_path / "w")), storage_options=options
    )
    _commit_versions(writer, 12)  # the default snapshot_every=10 snapshots version 10
    writer.wait_for_snapshots()
    assert writer.versions("op", 0) == list(range(13))
    cold = sk.StateBackend(
        uri, config=sk.StoreConfig(local_dir=str(tmp_path / "cold")), storage_options=options
    )
    with cold.open("op", partition=0) as store:
        info = store.restore_info
        assert (store.version, info.base_kind, info.base, info.changelogs_replayed) == (
            12,
            "snapshot",
            10,
            2,
        )
        assert info.files_downloaded > 0
        assert dict(store.scan()) == _expected(12)
    with cold.open("op", partition=0, version=7) as store:
        assert store.restore_info.base_kind == "empty"  # the local copy is ahead of 7
        assert dict(store.scan()) == _expected(7)
    assert "secret" not in repr(cold).lower()


def test_a_restore_whose_lineage_record_cannot_be_written_releases_the_copy(
    tmp_path: Path,
) -> None:
    """The restored copy was left open when its lineage record could not be written (a
    full disk): the open raised a bare OSError, and every later open in the process failed
    with "already open in this process"."""
    root, local = str(tmp_path / "root"), tmp_path / "local"
    config = sk.StoreConfig(local_dir=str(local), snapshot_every=2)
    with sk.StateBackend(root, config=config) as backend:
        with backend.open("op", 0) as store:
            for i in range(3):
                store.put(b"k%d" % i, b"v")
                store.commit()
        backend.wait_for_snapshots()
        copy = backend.local_path("op", 0)
    shutil.rmtree(copy)  # a new disk: restored from the snapshot at version 2
    blocker = f"{copy}.lineage.json.tmp"
    os.makedirs(blocker)  # the record's temporary name is taken: its write fails
    with sk.StateBackend(root, config=config) as backend:
        with pytest.raises(sk.StateKeeperError, match="cannot record the lineage"):
            backend.open("op", 0)
        os.rmdir(blocker)
        with backend.open("op", 0) as store:
            assert store.version == 3
            assert store.get(b"k2") == b"v"
