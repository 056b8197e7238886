"""``inspect`` and ``restore`` against a real root (local and S3)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import rocksdict

from statekeeper import layout
from tests.cli.conftest import Built, flip, one_error_line, run


@pytest.fixture
def no_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Spark layer is not importable: values are shown raw."""
    monkeypatch.setitem(__import__("sys").modules, "statekeeper.spark", None)


@pytest.fixture
def codec(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Spark layer whose codec decodes b"v<n>" to {"v": n} and fails on anything else."""
    module = types.ModuleType("statekeeper.spark")

    def decode_value(data: bytes) -> object:
        if not data.startswith(b"v"):
            raise ValueError("not one of ours")
        return {"v": int(data[1:])}

    module.decode_value = decode_value  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "statekeeper.spark", module)


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


@pytest.mark.usefixtures("no_codec")
@pytest.mark.parametrize("version", [0, 2, 5, 7])
def test_inspect_shows_exactly_the_state_at_a_version(root: Built, version: int) -> None:
    doc = _inspect(root, "counts", "-p", "0", "--version", str(version), "--limit", "0")
    assert doc["version"] == version
    assert doc["truncated"] is False
    assert _raw(doc) == root.states[("counts", 0)][version]


@pytest.mark.usefixtures("no_codec")
def test_inspect_defaults_to_the_latest_version(root: Built) -> None:
    doc = _inspect(root, "snap", "-p", "0")
    assert doc["version"] == 3
    assert _raw(doc) == root.states[("snap", 0)][3]


@pytest.mark.usefixtures("no_codec")
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


@pytest.mark.usefixtures("no_codec")
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


@pytest.mark.usefixtures("codec")
def test_inspect_decodes_values_with_the_spark_codec(root: Built) -> None:
    doc = _inspect(root, "counts", "-p", "0", "--limit", "2")
    assert [(i["value"], i["value_format"]) for i in doc["items"]] == [  # type: ignore[union-attr]
        ({"v": 7}, "decoded"),
        ({"v": 7}, "decoded"),
    ]
    doc = _inspect(root, "counts", "-p", "1")
    formats = {i["key"]: i["value_format"] for i in doc["items"]}  # type: ignore[union-attr]
    assert formats == {"0001": "hex", "text": "text"}  # the codec failed: raw bytes shown
    table = run("inspect", root.uri, *root.opts, "counts", "-p", "0").stdout
    assert '{"v": 7}' in table


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
    key = layout.changelog_key("counts", 0, 2)
    blobs = root.blobs()
    try:
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
    key = layout.changelog_key("counts", 0, 7)
    blobs = local.blobs()
    try:
        flip(blobs, key, -1)
    finally:
        blobs.close()
    target = tmp_path / "db"
    result = run("restore", local.uri, "counts", "-p", "0", "--to", str(target))
    assert result.exit_code == 1
    assert key in one_error_line(result)
    assert not target.exists()
    assert list(tmp_path.glob(".statekeeper-restore-*")) == []


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


def test_inspect_shows_values_the_codec_returns_as_non_json_by_repr(
    root: Built, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = types.ModuleType("statekeeper.spark")
    module.decode_value = lambda data: {len(data)} if data != b"v7" else None  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "statekeeper.spark", module)
    doc = _inspect(root, "counts", "-p", "1")
    assert {i["key"]: i["value"] for i in doc["items"]} == {"0001": "{2}", "text": "{11}"}  # type: ignore[union-attr]
    doc = _inspect(root, "counts", "-p", "0", "--limit", "1")
    assert [(i["value"], i["value_format"]) for i in doc["items"]] == [(None, "decoded")]  # type: ignore[union-attr]
