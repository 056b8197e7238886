"""verify(): every reference, every checksum; integrity checks and fallback on open."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterable
from pathlib import Path

import pytest

import statekeeper as sk
from statekeeper import layout
from statekeeper.errors import StorageError, TransientStorageError
from statekeeper.gc import collect_garbage
from statekeeper.history import RootListing, StoreHistory, lost_manifests
from statekeeper.storage import LocalBlobStore
from tests.blobstores import RecordingBlobStore, gc_later, store_history
from tests.changelog.format1 import to_format1


def _build(tmp_path: Path) -> sk.StateBackend:
    """Versions 1..25 with snapshots at 10 and 20 (small memtables: several SST files);
    background gc has removed changelogs 1..10."""
    config = sk.StoreConfig(
        local_dir=str(tmp_path / "w"),
        snapshot_every=10,
        write_buffer_mb=1,
        chunk_size=64 * 1024,
        retain_versions=8,  # background gc keeps snapshot 10 as the base, changelogs 11-25
    )
    backend = sk.StateBackend(str(tmp_path / "root"), config=config)
    with backend.open("op", 0) as store:
        for v in range(1, 26):
            for i in range(400):
                store.put(b"key%05d" % (v * 400 + i), b"%d" % v * 30)
            store.commit()
            backend.wait_for_snapshots()
    return backend


def _flip(path: Path, offset: int = -5) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _history(tmp_path: Path) -> StoreHistory:
    config = sk.StoreConfig(local_dir=str(tmp_path / "k"))
    return store_history(sk.StateBackend(str(tmp_path / "root"), config=config), "op", 0)


def _kinds(tmp_path: Path) -> dict[str, str]:
    root = tmp_path / "root"
    files = sorted(p for p in (root / "op/0/files").iterdir())
    history = _history(tmp_path)
    return {
        "changelog": history.changelog_key(22),
        "index": history.index_key(20),
        "file": f"op/0/files/{max(files, key=lambda p: p.stat().st_size).name}",
    }


def test_intact_root_verifies(tmp_path: Path) -> None:
    backend = _build(tmp_path)
    for deep in (False, True):
        report = backend.verify(deep=deep)
        assert report.ok, report.problems
        assert report.stores == 1
        assert report.blobs_checked > 25
    seen: list[tuple[int, int]] = []
    backend.verify(deep=True, progress=lambda done, total: seen.append((done, total)))
    assert seen
    assert seen[-1][0] >= seen[-1][1] > 0


@pytest.mark.parametrize("kind", ["changelog", "index", "file"])
def test_a_flipped_byte_in_any_blob_kind_is_found_and_named(tmp_path: Path, kind: str) -> None:
    backend = _build(tmp_path)
    key = _kinds(tmp_path)[kind]
    _flip(tmp_path / "root" / key)
    report = backend.verify(deep=True)
    assert not report.ok
    assert any(key in p.blob or key in p.message for p in report.problems), report.problems
    assert {p.kind for p in report.problems} <= {"corrupt", "missing", "unrestorable"}


@pytest.mark.parametrize("kind", ["changelog", "index", "file"])
def test_a_missing_blob_is_found_without_deep(tmp_path: Path, kind: str) -> None:
    backend = _build(tmp_path)
    assert backend.versions("op", 0)[0] == 10
    # the base snapshot: without it versions 11-19 are lost
    key = _history(tmp_path).index_key(10) if kind == "index" else _kinds(tmp_path)[kind]
    (tmp_path / "root" / key).unlink()
    report = backend.verify(deep=False)
    assert not report.ok
    assert any(key in p.blob or key in p.message for p in report.problems), report.problems


def test_truncated_changelog_is_found_without_deep(tmp_path: Path) -> None:
    backend = _build(tmp_path)
    path = tmp_path / "root" / _history(tmp_path).changelog_key(23)
    path.write_bytes(path.read_bytes()[:-10])
    problems = backend.verify(deep=False).problems
    assert [p.kind for p in problems] == ["corrupt", "unrestorable"]
    assert "versions 23-25" in problems[1].message  # what the broken changelog costs


def test_open_falls_back_to_an_older_snapshot_and_logs_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _build(tmp_path)
    _flip(tmp_path / "root" / _kinds(tmp_path)["file"])  # a file of the newest snapshot
    cold = sk.StateBackend(
        str(tmp_path / "root"), config=sk.StoreConfig(local_dir=str(tmp_path / "cold"))
    )
    with caplog.at_level(logging.WARNING), cold.open("op", 0) as store:
        assert store.version == 25
        assert (store.restore_info.base_kind, store.restore_info.base) == ("snapshot", 10)
        assert len(dict(store.scan())) == 25 * 400
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "snapshot 20" in warning
    assert "op/0" in warning


def test_corrupt_changelog_with_no_way_around_is_an_error_naming_blob_and_store(
    tmp_path: Path,
) -> None:
    _build(tmp_path)
    key = _history(tmp_path).changelog_key(23)
    _flip(tmp_path / "root" / key)
    cold = sk.StateBackend(
        str(tmp_path / "root"), config=sk.StoreConfig(local_dir=str(tmp_path / "cold"))
    )
    with pytest.raises(sk.CorruptStateError, match=key):
        cold.open("op", 0)
    with cold.open("op", 0, version=22) as store:  # what does not need it still opens
        assert store.version == 22


# -- format 1 roots (statekeeper 0.1): identity by name, GC in progress ----------------------


def _format1_root(tmp_path: Path) -> sk.StateBackend:
    """Versions 1..25 with snapshots at 10 and 20, rewritten as statekeeper 0.1 wrote them;
    nothing collected yet."""
    config = sk.StoreConfig(local_dir=str(tmp_path / "w"), snapshot_every=10, retain_versions=1000)
    backend = sk.StateBackend(str(tmp_path / "root"), config=config)
    with backend.open("op", 0) as store:
        for v in range(1, 26):
            store.put(b"key%03d" % v, b"%d" % v)
            store.put(b"last", b"%d" % v)
            store.commit()
            backend.wait_for_snapshots()
    backend.close()
    to_format1(tmp_path / "root")
    return _cold(tmp_path, "c")


def _cold(tmp_path: Path, local: str, **options: object) -> sk.StateBackend:
    config = sk.StoreConfig(local_dir=str(tmp_path / local), **options)  # type: ignore[arg-type]
    return sk.StateBackend(str(tmp_path / "root"), config=config)


class _DiesHalfWay(LocalBlobStore):
    """A blob store whose bulk delete removes half the keys, then fails (a GC killed)."""

    def delete_many(self, keys: Iterable[str]) -> None:
        keys = sorted(keys)
        super().delete_many(keys[::2])
        raise StorageError(f"connection lost after deleting {len(keys[::2])} of {len(keys)}")


def test_format1_root_verifies_and_opens(tmp_path: Path) -> None:
    backend = _format1_root(tmp_path)
    assert not list((tmp_path / "root" / "op/0").glob("manifest/*"))
    for deep in (False, True):
        report = backend.verify(deep=deep)
        assert report.ok, report.problems
        assert report.expired == []
    with backend.open("op", 0) as store:
        assert store.version == 25
        assert store.get(b"last") == b"25"


def test_format1_changelog_stored_under_another_version_is_reported(tmp_path: Path) -> None:
    backend = _format1_root(tmp_path)
    root = tmp_path / "root"
    target = layout.changelog_key("op", 0, 23)
    shutil.copyfile(root / layout.changelog_key("op", 0, 22), root / target)
    for deep in (False, True):
        problems = backend.verify(deep=deep).problems
        corrupt = [p for p in problems if p.kind == "corrupt"]
        assert [p.blob for p in corrupt] == [target], problems
        assert "version 23" in corrupt[0].message
        assert "version 22" in corrupt[0].message
    with pytest.raises(sk.CorruptStateError, match=target):
        _cold(tmp_path, "x").open("op", 0)


def test_format1_changelog_of_another_store_copied_over_is_reported(tmp_path: Path) -> None:
    backend = _format1_root(tmp_path)
    with _cold(tmp_path, "p1").open("other", 0) as store:  # a format-2 store beside it
        for v in range(1, 24):
            store.put(b"key", b"other %d" % v)
            store.commit()
    foreign = store_history(_cold(tmp_path, "k"), "other", 0).changelog_key(23)
    target = layout.changelog_key("op", 0, 23)
    shutil.copyfile(tmp_path / "root" / foreign, tmp_path / "root" / target)
    problems = backend.verify(deep=False).problems
    assert [p.blob for p in problems if p.kind == "corrupt"] == [target], problems
    with pytest.raises(sk.CorruptStateError, match="store other/0") as err:
        _cold(tmp_path, "y").open("op", 0)
    assert "store op/0, version 23, attempt format1" in str(err.value)


def test_gc_that_died_half_way_is_not_reported_as_damage(tmp_path: Path) -> None:
    backend = _format1_root(tmp_path)
    config = sk.StoreConfig(local_dir=str(tmp_path / "g"), retain_versions=8)
    dying = _DiesHalfWay(str(tmp_path / "root"))
    root_id = json.loads((tmp_path / "root" / layout.ROOT_METADATA).read_bytes())["rootId"]
    with pytest.raises(StorageError, match="connection lost"):
        collect_garbage(dying, config, ["op"], root_id=root_id)
    left = sorted(p.name for p in (tmp_path / "root/op/0/changelog").iterdir())
    assert layout.changelog_key("op", 0, 1).rsplit("/", 1)[1] not in left  # it did delete
    assert layout.changelog_key("op", 0, 2).rsplit("/", 1)[1] in left  # but not everything
    for version in range(10, 26):  # every version the GC retains still opens
        with _cold(tmp_path, f"o{version}").open("op", 0, version=version) as store:
            assert store.get(b"last") == b"%d" % version
    for deep in (False, True):
        report = backend.verify(deep=deep)
        assert report.ok, report.problems
        assert report.expired, "the leftovers of the GC are listed"
        assert all(p.kind == "expired" for p in report.expired)
        assert any("garbage collection" in p.message for p in report.expired)
    collect_garbage(LocalBlobStore(str(tmp_path / "root")), config, ["op"], root_id=root_id)
    after = backend.verify(deep=False)
    assert after.ok, after.problems
    assert after.expired == []  # the next run finished the job


def test_lost_changelog_above_every_base_is_still_damage(tmp_path: Path) -> None:
    backend = _format1_root(tmp_path)
    key = layout.changelog_key("op", 0, 22)
    (tmp_path / "root" / key).unlink()
    problems = backend.verify(deep=False).problems
    assert ("missing", key) in {(p.kind, p.blob) for p in problems}, problems
    assert any(p.kind == "unrestorable" and "23-25" in p.message for p in problems)
    with pytest.raises(sk.StateNotFoundError, match=key):  # the error names what is missing
        _cold(tmp_path, "z").open("op", 0, version=25)


def test_damaged_newer_manifest_is_reported(tmp_path: Path) -> None:
    backend = _build(tmp_path)
    newest = max((tmp_path / "root/op/0/manifest").iterdir())
    _flip(newest, 20)
    problems = backend.verify(deep=False).problems
    assert [p.kind for p in problems] == ["corrupt"], problems
    assert problems[0].blob == f"op/0/manifest/{newest.name}"
    assert "newer than the one readers use" in problems[0].message
    # Version 25 was only in the damaged manifest: opening it names that manifest.
    config = sk.StoreConfig(local_dir=str(tmp_path / "cold"))
    cold = sk.StateBackend(str(tmp_path / "root"), config=config)
    with pytest.raises(sk.StateNotFoundError, match="version 25") as info:
        cold.open("op", 0, version=25)
    assert f"newest manifest op/0/manifest/{newest.name} failed its checks" in str(info.value)
    cold.close()


def test_damaged_commit_metrics_of_a_manifest_store_are_reported_by_deep_verify(
    tmp_path: Path,
) -> None:
    """Found by the fault soak (python -m tests.faults --suite corruption --seed 1002): the
    format-2 path of verify never read the commit-metrics blobs that the format-1 path checks."""
    backend = _build(tmp_path)
    metrics = sorted((tmp_path / "root" / "op/0/metrics").iterdir())
    assert metrics
    metrics[-1].write_bytes(metrics[-1].read_bytes()[:-7])
    key = f"op/0/metrics/{metrics[-1].name}"
    assert backend.verify(deep=False).ok  # metrics are not state: only a deep check reads them
    report = backend.verify(deep=True)
    assert [(p.blob, p.kind) for p in report.problems] == [(key, "corrupt")]


def test_a_changelog_of_several_parts_verifies_and_a_damaged_part_is_named(
    tmp_path: Path,
) -> None:
    """A commit larger than changelog_part_bytes is written as several parts in one blob:
    the shallow check reads each part's header (the first one's length is not the blob's)."""
    config = sk.StoreConfig(
        local_dir=str(tmp_path / "w"), changelog_part_bytes=4096, snapshot_every=1000
    )
    backend = sk.StateBackend(str(tmp_path / "root"), config=config)
    with backend.open("op", 0) as store:
        for i in range(500):
            store.put(b"key%05d" % i, b"v" * 40)
        store.commit()
    key = _history(tmp_path).changelog_key(1)
    path = tmp_path / "root" / key
    data = path.read_bytes()
    assert data.count(b"SKCL") > 3  # several parts
    for deep in (False, True):
        report = backend.verify(deep=deep)
        assert report.ok, report.problems
    assert backend.verify(deep=True).bytes_checked >= len(data)  # every part, read in turn
    # Bytes after the last part: the deep check, reading a part at a time, sees them too.
    path.write_bytes(data + b"extra")
    for deep in (False, True):
        problems = backend.verify(deep=deep).problems
        assert [(p.kind, p.blob) for p in problems][:1] == [("corrupt", key)], (deep, problems)
    # The last part cut off: the part headers announce more bytes than the blob holds.
    path.write_bytes(data[: data.rindex(b"SKCL")])
    problems = backend.verify(deep=False).problems
    assert [(p.kind, p.blob) for p in problems][:1] == [("corrupt", key)], problems
    assert "too short for a header" in problems[0].message  # the announced part is not there
    # A part of another version spliced in: its header names the wrong version.
    other = bytearray(data)
    second = data.index(b"SKCL", 4)
    other[second + 16 : second + 24] = (7).to_bytes(8, "big")
    path.write_bytes(bytes(other))
    problems = backend.verify(deep=False).problems
    assert problems, "a part with another version passed the shallow check"
    assert problems[0].blob == key
    assert "does not belong where it is stored" in problems[0].message
    backend.close()


def test_a_store_whose_manifests_were_deleted_is_reported_and_kept(tmp_path: Path) -> None:
    """Found by review: with every manifest of a store gone (a lifecycle rule, a partial
    copy of the bucket) its per-attempt blobs were invisible to the format-1 reading, so
    verify said the root was intact, GC would have deleted its snapshots' files, and the
    tools listed it at version 0. (A Spark task refuses to fill it from empty state:
    ``tests/spark/test_skipped_batches.py``.)"""
    backend = _build(tmp_path)
    backend.close()
    files = sorted((tmp_path / "root" / "op" / "0" / "files").iterdir())
    shutil.rmtree(tmp_path / "root" / layout.manifest_prefix("op", 0))
    config = sk.StoreConfig(local_dir=str(tmp_path / "w2"))
    with sk.StateBackend(str(tmp_path / "root"), config=config) as again:
        report = again.verify()
        assert not report.ok
        assert [p.kind for p in report.problems] == ["missing"]
        assert "its manifests were deleted" in report.problems[0].message
        with pytest.raises(sk.CorruptStateError, match="its manifests were deleted"):
            RootListing.of(again.blobs).history("op", 0)
        collected = gc_later(again, 30 * 86400)
        assert collected.stores["op/0"].skipped is not None
        assert not [k for k in collected.deleted_keys if k.startswith("op/0/")]
    assert sorted((tmp_path / "root" / "op" / "0" / "files").iterdir()) == files


def test_orphans_of_refused_commits_are_not_taken_for_lost_manifests() -> None:
    """Found by the simulation: a first commit that never registered, and commits refused
    on top of it (a local copy ahead of the root), leave per-attempt blobs of versions 1, 2,
    ... and no manifest; only registered commits write commit metrics."""
    orphans = [layout.attempt_changelog_key("op", 0, v, "a" * 32) for v in (1, 2, 3)]
    assert lost_manifests("op", 0, orphans) is None
    assert lost_manifests("op", 0, [*orphans, layout.metrics_key("op", 0, 3)]) is not None
    legacy = [layout.changelog_key("op", 0, 1), layout.metrics_key("op", 0, 1)]
    assert lost_manifests("op", 0, [*legacy, orphans[0]]) is None  # statekeeper 0.1


class _FilesUnreadable(RecordingBlobStore):
    """Every read of a snapshot file fails as a throttled store's would after its retries."""

    def get(self, key: str) -> bytes:
        if "/files/" in key:
            raise TransientStorageError(f"503 SlowDown reading {key} (injected)")
        return super().get(key)


def test_a_file_that_cannot_be_read_now_is_an_error_not_a_missing_blob(tmp_path: Path) -> None:
    """Found by review: ``verify --deep`` reported every snapshot file it could not read
    (throttling, access denied) as missing, telling of damage a root did not have."""
    _build(tmp_path).close()
    blobs = _FilesUnreadable(LocalBlobStore(str(tmp_path / "root")))
    config = sk.StoreConfig(local_dir=str(tmp_path / "w2"))
    with sk.StateBackend(blobs, config=config) as backend:
        assert backend.verify(deep=False).ok
        with pytest.raises(StorageError, match="503 SlowDown"):
            backend.verify(deep=True)
