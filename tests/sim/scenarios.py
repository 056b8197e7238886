"""Named configurations of the simulation: which actors run, which faults hit them.

The second group exercises what format 1 got wrong (issue "commit protocol v2": re-runs by
newer attempts, zombies, snapshot-mode re-runs of batch 0, writers in two modes, GC racing
uploads and paged listings); format 2 must pass them like the rest. The third has writers of
different owners (streaming queries): a query started with a fresh checkpoint re-runs batch 0
as a newer attempt, and without owners would replace another query's version 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tests.sim.policy import EMPTY_STORE_KEPT
from tests.sim.scheduler import FaultRates

__all__ = ["SCENARIOS", "ActorSpec", "Scenario"]


@dataclass(frozen=True)
class ActorSpec:
    """``count`` actors of one role."""

    role: str  # writer | snapshotter | gc | reader
    steps: int
    count: int = 1
    mode: str = "changelog"
    crash: bool = True
    """Whether crashes may hit this actor (storage errors always may)."""
    weight: float = 1.0
    """Relative speed: how likely the scheduler picks this actor among the parked ones."""
    fresh: float = 0.0
    """Snapshotter: chance that a step starts on a new host (an executor moved elsewhere)."""
    hold: float = 0.5
    """Snapshotter: chance that it snapshots at its next step, not at once (a slow
    uploader: its snapshot is of a version the others have left behind)."""


@dataclass(frozen=True)
class Scenario:
    """One named configuration. Keep it small: few keys, few versions, few steps."""

    name: str
    doc: str
    actors: tuple[ActorSpec, ...]
    faults: FaultRates = field(default_factory=FaultRates)
    retain: int = 3
    orphan_ttl_s: float = 1e9
    """1e9: no unreferenced blob is ever old enough. GC compares blob ages with the wall clock,
    so only extremes keep a run a function of its seed; see ``blob_age_s`` for the other."""
    blob_age_s: float = 0.0
    """Every blob reads as written this much earlier: with 1e6 every blob is past any grace
    (GC raises a small ``orphan_ttl_s`` to its floor, so a TTL of 0 alone no longer is)."""
    keys: int = 3
    rerun: float = 0.0
    """Chance that a writer opening a store re-runs an older batch instead of the latest."""
    restarts: float = 0.0
    """Chance per writer step of a deliberate restart (a new process, a new attempt)."""
    zombies: bool = False
    """A restarted writer's old process lives on and commits once more (a zombie)."""
    stale: bool = False
    """With ``zombies``: that last commit is made with the new process's order, as by a Spark
    worker whose cached store outlived a restart and takes a task of the new run."""
    orders: bool = False
    """Every new process is a newer attempt (a higher generation), as a restarted query is."""
    queries: tuple[str, ...] = ()
    """The streaming query each writer commits for (its owner), by writer number; empty:
    none. A writer's zombie is of its query, and a writer that has committed nothing yet
    re-runs (chance ``rerun``) from version 0: a query started with a fresh checkpoint (or a
    new run's task of batch 0), whose batch 0 loads the empty store whatever it holds."""
    writer_snapshots: float = 0.0
    writer_gc: float = 0.0
    wipe: float = 0.5
    """Chance that a crashed process comes back on a new host (an empty local dir)."""
    page_size: int | None = None
    """Page listings (each page a yield point): listings stop being atomic."""
    keep_empty: bool = EMPTY_STORE_KEPT
    """Version 0 (the empty store) must stay restorable while retained."""
    lose_put: int | None = None
    """Self-test only: the store silently loses create-only puts from this one on."""

    @property
    def has_gc(self) -> bool:
        return self.writer_gc > 0 or any(a.role == "gc" for a in self.actors)


_FAULTS = FaultRates(crash=0.03, transient=0.05, permanent=0.02)
_READER = ActorSpec("reader", steps=1, crash=False)


def _scenarios(*scenarios: Scenario) -> dict[str, Scenario]:
    return {s.name: s for s in scenarios}


_RERUN_NEWER = Scenario(
    "rerun_newer_attempt",
    "a writer restarted as a newer attempt re-runs its last batch with other content; "
    "its old process (a zombie) commits once more",
    (ActorSpec("writer", steps=6), _READER),
    faults=_FAULTS,
    rerun=0.6,
    restarts=0.25,
    zombies=True,
    orders=True,
)

_RACING_QUERIES = Scenario(
    "racing_queries",
    "two writers, each its own streaming query, restarted as newer attempts: one started "
    "with a fresh checkpoint re-runs batch 0 over the other's version 1, which it may "
    "neither replace nor build on",
    (ActorSpec("writer", steps=4, count=2), _READER),
    faults=_FAULTS,
    rerun=0.5,
    restarts=0.2,
    orders=True,
    queries=("a", "b"),
)

SCENARIOS = _scenarios(
    Scenario(
        "changelog_writer",
        "one changelog-mode writer with crashes, storage errors and re-runs; a fresh-host reader",
        (ActorSpec("writer", steps=4), _READER),
        faults=_FAULTS,
        rerun=0.3,
    ),
    Scenario(
        "snapshot_writer",
        "one snapshot-mode writer with crashes, storage errors and re-runs; a reader",
        (ActorSpec("writer", steps=3, mode="snapshot"), _READER),
        faults=_FAULTS,
        rerun=0.3,
    ),
    Scenario(
        "snapshots_and_gc",
        "a writer that snapshots and collects garbage (orphan TTL 0) itself, and a reader",
        (ActorSpec("writer", steps=6), _READER),
        faults=_FAULTS,
        retain=2,
        orphan_ttl_s=0,
        blob_age_s=1e6,
        writer_snapshots=0.25,
        writer_gc=0.2,
        rerun=0.2,
    ),
    Scenario(
        "snapshotter_host",
        "a changelog writer and a snapshotter on another host, a reader",
        (ActorSpec("writer", steps=4), ActorSpec("snapshotter", steps=2), _READER),
        faults=_FAULTS,
    ),
    Scenario(
        "racing_writers",
        "two changelog writers of one store racing for each version (one must lose)",
        (ActorSpec("writer", steps=3, count=2), _READER),
        faults=_FAULTS,
    ),
    Scenario(
        "racing_snapshot_writers",
        "two snapshot-mode writers of one store racing for each version",
        (ActorSpec("writer", steps=3, count=2, mode="snapshot"), _READER),
        faults=_FAULTS,
    ),
    # -- format 1 failed these -----------------------------------------------------------
    _RERUN_NEWER,
    replace(
        _RERUN_NEWER,
        name="stale_cached_store",
        doc="rerun_newer_attempt, but the old process's store commits once more with the new "
        "run's order (a worker's cached store after a restart): built on a replaced version "
        "it must be refused",
        stale=True,
    ),
    Scenario(
        "rerun_newer_attempt_snapshot_mode",
        "rerun_newer_attempt with a snapshot-mode writer",
        (ActorSpec("writer", steps=6, mode="snapshot"), _READER),
        faults=_FAULTS,
        rerun=0.6,
        restarts=0.25,
        zombies=True,
        orders=True,
    ),
    Scenario(
        "snapshot_rerun_batch0",
        "a snapshot-mode writer that re-runs batch 0 (open version 0, commit 1 again)",
        (ActorSpec("writer", steps=4, mode="snapshot"), _READER),
        faults=_FAULTS,
        rerun=0.6,
        keep_empty=True,
    ),
    Scenario(
        "mixed_modes",
        "a changelog-mode and a snapshot-mode writer racing for each version",
        (
            ActorSpec("writer", steps=4),
            ActorSpec("writer", steps=4, mode="snapshot"),
            _READER,
        ),
        faults=_FAULTS,
    ),
    Scenario(
        "gc_vs_snapshots",
        "a writer that snapshots, a snapshotter host and a gc host at once (orphan TTL 1e9)",
        (
            ActorSpec("writer", steps=12),
            ActorSpec("snapshotter", steps=4),
            ActorSpec("gc", steps=4),
        ),
        faults=FaultRates(transient=0.03),
        retain=1,
        writer_snapshots=0.3,
    ),
    Scenario(
        "gc_paged_listing",
        "a writer that snapshots and a gc host, listings paged two keys at a time (not atomic)",
        (ActorSpec("writer", steps=12), ActorSpec("gc", steps=4)),
        faults=FaultRates(transient=0.03),
        retain=2,
        writer_snapshots=0.3,
        page_size=2,
    ),
    # -- owners (streaming queries) ------------------------------------------------------
    _RACING_QUERIES,
    replace(
        _RACING_QUERIES,
        name="racing_queries_snapshot_mode",
        doc="racing_queries with snapshot-mode writers (no identical content is adopted)",
        actors=(ActorSpec("writer", steps=3, count=2, mode="snapshot"), _READER),
    ),
    replace(
        _RACING_QUERIES,
        name="racing_queries_with_zombies",
        doc="racing_queries where a restarted writer's old process (a zombie of its query) "
        "commits once more: attempts of one query replace its versions and build on them, "
        "the other query's may do neither",
        actors=(ActorSpec("writer", steps=5, count=2), _READER),
        zombies=True,
    ),
    replace(
        _RACING_QUERIES,
        name="one_query_runs_twice",
        doc="two writers of one query at once (an old run's task still committing while the "
        "new run's runs, each restarted as newer attempts, with zombies) and a writer of "
        "another query: within a query, the newer attempt wins and an identical re-run "
        "adopts only what the newest manifest holds",
        actors=(ActorSpec("writer", steps=4, count=3), _READER),
        zombies=True,
        queries=("a", "a", "b"),
    ),
    replace(
        _RERUN_NEWER,
        name="zombies_after_manifest_gc",
        doc="rerun_newer_attempt with a gc host, every blob read as 1000 s old: past the "
        "manifests' grace (GC deletes superseded manifests) but not the orphans' (1e9 s), so "
        "a zombie's known manifest is followed by deleted sequence numbers",
        actors=(ActorSpec("writer", steps=10), ActorSpec("gc", steps=5), _READER),
        blob_age_s=1000.0,
        writer_snapshots=0.25,
    ),
)


def with_changes(scenario: Scenario, **changes: object) -> Scenario:
    """A variant of ``scenario`` (tests use it for self-checks)."""
    return replace(scenario, **changes)  # type: ignore[arg-type]
