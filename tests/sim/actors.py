"""Actors of the simulation: writers, snapshotters, garbage collectors and readers.

Each actor is a sequence of steps run by one thread under the baton, on its own **host** (a
local_dir of its own), through the public API of statekeeper only. A :class:`Crash` at any
yield point kills the actor's process: its objects are abandoned (their blob calls refused,
their RocksDB handles released, flushed or not), its host kept or replaced by an empty one, and
its next step starts a new process (a new ``StateBackend``). Everything an actor observes is
checked against the :class:`~tests.sim.model.Model` as soon as it is observed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import statekeeper as sk
from tests.sim import policy
from tests.sim.blobstore import SimBlobStore
from tests.sim.determinism import settle
from tests.sim.model import InvariantViolation, Model
from tests.sim.policy import PLAIN_ORDER, Attempt, Order, State
from tests.sim.scheduler import Crash, Sim

if TYPE_CHECKING:
    from statekeeper.storage import LocalBlobStore
    from tests.sim.scenarios import ActorSpec, Scenario

__all__ = ["OP", "PARTITION", "Actor", "World", "abandon", "read_all", "store_config"]

OP = "op"
PARTITION = 0
_OPEN_ERRORS = (sk.StateNotFoundError, sk.CorruptStateError)
_OPEN_TRIES = 4
_SETTLE_S = 60.0


@dataclass
class World:
    """What the actors of one run share."""

    sim: Sim
    model: Model
    scenario: Scenario
    inner: LocalBlobStore
    tmp: Path
    checker: sk.StateBackend
    generations: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    steps: Counter[str] = field(default_factory=Counter)
    deleted: int = 0
    """Blobs deleted so far (to tell a restore that raced GC from a lost version)."""
    changes: int = 0
    """Calls that may have changed the root so far (puts, deletes, sweeps)."""
    _listed: tuple[int, list[int]] | None = None

    def changed(self, op: str) -> None:
        """A blob call that may have changed the root reached it (see SimBlobStore)."""
        self.changes += 1
        if op == "delete":
            self.deleted += 1

    def check_step(self, who: str) -> None:
        """After every step: the version listing keeps what §5 says it keeps."""
        self.check_listing(f"after {who}")

    def check_listing(self, where: str) -> None:
        """The version listing keeps what §5 says it keeps (``where``: for the message).

        The listing is read again only if a blob call may have changed the root since it was
        last read: it is a function of the root's blobs alone, which change only through
        the actors' :class:`SimBlobStore` calls (the checker only reads until the run ends).
        The model's side is checked every time all the same.
        """
        if self._listed is None or self._listed[0] != self.changes:
            self._listed = (self.changes, self.checker.versions(OP, PARTITION))
        self.model.check_versions(self._listed[1], where)


def store_config(scenario: Scenario, local_dir: Path, mode: str) -> sk.StoreConfig:
    """Deterministic settings: one I/O thread, no background snapshots, no timed flushes."""
    return sk.StoreConfig(
        mode=mode,  # type: ignore[arg-type]
        local_dir=str(local_dir),
        io_threads=1,
        snapshot_every=10**9,
        retain_versions=scenario.retain,
        orphan_ttl_s=scenario.orphan_ttl_s,
        write_buffer_mb=1,
        local_checkpoint_interval_s=1e9,
        metrics_every=3,
    )


def read_all(store: sk.StateStore, keys: list[bytes]) -> State:
    """Everything the store holds, read twice (scan and multi_get) and cross-checked."""
    items = dict(store.scan())
    point = dict(zip(keys, store.multi_get(keys), strict=True))
    stray = set(items) - set(keys)
    if stray or any(items.get(k) != v for k, v in point.items()):
        raise InvariantViolation(f"store {store!r}: scan {items} disagrees with multi_get {point}")
    return frozenset(items.items())


def abandon(store: sk.StateStore, *, flush: bool) -> None:
    """Release a dead process's store. A real crash releases the RocksDB lock by dying; here
    the handle must be closed (``StateStore._copy`` and, for an unflushed crash, the
    copy's ``_db`` and ``_closed`` are the private names used, only for that, only if
    present).

    Unflushed (``flush=False``), the copy loses its memtables as a crash does: the working
    copy's WAL is off, so what a crash leaves on disk is the files as they are now. rocksdict's
    ``close`` always flushes, so the files are kept aside (once the flushes and compactions
    under way have ended, with none started after them), the database closed, and the kept
    files put back.
    """
    copy = getattr(store, "_copy", None)
    if copy is not None:
        if flush:
            copy.close(flush=True)  # also when a close crashed half way, before releasing it
        else:
            _close_losing_memtables(copy)
    store.close()


def _close_losing_memtables(copy: Any) -> None:
    """Close ``copy`` (a WorkingCopy) and leave on disk only what was there before."""
    path = Path(copy.path)
    db = getattr(copy, "_db", None)
    if getattr(copy, "_closed", True) or db is None or not path.is_dir():
        copy.close(flush=False)
        return
    with contextlib.suppress(sk.StateKeeperError):
        copy.wait()  # a write behind the commit lands in the memtables (and is lost with them)
    # Let the flushes and compactions already started end (so the trace does not depend on
    # their timing) and start none: then no file changes. (Stopping background work
    # outright would flush the memtables first.)
    db.set_options({"disable_auto_compactions": "true"})
    busy = ("num-running-flushes", "num-running-compactions", "mem-table-flush-pending")
    deadline = time.monotonic() + _SETTLE_S
    while any(db.property_int_value(f"rocksdb.{name}") for name in busy):
        if time.monotonic() > deadline:
            raise RuntimeError(f"background work of {path} did not end in {_SETTLE_S} s")
        time.sleep(0.001)
    kept = path.with_name(path.name + ".crash")
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir()
    for entry in sorted(path.iterdir()):
        if entry.suffix == ".sst":  # immutable once written: a link is the file as it is
            os.link(entry, kept / entry.name)
        elif entry.is_file():
            shutil.copyfile(entry, kept / entry.name)
    copy.close(flush=False)
    shutil.rmtree(path)
    kept.rename(path)


class Actor:
    """The harness of one actor: processes, hosts, crashes, and the step loop."""

    kind = "actor"

    def __init__(self, world: World, name: str, spec: ActorSpec) -> None:
        self.world = world
        self.spec = spec
        self.sim = world.sim
        self.model = world.model
        self.scenario = world.scenario
        self.name = name
        self.mode = spec.mode
        self.rng = world.sim.actor_rng(name)
        self.keys = [b"k%d" % i for i in range(self.scenario.keys)]
        self._hosts = itertools.count()
        self.host = self._new_host()
        self.backend: sk.StateBackend | None = None
        self.order: Order = PLAIN_ORDER
        self.inflight: list[Attempt] = []

    # -- process lifecycle ----------------------------------------------------------------

    def _new_host(self) -> Path:
        return self.world.tmp / "hosts" / f"{self.name}-{next(self._hosts)}"

    def process(self) -> sk.StateBackend:
        """This actor's running process (a backend), started if needed."""
        if self.backend is None:
            if self.scenario.orders:
                self.order = (next(self.world.generations), 0, 0)
            self.backend = sk.StateBackend(
                self.blobs(), config=store_config(self.scenario, self.host, self.mode)
            )
        return self.backend

    def blobs(self) -> SimBlobStore:
        """A new view of the shared root for one process of this actor."""
        return SimBlobStore(
            self.sim,
            self.world.inner,
            page_size=self.scenario.page_size,
            lose_put=self.scenario.lose_put,
            on_change=self.world.changed,
            on_manifest=self._manifest_written,
            age_s=self.scenario.blob_age_s,
        )

    def _manifest_written(self) -> None:
        """A manifest put of this actor took effect: a commit in flight may have taken effect
        now, whenever it returns (see :meth:`Model.took_effect`)."""
        for attempt in self.inflight:
            self.model.took_effect(attempt)

    def held_stores(self) -> list[sk.StateStore]:
        """Stores this actor holds open (abandoned if it dies)."""
        return []

    def forget_stores(self) -> None:
        """Drop references to the stores of a dead process."""

    def die(self) -> None:
        """The process died at a yield point: abandon its objects, maybe lose the host."""
        self.sim.set_dead("refuse")
        try:
            for store in self.held_stores():
                abandon(store, flush=self.rng.random() < 0.5)
            if self.backend is not None:
                self.backend.close()
        finally:
            self.sim.set_dead("")
        for attempt in self.inflight:
            self.model.end(attempt, "unknown")
        self.inflight = []
        self.forget_stores()
        self.backend = None
        if self.rng.random() < self.scenario.wipe:
            self.host = self._new_host()  # a new host: empty local dir

    def restart(self) -> None:
        """A deliberate restart (a fixed processor redeployed): close, start anew later."""
        for store in self.held_stores():
            store.close()
        if self.backend is not None:
            self.backend.close()
        self.forget_stores()
        self.backend = None

    # -- the step loop --------------------------------------------------------------------

    def run(self) -> None:
        try:
            for n in range(self.spec.steps):
                self._one_step(n)
                for store in self.held_stores():
                    settle(store)
                self.world.steps[self.kind] += 1
                self.world.check_step(f"{self.name} step {n}")
                self.sim.step_boundary()
        finally:
            self._release()

    def _one_step(self, n: int) -> None:
        try:
            self.step(n)
        except Crash:
            self.world.steps["crashed"] += 1
            self.die()
        except sk.StorageError:
            pass  # an injected failure surfaced: the operation failed, the process lives on
        except InvariantViolation:
            raise
        except Exception as exc:
            raise InvariantViolation(f"{self.name} step {n}: the library raised {exc!r}") from exc

    def _release(self) -> None:
        """The run is over (or torn down): close everything, without touching the store.

        A RocksDB handle left open would be closed by the garbage collector later, after the
        run's folder is gone, and can then stall the whole process for seconds.
        """
        self.sim.set_dead("refuse")
        try:
            for store in self.held_stores():
                abandon(store, flush=True)
            if self.backend is not None:
                self.backend.close()
        finally:
            self.sim.set_dead("")
        self.forget_stores()
        self.backend = None

    def step(self, n: int) -> None:
        raise NotImplementedError

    # -- shared pieces --------------------------------------------------------------------

    def open_checked(
        self, backend: sk.StateBackend, version: int | None, *, write: bool = False
    ) -> tuple[sk.StateStore, State] | None:
        """Open ``version`` (latest if None), read everything, check it against the model.

        Returns ``None`` if the open failed in a way §5 allows (a storage error, or a version
        that may have expired while it was being opened).
        """
        label = "latest" if version is None else version
        who = f"{self.name} (host {self.host.name}) opening {label}"
        for _ in range(_OPEN_TRIES):
            known, deleted = self.model.known_high, self.world.deleted
            at_start, begun = self.model.candidates(), self.model.attempts_so_far()
            running = self.model.in_flight()
            try:
                if write:
                    store = policy.open_for_write(backend, OP, PARTITION, version, self.order)
                else:
                    store = backend.open(OP, PARTITION, version)
                break
            except sk.StorageError:
                return None
            except _OPEN_ERRORS as exc:
                if self.model.open_failure_allowed(version, known):
                    return None
                if self.world.deleted == deleted:
                    raise InvariantViolation(
                        f"{who}: {exc!r}; versions {list(self.model.required_versions())} "
                        "must be restorable"
                    ) from exc
                # GC deleted blobs while this restore ran from an older listing: a race, not
                # a loss, if opening again works (what a Spark task retry does).
                self.world.steps["open raced gc"] += 1
        else:
            return None
        try:
            settle(store)
            state = read_all(store, self.keys)
            if version is None:
                self.model.check_latest(store.version, known, who)
            elif store.version != version:
                raise InvariantViolation(f"{who}: the store says version {store.version}")
            self.model.observe(store.version, state, who, at_start, begun, running)
        except BaseException:
            store.close()
            raise
        return store, state
