"""The layering of ``src/statekeeper`` holds: docs/layout.md is checked against real imports."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "statekeeper"
DOC = REPO / "docs" / "layout.md"

# Third-party imports allowed only in these packages (and their subpackages).
CONFINED = {
    "pyspark": ("spark", "cli.demo"),
    "pandas": ("keyed", "spark", "cli.demo"),
    "pyarrow": ("keyed", "spark", "cli.demo"),
    "click": ("cli",),
    "rich": ("cli",),
    "rocksdict": ("store", "repartition"),
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. "statekeeper.cli._data"
    target: str  # the imported module, e.g. "statekeeper.store._export"
    line: int


def layers() -> dict[str, int]:
    """Package -> layer, from the table in docs/layout.md."""
    out: dict[str, int] = {}
    for match in re.finditer(r"^\| (\d+) \| (.+?) \|", DOC.read_text(), re.MULTILINE):
        for name in re.findall(r"`([\w.]+)`", match.group(2)):
            out[name] = int(match.group(1))
    return out


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> list[Import]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        name = module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == "statekeeper":  # "from statekeeper import layout"
                    targets = [f"statekeeper.{a.name}" for a in node.names]
                else:
                    # "from statekeeper.x import _y" imports the module statekeeper.x._y.
                    targets = [node.module]
                    targets += [f"{node.module}.{a.name}" for a in node.names if a.name[0] == "_"]
                out += [Import(name, t, node.lineno) for t in targets]
            elif isinstance(node, ast.Import):
                out += [Import(name, a.name, node.lineno) for a in node.names]
    return out


def package(module: str) -> str:
    """The layer-table package of a statekeeper module ("statekeeper.cli.demo._run" -> "cli")."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def where(imp: Import) -> str:
    return f"{imp.module} (line {imp.line}) imports {imp.target}"


def test_every_package_has_a_layer() -> None:
    table = layers()
    found = {package(module_name(p)) for p in SRC.rglob("*.py")}
    assert found - set(table) == set(), "add these packages to docs/layout.md"
    assert set(table) - found == set(), "docs/layout.md names packages that do not exist"


def test_no_module_imports_from_a_higher_layer_or_a_sibling_package() -> None:
    table = layers()
    bad = []
    for imp in imports():
        if not imp.target.startswith("statekeeper."):
            continue
        own, other = package(imp.module), package(imp.target)
        if own == other:
            continue
        if table[other] > table[own]:
            bad.append(f"{where(imp)}: layer {table[other]} above {table[own]}")
        elif table[other] == table[own]:
            bad.append(f"{where(imp)}: sibling packages on layer {table[own]}")
    assert bad == []


def test_private_modules_are_imported_only_inside_their_package() -> None:
    bad = []
    for imp in imports():
        parts = imp.target.split(".")
        private = [i for i, part in enumerate(parts) if part.startswith("_")]
        if not imp.target.startswith("statekeeper.") or not private:
            continue
        home = ".".join(parts[: private[0]])  # the package holding the private module
        if not (imp.module == home or imp.module.startswith(home + ".")):
            bad.append(where(imp))
    assert bad == []


@pytest.mark.parametrize("library", sorted(CONFINED))
def test_third_party_libraries_stay_in_their_packages(library: str) -> None:
    allowed = tuple(f"statekeeper.{p}" for p in CONFINED[library])
    bad = [
        where(imp)
        for imp in imports()
        if imp.target.split(".")[0] == library
        and not any(imp.module == a or imp.module.startswith(a + ".") for a in allowed)
    ]
    assert bad == []


def test_module_names_do_not_repeat_across_packages() -> None:
    seen: dict[str, list[str]] = {}
    for path in SRC.rglob("_*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.name, []).append(module_name(path))
    assert {n: ms for n, ms in seen.items() if len(ms) > 1} == {}


def test_the_keyed_layer_decodes_state_without_pandas_or_pyarrow() -> None:
    """The command line (no spark extra) imports ``statekeeper.keyed``: that must not load
    the Arrow and pandas modules, which only its runner, output and testing modules use."""
    code = (
        "import sys, statekeeper.keyed, statekeeper.cli._data; "
        "print(sorted(m for m in ('pandas', 'pyarrow', 'pyspark') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"
