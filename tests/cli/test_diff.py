"""``statekeeper diff``: the changes between two versions, from the changelogs or, across
versions without changelogs, from two restored versions; and ``inspect --version`` for every
retained version (time travel). The root is the one ``conftest.build_root`` describes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import statekeeper as sk
from statekeeper.keyed import StatefulProcessorHandle
from tests.cli.conftest import Built, one_error_line, run


def _apply(items: dict[bytes, bytes], changes: list[dict[str, Any]]) -> dict[bytes, bytes]:
    out = dict(items)
    for change in changes:
        key = bytes.fromhex(change["key_hex"])
        if change["operation"] == "delete":
            assert change["value_hex"] is None
            out.pop(key, None)
        else:
            out[key] = bytes.fromhex(change["value_hex"])
    return out


def _diff(root: Built, *args: str) -> dict[str, Any]:
    result = run("diff", root.uri, *root.opts, *args, "--json", "--limit", "0")
    assert result.exit_code == 0, result.output
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


def test_diff_reads_the_changelogs_between_two_versions(root: Built) -> None:
    states = root.states[("counts", 0)]
    for start, end in ((0, 7), (2, 5), (4, 4), (6, 7)):
        doc = _diff(root, "counts", "-p", "0", "--from", str(start), "--to", str(end))
        (part,) = doc["partitions"]
        assert (part["from"], part["to"], part["restored"]) == (start, end, False)
        assert doc["decoded"] is False
        assert _apply(states[start], part["changes"]) == states[end]
        assert {c["version"] for c in part["changes"]} == set(range(start + 1, end + 1))
    # Version 3 deletes k002 and writes k003..k012 = v3.
    doc = _diff(root, "counts", "-p", "0", "--from", "2", "--to", "3")
    changes = [(c["operation"], c["key"], c["value"]) for c in doc["partitions"][0]["changes"]]
    assert ("delete", "k002", None) in changes
    assert ("put", "k012", "v3") in changes
    assert len(changes) == 11


def test_diff_across_versions_without_changelogs_compares_restored_versions(root: Built) -> None:
    states = root.states[("snap", 0)]
    doc = _diff(root, "snap", "--from", "1", "--to", "3")
    (part,) = doc["partitions"]
    assert part["restored"] is True
    assert part["stretches"] == [{"from": 1, "to": 3, "source": "restored versions"}]
    assert _apply(states[1], part["changes"]) == states[3]
    assert {c["version"] for c in part["changes"]} == {3}  # the net change, labelled 3
    human = run("diff", root.uri, *root.opts, "snap", "--from", "1", "--to", "3")
    assert human.exit_code == 0, human.output
    text = " ".join(human.stdout.split())
    assert "versions 2..3 have no changelog" in text
    assert "difference of the restored versions 1 and 3" in text


def test_diff_of_every_partition_with_a_limit(local: Built) -> None:
    doc = _diff(local, "counts", "--from", "0", "--to", "1")
    assert [p["partition"] for p in doc["partitions"]] == [0, 1]
    assert doc["truncated"] is False
    assert _apply({}, doc["partitions"][1]["changes"]) == local.states[("counts", 1)][1]
    result = run("diff", local.uri, "counts", "--from", "0", "--to", "1", "--json", "--limit", "4")
    limited = json.loads(result.stdout)
    assert limited["truncated"] is True
    assert [len(p["changes"]) for p in limited["partitions"]] == [4]
    human = run("diff", local.uri, "counts", "--from", "0", "--to", "1", "--limit", "4")
    assert "more changes follow: raise --limit" in human.stdout


def test_versions_gc_collected_or_out_of_order_are_usage_errors(local: Built) -> None:
    gc = run("gc", local.uri, "--retain-versions", "2", "--orphan-ttl", "300")
    assert gc.exit_code == 0, gc.output
    result = run("diff", local.uri, "counts", "-p", "0", "--from", "2", "--to", "7")
    assert result.exit_code == 2
    line = one_error_line(result)
    assert "version 2 of store counts/0 does not exist: restorable versions are 6-7" in line
    assert _diff(local, "counts", "-p", "0", "--from", "6", "--to", "7")["partitions"][0]
    result = run("diff", local.uri, "counts", "-p", "0", "--from", "7", "--to", "6")
    assert result.exit_code == 2
    assert "--from 7 is after --to 6 (partition 0)" in one_error_line(result)
    result = run("diff", local.uri, "nope", "--from", "0")
    assert result.exit_code == 2
    assert "operator 'nope' does not exist" in one_error_line(result)


def _keyed_root(tmp_path: Path) -> str:
    """A keyed processor's store: version 1 writes a value, a map entry, a list with a TTL
    and a timer; version 2 clears the value and lets the list expire."""
    uri = str(tmp_path / "keyed")
    config = sk.StoreConfig(local_dir=str(tmp_path / "wc"))
    with (
        sk.StateBackend(uri, config=config) as backend,
        backend.open("keyed", 0, partitions=1) as store,
    ):
        for now, first in ((1_000, True), (5_000, False)):
            handle = StatefulProcessorHandle(
                store, now_ms=now, batch_id=store.version, partition=0, key_groups=8,
                time_mode="processing_time",
            )  # fmt: skip
            value = handle.value_state("total")
            mapped = handle.map_state("seen")
            listed = handle.list_state("recent", ttl=2)
            handle.record_operator(["user"], key_schema=None, operator="keyed")
            handle.set_key(("ann",), 3)
            if first:
                value.update(10)
                mapped.put("page", {"n": 1})
                listed.extend(["a", "b"])
                handle.register_timer(9_000)
            else:
                value.clear()
            handle.set_key(None)
            handle.expire()
            store.commit()
    return uri


def test_diff_decodes_a_keyed_store_and_hides_its_bookkeeping(tmp_path: Path) -> None:
    uri = _keyed_root(tmp_path)
    result = run("diff", uri, "keyed", "--from", "0", "--to", "2", "--json")
    assert result.exit_code == 0, result.output
    (part,) = json.loads(result.stdout)["partitions"]
    shown = sorted(
        (c["version"], c["operation"], c["state"]["name"], c["state"]["entry"], c["value"])
        for c in part["changes"]
    )
    assert shown == [
        (1, "put", "$timer", 9000, None),
        (1, "put", "recent", 0, "a"),
        (1, "put", "recent", 1, "b"),
        (1, "put", "seen", "page", {"n": 1}),
        (1, "put", "total", None, 10),
        (2, "delete", "recent", 0, None),
        (2, "delete", "recent", 1, None),
        (2, "delete", "total", None, None),
    ]
    assert all(c["state"]["key"] == ["ann"] for c in part["changes"])
    raw = run("diff", uri, "keyed", "--from", "0", "--to", "2", "--json", "--raw")
    (raw_part,) = json.loads(raw.stdout)["partitions"]
    # The TTL index (2 puts, 2 deletes), the list counter (put, delete), the operator record,
    # the timer index and the TTL index's floor (written once entries expired) are raw
    # changes only.
    floors = [(c["version"], c["operation"]) for c in raw_part["changes"] if c["key"][:4] == "ff06"]
    assert floors == [(2, "put")]
    assert len(raw_part["changes"]) == len(part["changes"]) + 8 + len(floors)
    human = run("diff", uri, "keyed", "--from", "1", "--to", "2")
    assert human.exit_code == 0, human.output
    assert 'total ["ann"]' in human.stdout
    assert 'recent ["ann"] [1]' in human.stdout


def test_inspect_travels_to_every_retained_version(root: Built, tmp_path: Path) -> None:
    with root.backend(tmp_path / "versions") as backend:
        retained = backend.versions("counts", 0)
    assert retained == list(range(8))
    for version in retained:
        result = run(
            "inspect", root.uri, *root.opts, "counts", "-p", "0", "--version", str(version),
            "--json", "--limit", "0",
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        items = json.loads(result.stdout)["items"]
        found = {bytes.fromhex(i["key_hex"]): bytes.fromhex(i["value_hex"]) for i in items}
        assert found == root.states[("counts", 0)][version], version


@pytest.mark.parametrize("where", ["--partition", "-p"])
def test_diff_of_a_partition_that_does_not_exist_is_a_usage_error(local: Built, where: str) -> None:
    result = run("diff", local.uri, "counts", where, "5", "--from", "0")
    assert result.exit_code == 2
    assert "partition 5 of operator 'counts' does not exist" in one_error_line(result)


def test_diff_shows_a_progress_bar_on_a_terminal(local: Built) -> None:
    args = ("diff", local.uri, "counts", "-p", "0", "--from", "2", "--to", "5")
    result = run(*args, env={"TTY_COMPATIBLE": "1"})
    assert result.exit_code == 0, result.output
    assert "reading counts/0@2..5" in result.stdout
    quiet = run(*args, "--json", env={"TTY_COMPATIBLE": "1"})
    assert json.loads(quiet.stdout)["partitions"][0]["to"] == 5  # no bar around the JSON


def test_diff_streams_a_long_listing_as_the_same_json_and_in_tables(tmp_path: Path) -> None:
    """``diff --limit 0`` of a commit of millions of keys held every change, decoded, and the
    whole document (1.66 GB of RSS for 500k changes): changes are now written as they are
    read, partition by partition. The JSON is what one document would give; text comes as
    tables of 1,000 rows."""
    root = str(tmp_path / "root")
    config = sk.StoreConfig(local_dir=str(tmp_path / "w"))
    with sk.StateBackend(root, config=config) as backend:
        for p in range(2):
            with backend.open("big", p, partitions=2) as store:
                store.put_many([(b"k%05d" % i, b"v%d" % p) for i in range(1500)])
                store.commit()
    result = run("diff", root, "big", "--from", "0", "--json", "--limit", "0")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [len(p["changes"]) for p in doc["partitions"]] == [1500, 1500]
    assert doc["partitions"][1]["changes"][-1]["value"] == "v1"
    assert doc["truncated"] is False
    assert result.stdout == json.dumps(doc, indent=2) + "\n"  # partitions before truncated
    limited = json.loads(
        run("diff", root, "big", "--from", "0", "--json", "--limit", "1501").stdout
    )
    assert [len(p["changes"]) for p in limited["partitions"]] == [1500, 1]
    assert limited["truncated"] is True
    text = run("diff", root, "big", "--from", "0", "--limit", "0").stdout
    assert text.count("1500 changes") == 2
    assert text.count("k01499") == 2
    assert "more changes follow" not in text
