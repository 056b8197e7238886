"""Command line: replay one seed, or soak many seeds of every scenario.

.venv/bin/python -m tests.sim --scenario changelog_writer --seed 123456 [--trace]
.venv/bin/python -m tests.sim --soak 1000 [--first 0] [--scenario NAME ...] [--jobs N]

A soak prints a row per scenario (its "time" is the run time of its seeds summed, which the
workers spend in parallel) and the wall time and seeds per second of the whole soak.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time
import traceback

from tests.sim.parallel import SeedPool
from tests.sim.runner import repro, run_seed
from tests.sim.scenarios import SCENARIOS, Scenario


def _replay(scenario: Scenario, seed: int, show_trace: bool, keep: bool) -> int:
    result = run_seed(scenario, seed, keep=keep)
    if show_trace:
        for n, (actor, op, key, fault) in enumerate(result.trace):
            print(f"{n:5d} {actor:12s} {op:9s} {key}{'  !' + fault if fault else ''}")
    print(
        f"{scenario.name} seed {seed}: {result.steps} steps, {len(result.trace)} trace "
        f"entries, {result.crashes} crashes, {result.errors} storage errors injected"
    )
    if result.failure is None:
        print("OK")
        return 0
    traceback.print_exception(result.failure)
    print(f"FAILED: {result.failure}")
    print(f"  reproduce: {repro(scenario.name, seed)}")
    return 1


def _soak(scenarios: list[Scenario], seeds: int, first: int, show: int, jobs: int, log: str) -> int:
    print(f"soak: {seeds} seeds from {first} of {len(scenarios)} scenarios, {jobs} process(es)")
    header = f"{'scenario':36s} {'seeds':>6s} {'steps':>7s} {'crashes':>8s} {'errors':>7s}"
    print(f"{header} {'failures':>9s} {'time':>7s}")
    worst = 0
    started = time.monotonic()
    with SeedPool(jobs, log_level=log) as pool:
        batches = [pool.submit(s, range(first, first + seeds)) for s in scenarios]
        for batch in batches:
            outcomes = list(batch.outcomes())
            failed = [o for o in outcomes if o.failure is not None]
            print(
                f"{batch.scenario.name:36s} {seeds:6d} {sum(o.steps for o in outcomes):7d} "
                f"{sum(o.crashes for o in outcomes):8d} {sum(o.errors for o in outcomes):7d} "
                f"{len(failed):9d} {sum(o.seconds for o in outcomes):6.1f}s",
                flush=True,
            )
            for outcome in failed[:show]:
                print(f"    {outcome.summary()}")
            if failed:
                worst = 1
    elapsed = time.monotonic() - started
    total = seeds * len(scenarios)
    print(f"{total} seeds in {elapsed:.1f}s: {total / elapsed:.1f} seeds/s ({jobs} process(es))")
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS))
    parser.add_argument("--seed", type=int, help="replay this one seed")
    parser.add_argument("--trace", action="store_true", help="print every yield point")
    parser.add_argument("--keep", action="store_true", help="keep the run's folder")
    parser.add_argument("--soak", type=int, metavar="N", help="run N seeds of each scenario")
    parser.add_argument("--first", type=int, help="first soak seed (default: random)")
    parser.add_argument("--show", type=int, default=3, help="failing seeds shown per scenario")
    parser.add_argument("--log", default="CRITICAL", help="statekeeper log level")
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="soak: worker processes (default: one per core; 1 runs in this process)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(threadName)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("statekeeper").setLevel(args.log.upper())
    if args.seed is not None:
        if not args.scenario or len(args.scenario) != 1:
            parser.error("--seed needs exactly one --scenario")
        return _replay(SCENARIOS[args.scenario[0]], args.seed, args.trace, args.keep)
    if args.soak is None:
        parser.error("give --seed (with --scenario) or --soak N")
    if args.scenario:
        scenarios = [SCENARIOS[name] for name in args.scenario]
    else:
        scenarios = list(SCENARIOS.values())
    first = args.first if args.first is not None else random.randrange(10**6) * 1000
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    return _soak(scenarios, args.soak, first, args.show, args.jobs, args.log)


if __name__ == "__main__":
    sys.exit(main())
