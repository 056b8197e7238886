"""What only the local backend promises: hidden temp files, atomic visibility, a fenced root."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import statekeeper.storage
from statekeeper.errors import CommitConflictError, StateNotFoundError, StorageError
from statekeeper.storage import LocalBlobStore

SRC = Path(statekeeper.storage.__file__).resolve().parents[2]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


@pytest.fixture
def store(root: Path) -> LocalBlobStore:
    return LocalBlobStore(root)


def test_blob_is_a_plain_file_under_the_root(store: LocalBlobStore, root: Path) -> None:
    store.put("op/0/changelog/1.changelog", b"bytes")
    assert (root / "op" / "0" / "changelog" / "1.changelog").read_bytes() == b"bytes"
    assert store.uri == root.as_uri()


def test_temp_and_lock_files_are_hidden_and_cleaned(store: LocalBlobStore, root: Path) -> None:
    store.put("d/k", b"1")
    store.put("d/k", b"2", overwrite=True)
    etag = store.head("d/k").etag
    assert etag
    store.put("d/k", b"3", if_match=etag)
    (root / "d" / ".tmp-0123456789abcdef").write_bytes(b"left by a crashed writer")
    assert [m.key for m in store.list()] == ["d/k"]
    leftovers = sorted(os.listdir(root / "d"))
    # Only our own files: the blob, the planted temp file, the folder's lock file.
    assert leftovers == [".statekeeper.lock", ".tmp-0123456789abcdef", "k"]


def test_failed_write_leaves_no_partial_blob(store: LocalBlobStore, root: Path) -> None:
    # A real failing write: a child process whose file size limit is 4 KiB writes 1 MiB.
    script = textwrap.dedent(
        """
        import resource, signal, sys
        from statekeeper.errors import StorageError
        from statekeeper.storage import LocalBlobStore

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        store = LocalBlobStore(sys.argv[1])
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            store.put("big/blob", b"x" * (1 << 20))
        except StorageError as exc:
            print(type(exc.__cause__).__name__, exc)
            sys.exit(0)
        sys.exit(3)
        """
    )
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-c", script, str(root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "big/blob" in done.stdout
    assert store.list() == []
    with pytest.raises(StateNotFoundError):
        store.get("big/blob")
    assert os.listdir(root / "big") == []  # the temp file was removed too


def test_readers_never_see_a_partial_blob(store: LocalBlobStore) -> None:
    versions = (b"a" * (4 << 20), b"b" * (4 << 20))
    store.put("big", versions[0])
    done = threading.Event()
    failed: list[BaseException] = []

    def writer() -> None:
        try:
            for i in range(20):
                store.put("big", versions[(i + 1) % 2], overwrite=True)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            failed.append(exc)
        finally:
            done.set()  # a failed put must not leave the reader spinning

    thread = threading.Thread(target=writer)
    thread.start()
    deadline = time.monotonic() + 120
    reads = 0
    while not done.is_set() or reads == 0:
        assert store.get("big") in versions
        reads += 1
        assert time.monotonic() < deadline, "the writer never finished"
    thread.join()
    assert failed == []
    assert store.get("big") == versions[0]  # 20 overwrites, alternating, end where they began


@pytest.mark.parametrize("key", ["../escape", "a/../../escape", "/etc/passwd", "a/../b"])
def test_path_traversal_is_refused(store: LocalBlobStore, tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError, match="blob key"):
        store.put(key, b"x")
    assert not (tmp_path / "escape").exists()
    assert sorted(os.listdir(tmp_path)) == ["root"]


def test_symlink_out_of_the_root_is_refused(
    store: LocalBlobStore, root: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"not yours")
    os.symlink(outside, root / "link")
    with pytest.raises(ValueError, match="outside the root"):
        store.get("link/secret")
    with pytest.raises(ValueError, match="outside the root"):
        store.put("link/new", b"x")
    assert sorted(os.listdir(outside)) == ["secret"]
    assert store.list() == []


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """Make ``folder`` refuse new entries, also for root (who ignores mode bits)."""
    if os.geteuid() != 0:
        folder.chmod(0o500)
        try:
            yield
        finally:
            folder.chmod(0o700)
        return
    # root: the immutable attribute (ext4, xfs, btrfs) is honoured even for root.
    if shutil.which("chattr") is None:
        pytest.skip("running as root without chattr: cannot deny a write")
    made = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"running as root and chattr +i failed: {made.stderr!r}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_permission_denied_is_a_storage_error(store: LocalBlobStore, root: Path) -> None:
    store.put("p/k", b"1")
    with read_only(root / "p"), pytest.raises(StorageError, match="p/new") as info:
        store.put("p/new", b"2")
    assert isinstance(info.value.__cause__, PermissionError)
    assert store.list() == [store.head("p/k")]


def test_os_errors_become_storage_errors(store: LocalBlobStore) -> None:
    store.put("a", b"a blob where a folder is needed")
    with pytest.raises(StorageError, match="'a/b'") as info:
        store.put("a/b", b"x")
    assert not isinstance(info.value, CommitConflictError)
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(StateNotFoundError):
        store.get("a/b")


def test_a_folder_is_not_a_blob(store: LocalBlobStore, root: Path) -> None:
    store.put("dir/x", b"x")
    with pytest.raises(StateNotFoundError, match=f"'dir'.*{root}"):
        store.get("dir")
    with pytest.raises(StateNotFoundError):
        store.head("dir")
    with pytest.raises(StorageError, match="folder"):
        store.put("dir", b"x")
    store.delete_many(["dir"])  # a folder is no blob: nothing to delete
    assert store.get("dir/x") == b"x"


def test_root_is_created_and_a_file_root_refused(tmp_path: Path) -> None:
    LocalBlobStore(tmp_path / "new" / "deeper")
    assert (tmp_path / "new" / "deeper").is_dir()
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StorageError, match="not a folder"):
        LocalBlobStore(tmp_path / "file")


def test_same_size_rewrites_get_distinct_etags(store: LocalBlobStore) -> None:
    etags = []
    for data in (b"one", b"two", b"one", b"two"):
        store.put("e/k", data, overwrite=True)
        etags.append(store.head("e/k").etag)
    assert len(set(etags)) == len(etags)
    with pytest.raises(CommitConflictError, match="expected etag"):
        store.put("e/k", b"new", if_match=etags[0])
