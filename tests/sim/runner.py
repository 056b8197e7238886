"""Run one seed of one scenario: set up a root, spawn the actors, schedule, check at the end."""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import statekeeper as sk
from statekeeper.storage import LocalBlobStore
from tests.sim.actors import OP, PARTITION, World, read_all, store_config
from tests.sim.blobstore import open_inner
from tests.sim.determinism import (
    deterministic_rocksdb,
    manifests_stale_after,
    probe_every_gc,
    seeded_uuids,
)
from tests.sim.model import InvariantViolation, Model
from tests.sim.roles import ROLES
from tests.sim.scenarios import ActorSpec, Scenario
from tests.sim.scheduler import Crash, Sim, TraceEntry

__all__ = ["RunResult", "SimFailure", "actor_names", "repro", "run_seed"]


def repro(scenario: str, seed: int) -> str:
    """The one-line command that runs this seed again."""
    return f".venv/bin/python -m tests.sim --scenario {scenario} --seed {seed}"


class SimFailure(AssertionError):
    """A seed found a violation (or the harness lost determinism); names the reproduction."""


@dataclass
class RunResult:
    scenario: str
    seed: int
    trace: list[TraceEntry] = field(default_factory=list)
    steps: int = 0
    crashes: int = 0
    errors: int = 0
    failure: BaseException | None = None

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise SimFailure(
                f"{self.scenario} seed {self.seed}: {self.failure}\n"
                f"  reproduce: {repro(self.scenario, self.seed)}"
            ) from self.failure


def actor_names(scenario: Scenario) -> list[tuple[str, ActorSpec]]:
    """Unique actor names: the role, numbered when the scenario has several of it."""
    specs = [spec for spec in scenario.actors for _ in range(spec.count)]
    counts = Counter(spec.role for spec in specs)
    seen: Counter[str] = Counter()
    named = []
    for spec in specs:
        name = spec.role if counts[spec.role] == 1 else f"{spec.role}{seen[spec.role]}"
        seen[spec.role] += 1
        named.append((name, spec))
    return named


def _tmp_base() -> str | None:
    """tmpfs if there is one: the store fsyncs every blob, which a disk makes slow."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def run_seed(scenario: Scenario, seed: int, *, keep: bool = False) -> RunResult:
    """Run ``seed`` of ``scenario``; the result holds the trace and any failure."""
    tmp = Path(tempfile.mkdtemp(prefix=f"sk-sim-{scenario.name}-{seed}-", dir=_tmp_base()))
    result = RunResult(scenario.name, seed)
    try:
        _run(scenario, seed, tmp, result)
    finally:
        if keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return result


def _run(scenario: Scenario, seed: int, tmp: Path, result: RunResult) -> None:
    root = str(tmp / "root")
    sim = Sim(seed, scenario.faults)
    model = Model(retain=scenario.retain, gc=scenario.has_gc, keep_empty=scenario.keep_empty)
    stale_after = 0.0 if scenario.blob_age_s else math.inf
    with (
        seeded_uuids(sim),
        deterministic_rocksdb(),
        probe_every_gc(),
        manifests_stale_after(stale_after),
    ):
        # The checker's own view: not a yield point, and one I/O thread (no pool to start).
        raw = LocalBlobStore(root, io_threads=1)
        checker = sk.StateBackend(raw, config=store_config(scenario, tmp / "checker", "changelog"))
        checker.register(OP, 1)  # the root exists before the actors race
        world = World(sim, model, scenario, open_inner(root), tmp, checker)
        try:
            for name, spec in actor_names(scenario):
                actor = ROLES[spec.role](world, name, spec)
                sim.spawn(name, actor.run, can_crash=spec.crash, weight=spec.weight)
            sim.run()
            _final_check(world)
        except (Exception, Crash) as exc:  # noqa: BLE001 - the seed's result, reported
            result.failure = exc
        finally:
            checker.close()
            result.trace = sim.trace
            result.steps = sum(1 for entry in sim.trace if entry[1] == "step")
            result.crashes = sim.injected["crash"]
            result.errors = sim.injected["transient"] + sim.injected["permanent"]


def _final_check(world: World) -> None:
    """After one more gc (if the scenario collects garbage), every version that must be
    restorable is listed, and the latest (and after gc the oldest that must be kept) opens on
    the checker's host with content a commit of that version wrote."""
    model, checker = world.model, world.checker
    world.check_listing("at the end")  # read again only if the root changed since the last
    if world.scenario.has_gc:
        # Whatever the actors left (a gc that died half way, a snapshot published since),
        # one more complete gc must keep every retained version restorable.
        checker.gc()
        model.check_versions(checker.versions(OP, PARTITION), "after a final gc")
    keys = [b"k%d" % i for i in range(world.scenario.keys)]
    # Readers opened versions on fresh hosts during the run, and every version that must be
    # kept is listed (checked above); here: the latest, and after gc the oldest one kept.
    required = model.required_versions()
    for version in ([required[0]] if world.scenario.has_gc and required else []) + [None]:
        known = model.known_high
        who = f"the final check opening {'latest' if version is None else version}"
        try:
            store = checker.open(OP, PARTITION, version)
        except (sk.StateNotFoundError, sk.CorruptStateError) as exc:
            raise InvariantViolation(f"{who}: {exc!r}") from exc
        with store:
            if version is None:
                model.check_latest(store.version, known, who)
            model.observe(store.version, read_all(store, keys), who)
