"""Resuming a snapshot upload that was cut off (the upload journal), against a real
LocalBlobStore and real files."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import statekeeper as sk
from statekeeper import layout
from statekeeper.errors import StorageError
from statekeeper.gc import MIN_ORPHAN_TTL_S, resumable_age_s
from statekeeper.snapshot import ResumePolicy, SnapshotIndex, iter_files
from statekeeper.snapshot._resume import UploadJournal
from tests.snapshot.test_transfer import (
    OP,
    PART,
    CountingStore,
    expected_tree,
    restore,
    store,  # noqa: F401 - the fixture
    tree,
    upload,
    write,
)

CHUNK = 1024
FILE_CHUNKS = 4


def sst_tree(root: Path) -> Path:
    """Six immutable files of four chunks each, two below a subdirectory, and the mutable
    files RocksDB rewrites."""
    for n in range(1, 5):
        write(root / f"00000{n}.sst", os.urandom(CHUNK * FILE_CHUNKS))
    for n in range(5, 7):
        write(root / "sub" / f"00000{n}.sst", os.urandom(CHUNK * FILE_CHUNKS))
    write(root / "CURRENT", b"MANIFEST-000009\n")
    write(root / "MANIFEST-000009", os.urandom(300))
    return root


def policy(tmp: Path, max_age_s: float = 3600.0) -> ResumePolicy:
    return ResumePolicy(tmp / "copy.uploads.jsonl", max_age_s, time.time)


def cut_off_after(counting: CountingStore, puts: int) -> None:
    """Fail every put after the first ``puts`` (a worker killed mid-upload, as far as the
    blob store can tell)."""

    def fail(key: str) -> None:
        if len(counting.puts) > puts:
            raise StorageError(f"cut off at {key}")

    counting.before_put = fail


def cut_upload(counting: CountingStore, src: Path, tmp: Path, puts: int) -> dict[str, list[str]]:
    """An upload of ``src`` cut off after ``puts`` chunks; returns the journal's files and
    their blob ids."""
    cut_off_after(counting, puts)
    with pytest.raises(StorageError, match="cut off"):
        upload(counting, src, 1, chunk_size=CHUNK, io_threads=1, resume=policy(tmp))
    counting.before_put = None
    counting.puts.clear()
    lines = policy(tmp).journal.read_text().splitlines()
    return {(d := json.loads(line))["rel"]: [b for b, _ in d["blobs"]] for line in lines}


def chunk_puts(counting: CountingStore) -> list[str]:
    return [k for k in counting.puts if k.startswith(layout.files_prefix(OP, PART))]


def restores_exactly(
    counting: CountingStore, index: SnapshotIndex, src: Path, target: Path
) -> None:
    restore(counting, index, target)
    assert tree(target) == expected_tree(src)


def test_an_upload_cut_off_half_way_is_resumed_not_started_over(
    store: CountingStore,  # noqa: F811
    tmp_path: Path,
) -> None:
    src = sst_tree(tmp_path / "src")
    journal = cut_upload(store, src, tmp_path, puts=3 * FILE_CHUNKS + 2)
    # The files whose every chunk was written, and only those; never a mutable file.
    assert sorted(journal) == ["000001.sst", "000002.sst", "000003.sst"]
    index, metrics = upload(store, src, 1, chunk_size=CHUNK, io_threads=1, resume=policy(tmp_path))
    assert (metrics.files_resumed, metrics.bytes_resumed) == (3, 3 * CHUNK * FILE_CHUNKS)
    assert metrics.files_uploaded == 5  # three .sst files and the two mutable ones
    # Nothing resumed was written again; the index names the first upload's blobs.
    resumed_ids = {b for ids in journal.values() for b in ids}
    assert not {k.rsplit("/", 1)[-1] for k in chunk_puts(store)} & resumed_ids
    files = dict(iter_files(index.dir_index))
    assert [b.blob_id for b in files["000002.sst"].blobs] == journal["000002.sst"]
    assert not policy(tmp_path).journal.exists()  # emptied before the index was written
    restores_exactly(store, index, src, tmp_path / "dst")


def test_a_blob_gone_or_too_old_to_name_is_uploaded_again(
    store: CountingStore,  # noqa: F811
    tmp_path: Path,
) -> None:
    src = sst_tree(tmp_path / "src")
    journal = cut_upload(store, src, tmp_path, puts=5 * FILE_CHUNKS)
    assert len(journal) >= 4
    store.inner.delete_many([layout.file_blob_key(OP, PART, journal["000001.sst"][2])])
    old = time.time() - 3601  # past the policy's hour
    os.utime(store.blob_path(journal["000002.sst"][0]), (old, old))
    # a blob that is not what the journal says (truncated): never named
    truncated = store.blob_path(journal["000003.sst"][3])
    truncated.write_bytes(truncated.read_bytes()[:10])
    index, metrics = upload(store, src, 1, chunk_size=CHUNK, io_threads=1, resume=policy(tmp_path))
    assert metrics.files_resumed == len(journal) - 3
    again = {k.rsplit("/", 1)[-1] for k in chunk_puts(store)}
    files = dict(iter_files(index.dir_index))
    for rel in ("000001.sst", "000002.sst", "000003.sst"):
        assert {b.blob_id for b in files[rel].blobs} <= again
    restores_exactly(store, index, src, tmp_path / "dst")


def test_a_file_changed_under_its_name_or_a_torn_line_is_not_taken(
    store: CountingStore,  # noqa: F811
    tmp_path: Path,
) -> None:
    src = sst_tree(tmp_path / "src")
    journal = cut_upload(store, src, tmp_path, puts=3 * FILE_CHUNKS)
    assert sorted(journal) == ["000001.sst", "000002.sst", "000003.sst"]
    # Same name, size, inode and mtime, other bytes: only the checksum tells.
    changed = src / "000002.sst"
    before = changed.stat()
    with open(changed, "r+b") as fh:
        fh.write(b"\xff" * 16)
    os.utime(changed, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (changed.stat().st_ino, changed.stat().st_mtime_ns) == (
        before.st_ino,
        before.st_mtime_ns,
    )
    # A line cut short by a kill, and one naming a file that is not there.
    with open(policy(tmp_path).journal, "a") as fh:
        fh.write('{"rel":"000009.sst","size":4096,"ino":1,"mtimeNs":1,"crc":1,"blobs":[["ab"\n')
        fh.write('{"rel":"000004.sst","size":1,"ino":1,"mtimeNs":1,"crc":1,"blobs":[["ab",0]]}')
    index, metrics = upload(store, src, 1, chunk_size=CHUNK, io_threads=1, resume=policy(tmp_path))
    assert metrics.files_resumed == 2
    files = dict(iter_files(index.dir_index))
    changed_ids = [b.blob_id for b in files["000002.sst"].blobs]
    assert not set(changed_ids) & set(journal["000002.sst"])  # uploaded again, none reused
    assert [b.blob_id for b in files["000001.sst"].blobs] == journal["000001.sst"]
    restores_exactly(store, index, src, tmp_path / "dst")


def test_a_full_upload_after_reused_blobs_were_swept_takes_what_it_just_uploaded(
    store: CountingStore,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The diff against the previous snapshot found its blobs swept meanwhile: the snapshot
    is uploaded in full, but what the incremental pass uploaded is not uploaded twice."""
    src = sst_tree(tmp_path / "src")
    first, _ = upload(store, src, 1, chunk_size=CHUNK, io_threads=1)
    write(src / "000007.sst", os.urandom(CHUNK * FILE_CHUNKS))
    write(src / "000008.sst", os.urandom(CHUNK * FILE_CHUNKS))
    swept = dict(iter_files(first.dir_index))["000001.sst"].blobs[0]
    store.inner.delete_many([layout.file_blob_key(OP, PART, swept.blob_id)])
    store.puts.clear()
    index, metrics = upload(
        store, src, 2, first, chunk_size=CHUNK, io_threads=1, resume=policy(tmp_path)
    )
    assert index.prev_snapshot_index_blob_id is None  # a full upload
    assert metrics.files_resumed == 2  # the two new files, uploaded by the incremental pass
    # each immutable file once; the two mutable ones (never journaled) in each pass
    assert len(chunk_puts(store)) == (2 + 6) * FILE_CHUNKS + 2 * 2
    restores_exactly(store, index, src, tmp_path / "dst")


def test_resuming_is_off_at_the_least_grace(store: CountingStore, tmp_path: Path) -> None:  # noqa: F811
    """At ``orphan_ttl_s`` of ``MIN_ORPHAN_TTL_S`` or less a blob nothing names has no grace
    to spare: no journal is kept, and nothing is resumed."""
    assert resumable_age_s(sk.StoreConfig(orphan_ttl_s=0)) == 0
    assert resumable_age_s(sk.StoreConfig(orphan_ttl_s=MIN_ORPHAN_TTL_S)) == 0
    assert resumable_age_s(sk.StoreConfig()) == 7 * 86400 - MIN_ORPHAN_TTL_S
    src = sst_tree(tmp_path / "src")
    cut_off_after(store, 3 * FILE_CHUNKS)
    with pytest.raises(StorageError):
        upload(store, src, 1, chunk_size=CHUNK, io_threads=1, resume=policy(tmp_path, 0.0))
    assert not policy(tmp_path).journal.exists()


def test_one_upload_at_a_time_owns_a_copys_journal(tmp_path: Path) -> None:
    path = tmp_path / "copy.uploads.jsonl"
    with UploadJournal.take(path) as first:
        assert first is not None
        with UploadJournal.take(tmp_path / "." / "copy.uploads.jsonl") as second:
            assert second is None
        with UploadJournal.take(tmp_path / "other.uploads.jsonl") as other:
            assert other is not None
    with UploadJournal.take(path) as again:
        assert again is not None
