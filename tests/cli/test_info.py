"""``info`` and ``versions`` against a real root (local and S3)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from statekeeper import layout
from tests.cli.conftest import Built, one_error_line, run


def test_info_json_describes_every_store(root: Built) -> None:
    result = run("--json", "info", root.uri, *root.opts)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    blobs = root.blobs()
    try:
        listed = blobs.list("")
    finally:
        blobs.close()
    assert doc["format_version"] == 2
    assert doc["blobs"] == len(listed)
    assert doc["bytes"] == sum(m.size for m in listed)
    assert doc["mode"] == "mixed"
    ops = {op["name"]: op for op in doc["operators"]}
    assert ops.keys() == {"counts", "snap"}
    assert ops["counts"]["partitions"] == 2
    stores = {(op, s["partition"]): s for op in ops for s in ops[op]["stores"]}
    assert stores.keys() == {("counts", 0), ("counts", 1), ("snap", 0)}
    c0 = stores[("counts", 0)]
    assert (c0["latest_version"], c0["newest_snapshot"], c0["mode"]) == (7, 6, "changelog")
    assert (c0["changelogs"], c0["snapshots"]) == (7, 2)
    prefix = layout.store_prefix("counts", 0)
    assert c0["blobs"] == sum(1 for m in listed if m.key.startswith(prefix))
    assert (stores[("counts", 1)]["latest_version"], stores[("counts", 1)]["newest_snapshot"]) == (
        1,
        None,
    )
    s0 = stores[("snap", 0)]
    assert (s0["latest_version"], s0["newest_snapshot"], s0["mode"]) == (3, 3, "snapshot")


def test_info_table_for_people(root: Built) -> None:
    result = run("info", root.uri, *root.opts)
    assert result.exit_code == 0
    out = result.stdout
    assert "format version 2" in out
    for word in ("counts", "snap", "changelog", "snapshot", "0/2", "1/2"):
        assert word in out


def test_info_shows_a_partition_that_never_committed(tmp_path: Path, local: Built) -> None:
    with local.backend(tmp_path / "wc") as backend:
        backend.open("fresh", 2, partitions=3).close()  # registers 3 partitions, no commit
    doc = json.loads(run("info", local.uri, "--json").stdout)
    fresh = next(op for op in doc["operators"] if op["name"] == "fresh")
    assert [s["partition"] for s in fresh["stores"]] == [0, 1, 2]
    assert {s["mode"] for s in fresh["stores"]} == {"empty"}
    assert {s["latest_version"] for s in fresh["stores"]} == {0}


def test_versions_json_says_which_snapshot_each_version_needs(root: Built) -> None:
    result = run("versions", root.uri, "counts", *root.opts, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    parts = {p["partition"]: p["versions"] for p in doc["partitions"]}
    assert parts.keys() == {0, 1}
    by_version = {v["version"]: v for v in parts[0]}
    assert sorted(by_version) == list(range(8))
    assert by_version[2] == {
        "version": 2,
        "base_kind": "empty",
        "snapshot": None,
        "changelogs": [1, 2],
        "owner": None,
    }
    assert by_version[3]["snapshot"] == 3
    assert by_version[3]["changelogs"] == []
    assert by_version[5] == {
        "version": 5,
        "base_kind": "snapshot",
        "snapshot": 3,
        "changelogs": [4, 5],
        "owner": None,
    }
    assert by_version[7]["snapshot"] == 6
    assert by_version[7]["changelogs"] == [7]
    assert [v["version"] for v in parts[1]] == [0, 1]


def test_versions_of_one_partition_in_a_table(root: Built) -> None:
    result = run("versions", root.uri, "counts", "--partition", "0", *root.opts)
    assert result.exit_code == 0
    out = result.stdout
    assert "snapshot 3" in out
    assert "snapshot 6" in out
    assert "empty store" in out
    assert "4..V" in out  # versions 4-5: snapshot 3, then changelogs 4 up to the version


def test_versions_name_the_query_that_committed_each_version(local: Built, tmp_path: Path) -> None:
    """After an OwnerConflictError, which query holds the operator: the owner of each
    version (the Spark layer's streaming query id), in the JSON and as a table column."""
    with local.backend(tmp_path / "wc") as backend:
        with backend.open("owned", 0) as store:
            for owner in ("query-a", "query-a", None, "query-b"):
                store.put(b"k", b"v")
                store.commit(owner=owner)
        with backend.open("plain", 0) as store:
            store.put(b"k", b"v")
            store.commit()
    doc = json.loads(run("versions", local.uri, "owned", "--json").stdout)
    [part] = doc["partitions"]
    assert [(v["version"], v["owner"]) for v in part["versions"]] == [
        (0, None), (1, "query-a"), (2, "query-a"), (3, None), (4, "query-b"),
    ]  # fmt: skip
    table = run("versions", local.uri, "owned").stdout
    assert "owner (streaming query)" in table
    assert "query-a" in table
    assert "query-b" in table
    assert "owner" not in run("versions", local.uri, "plain").stdout  # no column without owners


def test_versions_of_snapshot_mode_store(root: Built) -> None:
    doc = json.loads(run("versions", root.uri, "snap", *root.opts, "--json").stdout)
    [part] = doc["partitions"]
    # version 0 (the empty store) stays restorable in snapshot mode: batch 0 can re-run
    assert [(v["version"], v["snapshot"], v["changelogs"]) for v in part["versions"]] == [
        (0, None, []),
        (1, 1, []),
        (2, 2, []),
        (3, 3, []),
    ]


def test_versions_unknown_operator_and_partition_are_usage_errors(root: Built) -> None:
    result = run("versions", root.uri, "nope", *root.opts)
    assert result.exit_code == 2
    line = one_error_line(result)
    assert "'nope'" in line
    assert "counts, snap" in line
    result = run("versions", root.uri, "counts", "-p", "2", *root.opts)
    assert result.exit_code == 2
    assert "partition 2" in one_error_line(result)
    result = run("versions", root.uri, "counts", "-p", "-1", *root.opts)
    assert result.exit_code == 2
    one_error_line(result)


def test_operator_without_a_recorded_partition_count(local: Built, tmp_path: Path) -> None:
    with local.backend(tmp_path / "wc") as backend, backend.open("loose", 1) as store:
        store.put(b"a", b"1")
        store.commit()
    doc = json.loads(run("info", local.uri, "--json").stdout)
    loose = next(op for op in doc["operators"] if op["name"] == "loose")
    assert loose["partitions"] is None
    assert [(s["partition"], s["latest_version"]) for s in loose["stores"]] == [(1, 1)]
    assert "1/?" in run("info", local.uri).stdout
    versions = json.loads(run("versions", local.uri, "loose", "--json").stdout)
    assert [p["partition"] for p in versions["partitions"]] == [1]
    result = run("inspect", local.uri, "loose", "-p", "0")
    assert result.exit_code == 2
    assert "partitions are 1" in one_error_line(result)
    assert run("inspect", local.uri, "loose", "-p", "1").exit_code == 0


def test_a_temporary_folder_inside_the_root_is_a_usage_error(
    local: Built, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: with the system's temporary folder inside a local root (root
    ``/data``, ``TMPDIR=/data/tmp``) every command failed with "unexpected ValueError",
    telling to change an option the command line does not have."""
    inside = Path(local.uri) / "tmp"
    inside.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(inside))
    result = run("info", local.uri)
    assert result.exit_code == 2
    assert "set TMPDIR to a folder outside the root" in one_error_line(result)


def test_a_file_given_as_the_root_is_said_to_be_one(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    result = run("info", str(tmp_path / "f"))
    assert result.exit_code == 2
    assert "is a file, not a folder" in one_error_line(result)
