"""The demo's stateful processor: clickstream sessions per user, with statekeeper state.

Spark's Python workers unpickle :class:`Sessionizer` by reference, so it lives in the
installed package rather than in a script.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pandas as pd  # type: ignore[import-untyped]

from statekeeper.spark import StatefulProcessor, StatefulProcessorHandle

__all__ = ["OUTPUT_SCHEMA", "SUMMARY", "Sessionizer"]

OUTPUT_SCHEMA = "user string, session long, start_ts long, end_ts long, events long"
SUMMARY = "summary"
PAGES = "pages"


class Sessionizer(StatefulProcessor):
    """Per user: sessions so far, clicks, the open session, and clicks per page.

    A session ends when a click comes more than ``gap_s`` event-time seconds after the
    previous one; the processor then outputs the ended session as a row of
    :data:`OUTPUT_SCHEMA`. The open session stays in the ``summary`` value state
    (``sessions``, ``events``, ``start``, ``last_seen``, ``open_events``); the ``pages`` map
    state counts clicks per page. Clicks of a user must arrive in event-time order across
    micro-batches (the demo's generator guarantees it); within one they may come in any
    order.
    """

    def __init__(self, gap_s: int) -> None:
        """Sessions end after ``gap_s`` seconds without a click."""
        self.gap_s = gap_s

    def init(self, handle: StatefulProcessorHandle) -> None:
        """Declare the ``summary`` value state and the ``pages`` map state."""
        self.summary = handle.value_state(SUMMARY)
        self.pages = handle.map_state(PAGES)

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        """Advance the user's sessions over this batch's clicks; yield the ended ones."""
        ordered = rows.sort_values(["ts", "event_id"], kind="stable")
        state: dict[str, int] | None = self.summary.get()
        ended: list[tuple[int, int, int, int]] = []
        for ts in ordered["ts"].tolist():
            if state is None:
                state = {"sessions": 1, "events": 0, "start": ts, "last_seen": ts}
                state["open_events"] = 0
            elif ts - state["last_seen"] > self.gap_s:
                ended.append(
                    (state["sessions"], state["start"], state["last_seen"], state["open_events"])
                )
                state.update(sessions=state["sessions"] + 1, start=ts, open_events=0)
            state.update(
                events=state["events"] + 1, last_seen=ts, open_events=state["open_events"] + 1
            )
        if state is not None:
            self.summary.update(state)
        for page, n in ordered["page"].value_counts().items():
            self.pages.put(str(page), int(self.pages.get(str(page), 0)) + int(n))
        if ended:
            columns = list(zip(*ended, strict=True))
            yield pd.DataFrame(
                {
                    "user": [key[0]] * len(ended),
                    "session": pd.array(columns[0], dtype="int64"),
                    "start_ts": pd.array(columns[1], dtype="int64"),
                    "end_ts": pd.array(columns[2], dtype="int64"),
                    "events": pd.array(columns[3], dtype="int64"),
                }
            )
