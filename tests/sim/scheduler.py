"""A seeded baton scheduler: actors run as greenlets of one thread, exactly one at a time.

Every blob store call an actor makes is a **yield point**: the actor switches back to the
scheduler, which draws from ``random.Random(seed)`` which parked actor goes next and which
fault, if any, hits the call it is parked at, and switches to that actor. So the interleaving,
and every fault, is a function of the seed alone. Actors are greenlets (``greenlet``), not
threads: a handoff is a switch inside one thread, with no lock, no condition and no system
call (OS threads handing a baton cost two futex round trips per blob call: a quarter of the
simulation's CPU was the kernel's). The scheduler's thread is one of its own, so that
:meth:`Sim.run` can watch it: an actor that neither yields nor finishes for
``_PARK_TIMEOUT_S`` (blocked on a lock another actor holds across a yield point, say) fails
the run with :class:`DeterminismError` instead of hanging it.

Threads of the library make no blob calls in the simulation's configuration: with
``StoreConfig(io_threads=1)`` snapshot transfers and ``put_many``/``get_many`` run in the
caller's thread (``statekeeper.storage.transfer_pool``), ``backend.snapshot`` uploads in the
caller's thread, and background snapshots are avoided altogether (``snapshot_every`` is huge:
snapshots are taken as explicit actor steps). A blob call from any other thread would make
the run depend on thread timing, so it raises :class:`DeterminismError` naming the thread.
Library threads that make no blob calls (a commit's write batch prepared on a helper) are
fine: the actor waits for them as it would in production.

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

import greenlet

from statekeeper.errors import StorageError, TransientStorageError

__all__ = [
    "Aborted",
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
    """The run stopped being a function of its seed (a blob call from a library thread, a
    blocked actor)."""


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
    body: Callable[[], None]
    can_crash: bool
    weight: float
    state: str = "parked"  # parked | running | done
    pending: tuple[str, str] | None = None
    fault: str = ""
    dead: str = ""  # "" alive, "crash": calls raise Crash, "refuse": calls raise StorageError
    glet: _ActorGreenlet | None = None
    """Made by the scheduler's thread when the run starts (a greenlet lives in one thread)."""


class _ActorGreenlet(greenlet.greenlet):  # type: ignore[misc]
    """An actor's greenlet, which knows its actor (see :meth:`Sim.current`)."""

    actor: _Actor


@dataclass
class Sim:
    """The scheduler of one run: the seeded choices, the trace, fault counters."""

    seed: int
    faults: FaultRates = field(default_factory=FaultRates)
    rng: random.Random = field(init=False)
    trace: list[TraceEntry] = field(default_factory=list)
    injected: Counter[str] = field(default_factory=Counter)
    failure: BaseException | None = None

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self._actors: dict[str, _Actor] = {}
        self._running: _Actor | None = None
        self._hub: greenlet.greenlet | None = None
        self._thread: threading.Thread | None = None
        self._handoffs = 0
        """Handoffs so far: :meth:`run` watches it move."""
        self._aborting = False
        self._aliases: dict[str, str] = {}
        # Streams of uuids per owner (see uuid4); a library thread may draw from its own
        # while an actor runs, hence the lock.
        self._uuid_lock = threading.Lock()
        self._uuid_streams: dict[str, random.Random] = {}

    # -- actors ---------------------------------------------------------------------------

    def spawn(
        self, name: str, body: Callable[[], None], *, can_crash: bool = True, weight: float = 1.0
    ) -> None:
        """Register an actor; it starts parked and runs ``body`` when first chosen.

        ``weight``: how likely the actor is chosen among the parked ones (relative speed).
        """
        if name in self._actors:
            raise ValueError(f"two actors named {name!r}")
        if self._thread is not None:
            raise RuntimeError(f"actor {name!r} spawned after the run started")
        self._actors[name] = _Actor(name, body, can_crash, weight)

    def run(self) -> None:
        """Schedule parked actors until all are done; re-raise the first failure.

        The actors run in a thread of the scheduler's own; this one watches that a handoff
        happens at least every ``_PARK_TIMEOUT_S``.
        """
        if self._thread is not None:
            raise RuntimeError("a Sim runs once")
        finished = threading.Event()

        def schedule() -> None:
            try:
                self._schedule()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, in run()
                self._fail(exc)
            finally:
                finished.set()

        self._thread = threading.Thread(target=schedule, name="sim-scheduler", daemon=True)
        self._thread.start()
        seen = -1
        while not finished.wait(timeout=_PARK_TIMEOUT_S):
            if self._handoffs == seen:
                running = self._running.name if self._running is not None else None
                # The blocked actor cannot be unwound from here: the scheduler's thread (a
                # daemon) is abandoned with it.
                self._fail(
                    DeterminismError(
                        f"actor {running!r} neither yielded nor finished in "
                        f"{_PARK_TIMEOUT_S}s: blocked on something a parked actor holds? "
                        "(actors are greenlets of one thread: a lock held across a blob "
                        "call blocks every actor that takes it)"
                    )
                )
                break
            seen = self._handoffs
        if self.failure is not None:
            raise self.failure

    def _schedule(self) -> None:
        """The scheduler's loop (in its own thread): while any actor is parked, pick one
        (drawn from the seed, with the fault for its call) and switch to it until it yields
        or finishes; after a failure, unwind every parked actor instead."""
        self._hub = greenlet.getcurrent()
        for actor in self._actors.values():
            glet = _ActorGreenlet(self._actor_main)
            glet.actor = actor
            actor.glet = glet
        while True:
            parked = sorted(n for n, a in self._actors.items() if a.state == "parked")
            if not parked:
                return
            if self.failure is not None:
                self._aborting = True
                actor = self._actors[parked[0]]
            else:
                actor = self._choose(parked)
                actor.fault = self._draw_fault(actor)
                if actor.pending is not None:
                    op, key = actor.pending
                    self.trace.append((actor.name, op, self._canonical(key), actor.fault))
            actor.state = "running"
            self._running = actor
            self._handoffs += 1
            assert actor.glet is not None
            actor.glet.switch()
            self._running = None

    def _actor_main(self) -> None:
        actor: _Actor = greenlet.getcurrent().actor
        try:
            if self._aborting:  # torn down before it ever ran
                return
            actor.body()
        except Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - re-raised by run(); the others unwind
            self._fail(exc)
        finally:
            actor.state = "done"

    def _choose(self, parked: list[str]) -> _Actor:
        """One parked actor, with probability proportional to its weight."""
        actors = [self._actors[name] for name in parked]
        roll = self.rng.random() * sum(a.weight for a in actors)
        for actor in actors:
            roll -= actor.weight
            if roll < 0:
                return actor
        return actors[-1]

    def _fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc

    def _current(self) -> _Actor:
        """The actor the calling greenlet is.

        Raises:
            DeterminismError: called from a thread that is no actor's (a library thread).
        """
        actor: _Actor | None = getattr(greenlet.getcurrent(), "actor", None)
        if actor is None:
            raise DeterminismError(
                f"blob call from thread {threading.current_thread().name!r}, which is no "
                "actor's: its timing would decide the schedule (use StoreConfig(io_threads=1) "
                "and no background snapshots, so that the library calls in the actor's thread)"
            )
        return actor

    def current(self) -> str:
        """The name of the actor a call from here belongs to (see :meth:`_current`)."""
        return self._current().name

    # -- yield points ---------------------------------------------------------------------

    def step_boundary(self) -> None:
        """Yield between two steps of the calling actor (no blob call, no fault)."""
        self._park(self._current(), None)

    def note(self, what: str) -> None:
        """Record what the running actor starts doing (a step) in the trace."""
        self.trace.append((self._current().name, "step", self._canonical(what), ""))

    def call(self, op: str, key: str, fn: Callable[[], _T]) -> _T:
        """Make one blob call ``fn`` as a yield point, injecting the fault drawn for it."""
        actor = self._current()
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
        """Hand the baton back to the scheduler until it picks this actor again; the fault
        drawn for ``pending``. Raises :class:`Aborted` once the run is being torn down."""
        if self._aborting:
            raise Aborted
        actor.state, actor.pending = "parked", pending
        assert self._hub is not None
        self._hub.switch()
        if self._aborting:
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
        self._current().dead = mode

    def uuid4(self) -> uuid.UUID:
        """A uuid drawn from a stream of the caller's owner: the actor for its own greenlet,
        ``"<actor>/pool"`` for a library thread working for the running actor, ``"harness"``
        outside any actor. So every stream is consumed in an order the seed determines."""
        actor: _Actor | None = getattr(greenlet.getcurrent(), "actor", None)
        if actor is not None:
            name = actor.name
        else:
            running = self._running
            name = "harness" if running is None else f"{running.name}/pool"
        with self._uuid_lock:
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
