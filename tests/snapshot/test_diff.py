"""The directory diff: what an incremental snapshot uploads, reuses and drops."""

from __future__ import annotations

import os
from pathlib import Path

import google_crc32c
import pytest

from statekeeper.snapshot import (
    DirDiff,
    DirIndex,
    FileBlob,
    FileIndex,
    diff_dir,
    is_immutable,
    is_skipped,
)


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def index_of(path: Path, name: str = "") -> DirIndex:
    """A DirIndex describing ``path`` exactly, as a previous snapshot of it would."""
    files, dirs = [], []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.is_dir():
            dirs.append(index_of(Path(entry.path), entry.name))
            continue
        data = Path(entry.path).read_bytes()
        files.append(
            FileIndex(
                file_name=entry.name,
                blobs=(FileBlob(blob_id=f"blob-{len(files)}", offset=0),) if data else (),
                size_in_bytes=len(data),
                mtime_ms=1,
                ctime_ms=1,
                crc=google_crc32c.value(data),
                attribs=0o644,
            )
        )
    return DirIndex(dir_name=name, files_present=tuple(files), sub_directories_present=tuple(dirs))


def names(paths: tuple[Path, ...]) -> list[str]:
    return [p.name for p in paths]


def file_names(entries: tuple[FileIndex, ...]) -> list[str]:
    return [f.file_name for f in entries]


def rocks_like(root: Path) -> Path:
    write(root / "000010.sst", b"s" * 100)
    write(root / "000011.sst", b"t" * 50)
    write(root / "000012.blob", b"b" * 30)
    write(root / "CURRENT", b"MANIFEST-000005\n")
    write(root / "MANIFEST-000005", b"manifest v1")
    write(root / "OPTIONS-000007", b"options")
    write(root / "sub" / "000001.sst", b"x" * 10)
    write(root / "sub" / "deeper" / "000002.sst", b"y" * 5)
    (root / "empty").mkdir()
    return root


def test_immutable_and_skipped_names() -> None:
    assert is_immutable("000123.sst")
    assert is_immutable("000007.blob")
    for mutable in ["CURRENT", "MANIFEST-000005", "OPTIONS-000007", "IDENTITY", "000008.log"]:
        assert not is_immutable(mutable)
    assert is_skipped("LOCK")
    assert is_skipped("LOG")
    assert is_skipped("LOG.old.1700000000")
    assert not is_skipped("CURRENT")
    assert not is_skipped("000010.sst")
    assert not is_skipped("LOGICAL.sst")


def test_first_snapshot_adds_everything_recursively(tmp_path: Path) -> None:
    root = rocks_like(tmp_path / "cp")
    write(root / "LOCK", b"")
    write(root / "LOG", b"log text")
    write(root / "LOG.old.123", b"old log")

    diff = diff_dir(root, None, trust_names=True)

    assert diff.dir_name == ""
    assert names(diff.files_added) == [
        "000010.sst",
        "000011.sst",
        "000012.blob",
        "CURRENT",
        "MANIFEST-000005",
        "OPTIONS-000007",
    ]  # LOCK and LOG* are not part of a snapshot
    assert all(p.parent == root for p in diff.files_added)
    assert [d.dir_name for d in diff.sub_dirs_added] == ["empty", "sub"]
    sub = diff.sub_dirs_added[1]
    assert names(sub.files_added) == ["000001.sst"]
    assert [d.dir_name for d in sub.sub_dirs_added] == ["deeper"]
    assert not diff.files_retained
    assert not diff.files_removed
    assert not diff.sub_dirs_retained
    total = 100 + 50 + 30 + len(b"MANIFEST-000005\n") + len(b"manifest v1") + 7 + 10 + 5
    assert diff.bytes_to_upload == total
    assert [rel for rel, _ in diff.iter_added()] == [
        "000010.sst",
        "000011.sst",
        "000012.blob",
        "CURRENT",
        "MANIFEST-000005",
        "OPTIONS-000007",
        "sub/000001.sst",
        "sub/deeper/000002.sst",
    ]


def test_incremental_diff_retains_adds_and_removes(tmp_path: Path) -> None:
    root = rocks_like(tmp_path / "cp")
    previous = index_of(root)
    # RocksDB compacts 000010 + 000011 into 000013, rewrites the manifest, and a
    # subdirectory comes and goes.
    (root / "000010.sst").unlink()
    (root / "000011.sst").unlink()
    write(root / "000013.sst", b"u" * 140)
    write(root / "MANIFEST-000005", b"manifest v2")
    write(root / "sub" / "000003.sst", b"z" * 3)
    for p in sorted((root / "sub" / "deeper").iterdir()):
        p.unlink()
    (root / "sub" / "deeper").rmdir()
    write(root / "new" / "000004.sst", b"n")
    (root / "empty").rmdir()

    diff = diff_dir(root, previous, trust_names=True)

    assert names(diff.files_added) == ["000013.sst", "CURRENT", "MANIFEST-000005", "OPTIONS-000007"]
    assert file_names(diff.files_retained) == ["000012.blob"]
    assert file_names(diff.files_removed) == ["000010.sst", "000011.sst"]
    # Mutable files are uploaded again even when unchanged; their old entries are replaced.
    assert file_names(diff.files_replaced) == ["CURRENT", "MANIFEST-000005", "OPTIONS-000007"]
    assert [d.dir_name for d in diff.sub_dirs_added] == ["new"]
    assert [d.dir_name for d in diff.sub_dirs_retained] == ["sub"]
    assert [d.dir_name for d in diff.sub_dirs_removed] == ["empty"]
    sub = diff.sub_dirs_retained[0]
    assert names(sub.files_added) == ["000003.sst"]
    assert file_names(sub.files_retained) == ["000001.sst"]
    assert [d.dir_name for d in sub.sub_dirs_removed] == ["deeper"]
    assert [f.file_name for f in diff.iter_removed()] == ["000010.sst", "000011.sst", "000002.sst"]
    assert [f.file_name for f in diff.iter_retained()] == ["000012.blob", "000001.sst"]
    assert diff.bytes_retained == 30 + 10
    mutable = len(b"MANIFEST-000005\n") + len(b"manifest v2") + len(b"options")
    assert diff.bytes_to_upload == 140 + mutable + 3 + 1


def test_unchanged_directory_uploads_only_mutable_files(tmp_path: Path) -> None:
    root = rocks_like(tmp_path / "cp")
    diff = diff_dir(root, index_of(root), trust_names=True)
    assert [rel for rel, _ in diff.iter_added()] == ["CURRENT", "MANIFEST-000005", "OPTIONS-000007"]
    assert [d.dir_name for d in diff.sub_dirs_retained] == ["empty", "sub"]
    assert not diff.sub_dirs_added
    assert not diff.sub_dirs_removed
    assert not diff.files_removed


def test_same_name_different_size_is_uploaded_again(tmp_path: Path) -> None:
    root = rocks_like(tmp_path / "cp")
    previous = index_of(root)
    write(root / "000010.sst", b"s" * 101)
    diff = diff_dir(root, previous, trust_names=True)
    assert "000010.sst" in names(diff.files_added)
    assert "000010.sst" in file_names(diff.files_replaced)
    assert "000010.sst" not in file_names(diff.files_retained)


def test_untrusted_names_need_a_matching_checksum(tmp_path: Path) -> None:
    root = rocks_like(tmp_path / "cp")
    previous = index_of(root)
    # Another database history: same file number and size, other content.
    write(root / "000010.sst", b"S" * 100)

    untrusted = diff_dir(root, previous, trust_names=False)
    assert "000010.sst" in names(untrusted.files_added)
    assert "000010.sst" in file_names(untrusted.files_replaced)
    assert file_names(untrusted.files_retained) == ["000011.sst", "000012.blob"]

    # With trusted names a same-name, same-size SST is assumed unchanged (no checksum).
    trusted = diff_dir(root, previous, trust_names=True)
    assert "000010.sst" in file_names(trusted.files_retained)


def test_file_and_directory_swapping_names(tmp_path: Path) -> None:
    root = rocks_like(tmp_path / "cp")
    previous = index_of(root)
    (root / "empty").rmdir()
    write(root / "empty", b"now a file")
    (root / "000011.sst").unlink()
    (root / "000011.sst").mkdir()
    diff = diff_dir(root, previous, trust_names=True)
    assert "empty" in names(diff.files_added)
    assert [d.dir_name for d in diff.sub_dirs_removed] == ["empty"]
    assert "000011.sst" in file_names(diff.files_removed)
    assert "000011.sst" in [d.dir_name for d in diff.sub_dirs_added]


def test_symlinks_are_refused_never_followed(tmp_path: Path) -> None:
    outside = write(tmp_path / "outside" / "secret.sst", b"secret")
    root = rocks_like(tmp_path / "cp")
    (root / "link.sst").symlink_to(outside)
    with pytest.raises(ValueError, match="symlink"):
        diff_dir(root, None, trust_names=True)
    (root / "link.sst").unlink()
    (root / "sub" / "linkdir").symlink_to(outside.parent, target_is_directory=True)
    with pytest.raises(ValueError, match="symlink"):
        diff_dir(root, None, trust_names=True)


def test_checkpoint_dir_itself_may_be_a_symlink(tmp_path: Path) -> None:
    root = rocks_like(tmp_path / "cp")
    link = tmp_path / "link"
    link.symlink_to(root, target_is_directory=True)
    assert (
        diff_dir(link, None, trust_names=True).bytes_to_upload
        == diff_dir(root, None, trust_names=True).bytes_to_upload
    )


def test_special_files_and_unsafe_local_names_are_refused(tmp_path: Path) -> None:
    root = rocks_like(tmp_path / "cp")
    os.mkfifo(root / "fifo")
    with pytest.raises(ValueError, match="special file"):
        diff_dir(root, None, trust_names=True)
    (root / "fifo").unlink()
    write(root / "back\\slash", b"x")
    with pytest.raises(ValueError, match="cannot snapshot"):
        diff_dir(root, None, trust_names=True)


def test_missing_directory_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        diff_dir(tmp_path / "nope", None, trust_names=True)


def test_dir_diff_defaults_are_empty() -> None:
    diff = DirDiff(dir_name="")
    assert diff.bytes_to_upload == 0
    assert list(diff.iter_added()) == []
