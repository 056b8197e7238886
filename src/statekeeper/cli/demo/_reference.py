"""The batch recomputation: the same sessions computed with pandas over all events, and the
comparison of the streaming results with it.

The streaming processor merges each user's clicks one by one and closes sessions with
event-time timers; this module gets the same answer another way (the watermarks from the
batches' event times, late clicks dropped with a mask, sessions by a vectorized gap test and
a cumulative sum), so that a bug in one is not repeated in the other. The rules are those of
``statekeeper.keyed.runner`` (after Spark's ``transformWithState``):

* the watermark of micro-batch ``b`` is ``max(0, E - delay)`` in ms, ``E`` the largest event
  time of batches ``0 .. b-1`` (0 in batch 0);
* a click of batch ``b`` is late, and dropped, if its event time is at or before the
  watermark of batch ``b - 1`` (nothing is late in batch 0);
* timers fire after the batch's input when their expiry is at or before its watermark: a
  session is closed (in the sink) once the watermark of some batch reaches its last click +
  gap. No accepted click can join it afterwards (it would be late), so after the last
  batch a session is closed exactly when ``(last click + gap) * 1000`` is at or before the
  last batch's watermark; every other session is open (in the state).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from statekeeper.cli.demo._clicks import Click
from statekeeper.keyed import TIMER_STATE

__all__ = [
    "Expected",
    "Found",
    "Outcome",
    "SessionRow",
    "compare",
    "expected_sessions",
    "shown",
    "state_of",
    "watermarks_ms",
]

SessionRow = tuple[str, int, int, int, int]
"""A closed session: user, session number (from 1), first click, last click, clicks."""
Summary = dict[str, int]
_MAX_SHOWN = 8


@dataclass(frozen=True)
class Expected:
    """What the stream must produce."""

    closed: list[SessionRow]
    """Sessions the watermark has passed (the sink's rows)."""
    summary: dict[str, Summary]
    """User -> the ``summary`` value state (sessions closed, clicks accepted)."""
    open: dict[str, list[list[int]]]
    """User -> the ``open`` value state: ``[first, last, clicks]`` per open session."""
    pages: dict[str, dict[str, int]]
    """User -> page -> clicks (the ``pages`` map state)."""
    late: int = 0
    """Clicks dropped as late."""
    watermark_ms: int = 0
    """The watermark of the last micro-batch."""
    gap_s: int = 0

    @property
    def timers(self) -> dict[str, list[int]]:
        """User -> the timers (ms) the open sessions must have: last click + gap."""
        return {
            user: [(s[1] + self.gap_s) * 1000 for s in sessions]
            for user, sessions in self.open.items()
        }

    @property
    def sessions(self) -> int:
        """All sessions, the open ones included."""
        return len(self.closed) + sum(len(s) for s in self.open.values())


@dataclass
class Outcome:
    """The result of the equality check."""

    differences: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True if nothing differs."""
        return not self.differences


def watermarks_ms(batches: Sequence[Sequence[Click]], delay_s: int) -> list[int]:
    """The watermark of every micro-batch (ms), one input file per batch."""
    out: list[int] = []
    top: int | None = None
    for clicks in batches:
        out.append(0 if top is None else max(0, top * 1000 - delay_s * 1000))
        if clicks:
            highest = max(c.ts for c in clicks)
            top = highest if top is None else max(top, highest)
    return out


def expected_sessions(batches: Sequence[Sequence[Click]], gap_s: int, delay_s: int) -> Expected:
    """Sessionize every accepted click at once (see the module docstring for the rules)."""
    import pandas as pd  # type: ignore[import-untyped]

    marks = watermarks_ms(batches, delay_s)
    frames = [
        pd.DataFrame(list(clicks), columns=list(Click._fields)).assign(
            late_ms=marks[b - 1] if b else 0
        )
        for b, clicks in enumerate(batches)
    ]
    every = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if every.empty:
        return Expected([], {}, {}, {}, gap_s=gap_s)
    df = every[every["ts"] * 1000 > every["late_ms"]]
    df = df.sort_values(["user", "ts"], kind="stable").reset_index(drop=True)
    gaps = df.groupby("user")["ts"].diff()
    df["session"] = (gaps.isna() | (gaps > gap_s)).astype("int64").groupby(df["user"]).cumsum()
    per = (
        df.groupby(["user", "session"])["ts"]
        .agg(["min", "max", "size"])
        .reset_index()
        .astype({"session": "int64", "min": "int64", "max": "int64", "size": "int64"})
    )
    final = marks[-1]
    per["closed"] = (per["max"] + gap_s) * 1000 <= final
    closed = [
        (str(r.user), int(r.session), int(r.min), int(r.max), int(r.size))
        for r in per[per["closed"]].itertuples(index=False)
    ]
    events = df.groupby("user").size()
    ended = per.groupby("user")["closed"].sum()
    summary = {str(u): {"sessions": int(ended[u]), "events": int(events[u])} for u in events.index}
    still: dict[str, list[list[int]]] = {}
    for r in per[~per["closed"]].itertuples(index=False):
        still.setdefault(str(r.user), []).append([int(r.min), int(r.max), int(r.size)])
    pages: dict[str, dict[str, int]] = {}
    for (user, page), n in df.groupby(["user", "page"]).size().items():
        pages.setdefault(str(user), {})[str(page)] = int(n)
    return Expected(
        closed, summary, still, pages, late=len(every) - len(df), watermark_ms=final, gap_s=gap_s
    )


@dataclass
class Found:
    """The stream's state as :func:`statekeeper.spark.read_state` reads it back."""

    summary: dict[str, Summary] = field(default_factory=dict)
    open: dict[str, list[list[int]]] = field(default_factory=dict)
    pages: dict[str, dict[str, int]] = field(default_factory=dict)
    timers: dict[str, list[int]] = field(default_factory=dict)
    """User -> the registered timers (ms), ascending."""


def state_of(rows: Iterable[Mapping[str, Any]]) -> Found:
    """``summary``, ``open``, ``pages`` and timers per user from the rows of
    :func:`read_state` (a timer is a row of state ``$timer``, its expiry in ``entry``)."""
    found = Found()
    for row in rows:
        if row["state"] == TIMER_STATE:
            found.timers.setdefault(row["user"], []).append(int(row["entry"]))
            continue
        value = json.loads(row["value"])
        if row["state"] == "summary":
            found.summary[row["user"]] = value
        elif row["state"] == "open":
            found.open[row["user"]] = value
        elif row["state"] == "pages":
            found.pages.setdefault(row["user"], {})[json.loads(row["entry"])] = value
    for expiries in found.timers.values():
        expiries.sort()
    return found


def compare(expected: Expected, sink: Sequence[SessionRow], state: Found) -> Outcome:
    """Every difference between the stream's sink and state and the batch recomputation."""
    outcome = Outcome()
    want, got = Counter(expected.closed), Counter(sink)
    for row, n in sorted((want - got).items()):
        outcome.differences.append(f"sink lacks {n}x session {row}")
    for row, n in sorted((got - want).items()):
        outcome.differences.append(f"sink has {n} unexpected copies of session {row}")
    _compare_maps("summary", expected.summary, state.summary, outcome)
    _compare_maps("open", expected.open, state.open, outcome)
    _compare_maps("pages", expected.pages, state.pages, outcome)
    _compare_maps("timers", expected.timers, state.timers, outcome)
    return outcome


def _compare_maps(
    what: str, want: Mapping[str, Any], got: Mapping[str, Any], outcome: Outcome
) -> None:
    for user in sorted(want.keys() | got.keys()):
        if user not in got:
            outcome.differences.append(f"state {what!r} lacks user {user}: {want[user]}")
        elif user not in want:
            outcome.differences.append(f"state {what!r} has unexpected user {user}: {got[user]}")
        elif want[user] != got[user]:
            outcome.differences.append(
                f"state {what!r} of {user}: expected {want[user]}, found {got[user]}"
            )


def shown(differences: Sequence[str]) -> list[str]:
    """The first differences, and how many more there are."""
    head = list(differences[:_MAX_SHOWN])
    if len(differences) > _MAX_SHOWN:
        head.append(f"... and {len(differences) - _MAX_SHOWN} more")
    return head
