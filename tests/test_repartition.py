"""Offline repartition (statekeeper.repartition): split and merge by key-group ranges on a
real local root, with TTL and timer index entries, the operator record and event time."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import statekeeper as sk
from statekeeper import layout
from statekeeper.epochs import EpochManifest, StoreEntry, write_manifest
from statekeeper.gc import collect_garbage
from statekeeper.keyed._layout import (
    DATA,
    GROUPED_TIMER_INDEX,
    INDEX_FLOOR,
    META_KEY,
    TIMER,
    U64,
    OperatorRecord,
    StateDecl,
    floor_key,
    group_prefix,
    key_group_range,
    state_prefix,
    ttl_prefix,
)
from statekeeper.repartition import plan_parents, repartition
from statekeeper.snapshot import SnapshotIndex, iter_files, referenced_blob_keys
from statekeeper.storage import open_blob_store
from statekeeper.store import DEFAULT_KEY_GROUPS, Rescale, _rescale
from tests.blobstores import SimulatedCrash

G = DEFAULT_KEY_GROUPS
OP = "counts"
EVENT_TIME_KEY = b"\xff\x05maxEventTimeMs"
RECORD = OperatorRecord(
    keys=("user",),
    key_schema=None,
    states={"count": StateDecl("value", 60_000, "json"), "seen": StateDecl("value", None, "json")},
    key_groups=G,
)


def config(tmp: Path, name: str) -> sk.StoreConfig:
    return sk.StoreConfig(local_dir=str(tmp / name), io_threads=4, snapshot_every=1000)


def keys_of(kg: int, i: int) -> dict[bytes, bytes]:
    """The entries one grouping key of key group ``kg`` holds: a value with a TTL and its
    index entry, a value without, a timer and its index entry."""
    user = b"user-%d" % i
    counted = group_prefix(kg) + state_prefix("count") + user
    expiry = 1_000_000 + i
    return {
        counted: b"\x01" + U64.pack(expiry) + b"%d" % i,
        group_prefix(kg) + state_prefix("seen") + user: b"\x00yes",
        ttl_prefix("count", grouped=True) + U64.pack(expiry) + counted: b"",
        group_prefix(kg) + TIMER + user + U64.pack(5_000 + i): b"",
        GROUPED_TIMER_INDEX + U64.pack(5_000 + i) + group_prefix(kg) + user: b"",
    }


def group_of(key: bytes) -> int | None:
    """The key group an entry belongs to (``None``: per store, e.g. the operator record)."""
    if key in (META_KEY, EVENT_TIME_KEY):
        return None
    if key.startswith(GROUPED_TIMER_INDEX):
        return int.from_bytes(key[10:12], "big")
    prefix = ttl_prefix("count", grouped=True)
    if key.startswith(prefix):
        return int.from_bytes(key[len(prefix) + 8 : len(prefix) + 10], "big")
    assert key[2:3] in (DATA, TIMER), key
    return int.from_bytes(key[:2], "big")


def build_root(
    tmp: Path, partitions: int, *, batches: int = 3, uri: str | None = None,
    options: dict[str, str] | None = None, owner: str | None = None,
) -> tuple[str, dict[bytes, bytes]]:  # fmt: skip
    """A root (``uri``, or a folder under ``tmp``) whose operator has ``partitions`` stores,
    snapshotted at version 2 and one changelog after it, committed by ``owner`` (a streaming
    query's id; ``None``: the store API); returns the root and every entry by key (per-store
    ones once)."""
    root = uri or str(tmp / "root")
    everything: dict[bytes, bytes] = {}
    with sk.StateBackend(root, config=config(tmp, "writer"), storage_options=options) as backend:
        for p in range(partitions):
            with backend.open(OP, p, partitions=partitions) as store:
                for b in range(batches):
                    for kg in key_group_range(p, partitions, G):
                        if (kg + b) % 5 == 0:
                            entries = keys_of(kg, kg * 10 + b)
                            for k, v in entries.items():
                                store.put(k, v)
                            everything.update(entries)
                    store.put(META_KEY, RECORD.to_bytes())
                    store.put(EVENT_TIME_KEY, U64.pack(123) + U64.pack(100))
                    # Index floors, trusted at this version: a new store must not keep them.
                    for index in (GROUPED_TIMER_INDEX, ttl_prefix("count", grouped=True)):
                        store.put(floor_key(index), U64.pack(5_000) + U64.pack(store.version + 1))
                    store.commit(owner=owner)
                    if b == 1:
                        backend.snapshot(OP, p)
    return root, everything


def state_of(
    root: str, tmp: Path, name: str, operator: str = OP, options: dict[str, str] | None = None
) -> dict[int, dict[bytes, bytes]]:
    with sk.StateBackend(root, config=config(tmp, name), storage_options=options) as backend:
        count = backend.operators()[operator]
        assert count is not None
        out = {}
        for q in range(count):
            with backend.open(operator, q) as store:
                out[q] = dict(store.scan())
        return out


def check_layout(
    state: dict[int, dict[bytes, bytes]], everything: dict[bytes, bytes], *, built: int = 0
) -> None:
    """Each store holds exactly the entries of its key groups, plus the per-store ones; the
    index floors ``build_root`` wrote are gone, unless the operator still has the ``built``
    partitions it was built with (no repartition ran)."""
    count = len(state)
    union: dict[bytes, bytes] = {}
    for q, items in state.items():
        owned = key_group_range(q, count, G)
        assert items.pop(META_KEY) == RECORD.to_bytes()
        assert items.pop(EVENT_TIME_KEY) == U64.pack(123) + U64.pack(100)
        # A repartition drops the floors: each index now also holds other stores' entries.
        floors = [k for k in items if k.startswith(b"\xff" + INDEX_FLOOR)]
        assert len(floors) == (2 if count == built else 0), (q, floors)
        for k in floors:
            del items[k]
        strays = [k for k in items if group_of(k) not in owned]
        assert not strays, f"store {q} of {count} holds keys of other key groups: {strays[:3]}"
        union.update(items)
    assert union == everything


def test_plan_parents_puts_the_largest_overlap_first() -> None:
    assert plan_parents(1, 8, 4, G) == [(0, range(512, 1024))]
    plan = plan_parents(1, 7, 4, G)
    assert [p for p, _ in plan] == [0, 1]
    assert [r for _, r in plan] == [range(586, 1024), range(1024, 1171)]
    assert sorted(p for p, _ in plan_parents(0, 1, 4, G)) == [0, 1, 2, 3]


def test_split_then_merge_keeps_every_entry_in_its_key_group(tmp_path: Path) -> None:
    root, everything = build_root(tmp_path, 4)
    report = repartition(root, OP, partitions=7, config=config(tmp_path, "r1"))
    assert (report.from_partitions, report.partitions, report.version) == (4, 7, 3)
    with sk.StateBackend(root) as backend:
        assert backend.operators()[OP] == 7
        meta = backend.root_metadata()
        assert meta is not None
        assert meta.format_version == 3
        assert not meta.rescales[OP].pending
    check_layout(state_of(root, tmp_path, "read7"), everything)

    # The new stores take commits on top of the cut's version, then merge into 3.
    with sk.StateBackend(root, config=config(tmp_path, "writer7")) as backend:
        for q in range(7):
            with backend.open(OP, q, partitions=7) as store:
                assert store.version == 3
                kg = key_group_range(q, 7, G)[0]
                entries = keys_of(kg, 99_000 + q)
                for k, v in entries.items():
                    store.put(k, v)
                everything.update(entries)
                assert store.commit().version == 4
    report = repartition(root, OP, partitions=3, config=config(tmp_path, "r2"))
    assert (report.from_partitions, report.version) == (7, 4)
    assert report.keys_ingested > 0  # a merge writes the ranges of its other parents
    check_layout(state_of(root, tmp_path, "read3"), everything)


def test_split_along_old_boundaries_reuses_the_parents_blobs(tmp_path: Path) -> None:
    root, everything = build_root(tmp_path, 2, batches=6)
    report = repartition(root, OP, partitions=4, config=config(tmp_path, "r"))
    assert report.keys_ingested == 0
    assert report.bytes_reused > 0
    check_layout(state_of(root, tmp_path, "read"), everything)
    # Store 1's snapshot names store 0's SST blobs in place: no copy was uploaded.
    with sk.StateBackend(root) as backend:
        key = layout.attempt_snapshot_key(OP, 1, report.version, report.attempt)
        index = SnapshotIndex.from_json(backend.blobs.get(key), blob=key)
    assert index.schema_version == 3
    shared = [b.store for _, f in iter_files(index.dir_index) for b in f.blobs if b.store]
    assert shared
    assert set(shared) == {(OP, 0)}


def test_repartition_into_a_new_operator_leaves_the_source_alone(tmp_path: Path) -> None:
    root, everything = build_root(tmp_path, 4)
    before = state_of(root, tmp_path, "before")
    repartition(root, OP, partitions=2, to="counts2", config=config(tmp_path, "r"))
    with sk.StateBackend(root) as backend:
        assert backend.operators() == {OP: 4, "counts2": 2}
    assert state_of(root, tmp_path, "after") == before
    check_layout(state_of(root, tmp_path, "new", "counts2"), everything)


def test_bad_requests_are_refused_naming_what_was_found(tmp_path: Path) -> None:
    root, _ = build_root(tmp_path, 2, batches=1)
    cfg = config(tmp_path, "r")
    with pytest.raises(sk.ConfigMismatchError, match="already has 2 partitions"):
        repartition(root, OP, partitions=2, config=cfg)
    with pytest.raises(sk.ConfigMismatchError, match=r"'nope' is not in the root \(it holds"):
        repartition(root, "nope", partitions=2, config=cfg)
    with pytest.raises(sk.ConfigMismatchError, match="at most 4096 partitions; 5000"):
        repartition(root, OP, partitions=5000, config=cfg)
    with pytest.raises(ValueError, match="partitions must be an int >= 1, got 0"):
        repartition(root, OP, partitions=0, config=cfg)
    with pytest.raises(sk.ConfigMismatchError, match="'counts' exists in the root"):
        repartition(root, OP, partitions=3, to=OP, config=cfg)
    # Once a dict config fell back on the backend's (or failed later with AttributeError).
    with (
        sk.StateBackend(root, config=cfg) as backend,
        pytest.raises(TypeError, match="config must be a StoreConfig or None, got dict"),
    ):
        repartition(backend, OP, partitions=3, config={})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="workers must be an int >= 1 or None, got -1"):
        repartition(root, OP, partitions=3, config=cfg, workers=-1)
    with pytest.raises(TypeError, match="progress must be callable or None, got int"):
        repartition(root, OP, partitions=3, config=cfg, progress=5)  # type: ignore[arg-type]
    assert state_of(root, tmp_path, "after").keys() == {0, 1}


def test_a_partition_ahead_of_the_cut_is_read_at_the_cut(tmp_path: Path) -> None:
    """Without an epoch manifest the cut is the newest version every partition has: a
    commit one partition made beyond it (a batch that failed elsewhere) is not moved."""
    root, everything = build_root(tmp_path, 2, batches=1)
    ahead = group_prefix(3000) + state_prefix("seen") + b"ahead"
    with (
        sk.StateBackend(root, config=config(tmp_path, "w")) as backend,
        backend.open(OP, 1) as store,
    ):
        store.put(ahead, b"\x00y")
        assert store.commit().version == 2
    report = repartition(root, OP, partitions=3, config=config(tmp_path, "r"))
    assert report.version == 1
    state = state_of(root, tmp_path, "read")
    assert all(ahead not in items for items in state.values())
    check_layout(state, everything)


def test_gc_keeps_parent_blobs_that_new_stores_name(tmp_path: Path) -> None:
    """After a split, store path 1 holds store 1 of the new layout (made from old store 0),
    and old store 1's SST blobs are named only by new stores 2 and 3. Once old store 1's
    retired snapshot is past ``orphan_ttl_s``, only the cross-store references keep them."""
    root, everything = build_root(tmp_path, 2, batches=6)
    cfg = config(tmp_path, "gc")
    report = repartition(root, OP, partitions=4, config=cfg)
    with sk.StateBackend(root) as backend:
        blobs, meta = backend.blobs, backend.root_metadata()
        assert meta is not None
        assert sorted(meta.rescales) == [OP]
        named = set()
        for q in (2, 3):
            key = layout.attempt_snapshot_key(OP, q, report.version, report.attempt)
            index = SnapshotIndex.from_json(blobs.get(key), blob=key)
            named |= referenced_blob_keys(index)
        parents = {k for k in named if k.startswith(layout.files_prefix(OP, 1))}
        assert parents
        later = time.time() + 10 * cfg.orphan_ttl_s
        # Without the references of other stores, store 1 would lose its parent blobs.
        blind = collect_garbage(blobs, cfg, [OP], dry_run=True, now=later, root_id=meta.root_id)
        assert parents <= set(blind.deleted_keys)
        run = collect_garbage(
            blobs, cfg, [OP], now=later, root_id=meta.root_id, shared_from=sorted(meta.rescales)
        )
        assert not parents & set(run.deleted_keys)
        assert run.deleted_keys  # old store 1's own files went: it was collected
    check_layout(state_of(root, tmp_path, "after-gc"), everything)


def test_keys_outside_every_key_group_are_refused_not_dropped(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    with (
        sk.StateBackend(root, config=config(tmp_path, "w")) as backend,
        backend.open("plain", 0, partitions=1) as store,
    ):
        store.put(b"user-1", b"3")  # the plain store API: no key group
        store.commit()
    before = (Path(root) / layout.ROOT_METADATA).read_bytes()
    with pytest.raises(sk.ConfigMismatchError, match=r"holds key b'user-1', outside the"):
        repartition(root, "plain", partitions=2, config=config(tmp_path, "r"))
    assert (Path(root) / layout.ROOT_METADATA).read_bytes() == before


def test_format_doc_shows_the_rescale_entry_as_the_root_writes_it(tmp_path: Path) -> None:
    text = (Path(__file__).parents[1] / "docs" / "format.md").read_text()
    (block,) = re.findall(r"```jsonc\n(.*?)```", text, flags=re.S)
    shown = json.loads(block)["operators"]["sessions"]
    root, _ = build_root(tmp_path, 2, batches=1)
    repartition(root, OP, partitions=3, config=config(tmp_path, "r"))
    written = json.loads((Path(root) / layout.ROOT_METADATA).read_bytes())["operators"][OP]
    assert set(shown) == set(written)
    assert set(shown["rescale"]) == set(written["rescale"])
    assert Rescale.from_json(shown["rescale"]).source == "sessions"


@pytest.mark.s3
def test_split_and_merge_on_s3(tmp_path: Path, s3_root: tuple[str, dict[str, str]]) -> None:
    """On an object store (moto): create-only uploads, the root's compare-and-swap by etag,
    and listings of the parents' files to check the blobs a new store reuses."""
    uri, options = s3_root
    root, everything = build_root(tmp_path, 2, uri=uri, options=options)
    report = repartition(
        root, OP, partitions=4, config=config(tmp_path, "r1"), storage_options=options
    )
    assert report.keys_ingested == 0
    assert report.bytes_reused > 0  # the parents' SST blobs, named in place
    check_layout(state_of(root, tmp_path, "read4", options=options), everything)
    repartition(root, OP, partitions=3, config=config(tmp_path, "r2"), storage_options=options)
    check_layout(state_of(root, tmp_path, "read3", options=options), everything)


def test_a_commit_during_the_rescale_refuses_the_switch(tmp_path: Path) -> None:
    """A query still running commits while the new stores are built: the switch is refused
    (its commits would be lost) and the root is as it was."""
    root, _ = build_root(tmp_path, 2, batches=1)
    before = (Path(root) / layout.ROOT_METADATA).read_bytes()
    committed = []

    def meanwhile(phase: str, done: int, total: int) -> None:
        if phase == "build" and done == 1 and not committed:
            with (
                sk.StateBackend(root, config=config(tmp_path, "query")) as backend,
                backend.open(OP, 0) as store,
            ):
                store.put(group_prefix(5) + state_prefix("seen") + b"late", b"\x00y")
                committed.append(store.commit().version)

    with pytest.raises(
        sk.CommitConflictError, match=r"newest versions went from \[1, 1\] to \[2, 1\]"
    ):
        repartition(root, OP, partitions=4, config=config(tmp_path, "r"), progress=meanwhile)
    assert committed == [2]
    assert (Path(root) / layout.ROOT_METADATA).read_bytes() == before


def test_gc_finishes_a_repartition_that_died_after_its_commit_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after the root switched to the new stores and before their manifests were
    written, nothing named the new stores' snapshots: a GC once their blobs outlived the
    orphan TTL deleted them all, and every partition failed to open for good."""
    root, everything = build_root(tmp_path, 2)
    finish = _rescale.complete_rescale

    def die_if_pending(blobs: Any, registry: Any, meta: Any, operator: str, **kw: Any) -> Any:
        rescale = meta.rescales.get(operator)
        if rescale is not None and rescale.pending:
            raise SimulatedCrash("killed right after the commit point")
        return finish(blobs, registry, meta, operator, **kw)

    monkeypatch.setattr(_rescale, "complete_rescale", die_if_pending)
    with pytest.raises(SimulatedCrash):
        repartition(root, OP, partitions=4, config=config(tmp_path, "r"))
    monkeypatch.undo()
    two_hours_ago = time.time() - 7200  # the TTL below is one hour
    for path in Path(root).rglob("*"):
        if path.is_file():
            os.utime(path, (two_hours_ago, two_hours_ago))
    gc_config = dataclasses.replace(config(tmp_path, "gc"), orphan_ttl_s=3600)
    with sk.StateBackend(root, config=gc_config) as backend:
        metadata = (Path(root) / layout.ROOT_METADATA).read_bytes()
        assert backend.gc(dry_run=True).deleted_blobs == 0  # writes nothing, deletes nothing
        assert (Path(root) / layout.ROOT_METADATA).read_bytes() == metadata
        meta = backend.root_metadata()
        assert meta is not None
        assert meta.rescales[OP].pending
        backend.gc()
        meta = backend.root_metadata()
        assert meta is not None
        assert not meta.rescales[OP].pending
        assert meta.operators[OP] == 4
    check_layout(state_of(root, tmp_path, "read"), everything)


_KILLED_CHILD = """
import sys
from pathlib import Path
from statekeeper.repartition import repartition
from statekeeper.storage import open_blob_store
from tests.blobstores import FaultyBlobStore
from tests.test_repartition import OP, config
root, tmp = sys.argv[1], Path(sys.argv[2])
blobs = FaultyBlobStore(open_blob_store(root), fail_at=1, kind="kill", op="put")
repartition(blobs, OP, partitions=3, config=config(tmp, "child"), work_dir=tmp / "scratch")
"""

_HOLDER_CHILD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()
"""


def test_the_work_folder_a_killed_repartition_left_is_deleted_by_the_next_one(
    tmp_path: Path,
) -> None:
    """Each work folder holds a restored copy of the whole operator: a killed repartition's
    must not stay for ever (repeated kills would fill the disk). The next repartition in
    the same work_dir deletes it, and keeps the folder of one still running."""
    root, everything = build_root(tmp_path, 2)
    scratch = tmp_path / "scratch"
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_CHILD, root, str(tmp_path)],
        cwd=repo, capture_output=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    (killed,) = scratch.glob("statekeeper-repartition-*")
    assert any(killed.rglob("*.sst"))  # the old stores were restored into it
    running = scratch / "statekeeper-repartition-running"
    running.mkdir()
    (running / ".owner.lock").touch()
    unlocked_new = scratch / "statekeeper-repartition-new"  # an older release's, just made
    unlocked_new.mkdir()
    unlocked_old = scratch / "statekeeper-repartition-old"
    unlocked_old.mkdir()
    os.utime(unlocked_old, (time.time() - 7200, time.time() - 7200))
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER_CHILD, str(running / ".owner.lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == b"locked\n"
        repartition(root, OP, partitions=3, config=config(tmp_path, "r"), work_dir=scratch)
    finally:
        holder.communicate(b"", timeout=60)
    assert sorted(p.name for p in scratch.iterdir()) == [unlocked_new.name, running.name]
    check_layout(state_of(root, tmp_path, "after"), everything)


def test_a_stale_epoch_manifest_does_not_set_the_version_new_stores_start_at(
    tmp_path: Path,
) -> None:
    """The root's newest epoch manifest names version 1, written by a classic session's
    listener; the query then ran on from Spark Connect (no manifests) to version 3. The
    rescale must start the new stores at 3, where the restarted query goes on: at 1 it
    failed for good, the state of the batches after 1 out of reach."""
    root, everything = build_root(tmp_path, 2, batches=3)
    entries = [StoreEntry(p, 1, f"{OP}/{p}/changelog/x", None, None) for p in (0, 1)]
    query = "0b5c2f0e-1111-4c1e-9a52-0c6d7a1e0001"
    stale = EpochManifest(0, query, "run", 1, {OP: 2}, {OP: entries})
    assert write_manifest(open_blob_store(root), stale)
    report = repartition(root, OP, partitions=3, config=config(tmp_path, "r"))
    assert report.version == 3
    check_layout(state_of(root, tmp_path, "read"), everything)


def test_a_cut_that_cannot_tell_where_the_query_goes_on_asks_for_the_version(
    tmp_path: Path,
) -> None:
    """Every partition at version 3, committed by a query, and no epoch manifest names it
    (Spark Connect, or a driver that stopped before writing it): micro-batch 2 finished (the
    query goes on at 3) or failed after its commits (it runs 2 again, from 2). The rescale
    took one of them, and new stores at the other stopped the restarted query for good."""
    query = "0b5c2f0e-1111-4c1e-9a52-0c6d7a1e0002"
    root, everything = build_root(tmp_path, 2, owner=query)
    with pytest.raises(sk.ConfigMismatchError, match=r"name the version: 3 if micro-batch 2 fin"):
        repartition(root, OP, partitions=3, config=config(tmp_path, "r"))
    # One version behind: where the manifest of batch 1 was the newest, the same question.
    entries = [StoreEntry(p, 2, f"{OP}/{p}/changelog/x", None, None) for p in (0, 1)]
    assert write_manifest(
        open_blob_store(root), EpochManifest(1, query, "r", 1, {OP: 2}, {OP: entries})
    )
    with pytest.raises(sk.ConfigMismatchError, match="--version V"):
        repartition(root, OP, partitions=3, config=config(tmp_path, "r"))
    with pytest.raises(sk.ConfigMismatchError, match="expected a version from 1 to 3"):
        repartition(root, OP, partitions=3, version=4, config=config(tmp_path, "r"))
    with pytest.raises(sk.ConfigMismatchError, match=r"\(.*so 2 or 3\): new stores at it"):
        repartition(root, OP, partitions=3, version=1, config=config(tmp_path, "r"))
    copy = repartition(root, OP, partitions=3, to="copy", version=1, config=config(tmp_path, "c"))
    assert copy.version == 1  # another operator: any retained version
    earlier = repartition(
        root, OP, partitions=3, to="older", version=2, config=config(tmp_path, "o")
    )
    assert (earlier.version, earlier.operator) == (2, "older")
    report = repartition(root, OP, partitions=3, version=3, config=config(tmp_path, "r"))
    assert report.version == 3
    check_layout(state_of(root, tmp_path, "read"), everything)
