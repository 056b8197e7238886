"""A root written by statekeeper 0.1.0 (format 1) opens, and is upgraded in place by the first
commit. The fixture is what 0.1.0 itself wrote: ``tests/fixtures/make_root_0_1.py``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import statekeeper as sk
from statekeeper import layout

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.fixture
def old_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(FIXTURES / "root-0.1.0", root)
    return root


def _expected() -> dict[str, dict[int, dict[bytes, bytes]]]:
    doc = json.loads((FIXTURES / "root-0.1.0.expected.json").read_text())
    return {
        name: {
            int(v): {bytes.fromhex(k): bytes.fromhex(x) for k, x in state.items()}
            for v, state in versions.items()
        }
        for name, versions in doc.items()
    }


def _format(root: Path) -> int:
    return int(json.loads((root / layout.ROOT_METADATA).read_text())["formatVersion"])


def test_every_version_0_1_kept_opens_with_its_content(old_root: Path, tmp_path: Path) -> None:
    expected = _expected()
    with sk.StateBackend(str(old_root), config=sk.StoreConfig(local_dir=str(tmp_path / "l"))) as b:
        for name in ("counts", "snap"):
            versions = b.versions(name, 0)
            assert versions[-1] == max(expected[name])
            for version in versions:
                with b.open(name, 0, version=version) as store:
                    assert dict(store.scan()) == expected[name].get(version, {})
        assert b.verify(deep=True).ok
    assert _format(old_root) == 1  # reading never rewrites the root


@pytest.mark.parametrize("mode", ["changelog", "snapshot"])
def test_the_first_commit_upgrades_the_root_and_keeps_all_state(
    old_root: Path, tmp_path: Path, mode: str
) -> None:
    expected = _expected()
    config = sk.StoreConfig(local_dir=str(tmp_path / "l"), mode=mode)  # type: ignore[arg-type]
    with sk.StateBackend(str(old_root), config=config) as backend, backend.open("counts", 0) as s:
        assert s.version == 7
        s.put(b"new", b"in format 2")
        assert s.commit().version == 8
    assert _format(old_root) == 2
    assert any((old_root / "counts" / "0" / "manifest").iterdir())
    fresh = sk.StoreConfig(local_dir=str(tmp_path / "fresh"))
    with sk.StateBackend(str(old_root), config=fresh) as backend:
        with backend.open("counts", 0) as store:
            assert dict(store.scan()) == {**expected["counts"][7], b"new": b"in format 2"}
        for version in backend.versions("counts", 0)[:-1]:
            with backend.open("counts", 0, version=version) as store:
                assert dict(store.scan()) == expected["counts"][version]
        with backend.open("snap", 0) as store:  # an untouched store of the upgraded root
            assert dict(store.scan()) == expected["snap"][3]
        report = backend.verify(deep=True)
        assert report.ok, report.problems
        meta = backend.root_metadata()
        assert meta is not None
        assert meta.key_groups == {}  # 0.1 operators keep their key layout


def test_an_upgraded_root_survives_gc_and_keeps_its_retained_versions(
    old_root: Path, tmp_path: Path
) -> None:
    expected = _expected()
    config = sk.StoreConfig(local_dir=str(tmp_path / "l"), retain_versions=3, snapshot_every=2)
    with sk.StateBackend(str(old_root), config=config) as backend:
        with backend.open("counts", 0) as store:
            for v in (8, 9):
                store.put(b"v", b"%d" % v)
                assert store.commit().version == v
        backend.wait_for_snapshots()
        backend.gc()
        assert backend.versions("counts", 0)[-3:] == [7, 8, 9]
        with backend.open("counts", 0, version=7) as store:
            assert dict(store.scan()) == expected["counts"][7]
        assert backend.verify(deep=True).ok


def test_the_fixture_is_what_0_1_0_writes(tmp_path: Path) -> None:
    """The script regenerates the fixture with the 0.1.0 sources from git: same content."""
    script = FIXTURES / "make_root_0_1.py"
    subprocess.run([sys.executable, str(script), "--to", str(tmp_path)], check=True)
    assert (tmp_path / "root-0.1.0.expected.json").read_text() == (
        FIXTURES / "root-0.1.0.expected.json"
    ).read_text()
    assert _format(tmp_path / "root-0.1.0") == 1
    kinds = {p.parent.name for p in (tmp_path / "root-0.1.0").rglob("*") if p.is_file()}
    assert {"changelog", "snapshot", "files"} <= kinds
