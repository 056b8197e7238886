"""Opening a checkpoint root for a command, read-only, and resolving what the user named.

Commands never touch a pipeline's local working copies: every backend they open keeps its
working copies in a temporary folder removed when the command ends. Nothing here writes to
the blob store; a root, operator, partition or version that does not exist is a usage error
(exit 2), checked before the library is asked for it, so that asking never registers an
operator or creates a folder.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, TypeVar, cast

import click

from statekeeper import layout
from statekeeper.cli._app import UsageFailure
from statekeeper.config import StoreConfig
from statekeeper.epochs import consistent_cut
from statekeeper.errors import StateNotFoundError, StorageError, TransientStorageError
from statekeeper.history import RootListing
from statekeeper.storage import BlobStore, local_root, open_blob_store
from statekeeper.store import RootMetadata, StateBackend

__all__ = [
    "MeteredBlobStore",
    "Root",
    "open_root",
    "parse_storage_options",
    "root_arguments",
]

_F = TypeVar("_F", bound=Callable[..., Any])


def parse_storage_options(
    _ctx: click.Context, _param: click.Parameter, values: Sequence[str]
) -> dict[str, str]:
    """Click callback: repeated ``KEY=VALUE`` values as a dict (a key given twice is refused)."""
    options: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}")
        if key in options:
            raise click.BadParameter(f"{key!r} is given twice")
        options[key] = value
    return options


def root_arguments(f: _F) -> _F:
    """Add the ``ROOT`` argument and the repeatable ``--storage-option KEY=VALUE``."""
    f = click.option(
        "--storage-option",
        "-o",
        "storage_options",
        multiple=True,
        metavar="KEY=VALUE",
        callback=parse_storage_options,
        help="Object store option (endpoint, region, access_key_id, allow_http, ...); repeatable.",
    )(f)
    return click.argument("root")(f)


class MeteredBlobStore:
    """Wraps a :class:`BlobStore` and reports the bytes its reads return, for progress bars.

    Reads (``get``, ``get_range``, ``get_many``) are counted; every other member is the
    wrapped store's own, looked up on use, so the wrapper keeps up with the protocol as it
    grows. :attr:`store` is this wrapper typed as a ``BlobStore``; :attr:`on_read` is called
    from the I/O threads with the size of each blob (or range) read.
    """

    def __init__(self, inner: BlobStore) -> None:
        self._inner = inner
        self.on_read: Callable[[int], None] | None = None

    @property
    def store(self) -> BlobStore:
        """This wrapper, as the blob store the library is given."""
        return cast(BlobStore, self)

    def __getattr__(self, name: str) -> Any:
        # Only called for what this class does not define: delegate it.
        return getattr(self._inner, name)

    def _count(self, n: int) -> None:
        callback = self.on_read
        if callback is not None:
            callback(n)

    def get(self, key: str) -> bytes:
        """As :meth:`BlobStore.get`, counting the bytes read."""
        data = self._inner.get(key)
        self._count(len(data))
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """As :meth:`BlobStore.get_range`, counting the bytes read."""
        data = self._inner.get_range(key, start, length)
        self._count(len(data))
        return data

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        """As :meth:`BlobStore.get_many`, counting the bytes read."""
        out = self._inner.get_many(keys)
        self._count(sum(len(d) for d in out))
        return out


@dataclass
class Root:
    """An open checkpoint root: its backend, its blob store (metered) and its metadata."""

    backend: StateBackend
    metered: MeteredBlobStore
    meta: RootMetadata

    @property
    def blobs(self) -> BlobStore:
        """The root's blob store; its reads feed :attr:`metered`."""
        return self.metered.store

    @property
    def uri(self) -> str:
        """The root URI, without credentials."""
        return self.blobs.uri

    @cached_property
    def listing(self) -> RootListing:
        """One listing of the whole root (made on first use)."""
        return RootListing.of(self.blobs, root_id=self.meta.root_id)

    def require_operator(self, operator: str) -> None:
        """Raise a usage error unless the root records ``operator``."""
        if operator not in self.meta.operators:
            known = ", ".join(sorted(self.meta.operators)) or "none"
            raise UsageFailure(
                f"operator {operator!r} does not exist in {self.uri}: operators are {known}"
            )

    def partitions(self, operator: str) -> list[int]:
        """The partitions of an operator: ``0..P-1`` when P is recorded, else those in use."""
        count = self.meta.operators.get(operator)
        used = self.listing.partitions(operator)
        if count is None:
            return used
        return sorted(set(range(count)) | set(used))

    def require_partition(self, operator: str, partition: int) -> None:
        """Raise a usage error unless ``partition`` is a partition of ``operator``."""
        self.require_operator(operator)
        count = self.meta.operators.get(operator)
        if count is not None and partition < count:
            return
        if count is None and self.listing.metas(operator, partition):
            return
        known = (
            f"0..{count - 1}"
            if count is not None
            else ", ".join(map(str, self.partitions(operator))) or "none"
        )
        raise UsageFailure(
            f"partition {partition} of operator {operator!r} does not exist in {self.uri}: "
            f"partitions are {known}"
        )

    def require_version(self, operator: str, partition: int, version: int | None) -> int:
        """The version to open; a usage error if it is not restorable.

        ``None`` means the partition's version in the consistent cut, as ``read_state``
        reads it (:func:`statekeeper.epochs.consistent_cut`): the one the newest epoch
        manifest naming the operator records, else (no manifest, or that version is no
        longer restorable; logged) the newest.
        """
        history = self.listing.history(operator, partition)
        try:
            wanted = self._default_version(operator, partition) if version is None else version
            history.plan(wanted, None)
        except StateNotFoundError as exc:
            raise UsageFailure(str(exc)) from exc
        return wanted

    def _default_version(self, operator: str, partition: int) -> int:
        count = self.meta.operators.get(operator)
        if count is None:  # never stated: as many as the listing shows
            count = max([partition, *self.partitions(operator)]) + 1
        cut = consistent_cut(
            self.blobs, operator, count, functools.partial(self.listing.history, operator),
            only=[partition],
        )  # fmt: skip
        if cut.manifest is None:
            return self.listing.history(operator, partition).latest()
        return cut.versions[partition]


def open_root(
    ctx: click.Context,
    root: str,
    storage_options: dict[str, str],
    **config: Any,
) -> Root:
    """Open an existing checkpoint root for the duration of the command.

    Args:
        ctx: the command's context; the backend and its temporary folder are released
            when it closes.
        root: the root as the user typed it.
        storage_options: parsed ``--storage-option`` values.
        **config: :class:`StoreConfig` fields (``local_dir`` is always a temp folder).

    Raises:
        UsageFailure: the root does not exist (a missing bucket too), cannot be read with
            the credentials given, is not a statekeeper root, or its URI or a storage option
            is not understood.
        StateKeeperError: the root cannot be read.
    """
    workdir = ctx.with_resource(tempfile.TemporaryDirectory(prefix="statekeeper-cli-"))
    try:
        local = local_root(root)
        if local is not None and not os.path.isdir(local):
            what = "is a file, not a folder" if os.path.exists(local) else "does not exist"
            raise UsageFailure(f"checkpoint root {local} {what}")
        store_config = StoreConfig(local_dir=workdir, **config)
        inner = open_blob_store(root, storage_options or None, io_threads=store_config.io_threads)
    except (TypeError, ValueError) as exc:
        raise UsageFailure(f"cannot open checkpoint root: {exc}") from exc
    metered = MeteredBlobStore(inner)
    try:
        try:
            backend = StateBackend(metered.store, config=store_config)  # reads the root
        except TransientStorageError:
            raise
        except StorageError as exc:  # a missing bucket, denied access: the URI is wrong
            raise UsageFailure(f"cannot open checkpoint root {inner.uri}: {exc}") from exc
        except ValueError as exc:  # the temporary folder lies inside a local root
            raise UsageFailure(
                f"cannot open checkpoint root {inner.uri}: {exc}. The command keeps its "
                f"working copies under the temporary folder {tempfile.gettempdir()}: set "
                "TMPDIR to a folder outside the root"
            ) from exc
    except BaseException:
        inner.close()
        raise
    ctx.with_resource(backend)
    meta = backend.root_metadata()
    if meta is None:
        raise UsageFailure(
            f"{inner.uri} is not a statekeeper checkpoint root: it holds no {layout.ROOT_METADATA}"
        )
    return Root(backend, metered, meta)
