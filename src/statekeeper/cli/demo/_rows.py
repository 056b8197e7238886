"""What the demo shows per micro-batch and per restore: plain records, JSON both ways.

The crash phase runs in a child process, which sends a :class:`BatchRow` per micro-batch to
the parent as one JSON line on stdout, prefixed with :data:`MARKER` (Spark may write its own
lines there too).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["MARKER", "BatchRow", "RestoreRow", "decode_message", "encode_message", "encode_row"]

MARKER = "@@statekeeper-demo "


@dataclass(frozen=True)
class BatchRow:
    """One micro-batch of the stateful operator, from the state listener's BatchMetrics."""

    phase: str
    batch_id: int
    version: int
    """The state version every partition committed (``batch_id + 1``)."""
    partitions: int
    partitions_committed: int
    rows_in: int
    late_rows: int
    """Input rows dropped as late (at or before the previous batch's watermark)."""
    sessions_closed: int
    """Sessions output: their timers fired in this batch."""
    open_sessions: int
    """Sessions open in the state at ``version``, counted by the monitor."""
    commit_p50_ms: float
    commit_max_ms: float
    bytes_uploaded: int
    snapshots: int
    """Background snapshots scheduled by this batch's commits."""
    stores_opened: int
    """Stores the workers opened (not kept open from the previous batch)."""
    stores_restored: int
    """Opened stores that downloaded from the root (snapshot files or changelogs)."""
    restore_bytes: int
    restore_s: float
    duration_ms: int | None
    """The micro-batch's wall time as Spark reports it (``None`` if unknown)."""


@dataclass(frozen=True)
class RestoreRow:
    """One way the state came back after the crash, summed over the partitions."""

    how: str
    stores: int
    restored: int
    bytes_downloaded: int
    seconds: float
    detail: str


def encode_message(event: str, **fields: Any) -> str:
    """One protocol line: the marker, then a JSON object with ``event`` and ``fields``."""
    return MARKER + json.dumps({"event": event, **fields})


def encode_row(row: BatchRow) -> str:
    """The protocol line of a batch row."""
    return encode_message("batch", row=dataclasses.asdict(row))


def decode_message(line: str) -> dict[str, Any] | None:
    """The message of a protocol line; ``None`` for any other line."""
    if not line.startswith(MARKER):
        return None
    message: dict[str, Any] = json.loads(line[len(MARKER) :])
    if message.get("event") == "batch":
        message["row"] = BatchRow(**message["row"])
    return message
