"""Rewrite a local root as statekeeper 0.1 (format 1) wrote it: blobs named by version alone,
changelogs without identity (envelope format 1), snapshot indexes of schema 1, no manifests,
root metadata of format 1. For tests that old roots still read and verify."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from statekeeper import layout
from statekeeper.changelog import decode_changelog, encode_changelog
from statekeeper.history import StoreHistory
from statekeeper.snapshot import SnapshotMetadata, load_index
from statekeeper.storage import LocalBlobStore

__all__ = ["to_format1"]


def to_format1(root: Path) -> str:
    """Rewrite the root at ``root`` in place; returns its root id."""
    meta_path = root / layout.ROOT_METADATA
    doc = json.loads(meta_path.read_bytes())
    root_id = str(doc["rootId"])
    blobs = LocalBlobStore(str(root))
    try:
        for operator in doc["operators"]:
            for partition in _partitions(blobs, operator):
                _rewrite_store(blobs, root_id, operator, partition)
    finally:
        blobs.close()
    operators = {name: {"partitions": e["partitions"]} for name, e in doc["operators"].items()}
    old = {"format": doc["format"], "formatVersion": 1, "rootId": root_id,
           "createdTimeMs": doc["createdTimeMs"], "operators": operators}  # fmt: skip
    meta_path.write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")
    return root_id


def _partitions(blobs: LocalBlobStore, operator: str) -> set[int]:
    found = set()
    for meta in blobs.list(layout.operator_prefix(operator)):
        store = layout.parse_store_key(meta.key)
        if store is not None and store[0] == operator:
            found.add(store[1])
    return found


def _rewrite_store(blobs: LocalBlobStore, root_id: str, operator: str, partition: int) -> None:
    history = StoreHistory.load(blobs, operator, partition, root_id=root_id)
    for v in sorted(history.changelogs):
        key = history.changelog_key(v)
        log = decode_changelog(blobs.get(key), blob=key)
        old = encode_changelog(log.records, base_version=v - 1, version=v, compression="none")
        blobs.put(layout.changelog_key(operator, partition, v), old)
    for v in sorted(history.snapshots):
        key = history.index_key(v)
        index = load_index(blobs, operator, partition, v, key=key)
        old_index = dataclasses.replace(
            index,
            metadata=SnapshotMetadata(operator=operator, partition=partition, version=v),
            prev_snapshot_index_blob_id=None,
            schema_version=0,
        )
        blobs.put(layout.snapshot_index_key(operator, partition, v), old_index.to_json())
    doomed = [
        m.key
        for m in blobs.list(layout.store_prefix(operator, partition))
        if layout.parse_manifest_key(m.key) is not None
        or layout.parse_attempt_changelog_key(m.key) is not None
        or layout.parse_attempt_snapshot_key(m.key) is not None
        or layout.parse_metrics_key(m.key) is not None
    ]
    blobs.delete_many(doomed)
