"""What a snapshot index says it is: its store and version and (schema 2) its root and
attempt, and the check every reader makes of it against what it expected under the index's
name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from statekeeper import layout
from statekeeper.errors import CorruptStateError

if TYPE_CHECKING:
    from statekeeper.snapshot._index import SnapshotIndex

__all__ = ["SnapshotMetadata", "check_metadata"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotMetadata:
    """Which store and version a snapshot is of, and (schema 2) which root and attempt.

    Attributes:
        operator, partition, version: the store and the version the snapshot holds.
        root_id: the checkpoint root's id; ``None`` in a schema-1 index (statekeeper 0.1).
        attempt: the attempt whose content the version is (the manifest's entry for it);
            ``None`` in a schema-1 index.

    Raises:
        TypeError, ValueError: as :func:`layout.validate_operator` and friends; a root id
            that is not a non-empty str of at most 255 characters; only one of ``root_id``
            and ``attempt`` given.
    """

    operator: str
    partition: int
    version: int
    root_id: str | None = None
    attempt: str | None = None

    def __post_init__(self) -> None:
        layout.validate_operator(self.operator)
        layout.validate_partition(self.partition)
        layout.validate_version(self.version)
        if (self.root_id is None) != (self.attempt is None):
            raise ValueError(
                "expected rootId and attempt together (or neither, schema 1), found "
                f"rootId {self.root_id!r} and attempt {self.attempt!r}"
            )
        if self.root_id is not None:
            if not isinstance(self.root_id, str) or not 1 <= len(self.root_id) <= 255:
                raise ValueError(f"expected rootId to be 1-255 characters, found {self.root_id!r}")
            layout.validate_attempt(self.attempt)

    def describe(self) -> str:
        """``root R, store op/0, version 4, attempt A``: for error messages."""
        store = f"store {self.operator}/{self.partition}, version {self.version}"
        if self.root_id is None:
            return store
        return f"root {self.root_id}, {store}, attempt {self.attempt}"


def check_metadata(
    index: SnapshotIndex, *, blob: str, expected: SnapshotMetadata, anonymous_ok: bool
) -> None:
    """Check that the index read under ``blob`` is the snapshot the reader expected there.

    A schema-1 index names no root or attempt: it is accepted where the reader expects one
    of statekeeper 0.1 (``anonymous_ok``) if its store and version match; fields of
    ``expected`` that are ``None`` are not checked.

    Raises:
        CorruptStateError: the index is of another root, store, version or attempt (or has
            no identity where one is required), naming what was expected and what it says.
    """
    found = index.metadata
    same_store = (found.operator, found.partition, found.version) == (
        expected.operator, expected.partition, expected.version,
    )  # fmt: skip
    if found.root_id is None:
        ok = same_store and (anonymous_ok or expected.root_id is None)
    else:
        ok = (
            same_store
            and expected.root_id in (None, found.root_id)
            and expected.attempt in (None, found.attempt)
        )
    if not ok:
        raise CorruptStateError(
            f"snapshot index {blob!r} does not belong where it is stored: expected "
            f"{expected.describe()}, found {found.describe()}"
            + (" (schema 1: no root id or attempt)" if found.root_id is None else "")
        )
