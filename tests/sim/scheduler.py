"""A seeded baton scheduler: actors run in threads, exactly one at a time.

Every blob store call an actor makes is a **yield point**: the calling thread parks and waits
for the baton. Once every actor is parked (at a blob call, at a step boundary, or finished),
the thread that parked (or finished) last draws from ``random.Random(seed)`` which parked actor
goes next and which fault, if any, hits the call it is parked at, and wakes that actor alone
(itself, if it was drawn: then no thread switch at all). So the interleaving, and every fault,
is a function of the seed alone; the thread that called :meth:`Sim.run` only watches for the
end (and for a run that stopped making progress).

Threads of the library (the snapshot upload and restore pools) are attributed to the actor that
holds the baton: only that actor runs, so any blob call made from a thread that is not an actor
thread was caused by it. The actor's own thread is then blocked on that pool's future, so it
still makes one blob call at a time; with ``StoreConfig(io_threads=1)`` the pools run one
transfer at a time, and a second concurrent call from one actor raises
:class:`DeterminismError` rather than silently making the run depend on thread timing.
Background snapshots are avoided altogether (``snapshot_every`` is huge): snapshots are taken
as explicit actor steps with ``backend.snapshot(...)``.

Faults a yield point may inject (drawn per call by the scheduler, rates per scenario):

* ``crash``: the actor's process dies before the call (``crash_after``: after the call took
  effect, its response lost). :class:`Crash` is a ``BaseException``, so library code cannot
  swallow it; every later call of that actor raises it again until the harness restarts it.
* ``transient`` / ``transient_after``: a :class:`~statekeeper.TransientStorageError` before the
  call, or after it took effect (a lost response); the library's retry must absorb it.
* ``permanent`` / ``permanent_after``: a :class:`~statekeeper.StorageError`, never retried.

Random names (snapshot blob ids, attempt ids) would make two runs' traces differ, so the trace
records keys with every hex id replaced by an alias numbered in order of first appearance.
"""

from __future__ import annotations

import random
import re
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from statekeeper.errors import StorageError, TransientStorageError

__all__ = [
    "Crash",
    "DeterminismError",
    "FaultRates",
    "Sim",
    "TraceEntry",
]

_T = TypeVar("_T")
TraceEntry = tuple[str, str, str, str]
"""(actor, call, key, fault) of one yield point, in the order the scheduler ran them."""

# A hex run of 16+ characters holding at least one letter: uuids and attempt ids, not the
# 20-digit zero-padded versions (all digits).
_RANDOM_ID = re.compile(r"(?=[0-9a-f]*[a-f])[0-9a-f]{16,}")
_PARK_TIMEOUT_S = 60.0
_MUTATING = frozenset({"put", "delete"})


class Crash(BaseException):
    """The actor's process died at a yield point; its in-memory objects are abandoned."""


class Aborted(BaseException):
    """The run is being torn down (a violation was found elsewhere): unwind, do nothing."""


class DeterminismError(RuntimeError):
    """The run stopped being a function of its seed (concurrent calls, a blocked actor)."""


@dataclass(frozen=True)
class FaultRates:
    """Per-yield-point probabilities of each fault (0 disables it)."""

    crash: float = 0.0
    transient: float = 0.0
    permanent: float = 0.0
    max_crashes: int = 3
    """Crashes injected per run at most, so that runs end."""


@dataclass
class _Actor:
    name: str
    can_crash: bool
    weight: float
    state: str = "new"  # new | parked | running | done
    pending: tuple[str, str] | None = None
    fault: str = ""
    thread_id: int | None = None
    dead: str = ""  # "" alive, "crash": calls raise Crash, "refuse": calls raise StorageError
    wake: threading.Condition | None = None
    """Notified when this actor is handed the baton (or the run aborts)."""


@dataclass
class Sim:
    """The scheduler of one run: a baton, the seeded choices, the trace, fault counters."""

    seed: int
    faults: FaultRates = field(default_factory=FaultRates)
    rng: random.Random = field(init=False)
    trace: list[TraceEntry] = field(default_factory=list)
    injected: Counter[str] = field(default_factory=Counter)
    failure: BaseException | None = None

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        # One lock guards the scheduler's state; each actor waits on a condition of its own
        # (woken alone when chosen), and ``_cv`` wakes the thread in :meth:`run`.
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._actors: dict[str, _Actor] = {}
        self._running: str | None = None
        self._started = False
        self._progress = 0
        self._local = threading.local()
        self._aliases: dict[str, str] = {}
        self._uuid_streams: dict[str, random.Random] = {}
        self._aborting = False

    # -- actors ---------------------------------------------------------------------------

    def spawn(
        self, name: str, body: Callable[[], None], *, can_crash: bool = True, weight: float = 1.0
    ) -> None:
        """Register an actor; its thread starts parked and runs ``body`` when first chosen.

        ``weight``: how likely the actor is chosen among the parked ones (relative speed).
        """
        if name in self._actors:
            raise ValueError(f"two actors named {name!r}")
        actor = _Actor(name, can_crash, weight, wake=threading.Condition(self._lock))
        self._actors[name] = actor

        def main() -> None:
            self._local.actor = name
            try:
                self._park(actor, None)
                body()
            except Aborted:
                pass
            except (Exception, Crash) as exc:  # noqa: BLE001 - re-raised by run()
                self._fail(exc)
            finally:
                with self._lock:
                    actor.state = "done"
                    if self._running == name:
                        self._running = None
                    self._progress += 1
                    self._dispatch_locked()
                    self._cv.notify_all()

        threading.Thread(target=main, name=f"sim-{name}", daemon=True).start()

    def run(self) -> None:
        """Schedule parked actors until all are done; re-raise the first failure."""
        with self._lock:
            self._started = True
            self._dispatch_locked()
            seen = self._progress
            while not all(a.state == "done" for a in self._actors.values()):
                if self._cv.wait(timeout=_PARK_TIMEOUT_S) or self._progress != seen:
                    seen = self._progress
                    continue
                busy = [a.name for a in self._actors.values() if a.state == "running"]
                if self.failure is None:
                    self.failure = DeterminismError(
                        f"actors {busy} neither parked nor finished in {_PARK_TIMEOUT_S}s: "
                        "blocked on something a parked actor holds?"
                    )
                self._abort_locked()
                break
        if self.failure is not None:
            raise self.failure

    def _dispatch_locked(self) -> None:
        """If every actor is parked or done, hand the baton to one parked actor (drawn from
        the seed, with the fault for its call), or abort the run after a failure."""
        if not self._started or not self._settled():
            return
        parked = sorted(n for n, a in self._actors.items() if a.state == "parked")
        if not parked:
            return  # all done: run() is notified by the thread that finished last
        if self.failure is not None:
            self._abort_locked()
            return
        actor = self._choose(parked)
        name = actor.name
        actor.fault = self._draw_fault(actor)
        if actor.pending is not None:
            op, key = actor.pending
            self.trace.append((name, op, self._canonical(key), actor.fault))
        actor.state = "running"
        self._running = name
        assert actor.wake is not None
        actor.wake.notify_all()
        # The watchdog in run() hears of every handoff (so its timeout runs from the last
        # one). It only notes the progress, yet waking it here made runs on a loaded machine
        # faster, not slower: 120 seeds in two worker processes took 10-16 s with it and
        # 16-21 s without (load 15 on 2 cores; the kernel seems to run the chosen actor
        # sooner), for ~10 us more CPU per handoff.
        self._cv.notify_all()

    def _choose(self, parked: list[str]) -> _Actor:
        """One parked actor, with probability proportional to its weight."""
        actors = [self._actors[name] for name in parked]
        roll = self.rng.random() * sum(a.weight for a in actors)
        for actor in actors:
            roll -= actor.weight
            if roll < 0:
                return actor
        return actors[-1]

    def _settled(self) -> bool:
        return self._running is None and all(
            a.state in ("parked", "done") for a in self._actors.values()
        )

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = exc

    def _abort_locked(self) -> None:
        self._aborting = True
        for actor in self._actors.values():
            assert actor.wake is not None
            actor.wake.notify_all()
        self._cv.notify_all()

    def current(self) -> str:
        """The actor a call from this thread belongs to (see the module docstring)."""
        name = getattr(self._local, "actor", None)
        if name is not None:
            return str(name)
        with self._lock:
            if self._running is None:
                raise DeterminismError(
                    f"blob call from thread {threading.current_thread().name!r} while no actor "
                    "runs: a library thread outlived the call that started it"
                )
            return self._running

    # -- yield points ---------------------------------------------------------------------

    def step_boundary(self) -> None:
        """Yield between two steps of the calling actor (no blob call, no fault)."""
        self._park(self._actors[self.current()], None)

    def note(self, what: str) -> None:
        """Record what the running actor starts doing (a step) in the trace."""
        who = self.current()
        with self._lock:
            self.trace.append((who, "step", self._canonical(what), ""))

    def call(self, op: str, key: str, fn: Callable[[], _T]) -> _T:
        """Make one blob call ``fn`` as a yield point, injecting the fault drawn for it."""
        actor = self._actors[self.current()]
        if actor.dead == "crash":
            raise Crash(f"{actor.name} is dead")
        if actor.dead == "refuse":
            raise StorageError(f"{actor.name} is dead: {op} {key} not made")
        fault = self._park(actor, (op, key))
        if fault:
            self.injected[fault.removesuffix("_after")] += 1
        if fault in ("crash", "transient", "permanent"):
            self._raise(actor, fault, op, key)
        result = fn()
        if fault:
            self._raise(actor, fault.removesuffix("_after"), op, key)
        return result

    def _raise(self, actor: _Actor, kind: str, op: str, key: str) -> None:
        where = f"{op} {key} by {actor.name}"
        if kind == "crash":
            actor.dead = "crash"
            raise Crash(f"injected crash at {where}")
        if kind == "transient":
            raise TransientStorageError(f"injected transient failure of {where}")
        raise StorageError(f"injected permanent failure of {where}")

    def _park(self, actor: _Actor, pending: tuple[str, str] | None) -> str:
        me = threading.get_ident()
        with self._lock:
            if actor.state == "parked":
                raise DeterminismError(
                    f"{actor.name} made two blob calls at once ({actor.pending} and {pending}): "
                    "use StoreConfig(io_threads=1) and no background snapshots"
                )
            actor.state, actor.pending, actor.thread_id = "parked", pending, me
            if self._running == actor.name:
                self._running = None
            self._progress += 1
            self._dispatch_locked()
            assert actor.wake is not None
            while actor.state != "running" and not self._aborting:
                actor.wake.wait()
            if self._aborting:
                actor.state = "running"  # unwinding; done when the thread ends
                raise Aborted
            return actor.fault

    def _draw_fault(self, actor: _Actor) -> str:
        """Always draws the same amount of randomness, so the schedule stays seed-determined."""
        roll, after = self.rng.random(), self.rng.random() < 0.5
        if actor.pending is None:
            return ""
        rates = self.faults
        mutating = actor.pending[0] in _MUTATING
        suffix = "_after" if after and mutating else ""
        crash = rates.crash if actor.can_crash else 0.0
        if roll < crash and self.injected["crash"] < rates.max_crashes:
            return "crash" + suffix
        roll -= crash
        if roll < rates.transient:
            return "transient" + suffix
        roll -= rates.transient
        if roll < rates.permanent:
            return "permanent" + suffix
        return ""

    # -- harness helpers ------------------------------------------------------------------

    def set_dead(self, mode: str) -> None:
        """Mark the calling actor dead (``"crash"``/``"refuse"``) or alive again (``""``).

        While the harness closes a crashed actor's abandoned objects, their blob calls are
        refused without reaching the store, as no call of a dead process would.
        """
        self._actors[self.current()].dead = mode

    def uuid4(self) -> uuid.UUID:
        """A uuid drawn from a stream of the calling thread's owner: the actor for its own
        thread, ``"<actor>/pool"`` for a library thread working for it (the two may run at
        once: an upload reads its next file while its pool writes the last), ``"harness"``
        outside any actor. So every stream is consumed in an order the seed determines."""
        name = getattr(self._local, "actor", None)
        with self._lock:
            if name is None:
                name = "harness" if self._running is None else f"{self._running}/pool"
            rng = self._uuid_streams.get(name)
            if rng is None:
                rng = self._uuid_streams[name] = random.Random(f"uuid/{self.seed}/{name}")
            return uuid.UUID(int=rng.getrandbits(128), version=4)

    def actor_rng(self, name: str) -> random.Random:
        """The actor's own choices (keys, values, steps): seeded per actor, so they depend
        on the seed and on what that actor has seen, never on thread timing."""
        return random.Random(f"{self.seed}/{name}")

    def _canonical(self, key: str) -> str:
        def alias(match: re.Match[str]) -> str:
            return self._aliases.setdefault(match.group(0), f"<id{len(self._aliases) + 1}>")

        return _RANDOM_ID.sub(alias, key)
