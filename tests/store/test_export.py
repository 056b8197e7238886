"""StateBackend.export and StateBackend.root_metadata: library work the command line uses."""

from __future__ import annotations

from pathlib import Path

import pytest
import rocksdict

import statekeeper as sk


def _backend(tmp_path: Path, local: str = "local") -> sk.StateBackend:
    return sk.StateBackend(
        str(tmp_path / "root"), config=sk.StoreConfig(local_dir=str(tmp_path / local))
    )


def _opened(path: Path) -> dict[bytes, bytes]:
    db = rocksdict.Rdict(str(path), rocksdict.Options(raw_mode=True))
    try:
        return dict(db.items())
    finally:
        db.close()


def _build(backend: sk.StateBackend) -> list[dict[bytes, bytes]]:
    states: list[dict[bytes, bytes]] = [{}]
    for v in range(1, 5):
        with backend.open("ops", 0, partitions=2) as store:
            store.put(f"k{v}".encode(), f"v{v}".encode())
            if v == 3:
                store.delete(b"k1")
            store.commit()
            states.append(dict(store.scan()))
    return states


def test_export_writes_exactly_a_version_and_leaves_no_staging(tmp_path: Path) -> None:
    with _backend(tmp_path) as backend:
        states = _build(backend)
        progress: list[int] = []
        info = backend.export(
            "ops", 0, tmp_path / "out" / "v2", version=2, progress=progress.append
        )
        latest = backend.export("ops", 0, tmp_path / "out" / "latest")
        # The backend (and its blob store) still work after exports.
        assert backend.versions("ops", 0) == [0, 1, 2, 3, 4]
    assert _opened(tmp_path / "out" / "v2") == states[2]
    assert (info.version, info.keys, sum(progress)) == (2, 2, 2)
    assert info.bytes == sum(len(k) + len(v) for k, v in states[2].items())
    assert info.restore.changelogs_replayed == 2
    assert latest.version == 4
    assert _opened(tmp_path / "out" / "latest") == states[4]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["latest", "v2"]


def test_export_refuses_a_non_empty_target_and_leaves_it_alone(tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with _backend(tmp_path) as backend:
        _build(backend)
        with pytest.raises(FileExistsError, match="not an empty directory"):
            backend.export("ops", 0, target)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".statekeeper")] == []
    assert (target / "keep.txt").read_text() == "mine"


def test_export_refuses_a_link_or_a_path_below_a_file_before_restoring_anything(
    tmp_path: Path,
) -> None:
    """A link to an empty folder was restored into in full, then failed to move the
    database into place ("Not a directory"); below a file, the error named no target."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    (tmp_path / "afile").write_text("f")
    with _backend(tmp_path) as backend:
        _build(backend)
        with pytest.raises(FileExistsError, match=r"link\b.* is a symbolic link \(to .*empty\)"):
            backend.export("ops", 0, tmp_path / "link")
        with pytest.raises(FileExistsError, match=r"afile is not a directory"):
            backend.export("ops", 0, tmp_path / "afile" / "sub")
    assert list((tmp_path / "empty").iterdir()) == []
    assert (tmp_path / "link").is_symlink()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".statekeeper")] == []


def test_export_of_a_missing_version_creates_nothing(tmp_path: Path) -> None:
    with _backend(tmp_path) as backend:
        _build(backend)
        with pytest.raises(sk.StateNotFoundError, match="version 9"):
            backend.export("ops", 0, tmp_path / "out", version=9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local", "root"]


def test_root_metadata_reads_what_the_root_records(tmp_path: Path) -> None:
    with _backend(tmp_path) as backend:
        assert backend.root_metadata() is None
        backend.register("ops", 2)
        backend.open("other", 0).close()
        meta = backend.root_metadata()
    assert meta is not None
    assert meta.operators == {"ops": 2, "other": None}
    assert meta.format_version >= 1
    assert len(meta.root_id) == 32
