"""statekeeper: durable, incremental state for Python stateful stream processing on Spark.

Start with :class:`StateBackend`::

    import statekeeper as sk

    backend = sk.StateBackend("/tmp/app-state")
    with backend.open("sessions", partition=0) as store:
        store.put(b"user-1", b"3")
        store.commit()
"""

from __future__ import annotations

from statekeeper.config import StoreConfig
from statekeeper.errors import (
    CommitConflictError,
    ConfigMismatchError,
    CorruptStateError,
    OwnerConflictError,
    StateKeeperError,
    StateNotFoundError,
    StorageError,
    TransientStorageError,
)
from statekeeper.gc import GcReport, StoreGc
from statekeeper.store import (
    CommitInfo,
    ExportInfo,
    RestoreInfo,
    Retention,
    RootMetadata,
    StateBackend,
    StateStore,
)
from statekeeper.verify import Problem, VerifyReport

__all__ = [
    "CommitConflictError",
    "CommitInfo",
    "ConfigMismatchError",
    "CorruptStateError",
    "ExportInfo",
    "GcReport",
    "OwnerConflictError",
    "Problem",
    "RestoreInfo",
    "Retention",
    "RootMetadata",
    "StateBackend",
    "StateKeeperError",
    "StateNotFoundError",
    "StateStore",
    "StorageError",
    "StoreConfig",
    "StoreGc",
    "TransientStorageError",
    "VerifyReport",
    "__version__",
]

__version__ = "0.2.0.dev0"
