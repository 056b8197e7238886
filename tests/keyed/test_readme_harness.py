"""The README's harness example runs as written, without pyspark."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = (Path(__file__).parents[2] / "README.md").read_text()


def test_the_readme_harness_example_runs_without_pyspark() -> None:
    section = README[README.index("## Testing a processor without Spark") :]
    code = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    namespace: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), namespace)  # its asserts are the test
    assert "tester" in namespace


def test_the_harness_imports_no_pyspark() -> None:
    probe = "import sys, statekeeper.keyed.testing; print('pyspark' in sys.modules)"
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == "False"
