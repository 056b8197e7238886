"""Root metadata: ``_statekeeper.json`` records the format version, the operators (partition
count, run generation, key groups) and the retention GC applies by default.

The document is created create-only and updated only by compare-and-swap on its etag, so two
processes registering operators at the same time cannot lose each other's entries, and two
callers disagreeing on an operator's partition count are told so. From format 2 it carries a
CRC32C of its canonical JSON. A format-1 root (statekeeper 0.1) is read as it is and upgraded
in place (format version 2) by the first format-2 commit, so a 0.1 library refuses it from
then on instead of writing blobs no manifest names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from statekeeper import layout
from statekeeper.checksum import check_sealed, seal
from statekeeper.errors import (
    CommitConflictError,
    ConfigMismatchError,
    CorruptStateError,
    StateKeeperError,
    StateNotFoundError,
)
from statekeeper.storage import BlobStore

__all__ = [
    "DEFAULT_KEY_GROUPS",
    "FORMAT_VERSION",
    "RESCALED_FORMAT_VERSION",
    "Rescale",
    "Retention",
    "RootMetadata",
    "RootRegistry",
]

FORMAT_VERSION = 2
RESCALED_FORMAT_VERSION = 3
"""The format of a root that records a rescale (:class:`Rescale`): its stores' snapshot
indexes may name their parents' blobs, which statekeeper before it would look for in the
wrong store, so it refuses the root instead."""
DEFAULT_KEY_GROUPS = 4096
"""Key groups of an operator created by format 2: the unit a later rescale moves."""
_FORMAT_NAME = "statekeeper"
_CAS_ATTEMPTS = 20


@dataclass(frozen=True)
class Retention:
    """The retention GC applies to a root unless told otherwise, as the root records it."""

    retain_versions: int
    orphan_ttl_s: float

    def to_json(self) -> dict[str, Any]:
        """The ``retention`` entry."""
        return {"retainVersions": self.retain_versions, "orphanTtlS": self.orphan_ttl_s}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Retention:
        """Parse a ``retention`` entry (errors as ``KeyError``/``ValueError``/``TypeError``)."""
        return cls(_positive("retainVersions", doc["retainVersions"]), float(doc["orphanTtlS"]))


@dataclass(frozen=True)
class Rescale:
    """The last rescale of an operator (``statekeeper repartition``), as the root records it.

    The root's switch to the new partition count is the rescale's commit point; the store
    manifests that make each new store start at ``version`` from its snapshot
    (``attempt``) are written right after it, and while ``pending`` any opener writes the
    ones still missing (a store is done once its newest manifest names that snapshot).
    """

    generation: int
    """The operator's run generation the rescale took: its stores' manifests are fenced
    with it, so no attempt of an earlier run writes them again."""
    version: int
    """The version every new store starts at (the cut the rescale read)."""
    attempt: str
    """The attempt id of that version in every new store."""
    source: str
    """The operator whose state was rescaled (the operator itself, or another with
    ``--to``): the new stores' snapshots may name its blobs."""
    from_partitions: int
    time_ms: int
    pending: bool = True
    fenced: bool = True
    """Whether the new stores' manifests are fenced with ``generation`` (so no attempt of an
    earlier run, a zombie, commits on them): when the source was written by runs with
    generations (the Spark layer), not by the plain store API, whose order is 0."""

    def to_json(self) -> dict[str, Any]:
        """The ``rescale`` entry of the operator in the root document."""
        return {
            "generation": self.generation, "version": self.version, "attempt": self.attempt,
            "source": self.source, "fromPartitions": self.from_partitions,
            "timeMs": self.time_ms, "pending": self.pending, "fenced": self.fenced,
        }  # fmt: skip

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Rescale:
        """Parse the ``rescale`` entry (errors as ``KeyError``/``ValueError``/``TypeError``)."""
        return cls(
            _positive("generation", doc["generation"]), int(doc["version"]),
            layout.validate_attempt(doc["attempt"]), layout.validate_operator(doc["source"]),
            _positive("fromPartitions", doc["fromPartitions"]), int(doc["timeMs"]),
            bool(doc["pending"]), bool(doc["fenced"]),
        )  # fmt: skip


@dataclass(frozen=True)
class RootMetadata:
    """The decoded ``_statekeeper.json``."""

    format_version: int
    root_id: str
    created_time_ms: int
    operators: dict[str, int | None] = field(default_factory=dict)
    """Operator name -> partition count (``None`` until a caller states it)."""
    generations: dict[str, int] = field(default_factory=dict)
    """Operator name -> run generation, bumped each time a query (re)starts on it: the first
    number of an attempt's order (:data:`statekeeper.manifest.Order`)."""
    key_groups: dict[str, int] = field(default_factory=dict)
    """Operator name -> number of key groups. Every operator a format-2 library creates has
    them (:data:`DEFAULT_KEY_GROUPS`): every key the keyed layer writes starts with its key
    group, and partition ``p`` of ``P`` owns the contiguous key groups ``g`` with
    ``g * P // key_groups == p``, so a rescale can move whole ranges. Operators created by
    statekeeper 0.1 have none (their keys carry no key group)."""
    retention: Retention | None = None
    """What ``statekeeper gc`` applies by default (recorded by the last run that started)."""
    rescales: dict[str, Rescale] = field(default_factory=dict)
    """Operator name -> its last rescale, for operators made or changed by one."""
    retentions: dict[str, Retention] = field(default_factory=dict)
    """Operator name -> the retention of the last run that started it: what ``statekeeper
    gc`` applies to that operator's stores (two operators, or two queries, of one root may
    keep different histories; :attr:`retention` is only the last run's of all)."""

    def to_json(self) -> bytes:
        """Serialize to the on-storage document."""
        doc: dict[str, Any] = {
            "format": _FORMAT_NAME,
            "formatVersion": self.format_version,
            "rootId": self.root_id,
            "createdTimeMs": self.created_time_ms,
            "operators": {name: self._operator_json(name) for name in sorted(self.operators)},
        }
        if self.retention is not None:
            doc["retention"] = self.retention.to_json()
        if self.format_version >= 2:
            seal(doc)
        return json.dumps(doc, indent=2, sort_keys=True).encode("utf-8") + b"\n"

    def _operator_json(self, name: str) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "partitions": self.operators[name],
            "generation": self.generations.get(name, 0),
        }
        if name in self.key_groups:
            entry["keyGroups"] = self.key_groups[name]
        if name in self.rescales:
            entry["rescale"] = self.rescales[name].to_json()
        if name in self.retentions:
            entry["retention"] = self.retentions[name].to_json()
        return entry

    def with_operator(self, name: str, partitions: int | None) -> RootMetadata:
        """This metadata with operator ``name`` recorded (``partitions`` if given); a new
        operator gets :data:`DEFAULT_KEY_GROUPS` key groups.

        Raises:
            ConfigMismatchError: more partitions than the operator has key groups.
        """
        operators = dict(self.operators)
        key_groups = dict(self.key_groups)
        if name not in operators:
            key_groups[name] = DEFAULT_KEY_GROUPS
        operators[name] = partitions if partitions is not None else operators.get(name)
        groups = key_groups.get(name)
        if partitions is not None and groups is not None and partitions > groups:
            raise ConfigMismatchError(
                f"operator {name!r} has {groups} key groups, so at most {groups} partitions; "
                f"{partitions} were asked for"
            )
        return dataclasses.replace(self, operators=operators, key_groups=key_groups)

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
        if version > RESCALED_FORMAT_VERSION:
            raise ConfigMismatchError(
                f"root metadata {blob} was written by statekeeper format version {version}; "
                f"this statekeeper reads format versions <= {RESCALED_FORMAT_VERSION}: "
                "upgrade statekeeper"
            )
        if version >= 2:
            check_sealed(doc, what=f"root metadata {blob}")
        try:
            operators = {
                str(name): _partitions(entry["partitions"])
                for name, entry in doc["operators"].items()
            }
            generations = {
                str(name): int(entry.get("generation", 0))
                for name, entry in doc["operators"].items()
            }
            key_groups = {
                str(name): _positive("keyGroups", entry["keyGroups"])
                for name, entry in doc["operators"].items()
                if "keyGroups" in entry
            }
            rescales = {
                str(name): Rescale.from_json(entry["rescale"])
                for name, entry in doc["operators"].items()
                if "rescale" in entry
            }
            kept = doc.get("retention")
            retention = None if kept is None else Retention.from_json(kept)
            retentions = {
                str(name): Retention.from_json(entry["retention"])
                for name, entry in doc["operators"].items()
                if "retention" in entry
            }
            return cls(
                version, str(doc["rootId"]), int(doc["createdTimeMs"]), operators,
                generations, key_groups, retention, rescales, retentions,
            )  # fmt: skip
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptStateError(
                f"root metadata {blob} is not valid: expected rootId, createdTimeMs and "
                f"operators with partition counts, found an error at {exc!r}"
            ) from exc


def _positive(name: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ValueError(f"{name} is {value!r}")


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
            # A cached count that contradicts may be stale (a rescale since): read again.
            with contextlib.suppress(ConfigMismatchError):
                if cached is not None and _satisfied(cached, operator, partitions):
                    return cached

        def change(current: RootMetadata) -> RootMetadata | None:
            if _satisfied(current, operator, partitions):
                return None
            if operator in current.operators and partitions is not None:
                self._check_in_use(operator, partitions)
            return current.with_operator(operator, partitions)

        return self._update(change)

    def _check_in_use(self, operator: str, partitions: int) -> None:
        """Refuse to record ``partitions`` for an operator that already has stores beyond it
        (they were committed while its count was unset, and could never be opened again).

        Raises:
            ConfigMismatchError: a partition ``>= partitions`` holds blobs.
        """
        in_use = {
            store[1]
            for meta in self._blobs.list(layout.operator_prefix(operator))
            if (store := layout.parse_store_key(meta.key)) is not None and store[0] == operator
        }
        beyond = sorted(p for p in in_use if p >= partitions)
        if beyond:
            raise ConfigMismatchError(
                f"operator {operator!r} cannot have {partitions} partitions in this checkpoint "
                f"root: partitions {beyond} already hold state (recorded while its partition "
                f"count was unset); ask for at least {beyond[-1] + 1} partitions"
            )

    def upgrade(self) -> RootMetadata:
        """Record format version 2 in a format-1 root (idempotent): from then on a 0.1
        library refuses the root instead of committing in a format no manifest names.

        Raises:
            StorageError: the root cannot be read or written.
        """
        cached = self._cached
        if cached is not None and cached.format_version >= FORMAT_VERSION:
            return cached

        def change(current: RootMetadata) -> RootMetadata | None:
            if current.format_version >= FORMAT_VERSION:
                return None
            return dataclasses.replace(current, format_version=FORMAT_VERSION)

        return self._update(change)

    def start_generation(self, operator: str, retention: Retention | None = None) -> int:
        """Bump ``operator``'s run generation by compare-and-swap and return the new one;
        record ``retention`` (if given) as the operator's, and as the root's last one.

        Raises:
            StorageError: the root cannot be read or written.
        """
        bumped: list[int] = []

        def change(current: RootMetadata) -> RootMetadata | None:
            generations = dict(current.generations)
            generations[operator] = generations.get(operator, 0) + 1
            bumped[:] = [generations[operator]]
            retentions = dict(current.retentions)
            if retention is not None:
                retentions[operator] = retention
            return dataclasses.replace(
                current.with_operator(operator, None),
                format_version=max(current.format_version, FORMAT_VERSION),
                generations=generations,
                retention=retention if retention is not None else current.retention,
                retentions=retentions,
            )  # fmt: skip

        self._update(change)
        return bumped[0]

    def rescale(
        self,
        operator: str,
        *,
        partitions: int,
        source: str,
        source_partitions: int,
        source_generation: int,
        version: int,
        attempt: str,
    ) -> Rescale:
        """The commit point of a rescale, by compare-and-swap: ``operator`` gets
        ``partitions`` partitions (and, for a new operator, ``source``'s key groups), its
        next run generation and a pending :class:`Rescale`; the root is written in format
        :data:`RESCALED_FORMAT_VERSION`.

        Raises:
            CommitConflictError: ``source`` no longer has ``source_partitions`` partitions
                and run generation ``source_generation`` (a query started on it, or another
                rescale won), or ``operator`` is new and the root records it meanwhile.
            StorageError: the root cannot be read or written.
        """
        done: list[Rescale] = []

        def change(current: RootMetadata) -> RootMetadata | None:
            found = (current.operators.get(source), current.generations.get(source, 0))
            if found != (source_partitions, source_generation):
                raise CommitConflictError(
                    f"operator {source!r} changed while it was being rescaled: it had "
                    f"{source_partitions} partitions and run generation {source_generation}, "
                    f"now {found[0]} and {found[1]} (a query started on it, or another "
                    "rescale finished first); nothing was changed, run the rescale again"
                )
            if operator != source and operator in current.operators:
                raise CommitConflictError(
                    f"operator {operator!r} was registered in the root meanwhile: rescale into "
                    "an operator name the root does not hold"
                )
            generation = current.generations.get(operator, 0) + 1
            rescale = Rescale(
                generation,
                version,
                attempt,
                source,
                source_partitions,
                int(time.time() * 1000),
                fenced=source_generation > 0,
            )
            done[:] = [rescale]
            return dataclasses.replace(
                current,
                format_version=max(current.format_version, RESCALED_FORMAT_VERSION),
                operators={**current.operators, operator: partitions},
                generations={**current.generations, operator: generation},
                key_groups={**current.key_groups, operator: current.key_groups[source]},
                rescales={**current.rescales, operator: rescale},
            )

        self._update(change)
        return done[0]

    def finish_rescale(self, operator: str, generation: int) -> RootMetadata:
        """Record that every store of ``operator``'s rescale of run ``generation`` is
        written (idempotent; nothing changes if a later rescale replaced it).

        Raises:
            StorageError: the root cannot be read or written.
        """

        def change(current: RootMetadata) -> RootMetadata | None:
            rescale = current.rescales.get(operator)
            if rescale is None or rescale.generation != generation or not rescale.pending:
                return None
            done = dataclasses.replace(rescale, pending=False)
            return dataclasses.replace(current, rescales={**current.rescales, operator: done})

        return self._update(change)

    def _update(self, change: Callable[[RootMetadata], RootMetadata | None]) -> RootMetadata:
        """Apply ``change`` by compare-and-swap (``None``: nothing to change).

        Raises:
            CommitConflictError: the document kept changing under every attempt.
            StorageError: the root cannot be read or written.
        """
        with self._lock:
            for _ in range(_CAS_ATTEMPTS):
                meta = self._try_update(change)
                if meta is not None:
                    self._cached = meta
                    return meta
                time.sleep(0.01)
            raise CommitConflictError(
                f"could not update {self._describe()}: it kept changing under "
                f"{_CAS_ATTEMPTS} attempts"
            )

    def _try_update(
        self, change: Callable[[RootMetadata], RootMetadata | None]
    ) -> RootMetadata | None:
        try:
            etag: str | None = self._blobs.head(layout.ROOT_METADATA).etag
            current: RootMetadata | None = RootMetadata.from_json(
                self._blobs.get(layout.ROOT_METADATA), blob=self._describe()
            )
        except StateNotFoundError:
            etag, current = None, None
        fresh = current is None
        if current is None:
            missing = self.missing_metadata()
            if missing is not None:
                raise CorruptStateError(missing)
            current = RootMetadata(FORMAT_VERSION, uuid.uuid4().hex, int(time.time() * 1000))
        updated = change(current)
        if updated is None:
            if not fresh:
                return current
            updated = current
        try:
            if etag is None:
                self._blobs.put(layout.ROOT_METADATA, updated.to_json())
            else:
                self._blobs.put(layout.ROOT_METADATA, updated.to_json(), if_match=etag)
        except (CommitConflictError, StateNotFoundError):
            return None  # somebody else changed it: read again and retry
        return updated

    def missing_metadata(self) -> str | None:
        """What is wrong if the root holds state but no root metadata (``None`` if it holds
        none: a new root). Starting such a root afresh would give it a new root id, and
        every store manifest, naming the old one, would be refused from then on.

        Raises:
            StorageError: the root cannot be listed.
        """
        state = [m.key for m in self._blobs.list() if layout.parse_store_key(m.key) is not None]
        if not state:
            return None
        root_id = "unknown"
        for key in state:
            if layout.parse_manifest_key(key) is not None:
                with contextlib.suppress(StateKeeperError, ValueError, AttributeError):
                    root_id = str(json.loads(self._blobs.get(key)).get("rootId"))
                break
        return (
            f"root metadata {self._describe()} is missing, but the root holds state "
            f"({len(state)} store blobs, for example {state[0]}): it was deleted, or the root "
            f"was copied without it. Restore {layout.ROOT_METADATA} from a backup or a copy "
            f"of the root (its rootId is {root_id}); statekeeper does not start a root that "
            "holds state afresh, since a new root id would make every store unreadable"
        )

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
