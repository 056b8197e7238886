"""The one error hierarchy of statekeeper.

Every error raised on purpose by the library is a :class:`StateKeeperError`. Backend errors
(filesystem, object store, RocksDB) are translated into these in exactly one place per
backend, with ``raise ... from exc`` so the original stays attached.
"""

from __future__ import annotations

__all__ = [
    "CommitConflictError",
    "ConfigMismatchError",
    "CorruptStateError",
    "OwnerConflictError",
    "StateKeeperError",
    "StateNotFoundError",
    "StorageError",
    "TransientStorageError",
]


class StateKeeperError(Exception):
    """Root of every error statekeeper raises on purpose."""


class CorruptStateError(StateKeeperError):
    """Stored bytes fail a checksum, a length or a format check; the message names the blob."""


class StateNotFoundError(StateKeeperError, FileNotFoundError):
    """A version, store or blob that was asked for does not exist."""


class CommitConflictError(StateKeeperError):
    """A create-only write found the target already there: another writer committed first."""


class OwnerConflictError(CommitConflictError):
    """The version a commit would replace or build on belongs to another owner (in the
    Spark layer, another streaming query: one started with a fresh checkpointLocation on an
    operator that holds another query's state)."""


class ConfigMismatchError(StateKeeperError):
    """The configuration or call disagrees with what the checkpoint root records."""


class StorageError(StateKeeperError):
    """The blob store refused or failed an operation (permissions, bad URI, I/O error)."""


class TransientStorageError(StorageError):
    """A failure worth retrying (timeout, throttling, 5xx); raised once retries are exhausted."""
