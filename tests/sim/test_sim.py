"""The simulation in ``make test``: every scenario today's code passes, over a fixed range of
seeds.

``SIM_SEEDS`` (environment) sets the seeds per scenario; ``make soak SEEDS=N`` runs more.
"""

from __future__ import annotations

import os

import pytest

from tests.sim.model import InvariantViolation
from tests.sim.runner import RunResult, SimFailure, repro, run_seed
from tests.sim.scenarios import SCENARIOS, with_changes

pytestmark = pytest.mark.sim

SEEDS = int(os.environ.get("SIM_SEEDS", "100"))


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_holds_for_every_seed(name: str) -> None:
    failed: list[RunResult] = []
    for seed in range(SEEDS):
        result = run_seed(SCENARIOS[name], seed)
        if result.failure is not None:
            failed.append(result)
            if len(failed) == 3:
                break
    for result in failed:
        print(f"FAILED {repro(name, result.seed)}  # {str(result.failure).splitlines()[0]}")
    if failed:
        failed[0].raise_failure()


@pytest.mark.parametrize("name", ["snapshots_and_gc", "racing_snapshot_writers", "gc_vs_snapshots"])
def test_a_seed_replays_the_same_trace(name: str) -> None:
    scenario = SCENARIOS[name]
    traces = []
    for seed in (1, 2, 3):
        first, second = run_seed(scenario, seed), run_seed(scenario, seed)
        assert len(first.trace) > 20
        assert first.trace == second.trace, f"seed {seed} ran differently twice"
        traces.append(first.trace)
    assert traces[0] != traces[1] != traces[2], "different seeds ran the same schedule"


def test_faults_are_injected_and_survived() -> None:
    scenario = SCENARIOS["changelog_writer"]
    results = [run_seed(scenario, seed) for seed in range(20)]
    assert all(r.failure is None for r in results)
    assert sum(r.crashes for r in results) >= 3
    assert sum(r.errors for r in results) >= 10


def test_a_store_that_loses_commits_is_caught() -> None:
    """The model is not vacuous: a blob store that acknowledges puts it drops fails it."""
    scenario = with_changes(SCENARIOS["changelog_writer"], lose_put=2)
    results = [run_seed(scenario, seed) for seed in range(5)]
    failures = [r.failure for r in results if r.failure is not None]
    assert len(failures) >= 3
    assert all(isinstance(f, InvariantViolation) for f in failures), failures
    with pytest.raises(SimFailure, match=r"reproduce: \.venv/bin/python -m tests\.sim "):
        next(r for r in results if r.failure is not None).raise_failure()
