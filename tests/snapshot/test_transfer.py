"""Snapshot upload and restore against a real LocalBlobStore, on real files and RocksDB."""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import google_crc32c
import pytest
import rocksdict
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from statekeeper import layout
from statekeeper.errors import CommitConflictError, CorruptStateError, StateNotFoundError
from statekeeper.snapshot import (
    DirIndex,
    SnapshotIndex,
    iter_files,
    load_index,
    referenced_blob_ids,
    restore_snapshot,
    upload_snapshot,
)
from statekeeper.storage import BlobMeta, LocalBlobStore
from tests.snapshot.test_index import seal

OP, PART = "sessions", 3


class CountingStore:
    """A BlobStore that records every call and delegates to a real LocalBlobStore."""

    def __init__(self, inner: LocalBlobStore) -> None:
        self.inner = inner
        self.puts: list[str] = []
        self.gets: list[str] = []
        self.ranges: list[str] = []
        self.before_put: Callable[[str], None] | None = None
        self.put_delay_s = 0.0
        self.max_in_flight = 0
        self._in_flight = 0
        self._lock = threading.Lock()

    @property
    def uri(self) -> str:
        return self.inner.uri

    def put(
        self, key: str, data: bytes, *, overwrite: bool = False, if_match: str | None = None
    ) -> None:
        with self._lock:
            self.puts.append(key)
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            if self.before_put is not None:
                self.before_put(key)
            time.sleep(self.put_delay_s)
            self.inner.put(key, data, overwrite=overwrite, if_match=if_match)
        finally:
            with self._lock:
                self._in_flight -= 1

    def get(self, key: str) -> bytes:
        with self._lock:
            self.gets.append(key)
        return self.inner.get(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with self._lock:
            self.ranges.append(key)
        return self.inner.get_range(key, start, length)

    def head(self, key: str) -> BlobMeta:
        return self.inner.head(key)

    def list(self, prefix: str = "") -> list[BlobMeta]:
        return self.inner.list(prefix)

    def delete_many(self, keys: Iterable[str]) -> None:
        self.inner.delete_many(keys)

    def put_many(self, items: Sequence[tuple[str, bytes]], *, overwrite: bool = False) -> None:
        for key, data in items:
            self.put(key, data, overwrite=overwrite)

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def close(self) -> None:
        self.inner.close()

    def file_blobs(self) -> list[str]:
        return [m.key for m in self.inner.list(layout.files_prefix(OP, PART))]

    def blob_path(self, blob_id: str) -> Path:
        return Path(self.inner.root, layout.file_blob_key(OP, PART, blob_id))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CountingStore]:
    counting = CountingStore(LocalBlobStore(tmp_path / "root", io_threads=4))
    yield counting
    counting.close()


def write(path: Path, data: bytes, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)
    return path


def tree(root: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every entry under ``root``: file content (None for a dir) and permission bits."""
    found: dict[str, tuple[bytes | None, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            content = None if name in dirnames else path.read_bytes()
            mode = stat.S_IMODE(path.lstat().st_mode) if content is not None else 0
            found[rel] = (content, mode)
    return found


def contents(root: Path) -> dict[str, bytes | None]:
    return {rel: content for rel, (content, _) in tree(root).items()}


def source_tree(root: Path) -> Path:
    write(root / "000010.sst", bytes(range(256)) * 3)
    write(root / "000011.sst", b"eleven" * 10, 0o600)
    write(root / "000012.blob", b"blob file")
    write(root / "CURRENT", b"MANIFEST-000005\n")
    write(root / "MANIFEST-000005", b"manifest v1")
    write(root / "OPTIONS-000007", b"[Version]\n")
    write(root / "empty.sst", b"")
    write(root / "sub" / "000001.sst", b"sub one")
    write(root / "sub" / "deeper" / "000002.sst", b"deeper two")
    (root / "emptydir" / "nested" / "deepest").mkdir(parents=True)
    write(root / "LOCK", b"")
    write(root / "LOG", b"not part of a snapshot")
    return root


def upload(
    store: CountingStore,
    src: Path,
    version: int,
    previous: SnapshotIndex | None = None,
    **kw: Any,
) -> tuple[SnapshotIndex, Any]:
    kw.setdefault("trust_names", True)
    kw.setdefault("chunk_size", 64)
    kw.setdefault("io_threads", 4)
    return upload_snapshot(
        store, src, operator=OP, partition=PART, version=version, previous=previous, **kw
    )


def restore(store: CountingStore, index: SnapshotIndex, target: Path, **kw: Any) -> Any:
    key = layout.snapshot_index_key(OP, PART, index.metadata.version)
    return restore_snapshot(store, index, target, io_threads=4, index_blob=key, **kw)


def expected_tree(src: Path) -> dict[str, tuple[bytes | None, int]]:
    return {k: v for k, v in tree(src).items() if k not in ("LOCK", "LOG")}


def no_temp_files(root: Path) -> bool:
    return not any(".sk-restore-" in p.name for p in root.rglob("*"))


# -- upload ----------------------------------------------------------------------------------


def test_backup_of_a_new_directory(store: CountingStore, tmp_path: Path) -> None:
    src = source_tree(tmp_path / "src")
    index, metrics = upload(store, src, 1, chunk_size=100)

    key = layout.snapshot_index_key(OP, PART, 1)
    assert store.puts[-1] == key  # the index is written last
    assert load_index(store, OP, PART, 1) == index
    assert index.prev_snapshot_index_blob_id is None
    files = dict(iter_files(index.dir_index))
    assert sorted(files) == sorted(k for k, (c, _) in expected_tree(src).items() if c is not None)
    for rel, f in files.items():
        data = (src / rel).read_bytes()
        assert (f.size_in_bytes, f.crc) == (len(data), google_crc32c.value(data))
        assert f.attribs == stat.S_IMODE((src / rel).stat().st_mode)
        assert f.mtime_ms == (src / rel).stat().st_mtime_ns // 1_000_000
    assert [len(f.blobs) for f in [files["000010.sst"], files["empty.sst"]]] == [8, 0]
    chunks = sum(len(f.blobs) for f in files.values())
    assert len(store.puts) == chunks + 1
    assert sorted(store.file_blobs()) == sorted(
        layout.file_blob_key(OP, PART, b) for b in referenced_blob_ids(index)
    )
    assert (metrics.files_uploaded, metrics.files_reused, metrics.files_removed) == (9, 0, 0)
    assert metrics.bytes_uploaded == sum(f.size_in_bytes for f in files.values())
    assert metrics.index_blob == key
    subdirs = [d.dir_name for d in index.dir_index.sub_directories_present]
    assert subdirs == ["emptydir", "sub"]


def test_incremental_backup_uploads_only_new_immutable_and_mutable_files(
    store: CountingStore, tmp_path: Path
) -> None:
    src = source_tree(tmp_path / "src")
    first, _ = upload(store, src, 1)
    (src / "000010.sst").unlink()
    (src / "000011.sst").unlink()
    write(src / "000013.sst", b"compacted" * 20)
    write(src / "sub" / "000003.sst", b"three")
    write(src / "MANIFEST-000005", b"manifest v2")
    store.puts.clear()

    second, metrics = upload(store, src, 2, first)

    uploaded = {"000013.sst", "sub/000003.sst", "CURRENT", "MANIFEST-000005", "OPTIONS-000007"}
    files = dict(iter_files(second.dir_index))
    expected_chunks = sum(len(files[rel].blobs) for rel in uploaded)
    assert len(store.puts) == expected_chunks + 1  # nothing else was written
    assert metrics.files_uploaded == len(uploaded)
    assert metrics.files_reused == len(files) - len(uploaded)
    assert metrics.files_removed == 2
    old = dict(iter_files(first.dir_index))
    for rel in set(files) - uploaded:
        assert files[rel] == old[rel]  # retained files reference the previous blobs
    assert second.prev_snapshot_index_blob_id == layout.snapshot_index_key(OP, PART, 1)
    removed = [f.file_name for f in second.dir_index.files_removed]
    assert removed == ["000010.sst", "000011.sst", "CURRENT", "MANIFEST-000005", "OPTIONS-000007"]
    # Every blob of the previous snapshot is either still referenced or listed as removed.
    gone = {b.blob_id for f in second.dir_index.files_removed for b in f.blobs}
    assert referenced_blob_ids(first) <= referenced_blob_ids(second) | gone
    assert not gone & referenced_blob_ids(second)


def test_existing_index_is_a_commit_conflict(store: CountingStore, tmp_path: Path) -> None:
    src = source_tree(tmp_path / "src")
    upload(store, src, 1)
    before = store.file_blobs()
    with pytest.raises(
        CommitConflictError, match=re.escape(layout.snapshot_index_key(OP, PART, 1))
    ):
        upload(store, src, 1)
    assert store.file_blobs() == before  # detected before uploading anything


def test_index_created_concurrently_is_a_commit_conflict(
    store: CountingStore, tmp_path: Path
) -> None:
    src = source_tree(tmp_path / "src")
    key = layout.snapshot_index_key(OP, PART, 1)

    def other_writer_wins(put_key: str) -> None:
        if put_key != key and store.before_put is not None:
            store.before_put = None
            store.inner.put(key, b"the other writer's index")

    store.before_put = other_writer_wins
    with pytest.raises(CommitConflictError):
        upload(store, src, 1)
    assert store.inner.get(key) == b"the other writer's index"


def test_previous_must_be_an_older_snapshot_of_the_same_store(
    store: CountingStore, tmp_path: Path
) -> None:
    src = source_tree(tmp_path / "src")
    first, _ = upload(store, src, 3)
    with pytest.raises(ValueError, match="previous snapshot"):
        upload(store, src, 3, first)
    with pytest.raises(ValueError, match="previous snapshot"):
        upload_snapshot(store, src, operator="other", partition=PART, version=4,
                        previous=first, trust_names=True, chunk_size=8, io_threads=1)  # fmt: skip
    with pytest.raises(ValueError, match="chunk_size"):
        upload(store, src, 4, first, chunk_size=0)


def test_upload_streams_with_bounded_parallelism(store: CountingStore, tmp_path: Path) -> None:
    src = tmp_path / "src"
    write(src / "000001.sst", os.urandom(700))
    store.put_delay_s = 0.005
    index, _ = upload(store, src, 1, chunk_size=7, io_threads=3)
    assert len(dict(iter_files(index.dir_index))["000001.sst"].blobs) == 100
    assert 2 <= store.max_in_flight <= 3


def test_one_io_thread_transfers_in_the_calling_thread(
    store: CountingStore, tmp_path: Path
) -> None:
    """``io_threads=1`` starts no pool thread: every put and get runs in the caller's thread
    (one transfer at a time gains nothing from a thread hop), and a failure still surfaces."""
    src = tmp_path / "src"
    write(src / "000001.sst", os.urandom(300))
    write(src / "MANIFEST-000001", os.urandom(50))
    threads: set[str] = set()
    store.before_put = lambda key: threads.add(threading.current_thread().name)
    index, _ = upload(store, src, 1, chunk_size=64, io_threads=1)
    assert threads == {threading.current_thread().name}
    assert len(store.puts) > 5

    seen: set[str] = set()
    real_get = store.get

    def get(key: str) -> bytes:
        seen.add(threading.current_thread().name)
        return real_get(key)

    store.get = get  # type: ignore[method-assign]
    key = layout.snapshot_index_key(OP, PART, 1)
    restore_snapshot(store, index, tmp_path / "dst", io_threads=1, index_blob=key)
    assert seen == {threading.current_thread().name}
    assert contents(tmp_path / "dst") == contents(src)

    store.inner.delete_many(store.file_blobs()[:1])
    with pytest.raises(StateNotFoundError, match="is missing"):
        restore_snapshot(store, index, tmp_path / "dst2", io_threads=1, index_blob=key)


def test_upload_logs_one_info_line(
    store: CountingStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = source_tree(tmp_path / "src")
    with caplog.at_level(logging.INFO, logger="statekeeper.snapshot"):
        index, _ = upload(store, src, 1)
        restore(store, index, tmp_path / "dst")
    lines = [r.getMessage() for r in caplog.records if r.name == "statekeeper.snapshot"]
    assert len(lines) == 2
    assert lines[0].startswith("snapshot sessions/3/snapshot/")
    assert "uploaded 9 files" in lines[0]
    assert "downloaded 9 files" in lines[1]


# -- load_index ------------------------------------------------------------------------------


def test_load_index_errors_name_the_blob(store: CountingStore, tmp_path: Path) -> None:
    key = layout.snapshot_index_key(OP, PART, 9)
    with pytest.raises(StateNotFoundError, match=key):
        load_index(store, OP, PART, 9)
    store.inner.put(key, b"{not json")
    with pytest.raises(CorruptStateError, match=key):
        load_index(store, OP, PART, 9)
    index, _ = upload(store, source_tree(tmp_path / "src"), 1)
    store.inner.put(layout.snapshot_index_key(OP, PART, 8), index.to_json())
    with pytest.raises(CorruptStateError, match="does not belong where it is stored") as err:
        load_index(store, OP, PART, 8)  # an index copied under another version's key
    assert "expected store sessions/3, version 8" in str(err.value)
    assert "found store sessions/3, version 1" in str(err.value)


def test_index_names_its_root_and_attempt_and_load_checks_them(
    store: CountingStore, tmp_path: Path
) -> None:
    index, metrics = upload(store, source_tree(tmp_path / "src"), 4, root_id="r00t", attempt="a1")
    key = metrics.index_blob
    meta = json.loads(store.inner.get(key))["metadata"]
    assert meta == {
        "operator": OP,
        "partition": PART,
        "version": 4,
        "rootId": "r00t",
        "attempt": "a1",
    }
    assert json.loads(store.inner.get(key))["schemaVersion"] == 2
    assert load_index(store, OP, PART, 4, key=key, root_id="r00t", attempt="a1") == index
    assert load_index(store, OP, PART, 4, key=key) == index  # nothing more expected: not checked
    for root_id, attempt, found in (("other", "a1", "root r00t"), ("r00t", "b2", "attempt a1")):
        with pytest.raises(CorruptStateError) as err:
            load_index(store, OP, PART, 4, key=key, root_id=root_id, attempt=attempt)
        message = str(err.value)
        assert key in message
        assert f"expected root {root_id}," in message, message
        assert found in message.split("found", 1)[1], message
    with pytest.raises(CorruptStateError, match=f"store {OP}/1, version 4, attempt a1, found"):
        load_index(store, OP, 1, 4, key=key, root_id="r00t", attempt="a1")


def test_schema_1_index_is_read_only_where_one_is_expected(
    store: CountingStore, tmp_path: Path
) -> None:
    index, metrics = upload(store, source_tree(tmp_path / "src"), 4)
    key = metrics.index_blob
    assert json.loads(store.inner.get(key))["schemaVersion"] == 1
    assert index.metadata.root_id is None
    legacy = load_index(
        store, OP, PART, 4, key=key, root_id="r", attempt="format1", anonymous_ok=True
    )
    assert legacy == index
    with pytest.raises(CorruptStateError, match=r"schema 1: no root id or attempt"):
        load_index(store, OP, PART, 4, key=key, root_id="r", attempt="a1")


# -- restore ---------------------------------------------------------------------------------


def test_restore_on_an_empty_target(store: CountingStore, tmp_path: Path) -> None:
    src = source_tree(tmp_path / "src")
    index, _ = upload(store, src, 1, chunk_size=7)  # many chunks per file
    target = tmp_path / "a" / "b" / "target"

    metrics = restore(store, index, target)

    assert tree(target) == expected_tree(src)
    assert (target / "empty.sst").read_bytes() == b""
    assert (target / "emptydir" / "nested" / "deepest").is_dir()
    for rel, f in iter_files(index.dir_index):
        assert (target / rel).stat().st_mtime_ns == f.mtime_ms * 1_000_000
    assert metrics.files_downloaded == 9
    assert metrics.files_reused == 0
    assert metrics.bytes_downloaded == sum(f.size_in_bytes for _, f in iter_files(index.dir_index))
    assert no_temp_files(target)


def test_restore_reuses_identical_files_without_downloading(
    store: CountingStore, tmp_path: Path
) -> None:
    src = source_tree(tmp_path / "src")
    index, _ = upload(store, src, 1)
    target = tmp_path / "target"
    restore(store, index, target)
    store.gets.clear()

    metrics = restore(store, index, target)

    assert (metrics.files_downloaded, metrics.files_reused, metrics.files_deleted) == (0, 9, 0)
    assert metrics.bytes_reused == sum(f.size_in_bytes for _, f in iter_files(index.dir_index))
    assert store.gets == []
    assert store.ranges == []
    assert tree(target) == expected_tree(src)


def test_restore_over_a_changed_target(store: CountingStore, tmp_path: Path) -> None:
    src = source_tree(tmp_path / "src")
    index, _ = upload(store, src, 1)
    target = tmp_path / "target"
    restore(store, index, target)
    outside = write(tmp_path / "outside" / "keep.txt", b"outside")
    write(target / "000011.sst", b"ELEVEN" * 10)  # same size, other content
    (target / "000012.blob").chmod(0o600)  # same content, other mode: kept, mode fixed
    write(target / "extra.sst", b"extra")
    write(target / "sub" / "stray" / "x" / "y", b"stray")
    (target / "sub" / "deeper" / "000002.sst").unlink()
    (target / "emptydir" / "nested" / "deepest").rmdir()
    (target / "link").symlink_to(outside.parent, target_is_directory=True)
    (target / "sub" / "deeper").rename(tmp_path / "moved")
    (target / "sub" / "deeper").symlink_to(outside.parent, target_is_directory=True)
    store.gets.clear()

    metrics = restore(store, index, target)

    assert tree(target) == expected_tree(src)
    assert not (target / "link").exists()
    assert not (target / "sub" / "deeper").is_symlink()
    assert outside.read_bytes() == b"outside"
    assert sorted(os.listdir(outside.parent)) == ["keep.txt"]
    assert metrics.files_downloaded == 2  # 000011.sst and sub/deeper/000002.sst
    assert metrics.files_reused == 7
    assert metrics.files_deleted == 4  # extra.sst, sub/stray/x/y and the two symlinks
    files = dict(iter_files(index.dir_index))
    downloaded = {
        layout.file_blob_key(OP, PART, b.blob_id)
        for rel in ("000011.sst", "sub/deeper/000002.sst")
        for b in files[rel].blobs
    }
    assert set(store.gets) == downloaded


def test_restore_with_wipe_downloads_everything(store: CountingStore, tmp_path: Path) -> None:
    src = source_tree(tmp_path / "src")
    index, _ = upload(store, src, 1)
    target = tmp_path / "target"
    restore(store, index, target)
    write(target / "extra", b"x")
    metrics = restore(store, index, target, wipe=True)
    assert (metrics.files_downloaded, metrics.files_reused, metrics.files_deleted) == (9, 0, 10)
    assert tree(target) == expected_tree(src)


def test_restore_reassembles_multi_chunk_files_in_order(
    store: CountingStore, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    data = os.urandom(1000)
    write(src / "000001.sst", data)
    index, _ = upload(store, src, 1, chunk_size=7)
    blobs = index.dir_index.files_present[0].blobs
    assert [b.offset for b in blobs] == list(range(0, 1000, 7))
    restore_snapshot(store, index, tmp_path / "t", io_threads=8, index_blob="i")
    assert (tmp_path / "t" / "000001.sst").read_bytes() == data


def test_corrupted_chunk_is_detected_and_nothing_moved_into_place(
    store: CountingStore, tmp_path: Path
) -> None:
    src = source_tree(tmp_path / "src")
    index, _ = upload(store, src, 1, chunk_size=100)
    target = tmp_path / "target"
    write(target / "000010.sst", b"old content")
    entry = dict(iter_files(index.dir_index))["000010.sst"]
    victim = store.blob_path(entry.blobs[3].blob_id)
    raw = bytearray(victim.read_bytes())
    raw[5] ^= 0x01
    victim.write_bytes(bytes(raw))

    with pytest.raises(CorruptStateError) as info:
        restore(store, index, target)

    message = str(info.value)
    assert layout.file_blob_key(OP, PART, entry.blobs[3].blob_id) in message
    assert "000010.sst" in message
    assert "CRC32C" in message
    assert (target / "000010.sst").read_bytes() == b"old content"
    assert no_temp_files(target)


def test_chunk_of_the_wrong_length_is_corrupt(store: CountingStore, tmp_path: Path) -> None:
    src = source_tree(tmp_path / "src")
    index, _ = upload(store, src, 1, chunk_size=100)
    entry = dict(iter_files(index.dir_index))["000010.sst"]
    victim = store.blob_path(entry.blobs[0].blob_id)
    victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(CorruptStateError, match="expected 100 bytes, found 99"):
        restore(store, index, tmp_path / "target")
    assert not (tmp_path / "target" / "000010.sst").exists()


def test_missing_chunk_names_the_blob_and_the_file(store: CountingStore, tmp_path: Path) -> None:
    src = source_tree(tmp_path / "src")
    index, _ = upload(store, src, 1, chunk_size=100)
    entry = dict(iter_files(index.dir_index))["sub/deeper/000002.sst"]
    key = layout.file_blob_key(OP, PART, entry.blobs[0].blob_id)
    store.inner.delete_many([key])
    with pytest.raises(StateNotFoundError) as info:
        restore(store, index, tmp_path / "target")
    assert isinstance(info.value, FileNotFoundError)
    assert key in str(info.value)
    assert "sub/deeper/000002.sst" in str(info.value)
    assert no_temp_files(tmp_path / "target")


def test_target_that_is_a_file_is_refused(store: CountingStore, tmp_path: Path) -> None:
    index, _ = upload(store, source_tree(tmp_path / "src"), 1)
    write(tmp_path / "file", b"x")
    with pytest.raises(NotADirectoryError):
        restore(store, index, tmp_path / "file")


def test_target_path_through_a_symlink(store: CountingStore, tmp_path: Path) -> None:
    src = source_tree(tmp_path / "src")
    index, _ = upload(store, src, 1)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    restore(store, index, tmp_path / "link" / "target")
    assert tree(tmp_path / "real" / "target") == expected_tree(src)


def bypass(obj: Any, **fields: Any) -> Any:
    """Set fields of a frozen dataclass without its validation, as a buggy caller could."""
    for name, value in fields.items():
        object.__setattr__(obj, name, value)
    return obj


@pytest.mark.parametrize("evil", ["..", "../escape", "/abs", "a/../../x", "", "."])
def test_unvalidated_index_paths_are_refused_before_writing(
    store: CountingStore, tmp_path: Path, evil: str
) -> None:
    index, _ = upload(store, source_tree(tmp_path / "src"), 1)
    first = index.dir_index.files_present[0]
    bypass(first, file_name=evil)
    sub = index.dir_index.sub_directories_present[0]
    target = tmp_path / "box" / "target"
    with pytest.raises(CorruptStateError, match="refusing to restore"):
        restore(store, index, target)
    assert not (tmp_path / "box").exists()
    bypass(first, file_name="000010.sst")
    bypass(sub, dir_name=evil)
    with pytest.raises(CorruptStateError, match="refusing to restore"):
        restore(store, index, target)
    assert not (tmp_path / "box").exists()


def test_unvalidated_blob_id_is_refused(store: CountingStore, tmp_path: Path) -> None:
    index, _ = upload(store, source_tree(tmp_path / "src"), 1)
    bypass(index.dir_index.files_present[0].blobs[0], blob_id="../../../etc/passwd")
    with pytest.raises(CorruptStateError, match="blob id"):
        restore(store, index, tmp_path / "target")
    assert store.gets == []


# -- a real RocksDB --------------------------------------------------------------------------


def rocks_items(path: Path) -> dict[bytes, bytes]:
    db = rocksdict.Rdict(str(path))
    try:
        items = db.items()
        found = {bytes(k): bytes(v) for k, v in items}
        del items  # iterators hold the DB open; release before close
    finally:
        db.close()
    return found


def test_real_rocksdb_checkpoints_round_trip(store: CountingStore, tmp_path: Path) -> None:
    db = rocksdict.Rdict(str(tmp_path / "db"))
    try:
        for i in range(2000):
            db[b"k%05d" % i] = b"v1-%05d" % i
        db.flush()
        rocksdict.Checkpoint(db).create_checkpoint(str(tmp_path / "cp1"))
        for i in range(1000, 3000):
            db[b"k%05d" % i] = b"v2-%05d" % i
        db.delete(b"k00007")
        db.flush()
        rocksdict.Checkpoint(db).create_checkpoint(str(tmp_path / "cp2"))
    finally:
        db.close()
    first, m1 = upload(store, tmp_path / "cp1", 1, chunk_size=4096)
    second, m2 = upload(store, tmp_path / "cp2", 2, first, chunk_size=4096)
    assert m1.files_reused == 0
    assert m2.files_reused >= 1  # the first SST is shared
    new_ssts = {n for n in os.listdir(tmp_path / "cp2") if n.endswith(".sst")} - set(
        os.listdir(tmp_path / "cp1")
    )
    uploaded_immutable = {rel for rel, f in iter_files(second.dir_index) if rel.endswith(".sst")}
    uploaded_immutable -= {rel for rel, _ in iter_files(first.dir_index)}
    assert uploaded_immutable == new_ssts

    target = tmp_path / "restored"
    restore(store, loaded := load_index(store, OP, PART, 2), target)
    assert loaded == second
    expected = {b"k%05d" % i: (b"v1-%05d" if i < 1000 else b"v2-%05d") % i for i in range(3000)}
    del expected[b"k00007"]
    assert rocks_items(target) == expected

    # Going back to version 1 in the same directory reuses the shared SST.
    metrics = restore(store, first, target)
    assert metrics.files_reused >= 1
    assert rocks_items(target) == {b"k%05d" % i: b"v1-%05d" % i for i in range(2000)}


# -- generated trees and hostile indexes -----------------------------------------------------

NAMES = ["a", "b", "c.sst", "d.sst", "MANIFEST-1", "e.blob"]


@st.composite
def file_trees(draw: st.DrawFn) -> dict[str, tuple[bytes, int]]:
    files: dict[str, tuple[bytes, int]] = {}
    for parts in draw(st.lists(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3))):
        rel = "/".join(parts)
        prefixes = {"/".join(parts[:i]) for i in range(1, len(parts))}
        if prefixes & files.keys() or any(k.startswith(rel + "/") for k in files):
            continue  # a path cannot be both a file and a directory
        content = draw(st.binary(max_size=40) | st.sampled_from([b"", b"shared", b"x" * 21]))
        files[rel] = (content, draw(st.sampled_from([0o600, 0o640, 0o644, 0o755])))
    return files


def materialize(root: Path, files: dict[str, tuple[bytes, int]], empty_dirs: list[str]) -> None:
    root.mkdir(parents=True)
    for rel, (content, mode) in files.items():
        write(root / rel, content, mode)
    for rel in empty_dirs:
        if not (root / rel).exists():
            (root / rel).mkdir(parents=True)


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(
    a=file_trees(),
    b=file_trees(),
    empty_dirs=st.lists(st.sampled_from(["x", "y/z"]), max_size=2),
    chunk_size=st.integers(1, 16),
)
def test_generated_trees_survive_incremental_upload_and_restore(
    a: dict[str, tuple[bytes, int]],
    b: dict[str, tuple[bytes, int]],
    empty_dirs: list[str],
    chunk_size: int,
) -> None:
    with tempfile.TemporaryDirectory() as tmp, LocalBlobStore(Path(tmp, "root")) as inner:
        blobs = CountingStore(inner)
        src_a, src_b, target = Path(tmp, "a"), Path(tmp, "b"), Path(tmp, "target")
        materialize(src_a, a, [])
        materialize(src_b, b, empty_dirs)
        first, _ = upload(blobs, src_a, 1, chunk_size=chunk_size)
        # src_b does not descend from src_a: same names may hold other content.
        second, _ = upload(blobs, src_b, 2, first, chunk_size=chunk_size, trust_names=False)
        restore(blobs, first, target)
        assert tree(target) == tree(src_a)
        metrics = restore(blobs, second, target)
        assert contents(target) == contents(src_b)
        # A retained entry keeps the previous snapshot's metadata (its FileIndex is reused
        # whole), so modes are compared with the index rather than with src_b.
        for rel, f in iter_files(second.dir_index):
            assert stat.S_IMODE((target / rel).stat().st_mode) == f.attribs
        identical = sum(1 for rel, v in b.items() if a.get(rel, (None, 0))[0] == v[0])
        assert metrics.files_reused >= identical
        assert metrics.files_reused + metrics.files_downloaded == len(b)
        gone = {x.blob_id for f in _all_removed(second.dir_index) for x in f.blobs}
        assert referenced_blob_ids(first) <= referenced_blob_ids(second) | gone


def _all_removed(d: DirIndex) -> Iterator[Any]:
    yield from d.files_removed
    for sub in d.sub_directories_removed:
        yield from (f for _, f in iter_files(sub))
    for sub in d.sub_directories_present:
        yield from _all_removed(sub)


HOSTILE_NAMES = ["..", ".", "", "../../outside", "/tmp/abs", "a/../..", "..\\x", "x\x00", "C:x"]
SAFE_NAMES = ["f.sst", "CURRENT", "sub", "..x", "x..", ".hidden", "outside", "target", "LOCK"]
SAFE_NAMES += [f"{i:06d}.sst" for i in range(8)]
CHUNKS = {"c0": b"zero", "c1": b"one!", "c2": b"2"}
HOSTILE_BLOB_IDS = ["../../x", "/etc/passwd", "a/b", ".tmp", ""]


@st.composite
def hostile_dirs(draw: st.DrawFn, depth: int = 0) -> dict[str, Any]:
    # Mostly safe names, so that many documents are valid and really restored.
    name_st = st.sampled_from(SAFE_NAMES * 4 + HOSTILE_NAMES)
    files = []
    for _ in range(draw(st.integers(0, 3))):
        blob_id = draw(st.sampled_from(sorted(CHUNKS) * 4 + HOSTILE_BLOB_IDS))
        files.append((draw(name_st), blob_id, CHUNKS.get(blob_id, b"?")))
    subs = [draw(hostile_dirs(depth + 1)) for _ in range(draw(st.integers(0, 2 - depth)))]
    return {"name": draw(name_st), "files": files, "subs": subs}


def hostile_doc(d: dict[str, Any], root: bool = True) -> dict[str, Any]:
    return {
        "dirName": "" if root else d["name"],
        "filesPresent": [
            {
                "fileName": name,
                "blobs": [{"blobId": blob_id, "offset": 0}],
                "sizeInBytes": len(content),
                "mtime": 1,
                "ctime": 1,
                "crc": google_crc32c.value(content),
                "attribs": 0o644,
            }
            for name, blob_id, content in d["files"]
        ],
        "filesRemoved": [],
        "subDirectoriesPresent": [hostile_doc(s, False) for s in d["subs"]],
        "subDirectoriesRemoved": [],
    }


def listing(root: Path, skip: Path) -> dict[str, bytes | None]:
    found: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [n for n in dirnames if Path(dirpath, n) != skip]
        for name in dirnames:
            found[str(Path(dirpath, name))] = None
        for name in filenames:
            found[str(Path(dirpath, name))] = Path(dirpath, name).read_bytes()
    return found


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(tree_spec=hostile_dirs())
def test_no_index_makes_restore_write_outside_its_target(tree_spec: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp, LocalBlobStore(Path(tmp, "box", "root")) as inner:
        box = Path(tmp, "box")
        write(box / "outside", b"do not touch")
        write(box / "target" / "sub" / "keep", b"old")
        target = box / "target" / "sub"
        doc = json.loads(upload(CountingStore(inner), box / "target", 1)[0].to_json())
        doc["dirIndex"] = hostile_doc(tree_spec)
        for blob_id, content in CHUNKS.items():
            inner.put(layout.file_blob_key(OP, PART, blob_id), content)
        before = listing(Path(tmp), skip=target)
        try:
            index = SnapshotIndex.from_json(seal(doc), blob="hostile")
            restore_snapshot(inner, index, target, io_threads=2, index_blob="hostile")
            event("restored")
        except (CorruptStateError, StateNotFoundError) as exc:
            event(f"refused: {type(exc).__name__}")
        after = listing(Path(tmp), skip=target)
        assert after == before
