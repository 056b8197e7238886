"""The batch recomputation: the same sessions computed with pandas over all events, and the
comparison of the streaming results with it.

The streaming processor walks each user's clicks one by one; this module gets the same
answer another way (a vectorized gap test and a cumulative sum), so that a bug in one is not
repeated in the other.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from statekeeper.cli.demo._clicks import Click

__all__ = [
    "Expected",
    "Outcome",
    "SessionRow",
    "compare",
    "expected_sessions",
    "shown",
    "state_of",
]

SessionRow = tuple[str, int, int, int, int]
"""A closed session: user, session number (from 1), first click, last click, clicks."""
Summary = dict[str, int]
_MAX_SHOWN = 8


@dataclass(frozen=True)
class Expected:
    """What the stream must produce."""

    closed: list[SessionRow]
    """Sessions followed by a later session of the same user (the sink's rows)."""
    summary: dict[str, Summary]
    """User -> the processor's ``summary`` value state."""
    pages: dict[str, dict[str, int]]
    """User -> page -> clicks (the ``pages`` map state)."""

    @property
    def sessions(self) -> int:
        """All sessions, the open ones included."""
        return sum(s["sessions"] for s in self.summary.values())


@dataclass
class Outcome:
    """The result of the equality check."""

    differences: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True if nothing differs."""
        return not self.differences


def expected_sessions(clicks: Iterable[Click], gap_s: int) -> Expected:
    """Sessionize every click at once: a session ends after ``gap_s`` seconds of silence."""
    import pandas as pd  # type: ignore[import-untyped]

    df = pd.DataFrame(list(clicks), columns=list(Click._fields))
    df = df.sort_values(["user", "ts", "event_id"], kind="stable").reset_index(drop=True)
    gaps = df.groupby("user")["ts"].diff()
    df["session"] = (gaps.isna() | (gaps > gap_s)).astype("int64").groupby(df["user"]).cumsum()
    per = (
        df.groupby(["user", "session"])["ts"]
        .agg(["min", "max", "size"])
        .reset_index()
        .astype({"session": "int64", "min": "int64", "max": "int64", "size": "int64"})
    )
    last = per.groupby("user")["session"].transform("max")
    closed = [
        (str(r.user), int(r.session), int(r.min), int(r.max), int(r.size))
        for r in per[per["session"] < last].itertuples(index=False)
    ]
    events = df.groupby("user").size()
    summary = {
        str(r.user): {
            "sessions": int(r.session),
            "events": int(events[r.user]),
            "start": int(r.min),
            "last_seen": int(r.max),
            "open_events": int(r.size),
        }
        for r in per[per["session"] == last].itertuples(index=False)
    }
    pages: dict[str, dict[str, int]] = {}
    for (user, page), n in df.groupby(["user", "page"]).size().items():
        pages.setdefault(str(user), {})[str(page)] = int(n)
    return Expected(closed, summary, pages)


def state_of(rows: Iterable[Mapping[str, Any]]) -> tuple[dict[str, Summary], dict[str, Any]]:
    """``summary`` and ``pages`` per user from the rows of :func:`read_state`."""
    summary: dict[str, Summary] = {}
    pages: dict[str, dict[str, int]] = {}
    for row in rows:
        value = json.loads(row["value"])
        if row["state"] == "summary":
            summary[row["user"]] = value
        elif row["state"] == "pages":
            pages.setdefault(row["user"], {})[json.loads(row["entry"])] = value
    return summary, pages


def compare(
    expected: Expected,
    sink: Sequence[SessionRow],
    summary: Mapping[str, Summary],
    pages: Mapping[str, Mapping[str, int]],
) -> Outcome:
    """Every difference between the stream's sink and state and the batch recomputation."""
    outcome = Outcome()
    want, got = Counter(expected.closed), Counter(sink)
    for row, n in sorted((want - got).items()):
        outcome.differences.append(f"sink lacks {n}x session {row}")
    for row, n in sorted((got - want).items()):
        outcome.differences.append(f"sink has {n} unexpected copies of session {row}")
    _compare_maps("summary", expected.summary, summary, outcome)
    _compare_maps("pages", expected.pages, pages, outcome)
    return outcome


def _compare_maps(
    what: str, want: Mapping[str, Any], got: Mapping[str, Any], outcome: Outcome
) -> None:
    for user in sorted(want.keys() | got.keys()):
        if user not in got:
            outcome.differences.append(f"state {what!r} lacks user {user}: {want[user]}")
        elif user not in want:
            outcome.differences.append(f"state {what!r} has unexpected user {user}: {got[user]}")
        elif dict(want[user]) != dict(got[user]):
            outcome.differences.append(
                f"state {what!r} of {user}: expected {want[user]}, found {dict(got[user])}"
            )


def shown(differences: Sequence[str]) -> list[str]:
    """The first differences, and how many more there are."""
    head = list(differences[:_MAX_SHOWN])
    if len(differences) > _MAX_SHOWN:
        head.append(f"... and {len(differences) - _MAX_SHOWN} more")
    return head
