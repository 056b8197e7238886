"""Blob storage: the :class:`BlobStore` contract, its backends, and retries.

``open_blob_store`` picks the backend from a checkpoint root URI: a plain path or
``file://`` URI gives a :class:`LocalBlobStore`; ``s3://`` (also ``s3a://``), ``gs://``,
``az://``, ``abfs://`` and ``abfss://`` give an :class:`ObjectBlobStore`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from urllib.parse import unquote, urlsplit

from statekeeper.storage._checks import check_storage_options
from statekeeper.storage._local import LocalBlobStore
from statekeeper.storage._object import OBJECT_SCHEMES, ObjectBlobStore
from statekeeper.storage._parallel import thread_pool, transfer_pool
from statekeeper.storage._protocol import BlobMeta, BlobStore, StreamingBlobStore
from statekeeper.storage._retry import RetryPolicy

__all__ = [
    "BlobMeta",
    "BlobStore",
    "LocalBlobStore",
    "ObjectBlobStore",
    "RetryPolicy",
    "StreamingBlobStore",
    "local_root",
    "open_blob_store",
    "put_stream",
    "thread_pool",
    "transfer_pool",
]

_SUPPORTED = "a local path, file://, " + ", ".join(f"{scheme}://" for scheme in OBJECT_SCHEMES)


def open_blob_store(
    uri: str,
    storage_options: Mapping[str, str] | None = None,
    *,
    io_threads: int = 8,
    retry: RetryPolicy | None = None,
) -> BlobStore:
    """Open the blob store of a checkpoint root.

    Args:
        uri: a local path (relative paths are made absolute), a ``file://`` URI, or an
            object store URI such as ``s3://bucket/prefix``.
        storage_options: object store options, a mapping of name to str (ints and bools are
            taken as their string form; see :class:`ObjectBlobStore`); must be empty for a
            local root.
        io_threads: parallel transfers of ``put_many``/``get_many``.
        retry: retry policy; ``RetryPolicy()`` if ``None``.

    Returns:
        A :class:`LocalBlobStore` (its folder created if missing) or an
        :class:`ObjectBlobStore`.

    Raises:
        ValueError: ``uri`` is not a non-empty str, has an unsupported scheme, is a
            ``file://`` URI naming another host, or ``storage_options`` are invalid (or
            given for a local root).
        StorageError: a local root exists and is not a folder, or cannot be created.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(f"checkpoint root must be a non-empty str: {_SUPPORTED}; got {uri!r}")
    options = check_storage_options(storage_options)
    scheme, sep, _ = uri.partition("://")
    scheme = scheme.lower()
    if sep and scheme in OBJECT_SCHEMES:
        return ObjectBlobStore(uri, options, io_threads=io_threads, retry=retry)
    if sep and scheme != "file":
        raise ValueError(f"unsupported checkpoint root scheme {scheme + '://'!r}; use {_SUPPORTED}")
    if options:
        raise ValueError(
            f"storage_options are not supported for a local checkpoint root; got {sorted(options)}"
        )
    path = _file_uri_path(uri) if sep else uri
    return LocalBlobStore(os.path.abspath(path), io_threads=io_threads, retry=retry)


def local_root(uri: str) -> str | None:
    """The folder of a local root (a path, or the path of a ``file://`` URI); ``None`` for
    any other scheme.

    Raises:
        ValueError: a ``file://`` URI naming another host, or not an absolute path.
    """
    scheme, sep, _ = uri.partition("://")
    if not sep:
        return uri
    return _file_uri_path(uri) if scheme.lower() == "file" else None


def put_stream(blobs: BlobStore, key: str, chunks: Callable[[], Iterable[bytes]]) -> int:
    """Write the concatenation of ``chunks()`` at ``key``; returns the bytes written.

    A :class:`StreamingBlobStore` (both backends) holds one chunk in memory at a time; any
    other store (a wrapper that only forwards ``put``) gets one create-only ``put`` of the
    joined chunks, so it still sees the write.

    Raises:
        As :meth:`StreamingBlobStore.put_stream`.
    """
    if isinstance(blobs, StreamingBlobStore):
        return blobs.put_stream(key, chunks)
    data = b"".join(chunks())
    blobs.put(key, data)
    return len(data)


def _file_uri_path(uri: str) -> str:
    parts = urlsplit(uri)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(
            f"file:// URIs must name a local path (file:///path), got host {parts.netloc!r}"
        )
    if parts.query or parts.fragment or not parts.path:
        raise ValueError(f"file:// URI must be file:///absolute/path, got {uri!r}")
    return unquote(parts.path)
