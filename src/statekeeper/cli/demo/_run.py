"""The demo from start to end: phases, crash, restores, the equality check and the summary."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pyspark.sql import SparkSession
from rich.console import Console

from statekeeper import layout
from statekeeper.cli.demo._clicks import Click, batch_clicks, write_batch
from statekeeper.cli.demo._crash import CrashReport, crash_phase, describe
from statekeeper.cli.demo._options import OPERATOR, DemoOptions
from statekeeper.cli.demo._pipeline import build_session, run_phase
from statekeeper.cli.demo._reference import Outcome, compare, expected_sessions, shown, state_of
from statekeeper.cli.demo._rows import BatchRow, RestoreRow
from statekeeper.cli.demo._show import BatchBoard, human_bytes, restore_table
from statekeeper.cli.demo._workdir import prepare
from statekeeper.config import StoreConfig
from statekeeper.spark import latest_epoch, read_state
from statekeeper.store import StateBackend

__all__ = ["run"]


class _Clock:
    """Wall time of the whole run and of each phase."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.phases: dict[str, float] = {}
        self._mark = self.started

    def lap(self, phase: str) -> None:
        """End ``phase`` now."""
        now = time.perf_counter()
        self.phases[phase] = now - self._mark
        self._mark = now

    @property
    def total(self) -> float:
        """Seconds since the start."""
        return time.perf_counter() - self.started


@dataclass
class _Run:
    """One run's options and what it has found so far."""

    options: DemoOptions
    console: Console
    clock: _Clock = field(default_factory=_Clock)
    batches: list[list[Click]] = field(default_factory=list)
    """The clicks of every input file written, one list per micro-batch."""
    spark: SparkSession | None = None
    crash: CrashReport | None = None
    rows: list[BatchRow] = field(default_factory=list)
    restores: list[RestoreRow] = field(default_factory=list)


def run(options: DemoOptions, console: Console | None = None) -> int:
    """Run the demo (see :mod:`statekeeper.cli.demo`); returns the exit code.

    Raises:
        DemoError: the demo folder or root is not the demo's, or a phase failed.
        StateKeeperError: the checkpoint root failed.
    """
    console = console or Console(highlight=False)
    if not console.is_terminal:  # a log or a test: room for the tables, nobody's screen
        console = Console(file=console.file, highlight=False, width=max(console.width, 120))
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    demo = _Run(options, console)
    prepare(options)
    _intro(console, options)
    try:
        with BatchBoard(console) as board:
            demo.rows = board.rows
            _stream(demo, board)
        demo.restores = [*_pipeline_restores(demo.rows), _open_restore(options)]
        console.print(restore_table(demo.restores))
        assert demo.spark is not None
        outcome = _check(demo.spark, options, demo.batches, console)
        demo.clock.lap("check")
    finally:
        if demo.spark is not None:
            demo.spark.stop()
    problems = _summary(demo, outcome)
    return 0 if outcome.passed and not problems else 1


def _intro(console: Console, options: DemoOptions) -> None:
    paths = options.paths()
    console.rule("[bold]statekeeper demo: clickstream sessions on Spark, with a crash")
    console.print(
        f"{options.keys:,} users, {options.batches} micro-batches ({options.file_format} "
        f"files), {options.partitions} state partitions; in event time: a session closes "
        f"when the watermark ({options.delay_s} s behind the newest click) passes its last "
        f"click + {options.gap_s} s, late clicks are dropped\n"
        f"demo folder {paths.base}\ncheckpoint root {paths.root}\n"
        f"local working copies under {paths.local}",
        highlight=False,
        soft_wrap=True,
    )


def _write(options: DemoOptions, span: tuple[int, int], batches: list[list[Click]]) -> int:
    """Generate and write the input files of batches ``span``; returns the clicks written."""
    written = 0
    for batch in range(*span):
        new = batch_clicks(options.seed, batch, options.keys)
        write_batch(options.paths().input, batch, new, options.file_format)
        batches.append(new)
        written += len(new)
    return written


def _stream(demo: _Run, board: BatchBoard) -> None:
    """The three streaming phases; leaves this process's SparkSession in ``demo.spark``."""
    options, plan, clicks, clock = demo.options, demo.options.plan(), demo.batches, demo.clock
    paths = options.paths()
    n = _write(options, plan.crash, clicks)
    board.note(
        f"\n[bold yellow]phase 1 (crash)[/]: {n:,} clicks in files {plan.crash[0]}.."
        f"{plan.crash[1] - 1}; the query runs in a child process, which is killed hard "
        f"after batch {plan.kill_after}"
    )
    demo.crash = crash_phase(options, plan.kill_after, board)
    for line in describe(demo.crash):
        board.note(line)
    clock.lap("crash")
    n = _write(options, plan.restart, clicks)
    board.note(
        f"\n[bold cyan]phase 2 (restart)[/]: a new driver in this process (pid {os.getpid()}) "
        f"resumes the query on the same local working copies; {n:,} new clicks"
    )
    demo.spark = build_session(paths, options)
    run_phase(demo.spark, options, "restart", paths.local_copies("working"), board.add)
    clock.lap("restart")
    n = _write(options, plan.cold, clicks)
    board.note(
        f"\n[bold magenta]phase 3 (cold)[/]: the query resumes on an empty local directory: "
        f"every partition restores from the root; {n:,} new clicks"
    )
    run_phase(demo.spark, options, "cold", paths.local_copies("cold"), board.add)
    clock.lap("cold")


def _pipeline_restores(rows: Sequence[BatchRow]) -> list[RestoreRow]:
    """The first batch of the restart and of the cold phase: how their stores came back."""
    out = []
    for phase, how in (("restart", "after the crash"), ("cold", "empty local dir")):
        first = next((r for r in rows if r.phase == phase), None)
        if first is None:
            continue
        local = first.stores_opened - first.stores_restored
        out.append(
            RestoreRow(
                how=f"{how} (batch {first.batch_id})",
                stores=first.stores_opened,
                restored=first.stores_restored,
                bytes_downloaded=first.restore_bytes,
                seconds=first.restore_s,
                detail=f"{local} local working copies reused as they were, "
                f"{first.stores_restored} brought to version {first.batch_id} from the root",
            )
        )
    return out


def _open_restore(options: DemoOptions) -> RestoreRow:
    """Restore every partition's newest version with ``StateBackend.open`` onto an empty dir."""
    paths = options.paths()
    started = time.perf_counter()
    config = StoreConfig(local_dir=paths.local_copies("open"))
    infos = []
    with StateBackend(
        paths.root, config=config, storage_options=options.storage_options or None
    ) as backend:
        for partition in range(options.partitions):
            with backend.open(OPERATOR, partition) as store:
                infos.append(store.restore_info)
    seconds = time.perf_counter() - started
    bases = sorted({f"{i.base_kind} {i.base}" for i in infos})
    return RestoreRow(
        how=f"StateBackend.open (version {infos[0].version})",
        stores=len(infos),
        restored=sum(i.base_kind != "local" or i.changelogs_replayed > 0 for i in infos),
        bytes_downloaded=sum(i.bytes_downloaded for i in infos),
        seconds=seconds,
        detail=(
            f"from {', '.join(bases)}; {sum(i.files_downloaded for i in infos)} files "
            f"downloaded, {sum(i.changelogs_replayed for i in infos)} changelogs replayed"
        ),
    )


def _check(
    spark: SparkSession, options: DemoOptions, batches: list[list[Click]], console: Console
) -> Outcome:
    """Compare the sink and the state with the batch recomputation; print the verdict."""
    paths = options.paths()
    expected = expected_sessions(batches, options.gap_s, options.delay_s)
    sink = [
        (r["user"], r["session"], r["start_ts"], r["end_ts"], r["events"])
        for r in spark.read.parquet(str(paths.output)).collect()
    ]
    state = read_state(spark, paths.root, OPERATOR, storage_options=options.storage_options)
    found = state_of(r.asDict() for r in state.collect())
    outcome = compare(expected, sink, found)
    clicks = sum(len(b) for b in batches)
    still = sum(len(s) for s in expected.open.values())
    console.print(
        f"\nbatch recomputation over all {clicks:,} clicks (pandas), {expected.late:,} of them "
        f"late: {len(expected.closed):,} sessions closed by the last watermark expected in "
        f"the sink (found {len(sink):,}), {still:,} open sessions of "
        f"{len(expected.open):,} users and {len(expected.summary):,} users expected in the "
        f"state (found {sum(len(s) for s in found.open.values()):,} open sessions of "
        f"{len(found.open):,} users, {len(found.summary):,} users)",
        highlight=False,
        soft_wrap=True,
    )
    if outcome.passed:
        console.print(
            f"[bold green]equality check: PASSED[/] ({len(expected.summary)} users, "
            f"{expected.sessions} sessions)",
            highlight=False,
            soft_wrap=True,
        )
    else:
        console.print(
            f"[bold red]equality check: FAILED[/] ({len(outcome.differences)} differences)",
            highlight=False,
            soft_wrap=True,
        )
        for line in shown(outcome.differences):
            console.print(f"  {line}", highlight=False, soft_wrap=True, markup=False)
    return outcome


def _summary(demo: _Run, outcome: Outcome) -> list[str]:
    """Print the closing summary; returns the problems ``verify`` found in the root."""
    options, console = demo.options, demo.console
    paths = options.paths()
    config = StoreConfig(local_dir=paths.local_copies("verify"))
    with StateBackend(
        paths.root, config=config, storage_options=options.storage_options or None
    ) as backend:
        blobs = backend.blobs.list("")
        report = backend.verify(deep=True)
        epoch = latest_epoch(backend.blobs)
    changelogs = sum(layout.parse_changelog_key(b.key) is not None for b in blobs)
    snapshots = sum(layout.parse_snapshot_key(b.key) is not None for b in blobs)
    problems = [f"{p.blob}: {p.message}" for p in report.problems]
    console.rule("[bold]summary")
    lines = [
        f"stream: {sum(len(b) for b in demo.batches):,} clicks of {options.keys:,} users in "
        f"{len(demo.rows)} micro-batches over 3 driver runs, "
        f"{sum(r.rows_in for r in demo.rows):,} rows processed, "
        f"{sum(r.late_rows for r in demo.rows):,} late rows dropped, "
        f"{sum(r.sessions_closed for r in demo.rows):,} sessions closed by timers",
        *_crash_summary(demo),
        "check: sink and state "
        + ("equal" if outcome.passed else "[red]differ from[/]")
        + " a batch recomputation over all clicks",
        f"root: {len(blobs)} blobs, {human_bytes(sum(b.size for b in blobs))} "
        f"({changelogs} changelogs, {snapshots} snapshot indexes), epoch manifests up to "
        f"{epoch}; verify: {report.blobs_checked} blobs checked, "
        + (f"[red]{len(problems)} problems[/]" if problems else "no problems"),
        "time: "
        + ", ".join(f"{name} {s:.1f} s" for name, s in demo.clock.phases.items())
        + f"; total {demo.clock.total:.1f} s",
        f"look around: statekeeper info {paths.root}",
    ]
    for line in lines + [f"  {p}" for p in problems]:
        console.print(line, highlight=False, soft_wrap=True)
    return problems


def _crash_summary(demo: _Run) -> list[str]:
    crash = demo.crash
    if crash is None:
        return []
    lines = [
        f"crash: driver pid {crash.pid} and {crash.killed - 1} processes below it killed "
        f"with SIGKILL; batch {crash.planned} was planned, batch {crash.committed} committed"
    ]
    for r in demo.restores:
        lines.append(
            f"restore {r.how}: {r.stores - r.restored} of {r.stores} stores reused locally, "
            f"{r.restored} from the root ({human_bytes(r.bytes_downloaded)} in "
            f"{r.seconds:.2f} s)"
        )
    return lines
