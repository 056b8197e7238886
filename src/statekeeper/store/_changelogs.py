"""Reading changelog blobs from the blob store a part at a time.

A changelog of one commit may be larger than memory allows (format 3 writes it as parts:
:mod:`statekeeper.changelog`). Readers here never fetch one whole: they read a prefix of
``StoreConfig.changelog_part_bytes`` plus a header (all of nearly every changelog, in one
request as a whole ``get`` would), then any further part by a ranged read, and let go of
each part before reading the next. A replayed version of several parts is applied a part at
a time, its label marked dirty until the last part, so a crash half way leaves a copy no
open trusts (invariant 3) rather than a mix of two versions labelled as one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from statekeeper.changelog import MAX_HEADER_SIZE, ChangelogIdentity, ChangelogPart, read_changelog
from statekeeper.config import StoreConfig
from statekeeper.storage import BlobStore
from statekeeper.store._working_copy import WorkingCopy

__all__ = ["changelog_parts", "prefix_length", "read_prefixes", "replay_changelog"]


def prefix_length(config: StoreConfig) -> int:
    """How much of a changelog the first read takes: a whole part and its header."""
    return config.changelog_part_bytes + MAX_HEADER_SIZE


def read_prefixes(blobs: BlobStore, keys: Sequence[str], length: int) -> list[bytes]:
    """The first ``length`` bytes of each blob (all of a shorter one), in ``keys`` order;
    in parallel on the store's I/O threads where it has them.

    Raises:
        StateNotFoundError: a blob is missing (the first in ``keys`` order).
        StorageError: a read failed.
    """
    get_prefixes = getattr(blobs, "get_prefixes", None)  # the backends' parallel reads
    if get_prefixes is not None:
        return list(get_prefixes(keys, length))
    return [blobs.get_range(key, 0, length) for key in keys]


def changelog_parts(
    blobs: BlobStore,
    key: str,
    *,
    first: bytes,
    length: int,
    expected: tuple[int, ChangelogIdentity] | None = None,
    anonymous_ok: bool = False,
) -> Iterator[ChangelogPart]:
    """The verified parts of changelog ``key``, whose first ``length`` bytes (or all, if
    fewer) are ``first``; later parts are read as they are asked for.

    Raises:
        CorruptStateError: a part fails its checks (see :func:`read_changelog`).
        StateNotFoundError, StorageError: a ranged read failed.
    """
    return read_changelog(
        lambda start, size: blobs.get_range(key, start, size),
        blob=key, expected=expected, anonymous_ok=anonymous_ok, first=first,
        complete=len(first) < length,
    )  # fmt: skip


def replay_changelog(
    copy: WorkingCopy,
    parts: Iterator[ChangelogPart],
    *,
    version: int,
    root_id: str,
    attempt: str,
) -> int:
    """Apply the parts of the changelog of ``version`` to ``copy``, one write per part, the
    copy marked dirty until the last part is applied; returns the bytes read.

    Raises:
        CorruptStateError: a part fails its checks (the copy is then dirty: not reused).
        StateKeeperError: a local write failed.
    """
    read = 0
    for part in parts:
        read += part.length
        copy.apply(
            part.records, version=version, root_id=root_id, attempt=attempt, dirty=not part.last
        )
    return read
