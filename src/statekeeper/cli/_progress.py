"""Progress bars (rich.progress) shown only to a person at a terminal.

With ``--json``, or when stdout is not a terminal (a pipe, a file, a test runner), every bar
is a no-op, so machine output stays exactly the document.
"""

from __future__ import annotations

from types import TracebackType
from typing import Literal

from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from statekeeper.cli._app import Env

__all__ = ["Bar", "Bars"]


class Bar:
    """One bar; every method is thread-safe and a no-op when progress is off."""

    def __init__(self, progress: Progress | None, task: TaskID | None) -> None:
        self._progress = progress
        self._task = task

    def advance(self, n: float) -> None:
        """Move the bar forward by ``n`` (bytes or items)."""
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, n)

    def set(self, done: float, total: float | None) -> None:
        """Set how much is done out of ``total`` (``None``: unknown)."""
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=done, total=total)


class Bars:
    """A group of bars, counting bytes (with a rate) or items; use as a context manager."""

    def __init__(self, env: Env, unit: Literal["bytes", "items"]) -> None:
        self._progress: Progress | None = None
        if env.progress_enabled:
            columns: list[ProgressColumn] = [
                TextColumn("{task.description}"),
                BarColumn(),
            ]
            if unit == "bytes":
                columns += [DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn()]
            else:
                columns += [MofNCompleteColumn(), TimeElapsedColumn()]
            self._progress = Progress(*columns, console=env.console, transient=True)

    @property
    def enabled(self) -> bool:
        """True when bars are actually drawn."""
        return self._progress is not None

    def add(self, description: str, total: float | None = None) -> Bar:
        """Start a new bar."""
        if self._progress is None:
            return Bar(None, None)
        return Bar(self._progress, self._progress.add_task(description, total=total))

    def __enter__(self) -> Bars:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
