"""The demo's stateful processor: event-time clickstream sessions per user, closed by timers.

Spark's Python workers unpickle :class:`Sessionizer` by reference, so it lives in the
installed package rather than in a script.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pandas as pd  # type: ignore[import-untyped]

from statekeeper.keyed import ExpiredTimerInfo, TimerValues
from statekeeper.spark import StatefulProcessor, StatefulProcessorHandle

__all__ = ["OPEN", "OUTPUT_SCHEMA", "SUMMARY", "Sessionizer", "merge_click"]

OUTPUT_SCHEMA = "user string, session long, start_ts long, end_ts long, events long"
SUMMARY = "summary"
OPEN = "open"
PAGES = "pages"
Session = list[int]
"""An open session: ``[first click, last click, clicks]`` (event-time seconds)."""


def merge_click(sessions: list[Session], ts: int, gap_s: int) -> list[Session]:
    """``sessions`` (disjoint, ascending) with the click at ``ts`` added: it joins every
    session it comes within ``gap_s`` of (bridging two merges them), or starts its own."""
    touching = [s for s in sessions if s[0] - gap_s <= ts <= s[1] + gap_s]
    rest = [s for s in sessions if s not in touching]
    merged = [
        min([ts, *(s[0] for s in touching)]),
        max([ts, *(s[1] for s in touching)]),
        1 + sum(s[2] for s in touching),
    ]
    return sorted([*rest, merged])


class Sessionizer(StatefulProcessor):
    """Per user: closed sessions and clicks so far, the open sessions, clicks per page.

    Event time (``time_mode="event_time"`` on the ``event_time`` column, the click's ``ts``):
    a session is a run of clicks with at most ``gap_s`` seconds between neighbours. Clicks
    may arrive out of order (rows at or before the watermark are dropped before they get
    here), so a user may have several open sessions, and a click may extend or merge them.
    Each open session has an event-time timer at its last click + ``gap_s``; when the
    watermark passes it, the session is final (no click still accepted can join it) and is
    output as a row of :data:`OUTPUT_SCHEMA`, numbered in order per user.

    State: ``summary`` (``sessions`` closed, ``events`` accepted), ``open`` (the open
    sessions, see :data:`Session`; cleared when none is left) and the ``pages`` map (clicks
    per page).
    """

    def __init__(self, gap_s: int) -> None:
        """Sessions end after ``gap_s`` seconds without a click."""
        self.gap_s = gap_s

    def init(self, handle: StatefulProcessorHandle) -> None:
        """Declare the states."""
        self.handle = handle
        self.summary = handle.value_state(SUMMARY)
        self.open = handle.value_state(OPEN)
        self.pages = handle.map_state(PAGES)

    def _expiry_ms(self, session: Session) -> int:
        return (session[1] + self.gap_s) * 1000

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        """Add this batch's clicks to the user's open sessions and move their timers."""
        before: list[Session] = self.open.get() or []
        sessions = before
        for ts in sorted(rows["ts"].tolist()):
            sessions = merge_click(sessions, int(ts), self.gap_s)
        old = {self._expiry_ms(s) for s in before}
        new = {self._expiry_ms(s) for s in sessions}
        for expiry in sorted(old - new):
            self.handle.delete_timer(expiry)
        for expiry in sorted(new - old):
            self.handle.register_timer(expiry)
        self.open.update(sessions)
        summary: dict[str, int] = self.summary.get() or {"sessions": 0, "events": 0}
        summary["events"] += len(rows)
        self.summary.update(summary)
        for page, n in rows["page"].value_counts().items():
            self.pages.put(str(page), int(self.pages.get(str(page), 0)) + int(n))
        return iter(())

    def handle_expired_timer(
        self, key: tuple[Any, ...], timer_values: TimerValues, expired_timer_info: ExpiredTimerInfo
    ) -> Iterator[Any]:
        """Close and output the session whose timer fired."""
        expiry = expired_timer_info.get_expiry_time_in_ms()
        sessions: list[Session] = self.open.get() or []
        ended = [s for s in sessions if self._expiry_ms(s) == expiry]
        if not ended:  # every session's timer moves with it: nothing to close
            return
        left = [s for s in sessions if s not in ended]
        if left:
            self.open.update(left)
        else:
            self.open.clear()
        summary: dict[str, int] = self.summary.get()
        summary["sessions"] += 1
        self.summary.update(summary)
        start, end, events = ended[0]
        yield pd.DataFrame(
            {
                "user": [key[0]],
                "session": pd.array([summary["sessions"]], dtype="int64"),
                "start_ts": pd.array([start], dtype="int64"),
                "end_ts": pd.array([end], dtype="int64"),
                "events": pd.array([events], dtype="int64"),
            }
        )
