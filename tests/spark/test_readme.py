"""Every code example and command in README.md and docs/ runs as written.

Python blocks of the README run in order in one namespace (with ``spark`` defined, as in a
pyspark shell); relative paths in them are made absolute under a temporary folder because
the JVM resolves paths against its own working directory. Shell blocks' ``statekeeper``
commands run through the CLI with the README's placeholders filled in.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

import statekeeper as sk
from statekeeper import layout
from statekeeper.changelog import HEADER_SIZE, MAGIC
from statekeeper.cli import cli
from statekeeper.store._root import RootMetadata
from tests.spark.conftest import SparkHolder
from tests.spark.helpers import json_key_names

pytestmark = pytest.mark.spark

REPO = Path(__file__).parents[2]
README = (REPO / "README.md").read_text()
RELATIVE = ("events/", "app-state", "counts/", "spark-checkpoint/")


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def absolute(code: str, tmp: Path) -> str:
    for rel in RELATIVE:
        code = code.replace(f'"{rel}"', repr(str(tmp / rel)))
    return code


def commands(text: str) -> list[list[str]]:
    """The ``statekeeper ...`` lines of the shell blocks, comments stripped."""
    out = []
    for block in blocks(text, "sh"):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("statekeeper "):
                out.append(shlex.split(line)[1:])
    return out


def run_cli(args: list[str]) -> None:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, (args, result.output)


def test_readme_examples_and_commands(
    spark_holder: SparkHolder,
    tmp_path: Path,
    s3_root: tuple[str, dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The examples that open stores in this process keep the default `local_dir`, the
    # system temp dir's `statekeeper/` (README's configuration table): the test's own here.
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    events = tmp_path / "events"
    events.mkdir()
    rows = [{"user": f"u{i % 7}", "page": f"/p{i % 3}"} for i in range(50)]
    (events / "part-0.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    uri, options = s3_root
    namespace: dict[str, object] = {"spark": spark_holder.get(), "__name__": "__readme__"}
    python = blocks(README, "python")
    assert len(python) == 5  # the harness example (no Spark) among them
    for code in python:
        code = absolute(code, tmp_path)
        code = code.replace('"s3://my-bucket/pipelines/clicks"', repr(uri))
        code = code.replace('storage_options={"region": "eu-west-1"}', "storage_options=OPTIONS")
        namespace["OPTIONS"] = options
        exec(compile(code, "README.md", "exec"), namespace)
    assert list((system_tmp / "statekeeper").iterdir())  # the default local_dir was used
    counts = spark_holder.get().read.parquet(str(tmp_path / "counts"))
    latest = counts.groupBy("user").max("count").collect()
    assert {r["user"]: r["max(count)"] for r in latest} == {
        f"u{u}": sum(1 for i in range(50) if i % 7 == u) for u in range(7)
    }
    root = str(tmp_path / "app-state")
    filled = {"ROOT": root, "OPERATOR": "running_count", "N": "0", "DIR": str(tmp_path / "out")}
    ran = 0
    for args in commands(README):
        run_cli([filled.get(a, a) for a in absolute_args(args, tmp_path)])
        ran += 1
    assert ran == 11


def absolute_args(args: list[str], tmp: Path) -> list[str]:
    return [str(tmp / a) if a in RELATIVE else a for a in args]


def test_operations_commands_run(tmp_path: Path) -> None:
    text = (REPO / "docs" / "operations.md").read_text()
    root = str(tmp_path / "root")
    backend = sk.StateBackend(root, config=sk.StoreConfig(local_dir=str(tmp_path / "l")))
    with backend.open("sessions", 0, partitions=1) as store:
        for v in range(3):
            store.put(b"\x00\x07k%d" % v, b"v")  # in key group 7: repartition moves it
            store.commit()
    fill = {"ROOT": root, "OPERATOR": "sessions", "DIR": str(tmp_path / "restored")}
    ran = 0
    for args in commands(text):
        run_cli([fill.get(a, a) for a in args])
        ran += 1
    assert ran == 10


def test_configuration_table_lists_every_field_with_its_default() -> None:
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", README, flags=re.M))
    fields = {f.name: f.default for f in dataclasses.fields(sk.StoreConfig)}
    assert set(rows) == set(fields)
    for name, default in fields.items():
        shown = f'"{default}"' if isinstance(default, str) else repr(default)
        assert rows[name] == shown, name


def test_format_doc_matches_the_code(tmp_path: Path) -> None:
    text = (REPO / "docs" / "format.md").read_text()
    example = json.loads(blocks(text, "json")[0])
    meta = RootMetadata.from_json(json.dumps(example).encode(), blob="example")
    assert meta.operators == {"sessions": 2}
    assert (meta.format_version, meta.generations) == (2, {"sessions": 3})
    assert meta.retentions == {"sessions": sk.Retention(100, 604800.0)}
    assert RootMetadata.from_json(meta.to_json(), blob="again") == meta
    assert f"magic `{MAGIC.decode()}`" in text
    assert f"A {HEADER_SIZE}-byte header" in text
    assert layout.changelog_key("op", 3, 7) == "op/3/changelog/00000000000000000007.changelog"
    assert layout.attempt_changelog_key("op", 3, 7, "a1") == (
        "op/3/changelog/00000000000000000007-a1.changelog"
    )
    for pattern in (
        "changelog/<version:020d>.changelog",
        "snapshot/<version:020d>.index.json",
        "manifest/<seq:020d>.json",
        "changelog/<version:020d>-<attempt>.changelog",
        "snapshot/<version:020d>-<upload>.index.json",
    ):
        assert pattern in text
    backend = sk.StateBackend(
        str(tmp_path / "root"), config=sk.StoreConfig(local_dir=str(tmp_path))
    )
    with backend.open("sessions", 0) as store:
        store.put(b"k", b"v")
        store.commit()
        metrics = store.snapshot_now()
    assert metrics is not None
    index = json.loads((tmp_path / "root" / metrics.index_blob).read_text())
    documented = set(re.findall(r'"(\w+)":', blocks(text, "json")[1]))
    actual = json_key_names(index)
    assert documented == actual


def test_every_public_name_is_documented() -> None:
    """Each name ``statekeeper`` or ``statekeeper.spark`` exports appears in the README or
    in docs/api.md (where the reference of what the README does not show lives)."""
    import statekeeper.spark

    text = README + (REPO / "docs" / "api.md").read_text()
    for module in (sk, statekeeper.spark):
        missing = [n for n in module.__all__ if not re.search(rf"`[^`]*\b{re.escape(n)}\b", text)]
        assert missing == [], f"{module.__name__} exports names no doc mentions: {missing}"
    assert "docs/api.md" in README
