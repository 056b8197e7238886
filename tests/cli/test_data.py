"""``inspect`` and ``restore`` against a real root (local and S3)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import rocksdict

import statekeeper as sk
from statekeeper.epochs import EpochManifest, StoreEntry, write_manifest
from statekeeper.keyed import PickleCodec, StatefulProcessor, StatefulProcessorHandle, encode_key
from statekeeper.keyed.testing import ProcessorTester
from tests.cli.conftest import Built, flip, history_of, one_error_line, run


def _inspect(root: Built, *args: str) -> dict[str, object]:
    result = run("inspect", root.uri, *root.opts, "--json", *args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert isinstance(doc, dict)
    return doc


def _raw(doc: dict[str, object]) -> dict[bytes, bytes]:
    items = doc["items"]
    assert isinstance(items, list)
    return {bytes.fromhex(i["key_hex"]): bytes.fromhex(i["value_hex"]) for i in items}


@pytest.mark.parametrize("version", [0, 2, 5, 7])
def test_inspect_shows_exactly_the_state_at_a_version(root: Built, version: int) -> None:
    doc = _inspect(root, "counts", "-p", "0", "--version", str(version), "--limit", "0")
    assert doc["version"] == version
    assert doc["truncated"] is False
    assert _raw(doc) == root.states[("counts", 0)][version]


def test_inspect_defaults_to_the_latest_version(root: Built) -> None:
    doc = _inspect(root, "snap", "-p", "0")
    assert doc["version"] == 3
    assert _raw(doc) == root.states[("snap", 0)][3]


def _epoch(root: Built, epoch: int, versions: list[int], created: int) -> None:
    """Write an epoch manifest of ``counts`` naming ``versions`` (one per partition)."""
    entries = [StoreEntry(p, v, None, None, None) for p, v in enumerate(versions)]
    manifest = EpochManifest(epoch, "q", None, created, {"counts": 2}, {"counts": entries})
    blobs = root.blobs()
    try:
        assert write_manifest(blobs, manifest)
    finally:
        blobs.close()


def test_inspect_and_restore_default_to_the_version_the_newest_epoch_manifest_names(
    local: Built, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Partition 0 is at version 7, but the last micro-batch a query finished left it at 6
    (the one that committed 7 may have failed after it): that is what read_state reads, and
    what inspect and restore show by default."""
    # A manifest two versions behind is stale: version 7 shows micro-batch 5 finished.
    _epoch(local, 4, [5, 1], 1)
    with caplog.at_level("WARNING", logger="statekeeper.epochs"):
        assert _inspect(local, "counts", "-p", "0")["version"] == 7
    assert "names version 5 of partition 0, which is at version 7" in caplog.text
    _epoch(local, 5, [6, 1], 1)
    doc = _inspect(local, "counts", "-p", "0", "--limit", "0")
    assert doc["version"] == 6
    assert _raw(doc) == local.states[("counts", 0)][6]
    result = run("restore", local.uri, "counts", "-p", "0", "--to", str(tmp_path / "db"), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["version"] == 6
    assert _opened(tmp_path / "db") == local.states[("counts", 0)][6]
    assert _inspect(local, "counts", "-p", "0", "--version", "7")["version"] == 7
    # A newer manifest naming a version that is not restorable: the newest, and why.
    _epoch(local, 98, [99, 1], 2)
    with caplog.at_level("WARNING", logger="statekeeper.epochs"):
        assert _inspect(local, "counts", "-p", "0")["version"] == 7
    assert "names version 99 of partition 0" in caplog.text


def test_inspect_shows_text_or_hex(root: Built) -> None:
    doc = _inspect(root, "counts", "-p", "1")
    by_key = {i["key_hex"]: i for i in doc["items"]}  # type: ignore[union-attr]
    binary = by_key[b"\x00\x01".hex()]
    assert (binary["key"], binary["key_format"]) == ("0001", "hex")
    assert (binary["value"], binary["value_format"]) == ("fffe", "hex")
    text = by_key[b"text".hex()]
    assert (text["key"], text["value"], text["value_format"]) == ("text", "hello world", "text")
    table = run("inspect", root.uri, *root.opts, "counts", "-p", "1").stdout
    assert "0x0001" in table
    assert "0xfffe" in table
    assert "hello world" in table


def test_inspect_prefix_as_text_or_hex_and_limit(root: Built) -> None:
    state = root.states[("counts", 0)][7]
    doc = _inspect(root, "counts", "-p", "0", "--prefix", "k01")
    assert _raw(doc) == {k: v for k, v in state.items() if k.startswith(b"k01")}
    doc = _inspect(root, "counts", "-p", "0", "--prefix", "0x" + b"k01".hex())
    assert _raw(doc) == {k: v for k, v in state.items() if k.startswith(b"k01")}
    doc = _inspect(root, "counts", "-p", "0", "--limit", "3")
    assert doc["truncated"] is True
    assert _raw(doc) == dict(sorted(state.items())[:3])
    doc = _inspect(root, "counts", "-p", "0", "--limit", str(len(state)))
    assert doc["truncated"] is False
    result = run("inspect", root.uri, *root.opts, "counts", "-p", "0", "--prefix", "0xzz")
    assert result.exit_code == 2
    assert "--prefix" in one_error_line(result)
    # A byte the shell passed that is not UTF-8 (Python's argv holds it as a surrogate).
    result = run("inspect", root.uri, *root.opts, "counts", "-p", "0", "--prefix", "\udcff")
    assert result.exit_code == 2
    assert "is not UTF-8 text: give other bytes as '0x'" in one_error_line(result)


def _keyed_root(tmp_path: Path) -> str:
    """A root whose store was written by keyed state handles, exactly as a processor's task
    writes it (no Spark: the handles are the keyed layer's own)."""
    uri = str(tmp_path / "keyed-root")
    config = sk.StoreConfig(local_dir=str(tmp_path / "keyed-local"))
    with (
        sk.StateBackend(uri, config=config) as backend,
        backend.open("sessions", 0, partitions=1) as store,
    ):
        handle = StatefulProcessorHandle(store, now_ms=1_000, batch_id=0, partition=0)
        count = handle.value_state("count")
        pages = handle.map_state("pages", ttl=60)
        events = handle.list_state("events")
        secret = handle.value_state("secret", codec=PickleCodec())
        handle.record_operator(["user"], key_schema=None, operator="sessions")
        handle.set_key(("alice",))
        count.update(3)
        pages.put("/home", {"hits": 2, "day": dt.date(2026, 11, 23)})
        events.extend(["a", "b"])
        secret.update({1, 2})
        handle.set_key(("bob",))
        count.update(1)
        store.commit()
    return uri


def test_inspect_decodes_the_state_of_keyed_processors(tmp_path: Path) -> None:
    """Values of a keyed store are decoded by the keyed layer (no Spark, nothing planted)."""
    uri = _keyed_root(tmp_path)
    result = run("inspect", uri, "sessions", "-p", "0", "--json", "--limit", "0")
    assert result.exit_code == 0, result.output
    items = json.loads(result.stdout)["items"]
    pickled = len(PickleCodec().encode({1, 2}))
    decoded = [
        (i["state"]["name"], i["state"]["key"], i["state"]["entry"], i["value"])
        for i in items
        if i["value_format"] == "decoded"
    ]
    assert decoded == [
        ("count", ["alice"], None, 3),
        ("count", ["bob"], None, 1),
        ("events", ["alice"], 0, "a"),
        ("events", ["alice"], 1, "b"),
        ("pages", ["alice"], "/home", {"hits": 2, "day": "2026-11-23"}),
        ("secret", ["alice"], None, f"<pickle: {pickled} bytes; pass allow_pickle=True to decode>"),
    ]
    pages = next(i for i in items if i.get("state", {}).get("name") == "pages")
    assert pages["state"]["expires_at_ms"] == 61_000
    # The operator record, the list counter and the TTL index stay raw.
    assert len(items) - len(decoded) == 3
    assert all(i["value_format"] != "decoded" for i in items if "state" not in i)
    table = run("inspect", uri, "sessions", "-p", "0").stdout
    assert 'count ["alice"]' in table
    assert 'pages ["alice"] ["/home"]' in table


def test_inspect_decodes_pickled_values_only_when_allowed(tmp_path: Path) -> None:
    uri = _keyed_root(tmp_path)
    args = ("inspect", uri, "sessions", "-p", "0", "--json", "--prefix")
    result = run(*args, "0x01" + encode_key(("secret",)).hex(), "--allow-pickle")
    assert result.exit_code == 0, result.output
    assert [i["value"] for i in json.loads(result.stdout)["items"]] == [[1, 2]]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["nope", "-p", "0"], "operator 'nope'"),
        (["counts", "-p", "5"], "partition 5"),
        (["counts", "-p", "0", "--version", "99"], "version 99"),
        (["counts"], "--partition"),
    ],
    ids=["operator", "partition", "version", "no-partition"],
)
def test_inspect_bad_input_is_a_usage_error(root: Built, args: list[str], expected: str) -> None:
    result = run("inspect", root.uri, *root.opts, *args)
    assert result.exit_code == 2
    assert expected in one_error_line(result)


def test_inspect_corrupt_changelog_fails_naming_it(root: Built) -> None:
    blobs = root.blobs()
    try:
        key = history_of(blobs, "counts", 0).changelog_key(2)
        flip(blobs, key, -1)
    finally:
        blobs.close()
    result = run("inspect", root.uri, *root.opts, "counts", "-p", "0", "--version", "2")
    assert result.exit_code == 1
    assert key in one_error_line(result)


def _opened(path: Path) -> dict[bytes, bytes]:
    db = rocksdict.Rdict(str(path))
    try:
        return {bytes(k): bytes(v) for k, v in db.items()}
    finally:
        db.close()


@pytest.mark.parametrize(
    ("store", "version"),
    [
        (("counts", 0), 5),
        (("counts", 0), None),
        (("counts", 0), 0),
        (("counts", 1), 1),
        (("snap", 0), 2),
    ],
    ids=["snapshot+changelogs", "latest", "empty", "binary", "snapshot-mode"],
)
def test_restore_opens_with_rocksdict_and_holds_exactly_the_version(
    root: Built, tmp_path: Path, store: tuple[str, int], version: int | None
) -> None:
    target = tmp_path / "out" / "db"
    args = ["restore", root.uri, *root.opts, store[0], "-p", str(store[1]), "--to", str(target)]
    if version is not None:
        args += ["--version", str(version)]
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    states = root.states[store]
    expected = states[-1] if version is None else states[version]
    assert doc["version"] == (len(states) - 1 if version is None else version)
    assert doc["keys"] == len(expected)
    restored = _opened(target)
    assert restored == expected
    assert b"" not in restored  # the working copy's version label is not copied
    assert [p.name for p in target.parent.iterdir()] == ["db"]  # no staging left behind


def test_restore_table_and_base(root: Built, tmp_path: Path) -> None:
    target = tmp_path / "db"
    result = run(
        "restore", root.uri, *root.opts, "counts", "-p", "0", "--version", "5", "--to", str(target)
    )
    assert result.exit_code == 0, result.output
    assert "from snapshot 3 and 2 changelogs" in result.stdout
    assert _opened(target) == root.states[("counts", 0)][5]


def test_restore_into_an_empty_existing_directory(local: Built, tmp_path: Path) -> None:
    target = tmp_path / "empty"
    target.mkdir()
    result = run("restore", local.uri, "counts", "-p", "0", "--to", str(target))
    assert result.exit_code == 0, result.output
    assert _opened(target) == local.states[("counts", 0)][7]


def test_restore_refuses_a_non_empty_target(local: Built, tmp_path: Path) -> None:
    target = tmp_path / "full"
    target.mkdir()
    (target / "precious").write_text("keep me")
    result = run("restore", local.uri, "counts", "-p", "0", "--to", str(target))
    assert result.exit_code == 2
    assert "not empty" in one_error_line(result)
    assert [p.name for p in target.iterdir()] == ["precious"]


def test_restore_refuses_a_target_inside_the_root(local: Built) -> None:
    """GC would take the restored files for orphans of the root and delete them."""
    target = Path(local.uri.removeprefix("file://")) / "counts" / "restored"
    result = run("restore", local.uri, "counts", "-p", "0", "--to", str(target))
    assert result.exit_code == 2
    assert "lies inside the checkpoint root" in one_error_line(result)
    assert not target.exists()


def test_restore_of_an_unknown_version_creates_nothing(local: Built, tmp_path: Path) -> None:
    target = tmp_path / "out" / "db"
    result = run("restore", local.uri, "counts", "-p", "0", "--version", "8", "--to", str(target))
    assert result.exit_code == 2
    line = one_error_line(result)
    assert "version 8" in line
    assert "0-7" in line
    assert not target.exists()


def test_restore_of_a_corrupt_store_fails_and_leaves_no_target(
    local: Built, tmp_path: Path
) -> None:
    blobs = local.blobs()
    try:
        key = history_of(blobs, "counts", 0).changelog_key(7)
        flip(blobs, key, -1)
    finally:
        blobs.close()
    target = tmp_path / "db"
    before = set(tmp_path.iterdir())
    result = run("restore", local.uri, "counts", "-p", "0", "--to", str(target))
    assert result.exit_code == 1
    assert key in one_error_line(result)
    assert set(tmp_path.iterdir()) == before  # no target, no staging folder beside it


def test_restore_shows_a_progress_bar_on_a_terminal(local: Built, tmp_path: Path) -> None:
    target = tmp_path / "db"
    args = ("restore", local.uri, "counts", "-p", "0", "--version", "5", "--to", str(target))
    result = run(*args, env={"TTY_COMPATIBLE": "1"})
    assert result.exit_code == 0, result.output
    assert "downloading counts/0@5" in result.stdout
    assert _opened(target) == local.states[("counts", 0)][5]
    target2 = tmp_path / "db2"
    quiet = run(*args[:-1], str(target2), "--json", env={"TTY_COMPATIBLE": "1"})
    assert json.loads(quiet.stdout)["version"] == 5  # no bar around the JSON


class _Reminder(StatefulProcessor):
    """Arms a timer a minute after each key's last row."""

    rows = "row"

    def init(self, handle: Any) -> None:
        self.handle = handle

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        for old in self.handle.list_timers():
            self.handle.delete_timer(old)
        self.handle.register_timer(self.handle.timer_values.processing_time_ms + 60_000)
        return iter(())


def test_inspect_lists_the_timers_of_a_keyed_store(tmp_path: Path) -> None:
    schema = pa.schema([("user", pa.string())])
    with ProcessorTester(
        _Reminder(), keys="user", output_schema=schema, time_mode="processing_time",
        directory=tmp_path / "t",
    ) as tester:  # fmt: skip
        tester.processing_time_ms = 1_000
        tester.run([{"user": "ann"}, {"user": "bob"}])
        tester.processing_time_ms = 5_000
        tester.run([{"user": "ann"}])
    uri = str(tmp_path / "t" / "root")
    doc = json.loads(run("inspect", uri, "tester", "-p", "0", "--timers", "--json").stdout)
    assert [(t["key"], t["expiry_ms"]) for t in doc["timers"]] == [
        (["bob"], 61_000),
        (["ann"], 65_000),
    ]
    assert (doc["version"], doc["truncated"]) == (2, False)
    args = ("inspect", uri, "tester", "-p", "0", "--timers", "--limit", "1")
    one = json.loads(run(*args, "--json").stdout)
    assert ([t["key"] for t in one["timers"]], one["truncated"]) == ([["bob"]], True)
    table = run(*args).stdout
    assert '["bob"]' in table
    assert "1970-01-01T00:01:01+00:00" in table
    assert "more timers follow" in table
    raw = sk.StateBackend(uri, config=sk.StoreConfig(local_dir=str(tmp_path / "raw")))
    with raw, raw.open("plain", 0) as store:
        store.put(b"k", b"v")
        store.commit()
    refused = run("inspect", uri, "plain", "-p", "0", "--timers")
    assert refused.exit_code == 2
    assert "holds no operator record" in one_error_line(refused)


def test_inspect_streams_a_long_listing_as_the_same_json_and_in_tables(tmp_path: Path) -> None:
    """``inspect --limit 0`` of a store of millions of keys held every item, decoded, and
    the whole document (17.6 GB at 5M keys): items are now written as they are scanned.
    The JSON is what one document would give; text comes as tables of 1,000 rows."""
    root = str(tmp_path / "root")
    config = sk.StoreConfig(local_dir=str(tmp_path / "w"))
    with sk.StateBackend(root, config=config) as backend, backend.open("big", 0) as store:
        store.put_many([(b"k%05d" % i, b"v%d" % i) for i in range(2500)])
        store.commit()
    result = run("inspect", root, "big", "-p", "0", "--json", "--limit", "0")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [i["key"] for i in doc["items"]] == [f"k{i:05d}" for i in range(2500)]
    assert doc["truncated"] is False
    # Byte for byte what json.dumps of the whole document gives (items before truncated).
    assert result.stdout == json.dumps(doc, indent=2) + "\n"
    limited = json.loads(run("inspect", root, "big", "-p", "0", "--json", "--limit", "3").stdout)
    assert (len(limited["items"]), limited["truncated"]) == (3, True)
    empty = run("inspect", root, "big", "-p", "0", "--json", "--prefix", "nope")
    assert json.loads(empty.stdout)["items"] == []
    text = run("inspect", root, "big", "-p", "0", "--limit", "0").stdout
    assert "2500 items" in text
    assert text.count("k02499") == 1
    assert "more items follow" not in text
