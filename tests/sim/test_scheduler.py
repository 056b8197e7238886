"""The simulation's scheduler on its own: interleaving, faults, teardown, library threads."""

from __future__ import annotations

import random
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from statekeeper.errors import StorageError
from tests.sim import scheduler
from tests.sim.scheduler import Crash, DeterminismError, FaultRates, Sim

pytestmark = pytest.mark.sim


def _counting(sim: Sim, name: str, calls: int, log: list[str]) -> None:
    for n in range(calls):
        sim.call("get", f"{name}/{n}", lambda name=name, n=n: log.append(f"{name}{n}"))
        if n % 2:
            sim.step_boundary()


def _run(seed: int, faults: FaultRates | None = None) -> tuple[Sim, list[str]]:
    sim, log = Sim(seed, faults or FaultRates()), []
    for name in ("a", "b", "c"):
        sim.spawn(name, lambda name=name: _counting(sim, name, 6, log))
    sim.run()
    return sim, log


def test_actors_interleave_as_the_seed_says() -> None:
    runs = {seed: _run(seed) for seed in range(4)}
    for seed, (sim, log) in runs.items():
        assert sorted(log) == sorted(f"{a}{n}" for a in "abc" for n in range(6))
        for actor in "abc":  # each actor's own calls in its order
            assert [e for e in log if e[0] == actor] == [f"{actor}{n}" for n in range(6)]
        # Every call ran at the point the trace names, right after it was scheduled.
        assert [f"{key[0]}{key[2:]}" for _, _, key, _ in sim.trace] == log
        again, again_log = _run(seed)
        assert again.trace == sim.trace
        assert again_log == log
    assert len({tuple(log) for _, log in runs.values()}) > 1, "every seed ran alike"


def test_a_crash_is_raised_at_the_yield_point_and_again_after() -> None:
    sim = Sim(7, FaultRates(crash=1.0, max_crashes=1))
    seen: list[str] = []

    def body() -> None:
        try:
            sim.call("put", "k", lambda: seen.append("put made"))
        except Crash as exc:
            seen.append(str(exc))
        with pytest.raises(Crash, match="is dead"):
            sim.call("get", "k", lambda: seen.append("get made"))
        sim.set_dead("refuse")  # the harness closing the dead process's objects
        with pytest.raises(StorageError, match="is dead: get k not made"):
            sim.call("get", "k", lambda: seen.append("get made"))

    sim.spawn("writer", body)
    sim.run()
    assert seen in (
        ["injected crash at put k by writer"],
        ["put made", "injected crash at put k by writer"],
    )
    assert sim.injected["crash"] == 1


def test_a_failure_tears_every_actor_down() -> None:
    sim = Sim(3)
    started: list[str] = []
    unwound: list[str] = []

    def failing() -> None:
        sim.call("get", "x", lambda: None)
        raise ValueError("a violation")

    def patient(name: str) -> None:
        started.append(name)
        try:
            for n in range(100):
                sim.call("get", f"{name}{n}", lambda: None)
        finally:
            unwound.append(name)

    sim.spawn("failing", failing)
    for name in ("p", "q"):
        sim.spawn(name, lambda name=name: patient(name))
    with pytest.raises(ValueError, match="a violation"):
        sim.run()
    # Those that started unwound (by Aborted, at their next yield point), before the end.
    assert started
    assert sorted(unwound) == sorted(started)
    assert len(sim.trace) < 100


def test_a_blob_call_from_a_library_thread_is_the_running_actors() -> None:
    """A pool thread working for an actor (which waits for it) makes its calls as that actor,
    and draws uuids from the actor's pool stream."""
    sim = Sim(1)
    made: list[str] = []
    ids = []

    def library_work() -> None:
        made.append("k")
        ids.append(sim.uuid4())

    def body() -> None:
        with ThreadPoolExecutor(1, thread_name_prefix="library") as pool:
            pool.submit(sim.call, "get", "k", library_work).result()

    sim.spawn("writer", body)
    sim.run()
    assert made == ["k"]
    assert sim.trace == [("writer", "get", "k", "")]
    expected = random.Random("uuid/1/writer/pool").getrandbits(128)
    assert ids == [uuid.UUID(int=expected, version=4)]


def test_an_actor_that_never_yields_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler, "_PARK_TIMEOUT_S", 0.05)
    release = threading.Event()
    sim = Sim(1)
    sim.spawn("stuck", lambda: release.wait(30) and None)
    try:
        with pytest.raises(DeterminismError, match=r"actors \['stuck'\] neither parked nor"):
            sim.run()
    finally:
        release.set()  # let the stuck thread end
