"""How the demo looks: the live per-batch table, the restore table, notes and sizes.

On a terminal the batch table is redrawn live as micro-batches finish; elsewhere (a log, a
test) every batch is printed as one line when it finishes and the table once at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

from rich.console import Console
from rich.live import Live
from rich.table import Table

from statekeeper.cli.demo._rows import BatchRow, RestoreRow

__all__ = ["BatchBoard", "human_bytes", "restore_table"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
_PHASE_STYLE = {"crash": "yellow", "restart": "cyan", "cold": "magenta"}


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _opened(row: BatchRow) -> str:
    if row.stores_opened == 0:
        return "-"
    return f"{row.stores_opened} ({row.stores_opened - row.stores_restored} local)"


def _restored(row: BatchRow) -> str:
    if row.stores_restored == 0:
        return "-"
    return f"{row.stores_restored}: {human_bytes(row.restore_bytes)}, {row.restore_s:.2f} s"


def _cells(row: BatchRow) -> list[str]:
    duration = "" if row.duration_ms is None else f"{row.duration_ms / 1000:.1f} s"
    return [
        f"[{_PHASE_STYLE.get(row.phase, '')}]{row.phase}[/]",
        str(row.batch_id),
        f"{row.rows_in:,}",
        f"{row.late_rows:,}",
        f"{row.sessions_closed:,}",
        f"{row.open_sessions:,}",
        f"{row.commit_p50_ms:.1f} ms",
        human_bytes(row.bytes_uploaded),
        f"yes ({row.snapshots})" if row.snapshots else "-",
        _opened(row),
        _restored(row),
        duration,
    ]


def _line(row: BatchRow) -> str:
    """One finished batch as a sentence (when the table is not redrawn live)."""
    snapshot = f"{row.snapshots} snapshots scheduled" if row.snapshots else "no snapshot"
    opened = ""
    if row.stores_opened:
        opened = f"; {row.stores_opened} stores opened, {row.stores_restored} from the root"
        if row.stores_restored:
            opened += f" ({human_bytes(row.restore_bytes)} in {row.restore_s:.2f} s)"
    duration = "" if row.duration_ms is None else f"; {row.duration_ms / 1000:.1f} s"
    return (
        f"  batch {row.batch_id}: {row.rows_in:,} rows ({row.late_rows:,} late, dropped), "
        f"{row.sessions_closed:,} sessions closed, {row.open_sessions:,} open, commit p50 "
        f"{row.commit_p50_ms:.1f} ms, {human_bytes(row.bytes_uploaded)} uploaded, "
        f"{snapshot}{opened}{duration}"
    )


class BatchBoard:
    """The table of micro-batches, growing as they finish. A context manager."""

    _HEADERS = (
        "phase", "batch", "rows", "late", "closed", "open", "commit p50", "uploaded", "snapshot",
        "stores opened", "restored from root", "time",
    )  # fmt: skip

    def __init__(self, console: Console) -> None:
        """Show batches on ``console``."""
        self.console = console
        self.rows: list[BatchRow] = []
        self._live: Live | None = None

    def table(self) -> Table:
        """The table of every batch so far."""
        table = Table(title="micro-batches of operator 'sessions'", title_justify="left")
        for i, header in enumerate(self._HEADERS):
            table.add_column(header, justify="right" if 1 <= i <= 7 else "left")
        for row in self.rows:
            table.add_row(*_cells(row))
        return table

    def add(self, row: BatchRow) -> None:
        """Show one more finished batch."""
        self.rows.append(row)
        if self._live is not None:
            self._live.update(self.table())
        else:
            self.console.print(_line(row), highlight=False, soft_wrap=True)

    def note(self, text: str) -> None:
        """Print a line above the table."""
        self.console.print(text, highlight=False, soft_wrap=True)

    def __enter__(self) -> BatchBoard:
        if self.console.is_terminal:
            self._live = Live(self.table(), console=self.console, refresh_per_second=8)
            self._live.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._live is not None:
            self._live.__exit__(exc_type, exc, tb)
            self._live = None
        elif self.rows:
            self.console.print(self.table())


def restore_table(rows: Sequence[RestoreRow]) -> Table:
    """How the state came back: after the crash, on an empty local dir, and by ``open``."""
    table = Table(title="restores", title_justify="left")
    for header in ("restart", "stores", "from root", "downloaded", "time", "how"):
        table.add_column(header, justify="right" if header in ("stores", "from root") else "left")
    for r in rows:
        table.add_row(
            r.how,
            str(r.stores),
            str(r.restored),
            human_bytes(r.bytes_downloaded),
            f"{r.seconds:.3f} s",
            r.detail,
        )
    return table
