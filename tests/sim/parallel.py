"""Many seeds on several cores: chunks of seeds run in worker processes.

A run is a function of its scenario and seed alone (see ``scheduler.py`` and
``determinism.py``), so which process runs it, and after which other seeds, changes nothing:
a seed that fails in a worker fails the same way when replayed alone with the one-line
command of :func:`~tests.sim.runner.repro`. Workers are *spawned* (not forked: the parent may
hold threads, and a fork copies their locks in whatever state they are), send back a small
:class:`SeedOutcome` per seed (a failure as text, its traceback formatted, never the
exception object, which need not survive pickling), and log at the level they are given
(``CRITICAL``, quiet, by default). ``jobs=1`` runs the seeds in the calling process instead.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import time
import traceback
import warnings
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass

from tests.sim.runner import repro, run_seed
from tests.sim.scenarios import Scenario

__all__ = ["Batch", "SeedOutcome", "SeedPool", "run_seeds", "trace_digest"]

CHUNK = 8
"""Seeds per task: small enough that the workers finish together, large enough that the
task overhead (a pickle each way) stays far below the runs' cost."""


@dataclass(frozen=True)
class SeedOutcome:
    """What one seed of one scenario did, as a worker reports it."""

    scenario: str
    seed: int
    steps: int
    crashes: int
    errors: int
    seconds: float
    failure: str | None = None
    """The violation (``Type: message``), or ``None`` if the seed held."""
    details: str = ""
    """The failure's formatted traceback."""
    trace_digest: str = ""
    """A digest of the run's trace: equal for two runs that interleaved alike."""

    @property
    def repro(self) -> str:
        return repro(self.scenario, self.seed)

    def summary(self) -> str:
        """The one-line reproduction, with the failure's first line."""
        first = self.failure.splitlines()[0][:300] if self.failure else ""
        return f"{self.repro}   # {first}"


def run_seeds(scenario: Scenario, seeds: Iterable[int]) -> list[SeedOutcome]:
    """Run ``seeds`` of ``scenario`` here, one after the other."""
    outcomes = []
    for seed in seeds:
        started = time.monotonic()
        result = run_seed(scenario, seed)
        failure = details = None
        if result.failure is not None:
            exc = result.failure
            failure = f"{type(exc).__name__}: {exc}"
            details = "".join(traceback.format_exception(exc))
        outcomes.append(
            SeedOutcome(
                scenario.name,
                seed,
                result.steps,
                result.crashes,
                result.errors,
                time.monotonic() - started,
                failure,
                details or "",
                trace_digest(result.trace),
            )
        )
    return outcomes


def trace_digest(trace: Sequence[tuple[str, str, str, str]]) -> str:
    """A short digest of a run's trace (every yield point, in order)."""
    return hashlib.sha256(repr(trace).encode()).hexdigest()[:16]


def _worker_init(log_level: str, strict_warnings: bool) -> None:
    logging.basicConfig(format="%(processName)s %(threadName)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("statekeeper").setLevel(log_level)
    if strict_warnings:
        warnings.simplefilter("error")  # as pytest's filterwarnings = error does in-process


class SeedPool:
    """Worker processes that run chunks of seeds; a context manager.

    Args:
        jobs: worker processes (1: run in the calling process, when results are asked for).
        log_level: the workers' statekeeper log level.
        strict_warnings: turn warnings into errors in the workers (pytest's setting).
    """

    def __init__(
        self, jobs: int, *, log_level: str = "CRITICAL", strict_warnings: bool = False
    ) -> None:
        if jobs < 1:
            raise ValueError(f"jobs must be at least 1, got {jobs}")
        self._executor = None
        if jobs > 1:
            self._executor = ProcessPoolExecutor(
                max_workers=jobs,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init,
                initargs=(log_level.upper(), strict_warnings),
            )

    def __enter__(self) -> SeedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers; seeds not started yet are dropped."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def submit(self, scenario: Scenario, seeds: Sequence[int]) -> Batch:
        """Queue ``seeds`` of ``scenario``; they start as workers become free."""
        if self._executor is None:
            return Batch(scenario, list(seeds), [])
        chunks = [seeds[i : i + CHUNK] for i in range(0, len(seeds), CHUNK)]
        futures = [self._executor.submit(run_seeds, scenario, list(c)) for c in chunks]
        return Batch(scenario, list(seeds), futures)


@dataclass
class Batch:
    """The seeds of one scenario handed to a :class:`SeedPool`."""

    scenario: Scenario
    seeds: list[int]
    futures: list[Future[list[SeedOutcome]]]

    def outcomes(self) -> Iterator[SeedOutcome]:
        """Every seed's outcome in seed order, waiting for each chunk as needed."""
        if not self.futures:
            yield from run_seeds(self.scenario, self.seeds)
            return
        for future in self.futures:
            yield from future.result()
