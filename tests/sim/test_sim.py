"""The simulation in ``make test``: every scenario today's code passes, over a fixed range of
seeds, in worker processes (:mod:`tests.sim.parallel`).

``SIM_SEEDS`` (environment) sets the seeds per scenario (170: 3060 seeds in all),
``SIM_JOBS`` the worker processes (default 2, or 1 on one core: then the seeds run in the
pytest process); ``make soak SEEDS=N`` runs more.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

import statekeeper as sk
import statekeeper.manifest
import statekeeper.store._commit_point
from statekeeper.manifest import fenced, write_manifest
from statekeeper.store._commit_point import CommitPoint
from tests.sim import runner
from tests.sim.model import InvariantViolation
from tests.sim.parallel import CHUNK, Batch, SeedPool, trace_digest
from tests.sim.runner import SimFailure, run_seed
from tests.sim.scenarios import SCENARIOS, with_changes

pytestmark = pytest.mark.sim

SEEDS = int(os.environ.get("SIM_SEEDS", "170"))
JOBS = int(os.environ.get("SIM_JOBS", str(min(2, os.cpu_count() or 1))))
_EVERY_SEED = "test_scenario_holds_for_every_seed"


@pytest.fixture(scope="module", autouse=True)
def seed_pool(request: pytest.FixtureRequest) -> Iterator[tuple[SeedPool, dict[str, Batch]]]:
    """The workers, and the seeds of every selected scenario queued in them as the module
    starts, so that they run while the in-process tests below run too."""
    wanted = sorted(
        {
            item.callspec.params["name"]
            for item in request.session.items
            if getattr(item, "originalname", None) == _EVERY_SEED and hasattr(item, "callspec")
        }
    )
    with SeedPool(JOBS, strict_warnings=True) as pool:
        yield pool, {name: pool.submit(SCENARIOS[name], range(SEEDS)) for name in wanted}


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


_QUERIES = "racing_queries"
_QUERY_SEEDS = range(8)
"""Seeds of racing_queries that today's code passes, and of which 4, 5 and 6 fail if the
store ignores owners (seed 4: writer1 commits version 1, then writer0, restarted as a newer
attempt, re-runs batch 0 from version 0 and replaces it, as query B did to query A)."""
_ADOPTING_SEEDS = (80, 174)
"""Seeds of racing_queries in which a writer re-runs batch 0 with exactly the changes of the
other query's version 1 (found by running 300 seeds with only the adoption ignoring owners)."""


def _owners_ignored(monkeypatch: pytest.MonkeyPatch, *, adopt_only: bool = False) -> None:
    """The store as it was before owners: anyone owns every version (or, ``adopt_only``,
    only adopting identical content ignores owners)."""

    def anyone(owner: str, entry: object) -> bool:
        return True

    if not adopt_only:
        monkeypatch.setattr(statekeeper.manifest, "owns", anyone)  # decide()
    monkeypatch.setattr(statekeeper.store._commit_point, "owns", anyone)  # adopting


def _failures(name: str, seeds: Iterable[int]) -> list[BaseException]:
    return [r.failure for r in (run_seed(SCENARIOS[name], s) for s in seeds) if r.failure]


def test_racing_queries_hold_for_the_self_check_seeds() -> None:
    """The failures below come from ignoring owners, not from these seeds."""
    assert _failures(_QUERIES, [*_QUERY_SEEDS, *_ADOPTING_SEEDS]) == []


def test_a_store_that_ignores_owners_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug owners close: a query started with a fresh checkpoint (a newer attempt)
    re-runs batch 0 over another query's version 1 and replaces it, or builds on another
    query's versions; the model must call that a violation."""
    _owners_ignored(monkeypatch)
    failures = _failures(_QUERIES, _QUERY_SEEDS)
    assert len(failures) >= 2
    assert all(isinstance(f, InvariantViolation) for f in failures), failures
    assert any("committed although the protocol must refuse it" in str(f) for f in failures)


def test_a_store_that_adopts_another_owners_content_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An attempt whose changes are byte for byte another query's version must not adopt it
    (the identical re-run shortcut): refused for the owner, the rules say it must be
    refused."""
    _owners_ignored(monkeypatch, adopt_only=True)
    failures = _failures(_QUERIES, _ADOPTING_SEEDS)
    assert failures
    assert all(isinstance(f, InvariantViolation) for f in failures), failures


def test_a_store_that_refuses_owners_their_own_versions_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The other way round: OwnerConflictError where no other owner is in the way."""
    monkeypatch.setattr(statekeeper.manifest, "owns", lambda owner, entry: False)
    failures = _failures(_QUERIES, _QUERY_SEEDS)
    assert len(failures) >= 4
    assert all(isinstance(f, InvariantViolation) for f in failures), failures
    assert any("refused for another owner's sake" in str(f) for f in failures)


_STALE_ADOPTION_SEEDS = (1141000378, 1141000444, 1141001788)
"""Seeds of one_query_runs_twice that fail when adoption trusts the known manifest."""


def test_a_store_that_adopts_from_a_stale_manifest_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bug this scenario found: a re-run whose changes equal what the manifest its store
    knew names for the version adopted it without reading the newest manifest, in which a
    newer attempt may have replaced the version: acknowledged for content that was no
    longer the version. With the adoption as it was, these seeds fail; as it is, they pass."""
    assert _failures("one_query_runs_twice", _STALE_ADOPTION_SEEDS) == []

    def adopt_from_the_known_manifest(
        self: CommitPoint, version: int, columns: Any, parent: str, owner: str, order: Any
    ) -> str | None:
        manifest = self.manifest
        while True:
            adopted = self._identical(manifest, version, columns, parent, owner)
            if adopted is None:
                return None
            if order > manifest.fence:
                try:
                    write_manifest(self._blobs, fenced(manifest, order))
                except sk.CommitConflictError:
                    manifest = self._newest()
                    continue
                manifest = fenced(manifest, order)
            self.manifest = manifest
            return adopted

    monkeypatch.setattr(CommitPoint, "_adopt", adopt_from_the_known_manifest)
    failures = _failures("one_query_runs_twice", _STALE_ADOPTION_SEEDS)
    assert len(failures) == len(_STALE_ADOPTION_SEEDS)
    assert all(isinstance(f, InvariantViolation) for f in failures), failures


_HOLE_SEEDS = (1190000042, 1190000353, 1190000373)
"""Seeds of zombies_after_manifest_gc that fail when a writer trusts a manifest it has known
for longer than the manifests' grace."""


def test_a_writer_that_trusts_an_old_manifest_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A zombie that knew manifest ``seq`` since before GC deleted ``seq + 1`` wrote
    ``seq + 1`` again: acknowledged under a newer manifest, against the fence it never saw.
    A writer re-reads a manifest older than STALE_AFTER_S (the scenario's blobs are all
    1000 s old: every known manifest is); trusting it instead, these seeds fail."""
    assert _failures("zombies_after_manifest_gc", _HOLE_SEEDS) == []
    trusting = runner.manifests_stale_after
    monkeypatch.setattr(runner, "manifests_stale_after", lambda _: trusting(math.inf))
    failures = _failures("zombies_after_manifest_gc", _HOLE_SEEDS)
    assert len(failures) == len(_HOLE_SEEDS)
    assert all(isinstance(f, InvariantViolation) for f in failures), failures


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_holds_for_every_seed(
    name: str, seed_pool: tuple[SeedPool, dict[str, Batch]]
) -> None:
    outcomes = list(seed_pool[1][name].outcomes())
    assert [o.seed for o in outcomes] == list(range(SEEDS))
    failed = [o for o in outcomes if o.failure is not None]
    for outcome in failed[:3]:
        print(f"FAILED {outcome.summary()}")
    if failed:
        first = failed[0]
        raise SimFailure(
            f"{len(failed)} of {SEEDS} seeds of {name} failed; the first, seed {first.seed}:\n"
            f"{first.details}\n  reproduce: {first.repro}"
        )


def test_a_failing_seed_in_a_worker_is_reported_with_its_reproduction(
    seed_pool: tuple[SeedPool, dict[str, Batch]],
) -> None:
    """The same self-check through the worker processes (after the seeds queued above)."""
    scenario = with_changes(SCENARIOS["changelog_writer"], lose_put=2)
    outcomes = list(seed_pool[0].submit(scenario, range(5)).outcomes())
    failed = [o for o in outcomes if o.failure is not None]
    assert len(failed) >= 3
    assert all(o.failure.startswith("InvariantViolation: ") for o in failed), failed
    assert all("Traceback" in o.details for o in failed)
    line = failed[0].summary()
    assert "\n" not in line
    assert line.startswith(
        f".venv/bin/python -m tests.sim --scenario changelog_writer --seed {failed[0].seed}   # "
    )


def test_a_seed_runs_alike_in_a_worker_and_alone(
    seed_pool: tuple[SeedPool, dict[str, Batch]],
) -> None:
    """What makes a worker's reproduction line true: a seed run in a worker, after other
    seeds there, interleaves exactly as it does alone in this process."""
    name = "gc_vs_snapshots"
    if name not in seed_pool[1]:
        pytest.skip(f"{name} was not selected")
    ran = {o.seed: o for o in seed_pool[1][name].outcomes()}
    seeds = sorted({1, CHUNK + 1, SEEDS - 1} & set(ran))  # each after another seed in its worker
    assert seeds
    for seed in seeds:
        alone = run_seed(SCENARIOS[name], seed)
        assert ran[seed].trace_digest == trace_digest(alone.trace), f"seed {seed}"
        assert ran[seed].steps == alone.steps


def test_a_read_overtaken_by_a_replacement_returns_the_content_it_began_with() -> None:
    """Seed 50005: a reader opens the latest version (1, attempt 1) while a newer attempt
    replaces version 1; the read returns attempt 1's content, which was version 1 when it
    began (a read is not something built on it, §5.4). The model used to call that a
    violation; content that was never a candidate during the read still is one."""
    result = run_seed(SCENARIOS["rerun_newer_attempt"], 50005)
    assert result.failure is None, result.failure


@pytest.mark.parametrize("name", ["rerun_newer_attempt", "stale_cached_store"])
def test_a_read_that_began_before_the_version_may_return_an_attempt_replaced_since(
    name: str,
) -> None:
    """Seed 702401068: a reader opening the latest version starts before version 1 exists;
    meanwhile attempt 1 commits it, the reader finds its manifest, and a restarted writer's
    attempt 2 replaces it before the reader has read attempt 1's changelog. The read returns
    attempt 1's content, version 1 at a moment of the read. The model accepted only the
    content of the read's start, and called it a violation (found by a soak of 19,500 seeds
    from 702400000)."""
    result = run_seed(SCENARIOS[name], 702401068)
    assert result.failure is None, result.failure


def test_a_store_built_on_a_maybe_replaced_version_may_be_refused() -> None:
    """Seed 271800007: a restarted writer re-runs version 1 with the same (empty) content;
    its manifest lands but the put reports an error (outcome unknown). A cached store that
    had loaded the first attempt's version 1 then commits version 2 and is refused: the
    protocol tells attempts apart, not content, and version 1 is now the re-run's. The model
    used to count only attempts known to have landed, and called the refusal a wedge."""
    result = run_seed(SCENARIOS["stale_cached_store"], 271800007)
    assert result.failure is None, result.failure


def test_a_commit_that_landed_before_a_newer_attempt_committed_may_return_after_it() -> None:
    """Seed 1280000235: an old run's commit of version 3 lands (its manifest put), then its
    metrics put fails after taking effect and is retried; meanwhile the new run (a newer
    order) adopts version 1 and is acknowledged. The old commit then returns its ack, right:
    it had decided before the newer attempt committed. The model judged a commit by what it
    knew when the commit returned, and called the ack a zombie's (found by a soak of 27,000
    seeds from 1280000000); it now judges it as of its last manifest put that took effect."""
    result = run_seed(SCENARIOS["one_query_runs_twice"], 1280000235)
    assert result.failure is None, result.failure
