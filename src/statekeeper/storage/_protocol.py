"""The BlobStore contract: a small synchronous interface every backend implements.

Keys are ``/``-separated paths relative to the checkpoint root (see ``layout.py``): no empty
segment, no segment starting with ``.`` (so no ``.`` or ``..``; backends keep their temp and
lock files there), no leading ``/``, no backslash. Every method raises only
:mod:`statekeeper.errors` types, plus ``ValueError``/``TypeError`` for invalid arguments;
backends translate their own errors once.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["BlobMeta", "BlobStore", "StreamingBlobStore"]


@dataclass(frozen=True, slots=True)
class BlobMeta:
    """What a listing or ``head`` knows of one blob."""

    key: str
    size: int
    last_modified: float
    """Seconds since the epoch (UTC) of the last write."""
    etag: str | None
    """Opaque version tag usable with ``put(..., if_match=...)``; ``None`` if unsupported."""


@runtime_checkable
class BlobStore(Protocol):
    """A flat namespace of immutable-by-default blobs under one checkpoint root.

    Writes are atomic: a reader sees either no blob or the complete blob, never a prefix.
    """

    @property
    def uri(self) -> str:
        """The root URI, without credentials; safe to log."""
        ...

    def put(
        self, key: str, data: bytes, *, overwrite: bool = False, if_match: str | None = None
    ) -> None:
        """Write ``data`` at ``key`` atomically.

        By default the write is create-only. ``overwrite=True`` replaces an existing blob;
        ``if_match`` replaces it only if its current etag equals ``if_match`` (it takes
        precedence over ``overwrite``).

        Raises:
            ValueError: invalid key.
            CommitConflictError: create-only and the key exists, or ``if_match`` does not match.
            StorageError: the backend refused the write (``TransientStorageError`` if retryable).
        """
        ...

    def get(self, key: str) -> bytes:
        """Read a whole blob.

        Raises:
            StateNotFoundError: no blob at ``key``.
            StorageError: the backend failed the read.
        """
        ...

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Read ``length`` bytes from ``start`` (fewer if the blob ends first).

        Raises:
            StateNotFoundError: no blob at ``key``.
            ValueError: ``start`` or ``length`` negative.
            StorageError: the backend failed the read.
        """
        ...

    def head(self, key: str) -> BlobMeta:
        """Metadata of one blob.

        Raises:
            StateNotFoundError: no blob at ``key``.
            StorageError: the backend failed the request.
        """
        ...

    def list(self, prefix: str = "") -> list[BlobMeta]:
        """Every blob whose key starts with ``prefix``, sorted by key (recursive).

        ``prefix`` is a plain string prefix: ``"a/b"`` matches ``"a/b/c"`` and ``"a/bc"``.
        Only valid keys are listed: what other tools left under the root (``.DS_Store``, a
        name with a segment starting with ``.``) is not.

        Raises:
            ValueError: the folder part of ``prefix`` is not a valid key.
            StorageError: the backend failed the listing.
        """
        ...

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete blobs; keys that do not exist are ignored.

        Raises:
            StorageError: the backend failed a delete.
        """
        ...

    def put_many(self, items: Sequence[tuple[str, bytes]], *, overwrite: bool = False) -> None:
        """``put`` every item, in parallel on the store's I/O threads.

        All transfers are attempted; the first error (in item order) is raised afterwards.

        Raises:
            CommitConflictError, StorageError: as ``put``.
        """
        ...

    # builtins.list: inside this class body, plain ``list`` names the method above.
    def get_many(self, keys: Sequence[str]) -> builtins.list[bytes]:
        """``get`` every key in parallel; results are in the order of ``keys``.

        Raises:
            StateNotFoundError, StorageError: as ``get``.
        """
        ...

    def sweep_incomplete(self, older_than_s: float, *, dry_run: bool = False) -> int:
        """Remove leftovers of writes that died half way, once older than ``older_than_s``.

        Returns how many were (or, with ``dry_run``, would be) removed. Backends whose
        writes leave nothing behind when interrupted return 0.

        Raises:
            StorageError: the backend failed the cleanup.
        """
        ...

    def close(self) -> None:
        """Release threads and connections. Idempotent."""
        ...


@runtime_checkable
class StreamingBlobStore(Protocol):
    """A blob store that can write a blob of any size from chunks, holding one at a time.

    Both backends are; :func:`statekeeper.storage.put_stream` writes through any store
    (one joined ``put`` for one that is not).
    """

    def put_stream(self, key: str, chunks: Callable[[], Iterable[bytes]]) -> int:
        """Write the concatenation of ``chunks()`` at ``key`` atomically; returns its size.

        ``chunks`` is called again for a retry, and must then yield the same bytes. Local
        stores write create-only; object stores upload the parts of a multipart upload,
        which cannot be conditional: an existing blob is replaced (see
        :meth:`statekeeper.storage.ObjectBlobStore.put_stream`).

        Raises:
            ValueError: invalid key.
            TypeError: a chunk is not bytes-like.
            CommitConflictError: create-only and the key exists.
            StorageError: the backend refused the write (``TransientStorageError`` if
                retries ran out).
        """
        ...
