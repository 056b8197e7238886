"""The crash: run the first phase's driver in a child process and kill it hard mid-batch.

Once the child reports micro-batch ``kill_after`` done, the parent watches the checkpoint
root, and the moment a partition commits the state of the next batch it sends ``SIGKILL``
to the child's process group and to every process descended from the child (the JVM, and
Spark's Python daemon and workers, which sit in a process group of their own). Nothing gets
to clean up: no query stop, no store close; the kernel releases their file locks. Spark has
then planned that batch but not committed it, while some state partitions already hold its
version: the restart must re-run it and recommit the same state.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from statekeeper.cli.demo._options import OPERATOR, DemoError, DemoOptions
from statekeeper.cli.demo._rows import BatchRow, decode_message
from statekeeper.cli.demo._show import BatchBoard
from statekeeper.config import StoreConfig
from statekeeper.store import StateBackend

__all__ = ["CrashReport", "crash_phase", "describe"]

_PHASE_TIMEOUT_S = 300.0
_POLL_S = 0.02


@dataclass(frozen=True)
class CrashReport:
    """What the kill left behind."""

    pid: int
    killed: int
    """Processes killed: the driver and its descendants."""
    returncode: int
    batches_done: int
    """Micro-batches the child reported finished before it was killed."""
    planned: int | None
    """The newest batch in Spark's offset log (planned, possibly running)."""
    committed: int | None
    """The newest batch in Spark's commit log (finished)."""
    versions: list[int]
    """The newest state version of each partition in the root."""


def crash_phase(options: DemoOptions, kill_after: int, board: BatchBoard) -> CrashReport:
    """Run the crash phase's driver in a child process and kill it; report the aftermath.

    Raises:
        DemoError: the child failed or went silent before it could be killed.
    """
    paths = options.paths()
    paths.logs.mkdir(parents=True, exist_ok=True)
    log_path = paths.logs / "crash-driver.log"
    env = dict(os.environ)
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    command = [sys.executable, "-m", "statekeeper.cli.demo._child", options.to_json()]
    with log_path.open("wb") as log, _watcher(options) as backend:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True, text=True
        )
        driver = _Driver(proc, board, log_path)
        try:
            driver.run(kill_after, backend, options.partitions)
        finally:
            if not driver.killed and proc.poll() is None:
                driver.kill("after a failure of the demo")
            proc.wait()
        versions = [(backend.versions(OPERATOR, p) or [0])[-1] for p in range(options.partitions)]
    return CrashReport(
        pid=proc.pid,
        killed=driver.killed,
        returncode=proc.returncode,
        batches_done=driver.done,
        planned=_newest(paths.checkpoint / "offsets"),
        committed=_newest(paths.checkpoint / "commits"),
        versions=versions,
    )


def _watcher(options: DemoOptions) -> StateBackend:
    paths = options.paths()
    return StateBackend(
        paths.root,
        config=StoreConfig(local_dir=str(paths.monitor / "crash-watch")),
        storage_options=options.storage_options or None,
    )


class _Driver:
    """The child process, its reports, and its end."""

    def __init__(self, proc: subprocess.Popen[str], board: BatchBoard, log: Path) -> None:
        assert proc.stdout is not None
        self.proc = proc
        self.board = board
        self.log = log
        self.done = 0
        self.killed = 0
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._deadline = time.monotonic() + _PHASE_TIMEOUT_S
        threading.Thread(target=_pump, args=(proc.stdout, self._lines), daemon=True).start()

    def run(self, kill_after: int, backend: StateBackend, partitions: int) -> None:
        """Show the child's batches; kill it while the batch after ``kill_after`` commits."""
        while True:
            message = self._next(timeout=max(0.0, self._deadline - time.monotonic()))
            if message is None:
                raise DemoError(f"the crash phase's driver went silent; see {self.log}")
            if message["event"] == "session":
                self.board.note(f"  driver pid {self.proc.pid}: Spark session up, query started")
            elif message["event"] == "idle":
                self.kill("after its last micro-batch (it was faster than the kill)")
                return
            elif message["event"] == "batch" and self._batch(message["row"]) >= kill_after:
                break
        target = kill_after + 2  # the version the next batch commits
        while time.monotonic() < self._deadline:
            versions = [(backend.versions(OPERATOR, p) or [0])[-1] for p in range(partitions)]
            committed = sum(v >= target for v in versions)
            if committed:
                self.kill(
                    f"during micro-batch {kill_after + 1}, when {committed} of {partitions} "
                    f"partitions had committed its state (version {target})"
                )
                return
            message = self._next(timeout=_POLL_S)
            if message is not None and message["event"] in ("batch", "idle"):
                if message["event"] == "batch":
                    self._batch(message["row"])
                self.kill(f"after micro-batch {kill_after + 1} (it was faster than the kill)")
                return
        raise DemoError(f"the crash phase's driver did not get on; see {self.log}")

    def _batch(self, row: BatchRow) -> int:
        self.board.add(row)
        self.done += 1
        return row.batch_id

    def _next(self, timeout: float) -> dict[str, Any] | None:
        """The next protocol message, or ``None`` after ``timeout``.

        Raises:
            DemoError: the child reported an error, or exited.
        """
        end = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                return None
            if line is None:
                raise DemoError(f"the crash phase's driver exited on its own; see {self.log}")
            message = decode_message(line)
            if message is not None and message["event"] == "error":
                raise DemoError(f"the crash phase's driver failed: {message['message']}")
            if message is not None:
                return message

    def kill(self, when: str) -> None:
        """SIGKILL the child's process group and every process descended from it."""
        victims = _descendants(self.proc.pid)
        os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):  # gone with the process group
                os.kill(pid, signal.SIGKILL)
        self.killed = 1 + len(victims)
        self.board.note(
            f"[bold red]CRASH[/]: killed the driver (pid {self.proc.pid}) {when}, with "
            f"SIGKILL, together with its {len(victims)} descendant processes (the JVM, "
            "Spark's Python workers)"
        )


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from ``/proc``; empty where there is none)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found.extend(kids)
        todo.extend(kids)
    return found


def _newest(folder: Path) -> int | None:
    """The highest numbered file of a Spark checkpoint log folder."""
    if not folder.is_dir():
        return None
    numbers = [int(p.name) for p in folder.iterdir() if p.name.isdigit()]
    return max(numbers, default=None)


def describe(report: CrashReport) -> list[str]:
    """Lines explaining the aftermath of the crash."""
    out = [
        f"  {report.killed} processes killed; the driver's exit status is "
        f"{report.returncode}; {report.batches_done} micro-batches had finished",
        f"  Spark's offset log plans batch {report.planned}, its commit log ends at batch "
        f"{report.committed}; newest state version per partition: {report.versions}",
    ]
    planned = report.planned
    if planned is not None and planned != report.committed:
        ahead = [p for p, v in enumerate(report.versions) if v > planned]
        out.append(
            f"  so the restart re-runs batch {planned} from state version {planned}"
            + (
                f"; partitions {ahead} already hold version {planned + 1} and must "
                "recommit the same state"
                if ahead
                else ""
            )
        )
    return out
