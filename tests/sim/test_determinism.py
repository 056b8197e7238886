"""What keeps a run a function of its seed below the blob store (tests/sim/determinism.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import statekeeper as sk
from tests.sim.actors import OP, PARTITION, store_config
from tests.sim.determinism import deterministic_rocksdb, settle
from tests.sim.scenarios import SCENARIOS

pytestmark = pytest.mark.sim


def test_working_copies_compact_only_when_settled(tmp_path: Path) -> None:
    """RocksDB never compacts a sim's working copy on its own thread (a race with the next
    checkpoint: a snapshot of one file or of five); :func:`settle` compacts it instead."""
    config = store_config(SCENARIOS["gc_vs_snapshots"], tmp_path / "host", "changelog")
    with (
        deterministic_rocksdb(),
        sk.StateBackend(str(tmp_path / "root"), config=config) as backend,
        backend.open(OP, PARTITION) as store,
    ):
        for n in range(6):  # each snapshot's checkpoint flushes one level-0 file
            store.put(b"k%d" % n, b"v")
            store.commit()
            backend.snapshot(OP, PARTITION)
        db = store._copy._db  # the one private name settle() uses too
        assert db.property_int_value("rocksdb.num-files-at-level0") == 6
        assert db.property_int_value("rocksdb.compaction-pending") == 0
        assert db.property_int_value("rocksdb.num-running-compactions") == 0
        settle(store)
        assert db.property_int_value("rocksdb.num-files-at-level0") == 0
        assert dict(store.scan()) == {b"k%d" % n: b"v" for n in range(6)}
