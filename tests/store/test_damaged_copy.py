"""A damaged local working copy is set aside and rebuilt from the root; a locked one is not.

The damage is real: a byte of an SST file of the working copy is flipped on disk, as a bad
sector or a torn write would leave it, and the store is opened (and read) again.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import rocksdict

import statekeeper as sk
from statekeeper.errors import StateKeeperError
from statekeeper.storage import BlobStore, LocalBlobStore
from statekeeper.store import checked_items, set_aside_copies, set_aside_time
from statekeeper.store._local_disk import DamagedCopyError, read_failure, set_aside
from statekeeper.store._rocks import damaged_tables
from tests.blobstores import RecordingBlobStore, store_history

KEYS = 3000


def _value(i: int) -> bytes:
    # Incompressible, so the SST holds many data blocks and a flipped byte lands in one.
    return random.Random(i).randbytes(100)


def _backend(root: Path, local: Path) -> sk.StateBackend:
    config = sk.StoreConfig(local_dir=str(local), snapshot_every=10_000, io_threads=2)
    return sk.StateBackend(LocalBlobStore(str(root)), config=config)


def _committed(tmp_path: Path) -> tuple[sk.StateBackend, Path]:
    """A store with two commits whose working copy is closed (flushed to one SST)."""
    backend = _backend(tmp_path / "root", tmp_path / "local")
    with backend.open("op", 0) as store:
        for i in range(KEYS // 2):
            store.put(b"k%05d" % i, _value(i))
        store.commit()
        for i in range(KEYS // 2, KEYS):
            store.put(b"k%05d" % i, _value(i))
        store.commit()
    return backend, Path(backend.local_path("op", 0))


def _flip(sst: Path, offset: int) -> None:
    with open(sst, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


def _damaged_where_nothing_reads(tmp_path: Path) -> tuple[Path, Path]:
    """:func:`_committed`, closed, with a byte flipped in a data block of its largest SST
    that no read of the tests below touches; returns the copy's folder and that SST."""
    backend, copy = _committed(tmp_path)
    backend.close()
    sst = max(_ssts(copy), key=lambda p: p.stat().st_size)
    _flip(sst, sst.stat().st_size // 3)
    return copy, sst


def _flushing(tmp_path: Path, blobs: BlobStore | None = None, **config: Any) -> sk.StateBackend:
    """The root of :func:`_committed` with a copy flushed at every commit (L0 files pile up
    and compactions run)."""
    return sk.StateBackend(
        blobs or LocalBlobStore(str(tmp_path / "root")),
        config=sk.StoreConfig(
            local_dir=str(tmp_path / "local"), local_checkpoint_interval_s=0, **config
        ),
    )


def _ssts(copy: Path) -> list[Path]:
    found = sorted(copy.glob("*.sst"))
    assert found, f"no SST in {copy}"
    return found


def _aside(copy: Path) -> list[Path]:
    return sorted(p for p in copy.parent.iterdir() if p.name.startswith(copy.name + ".damaged"))


def _warnings(caplog: pytest.LogCaptureFixture) -> str:
    return " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_damage_met_at_open_sets_the_copy_aside_and_restores(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend, copy = _committed(tmp_path)
    for sst in _ssts(copy):
        _flip(sst, 40)  # the first data block, which holds the version label (key b"")
    with caplog.at_level(logging.WARNING), backend.open("op", 0) as store:
        assert store.version == 2
        assert store.restore_info.base_kind == "empty"
        assert store.get(b"k00007") == _value(7)
        assert len(dict(store.scan())) == KEYS
    aside = _aside(copy)
    assert len(aside) == 1, sorted(p.name for p in copy.parent.iterdir())
    assert list(aside[0].glob("*.sst")), "the damaged copy is kept for inspection"
    assert str(aside[0]) in _warnings(caplog)
    assert str(copy) in _warnings(caplog)


@pytest.mark.parametrize(
    "step", [1, 3, 10], ids=["read in order", "read in order with gaps", "read key by key"]
)
def test_damage_met_at_first_read_rebuilds_and_answers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, step: int
) -> None:
    """Whether ``multi_get`` reads the range in order (every key asked) or key by key, a
    damaged block is damage, never a key read as absent (RocksDB's iterator only becomes
    invalid at an error)."""
    backend, copy = _committed(tmp_path)
    sst = max(_ssts(copy), key=lambda p: p.stat().st_size)
    _flip(sst, sst.stat().st_size // 3)  # a data block in the middle, not the label's
    with caplog.at_level(logging.WARNING), backend.open("op", 0) as store:
        assert store.restore_info.base_kind == "local"  # the label read fine
        store.put(b"pending", b"kept")
        values = store.multi_get([b"k%05d" % i for i in range(0, KEYS, step)])
        assert values == [_value(i) for i in range(0, KEYS, step)]
        assert store.get(b"pending") == b"kept"  # uncommitted writes survive the rebuild
        store.commit()
        assert store.version == 3
    assert len(_aside(copy)) == 1
    assert "set aside" in _warnings(caplog)
    with _backend(tmp_path / "root", tmp_path / "fresh").open("op", 0) as store:
        assert store.get(b"pending") == b"kept"
        assert store.get(b"k02999") == _value(2999)


def test_damage_met_in_a_scan_resumes_after_the_last_key(tmp_path: Path) -> None:
    backend, copy = _committed(tmp_path)
    sst = max(_ssts(copy), key=lambda p: p.stat().st_size)
    _flip(sst, sst.stat().st_size // 2)
    with backend.open("op", 0) as store:
        items = list(store.scan(b"k"))
    assert items == [(b"k%05d" % i, _value(i)) for i in range(KEYS)]
    assert len(_aside(copy)) == 1


def _read_only(copy: Path) -> rocksdict.Rdict:
    return rocksdict.Rdict(
        str(copy), rocksdict.Options(raw_mode=True), access_type=rocksdict.AccessType.read_only()
    )


def test_a_whole_database_read_raises_at_damage_and_never_ends_short(tmp_path: Path) -> None:
    """What a rescale and the change feed read a whole database with (``checked_items``):
    every item under a prefix, in order; at a damaged block an error, where rocksdict's
    ``items()`` ends as if the database ended there (seen: 1,476 of 3,000 items)."""
    _, copy = _committed(tmp_path)
    db = _read_only(copy)
    assert list(checked_items(db, b"k")) == [(b"k%05d" % i, _value(i)) for i in range(KEYS)]
    assert [k for k, _ in checked_items(db, b"k0001")] == [b"k%05d" % i for i in range(10, 20)]
    assert list(checked_items(db, b"nothing here")) == []
    db.close()
    sst = max(_ssts(copy), key=lambda p: p.stat().st_size)
    _flip(sst, sst.stat().st_size // 2)
    db = _read_only(copy)
    read: list[bytes] = []
    with pytest.raises(StateKeeperError, match=r"reading the RocksDB database .* failed after"):
        read.extend(k for k, _ in checked_items(db, b"k"))
    assert 0 < len(read) < KEYS
    db.close()  # nothing the error keeps holds the database open
    assert rocksdict.Rdict(str(copy), rocksdict.Options(raw_mode=True)).close() is None


HOLDER = textwrap.dedent(
    """
    import sys, rocksdict
    db = rocksdict.Rdict(sys.argv[1], rocksdict.Options(raw_mode=True))
    print("ready", flush=True)
    sys.stdin.readline()
    db.close()
    """
)


def test_a_copy_locked_by_another_process_is_refused_and_left_alone(tmp_path: Path) -> None:
    backend, copy = _committed(tmp_path)
    with subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(copy)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as holder:  # fmt: skip
        assert holder.stdin is not None
        assert holder.stdout is not None
        try:
            assert holder.stdout.readline().strip() == "ready"
            with pytest.raises(sk.StateKeeperError, match="another process") as caught:
                backend.open("op", 0)
            assert str(copy) in str(caught.value)
            assert _aside(copy) == []
        finally:
            holder.stdin.write("\n")
            holder.stdin.flush()
            holder.wait(timeout=30)
    with backend.open("op", 0) as store:  # once released, the same copy is reused as is
        assert store.restore_info.base_kind == "local"
        assert store.get(b"k00001") == _value(1)
    assert _aside(copy) == []


_OUT_OF_FILES_CHILD = textwrap.dedent(
    """
    import os, resource, sys
    import statekeeper as sk
    from statekeeper.errors import StateKeeperError
    from statekeeper.storage import LocalBlobStore
    root, local = sys.argv[1], sys.argv[2]
    config = sk.StoreConfig(local_dir=local, snapshot_every=10_000, io_threads=2)
    with sk.StateBackend(LocalBlobStore(root), config=config) as backend:
        backend.versions("op", 0)  # threads and files of the backend, before the squeeze
        held = len(os.listdir("/proc/self/fd"))
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (held + 3, hard))
        try:
            backend.open("op", 0)
        except StateKeeperError as exc:
            print(type(exc).__name__, exc)
    """
)


def test_running_out_of_file_handles_is_not_taken_for_damage(tmp_path: Path) -> None:
    """Found by review (200 partitions per worker under ulimit -n 1024): RocksDB's "Too many
    open files" was taken for a damaged copy, which was set aside (a whole copy left behind
    per attempt, never swept) and rebuilt, failing the same way. It is now an error that
    names the limit, and the copy stays where it is."""
    backend, copy = _committed(tmp_path)
    backend.close()
    args = [str(tmp_path / "root"), str(tmp_path / "local")]
    child = subprocess.run(
        [sys.executable, "-c", _OUT_OF_FILES_CHILD, *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr
    assert child.stdout.startswith("StateKeeperError "), child.stdout + child.stderr
    assert "out of file handles" in child.stdout
    assert "ulimit -n" in child.stdout
    assert not list(copy.parent.glob("*.damaged-*"))
    with _backend(tmp_path / "root", tmp_path / "local") as again, again.open("op", 0) as store:
        assert store.version == 2
        assert len(list(store.scan())) == KEYS


def test_the_info_logs_of_a_copy_reopened_often_stay_few(tmp_path: Path) -> None:
    """Found by review: RocksDB rolls its info log at every open and kept 1,000 old ones, so
    a store that workers reopened held 27 MB of logs, more than its data."""
    backend, copy = _committed(tmp_path)
    with backend:
        for _ in range(6):
            with backend.open("op", 0) as store:
                assert store.version == 2
    assert len(list(copy.glob("LOG.old*"))) <= 2


def test_damage_met_by_a_compaction_is_rebuilt_and_the_store_goes_on(tmp_path: Path) -> None:
    """A damaged block no read touches is met by a compaction instead; RocksDB then fails
    every write of the copy. The store sets the copy aside and rebuilds it at its committed
    version, and goes on. (It once reused the copy at every open, failing the same way for
    good, with an error that blamed the disk: "cannot flush ... N bytes are free".)"""
    copy, _sst = _damaged_where_nothing_reads(tmp_path)
    with _flushing(tmp_path, snapshot_every=10_000) as flushing, flushing.open("op", 0) as store:
        assert store.restore_info.base_kind == "local"
        for n in range(200):  # each commit flushes: L0 files pile up, and a compaction runs
            store.put(b"new%05d" % n, b"v")
            store.commit()
            if _aside(copy):
                break
        assert len(_aside(copy)) == 1, "no compaction met the damaged block"
        store.put(b"after", b"rebuilt")
        store.commit()
        assert store.get(b"k02999") == _value(2999)
        assert store.get(b"new00000") == b"v"
    with _backend(tmp_path / "root", tmp_path / "fresh").open("op", 0) as store:
        assert store.get(b"after") == b"rebuilt"
        assert store.get(b"k01500") == _value(1500)


def test_damage_a_flush_meets_is_rebuilt_and_the_store_goes_on(tmp_path: Path) -> None:
    """An idle worker's flush (``StateStore.flush``) is the first to meet damage a
    compaction found: the copy is set aside and rebuilt, not left for the next open to
    reuse. (Found by review: the flush raised, its store was closed, and the next open
    reused the damaged copy as it was.)"""
    copy, _sst = _damaged_where_nothing_reads(tmp_path)
    backend = _backend(tmp_path / "root", tmp_path / "local")
    with backend, backend.open("op", 0) as store:
        assert store.restore_info.base_kind == "local"
        store.put(b"first", b"flushed")
        store.commit()
        store.flush()  # a second SST: the compaction below merges, reading every block
        store.put(b"after", b"in the memtable")
        store.commit()
        # The compaction meets the damaged block (and returns): RocksDB now fails every
        # write, first the flush of the memtable.
        store._copy._db.compact_range(None, None)
        store.flush()
        assert len(_aside(copy)) == 1
        assert store.get(b"after") == b"in the memtable"
        assert store.get(b"k01500") == _value(1500)
        store.put(b"later", b"v")
        store.commit()
    with _backend(tmp_path / "root", tmp_path / "local").open("op", 0) as store:
        assert store.restore_info.base_kind == "local"
        assert (store.get(b"later"), store.get(b"k02999")) == (b"v", _value(2999))


def test_a_snapshot_never_uploads_a_damaged_file(tmp_path: Path) -> None:
    """Damage no read met yet (a block of an SST gone bad on disk) is found before a
    snapshot uploads the file, never made the snapshot's: that lost committed state once
    GC dropped the changelogs below the snapshot (every restore from it failed with
    "block checksum mismatch", and ``verify --deep`` called the root intact). The copy is
    rebuilt from the blob store and the next snapshot is whole."""
    copy, _sst = _damaged_where_nothing_reads(tmp_path)
    expected = {b"k%05d" % i: _value(i) for i in range(KEYS)}
    states: dict[int, dict[bytes, bytes]] = {}
    with _flushing(tmp_path, snapshot_every=3) as flushing:
        with flushing.open("op", 0) as store:
            for version in range(3, 8):
                store.put(b"new%d" % version, b"v")
                expected[b"new%d" % version] = b"v"
                store.commit()
                flushing.wait_for_snapshots()
                states[version] = dict(expected)
        assert len(_aside(copy)) == 1, "the snapshot at version 3 did not find the damage"
    with sk.StateBackend(
        LocalBlobStore(str(tmp_path / "root")),
        config=sk.StoreConfig(local_dir=str(tmp_path / "l2")),
    ) as fresh:
        assert fresh.verify(deep=True).problems == []
        for version, state in states.items():
            with fresh.open("op", 0, version=version) as store:
                assert dict(store.scan()) == state, version
    with _backend(tmp_path / "root", tmp_path / "l3").open("op", 0) as store:
        assert store.restore_info.base_kind == "snapshot"  # the one at version 6, whole
        assert dict(store.scan()) == states[7]


def test_only_the_newest_copy_set_aside_is_kept(tmp_path: Path) -> None:
    """Damage that comes back (a disk going bad) once left a whole copy behind at every
    rebuild: 23 in 40 s under a retrying query, on the disk that was failing."""
    backend, copy = _committed(tmp_path)
    backend.close()
    for stamp in ("20260101T000000Z-aaaa1111", "20260102T000000Z-bbbb2222"):
        (copy.parent / f"{copy.name}.damaged-{stamp}").mkdir()
    aside = set_aside(str(copy), "a test")
    assert [str(p) for p in _aside(copy)] == [aside]
    assert set_aside_copies(str(copy)) == [aside]
    when = set_aside_time(aside)
    assert when is not None
    assert abs(when - time.time()) < 5


@pytest.mark.parametrize(
    "cause",
    [
        PermissionError(errno.EACCES, "Permission denied", "/x/op/0/CURRENT"),
        Exception(
            "IO error: While open a file for random read: /x/op/0/000008.sst: Permission denied"
        ),
    ],
    ids=["OSError", "RocksDB"],
)
def test_a_copy_the_process_may_not_read_is_not_taken_for_damage(cause: Exception) -> None:
    """Found by review (a copy left by another user): EACCES was taken for damage, and a
    good copy was renamed aside and rebuilt, which fails the same way."""
    problem = read_failure("/x/op/0", cause)
    assert not isinstance(problem, DamagedCopyError)
    assert "permission denied" in str(problem)
    assert f"uid {os.getuid()}" in str(problem)
    damaged = read_failure("/x/op/0", Exception("Corruption: block checksum mismatch"))
    assert isinstance(damaged, DamagedCopyError)


def test_verify_deep_finds_a_snapshot_file_uploaded_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Roots written before snapshots checked their files may hold an SST uploaded
    damaged, under a checksum of the damaged bytes: ``verify --deep`` called such a root
    intact while every restore from the snapshot failed."""
    _copy, sst = _damaged_where_nothing_reads(tmp_path)
    # The upload as it was before the check (this test makes the damaged root).
    monkeypatch.setattr("statekeeper.store._snapshots.damaged_tables", lambda tables: [])
    with _backend(tmp_path / "root", tmp_path / "local") as old, old.open("op", 0) as store:
        assert store.snapshot_now() is not None
    monkeypatch.undo()
    with _backend(tmp_path / "root", tmp_path / "l2") as fresh:
        assert fresh.verify(deep=False).problems == []  # only the deep check reads files
        problems = fresh.verify(deep=True).problems
        assert [(p.kind, p.store) for p in problems] == [("corrupt", "op/0")], problems
        assert sst.name in problems[0].message
        assert "cannot read it whole" in problems[0].message


class _SnapshotDuringCommit(RecordingBlobStore):
    """Holds the background snapshot's first blob call until the changelog of version
    ``at`` is written, and holds that write until the snapshot is done: the snapshot ends
    in the middle of the commit, between its start and its write to the working copy."""

    def __init__(self, inner: LocalBlobStore, at: int) -> None:
        super().__init__(inner)
        self.changelog = f"/changelog/{at:020d}-"
        self.reached = threading.Event()
        self.snapshot_done = threading.Event()

    def _record(self, op: str, key: str) -> None:
        super()._record(op, key)
        snapshot_thread = threading.current_thread().name.startswith("statekeeper-snapshot")
        if snapshot_thread and not self.reached.is_set():
            assert self.reached.wait(30), "the commit never came"
        elif op == "put" and self.changelog in key:
            self.reached.set()
            assert self.snapshot_done.wait(30), "the snapshot never ended"

    def commit_meeting_the_snapshot(
        self, backend: sk.StateBackend, store: sk.StateStore
    ) -> sk.CommitInfo:
        """Commit ``store`` while the snapshot already scheduled ends in the middle."""

        def finish() -> None:
            backend.wait_for_snapshots()
            self.snapshot_done.set()

        waiter = threading.Thread(target=finish)
        waiter.start()
        try:
            return store.commit()
        finally:
            waiter.join(30)


def test_damage_a_snapshot_finds_during_a_commit_does_not_fail_the_commit(
    tmp_path: Path,
) -> None:
    """The commit was published, then its write to the working copy raised the damage the
    snapshot had just reported: an error for a version that is committed (with local[N],
    whose tasks get one attempt, a failed query)."""
    copy, _sst = _damaged_where_nothing_reads(tmp_path)
    blobs = _SnapshotDuringCommit(LocalBlobStore(str(tmp_path / "root")), at=4)
    config = sk.StoreConfig(local_dir=str(tmp_path / "local"), snapshot_every=1)
    with sk.StateBackend(blobs, config=config) as flushing, flushing.open("op", 0) as store:
        store.put(b"a", b"3")
        assert store.commit().snapshot_scheduled  # version 3: its snapshot finds the damage
        store.put(b"a", b"4")
        assert blobs.commit_meeting_the_snapshot(flushing, store).version == 4
        assert len(_aside(copy)) == 0  # not yet: the next call rebuilds the copy
        store.put(b"a", b"5")
        assert store.commit().version == 5
        assert len(_aside(copy)) == 1
        assert store.get(b"a") == b"5"
        assert store.get(b"k02999") == _value(2999)


class _HeldSnapshot(RecordingBlobStore):
    """Holds the background snapshot's first upload (its checkpoint taken) until released."""

    def __init__(self, inner: LocalBlobStore) -> None:
        super().__init__(inner)
        self.held = threading.Event()
        self.release = threading.Event()

    def _record(self, op: str, key: str) -> None:
        super()._record(op, key)
        if op == "put" and threading.current_thread().name.startswith("statekeeper-snapshot"):
            self.held.set()
            assert self.release.wait(30), "never released"


def test_a_snapshot_of_a_copy_set_aside_leaves_no_lineage_on_the_rebuilt_copy(
    tmp_path: Path,
) -> None:
    """Found by review: a snapshot uploading while its copy was set aside and rebuilt then
    recorded its lineage beside the rebuilt copy. The next snapshot would have trusted the
    rebuilt copy's files by name and size against that snapshot's (another database's
    files, which may well share both), naming the wrong blobs: corrupt state that every
    checksum agrees with."""
    backend, copy = _committed(tmp_path)
    backend.close()
    blobs = _HeldSnapshot(LocalBlobStore(str(tmp_path / "root")))
    config = sk.StoreConfig(local_dir=str(tmp_path / "local"), snapshot_every=1)
    with sk.StateBackend(blobs, config=config) as snapshotting, snapshotting.open("op", 0) as store:
        store.put(b"a", b"3")
        assert store.commit().snapshot_scheduled
        assert blobs.held.wait(30)
        store._copy.report_damage(DamagedCopyError(str(copy), OSError("Corruption: injected")))
        assert store.get(b"a") == b"3"  # rebuilt from the root
        assert len(_aside(copy)) == 1
        blobs.release.set()
        snapshotting.wait_for_snapshots()
        assert Path(f"{copy}.lineage.json").exists()  # written late, for the old database
        assert store._copy.lineage is None  # and not taken for the rebuilt one's


class _SwapsAFileOfTheCheckpoint(RecordingBlobStore):
    """When armed, at the snapshot's read of its previous index (after the checkpoint was
    taken, before the upload), puts another table's bytes under one of the checkpoint's
    newest table's names: what a folder replaced under a live store leaves (a file of
    another database under a name the MANIFEST knows), each file passing its own checks."""

    def __init__(self, inner: LocalBlobStore, copy: str) -> None:
        super().__init__(inner)
        self.copy = copy
        self.armed = False

    def get(self, key: str) -> bytes:
        if self.armed and "/snapshot/" in key:
            self.armed = False
            (checkpoint,) = Path(f"{self.copy}.checkpoints").iterdir()
            tables = sorted(checkpoint.glob("*.sst"))
            newest, other = tables[-1], tables[0]
            newest.unlink()  # a hard link: the live copy keeps its own file
            newest.write_bytes(other.read_bytes())
        return super().get(key)


def _snapshot_versions(backend: sk.StateBackend) -> list[int]:
    manifest = store_history(backend, "op", 0).manifest
    assert manifest is not None
    return [s.version for s in manifest.snapshots]


def test_a_checkpoint_holding_another_database_s_file_is_not_uploaded(tmp_path: Path) -> None:
    """Found by review (a copy's folder replaced under a live store): the snapshot was
    uploaded and registered; every file passed its own checksum, but no restore could open
    it ("Mismatch in unique ID"), and GC then took it as the base of the versions it kept,
    deleting the changelogs that could still rebuild them. The checkpoint must open, as
    the database and version it was taken of, before it is uploaded."""
    backend, copy = _committed(tmp_path)
    backend.close()
    blobs = _SwapsAFileOfTheCheckpoint(LocalBlobStore(str(tmp_path / "root")), str(copy))
    config = sk.StoreConfig(
        local_dir=str(tmp_path / "local"), snapshot_every=10_000, local_checkpoint_interval_s=0
    )
    with sk.StateBackend(blobs, config=config) as snapshotting:
        with snapshotting.open("op", 0) as store:
            store.snapshot_now()  # version 2
            for n in range(3):  # flushed at each commit: new tables
                store.put(b"new%d" % n, b"v")
                store.commit()
            blobs.armed = True
            with pytest.raises(DamagedCopyError, match="not the database it was taken of"):
                store.snapshot_now()  # version 5
            assert _snapshot_versions(snapshotting) == [2]
            assert store.get(b"new2") == b"v"  # rebuilt from the root
            assert len(_aside(copy)) == 1
            store.snapshot_now()
        assert _snapshot_versions(snapshotting) == [2, 5]
    with _backend(tmp_path / "root", tmp_path / "fresh").open("op", 0) as fresh:
        assert fresh.restore_info.base_kind == "snapshot"
        assert fresh.restore_info.base == 5
        assert (fresh.get(b"new0"), fresh.get(b"k02999")) == (b"v", _value(2999))


def test_damage_found_in_a_multi_part_commit_does_not_fail_it(tmp_path: Path) -> None:
    """The same meeting, in a commit of several changelog parts, whose write to the copy
    is not behind it: it raised the damage as a failure of the committed version."""
    copy, _sst = _damaged_where_nothing_reads(tmp_path)
    blobs = _SnapshotDuringCommit(LocalBlobStore(str(tmp_path / "root")), at=4)
    config = sk.StoreConfig(
        local_dir=str(tmp_path / "local"), snapshot_every=1, changelog_part_bytes=64
    )
    with sk.StateBackend(blobs, config=config) as flushing, flushing.open("op", 0) as store:
        store.put(b"a", b"3")
        assert store.commit().snapshot_scheduled
        for n in range(20):
            store.put(b"b%02d" % n, b"4" * 10)  # more than one part
        assert blobs.commit_meeting_the_snapshot(flushing, store).version == 4
        assert store.get(b"b19") == b"4" * 10  # the next call rebuilt the copy
        assert len(_aside(copy)) == 1


class _SnapshotAfterClose(RecordingBlobStore):
    """Holds the background snapshot's first blob call until ``closed`` is set."""

    def __init__(self, inner: LocalBlobStore) -> None:
        super().__init__(inner)
        self.closed = threading.Event()

    def _record(self, op: str, key: str) -> None:
        super()._record(op, key)
        if threading.current_thread().name.startswith("statekeeper-snapshot"):
            assert self.closed.wait(30), "the store was never closed"


def test_damage_a_snapshot_finds_after_its_store_closed_sets_the_copy_aside(
    tmp_path: Path,
) -> None:
    """A handover closes the store, then waits for its snapshot: damage the snapshot found
    then was noted on a closed copy and dropped, and the next holder reopened it."""
    copy, _sst = _damaged_where_nothing_reads(tmp_path)
    blobs = _SnapshotAfterClose(LocalBlobStore(str(tmp_path / "root")))
    config = sk.StoreConfig(local_dir=str(tmp_path / "local"), snapshot_every=1)
    with sk.StateBackend(blobs, config=config) as backend:
        store = backend.open("op", 0)
        store.put(b"a", b"3")
        assert store.commit().snapshot_scheduled
        store.close()
        blobs.closed.set()
        backend.wait_for_snapshots()
        assert len(_aside(copy)) == 1
        with backend.open("op", 0) as again:
            assert again.restore_info.base_kind != "local"  # rebuilt, not the damaged copy
            assert again.get(b"a") == b"3"


def test_an_sst_file_writer_file_is_checked_and_not_taken_for_damage(tmp_path: Path) -> None:
    """A rescale ingests SstFileWriter files, which name no column family: RocksDB's
    repairer refuses them whole, and verify --deep called every merged store unrestorable."""
    table = tmp_path / "files" / "000123.sst"
    table.parent.mkdir()
    writer = rocksdict.SstFileWriter(rocksdict.Options(raw_mode=True))
    writer.open(str(table))
    for i in range(KEYS):
        writer[b"k%05d" % i] = _value(i)
    writer.finish()
    assert damaged_tables([table]) == []
    _flip(table, table.stat().st_size // 3)
    assert damaged_tables([table]) == [table.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["files"]  # no scratch left


def test_files_deleted_under_a_live_copy_are_rebuilt_and_snapshots_go_on(tmp_path: Path) -> None:
    """Found this session: an age-based cleaner of temporary files (systemd-tmpfiles on
    ``/tmp``, Spark's default local dir) deletes the files of a long-lived copy while its
    store is open. RocksDB reads on through its open handles, but every checkpoint fails
    (it hard-links the files): the snapshot was skipped, with an INFO line, at every
    interval from then on, and the changelog chain grew without end. The copy is now taken
    for damaged and rebuilt, and the next snapshot is taken."""
    backend, copy = _committed(tmp_path)
    backend.close()
    config = sk.StoreConfig(local_dir=str(tmp_path / "local"), snapshot_every=10_000)
    backend = sk.StateBackend(LocalBlobStore(str(tmp_path / "root")), config=config)
    with backend, backend.open("op", 0) as store:
        assert store.restore_info.base_kind == "local"
        for path in copy.iterdir():
            if path.is_file():
                path.unlink()
        store.put(b"new", b"v")
        store.commit()  # version 3
        store.snapshot_now()  # skipped: the checkpoint cannot link the deleted files
        assert _snapshot_versions(backend) == []
        assert store.get(b"new") == b"v"  # rebuilt from the root
        assert len(_aside(copy)) == 1
        assert (copy / "CURRENT").exists()
        store.snapshot_now()
        assert _snapshot_versions(backend) == [3]
    with _backend(tmp_path / "root", tmp_path / "fresh").open("op", 0) as fresh:
        assert (fresh.restore_info.base_kind, fresh.restore_info.base) == ("snapshot", 3)
        assert (fresh.get(b"new"), fresh.get(b"k02999")) == (b"v", _value(2999))


def test_a_copy_folder_deleted_under_a_live_store_is_rebuilt_by_its_flush(tmp_path: Path) -> None:
    """The whole folder deleted: the idle flush (``StateStore.flush``) rebuilds the copy
    instead of failing (before, it raised a disk error and left the rebuild to a reopen)."""
    backend = _backend(tmp_path / "root", tmp_path / "local")
    with backend, backend.open("op", 0) as store:
        store.put(b"a", b"1")
        store.commit()
        copy = Path(backend.local_path("op", 0))
        shutil.rmtree(copy)
        store.put(b"b", b"2")
        store.commit()
        store.flush()
        assert (copy / "CURRENT").exists()
        assert (store.get(b"a"), store.get(b"b")) == (b"1", b"2")
    with _backend(tmp_path / "root", tmp_path / "local").open("op", 0) as store:
        assert store.restore_info.base_kind == "local"
        assert (store.get(b"a"), store.get(b"b")) == (b"1", b"2")
