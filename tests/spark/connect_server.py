"""A local Spark Connect server from the pip-installed PySpark, on a free loopback port.

Started and stopped with the scripts ``docs/operations.md`` shows (``start-connect-server.sh``
and ``stop-connect-server.sh`` under ``$SPARK_HOME/sbin``, ``SPARK_HOME`` being the
``pyspark`` package folder); its pid file and logs go to a test folder so that nothing is
left behind and two runs never share a pid file.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyspark

SPARK_HOME = str(Path(pyspark.__file__).parent)


def free_port() -> int:
    """A TCP port nothing listens on now (on 127.0.0.1)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ConnectServer:
    """A running Spark Connect server."""

    port: int
    env: dict[str, str]
    log_dir: Path

    @property
    def url(self) -> str:
        """The ``sc://`` URL of the server."""
        return f"sc://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Stop the server with Spark's script (waits for the JVM to exit)."""
        script = f"{SPARK_HOME}/sbin/stop-connect-server.sh"
        subprocess.run(["bash", script], env=self.env, check=True, capture_output=True)

    def log(self) -> str:
        """The server's log so far (for failure messages)."""
        return "".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob("*.out")))


def start_connect_server(
    work: Path, *, master: str = "local[2]", timeout: float = 120
) -> ConnectServer:
    """Start a Connect server whose Python workers run this interpreter.

    Raises:
        RuntimeError: it did not listen within ``timeout`` seconds (the log is included).
    """
    port = free_port()
    log_dir = work / "logs"
    env = {
        **os.environ,
        "SPARK_HOME": SPARK_HOME,
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOG_DIR": str(log_dir),
        "SPARK_PID_DIR": str(work / "pids"),
        "SPARK_IDENT_STRING": f"statekeeper-test-{port}",
    }
    command = [
        "bash", f"{SPARK_HOME}/sbin/start-connect-server.sh",
        "--master", master,
        "--conf", f"spark.connect.grpc.binding.port={port}",
        "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
        "--conf", "spark.sql.shuffle.partitions=2",
        "--conf", "spark.ui.enabled=false",
        "--conf", "spark.sql.session.timeZone=UTC",
        "--conf", f"spark.local.dir={work / 'spark-local'}",
    ]  # fmt: skip
    subprocess.run(command, env=env, check=True, capture_output=True)
    server = ConnectServer(port, env, log_dir)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return server
        time.sleep(0.5)
    log = server.log()
    server.stop()
    raise RuntimeError(f"the Spark Connect server did not listen on {port}:\n{log[-4000:]}")
