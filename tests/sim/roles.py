"""The roles an actor plays: writer, snapshotter, garbage collector, reader.

A :class:`~tests.sim.scheduler.Crash` is never caught here: it unwinds to the harness
(:meth:`Actor.run`) with the stores still held, so that they are abandoned as a dead process
leaves them, not closed gracefully.
"""

from __future__ import annotations

import contextlib
import shutil

import statekeeper as sk
from tests.sim import policy
from tests.sim.actors import OP, PARTITION, Actor, World
from tests.sim.model import InvariantViolation
from tests.sim.policy import Attempt, Order, State
from tests.sim.scenarios import ActorSpec

__all__ = ["ROLES", "Collector", "Reader", "Snapshotter", "Writer"]

Writes = dict[bytes, bytes | None]


class Writer(Actor):
    """Runs batches: open (latest, or an older version to re-run a batch), write, commit.

    Between batches it may snapshot or collect garbage through its own backend, or restart (a
    fixed processor redeployed; with ``zombies`` the old process lives on and commits once
    more later). A re-run repeats the previous batch's writes (a task retry) or writes other
    content (a fixed processor). With the scenario's ``queries`` it is a streaming query of
    its own, the owner of what it commits; its old process (a zombie) is of the same query.
    """

    kind = "writer"

    def __init__(self, world: World, name: str, spec: ActorSpec) -> None:
        super().__init__(world, name, spec)
        self.store: sk.StateStore | None = None
        self.state: State = frozenset()
        self.last = 0  # the last version this writer committed
        self.batches: dict[int, Writes] = {}
        self.values = 0
        self.zombie: tuple[sk.StateStore, State, Order] | None = None
        queries = self.scenario.queries
        self.owner = queries[int(name.removeprefix("writer") or 0)] if queries else ""

    def held_stores(self) -> list[sk.StateStore]:
        held = [self.store] if self.store is not None else []
        return held + ([self.zombie[0]] if self.zombie is not None else [])

    def forget_stores(self) -> None:
        self.store, self.zombie = None, None

    def step(self, n: int) -> None:
        s, roll = self.scenario, self.rng.random()
        if self.zombie is not None and roll < 0.3:
            self._zombie_batch()
        elif roll < s.writer_snapshots:
            self._snapshot()
        elif roll < s.writer_snapshots + s.writer_gc:
            self.sim.note("gc")
            self.process().gc()
        elif roll < s.writer_snapshots + s.writer_gc + s.restarts:
            self.sim.note("restart")
            if s.zombies and self.store is not None and self.zombie is None:
                self.zombie = (self.store, self.state, self.order)
                self.store, self.backend = None, None
                self.host = self._new_host()  # the old process keeps its working copy
            else:
                self.restart()
        else:
            self._batch()

    def _snapshot(self) -> None:
        """Snapshot the open store (opened first if need be, so the model checks it)."""
        if self.store is None:
            self.sim.note("open latest")
            opened = self.open_checked(self.process(), None, write=True)
            if opened is None:
                return
            self.store, self.state = opened
        self.sim.note(f"snapshot {self.store.version}")
        self.process().snapshot(OP, PARTITION)

    def _batch(self) -> None:
        if self.store is None:
            version = self._version_to_open()
            self.sim.note(f"open {'latest' if version is None else version}")
            opened = self.open_checked(self.process(), version, write=True)
            if opened is None:
                return
            self.store, self.state = opened
        store = self.store
        target = store.version + 1
        same = self.batches.get(target) if self.rng.random() < 0.5 else None
        writes = same if same is not None else self._writes()
        self.sim.note(f"commit {target}")
        attempt = self._apply(store, self.state, self.order, writes, self.name)
        if self._commit(store, attempt):
            self.state, self.last = attempt.state, target
            self.batches[target] = writes
            if self.rng.random() < 0.25:
                self._drop_store(store)

    def _version_to_open(self) -> int | None:
        """The latest version (``None``), or an older one to re-run a batch: one before the
        last this writer committed, or, for a query that has committed nothing yet, version
        0 (a fresh checkpoint starts at batch 0, whatever the store holds)."""
        fresh = bool(self.scenario.queries) and self.last == 0
        if not (self.last >= 1 or fresh) or self.rng.random() >= self.scenario.rerun:
            return None
        if fresh:
            return 0
        back = self.rng.random() < 0.7
        return self.last - 1 if back else self.rng.randint(0, self.last - 1)

    def _writes(self) -> Writes:
        writes: Writes = {}
        for _ in range(self.rng.randint(1, 3)):
            self.values += 1
            key = self.rng.choice(self.keys)
            delete = self.rng.random() < 0.25
            writes[key] = None if delete else f"{self.name}.{self.values}".encode()
        return writes

    def _apply(
        self, store: sk.StateStore, parent: State, order: Order, writes: Writes, who: str
    ) -> Attempt:
        attempt = self.model.begin(who, store.version + 1, order, parent, writes, self.owner)
        for key, value in writes.items():
            if value is None:
                store.delete(key)
            else:
                store.put(key, value)
        self.inflight = [attempt]
        return attempt

    def _commit(self, store: sk.StateStore, attempt: Attempt) -> bool:
        """Commit, retrying after a storage error in changelog mode; True if acknowledged."""
        while True:
            try:
                info = policy.commit(store, attempt.order, attempt.owner)
            except sk.CommitConflictError as exc:
                self._check_refusal(attempt, exc)
                self.inflight = []
                self.model.end(attempt, "conflict")
                self._drop_store(store)
                return False
            except sk.StorageError:
                self.model.end(attempt, "unknown")
                if self.mode == "changelog" and self.rng.random() < 0.5:
                    self.model.resume(attempt)  # §3: the writes are kept, commit may retry
                    continue
                self.inflight = []
                self._drop_store(store)
                return False
            self.inflight = []
            self.model.end(attempt, "ack")
            if info.version != attempt.version:
                raise InvariantViolation(
                    f"{self.name}: commit of version {attempt.version} returned {info.version}"
                )
            return True

    def _check_refusal(self, attempt: Attempt, exc: sk.CommitConflictError) -> None:
        """A refusal for the owner's sake must have an owner behind it."""
        if isinstance(exc, sk.OwnerConflictError):
            self.model.check_owner_conflict(attempt)

    def _drop_store(self, store: sk.StateStore) -> None:
        store.close()  # held until closed: a crash while closing abandons it
        if store is self.store:
            self.store = None

    def _zombie_batch(self) -> None:
        """The old process of a restarted writer commits once more, then is gone; with
        ``stale``, with the new process's order (a cached store reused by the new run)."""
        assert self.zombie is not None
        store, state, order = self.zombie
        if self.scenario.stale:
            self.process()  # the new run has started: its order
            order = self.order
        self.sim.note(f"zombie commit {store.version + 1}")
        attempt = self._apply(store, state, order, self._writes(), f"{self.name}-zombie")
        try:
            policy.commit(store, order, attempt.owner)
        except sk.CommitConflictError as exc:
            self._check_refusal(attempt, exc)
            self.model.end(attempt, "conflict")
        except sk.StorageError:
            self.model.end(attempt, "unknown")
        else:
            self.model.end(attempt, "ack")
        self.inflight = []
        store.close()
        self.zombie = None


class Snapshotter(Actor):
    """A host that opens the latest version, checks it, and snapshots it: at once, or at its
    next step (a slow uploader, whose snapshot is of a version others have left behind)."""

    kind = "snapshotter"

    def __init__(self, world: World, name: str, spec: ActorSpec) -> None:
        super().__init__(world, name, spec)
        self.store: sk.StateStore | None = None

    def held_stores(self) -> list[sk.StateStore]:
        return [self.store] if self.store is not None else []

    def forget_stores(self) -> None:
        self.store = None

    def step(self, n: int) -> None:
        if self.store is None:
            if self.rng.random() < self.spec.fresh:
                self.restart()
                self.host = self._new_host()
            self.sim.note("open latest")
            opened = self.open_checked(self.process(), None)
            if opened is None:
                return
            self.store = opened[0]
            if self.rng.random() < self.spec.hold:
                return  # snapshot at the next step
        self.sim.note(f"snapshot {self.store.version}")
        try:
            self.process().snapshot(OP, PARTITION)  # uses the store this backend holds open
        except sk.StorageError:
            pass
        except (sk.StateNotFoundError, sk.CorruptStateError) as exc:
            version = self.store.version
            if not self.model.open_failure_allowed(version, version):
                raise InvariantViolation(
                    f"{self.name}: snapshot of version {version} failed: {exc!r}"
                ) from exc
        self.store.close()
        self.store = None


class Collector(Actor):
    """A host that runs garbage collection."""

    kind = "gc"

    def step(self, n: int) -> None:
        self.sim.note("gc")
        with contextlib.suppress(sk.StorageError):  # an injected failure surfaced
            self.process().gc()


class Reader(Actor):
    """A fresh host per step: a new backend with an empty local dir reads one version."""

    kind = "reader"

    def step(self, n: int) -> None:
        if self.backend is not None:  # the last step failed half way
            self.backend.close()
            self.backend = None
        self.host = self._new_host()
        version: int | None = None
        floor, high = self.model.retained_floor(), self.model.known_high
        if self.rng.random() < 0.5 and floor <= high:
            version = self.rng.randint(floor, high)
        self.sim.note(f"read {'latest' if version is None else version}")
        backend = self.process()
        opened = self.open_checked(backend, version)
        if opened is not None:
            opened[0].close()
        backend.close()
        self.backend = None
        shutil.rmtree(self.host, ignore_errors=True)


ROLES: dict[str, type[Actor]] = {
    "writer": Writer,
    "snapshotter": Snapshotter,
    "gc": Collector,
    "reader": Reader,
}
