"""A full disk under local_dir: a precise error, the handle released, the next open works.

What this really exercises: the working copies live on a real 8 MiB tmpfs
(:mod:`tests.small_tmpfs`), which the child fills to the last byte with a plain file. RocksDB
meets a real ``ENOSPC`` when it flushes the commit's memtable; no call is patched. The
checkpoint root is on the ordinary disk, so the changelog and manifest of the commit land: the
commit is durable, and only the local copy fails. (A file-size limit, ``RLIMIT_FSIZE``,
would give ``EFBIG`` instead of ``ENOSPC`` and miss the free-space message; a wrapper raising
``OSError`` would test nothing of RocksDB.)
"""

from __future__ import annotations

from pathlib import Path

import statekeeper as sk
from statekeeper.storage import LocalBlobStore
from tests.small_tmpfs import run_on_small_tmpfs

CHILD = r"""
import json, os, sys
sys.path.insert(0, sys.argv[3])
import statekeeper as sk
from statekeeper.storage import LocalBlobStore
from tests.small_tmpfs import fill

root, local = sys.argv[1], sys.argv[2]
config = sk.StoreConfig(
    local_dir=local, snapshot_every=10_000, write_buffer_mb=1, io_threads=2,
    local_checkpoint_interval_s=0,  # flush on every commit: the full disk shows at once
)
backend = sk.StateBackend(LocalBlobStore(root), config=config)
out = {}
with backend.open("op", 0) as store:
    store.put(b"a", b"1")
    store.commit()
store = backend.open("op", 0)
filler = os.path.join(local, "filler")
out["filled"] = fill(filler)
for i in range(64):
    store.put(b"big%02d" % i, os.urandom(16 << 10))
try:
    store.commit()
    out["commit"] = "ok"
except BaseException as exc:
    out["commit"] = [type(exc).__name__, str(exc)]
try:
    store.get(b"a")  # waits for the commit's write to the working copy
    out["next"] = "ok"
except BaseException as exc:
    out["next"] = [type(exc).__name__, str(exc)]
try:
    store.close()
    out["close"] = "ok"
except BaseException as exc:
    out["close"] = [type(exc).__name__, str(exc)]
try:
    with backend.open("op", 0) as again:
        out["reopen_full"] = again.version
except BaseException as exc:
    out["reopen_full"] = [type(exc).__name__, str(exc)]
os.unlink(filler)
try:
    with backend.open("op", 0) as again:
        out["reopen_freed"] = [again.version, again.get(b"a").decode(), len(again.get(b"big63"))]
except BaseException as exc:
    out["reopen_freed"] = [type(exc).__name__, str(exc)]
print("RESULT " + json.dumps(out), flush=True)
"""


def test_full_local_disk_says_the_commit_is_durable_and_the_next_open_works(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    out = run_on_small_tmpfs(CHILD, root, tmp_path / "local")
    assert out["filled"] == 28  # ENOSPC: the filesystem really was full

    # The commit returns once durable; its write to the working copy fails behind it, and
    # the store's next use says so.
    assert out["commit"] == "ok"
    kind, message = out["next"]  # type: ignore[misc]
    assert kind == "StateKeeperError", out["next"]
    assert "version 2 of store op/0 IS committed" in message
    assert "bytes are free" in message  # how full the disk is...
    assert "local_dir" in message  # ...and what to free, or move
    assert out["close"] == "ok"  # and the RocksDB handle was released...
    # ...so the same process can open the store again: while the disk is still full it says
    # so (never "in use by another process"), and once space is freed it catches up.
    full = out["reopen_full"]
    assert full == 2 or (isinstance(full, list) and "another process" not in full[1]), full
    assert out["reopen_freed"] == [2, "1", 16 << 10]

    # The commit really is durable: a fresh host sees version 2.
    config = sk.StoreConfig(local_dir=str(tmp_path / "fresh"), snapshot_every=10_000)
    with sk.StateBackend(LocalBlobStore(str(root)), config=config).open("op", 0) as store:
        assert store.version == 2
        assert store.get(b"a") == b"1"
