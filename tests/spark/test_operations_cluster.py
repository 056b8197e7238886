"""Every command of ``docs/operations.md``'s "Running on a cluster" section runs as written.

Two adjustments keep the test from touching the developer's environment, and nothing else
changes: the wheel goes to a temporary ``dist`` folder, and the install goes into a
temporary ``--target`` folder without dependencies (they are installed here already).
The Connect server gets a free port instead of 15002 and a private pid and log folder.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from tests.spark.conftest import SparkHolder
from tests.spark.connect_server import SPARK_HOME, free_port

pytestmark = [pytest.mark.spark, pytest.mark.connect, pytest.mark.slow]

REPO = Path(__file__).parents[2]
SECTION = "## Running on a cluster"


def section_commands() -> list[str]:
    """The command lines of the section's ``bash`` blocks, in order."""
    text = (REPO / "docs" / "operations.md").read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    body = text[start : end if end > 0 else len(text)]
    blocks = re.findall(r"```bash\n(.*?)```", body, flags=re.S)
    return [line.strip() for b in blocks for line in b.splitlines() if line.strip()]


def run(command: str, env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(
        ["bash", "-c", command], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
    return done.stdout


def wait_for_port(port: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise AssertionError(f"the Connect server did not listen on {port}")


def test_the_cluster_section_commands_run(no_classic_session: SparkHolder, tmp_path: Path) -> None:
    commands = section_commands()
    assert len(commands) == 6
    build, install, check, export, start, stop = commands
    port = free_port()
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_PID_DIR": str(tmp_path / "pids"),
        "SPARK_LOG_DIR": str(tmp_path / "logs"),
        "SPARK_IDENT_STRING": f"statekeeper-docs-{port}",
    }
    dist = tmp_path / "dist"
    run(build.replace("--wheel-dir dist", f"--wheel-dir {dist}"), env, REPO)
    site = tmp_path / "site"
    run(install.replace('"dist/', f'"{dist}/') + f" --no-deps --target {site}", env, REPO)
    assert (site / "statekeeper" / "spark" / "__init__.py").is_file()
    run(check, {**env, "PYTHONPATH": str(site)}, tmp_path)

    assert run(f"{export} && echo $SPARK_HOME", env, tmp_path).strip() == SPARK_HOME
    run(f"{export} && {start.replace('15002', str(port))}", env, tmp_path)
    try:
        wait_for_port(port)
        spark = SparkSession.builder.remote(f"sc://localhost:{port}").getOrCreate()
        try:
            assert spark.range(3).count() == 3
        finally:
            spark.stop()
    finally:
        run(f"{export} && {stop}", env, tmp_path)
