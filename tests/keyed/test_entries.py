"""Decoded reading of keyed state (iter_state), without Spark."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path

import pytest

import statekeeper as sk
from statekeeper.keyed import (
    PickleCodec,
    StateEntry,
    StatefulProcessorHandle,
    Undecoded,
    iter_state,
    jsonable,
)


def _write(store: sk.StateStore) -> None:
    handle = StatefulProcessorHandle(store, now_ms=5_000, batch_id=0, partition=0)
    total = handle.value_state("total", ttl=10)
    seen = handle.map_state("seen")
    log = handle.list_state("log")
    blob = handle.value_state("blob", codec=PickleCodec())
    handle.record_operator(["user", "day"], key_schema=None, operator="ops")
    for user in ("b", "a"):
        handle.set_key((user, dt.date(2026, 1, 2)))
        total.update(len(user) * 10)
        seen.put(2, "two")
        seen.put(1, b"\x00one")
        log.extend([user, user * 2])
    handle.set_key(("a", dt.date(2026, 1, 2)))
    blob.update(frozenset({3}))
    log.put(["x"])  # replaced: positions restart at 0, sequence numbers do not
    handle.set_key(None)


def test_iter_state_decodes_every_entry_in_key_order(tmp_path: Path) -> None:
    config = sk.StoreConfig(local_dir=str(tmp_path / "local"))
    with sk.StateBackend(str(tmp_path / "root"), config=config) as backend:
        with backend.open("ops", 0) as store:
            _write(store)
            store.commit()
        with backend.open("ops", 0) as store:
            entries = list(iter_state(store))
            only = list(iter_state(store, state="seen"))
            allowed = list(iter_state(store, state="blob", allow_pickle=True))
    a, b = ("a", dt.date(2026, 1, 2)), ("b", dt.date(2026, 1, 2))
    assert entries == [
        StateEntry(a, "blob", "value", None, Undecoded("pickle", entries[0].value.size), None),
        StateEntry(a, "log", "list", 0, "x", None),
        StateEntry(b, "log", "list", 0, "b", None),
        StateEntry(b, "log", "list", 1, "bb", None),
        StateEntry(a, "seen", "map", 1, b"\x00one", None),
        StateEntry(a, "seen", "map", 2, "two", None),
        StateEntry(b, "seen", "map", 1, b"\x00one", None),
        StateEntry(b, "seen", "map", 2, "two", None),
        StateEntry(a, "total", "value", None, 10, 15_000),
        StateEntry(b, "total", "value", None, 10, 15_000),
    ]
    assert only == [e for e in entries if e.state == "seen"]
    assert [e.value for e in allowed] == [frozenset({3})]
    assert jsonable(entries[4].value) == "AG9uZQ=="
    assert jsonable(allowed[0].value) == [3]
    assert str(entries[0].value).startswith("<pickle: ")


def test_iter_state_refuses_a_store_no_keyed_processor_wrote(tmp_path: Path) -> None:
    config = sk.StoreConfig(local_dir=str(tmp_path / "local"))
    with (
        sk.StateBackend(str(tmp_path / "root"), config=config) as backend,
        backend.open("raw", 0) as store,
    ):
        store.put(b"k", b"v")
        with pytest.raises(sk.StateKeeperError, match="holds no operator record"):
            list(iter_state(store))
        with pytest.raises(ValueError, match="state name"):
            list(iter_state(store, state=""))


def test_the_keyed_layer_does_not_import_pyspark() -> None:
    code = (
        "import sys, statekeeper.keyed, statekeeper.epochs, statekeeper.cli; "
        "print(sorted(m for m in ('pyspark', 'pandas', 'pyarrow') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "[]"
