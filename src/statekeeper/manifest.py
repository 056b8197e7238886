"""Store manifests (format 2): the one authority on which attempt is each version of a store.

Format 1 had two commit points (a changelog blob *or* a snapshot index named by version
alone) and no notion of attempts: a re-run batch that wrote other state could never commit
again, two writers in different modes could both commit one version, and GC decided from a
listing that interleaves with commits. Format 2 gives every store a chain of **manifests**,
``<operator>/<partition>/manifest/<seq:020d>.json``, each written create-only and never
replaced (SlateDB's manifest fencing, with the store's blob store as the only coordinator):

* Every blob a commit writes has a name unique to its **attempt** (a random id), so no blob
  name is ever reused; a blob is committed only when the newest manifest names it.
* A commit writes its changelog (or snapshot index), then manifest ``seq + 1`` naming it.
  Two writers racing for ``seq + 1`` cannot both succeed (create-only): the loser reads the
  newest manifest again and decides anew with :func:`decide`.
* **Attempt order.** Each attempt carries an order, ``(generation, stage id, stage attempt, task
  attempt)``: the generation is bumped when a query (re)starts, the rest are Spark's attempt
  numbers; the plain store API uses ``(0, 0, 0, 0)``. A manifest records the highest order that
  ever wrote it (``fence``): an older attempt (a zombie) is refused before it writes
  anything, so it can never displace a newer one.
* **Re-runs.** A newer attempt that loads version ``v - 1`` and commits ``v`` *replaces*
  the entry of ``v`` as long as ``v`` is the newest version (nothing was built on it); a
  version with a successor is final. Attempts of equal order do not replace each other
  (two plain writers of one version: the second gets ``CommitConflictError``), unless they
  are the same attempt (an idempotent retry of the manifest write).
* **Owners.** An entry may name its **owner**: in the Spark layer, the streaming query
  (its id, which stays the same across restarts from one ``checkpointLocation``). An attempt
  of another owner may not replace the version, adopt it, or build on it: a query started
  with a fresh ``checkpointLocation`` on an operator that holds another query's state would
  otherwise replace that query's newest version (its batch 0 re-commits version 1), or
  continue from it. An empty owner (the plain store API, entries written before owners
  existed) is anyone's.
* **Lineage.** Each entry records its parent ``(version, attempt)``; a manifest holds one
  linear chain from its base to its newest version, so every reader on every host that
  reads the same manifest agrees on the content of every version. Branches that lost
  (replaced entries, attempts fenced after writing their blob) are named by no manifest
  and become orphans for GC after its grace period.

* **Staying bounded.** A manifest names the retained versions, the registered snapshots
  and at most :data:`RETIRED_KEPT` *retired* snapshots (no longer named, their files kept
  by GC for an upload that started from one); GC deletes a manifest once its successor is
  :data:`MANIFEST_GRACE_S` old (or ``orphan_ttl_s``, if smaller). So neither a manifest
  nor their number grows with the age of a store. A snapshot is registered only if the
  snapshot it reused files of is still named or retired (:func:`with_snapshot`), and a
  writer whose known manifest is older than :data:`STALE_AFTER_S` reads the newest before
  writing one: a deleted sequence number must never be written again.

A manifest carries the root id, operator and partition it belongs to and a CRC32C of its
canonical JSON; a reader refuses one that does not match (naming both), and falls back to
the previous manifest when the newest is damaged.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from statekeeper import layout
from statekeeper.checksum import canonical_json, check_sealed, seal
from statekeeper.errors import (
    CommitConflictError,
    ConfigMismatchError,
    CorruptStateError,
    OwnerConflictError,
    StateNotFoundError,
)
from statekeeper.storage import BlobStore

__all__ = [
    "FORMAT_VERSION",
    "LEGACY_ATTEMPT",
    "MANIFEST_GRACE_S",
    "PLAIN_ORDER",
    "RETIRED_KEPT",
    "STALE_AFTER_S",
    "Decision",
    "Order",
    "RetiredSnapshot",
    "SnapshotEntry",
    "StoreManifest",
    "VersionEntry",
    "apply",
    "chain",
    "decide",
    "decode_manifest",
    "encode_manifest",
    "fenced",
    "names_snapshot",
    "owns",
    "read_newest_after_conflict",
    "read_newest_manifest",
    "retire",
    "with_base",
    "with_snapshot",
    "write_manifest",
]

FORMAT_VERSION = 2
RETIRED_KEPT = 16
"""Retired snapshots a manifest names at most (the most recently retired): with one taken
every few commits, a grace of days would otherwise name thousands, in every manifest."""
MANIFEST_GRACE_S = 900.0
"""GC deletes a manifest once its successor is this old (``orphan_ttl_s`` if smaller): a
reader that listed the manifests has long read it, and no writer knows it as the newest
(see :data:`STALE_AFTER_S`). Without the bound a store kept a manifest per commit for
``orphan_ttl_s`` (7 days by default)."""
STALE_AFTER_S = 60.0
"""A writer whose newest known manifest was read or written longer ago than this reads the
newest again before writing the next one. A writer that knew ``seq`` for longer than
:data:`MANIFEST_GRACE_S` could otherwise write ``seq + 1`` after GC deleted it, under a
newer manifest: acknowledged, and never read."""
_FORMAT_NAME = "statekeeper.store-manifest"
_log = logging.getLogger("statekeeper.manifest")

Order = tuple[int, int, int, int]
"""(generation, stage id, stage attempt, task attempt): higher is newer. In the Spark layer the
generation is bumped by compare-and-swap on the root when a query (re)starts, and the rest are
Spark's numbers: stage ids grow within an application, so a second action over the same
micro-batch (``foreachBatch``) is newer than the first, a stage retry newer than the attempt
it retries, a task retry newer than the task."""

PLAIN_ORDER: Order = (0, 0, 0, 0)
"""The order of writers of the plain store API (no attempt numbers)."""

LEGACY_ATTEMPT = "format1"
"""The attempt id of versions written by format 1 (statekeeper 0.1), once a manifest names
them: format 1 had no attempts, and each version had one blob named by version alone."""

Kind = Literal["changelog", "snapshot"]


@dataclass(frozen=True, slots=True)
class VersionEntry:
    """Which attempt's content is one version, and what it was built on.

    Attributes:
        version: the version (>= 1).
        attempt: the attempt id that wrote it.
        order: that attempt's order.
        kind: ``"changelog"`` (``blob`` holds its puts and deletes) or ``"snapshot"``
            (``blob`` is a snapshot index of the whole store at ``version``).
        blob: the key of that blob.
        parent_attempt: the attempt of ``version - 1`` it was built on (``""`` for the
            empty store at version 0).
        committed_time_ms: when the manifest naming it was written.
        owner: who committed it (in the Spark layer the streaming query's id); ``""``:
            anyone's (the plain store API, or written before owners were recorded).
    """

    version: int
    attempt: str
    order: Order
    kind: Kind
    blob: str
    parent_attempt: str
    committed_time_ms: int
    owner: str = ""


@dataclass(frozen=True, slots=True)
class SnapshotEntry:
    """A snapshot index of the store at ``version`` whose content is that version's entry."""

    version: int
    attempt: str
    index_blob: str


@dataclass(frozen=True, slots=True)
class RetiredSnapshot:
    """A snapshot the manifest stopped naming (expired by GC, or of a replaced version) at
    ``time_ms``: GC keeps its files while a manifest lists it (the :data:`RETIRED_KEPT`
    most recent, for at most ``orphan_ttl_s``), since an upload that read an older manifest
    may be reusing them."""

    index_blob: str
    time_ms: int


@dataclass(frozen=True, slots=True)
class StoreManifest:
    """One manifest of a store: its retained chain of versions and restorable snapshots.

    Attributes:
        seq: this manifest's sequence number (its blob name).
        root_id: the root it belongs to.
        operator: the operator it belongs to.
        partition: the partition it belongs to.
        fence: the highest attempt order that wrote this store; older ones are refused.
        base: the oldest version a restore may start from: 0 (the empty store) or the
            version of a snapshot in ``snapshots``; versions at or below it are not retained.
        versions: entries ``base + 1 .. latest``, ascending and contiguous.
        snapshots: restorable snapshots, ascending by version.
        retired: snapshots no longer named, with when they stopped being named.
    """

    seq: int
    root_id: str
    operator: str
    partition: int
    fence: Order = PLAIN_ORDER
    base: int = 0
    versions: tuple[VersionEntry, ...] = ()
    snapshots: tuple[SnapshotEntry, ...] = field(default=())
    retired: tuple[RetiredSnapshot, ...] = field(default=())

    @property
    def latest(self) -> int:
        """The newest committed version (``base`` when no version after it is retained)."""
        return self.versions[-1].version if self.versions else self.base

    def entry(self, version: int) -> VersionEntry | None:
        """The entry of ``version`` if it is retained after the base."""
        i = version - self.base - 1
        return self.versions[i] if 0 <= i < len(self.versions) else None

    def attempt_of(self, version: int) -> str:
        """The attempt whose content is ``version`` (``""`` for the empty store, and for a
        snapshot base whose entry is no longer retained: its snapshot entry names it).

        Raises:
            StateNotFoundError: ``version`` is not restorable from this manifest.
        """
        entry = self.entry(version)
        if entry is not None:
            return entry.attempt
        if version == self.base:
            snap = next((s for s in self.snapshots if s.version == version), None)
            return "" if snap is None else snap.attempt
        raise StateNotFoundError(
            f"version {version} of store {self.operator}/{self.partition} is not restorable: "
            f"manifest {self.seq} retains versions {self.base}..{self.latest}"
        )


@dataclass(frozen=True, slots=True)
class Decision:
    """What :func:`decide` concluded for an attempt that loaded ``parent`` and commits.

    ``action`` is ``"append"`` (a new version), ``"replace"`` (the newest version, written
    by an older attempt, is replaced) or ``"done"`` (this attempt's commit is already the
    authority: a retried manifest write).
    """

    action: Literal["append", "replace", "done"]
    version: int


def decide(
    manifest: StoreManifest,
    *,
    parent: int,
    attempt: str,
    order: Order,
    parent_attempt: str | None = None,
    owner: str = "",
) -> Decision:
    """Decide whether an attempt of ``owner`` that loaded version ``parent`` (its content
    written by ``parent_attempt``, if given) may commit ``parent + 1``.

    Raises:
        OwnerConflictError: version ``parent + 1`` or ``parent`` belongs to another owner.
        CommitConflictError: the attempt is older than the store's fence (a zombie), or
            version ``parent + 1`` is final (a later version was built on it), or it was
            committed by another attempt of the same or a newer order, or version
            ``parent`` is no longer ``parent_attempt``'s (a re-run replaced it after this
            attempt loaded it: its changes were made on other content).
        StateNotFoundError: ``parent`` is newer than the newest committed version.
    """
    where = f"store {manifest.operator}/{manifest.partition}"
    if order < manifest.fence:
        raise CommitConflictError(
            f"{where}: attempt {attempt} has order {order}, older than {manifest.fence} "
            f"which already wrote this store (manifest {manifest.seq}): it is a zombie "
            "attempt and may not commit"
        )
    version = parent + 1
    if parent > manifest.latest:
        raise StateNotFoundError(
            f"{where}: cannot commit version {version} on version {parent}: the newest "
            f"committed version is {manifest.latest} (manifest {manifest.seq})"
        )
    current = manifest.entry(version)  # None when parent is the newest version
    loaded = manifest.entry(parent)  # None: version 0, or a base whose entry is dropped
    for entry in (current, loaded):
        if entry is not None and not owns(owner, entry):
            raise OwnerConflictError(
                f"{where}: version {entry.version} belongs to owner {entry.owner!r}, and "
                f"attempt {attempt} of owner {owner!r} may not "
                f"{'replace' if entry is current else 'build on'} it (manifest "
                f"{manifest.seq}): one owner's state is never taken over by another"
            )
    if parent < manifest.latest - 1 or (parent < manifest.latest and current is None):
        raise CommitConflictError(
            f"{where}: version {version} is final: version {manifest.latest} was built on "
            f"it (manifest {manifest.seq}); a re-run may only replace the newest version"
        )
    # A base's entry is dropped, but its snapshot still names the content's attempt: a
    # store left open on a version that a re-run replaced and GC then made the base (or a
    # rescale started a new store at) must be refused all the same.
    now = loaded.attempt if loaded is not None else manifest.attempt_of(parent)
    if parent_attempt is not None and now and now != parent_attempt:
        raise CommitConflictError(
            f"{where}: attempt {attempt} was built on version {parent} of attempt "
            f"{parent_attempt}, but version {parent} is now attempt {now} "
            f"(manifest {manifest.seq}): a re-run replaced it after this store loaded it, so "
            "its changes were made on other content; reopen the store to continue from the "
            "newest version"
        )
    if current is None:
        return Decision("append", version)
    if current.attempt == attempt:
        return Decision("done", version)
    if order > current.order:
        return Decision("replace", version)
    raise CommitConflictError(
        f"{where}: version {version} was committed by attempt {current.attempt} of order "
        f"{current.order}; attempt {attempt} of order {order} is not newer and may not "
        "replace it"
    )


def owns(owner: str, entry: VersionEntry) -> bool:
    """Whether an attempt of ``owner`` may replace, adopt or build on ``entry``: either has
    no owner, or both have the same."""
    return not owner or not entry.owner or owner == entry.owner


def apply(
    manifest: StoreManifest,
    decision: Decision,
    *,
    attempt: str,
    order: Order,
    kind: Kind,
    blob: str,
    now_ms: int | None = None,
    owner: str = "",
) -> StoreManifest:
    """The next manifest: ``decision`` applied, the fence raised to ``order``.

    Raises:
        ValueError: ``decision`` is ``"done"`` (nothing to write).
    """
    if decision.action == "done":
        raise ValueError("the commit is already the authority: nothing to apply")
    version = decision.version
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    kept = tuple(e for e in manifest.versions if e.version < version)
    # A replaced version's snapshots describe the content that lost: drop them.
    snapshots = tuple(s for s in manifest.snapshots if s.version < version)
    retired = retire(
        manifest.retired,
        (RetiredSnapshot(s.index_blob, now_ms) for s in manifest.snapshots if s.version >= version),
    )
    entry = VersionEntry(
        version=version,
        attempt=layout.validate_attempt(attempt),
        order=order,
        kind=kind,
        blob=blob,
        parent_attempt=manifest.attempt_of(version - 1),
        committed_time_ms=now_ms,
        owner=owner,
    )
    if kind == "snapshot":
        snapshots += (SnapshotEntry(version, attempt, blob),)
    return replace(
        manifest,
        seq=manifest.seq + 1,
        fence=max(manifest.fence, order),
        versions=(*kept, entry),
        snapshots=snapshots,
        retired=retired,
    )


def fenced(manifest: StoreManifest, order: Order) -> StoreManifest:
    """The next manifest with the fence raised to ``order`` and nothing else changed: an
    attempt that adopted another's identical content of a version (nothing to write) still
    takes the store, so that attempts older than it can no longer commit."""
    return replace(manifest, seq=manifest.seq + 1, fence=max(manifest.fence, order))


# -- encoding ------------------------------------------------------------------------------


def _body(m: StoreManifest) -> dict[str, Any]:
    return {
        "format": _FORMAT_NAME,
        "formatVersion": FORMAT_VERSION,
        "seq": m.seq,
        "rootId": m.root_id,
        "operator": m.operator,
        "partition": m.partition,
        "fence": list(m.fence),
        "base": m.base,
        "versions": [
            {
                "version": e.version,
                "attempt": e.attempt,
                "order": list(e.order),
                "kind": e.kind,
                "blob": e.blob,
                "parentAttempt": e.parent_attempt,
                "committedTimeMs": e.committed_time_ms,
                **({"owner": e.owner} if e.owner else {}),
            }
            for e in m.versions
        ],
        "snapshots": [
            {"version": s.version, "attempt": s.attempt, "indexBlob": s.index_blob}
            for s in m.snapshots
        ],
        "retired": [{"indexBlob": r.index_blob, "timeMs": r.time_ms} for r in m.retired],
    }


def encode_manifest(manifest: StoreManifest) -> bytes:
    """The manifest blob: canonical JSON with a CRC32C of itself (without the field)."""
    return canonical_json(seal(_body(manifest)))


def decode_manifest(
    data: bytes, *, blob: str, root_id: str, operator: str, partition: int
) -> StoreManifest:
    """Parse and check a manifest blob of store (``operator``, ``partition``) in root
    ``root_id``.

    Raises:
        CorruptStateError: not a manifest, a checksum mismatch, a broken chain, or a
            manifest of another root, store or sequence number (the message names ``blob``
            and both identities).
        ConfigMismatchError: written by a newer format version.
    """
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT_NAME:
            raise ValueError(f"expected format {_FORMAT_NAME!r}")
        version = doc["formatVersion"]
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise ConfigMismatchError(
                f"manifest {blob} has format version {version}; this statekeeper reads "
                f"<= {FORMAT_VERSION}: upgrade statekeeper"
            )
        check_sealed(doc, what=f"manifest {blob}")
        manifest = _from_doc(doc)
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise CorruptStateError(f"manifest {blob} is not valid: {exc}") from exc
    found = (manifest.root_id, manifest.operator, manifest.partition)
    wanted = (root_id, operator, partition)
    seq = layout.parse_manifest_key(blob)
    if found[1:] == wanted[1:] and found[0] != root_id and seq in (None, manifest.seq):
        raise CorruptStateError(
            f"manifest {blob} belongs to root {found[0]}, but {layout.ROOT_METADATA} says the "
            f"root is {root_id}: either {layout.ROOT_METADATA} was replaced by another root's "
            "(restore this root's own), or the manifest was copied from another root"
        )
    if found != wanted or (seq is not None and seq != manifest.seq):
        raise CorruptStateError(
            f"manifest {blob} belongs to root {found[0]}, store {found[1]}/{found[2]}, "
            f"seq {manifest.seq}; expected root {root_id}, store {operator}/{partition}, "
            f"seq {seq}: it was copied from elsewhere"
        )
    return manifest


def _order(value: Any) -> Order:
    a, b, c, d = (int(x) for x in value)
    return (a, b, c, d)


def _from_doc(doc: dict[str, Any]) -> StoreManifest:
    versions = tuple(
        VersionEntry(
            version=int(e["version"]),
            attempt=str(e["attempt"]),
            order=_order(e["order"]),
            kind=e["kind"],
            blob=str(e["blob"]),
            parent_attempt=str(e["parentAttempt"]),
            committed_time_ms=int(e["committedTimeMs"]),
            owner=str(e.get("owner", "")),
        )
        for e in doc["versions"]
    )
    base = int(doc["base"])
    for i, e in enumerate(versions):
        if e.version != base + 1 + i or e.kind not in ("changelog", "snapshot"):
            raise ValueError(f"version entries are not contiguous after base {base}")
        if i and e.parent_attempt != versions[i - 1].attempt:
            raise ValueError(f"version {e.version} names parent {e.parent_attempt!r}, not the "
                             f"attempt of version {e.version - 1}")  # fmt: skip
    snapshots = tuple(
        SnapshotEntry(int(s["version"]), str(s["attempt"]), str(s["indexBlob"]))
        for s in doc["snapshots"]
    )
    retired = tuple(RetiredSnapshot(str(r["indexBlob"]), int(r["timeMs"])) for r in doc["retired"])
    return StoreManifest(
        seq=int(doc["seq"]),
        root_id=str(doc["rootId"]),
        operator=str(doc["operator"]),
        partition=int(doc["partition"]),
        fence=_order(doc["fence"]),
        base=base,
        versions=versions,
        snapshots=snapshots,
        retired=retired,
    )


# -- blob store ----------------------------------------------------------------------------


def read_newest_manifest(
    blobs: BlobStore,
    *,
    root_id: str,
    operator: str,
    partition: int,
    keys: Sequence[str] | None = None,
    skipped: list[str] | None = None,
) -> StoreManifest | None:
    """The newest readable manifest of a store; ``None`` if the store has none (a new store,
    or one written by format 1). ``keys``: the store's blob keys if already listed (any
    order; other keys are ignored), saving a listing.

    A newest manifest that fails its checks is skipped with a WARNING naming it (and its key
    appended to ``skipped``), and the one before it is used: it describes a consistent,
    older state of the store (the damaged one can only have added or replaced the newest
    version).

    Raises:
        CorruptStateError: every manifest of the store fails its checks.
        StorageError: listing or reading failed.
    """
    if keys is None:
        keys = [m.key for m in blobs.list(layout.manifest_prefix(operator, partition))]
    prefix = layout.manifest_prefix(operator, partition)
    seqs = sorted(
        (seq, key)
        for key in keys
        if key.startswith(prefix) and (seq := layout.parse_manifest_key(key)) is not None
    )
    errors: list[str] = []
    for _, key in reversed(seqs):
        try:
            manifest = _read_checked(blobs, key, root_id, operator, partition)
        except (CorruptStateError, StateNotFoundError) as exc:
            _log.warning("skipping manifest %s: %s", key, exc)
            errors.append(str(exc))
            if skipped is not None:
                skipped.append(key)
            continue
        return manifest
    if errors:
        raise CorruptStateError(
            f"no manifest of store {operator}/{partition} is readable: {'; '.join(errors)}"
        )
    return None


_DAMAGE_READS = 3
"""Reads of a manifest that fails its checks before it is taken for damaged."""


def _read_checked(
    blobs: BlobStore, key: str, root_id: str, operator: str, partition: int
) -> StoreManifest:
    """The manifest at ``key``, read again while it fails its checks, up to
    :data:`_DAMAGE_READS` times: a body cut short on the way (a proxy that rewrote its
    length) reads as damage once, and taking it for damage skips a committed version, which
    a task would then commit empty (or a GC write past). Only what fails every read is.

    Raises:
        CorruptStateError: every read failed its checks.
        StateNotFoundError: the manifest is gone.
        StorageError: reading failed.
    """
    for attempt in range(_DAMAGE_READS):
        data = blobs.get(key)
        try:
            return decode_manifest(
                data, blob=key, root_id=root_id, operator=operator, partition=partition
            )
        except CorruptStateError as exc:
            if attempt + 1 == _DAMAGE_READS:
                raise
            _log.info("manifest %s failed its checks (%s); reading it again", key, exc)
    raise AssertionError("unreachable")


def read_newest_after_conflict(
    blobs: BlobStore, lost: StoreManifest, *, root_id: str
) -> StoreManifest:
    """The manifest to decide on again after the write of ``lost`` found its sequence
    number taken: the newest readable one.

    If that is older than ``lost``, the blob under ``lost.seq`` exists but cannot be read
    (a damaged manifest, which :func:`read_newest_manifest` skips): the readable one is
    returned with ``lost``'s sequence number, so that the next write goes past the damaged
    one instead of losing the same race forever (WARNING).

    Raises:
        CorruptStateError: every manifest of the store fails its checks.
        StateNotFoundError: the store has no manifest any more.
        StorageError: listing or reading failed.
    """
    newest = read_newest_manifest(
        blobs, root_id=root_id, operator=lost.operator, partition=lost.partition
    )
    if newest is None:
        raise StateNotFoundError(
            f"the manifests of store {lost.operator}/{lost.partition} disappeared"
        )
    if newest.seq >= lost.seq:
        return newest
    key = layout.manifest_key(lost.operator, lost.partition, lost.seq)
    _log.warning(
        "manifest %s cannot be read: the next one is written past it, from manifest %s", key,
        newest.seq,
    )  # fmt: skip
    return replace(newest, seq=lost.seq)


def write_manifest(blobs: BlobStore, manifest: StoreManifest) -> str:
    """Write ``manifest`` create-only under its sequence number; returns its key.

    Raises:
        CommitConflictError: another writer wrote that sequence number first: read the
            newest manifest again and decide anew.
        StorageError: the write failed.
    """
    key = layout.manifest_key(manifest.operator, manifest.partition, manifest.seq)
    blobs.put(key, encode_manifest(manifest))
    return key


def retire(
    retired: Sequence[RetiredSnapshot],
    new: Iterable[RetiredSnapshot],
    *,
    forget_before_ms: int | None = None,
) -> tuple[RetiredSnapshot, ...]:
    """``retired`` and then ``new``, without those retired before ``forget_before_ms`` and
    without all but the :data:`RETIRED_KEPT` most recent."""
    kept = [r for r in retired if forget_before_ms is None or r.time_ms >= forget_before_ms]
    return tuple([*kept, *new][-RETIRED_KEPT:])


def names_snapshot(manifest: StoreManifest, index_blob: str) -> bool:
    """Whether ``manifest`` names the snapshot ``index_blob``, registered or retired: GC
    then keeps its files."""
    return any(s.index_blob == index_blob for s in manifest.snapshots) or any(
        r.index_blob == index_blob for r in manifest.retired
    )


def with_snapshot(
    manifest: StoreManifest, snapshot: SnapshotEntry, *, reused: str | None = None
) -> StoreManifest | None:
    """The next manifest with ``snapshot`` registered; ``None`` if it must not be: the
    snapshot's version is not retained, its content is not that version's (another attempt
    won it since), a snapshot of that version is already registered, or ``reused`` (the
    index of the snapshot whose files it reuses) is named no more, so GC may have deleted
    those files."""
    if reused is not None and not names_snapshot(manifest, reused):
        return None
    version = snapshot.version
    if version < manifest.base or version > manifest.latest:
        return None
    try:
        if manifest.attempt_of(version) != snapshot.attempt:
            return None
    except StateNotFoundError:
        return None
    if any(s.version == version for s in manifest.snapshots):
        return None
    snapshots = tuple(sorted((*manifest.snapshots, snapshot), key=lambda s: s.version))
    return replace(manifest, seq=manifest.seq + 1, snapshots=snapshots)


def with_base(
    manifest: StoreManifest, base: int, *, now_ms: int, forget_before_ms: int
) -> StoreManifest:
    """The next manifest with versions at or below ``base`` no longer retained: ``base``
    must be 0 or a registered snapshot's version (the restore starts there). Snapshots
    before it are retired at ``now_ms``; retired ones older than ``forget_before_ms`` are
    forgotten (their grace period is over).

    Raises:
        ValueError: ``base`` is not a registered snapshot within the manifest's versions.
    """
    if base != manifest.base and not any(s.version == base for s in manifest.snapshots):
        raise ValueError(f"version {base} has no registered snapshot to be a base")
    if not manifest.base <= base <= manifest.latest:
        raise ValueError(f"base {base} is outside {manifest.base}..{manifest.latest}")
    retired = retire(
        manifest.retired,
        (RetiredSnapshot(s.index_blob, now_ms) for s in manifest.snapshots if s.version < base),
        forget_before_ms=forget_before_ms,
    )
    return replace(
        manifest,
        seq=manifest.seq + 1,
        base=base,
        versions=tuple(e for e in manifest.versions if e.version > base),
        snapshots=tuple(s for s in manifest.snapshots if s.version >= base),
        retired=retired,
    )


def chain(manifest: StoreManifest, version: int) -> Sequence[VersionEntry]:
    """The entries to replay after the newest snapshot at or below ``version``.

    Raises:
        StateNotFoundError: ``version`` is not restorable from this manifest.
    """
    manifest.attempt_of(version)  # raises when not restorable
    bases = [s.version for s in manifest.snapshots if s.version <= version]
    start = max([manifest.base, *bases])
    return [e for e in manifest.versions if start < e.version <= version]
