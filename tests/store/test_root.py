"""Root metadata: key groups of new operators, recorded retention, partition counts in use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import statekeeper as sk
from statekeeper import layout
from statekeeper.storage import LocalBlobStore


def _backend(tmp_path: Path, **config: object) -> sk.StateBackend:
    options = sk.StoreConfig(local_dir=str(tmp_path / "local"), **config)  # type: ignore[arg-type]
    return sk.StateBackend(str(tmp_path / "root"), config=options)


def _root_doc(tmp_path: Path) -> dict[str, object]:
    doc = json.loads((tmp_path / "root" / layout.ROOT_METADATA).read_text())
    assert isinstance(doc, dict)
    return doc


def test_a_new_operator_gets_4096_key_groups_recorded_in_the_root(tmp_path: Path) -> None:
    with _backend(tmp_path) as backend:
        backend.register("sessions", 8)
        meta = backend.root_metadata()
    assert meta is not None
    assert meta.key_groups == {"sessions": 4096}
    operators = _root_doc(tmp_path)["operators"]
    assert isinstance(operators, dict)
    assert operators["sessions"]["keyGroups"] == 4096


def test_an_operator_of_a_0_1_root_stays_without_key_groups(tmp_path: Path) -> None:
    """Its keys carry no key group: recording some later would misread every key."""
    with _backend(tmp_path) as backend:
        backend.register("old", 2)
    doc = _root_doc(tmp_path)
    del doc["crc32c"]
    doc["formatVersion"] = 1
    del doc["operators"]["old"]["keyGroups"]  # type: ignore[index]
    (tmp_path / "root" / layout.ROOT_METADATA).write_text(json.dumps(doc))
    with _backend(tmp_path) as backend:
        backend.register("old", 2)
        backend.start_generation("old")
        backend.register("new", 2)
        meta = backend.root_metadata()
    assert meta is not None
    assert meta.key_groups == {"new": 4096}
    assert meta.format_version == 2


def test_more_partitions_than_key_groups_are_refused(tmp_path: Path) -> None:
    with _backend(tmp_path) as backend:
        with pytest.raises(sk.ConfigMismatchError, match="4096 key groups, so at most 4096"):
            backend.register("wide", 4097)
        assert backend.operators() == {}


def test_a_run_records_its_retention_as_the_roots_default(tmp_path: Path) -> None:
    with _backend(tmp_path, retain_versions=7, orphan_ttl_s=1800.0) as backend:
        assert backend.root_metadata() is None
        backend.start_generation("sessions")
        meta = backend.root_metadata()
    assert meta is not None
    assert meta.retention == sk.Retention(7, 1800.0)
    assert _root_doc(tmp_path)["retention"] == {"retainVersions": 7, "orphanTtlS": 1800.0}
    # A root with retention recorded reads back through a fresh registry, checksum included.
    with sk.StateBackend(LocalBlobStore(str(tmp_path / "root"))) as fresh:
        again = fresh.root_metadata()
    assert again == meta


def test_a_partition_count_below_a_partition_in_use_is_refused(tmp_path: Path) -> None:
    """Partition 7 committed while the count was unset; ``partitions=2`` would orphan it."""
    with _backend(tmp_path) as backend:
        with backend.open("sessions", 7) as store:
            store.put(b"k", b"v")
            store.commit()
        with pytest.raises(sk.ConfigMismatchError, match=r"partitions \[7\] already hold"):
            backend.open("sessions", 0, partitions=2)
        assert backend.operators() == {"sessions": None}
        with backend.open("sessions", 7, partitions=8) as store:
            assert store.get(b"k") == b"v"
        assert backend.operators() == {"sessions": 8}


def test_a_deleted_root_metadata_is_refused_not_started_afresh(tmp_path: Path) -> None:
    """Starting afresh would mint a new root id and make every store's manifests foreign."""
    with _backend(tmp_path) as backend:
        with backend.open("sessions", 0, partitions=1) as store:
            store.put(b"k", b"v")
            store.commit()
        root_id = backend.root_metadata().root_id  # type: ignore[union-attr]
    saved = (tmp_path / "root" / layout.ROOT_METADATA).read_bytes()
    (tmp_path / "root" / layout.ROOT_METADATA).unlink()
    with _backend(tmp_path) as backend:
        report = backend.verify(deep=False)
        assert [(p.blob, p.kind) for p in report.problems] == [(layout.ROOT_METADATA, "missing")]
        assert root_id in report.problems[0].message
        with pytest.raises(sk.CorruptStateError, match=rf"_statekeeper.json is missing.*{root_id}"):
            backend.open("sessions", 0)
    assert not (tmp_path / "root" / layout.ROOT_METADATA).exists()  # nothing was written
    (tmp_path / "root" / layout.ROOT_METADATA).write_bytes(saved)  # the remedy it names
    with _backend(tmp_path) as backend, backend.open("sessions", 0) as store:
        assert store.get(b"k") == b"v"


def test_root_metadata_of_another_root_is_named_as_the_likely_culprit(tmp_path: Path) -> None:
    with _backend(tmp_path) as backend, backend.open("sessions", 0, partitions=1) as store:
        store.put(b"k", b"v")
        store.commit()
    other = tmp_path / "other"
    with sk.StateBackend(str(other), config=sk.StoreConfig(local_dir=str(tmp_path / "o"))) as b:
        b.register("sessions", 1)
    (tmp_path / "root" / layout.ROOT_METADATA).write_bytes(
        (other / layout.ROOT_METADATA).read_bytes()
    )
    backend = _backend(tmp_path)
    with backend, pytest.raises(sk.CorruptStateError, match=r"_statekeeper\.json was replaced"):
        backend.open("sessions", 0)


def test_reading_a_store_the_root_lacks_neither_registers_it_nor_pretends_it_exists(
    tmp_path: Path,
) -> None:
    """``open`` creates stores; ``snapshot``, ``export`` and ``versions`` only read one. A
    misspelt operator once got registered, with a snapshot of an empty store uploaded."""
    with _backend(tmp_path) as backend:
        with backend.open("ops", 0, partitions=2) as store:
            store.put(b"k", b"v")
            store.commit()
        with pytest.raises(sk.StateNotFoundError, match=r"operator 'nope' is not in .*: ops"):
            backend.snapshot("nope", 0)
        with pytest.raises(sk.StateNotFoundError, match="operator 'nope' is not in"):
            backend.export("nope", 0, tmp_path / "out")
        assert backend.versions("nope", 0) == []
        for call in (backend.versions, backend.snapshot):
            with pytest.raises(sk.ConfigMismatchError, match="operator 'ops' has 2 partitions"):
                call("ops", 9)
        with pytest.raises(sk.ConfigMismatchError, match="operator 'ops' has 2 partitions"):
            backend.export("ops", 2, tmp_path / "out")
        assert backend.operators() == {"ops": 2}
        assert backend.versions("ops", 1) == [0]
        with pytest.raises(TypeError, match="progress must be callable or None, got int"):
            backend.verify(progress=5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="progress must be callable or None, got int"):
            backend.export("ops", 0, tmp_path / "out", progress=5)  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == [layout.ROOT_METADATA, "ops"]


def test_a_closed_backend_refuses_new_work_and_its_open_stores_still_commit(
    tmp_path: Path,
) -> None:
    backend = _backend(tmp_path, snapshot_every=1)
    backend.register("ops", 1)
    store = backend.open("ops", 0)
    backend.close()
    backend.close()  # idempotent
    calls = {
        "open": lambda: backend.open("ops", 0),
        "register": lambda: backend.register("ops", 1),
        "start_generation": lambda: backend.start_generation("ops"),
        "operators": backend.operators,
        "root_metadata": backend.root_metadata,
        "versions": lambda: backend.versions("ops", 0),
        "snapshot": lambda: backend.snapshot("ops", 0),
        "export": lambda: backend.export("ops", 0, tmp_path / "out"),
        "gc": backend.gc,
        "verify": backend.verify,
    }
    for call in calls.values():
        with pytest.raises(sk.StateKeeperError, match=r"is closed: .* new StateBackend"):
            call()
    store.put(b"k", b"v")
    assert store.commit().version == 1
    store.close()
    with _backend(tmp_path) as again:
        assert again.versions("ops", 0) == [0, 1]
