"""The model of one store: which content each version may hold, narrowed by what actors see.

For every version the model keeps its **candidates**: the attempts that may hold it now. An
attempt becomes a candidate when its commit starts; it stays one if it was acknowledged, or if
it failed in a way that may have landed (a storage error, a crash); it is dropped when it was
refused, when a reader saw other content for the version and it cannot replace that content
any more (an older attempt, or another owner's), or when lineage rules it out (a version
built on other content of its parent, or the parent of a version that exists). Every
observation must match a candidate, every commit outcome must be one
:func:`~tests.sim.policy.allowed_commit_outcomes` allows, and the store's version listing must
keep every version §5 says it keeps. Only public behaviour is checked: what
``open``/``scan``/``commit``/``versions`` return, never a blob name.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from tests.sim.policy import (
    PLAIN_ORDER,
    Attempt,
    Order,
    State,
    allowed_commit_outcomes,
    may_replace,
    owners_agree,
    render,
)

__all__ = ["InvariantViolation", "Model"]

_UNSETTLED = ("inflight", "unknown")
"""Statuses of attempts that may have landed, or may still land, without the model knowing."""

Writes = dict[bytes, bytes | None]


class InvariantViolation(AssertionError):
    """An invariant of ARCHITECTURE §5 does not hold."""


class Model:
    """Candidates per version of the one store of a run, and the checks on them.

    Args:
        retain: ``retain_versions`` of the scenario.
        gc: whether garbage collection may run (versions below the retention may vanish).
        keep_empty: whether version 0 must stay restorable once version 1 may exist (see
            :data:`tests.sim.policy.EMPTY_STORE_KEPT`).
    """

    def __init__(self, *, retain: int, gc: bool, keep_empty: bool) -> None:
        self.retain = retain
        self.gc = gc
        self.keep_empty = keep_empty
        self._ids = itertools.count(1)
        genesis = Attempt(0, "genesis", 0, PLAIN_ORDER, frozenset(), frozenset(), "acked", True)
        self.cands: dict[int, list[Attempt]] = {0: [genesis]}
        self.attempts: list[Attempt] = [genesis]
        self.known_high = 0
        """Highest version known to exist (acknowledged or read)."""
        self._overlapping: dict[int, frozenset[int]] = {genesis.id: frozenset()}
        """Per attempt, the attempts whose commits were running when it began."""
        self.superseded: set[int] = set()
        """Attempts that left the candidates unsettled because one that may replace them
        holds their version (acknowledged, or read): they may have held it before (a commit
        that crashed after its manifest landed, re-run by its query's restarted process). A
        read that began before the replacement may return their content (:meth:`observe`),
        and a commit of theirs still under way may return either way (:meth:`end`)."""

    # -- queries --------------------------------------------------------------------------

    @property
    def maybe_high(self) -> int:
        """Highest version that may exist."""
        return max(v for v, c in self.cands.items() if c)

    def retained_floor(self) -> int:
        """Versions from here up are guaranteed restorable (§5.5), given what may exist."""
        floor = max(0, self.maybe_high - self.retain + 1) if self.gc else 0
        if not self.keep_empty and self.maybe_high >= 1:
            floor = max(floor, 1)
        return floor

    def required_versions(self) -> range:
        """Versions that must be restorable right now."""
        return range(self.retained_floor(), self.known_high + 1)

    def contents(self, version: int) -> list[str]:
        return [c.describe() for c in self.cands.get(version, [])]

    # -- commits --------------------------------------------------------------------------

    def begin(
        self,
        actor: str,
        version: int,
        order: Order,
        parent: State,
        writes: Writes,
        owner: str = "",
    ) -> Attempt:
        """Register a commit of ``version`` built on ``parent`` with ``writes``, for
        ``owner`` (empty: none)."""
        state = dict(parent)
        for key, value in writes.items():
            if value is None:
                state.pop(key, None)
            else:
                state[key] = value
        attempt = Attempt(
            next(self._ids), actor, version, order, parent, frozenset(state.items()), owner=owner
        )
        self._overlapping[attempt.id] = self.in_flight()
        self.attempts.append(attempt)
        self.cands.setdefault(version, []).append(attempt)
        return attempt

    def resume(self, attempt: Attempt) -> None:
        """The same attempt commits again (a retry after a storage error)."""
        attempt.status = "inflight"

    def took_effect(self, attempt: Attempt) -> None:
        """A manifest put of ``attempt``'s commit took effect: the commit decided now. What it
        may return is judged as of now too (:meth:`end`): a commit that landed, then spent a
        while on its metrics (retried), returns after a newer attempt may have committed,
        and was right to land all the same."""
        if attempt.status == "inflight":
            attempt.effect_outcomes = self._allowed(attempt)

    def end(self, attempt: Attempt, outcome: str) -> None:
        """Record how a commit returned: ``"ack"``, ``"conflict"`` or ``"unknown"``.

        Raises:
            InvariantViolation: the outcome is not allowed (§5.1, §5.4).
        """
        if outcome == "unknown":
            attempt.status = "unknown"
            return
        if attempt.id in self.superseded:
            # It may have landed before the attempt that holds its version replaced it, or
            # not: either outcome is true to that, and it is no candidate again either way.
            # Landed, it was built on what the version below held: that version was final
            # while it held its own, so the holder now was built on the same content.
            below = {c.state for c in self.cands.get(attempt.version - 1, [])}
            if outcome == "ack" and attempt.parent not in below:
                raise InvariantViolation(
                    f"version {attempt.version}: {attempt.describe()} was acknowledged, built "
                    f"on {render(attempt.parent)}, which version {attempt.version - 1} cannot "
                    f"have held: {self.contents(attempt.version - 1)}"
                )
            attempt.status = "refused" if outcome == "conflict" else "acked"
            attempt.landed = attempt.landed or outcome == "ack"
            return
        if outcome == "ack" and attempt.dropped:
            raise InvariantViolation(
                f"{attempt.describe()} was acknowledged for version {attempt.version}, "
                f"but it cannot be that version: {attempt.dropped}"
            )
        allowed = self._allowed(attempt)
        if outcome == "ack":
            allowed |= attempt.effect_outcomes & {"ack"}
        if outcome not in allowed:
            what = (
                "committed although the protocol must refuse it"
                if outcome == "ack"
                else "was refused with CommitConflictError although nothing may stand in its "
                "way (the writer is wedged)"
            )
            raise InvariantViolation(
                f"version {attempt.version}: {attempt.describe()} {what}; built on "
                f"{render(attempt.parent)}; other candidates: "
                f"{[c.describe() for c in self._rivals(attempt)] or 'none'}; candidates of "
                f"version {attempt.version - 1}: {self.contents(attempt.version - 1)}"
            )
        if outcome == "conflict":
            attempt.status = "refused"
            if not attempt.landed:  # one read back holds it, whatever its writer was told
                self._drop(attempt, "its commit was refused")
            return
        attempt.status, attempt.landed = "acked", True
        self.known_high = max(self.known_high, attempt.version)
        rivals = self._rivals(attempt)
        self.cands[attempt.version] = [attempt] + [
            c
            for c in rivals
            if c.state == attempt.state
            or (self._may_land_after(c, attempt) and may_replace(c, attempt))
        ]
        self._supersede(rivals, [attempt])
        self._propagate()

    def _may_land_after(self, rival: Attempt, attempt: Attempt) -> bool:
        """Whether ``rival`` may land after ``attempt``'s commit took effect: it is running,
        or its outcome is unknown (its writer died) and it ran while ``attempt``'s commit
        did. (A commit takes effect at its manifest write, or, when it adopts identical
        content, at the read of the newest manifest: a rival may land after either.)"""
        if rival.status == "inflight":
            return True
        return rival.status == "unknown" and (
            rival.id > attempt.id or rival.id in self._overlapping[attempt.id]
        )

    def _supersede(self, before: list[Attempt], holders: list[Attempt]) -> None:
        """Of the candidates ``before`` of a version now held by one of ``holders``, note
        those that left unsettled although a holder may have replaced them (see
        :attr:`superseded`)."""
        kept = self.cands.get(holders[0].version, [])
        for c in before:
            if c not in kept and c.status in _UNSETTLED and any(may_replace(h, c) for h in holders):
                self.superseded.add(c.id)

    def _may_have_held(self, attempt: Attempt) -> bool:
        """Whether ``attempt`` may have been its version at some moment (a candidate or not
        now): known to have been, or replaced by one that holds it (:attr:`superseded`)."""
        return attempt.landed or attempt.id in self.superseded

    def check_owner_conflict(self, attempt: Attempt) -> None:
        """``attempt``'s commit raised OwnerConflictError (before :meth:`end`): what it would
        replace or build on is another owner's. That entry was a candidate of its version or
        of the one below when the commit read it, and a candidate leaves only for another
        that may hold the version, of the same owner (a newer attempt of it, or a twin).

        Raises:
            InvariantViolation: no candidate of either version has another owner.
        """
        v = attempt.version
        others = [
            c
            for c in self._rivals(attempt) + self.cands.get(v - 1, [])
            if not owners_agree(attempt.owner, c.owner)
        ]
        if not others:
            raise InvariantViolation(
                f"version {v}: {attempt.describe()} was refused for another owner's sake, "
                f"but no commit of version {v} or {v - 1} that may hold it has an owner other "
                f"than {attempt.owner!r}: {self.contents(v)}, {self.contents(v - 1)}"
            )

    def _parent_owners(self, attempt: Attempt) -> set[str]:
        """The owners of what ``attempt`` may have built on: the candidates of its parent
        version with the content it loaded (version 0's is the genesis, of no owner).

        GC moves the base up to a snapshot of a version at most ``retain - 1`` below the
        newest, and the base's entry, with its owner, is then no longer in the manifest: a
        commit built on it cannot tell whose it was. So where that may have happened, "no
        owner" is one of the possibilities.
        """
        below = attempt.version - 1
        owners = {c.owner for c in self.cands.get(below, []) if c.state == attempt.parent}
        if self.gc and below <= self.maybe_high - self.retain + 1:
            owners.add("")
        return owners

    def _rivals(self, attempt: Attempt) -> list[Attempt]:
        return [c for c in self.cands.get(attempt.version, []) if c is not attempt]

    def _allowed(self, attempt: Attempt) -> frozenset[str]:
        v = attempt.version
        below = self.cands.get(v - 1, [])
        parents = {c.state for c in below}
        parent = "no" if attempt.parent not in parents else "yes" if len(parents) == 1 else "maybe"
        if parent == "yes" and sum(c.landed or c.status in _UNSETTLED for c in below) > 1:
            # Replaced, or maybe replaced (a commit that failed may have landed), by identical
            # content: the protocol tells attempts apart, not content, and refuses a store
            # built on the replaced one (it reopens and reads the other).
            parent = "maybe"
        if self.known_high > v:
            successor = "landed"
        else:
            successor = "maybe" if self.cands.get(v + 1) else "none"
        others = [a for a in self.attempts if a is not attempt]
        return frozenset(
            allowed_commit_outcomes(
                attempt,
                self._rivals(attempt),
                parent=parent,  # type: ignore[arg-type]
                parent_owners=self._parent_owners(attempt),
                successor=successor,  # type: ignore[arg-type]
                fence_certain=max(a.order for a in others if a.status == "acked"),
                fence_possible=max(a.order for a in others if a.status != "refused"),
            )
        )

    # -- observations ---------------------------------------------------------------------

    def candidates(self) -> dict[int, list[Attempt]]:
        """The attempts that may hold each version now (a copy): what a read that starts
        now may return (see :meth:`observe`)."""
        return {v: list(cands) for v, cands in self.cands.items()}

    def in_flight(self) -> frozenset[int]:
        """The ids of the attempts whose commits are running: at a read's start, those that
        may land during the read (see :meth:`observe`)."""
        return frozenset(a.id for a in self.attempts if a.status == "inflight")

    def attempts_so_far(self) -> int:
        """How many attempts exist: at a read's start, those after it began during the read
        (see :meth:`observe`)."""
        return len(self.attempts)

    def observe(
        self,
        version: int,
        state: State,
        who: str,
        at_start: dict[int, list[Attempt]] | None = None,
        begun: int | None = None,
        running: frozenset[int] = frozenset(),
    ) -> None:
        """A store opened at ``version`` holds ``state``; ``at_start`` are the candidates
        when the open began (:meth:`candidates`), ``begun`` the number of attempts then
        (:meth:`attempts_so_far`), ``running`` those whose commits were running then
        (:meth:`in_flight`).

        A newer attempt may replace a version while a read of it runs (§5.4): the read then
        returns the content that was the version at some moment of the read, which says
        nothing about the version now: the content of its start, or of an attempt that was
        in flight then or began during the read and may have held the version since (a
        reader that finds no version 1 when it starts, then the first attempt's manifest,
        whose re-run replaces it before the read ends; or an attempt whose commit crashed
        after its manifest landed, replaced by its query's restarted run). Any other content
        that is no candidate now is a violation. The other way round, what the read returned
        rules out only what had landed when it began: an attempt whose commit was running
        then, or began during the read, may have landed after the read chose its manifest,
        even if its writer has died since (its outcome unknown).

        Raises:
            InvariantViolation: no attempt that may hold ``version`` has that content (§5.2).
        """
        cands = self.cands.get(version, [])
        matching = [c for c in cands if c.state == state]
        started = at_start.get(version, []) if at_start is not None else []
        during = self.attempts[begun:] if begun is not None else []
        replaced = [
            c
            for c in (*started, *during)
            if c.version == version
            and c.state == state
            and c not in cands
            and self._may_have_held(c)
        ]
        if replaced:
            # The content of an attempt that held the version at some moment of the read (a
            # candidate at its start, or one that began during it) and has been replaced
            # since: the read may have seen it then, so it says nothing about the version
            # now, even if an attempt that may hold it now has the same content (a twin).
            return
        if not matching:
            raise InvariantViolation(
                f"{who} opened version {version} and read {render(state)}, which no commit of "
                f"that version wrote (a mix, a newer or a lost version); the commits that may "
                f"hold it: {self.contents(version) or 'none'}"
            )
        for c in matching:
            c.landed = True
        self.known_high = max(self.known_high, version)
        late = {a.id for a in self.attempts[begun:]} if begun is not None else set()
        rest = [
            c
            for c in cands
            if c not in matching
            and (
                c.status == "inflight"
                or (c.status == "unknown" and (c.id in running or c.id in late))
            )
            and any(may_replace(c, m) for m in matching)
        ]
        previous = list(cands)  # _drop removes from cands
        for c in cands:
            if c not in matching and c not in rest:
                self._drop(c, f"{who} read other content for version {version}")
        self.cands[version] = matching + rest
        self._supersede(previous, matching)
        self._propagate()

    def check_latest(self, version: int, known_high_before: int, who: str) -> None:
        """``open`` at the latest version returned ``version``."""
        if not known_high_before <= version <= self.maybe_high:
            raise InvariantViolation(
                f"{who} opened the latest version and got {version}; versions up to "
                f"{known_high_before} were committed before it opened and at most "
                f"{self.maybe_high} may exist"
            )

    def open_failure_allowed(self, version: int | None, known_high_before: int) -> bool:
        """Whether ``open`` may fail with StateNotFoundError/CorruptStateError: only for a
        version that may have fallen out of the retention while it was being opened."""
        if version == 0 and not self.keep_empty and self.maybe_high >= 1:
            return True
        if not self.gc:
            return False
        floor = self.maybe_high - self.retain + 1
        return (known_high_before if version is None else version) < floor

    def check_versions(self, listed: Iterable[int], who: str) -> None:
        """``backend.versions()`` keeps every required version and invents none (§5.4-5)."""
        listed = set(listed)
        missing = sorted(set(self.required_versions()) - listed)
        if missing:
            raise InvariantViolation(
                f"{who}: versions {missing} are no longer restorable, but every version from "
                f"{self.retained_floor()} to {self.known_high} was committed and must be kept "
                f"(retain_versions={self.retain}); restorable: {sorted(listed)}"
            )
        if listed and max(listed) > self.maybe_high:
            raise InvariantViolation(
                f"{who}: version {max(listed)} is listed, but no commit of it was attempted "
                f"(highest attempted: {self.maybe_high})"
            )

    # -- lineage --------------------------------------------------------------------------

    def _drop(self, attempt: Attempt, why: str) -> None:
        attempt.dropped = attempt.dropped or why
        cands = self.cands.get(attempt.version, [])
        if attempt in cands:
            cands.remove(attempt)

    def _propagate(self) -> None:
        """Apply lineage until nothing changes: a version is built on one content of its
        parent, and a version that exists fixes its parent (§5.4: it is final)."""
        changed = True
        while changed:
            changed = False
            top = max(self.cands)
            for v in range(1, top + 1):
                parents = {c.state for c in self.cands.get(v - 1, [])}
                for c in list(self.cands.get(v, [])):
                    if c.status != "inflight" and c.parent not in parents:
                        if c.landed:
                            raise InvariantViolation(
                                f"version {v} holds {c.describe()}, built on "
                                f"{render(c.parent)}, but version {v - 1} cannot hold that "
                                f"any more: {self.contents(v - 1)}"
                            )
                        self._drop(c, f"version {v - 1} cannot hold what it was built on")
                        changed = True
            for v in range(min(self.known_high, top), 0, -1):
                parents = {c.parent for c in self.cands.get(v, [])}
                keep = [c for c in self.cands.get(v - 1, []) if c.state in parents]
                if not keep:
                    raise InvariantViolation(
                        f"version {v} exists, with candidates {self.contents(v)}, but none "
                        f"was built on what version {v - 1} may hold: {self.contents(v - 1)}"
                    )
                for c in self.cands[v - 1]:
                    if c not in keep:
                        self._drop(c, f"version {v} was built on other content")
                        changed = True
