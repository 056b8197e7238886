"""The command group: entry points, global options, exit codes and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from statekeeper.cli import main
from statekeeper.cli._app import Env
from tests.cli.conftest import Built, build_root, one_error_line, run

COMMANDS = ("gc", "info", "inspect", "restore", "stats", "verify", "versions")


def test_python_dash_m_runs_the_command_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "statekeeper", "--help"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for command in COMMANDS:
        assert command in done.stdout


def test_main_exits_with_the_command_status(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert "statekeeper" in capsys.readouterr().out


def test_without_the_cli_extra_the_command_says_how_to_install_it() -> None:
    code = (
        "import sys; sys.modules['rich'] = None; "
        "from statekeeper.__main__ import main; main(['--version'])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "pip install 'statekeeper[cli]'" in done.stderr
    assert "needs rich" in done.stderr
    assert "Traceback" not in done.stderr


def test_cli_import_does_not_import_pyspark() -> None:
    code = "import sys, statekeeper.cli; print('pyspark' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "False"


def test_json_is_accepted_before_and_after_the_command(local: Built) -> None:
    before = run("--json", "info", local.uri)
    after = run("info", local.uri, "--json")
    assert before.exit_code == after.exit_code == 0
    assert json.loads(before.stdout)["root_id"] == json.loads(after.stdout)["root_id"]


@pytest.mark.parametrize(
    "option",
    ["novalue", "=value", "endpoint=a -o endpoint=b"],
    ids=["no-equals", "no-key", "twice"],
)
def test_malformed_storage_option_is_a_usage_error(option: str) -> None:
    args = [a for part in option.split(" -o ") for a in ("-o", part)]
    result = run("info", "s3://bucket/root", *args)
    assert result.exit_code == 2
    line = one_error_line(result)
    assert "--storage-option" in line


def test_unknown_storage_option_names_it(tmp_path: Path) -> None:
    result = run("info", "s3://bucket/root", "-o", "no_such_option=1")
    assert result.exit_code == 2
    assert "no_such_option" in one_error_line(result)


def test_storage_option_for_a_local_root_is_a_usage_error(local: Built) -> None:
    result = run("info", local.uri, "-o", "endpoint=http://x")
    assert result.exit_code == 2
    assert "storage_options" in one_error_line(result)


def test_missing_local_root_is_a_usage_error_and_is_not_created(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    for command in (["info"], ["verify"], ["versions"], ["stats"]):
        args = [*command, str(missing)] + (["op"] if command == ["versions"] else [])
        result = run(*args)
        assert result.exit_code == 2, result.output
        assert str(missing) in one_error_line(result)
    assert not missing.exists()


def test_folder_without_root_metadata_is_a_usage_error(tmp_path: Path) -> None:
    result = run("info", f"file://{tmp_path}")
    assert result.exit_code == 2
    assert "_statekeeper.json" in one_error_line(result)


@pytest.mark.s3
@pytest.mark.parametrize("bucket", ["empty", "missing"])
def test_bucket_without_root_metadata_is_a_usage_error(
    s3_root: tuple[str, dict[str, str]], bucket: str
) -> None:
    uri, options = s3_root
    if bucket == "missing":
        uri = "s3://sk-no-such-bucket/root"
    opts = [a for k, v in options.items() for a in ("-o", f"{k}={v}")]
    result = run("info", uri, *opts)
    assert result.exit_code == 2
    line = one_error_line(result)
    if bucket == "missing":  # not "holds no _statekeeper.json": the URI is what is wrong
        assert f"cannot open checkpoint root {uri}" in line
        assert "bucket or container not found" in line
    else:
        assert f"{uri} is not a statekeeper checkpoint root" in line
    assert options["secret_access_key"] not in result.output


def test_missing_argument_is_one_line_with_a_hint() -> None:
    result = run("info")
    assert result.exit_code == 2
    line = one_error_line(result)
    assert "ROOT" in line
    assert "statekeeper info --help" in line


def test_unknown_command_is_one_line() -> None:
    result = run("frobnicate")
    assert result.exit_code == 2
    assert "frobnicate" in one_error_line(result)


def test_verbose_adds_the_traceback(tmp_path: Path) -> None:
    result = run("--verbose", "info", str(tmp_path / "nope"))
    assert result.exit_code == 2
    assert "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("statekeeper: error: ")


def test_verbose_logs_what_the_library_does(local: Built) -> None:
    result = run("inspect", local.uri, "counts", "-p", "0", "--verbose")
    assert result.exit_code == 0
    assert "restored counts/0" in result.stderr


def test_read_commands_never_write_to_the_root(root: Built, tmp_path: Path) -> None:
    blobs = root.blobs()
    try:
        before = [(m.key, m.size, m.etag) for m in blobs.list("")]
        for args, code in (
            (["info"], 0),
            (["versions", "counts"], 0),
            (["inspect", "counts", "-p", "0", "--version", "4"], 0),
            (["inspect", "unknown", "-p", "0"], 2),  # must not register the operator
            (["stats"], 0),
            (["verify", "--deep"], 0),
            (["restore", "snap", "-p", "0", "--to", str(tmp_path / "db")], 0),
            (["gc", "--dry-run"], 0),
        ):
            # Each command did its work (or refused as asked): nothing written is no accident.
            result = run(args[0], root.uri, *root.opts, *args[1:])
            assert result.exit_code == code, (args, result.output)
        assert [(m.key, m.size, m.etag) for m in blobs.list("")] == before
    finally:
        blobs.close()


@pytest.mark.s3
def test_credentials_never_appear_in_output(
    s3_root: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    uri, options = s3_root
    secret = "SUPERSECRET-CLI-5f4dcc3b"
    built = build_root(uri, {**options, "secret_access_key": secret}, tmp_path)
    runs = [
        ["info"],
        ["versions", "counts"],
        ["inspect", "counts", "-p", "0"],
        ["stats"],
        ["verify", "--deep"],
        ["restore", "counts", "-p", "0", "--to", str(tmp_path / "db")],
        ["gc", "--dry-run", "--list"],
        ["inspect", "nope", "-p", "0"],
        ["info", "-o", "no_such_option=1"],
    ]
    for args in runs:
        for extra in ([], ["--json"]):
            result = run(args[0], built.uri, *built.opts, *args[1:], "--verbose", *extra)
            assert secret not in result.output, args
            assert secret not in result.stderr, args


def test_a_streamed_json_list_is_written_while_it_is_produced(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What inspect and diff --limit 0 rely on: items are written as they come (a chunk at a time),
    never held whole, and the output is exactly one json.dumps document."""
    seen: list[str] = []

    def items() -> Iterator[dict[str, int]]:
        for i in range(2500):
            if i == 1500:
                seen.append(capsys.readouterr().out)  # what was written by then
            yield {"i": i}

    deep: list[Any] = []
    for _ in range(700):
        deep = [deep]

    def parts() -> Iterator[dict[str, Any]]:
        yield {"partition": 0, "items": items(), "more": lambda: len(seen)}
        yield {"partition": 1, "items": iter([]), "nested": {"at": {"end": [1.5, None]}}}
        yield {"deep": deep}  # an item's own values are json's to walk, however deep

    Env(json=True).emit_json({"root": "r", "parts": parts(), "empty": {}, "n": {1: None}})
    rest = capsys.readouterr().out
    assert seen[0].count('"i"') == 1000  # the first chunk was out before item 1500 was made
    doc = {
        "root": "r",
        "parts": [
            {"partition": 0, "items": [{"i": i} for i in range(2500)], "more": 1},
            {"partition": 1, "items": [], "nested": {"at": {"end": [1.5, None]}}},
            {"deep": deep},
        ],
        "empty": {},
        "n": {1: None},
    }
    assert seen[0] + rest == json.dumps(doc, indent=2) + "\n"
