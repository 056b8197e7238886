"""Commits of any size: a changelog larger than one part is written and replayed a part at a
time (changelog format 3), on a local root and on S3; memory stays bounded by the part."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import pytest

import statekeeper as sk
from statekeeper.changelog import FORMAT_VERSION, MAX_HEADER_SIZE, read_header
from statekeeper.storage import BlobStore, open_blob_store
from tests.blobstores import RecordingBlobStore, store_history

MIB = 1024 * 1024


def _config(local: Path, **fields: object) -> sk.StoreConfig:
    fields = {"changelog_part_bytes": MIB, "snapshot_every": 10_000, **fields}
    return sk.StoreConfig(local_dir=str(local), **fields)  # type: ignore[arg-type]


def _changes(count: int, size: int, seed: int) -> dict[bytes, bytes | None]:
    out: dict[bytes, bytes | None] = {b"k%06d" % i: os.urandom(size) for i in range(count)}
    out[b"k%06d" % seed] = None  # a delete among them
    return out


def _part_headers(blobs: BlobStore, key: str) -> list[tuple[int, bool]]:
    """(record count, more parts) of each part of a changelog blob, from its headers."""
    out, offset = [], 0
    while True:
        header = read_header(blobs.get_range(key, offset, MAX_HEADER_SIZE), blob=key)
        out.append((header.record_count, header.more_parts))
        if not header.more_parts:
            return out
        offset += header.blob_length


def _commit_and_reopen(root: str, options: dict[str, str], tmp: Path) -> None:
    changes = _changes(3000, 1000, seed=5)  # ~3 MB: three or four 1 MiB parts
    backend = sk.StateBackend(root, config=_config(tmp / "a"), storage_options=options)
    with backend, backend.open("op", 0) as store:
        store.put(b"k000005", b"before")
        store.commit()
        for key, value in changes.items():
            if value is None:
                store.delete(key)
            else:
                store.put(key, value)
        info = store.commit()
        expected = {k: v for k, v in changes.items() if v is not None}
        assert dict(store.scan()) == expected  # applied a part at a time, then labelled clean
        history = store_history(backend, "op", 0)
        parts = _part_headers(backend.blobs, info.blob)
        blob_size = backend.blobs.head(info.blob).size
    assert info.blob == history.changelog_key(2)
    assert len(parts) >= 3
    assert [more for _, more in parts] == [True] * (len(parts) - 1) + [False]
    assert sum(count for count, _ in parts) == len(changes)
    assert read_header(
        backend_blobs(root, options).get_range(info.blob, 0, MAX_HEADER_SIZE), blob=info.blob
    ).format_version == FORMAT_VERSION  # fmt: skip
    assert info.bytes_uploaded == blob_size
    assert (info.puts, info.deletes) == (len(changes) - 1, 1)
    # The writer's copy is current; a new working copy replays it part by part. Both see
    # exactly the commit.
    again = sk.StateBackend(root, config=_config(tmp / "a"), storage_options=options)
    with again, again.open("op", 0) as store:
        assert store.restore_info.base_kind == "local"
        assert dict(store.scan()) == expected
    fresh = sk.StateBackend(root, config=_config(tmp / "b"), storage_options=options)
    with fresh, fresh.open("op", 0) as store:
        assert store.restore_info.changelogs_replayed == 2
        assert dict(store.scan()) == expected


def backend_blobs(root: str, options: dict[str, str]) -> BlobStore:
    return open_blob_store(root, options)


def test_a_commit_larger_than_a_part_is_written_and_replayed_in_parts(tmp_path: Path) -> None:
    _commit_and_reopen(str(tmp_path / "root"), {}, tmp_path)


@pytest.mark.s3
def test_a_commit_larger_than_a_part_on_s3_is_a_multipart_upload(
    s3_root: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    _commit_and_reopen(*s3_root, tmp_path)


def test_a_re_run_of_a_commit_of_several_parts_is_compared_part_by_part(
    tmp_path: Path,
) -> None:
    changes = _changes(3000, 1000, seed=7)
    root = str(tmp_path / "root")
    backends = [sk.StateBackend(root, config=_config(tmp_path / n)) for n in "abc"]
    stores = [b.open("op", 0) for b in backends]
    for i, store in enumerate(stores):
        for key, value in changes.items():
            if value is not None:
                store.put(key, value if i < 2 else value[:-1] + b"!")  # c differs at the end
    assert stores[0].commit().version == 1
    assert stores[1].commit().version == 1  # the same order and content: accepted
    with pytest.raises(sk.CommitConflictError, match="version 1"):
        stores[2].commit()  # the same order, other content (in its last part): refused
    for store, backend in zip(stores, backends, strict=True):
        store.close()
        backend.close()
    with sk.StateBackend(root, config=_config(tmp_path / "d")) as reader:
        assert reader.versions("op", 0) == [0, 1]


def test_a_failed_commit_then_more_writes_is_a_new_attempt(tmp_path: Path) -> None:
    """A changelog that may have landed for the first try must never be taken for writes
    made after it: the retry commits under a new attempt, with every write."""
    recorder = RecordingBlobStore(open_blob_store(str(tmp_path / "root")))
    failing = _FailManifestOnce(recorder)
    backend = sk.StateBackend(failing, config=_config(tmp_path / "a"))
    with backend, backend.open("op", 0) as store:
        store.put(b"a", b"1")
        with pytest.raises(sk.StorageError, match="injected"):
            store.commit()
        store.put(b"b", b"2")
        info = store.commit()
    changelogs = [key for op, key in recorder.calls if op == "put" and "/changelog/" in key]
    assert len(set(changelogs)) == 2  # two attempts: two names
    assert info.blob == changelogs[-1]
    reader = sk.StateBackend(str(tmp_path / "root"), config=_config(tmp_path / "b"))
    with reader, reader.open("op", 0) as store:
        assert dict(store.scan()) == {b"a": b"1", b"b": b"2"}


class _FailManifestOnce(RecordingBlobStore):
    """Fails the first manifest write (after the changelog landed)."""

    def __init__(self, inner: BlobStore) -> None:
        super().__init__(inner)
        self.failed = False

    def put(
        self, key: str, data: bytes, *, overwrite: bool = False, if_match: str | None = None
    ) -> None:
        if "/manifest/" in key and not self.failed:
            self.failed = True
            raise sk.StorageError(f"injected failure writing {key}")
        super().put(key, data, overwrite=overwrite, if_match=if_match)


@pytest.mark.slow
def test_memory_of_a_commit_and_its_replay_is_bounded_by_the_part_size(tmp_path: Path) -> None:
    """64 MiB of changes in 1 MiB parts: the commit and the replay allocate a few parts
    beyond the changes themselves (before parts, the commit held three copies of them:
    the framed body, the compressed body and the blob)."""
    total = 64 * MIB
    changes = {b"k%05d" % i: os.urandom(64 * 1024) for i in range(total // (64 * 1024))}
    root = str(tmp_path / "root")
    backend = sk.StateBackend(root, config=_config(tmp_path / "a"))
    with backend, backend.open("op", 0) as store:
        for key, value in changes.items():
            store.put(key, value)
        tracemalloc.start()
        try:
            store.commit()
            _, commit_peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    fresh = sk.StateBackend(root, config=_config(tmp_path / "b", io_threads=2))
    tracemalloc.start()
    try:
        with fresh, fresh.open("op", 0) as store:
            _, replay_peak = tracemalloc.get_traced_memory()
            assert store.restore_info.changelogs_replayed == 1
    finally:
        tracemalloc.stop()
    # Python allocations only (RocksDB's write batch is native): bounded by parts, not by
    # the 64 MiB changelog.
    print(f"peaks: commit {commit_peak / MIB:.1f} MiB, replay {replay_peak / MIB:.1f} MiB")
    assert commit_peak < 12 * MIB, commit_peak
    assert replay_peak < 12 * MIB, replay_peak


def test_a_scheduled_snapshot_never_sees_a_commit_half_applied(tmp_path: Path) -> None:
    """A commit of several parts is applied a part at a time: a background snapshot
    scheduled by the commit before takes its checkpoint first, so every snapshot holds
    exactly one version."""
    root = str(tmp_path / "root")
    backend = sk.StateBackend(root, config=_config(tmp_path / "a", snapshot_every=1))
    first = {b"k%06d" % i: b"one" for i in range(100)}
    with backend, backend.open("op", 0) as store:
        for key, value in first.items():
            store.put(key, value)
        assert store.commit().snapshot_scheduled
        for key, value in _changes(3000, 1000, seed=1).items():
            if value is not None:
                store.put(key, value)
        store.commit()
    for version, want in ((1, first), (2, None)):
        fresh = sk.StateBackend(root, config=_config(tmp_path / f"v{version}"))
        with fresh, fresh.open("op", 0, version=version) as store:
            state = dict(store.scan())
            if want is not None:
                assert state == want
            else:
                assert len(state) == 3000
