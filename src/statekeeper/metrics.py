"""Per-commit metrics history: the one durable source of commit latency.

Changelog blobs tell how many bytes and records each commit wrote, but not how long it took.
Commit latency is kept, best effort, in small **commit-metrics blobs**: a store buffers the
:class:`CommitMetrics` of its commits in memory and writes them as one blob, create-only, at
``<operator>/<partition>/metrics/<last version:020d>.json``, whenever it takes a snapshot and
when it closes. So a store pays one small PUT per snapshot interval, never one per commit;
a crash loses the buffered entries (only metrics, never state). Garbage collection may
delete a metrics blob once its last version is older than the oldest retained version.

Document (UTF-8 JSON, keys sorted)::

    {"format": "statekeeper-commit-metrics", "formatVersion": 1,
     "operator": "sessions", "partition": 3,
     "commits": [{"version": 12, "durationMs": 8.4, "bytes": 5120, "records": 100,
                  "committedTimeMs": 1700000000000}, ...]}

Readers reject a newer ``formatVersion`` with a clear error.

Keys come from ``layout.metrics_key`` / ``metrics_prefix`` / ``parse_metrics_key``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from statekeeper import layout
from statekeeper.errors import CorruptStateError
from statekeeper.storage import BlobStore

__all__ = [
    "FORMAT_VERSION",
    "CommitMetrics",
    "decode_commit_metrics",
    "encode_commit_metrics",
    "from_commit",
    "read_commit_metrics",
    "write_commit_metrics",
]

FORMAT_VERSION = 1
_FORMAT_NAME = "statekeeper-commit-metrics"


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitMetrics:
    """What one commit cost.

    Attributes:
        version: the version the commit created.
        duration_ms: wall time of ``StateStore.commit`` (upload included).
        bytes: bytes uploaded by the commit.
        records: puts and deletes in the commit.
        committed_time_ms: when it finished, milliseconds since the epoch.
    """

    version: int
    duration_ms: float
    bytes: int
    records: int
    committed_time_ms: int

    def to_json(self) -> dict[str, Any]:
        """The entry's JSON object."""
        return {
            "version": self.version,
            "durationMs": self.duration_ms,
            "bytes": self.bytes,
            "records": self.records,
            "committedTimeMs": self.committed_time_ms,
        }


def encode_commit_metrics(operator: str, partition: int, commits: Sequence[CommitMetrics]) -> bytes:
    """The blob holding ``commits`` (in version order).

    Raises:
        ValueError: ``commits`` is empty.
    """
    if not commits:
        raise ValueError("a commit-metrics blob holds at least one commit")
    doc = {
        "format": _FORMAT_NAME,
        "formatVersion": FORMAT_VERSION,
        "operator": layout.validate_operator(operator),
        "partition": layout.validate_partition(partition),
        "commits": [c.to_json() for c in sorted(commits, key=lambda c: c.version)],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")


def decode_commit_metrics(data: bytes, *, blob: str) -> list[CommitMetrics]:
    """Parse a commit-metrics blob.

    Raises:
        CorruptStateError: not a commit-metrics document, or written by a newer format
            version; the message names ``blob``.
    """
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT_NAME:
            raise ValueError(f"expected format {_FORMAT_NAME!r}")
        version = doc["formatVersion"]
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ValueError(
                f"written by a newer statekeeper: expected formatVersion <= {FORMAT_VERSION}, "
                f"found {version!r}"
            )
        return [_entry(c) for c in doc["commits"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptStateError(f"commit-metrics blob {blob!r} is not valid: {exc}") from exc


def _entry(obj: Any) -> CommitMetrics:
    metrics = CommitMetrics(
        version=int(obj["version"]),
        duration_ms=float(obj["durationMs"]),
        bytes=int(obj["bytes"]),
        records=int(obj["records"]),
        committed_time_ms=int(obj["committedTimeMs"]),
    )
    if metrics.version < 1 or metrics.duration_ms < 0 or metrics.bytes < 0:
        raise ValueError(f"entry out of range: {obj!r}")
    return metrics


def write_commit_metrics(
    blobs: BlobStore, operator: str, partition: int, commits: Sequence[CommitMetrics]
) -> str:
    """Write ``commits`` as one blob, create-only; returns its key.

    Raises:
        ValueError: ``commits`` is empty.
        CommitConflictError: a blob with that last version exists (a re-run): nothing lost.
        StorageError: the upload failed.
    """
    data = encode_commit_metrics(operator, partition, commits)
    key = layout.metrics_key(operator, partition, max(c.version for c in commits))
    blobs.put(key, data)
    return key


def read_commit_metrics(
    blobs: BlobStore, operator: str, partition: int, *, since: int = 0
) -> dict[int, CommitMetrics]:
    """Every recorded commit of a store with version >= ``since``, by version.

    When two blobs record one version (a re-run), the newer blob's entry wins.

    Raises:
        CorruptStateError: a metrics blob is not valid.
        StorageError: listing or reading failed.
    """
    keys = sorted(
        (v, m.key)
        for m in blobs.list(layout.metrics_prefix(operator, partition))
        if (v := layout.parse_metrics_key(m.key)) is not None and v >= since
    )
    out: dict[int, CommitMetrics] = {}
    datas = blobs.get_many([k for _, k in keys])
    for (_, key), data in zip(keys, datas, strict=True):
        out.update(
            (c.version, c) for c in decode_commit_metrics(data, blob=key) if c.version >= since
        )
    return out


def from_commit(
    version: int, duration_s: float, bytes_uploaded: int, records: int
) -> CommitMetrics:
    """A :class:`CommitMetrics` for a commit that just finished (stamped now)."""
    return CommitMetrics(
        version=version,
        duration_ms=duration_s * 1000.0,
        bytes=bytes_uploaded,
        records=records,
        committed_time_ms=int(time.time() * 1000),
    )
