"""Command line: replay one seed, or soak many seeds of every scenario.

.venv/bin/python -m tests.sim --scenario changelog_writer --seed 123456 [--trace]
.venv/bin/python -m tests.sim --soak 1000 [--first 0] [--scenario NAME ...]
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
import traceback

from tests.sim.runner import RunResult, repro, run_seed
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


def _soak(scenarios: list[Scenario], seeds: int, first: int, show: int) -> int:
    print(f"soak: {seeds} seeds from {first} of {len(scenarios)} scenarios")
    header = f"{'scenario':36s} {'seeds':>6s} {'steps':>7s} {'crashes':>8s} {'errors':>7s}"
    print(f"{header} {'failures':>9s} {'time':>7s}")
    worst = 0
    for scenario in scenarios:
        started = time.monotonic()
        failed: list[RunResult] = []
        steps = crashes = errors = 0
        for seed in range(first, first + seeds):
            result = run_seed(scenario, seed)
            steps, crashes = steps + result.steps, crashes + result.crashes
            errors += result.errors
            if result.failure is not None:
                failed.append(result)
        print(
            f"{scenario.name:36s} {seeds:6d} {steps:7d} {crashes:8d} {errors:7d} "
            f"{len(failed):9d} {time.monotonic() - started:6.1f}s",
            flush=True,
        )
        for result in failed[:show]:
            first_line = str(result.failure).splitlines()[0][:300]
            print(f"    {repro(scenario.name, result.seed)}   # {first_line}")
        if failed:
            worst = 1
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
    return _soak(scenarios, args.soak, first, args.show)


if __name__ == "__main__":
    sys.exit(main())
