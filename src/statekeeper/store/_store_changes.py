"""The change feed of one store: every put and delete that turns one version into another.

The versions are read as :meth:`StoreHistory.change_stretches` lays them out:

* **From the changelogs**, for versions whose changelog the store's history names: the blob
  of the attempt the newest manifest records for each version, checked by its identity
  (root, store, version, attempt) as a restore checks it, so a re-run's losing attempt or a
  stray blob is never read. Changelogs are fetched in parallel windows on the blob store's
  I/O threads and read a part at a time; records come out in commit order, one
  :class:`StoreChange` each (a key may repeat within a version, the last record wins).
* **From two restored versions**, for a run of versions without changelogs (collected by GC
  before a snapshot, or committed as snapshots in ``mode="snapshot"``): both ends are
  exported into temporary RocksDB directories (never the backend's own working copies) and
  merge-scanned in key order; the difference comes out as puts and deletes all labelled with
  the run's last version. Only the net change of the run is known there.

Applying a feed of ``a .. b`` in order to the items of version ``a`` gives exactly the items
of version ``b`` (``tests/test_changes.py`` holds this over random histories).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import rocksdict

from statekeeper.history import ChangeStretch, StoreHistory
from statekeeper.store._backend import StateBackend
from statekeeper.store._changelogs import changelog_parts, prefix_length, read_prefixes
from statekeeper.store._rocks import checked_items

__all__ = ["StoreChange", "StoreChanges", "diff_items"]


@dataclass(frozen=True, slots=True)
class StoreChange:
    """One put (``value`` is bytes) or delete (``value`` is ``None``) of a store key, made
    by the commit of ``version``."""

    version: int
    key: bytes
    value: bytes | None


class StoreChanges:
    """The changes that turn version ``from_version`` of a store into ``to_version``
    (versions ``from_version + 1 .. to_version``), iterated lazily, in version order.

    Built by :meth:`open`, which checks that both versions exist; iterating reads the blobs.
    """

    def __init__(
        self,
        backend: StateBackend,
        history: StoreHistory,
        *,
        root_id: str,
        from_version: int,
        to_version: int,
    ) -> None:
        """Use :meth:`open`; ``history`` must be the store's, read from ``backend``."""
        self._backend = backend
        self._history = history
        self._root_id = root_id
        self.operator = history.operator
        self.partition = history.partition
        self.from_version = from_version
        self.to_version = to_version
        self.stretches: tuple[ChangeStretch, ...] = history.change_stretches(
            from_version, to_version
        )
        """How the versions are read: runs of changelogs and restored differences."""

    @classmethod
    def open(
        cls,
        backend: StateBackend,
        operator: str,
        partition: int,
        *,
        from_version: int,
        to_version: int,
    ) -> StoreChanges:
        """The change feed of store (``operator``, ``partition``) from ``from_version`` to
        ``to_version``, as the store's newest manifest lays it out now.

        Raises:
            ValueError: ``from_version`` is after ``to_version``.
            StateNotFoundError: the root records no operators, or a version needed is not
                restorable (the message names the restorable versions).
            CorruptStateError: no manifest of the store is readable.
            StorageError: the root cannot be read.
        """
        meta = backend.root_metadata()
        root_id = "" if meta is None else meta.root_id
        history = StoreHistory.load(backend.blobs, operator, partition, root_id=root_id)
        return cls(
            backend, history, root_id=root_id, from_version=from_version, to_version=to_version
        )

    @property
    def restores(self) -> bool:
        """True if some versions are read as the difference of two restored versions."""
        return any(not s.from_changelogs for s in self.stretches)

    def changelog_keys(self) -> list[str]:
        """The changelog blobs the feed reads, in version order."""
        return [
            self._history.changelog_key(v)
            for s in self.stretches
            if s.from_changelogs
            for v in range(s.start + 1, s.end + 1)
        ]

    def __iter__(self) -> Iterator[StoreChange]:
        """Every change, in version order.

        Raises:
            StateNotFoundError: a changelog or snapshot blob is missing.
            CorruptStateError: a blob fails its checks, or belongs to another attempt.
            StorageError: the blob store failed.
        """
        for stretch in self.stretches:
            if stretch.from_changelogs:
                yield from self._logged(stretch)
            else:
                yield from self._restored(stretch)

    def _logged(self, stretch: ChangeStretch) -> Iterator[StoreChange]:
        blobs, config, history = self._backend.blobs, self._backend.config, self._history
        window = max(1, config.io_threads * 2)
        length = prefix_length(config)
        versions = list(range(stretch.start + 1, stretch.end + 1))
        for first in range(0, len(versions), window):
            batch = versions[first : first + window]
            keys = [history.changelog_key(v) for v in batch]
            for v, key, data in zip(batch, keys, read_prefixes(blobs, keys, length), strict=True):
                identity, legacy = history.changelog_identity(v, self._root_id)
                parts = changelog_parts(
                    blobs, key, first=data, length=length, expected=(v, identity),
                    anonymous_ok=legacy,
                )  # fmt: skip
                for part in parts:
                    for k, value in part.records:
                        yield StoreChange(v, k, value)

    def _restored(self, stretch: ChangeStretch) -> Iterator[StoreChange]:
        local = self._backend.config.local_dir
        if local is not None:
            os.makedirs(local, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="statekeeper-diff-", dir=local) as tmp:
            before, after = Path(tmp, "from"), Path(tmp, "to")
            for version, target in ((stretch.start, before), (stretch.end, after)):
                self._backend.export(self.operator, self.partition, target, version=version)
            with _read_only(before) as old, _read_only(after) as new:
                for key, value in diff_items(checked_items(old), checked_items(new)):
                    yield StoreChange(stretch.end, key, value)


class _read_only:
    """A RocksDB directory opened read-only, closed on exit."""

    def __init__(self, path: Path) -> None:
        self._db = rocksdict.Rdict(
            str(path),
            rocksdict.Options(raw_mode=True),
            access_type=rocksdict.AccessType.read_only(),
        )

    def __enter__(self) -> rocksdict.Rdict:
        return self._db

    def __exit__(self, *exc: object) -> None:
        self._db.close()


def diff_items(
    before: Iterable[tuple[bytes, bytes]], after: Iterable[tuple[bytes, bytes]]
) -> Iterator[tuple[bytes, bytes | None]]:
    """The puts and deletes (value ``None``) that turn the items ``before`` into ``after``;
    both sorted by key, as a scan returns them. One pass over each, nothing held."""
    old, new = iter(before), iter(after)
    a, b = next(old, None), next(new, None)
    while a is not None or b is not None:
        if b is None or (a is not None and a[0] < b[0]):
            assert a is not None
            yield a[0], None
            a = next(old, None)
        elif a is None or b[0] < a[0]:
            yield b
            b = next(new, None)
        else:
            if a[1] != b[1]:
                yield b
            a, b = next(old, None), next(new, None)
