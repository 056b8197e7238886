"""The simulation's crash of a process holding a store: what it leaves on the host's disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import rocksdict

import statekeeper as sk
from tests.sim.actors import abandon

pytestmark = pytest.mark.sim


def _on_disk(path: str, key: bytes) -> bytes | None:
    """``key`` as RocksDB finds it in the files at ``path`` (opened read-write, alone)."""
    db = rocksdict.Rdict(path, rocksdict.Options(raw_mode=True))
    try:
        value = db.get(key)
    finally:
        db.close()
    return None if value is None else bytes(value)


@pytest.mark.parametrize("flush", [True, False])
def test_a_crash_loses_the_memtables_unless_flushed(tmp_path: Path, flush: bool) -> None:
    """The working copy writes no WAL, so a crash keeps only what was flushed; the next
    open catches the lost commits up from the blob store."""
    config = sk.StoreConfig(local_dir=str(tmp_path / "local"))
    with sk.StateBackend(str(tmp_path / "root"), config=config) as backend:
        store = backend.open("op", 0, partitions=1)
        store.put(b"flushed", b"1")
        store.commit()
        store._copy.flush()  # the working copy's files now hold version 1
        store.put(b"in-memory", b"2")
        store.commit()
        path = backend.local_path("op", 0)
        abandon(store, flush=flush)
        assert not any(name.endswith(".crash") for name in os.listdir(Path(path).parent))
        assert _on_disk(path, b"flushed") == b"1"
        assert _on_disk(path, b"in-memory") == (b"2" if flush else None)
        again = backend.open("op", 0)
        assert again.version == 2
        assert again.get(b"in-memory") == b"2"
        assert again.restore_info.changelogs_replayed == (0 if flush else 1)
        again.close()
