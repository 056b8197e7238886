"""Incremental snapshots of a store's RocksDB directory (ARCHITECTURE §4, seed 001).

A snapshot is an index blob (:class:`SnapshotIndex`) naming every file of a RocksDB
checkpoint and the chunk blobs holding its bytes. :func:`upload_snapshot` uploads only what
:func:`diff_dir` finds new since the previous snapshot, then writes the index last and
create-only; :func:`restore_snapshot` makes a local directory hold exactly a snapshot,
reusing identical files and verifying every byte it downloads.
"""

from __future__ import annotations

from statekeeper.snapshot._diff import DirDiff, diff_dir
from statekeeper.snapshot._download import RestoreMetrics, restore_snapshot
from statekeeper.snapshot._files import is_immutable, is_skipped
from statekeeper.snapshot._index import (
    ROOT_DIR_NAME,
    SCHEMA_VERSION,
    DirIndex,
    FileBlob,
    FileIndex,
    SnapshotIndex,
    SnapshotMetadata,
    check_metadata,
    iter_dirs,
    iter_files,
    rebased,
    referenced_blob_ids,
    referenced_blob_keys,
)
from statekeeper.snapshot._resume import ResumePolicy
from statekeeper.snapshot._transfer import SnapshotMetrics, load_index, upload_snapshot

__all__ = [
    "ROOT_DIR_NAME",
    "SCHEMA_VERSION",
    "DirDiff",
    "DirIndex",
    "FileBlob",
    "FileIndex",
    "RestoreMetrics",
    "ResumePolicy",
    "SnapshotIndex",
    "SnapshotMetadata",
    "SnapshotMetrics",
    "check_metadata",
    "diff_dir",
    "is_immutable",
    "is_skipped",
    "iter_dirs",
    "iter_files",
    "load_index",
    "rebased",
    "referenced_blob_ids",
    "referenced_blob_keys",
    "restore_snapshot",
    "upload_snapshot",
]
