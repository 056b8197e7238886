"""Every blob names what it belongs to (issue 11, event 5) and errors name the broken blob
(issue 13, item 3): met as a user meets them, through the backend and the command line."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

import statekeeper as sk
from statekeeper.history import StoreHistory
from tests.blobstores import store_history
from tests.cli.conftest import run


def _backend(tmp_path: Path, local: str = "w", **options: object) -> sk.StateBackend:
    config = sk.StoreConfig(local_dir=str(tmp_path / local), **options)  # type: ignore[arg-type]
    return sk.StateBackend(str(tmp_path / "root"), config=config)


def _commit(backend: sk.StateBackend, partition: int, versions: int) -> None:
    with backend.open("op", partition, partitions=2) as store:
        for v in range(1, versions + 1):
            store.put(b"key", b"p%d-v%d" % (partition, v))
            store.put(b"p%d-only" % partition, b"%d" % v)
            store.commit()


def _two_partitions(tmp_path: Path, versions: int = 3) -> tuple[StoreHistory, StoreHistory]:
    backend = _backend(tmp_path, snapshot_every=10_000)
    for partition in (0, 1):
        _commit(backend, partition, versions)
    backend.close()
    return store_history(backend, "op", 0), store_history(backend, "op", 1)


def _contains(text: str, *parts: str) -> None:
    for part in parts:
        assert part in text, f"{part!r} not in {text!r}"


def _copy_over(tmp_path: Path, source: str, target: str) -> None:
    """Replace blob ``target`` by the bytes of ``source``, as a misconfigured sync would."""
    shutil.copyfile(tmp_path / "root" / source, tmp_path / "root" / target)


def test_changelog_of_another_partition_copied_over_is_refused_naming_both(
    tmp_path: Path,
) -> None:
    h0, h1 = _two_partitions(tmp_path)
    target = h0.changelog_key(3)
    _copy_over(tmp_path, h1.changelog_key(3), target)
    cold = _backend(tmp_path, "cold")
    with pytest.raises(sk.CorruptStateError) as err:
        cold.open("op", 0)
    message = str(err.value)
    assert target in message
    _contains(message, "op/0", "op/1", h0.attempt(3), h1.attempt(3))  # expected and found
    with cold.open("op", 0, version=2) as store:  # what does not need it still opens
        assert store.get(b"key") == b"p0-v2"
        assert store.get(b"p1-only") is None


@pytest.mark.parametrize("deep", [False, True])
def test_verify_reports_a_changelog_of_another_partition(tmp_path: Path, deep: bool) -> None:
    h0, h1 = _two_partitions(tmp_path)
    target = h0.changelog_key(3)
    _copy_over(tmp_path, h1.changelog_key(3), target)
    report = _backend(tmp_path, "v").verify(deep=deep)
    corrupt = [p for p in report.problems if p.kind == "corrupt"]
    assert [p.blob for p in corrupt] == [target], report.problems
    _contains(corrupt[0].message, "op/1", "op/0")
    assert any(p.kind == "unrestorable" and "versions 3 " in p.message for p in report.problems)


def test_cli_inspect_and_verify_report_a_changelog_of_another_partition(tmp_path: Path) -> None:
    h0, h1 = _two_partitions(tmp_path)
    target = h0.changelog_key(3)
    _copy_over(tmp_path, h1.changelog_key(3), target)
    uri = str(tmp_path / "root")
    inspected = run("inspect", uri, "op", "-p", "0", "--json")
    assert inspected.exit_code != 0
    _contains(inspected.stderr, target, "op/1")
    verified = run("verify", uri, "--json")
    assert verified.exit_code != 0
    doc = json.loads(verified.stdout)
    assert target in {p["blob"] for p in doc["problems"]}, doc


def test_changelog_stored_under_another_version_is_refused_and_reported(tmp_path: Path) -> None:
    h0, _ = _two_partitions(tmp_path)
    target = h0.changelog_key(3)
    _copy_over(tmp_path, h0.changelog_key(2), target)
    with pytest.raises(sk.CorruptStateError, match=target) as err:
        _backend(tmp_path, "cold").open("op", 0)
    _contains(str(err.value), "version 3", "version 2")
    report = _backend(tmp_path, "v").verify(deep=False)
    assert target in {p.blob for p in report.problems if p.kind == "corrupt"}, report.problems


def _with_snapshot(tmp_path: Path, versions: int) -> StoreHistory:
    """Versions 1..``versions`` of partition 0 and a snapshot of the latest; partition 1 the
    same, so that its index can be copied over."""
    backend = _backend(tmp_path, snapshot_every=10_000, retain_versions=1)
    for partition in (0, 1):
        _commit(backend, partition, versions)
        backend.snapshot("op", partition)
    backend.gc()  # the snapshot is the only base: the changelogs before it are gone
    backend.close()
    return store_history(backend, "op", 0)


def test_snapshot_index_of_another_partition_is_refused_naming_both(tmp_path: Path) -> None:
    h0 = _with_snapshot(tmp_path, 4)
    h1 = store_history(_backend(tmp_path, "k"), "op", 1)
    assert h0.snapshots == {4}
    target = h0.index_key(4)
    _copy_over(tmp_path, h1.index_key(4), target)
    with pytest.raises(sk.CorruptStateError) as err:
        _backend(tmp_path, "cold").open("op", 0)
    message = str(err.value)
    _contains(message, target, "op/1", "op/0")
    report = _backend(tmp_path, "v").verify(deep=False)
    assert target in {p.blob for p in report.problems if p.kind == "corrupt"}, report.problems


def test_corrupt_only_base_snapshot_names_the_index_and_why(tmp_path: Path) -> None:
    h0 = _with_snapshot(tmp_path, 4)
    target = tmp_path / "root" / h0.index_key(4)
    target.write_bytes(target.read_bytes().replace(b'"version":4', b'"version":5'))
    with pytest.raises(sk.CorruptStateError) as err:
        _backend(tmp_path, "cold").open("op", 0)
    message = str(err.value)
    assert h0.index_key(4) in message, message
    assert "checksum" in message, message  # why it is unusable
    assert "version 4" in message, message  # what could not be restored


def test_missing_only_base_snapshot_names_the_index(tmp_path: Path) -> None:
    h0 = _with_snapshot(tmp_path, 4)
    (tmp_path / "root" / h0.index_key(4)).unlink()
    with pytest.raises(sk.StateNotFoundError) as err:
        _backend(tmp_path, "cold").open("op", 0)
    assert h0.index_key(4) in str(err.value), err.value


def test_missing_middle_changelog_names_the_missing_blob(tmp_path: Path) -> None:
    h0, _ = _two_partitions(tmp_path, versions=5)
    key = h0.changelog_key(3)
    (tmp_path / "root" / key).unlink()
    with pytest.raises(sk.StateNotFoundError) as err:
        _backend(tmp_path, "cold").open("op", 0)
    assert key in str(err.value), err.value
    assert "version 5" in str(err.value) or "version 3" in str(err.value), err.value


def test_snapshot_fallback_past_a_foreign_index_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = _backend(tmp_path, snapshot_every=10_000)
    for partition in (0, 1):
        _commit(backend, partition, 4)
        backend.snapshot("op", partition)
    backend.close()
    h0 = store_history(backend, "op", 0)
    h1 = store_history(backend, "op", 1)
    _copy_over(tmp_path, h1.index_key(4), h0.index_key(4))
    with caplog.at_level(logging.WARNING), _backend(tmp_path, "cold").open("op", 0) as store:
        assert store.version == 4
        assert store.restore_info.base_kind == "empty"  # the changelogs rebuild it
        assert store.get(b"key") == b"p0-v4"
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    _contains(warning, h0.index_key(4), "op/1")
