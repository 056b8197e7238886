"""verify(): every reference, every checksum; integrity checks and fallback on open."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import statekeeper as sk
from statekeeper.history import StoreHistory
from tests.blobstores import store_history


def _build(tmp_path: Path) -> sk.StateBackend:
    """Versions 1..25 with snapshots at 10 and 20 (small memtables: several SST files);
    background gc has removed changelogs 1..10."""
    config = sk.StoreConfig(
        local_dir=str(tmp_path / "w"),
        snapshot_every=10,
        write_buffer_mb=1,
        chunk_size=64 * 1024,
        retain_versions=8,  # background gc keeps snapshot 10 as the base, changelogs 11-25
    )
    backend = sk.StateBackend(str(tmp_path / "root"), config=config)
    with backend.open("op", 0) as store:
        for v in range(1, 26):
            for i in range(400):
                store.put(b"key%05d" % (v * 400 + i), b"%d" % v * 30)
            store.commit()
            backend.wait_for_snapshots()
    return backend


def _flip(path: Path, offset: int = -5) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _history(tmp_path: Path) -> StoreHistory:
    config = sk.StoreConfig(local_dir=str(tmp_path / "k"))
    return store_history(sk.StateBackend(str(tmp_path / "root"), config=config), "op", 0)


def _kinds(tmp_path: Path) -> dict[str, str]:
    root = tmp_path / "root"
    files = sorted(p for p in (root / "op/0/files").iterdir())
    history = _history(tmp_path)
    return {
        "changelog": history.changelog_key(22),
        "index": history.index_key(20),
        "file": f"op/0/files/{max(files, key=lambda p: p.stat().st_size).name}",
    }


def test_intact_root_verifies(tmp_path: Path) -> None:
    backend = _build(tmp_path)
    for deep in (False, True):
        report = backend.verify(deep=deep)
        assert report.ok, report.problems
        assert report.stores == 1
        assert report.blobs_checked > 25
    seen: list[tuple[int, int]] = []
    backend.verify(deep=True, progress=lambda done, total: seen.append((done, total)))
    assert seen
    assert seen[-1][0] >= seen[-1][1] > 0


@pytest.mark.parametrize("kind", ["changelog", "index", "file"])
def test_a_flipped_byte_in_any_blob_kind_is_found_and_named(tmp_path: Path, kind: str) -> None:
    backend = _build(tmp_path)
    key = _kinds(tmp_path)[kind]
    _flip(tmp_path / "root" / key)
    report = backend.verify(deep=True)
    assert not report.ok
    assert any(key in p.blob or key in p.message for p in report.problems), report.problems
    assert {p.kind for p in report.problems} <= {"corrupt", "missing", "unrestorable"}


@pytest.mark.parametrize("kind", ["changelog", "index", "file"])
def test_a_missing_blob_is_found_without_deep(tmp_path: Path, kind: str) -> None:
    backend = _build(tmp_path)
    assert backend.versions("op", 0)[0] == 10
    # the base snapshot: without it versions 11-19 are lost
    key = _history(tmp_path).index_key(10) if kind == "index" else _kinds(tmp_path)[kind]
    (tmp_path / "root" / key).unlink()
    report = backend.verify(deep=False)
    assert not report.ok
    assert any(key in p.blob or key in p.message for p in report.problems), report.problems


def test_truncated_changelog_is_found_without_deep(tmp_path: Path) -> None:
    backend = _build(tmp_path)
    path = tmp_path / "root" / _history(tmp_path).changelog_key(23)
    path.write_bytes(path.read_bytes()[:-10])
    problems = backend.verify(deep=False).problems
    assert [p.kind for p in problems] == ["corrupt", "unrestorable"]
    assert "versions 23-25" in problems[1].message  # what the broken changelog costs


def test_open_falls_back_to_an_older_snapshot_and_logs_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _build(tmp_path)
    _flip(tmp_path / "root" / _kinds(tmp_path)["file"])  # a file of the newest snapshot
    cold = sk.StateBackend(
        str(tmp_path / "root"), config=sk.StoreConfig(local_dir=str(tmp_path / "cold"))
    )
    with caplog.at_level(logging.WARNING), cold.open("op", 0) as store:
        assert store.version == 25
        assert (store.restore_info.base_kind, store.restore_info.base) == ("snapshot", 10)
        assert len(dict(store.scan())) == 25 * 400
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "snapshot 20" in warning
    assert "op/0" in warning


def test_corrupt_changelog_with_no_way_around_is_an_error_naming_blob_and_store(
    tmp_path: Path,
) -> None:
    _build(tmp_path)
    key = _history(tmp_path).changelog_key(23)
    _flip(tmp_path / "root" / key)
    cold = sk.StateBackend(
        str(tmp_path / "root"), config=sk.StoreConfig(local_dir=str(tmp_path / "cold"))
    )
    with pytest.raises(sk.CorruptStateError, match=key):
        cold.open("op", 0)
    with cold.open("op", 0, version=22) as store:  # what does not need it still opens
        assert store.version == 22
