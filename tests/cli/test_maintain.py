"""``verify`` and ``gc`` against a real root (local and S3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import rocksdict

import statekeeper as sk
from statekeeper import StateBackend, layout
from statekeeper.history import StoreHistory
from statekeeper.snapshot import load_index, referenced_blob_ids
from statekeeper.storage import BlobStore
from tests.cli.conftest import Built, flip, history_of, keys_of, one_error_line, run

needs_verify = pytest.mark.skipif(
    not hasattr(StateBackend, "verify"), reason="StateBackend.verify is not in the core yet"
)
needs_gc = pytest.mark.skipif(
    not hasattr(StateBackend, "gc"), reason="StateBackend.gc is not in the core yet"
)


def _history(blobs: BlobStore) -> StoreHistory:
    return history_of(blobs, "counts", 0)


def _file_blob(blobs: BlobStore) -> str:
    """A non-empty file blob that the snapshot of counts/0 at version 6 references."""
    index = load_index(blobs, "counts", 0, 6, key=_history(blobs).index_key(6))
    sized = {m.key: m.size for m in blobs.list(layout.files_prefix("counts", 0))}
    keys = [layout.file_blob_key("counts", 0, b) for b in sorted(referenced_blob_ids(index))]
    return max(keys, key=lambda k: sized[k])


def _corrupt(root: Built, kind: str) -> str:
    """Flip one byte in the middle of a blob of ``kind``; returns its key."""
    blobs = root.blobs()
    try:
        key = {
            "changelog": lambda: _history(blobs).changelog_key(4),
            "snapshot index": lambda: _history(blobs).index_key(6),
            "file": lambda: _file_blob(blobs),
        }[kind]()
        size = blobs.head(key).size
        # A changelog's header (identity included) is what a shallow verify reads: flip a
        # byte of its body, which only the deep check's CRC32C can see.
        flip(blobs, key, size - 3 if kind == "changelog" else size // 2)
    finally:
        blobs.close()
    return key


@needs_verify
def test_verify_intact_root(root: Built) -> None:
    for deep in ([], ["--deep"]):
        result = run("verify", root.uri, *root.opts, *deep, "--json")
        assert result.exit_code == 0, result.output
        doc = json.loads(result.stdout)
        assert doc["ok"] is True
        assert doc["problems"] == []
        assert doc["deep"] is bool(deep)
        assert doc["blobs_checked"] >= 7 + 2 + 1 + 3
    result = run("verify", root.uri, *root.opts, "--deep")
    assert result.exit_code == 0
    assert "intact" in result.stdout
    assert result.stderr == ""


@needs_verify
@pytest.mark.parametrize(
    ("kind", "shallow_sees_it"),
    [("changelog", False), ("snapshot index", True), ("file", False)],
)
def test_verify_deep_finds_a_flipped_byte_in_every_blob_kind(
    root: Built, kind: str, shallow_sees_it: bool
) -> None:
    key = _corrupt(root, kind)
    result = run("verify", root.uri, *root.opts, "--deep", "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["ok"] is False
    assert any(p["blob"] == key or key in p["message"] for p in doc["problems"]), doc
    assert all(p["store"] == "counts/0" for p in doc["problems"])
    assert f"verify found {len(doc['problems'])} problem(s)" in result.stderr
    table = run("verify", root.uri, *root.opts, "--deep")
    assert table.exit_code == 1
    assert key in table.stdout
    assert table.stderr.strip().splitlines() == [
        f"statekeeper: verify found {len(doc['problems'])} problem(s) in {doc['root']}"
    ]
    shallow = run("verify", root.uri, *root.opts)
    assert shallow.exit_code == (1 if shallow_sees_it else 0)


@needs_verify
def test_verify_finds_a_missing_file_blob_without_deep(local: Built) -> None:
    blobs = local.blobs()
    try:
        key = _file_blob(blobs)
    finally:
        blobs.close()
    Path(local.uri, key).unlink()
    result = run("verify", local.uri, "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    kinds = {(p["blob"], p["kind"]) for p in doc["problems"]}
    assert (key, "missing") in kinds
    # the snapshot is the store's base: what needs it is reported, naming the manifest
    assert {k for b, k in kinds if b != key} <= {"unrestorable"}


@needs_verify
def test_verify_shows_a_progress_bar_on_a_terminal(local: Built) -> None:
    result = run("verify", local.uri, "--deep", env={"TTY_COMPATIBLE": "1"})
    assert result.exit_code == 0
    assert "verifying blobs (deep)" in result.stdout


def test_verify_unknown_root_is_a_usage_error(tmp_path: Path) -> None:
    result = run("verify", str(tmp_path / "missing"), "--deep")
    assert result.exit_code == 2
    one_error_line(result)


@needs_gc
def test_gc_dry_run_deletes_nothing_and_says_what_it_would(root: Built) -> None:
    blobs = root.blobs()
    try:
        before = keys_of(blobs, "")
        history = _history(blobs)
        args = (
            "gc",
            root.uri,
            *root.opts,
            "--dry-run",
            "--retain-versions",
            "2",
            "--orphan-ttl",
            "0",
        )
        result = run(*args, "--json")
        assert result.exit_code == 0, result.output
        doc = json.loads(result.stdout)
        assert keys_of(blobs, "") == before
    finally:
        blobs.close()
    assert doc["dry_run"] is True
    doomed = set(doc["deleted_keys"])
    assert {history.changelog_key(v) for v in range(1, 7)} <= doomed
    # Snapshot 3 stops being named by this run: an upload that read an older manifest may
    # still reuse its files, so it waits out the grace (0 s is raised to the floor).
    assert history.index_key(3) not in doomed
    assert history.index_key(6) not in doomed
    stores = {s["store"]: s for s in doc["stores"]}
    c0 = stores["counts/0"]
    prefix = layout.store_prefix("counts", 0)
    assert c0["deleted_blobs"] == sum(1 for k in doomed if k.startswith(prefix))
    assert c0["deleted_blobs"] + c0["kept_blobs"] == sum(1 for k in before if k.startswith(prefix))
    table = run(*args, "--list")
    assert "would delete" in table.stdout
    assert "dry run: nothing was deleted" in table.stdout
    assert history.changelog_key(1) in table.stdout


@needs_gc
def test_gc_deletes_and_keeps_the_retained_versions_restorable(root: Built, tmp_path: Path) -> None:
    result = run(
        "gc", root.uri, *root.opts, "--retain-versions", "2", "--orphan-ttl", "0", "--json"
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["dry_run"] is False
    assert doc["deleted_blobs"] > 0
    # The total counts every key deleted, the root's own (epoch manifests...) too.
    assert doc["deleted_blobs"] == len(doc["deleted_keys"])
    assert doc["deleted_root_blobs"] == doc["deleted_blobs"] - sum(
        s["deleted_blobs"] for s in doc["stores"]
    )
    blobs = root.blobs()
    try:
        left = set(keys_of(blobs, ""))
    finally:
        blobs.close()
    assert not left & set(doc["deleted_keys"])
    versions = json.loads(
        run("versions", root.uri, *root.opts, "counts", "-p", "0", "--json").stdout
    )
    assert [v["version"] for v in versions["partitions"][0]["versions"]] == [6, 7]
    target = tmp_path / "db"
    restored = run("restore", root.uri, *root.opts, "counts", "-p", "0", "--to", str(target))
    assert restored.exit_code == 0, restored.output
    db = rocksdict.Rdict(str(target))
    try:
        assert {bytes(k): bytes(v) for k, v in db.items()} == root.states[("counts", 0)][7]
    finally:
        db.close()
    if hasattr(StateBackend, "verify"):
        assert run("verify", root.uri, *root.opts, "--deep").exit_code == 0


@needs_gc
def test_gc_with_the_default_retention_keeps_everything(local: Built) -> None:
    result = run("gc", local.uri)
    assert result.exit_code == 0, result.output
    assert "deleted 0 blobs" in result.stdout
    assert "counts/0" in result.stdout
    assert "snap/0" in result.stdout


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--retain-versions", "0"),
        ("--orphan-ttl", "-1"),
        ("--orphan-ttl", "nan"),
        ("--orphan-ttl", "inf"),
    ],
)
def test_gc_bad_options_are_usage_errors(local: Built, option: str, value: str) -> None:
    """nan once passed the option's range and came back as the config field's error."""
    result = run("gc", local.uri, option, value)
    assert result.exit_code == 2
    assert option in one_error_line(result)


@needs_gc
def test_gc_applies_the_retention_the_root_records_by_default(local: Built, tmp_path: Path) -> None:
    """The pipeline's run recorded retain_versions=2: a bare ``gc`` keeps exactly that."""
    with local.backend(tmp_path / "run") as backend:
        backend.start_generation("counts")
    doc = json.loads(run("gc", local.uri, "--json").stdout)
    assert (doc["retain_versions"], doc["orphan_ttl_s"]) == (100, 7 * 24 * 3600.0)
    assert doc["deleted_blobs"] == 0
    recorded = sk.StoreConfig(local_dir=str(tmp_path / "l2"), retain_versions=2, orphan_ttl_s=0)
    with sk.StateBackend(local.uri, config=recorded) as backend:
        backend.start_generation("counts")
    doc = json.loads(run("gc", local.uri, "--json").stdout)
    assert (doc["retain_versions"], doc["orphan_ttl_s"]) == (2, 300.0)  # raised to the floor
    assert doc["deleted_blobs"] > 0
    versions = json.loads(run("versions", local.uri, "counts", "-p", "0", "--json").stdout)
    assert [v["version"] for v in versions["partitions"][0]["versions"]] == [6, 7]
    # An option given on the command line wins over the recorded one.
    doc = json.loads(run("gc", local.uri, "--retain-versions", "50", "--json").stdout)
    assert doc["retain_versions"] == 50


@needs_gc
def test_gc_applies_each_operators_own_recorded_retention(local: Built, tmp_path: Path) -> None:
    """Two operators of one root whose runs asked for different histories: a bare ``gc``
    keeps each one's. (The root once kept only the last run's retention, and ``gc`` applied
    it to every operator: the one that asked for more lost its history.)"""
    for operator, retain in (("counts", 4), ("snap", 1)):  # snap starts last
        config = sk.StoreConfig(
            local_dir=str(tmp_path / operator), retain_versions=retain, orphan_ttl_s=0
        )
        with sk.StateBackend(local.uri, config=config) as backend:
            backend.start_generation(operator)
        recorded = sk.StateBackend(local.uri, config=config)
        with recorded:
            assert recorded.recorded_retention()[operator] == sk.Retention(retain, 0.0)
    doc = json.loads(run("gc", local.uri, "--json").stdout)
    assert doc["operators"] == {
        "counts": {"retain_versions": 4, "orphan_ttl_s": 300.0},
        "snap": {"retain_versions": 1, "orphan_ttl_s": 300.0},
    }
    assert (doc["retain_versions"], doc["orphan_ttl_s"]) == (None, None)

    def restorable(operator: str) -> list[int]:
        listed = run("versions", local.uri, operator, "-p", "0", "--json")
        return [v["version"] for v in json.loads(listed.stdout)["partitions"][0]["versions"]]

    assert restorable("counts") == [3, 4, 5, 6, 7]  # oldest 4, from the snapshot at 3
    assert restorable("snap") == [3]
    text = run("gc", local.uri, "--dry-run")
    assert "versions each operator's last run asked for (counts: 4, snap: 1)" in text.stdout
    # An option applies to every operator.
    doc = json.loads(run("gc", local.uri, "--retain-versions", "3", "--json").stdout)
    assert doc["retain_versions"] == 3
    assert {u["retain_versions"] for u in doc["operators"].values()} == {3}
