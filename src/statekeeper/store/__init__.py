"""Versioned state stores: the RocksDB working copy, commits and restore."""

from __future__ import annotations

from statekeeper.store._backend import StateBackend
from statekeeper.store._export import ExportInfo
from statekeeper.store._local_disk import set_aside_copies, set_aside_time
from statekeeper.store._overlay import check_progress, listed
from statekeeper.store._rescale import (
    ParentCopy,
    StoreRescale,
    finish_pending_rescale,
    latest_versions,
)
from statekeeper.store._rocks import checked_items
from statekeeper.store._root import DEFAULT_KEY_GROUPS, Rescale, Retention, RootMetadata
from statekeeper.store._state_store import CommitInfo, RestoreInfo, StateStore
from statekeeper.store._store_changes import StoreChange, StoreChanges
from statekeeper.store._working_copy import remove_unused_copy

__all__ = [
    "DEFAULT_KEY_GROUPS",
    "CommitInfo",
    "ExportInfo",
    "ParentCopy",
    "Rescale",
    "RestoreInfo",
    "Retention",
    "RootMetadata",
    "StateBackend",
    "StateStore",
    "StoreChange",
    "StoreChanges",
    "StoreRescale",
    "check_progress",
    "checked_items",
    "finish_pending_rescale",
    "latest_versions",
    "listed",
    "remove_unused_copy",
    "set_aside_copies",
    "set_aside_time",
]
