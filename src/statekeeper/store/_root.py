"""Root metadata: ``_statekeeper.json`` records the format version and the operators.

The document is created create-only and updated only by compare-and-swap on its etag, so two
processes registering operators at the same time cannot lose each other's entries, and two
callers disagreeing on an operator's partition count are told so.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from statekeeper import layout
from statekeeper.errors import (
    CommitConflictError,
    ConfigMismatchError,
    CorruptStateError,
    StateNotFoundError,
)
from statekeeper.storage import BlobStore

__all__ = ["FORMAT_VERSION", "RootMetadata", "RootRegistry"]

FORMAT_VERSION = 1
_FORMAT_NAME = "statekeeper"
_CAS_ATTEMPTS = 20


@dataclass(frozen=True)
class RootMetadata:
    """The decoded ``_statekeeper.json``."""

    format_version: int
    root_id: str
    created_time_ms: int
    operators: dict[str, int | None] = field(default_factory=dict)
    """Operator name -> partition count (``None`` until a caller states it)."""

    def to_json(self) -> bytes:
        """Serialize to the on-storage document."""
        doc = {
            "format": _FORMAT_NAME,
            "formatVersion": self.format_version,
            "rootId": self.root_id,
            "createdTimeMs": self.created_time_ms,
            "operators": {
                name: {"partitions": parts} for name, parts in sorted(self.operators.items())
            },
        }
        return json.dumps(doc, indent=2, sort_keys=True).encode("utf-8") + b"\n"

    @classmethod
    def from_json(cls, data: bytes, *, blob: str) -> RootMetadata:
        """Parse and validate the on-storage document.

        Raises:
            CorruptStateError: not a statekeeper root document.
            ConfigMismatchError: written by a newer format version than this library reads.
        """
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict) or doc.get("format") != _FORMAT_NAME:
                raise ValueError("not a statekeeper root document")
            version = doc["formatVersion"]
            if not isinstance(version, int):
                raise ValueError(f"formatVersion is {version!r}")
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptStateError(
                f"root metadata {blob} is not valid: expected a statekeeper JSON document "
                f"with formatVersion, found {exc}"
            ) from exc
        if version > FORMAT_VERSION:
            raise ConfigMismatchError(
                f"root metadata {blob} was written by statekeeper format version {version}; "
                f"this statekeeper reads format versions <= {FORMAT_VERSION}: upgrade statekeeper"
            )
        try:
            operators = {
                str(name): _partitions(entry["partitions"])
                for name, entry in doc["operators"].items()
            }
            return cls(version, str(doc["rootId"]), int(doc["createdTimeMs"]), operators)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptStateError(
                f"root metadata {blob} is not valid: expected rootId, createdTimeMs and "
                f"operators with partition counts, found an error at {exc!r}"
            ) from exc


def _partitions(value: Any) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    raise ValueError(f"partitions is {value!r}")


class RootRegistry:
    """Reads, creates and updates the root metadata of one checkpoint root. Thread-safe."""

    def __init__(self, blobs: BlobStore) -> None:
        self._blobs = blobs
        self._lock = threading.Lock()
        self._cached: RootMetadata | None = None

    def read(self) -> RootMetadata | None:
        """The current root metadata, or ``None`` if the root holds none yet.

        Raises:
            CorruptStateError, ConfigMismatchError: as :meth:`RootMetadata.from_json`.
            StorageError: the root cannot be read.
        """
        try:
            data = self._blobs.get(layout.ROOT_METADATA)
        except StateNotFoundError:
            return None
        meta = RootMetadata.from_json(data, blob=self._describe())
        self._cached = meta
        return meta

    def register(self, operator: str, partitions: int | None) -> RootMetadata:
        """Make sure ``operator`` is recorded, with ``partitions`` if given.

        Returns:
            The root metadata after registration.

        Raises:
            ConfigMismatchError: the root records a different partition count.
            StorageError: the root cannot be read or written.
        """
        with self._lock:
            cached = self._cached
            if cached is not None and _satisfied(cached, operator, partitions):
                return cached
            for _ in range(_CAS_ATTEMPTS):
                meta = self._try_register(operator, partitions)
                if meta is not None:
                    self._cached = meta
                    return meta
                time.sleep(0.01)
            raise CommitConflictError(
                f"could not update {self._describe()}: it kept changing under "
                f"{_CAS_ATTEMPTS} attempts"
            )

    def _try_register(self, operator: str, partitions: int | None) -> RootMetadata | None:
        try:
            etag: str | None = self._blobs.head(layout.ROOT_METADATA).etag
            current = RootMetadata.from_json(
                self._blobs.get(layout.ROOT_METADATA), blob=self._describe()
            )
        except StateNotFoundError:
            etag, current = None, None
        if current is not None and _satisfied(current, operator, partitions):
            return current
        if current is None:
            current = RootMetadata(FORMAT_VERSION, uuid.uuid4().hex, int(time.time() * 1000))
        operators = dict(current.operators)
        operators[operator] = partitions if partitions is not None else operators.get(operator)
        updated = RootMetadata(
            current.format_version, current.root_id, current.created_time_ms, operators
        )
        try:
            if etag is None:
                self._blobs.put(layout.ROOT_METADATA, updated.to_json())
            else:
                self._blobs.put(layout.ROOT_METADATA, updated.to_json(), if_match=etag)
        except (CommitConflictError, StateNotFoundError):
            return None  # somebody else changed it: read again and retry
        return updated

    def _describe(self) -> str:
        return f"{self._blobs.uri.rstrip('/')}/{layout.ROOT_METADATA}"


def _satisfied(meta: RootMetadata, operator: str, partitions: int | None) -> bool:
    """True if ``meta`` already records what is asked; raises if it contradicts it."""
    if operator not in meta.operators:
        return False
    recorded = meta.operators[operator]
    if partitions is None or recorded == partitions:
        return True
    if recorded is None:
        return False
    raise ConfigMismatchError(
        f"operator {operator!r} has {recorded} partitions in this checkpoint root, "
        f"but {partitions} were asked for; the partition count of an operator is fixed "
        "(use a new operator name or a new root to change it)"
    )
