"""What the simulation assumes about the commit protocol beyond ARCHITECTURE §5: the one file
the commit-protocol redesign (format 2, issue "commit protocol v2") edits.

Two things live here and nowhere else:

* :func:`open_for_write`: how a writer opens a store as an attempt of a given order. Format 1
  has no attempts, so the order is dropped; format 2 passes it on (``(generation, stage
  attempt, task attempt)``, see :mod:`statekeeper.manifest`).
* :func:`allowed_commit_outcomes` and :func:`may_replace`: whether a commit must succeed, must
  raise :class:`~statekeeper.CommitConflictError`, or may do either, given what the model
  knows. The rules are those of §5 invariant 4 (the format 2 semantics); where format 1 and
  format 2 legitimately differ (a re-run with identical content: format 1 accepts it, format 2
  refuses a different attempt of equal order) they allow both. They include **owners** (in
  the Spark layer, streaming queries): an attempt never replaces, adopts or builds on a
  version of another owner (:func:`statekeeper.manifest.owns`).
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Literal

import statekeeper as sk

__all__ = [
    "EMPTY_STORE_KEPT",
    "PLAIN_ORDER",
    "Attempt",
    "Order",
    "allowed_commit_outcomes",
    "commit",
    "may_replace",
    "open_for_write",
    "owners_agree",
]

Order = tuple[int, int, int]
"""(generation, stage attempt, task attempt): higher is newer."""
PLAIN_ORDER: Order = (0, 0, 0)
State = frozenset[tuple[bytes, bytes]]
Outcome = Literal["ack", "conflict"]


@dataclass(eq=False)
class Attempt:
    """One commit of one version by one writer, from the writer's point of view."""

    id: int
    actor: str
    version: int
    order: Order
    parent: State
    """The content of ``version - 1`` the writer opened and built on."""
    state: State
    """The content ``version`` has if this attempt is the one that won it."""
    status: str = "inflight"  # inflight | acked | unknown (failed or crashed) | refused
    landed: bool = False
    """Known to have been the content of ``version`` at some point (acked or read back)."""
    dropped: str = ""
    """Why the model ruled out that this attempt holds its version (empty: it may)."""
    notes: list[str] = field(default_factory=list)
    effect_outcomes: frozenset[str] = frozenset()
    """What its commit could have returned at the moment its last manifest put took effect
    (empty: none did): the commit decided then, however long it takes to return."""
    owner: str = ""
    """Whom it commits for (a streaming query); empty: anyone's, as every version of a
    scenario without ``queries`` is, and version 0 (the empty store) always."""

    def describe(self) -> str:
        owner = f", owner {self.owner}" if self.owner else ""
        return (
            f"attempt #{self.id} of {self.actor} (order {self.order}{owner}, {self.status}) "
            f"-> {render(self.state)}"
        )


def render(state: State) -> str:
    """A state as a short, sorted dict literal."""
    return "{" + ", ".join(f"{k.decode()}: {v.decode()}" for k, v in sorted(state)) + "}"


EMPTY_STORE_KEPT = True
"""Whether version 0 (the empty store) stays restorable while it is retained.

Format 1 lists it only while changelog 1 exists: once version 1 is a snapshot (snapshot
mode), ``open(version=0)`` fails and batch 0 cannot be re-run. Scenarios take this default;
``snapshot_rerun_batch0`` asks for it. Format 2 keeps it (True).
"""


def open_for_write(
    backend: sk.StateBackend, operator: str, partition: int, version: int | None, order: Order
) -> sk.StateStore:
    """Open a store for a batch, as an attempt of ``order`` (format 2 takes the order at
    commit: see :func:`commit`)."""
    del order
    return backend.open(operator, partition, version)


def commit(store: sk.StateStore, order: Order, owner: str = "") -> sk.CommitInfo:
    """Commit as an attempt of ``order`` and ``owner`` (empty: none, the plain API's
    default): the simulation's ``(generation, stage attempt, task attempt)`` is format 2's
    ``(generation, stage id, stage attempt, task attempt)`` with one stage."""
    generation, stage_attempt, task_attempt = order
    full = (generation, 0, stage_attempt, task_attempt)
    if not owner:
        return store.commit(order=full)  # exactly the call of the scenarios without owners
    return store.commit(order=full, owner=owner)


def owners_agree(owner: str, other: str) -> bool:
    """Whether an attempt of ``owner`` may replace, adopt or build on a version of ``other``
    (:func:`statekeeper.manifest.owns`): either is empty, or both are the same.

    The rules below compare owners pair by pair, which is sound when agreeing is transitive:
    the owners of one scenario's writers are either all empty or all named (version 0, the
    empty store, has none and is never replaced).
    """
    return not owner or not other or owner == other


def may_replace(new: Attempt, holder: Attempt) -> bool:
    """Whether ``new`` may replace ``holder`` as its version (if nothing was built on it).

    §5.4: a newer attempt replaces an older attempt's ``b + 1``; equal orders never replace
    each other; an older one (a zombie) never displaces a newer one; and an attempt of one
    owner never replaces another owner's version, however new it is (a query started with a
    fresh checkpoint re-running batch 0 over another query's version 1).
    """
    return new.order > holder.order and owners_agree(new.owner, holder.owner)


def allowed_commit_outcomes(
    attempt: Attempt,
    rivals: Sequence[Attempt],
    *,
    parent: Literal["yes", "maybe", "no"],
    parent_owners: AbstractSet[str],
    successor: Literal["none", "maybe", "landed"],
    fence_certain: Order,
    fence_possible: Order,
) -> frozenset[Outcome]:
    """What ``attempt.commit()`` may return, given the model's knowledge at that moment.

    Args:
        attempt: the commit that just returned.
        rivals: other attempts that may hold ``attempt.version`` now (landed, in flight, or
            failed in a way that may have landed).
        parent: whether what the attempt built on may still be ``version - 1``.
        parent_owners: the owners of what the attempt may have built on (the attempts that
            may hold ``version - 1`` with the content it loaded); ``""`` among them if that
            has no owner (version 0, or a snapshot base whose entry is no longer retained).
        successor: whether ``version + 1`` exists.
        fence_certain: the highest order of an attempt known to have committed.
        fence_possible: the highest order of an attempt that may have committed.
    """
    if attempt.landed or any(
        r.landed and r.state == attempt.state and owners_agree(attempt.owner, r.owner)
        for r in rivals
    ):
        # It was read back as the version (a retry of a write that landed), or it re-runs a
        # committed version with identical content: format 1 accepts that, format 2 refuses
        # another attempt of equal order. Either way the version holds this content. Another
        # owner's identical content is never adopted: the rules below decide.
        return frozenset({"ack", "conflict"})
    if attempt.order < fence_certain or parent == "no" or successor == "landed":
        return frozenset({"conflict"})  # a zombie, a stale parent, or a final version
    if not any(owners_agree(attempt.owner, owner) for owner in parent_owners):
        return frozenset({"conflict"})  # it built on another owner's version
    for rival in rivals:
        if rival.landed and not may_replace(attempt, rival):
            # Another attempt committed it first (or another owner's holds it), unless the
            # read that showed its content may have shown a twin's: identical content this
            # attempt may replace.
            twins = [r for r in rivals if r is not rival and r.landed and r.state == rival.state]
            if not any(may_replace(attempt, twin) for twin in twins):
                return frozenset({"conflict"})
    if (
        all(may_replace(attempt, rival) for rival in rivals)
        and parent == "yes"
        and all(owners_agree(attempt.owner, owner) for owner in parent_owners)
        and successor == "none"
        and attempt.order >= fence_possible
    ):
        return frozenset({"ack"})  # nothing can be in its way: a refusal would wedge it
    return frozenset({"ack", "conflict"})
