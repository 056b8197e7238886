"""Command line: seeded randomized fault suites and their table of attacks.

.venv/bin/python -m tests.faults --seeds 20 [--first 0] [--suite sigkill ...]
.venv/bin/python -m tests.faults --suite corruption --seed 7      (replay one trial)

Every suite draws its attack from the seed; the table has one row per suite and attack:
trials, the expected outcome, the outcomes observed (counts), failures and time. A failing
trial prints its reproduction line; the exit code is 1 if any trial failed.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

from tests.faults import corruption, s3, sigkill
from tests.faults.common import Trial, repro

RunTrial = Callable[[int, Path], Trial]
SUITES: dict[str, tuple[RunTrial, str]] = {
    sigkill.NAME: (sigkill.run_trial, sigkill.EXPECTED),
    corruption.NAME: (corruption.run_trial, corruption.EXPECTED),
    s3.NAME: (s3.run_trial, s3.EXPECTED),
}


def run_one(suite: str, seed: int) -> Trial:
    """Run one trial in a fresh folder; an unexpected exception is the trial's failure."""
    run, _ = SUITES[suite]
    with tempfile.TemporaryDirectory(prefix=f"sk-faults-{suite}-") as tmp:
        try:
            return run(seed, Path(tmp))
        # Any exception is the trial's failure, shown with its reproduction line.
        except Exception as exc:  # noqa: BLE001
            trial = Trial(suite, seed, attack="(crashed)", observed=type(exc).__name__)
            trial.fail(f"{type(exc).__name__}: {exc}")
            trial.notes.append(traceback.format_exc())
            return trial


class _Row:
    def __init__(self) -> None:
        self.trials: list[Trial] = []
        self.seconds = 0.0


def _print_table(rows: dict[tuple[str, str], _Row]) -> None:
    print(f"{'suite':11s} {'attack':34s} {'trials':>6s}  {'expected':40s} {'observed':44s} "
          f"{'fail':>4s} {'time':>7s}")  # fmt: skip
    for (suite, attack), row in sorted(rows.items()):
        counts = Counter(t.observed for t in row.trials)
        observed = ", ".join(f"{label} {n}" for label, n in counts.most_common())
        failed = sum(t.failure is not None for t in row.trials)
        print(f"{suite:11s} {attack:34s} {len(row.trials):6d}  {SUITES[suite][1]:40s} "
              f"{observed:44s} {failed:4d} {row.seconds:6.1f}s")  # fmt: skip


def soak(suites: list[str], seeds: list[int], show_traceback: bool = False) -> int:
    """Run every seed of every suite; print the table and one line per failing trial."""
    rows: dict[tuple[str, str], _Row] = defaultdict(_Row)
    failed: list[Trial] = []
    for suite in suites:
        for seed in seeds:
            started = time.monotonic()
            trial = run_one(suite, seed)
            row = rows[(suite, trial.attack)]
            row.trials.append(trial)
            row.seconds += time.monotonic() - started
            if trial.failure is not None:
                failed.append(trial)
                print(f"FAIL {repro(suite, seed)}   # {trial.failure[:300]}", flush=True)
                if show_traceback:
                    print("".join(trial.notes), flush=True)
    print()
    _print_table(rows)
    print(f"\n{len(failed)} failing trial(s) of {len(suites) * len(seeds)}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.faults",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--suite", action="append", choices=sorted(SUITES))
    parser.add_argument("--seeds", type=int, metavar="N", help="trials per suite")
    parser.add_argument("--first", type=int, help="first seed (default: random)")
    parser.add_argument("--seed", type=int, help="replay this one seed (shows tracebacks)")
    parser.add_argument("--log", default="CRITICAL", help="statekeeper log level")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(threadName)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("statekeeper").setLevel(args.log.upper())
    suites = args.suite or list(SUITES)
    if args.seed is not None:
        return soak(suites, [args.seed], show_traceback=True)
    if args.seeds is None:
        parser.error("give --seeds N, or --seed S to replay one trial")
    first = args.first if args.first is not None else random.randrange(10**6) * 1000
    print(f"fault soak: {args.seeds} seeds from {first} of {', '.join(suites)}", flush=True)
    return soak(suites, list(range(first, first + args.seeds)))


if __name__ == "__main__":
    sys.exit(main())
