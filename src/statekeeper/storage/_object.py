"""ObjectBlobStore: S3, GCS and Azure Blob Storage through obstore.

obstore errors are translated in exactly one place (:meth:`ObjectBlobStore._translate`).
obstore's own retries are switched off: :class:`~statekeeper.storage.RetryPolicy` retries, so
attempts are not multiplied, every retry is logged, and a create-only put whose reply was lost
is not mistaken for a conflict (``_retry.py`` says why obstore's cannot do that).

The three stores differ in how a conditional write is expressed; obstore hides most of it:
create-only is ``If-None-Match: *`` on S3 and Azure and ``x-goog-if-generation-match: 0`` on
GCS; ``if_match`` is ``If-Match: <etag>`` on S3 and Azure, while GCS conditions on the object's
generation (see :meth:`ObjectBlobStore._generation_of`). Etags are kept in their quoted form,
so that a listing and a ``head`` of the same version agree.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import parse_qsl, urlsplit

import obstore
from obstore.exceptions import (
    AlreadyExistsError,
    BaseError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
    UnknownConfigurationKeyError,
)
from obstore.store import from_url

from statekeeper.errors import (
    CommitConflictError,
    StateKeeperError,
    StateNotFoundError,
    StorageError,
    TransientStorageError,
)
from statekeeper.storage._checks import (
    check_plain_http,
    check_storage_options,
    is_secret_option,
    split_client_options,
    unknown_option_message,
    unparsable_option_message,
    url_password,
)
from statekeeper.storage._parallel import (
    ParallelTransfers,
    check_data,
    check_key,
    check_prefix,
    check_range,
    is_key,
)
from statekeeper.storage._protocol import BlobMeta
from statekeeper.storage._retry import RetryPolicy, call_with_retry, put_with_retry

if TYPE_CHECKING:
    from obstore import ObjectMeta, PutMode, UpdateVersion
    from obstore.store import ObjectStore, RetryConfig

__all__ = ["OBJECT_SCHEMES", "ObjectBlobStore"]

OBJECT_SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss")
"""URI schemes served by :class:`ObjectBlobStore`."""

_NO_RETRIES: RetryConfig = {"max_retries": 0}
_NO_BUCKET = re.compile(r"NoSuchBucket|ContainerNotFound|bucket does not exist")
"""A 404's body that says the bucket or container is missing (S3, Azure, GCS)."""
STREAM_PART_BYTES = 8 * 1024 * 1024
"""Size of each request of a multipart upload by ``put_stream`` (S3's minimum is 5 MiB)."""
STREAM_CONCURRENCY = 4
"""Requests of one multipart upload in flight at once."""
_DEBUG_MARKER = "\n\nDebug source:"
_MAX_DETAIL = 300
_LIST_CHUNK = 1000
# Matched against the part of obstore's message before its debug dump (the dump always
# mentions "retry_timeout", which must not count as a timeout).
_TRANSIENT = re.compile(
    # 501 and 505 are the server's for good (no conditional writes, say): not retried.
    r"status code: (5(?!01|05)\d\d|429)\b|slowdown|throttl|requesttimeout|serviceunavailable"
    r"|internalerror|timed out|timeout|error sending request"
    r"|connection (reset|refused|closed|aborted)|broken pipe|body error|dns error"
    # A listing cut short on the way: seen behind a proxy, and one failed read stopped a
    # query whose task had a single attempt.
    r"|invalid list response",
    re.IGNORECASE,
)
_UNKNOWN_KEY = re.compile(r"key: '([^']*)'")
_CONDITIONAL_CONFLICT = "ConditionalRequestConflict"
_INVALID_PATH = "Encountered object with invalid path"
_METADATA_ENDPOINT = "169.254.169.254"  # asked for credentials when none were given
_XML_DECLARATION = re.compile(r"<\?xml[^>]*\?>")


class ObjectBlobStore(ParallelTransfers):
    """A :class:`~statekeeper.storage.BlobStore` over an object store bucket and prefix.

    Create-only puts use the store's conditional write (S3 ``If-None-Match: *``), ``if_match``
    uses ``If-Match``; every put is a single request, so a blob is never seen half written;
    ``put_stream`` is a multipart upload, also invisible until complete.
    Neither ``repr``, ``uri`` nor any error message shows credentials.
    """

    def __init__(
        self,
        uri: str,
        storage_options: Mapping[str, str] | None = None,
        *,
        io_threads: int = 8,
        retry: RetryPolicy | None = None,
    ) -> None:
        """Build the obstore client for ``uri`` (no request is made yet).

        Args:
            uri: ``s3://bucket/prefix`` (also ``s3a``), ``gs://bucket/prefix``,
                ``az://container/prefix``, ``abfs[s]://container@account.dfs.../prefix``.
            storage_options: a mapping of option name to str (an int or a bool is taken
                in its string form): obstore HTTP client options (``allow_http``,
                ``timeout`` as seconds or ``"30s"``, ...) and store config keys (``endpoint``,
                ``region``, ``access_key_id``, ``service_account_key``, ``account_name``,
                ...). Checked here, once; see ``storage/_checks.py``.
            io_threads: parallel transfers of ``put_many``/``get_many``.
            retry: retry policy of every request; ``RetryPolicy()`` if ``None``.

        Raises:
            ValueError: unsupported scheme, no bucket, credentials inside the URI,
                ``storage_options`` not a mapping, an unknown option (named, with the names
                this store takes) or an invalid value (named, with the form expected and the
                value found, unless it is a secret).
        """
        super().__init__(io_threads)
        options = check_storage_options(storage_options)
        check_plain_http(options)
        self._secrets = _secret_values(uri, options)
        self._uri = _display_uri(uri)
        self._retry = retry if retry is not None else RetryPolicy()
        config, client = split_client_options(options)
        scheme = self._uri.partition("://")[0]
        self._update_by_generation = scheme == "gs"
        self._store = self._build(self._uri, config, client)

    @property
    def uri(self) -> str:
        """``scheme://bucket/prefix``: no credentials, no query string."""
        return self._uri

    def __repr__(self) -> str:
        return f"ObjectBlobStore({self._uri!r})"

    def put(
        self, key: str, data: bytes, *, overwrite: bool = False, if_match: str | None = None
    ) -> None:
        """Write ``data`` at ``key`` in one request.

        Create-only by default; ``overwrite=True`` replaces; ``if_match`` (which takes
        precedence over ``overwrite``) replaces only a blob whose etag is ``if_match``.

        Raises:
            ValueError: invalid key.
            TypeError: ``data`` is not bytes-like.
            CommitConflictError: create-only and the key exists, or ``if_match`` does not
                match (or the blob is missing).
            TransientStorageError: retries exhausted on throttling, 5xx or network errors.
            StorageError: access denied, missing bucket, other failures.
        """
        check_key(key)
        check_data(data)

        def write() -> None:
            with self._translated("put", key):
                mode: PutMode
                if if_match is None:
                    mode = "overwrite" if overwrite else "create"
                elif self._update_by_generation:
                    mode = self._generation_of(key, if_match)
                else:
                    mode = {"e_tag": if_match}
                obstore.put(self._store, key, data, mode=mode, use_multipart=False)

        put_with_retry(
            self._retry, write, lambda: self._get_once(key), data, self._describe("put", key)
        )

    def put_stream(self, key: str, chunks: Callable[[], Iterable[bytes]]) -> int:
        """Write the concatenation of ``chunks()`` at ``key`` by a multipart upload, holding
        at most :data:`STREAM_PART_BYTES` times :data:`STREAM_CONCURRENCY` bytes of it in
        memory; returns the bytes written.

        **Not create-only**: S3, GCS and Azure cannot make a multipart upload conditional
        (obstore performs a conditional put only as one request), so an existing blob is
        replaced. Use it only for a key no other writer uses and whose content a retry
        rewrites identically (a changelog's name is unique to its commit attempt). A retry
        calls ``chunks`` again; an upload that fails for good is aborted, and one the
        process dies in leaves parts that only the bucket's lifecycle rule for incomplete
        multipart uploads removes.

        Raises:
            ValueError: invalid key.
            TypeError: a chunk is not bytes-like.
            TransientStorageError: retries exhausted on throttling, 5xx or network errors.
            StorageError: access denied, missing bucket, other failures.
        """
        check_key(key)
        written = 0

        def counted() -> Iterator[bytes]:
            nonlocal written
            written = 0
            for chunk in chunks():
                check_data(chunk)
                written += len(chunk)
                yield chunk

        def write() -> None:
            with self._translated("put", key):
                obstore.put(
                    self._store, key, counted(), use_multipart=True,
                    chunk_size=STREAM_PART_BYTES, max_concurrency=STREAM_CONCURRENCY,
                )  # fmt: skip

        call_with_retry(self._retry, write, self._describe("put", key))
        return written

    def get(self, key: str) -> bytes:
        """Read a whole blob.

        Raises:
            ValueError: invalid key.
            StateNotFoundError: no blob at ``key``.
            TransientStorageError: retries exhausted.
            StorageError: the read failed.
        """
        check_key(key)
        return call_with_retry(self._retry, lambda: self._get_once(key), self._describe("get", key))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Read ``length`` bytes from ``start``; fewer (maybe none) if the blob ends first.

        Raises:
            ValueError: invalid key, or ``start`` or ``length`` negative.
            StateNotFoundError: no blob at ``key``.
            TransientStorageError: retries exhausted.
            StorageError: the read failed.
        """
        check_key(key)
        check_range(start, length)

        def read_range() -> bytes:
            if length == 0:
                self._head_once(key)  # An empty HTTP range cannot be asked for.
                return b""
            try:
                with self._translated("get_range", key):
                    return bytes(obstore.get_range(self._store, key, start=start, length=length))
            except (StateNotFoundError, TransientStorageError):
                raise
            except StorageError:
                # Servers refuse a range starting at or after the end (S3: 416); the
                # contract returns what is there, which is nothing.
                if start >= self._head_once(key).size:
                    return b""
                raise

        return call_with_retry(self._retry, read_range, self._describe("get_range", key))

    def head(self, key: str) -> BlobMeta:
        """Size, modification time and etag of one blob.

        Raises:
            ValueError: invalid key.
            StateNotFoundError: no blob at ``key``.
            TransientStorageError: retries exhausted.
            StorageError: the request failed.
        """
        check_key(key)
        return call_with_retry(
            self._retry, lambda: self._head_once(key), self._describe("head", key)
        )

    def list(self, prefix: str = "") -> list[BlobMeta]:
        """Every blob whose key starts with ``prefix`` (a plain string prefix), sorted by key.
        Objects whose names are not blob keys (put there by other tools: ``.DS_Store``) are
        left out, as the local backend leaves out dot files.

        Raises:
            ValueError: invalid prefix.
            TransientStorageError: retries exhausted.
            StorageError: the listing failed (e.g. no such bucket).
        """
        check_prefix(prefix)
        # obstore lists whole path segments; list the folder and filter for the rest.
        folder = prefix.rpartition("/")[0]

        def scan() -> list[BlobMeta]:
            found: list[BlobMeta] = []
            with self._translated("list", prefix):
                for chunk in obstore.list(self._store, folder or None, chunk_size=_LIST_CHUNK):
                    found.extend(
                        _meta(meta["path"], meta)
                        for meta in chunk
                        if meta["path"].startswith(prefix) and is_key(meta["path"])
                    )
            found.sort(key=lambda meta: meta.key)
            return found

        return call_with_retry(self._retry, scan, self._describe("list", prefix))

    def sweep_incomplete(self, older_than_s: float, *, dry_run: bool = False) -> int:
        """Nothing to sweep: every put is one atomic request, and a multipart upload of
        ``put_stream`` is invisible until complete (one abandoned by a dead process is the
        bucket lifecycle rule's to remove)."""
        return 0

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete blobs; missing keys are ignored. Every key is checked before any delete.

        Raises:
            ValueError: an invalid key (nothing was deleted).
            TransientStorageError: retries exhausted.
            StorageError: a delete failed.
        """
        targets = [check_key(key) for key in keys]
        if not targets:
            return

        def delete_all() -> None:
            with self._translated("delete_many", f"{len(targets)} keys"):
                try:
                    obstore.delete(self._store, targets)
                except FileNotFoundError:
                    # Stores other than S3 may refuse a bulk delete naming a missing key.
                    for key in targets:
                        with contextlib.suppress(FileNotFoundError):
                            obstore.delete(self._store, key)

        call_with_retry(
            self._retry, delete_all, self._describe("delete_many", f"{len(targets)} keys")
        )

    # -- internals ---------------------------------------------------------------------------

    def _build(self, uri: str, config: dict[str, Any], client: dict[str, Any]) -> ObjectStore:
        try:
            return from_url(
                uri,
                config=cast(Any, config),
                client_options=cast(Any, client),
                retry_config=_NO_RETRIES,
            )
        except UnknownConfigurationKeyError as exc:
            found = _UNKNOWN_KEY.search(str(exc))
            name = found.group(1) if found else "?"
            scheme = self._uri.partition("://")[0]
            raise ValueError(unknown_option_message(name, scheme, self._uri)) from self._scrubbed(
                exc
            )
        except (BaseError, ValueError) as exc:
            named = unparsable_option_message(str(exc).split(_DEBUG_MARKER, 1)[0], config)
            message = named or f"invalid storage options for {self._uri}: {self._detail(str(exc))}"
            raise ValueError(self._scrub(message)) from self._scrubbed(exc)

    def _generation_of(self, key: str, if_match: str) -> UpdateVersion:
        """The precondition of a GCS update that replaces only the blob whose etag is ``if_match``.

        GCS conditions a write on the object's generation, not its ETag (obstore refuses an
        update without one). The generation is read together with the ETag it is checked
        against, so a blob replaced in between fails the write's own precondition.

        Raises:
            CommitConflictError: no blob at ``key``, or its etag is not ``if_match``.
        """
        try:
            current = obstore.head(self._store, key)
        except FileNotFoundError as exc:
            raise CommitConflictError(
                f"{self._describe('put', key)}: expected etag {if_match!r}, found no blob"
            ) from self._scrubbed(exc)
        etag = _quoted(current["e_tag"])
        if etag != if_match or current["version"] is None:
            raise CommitConflictError(
                f"{self._describe('put', key)}: expected etag {if_match!r}, found {etag!r}"
            )
        return {"e_tag": current["e_tag"], "version": current["version"]}

    def _get_once(self, key: str) -> bytes:
        with self._translated("get", key):
            return bytes(obstore.get(self._store, key).bytes())

    def _head_once(self, key: str) -> BlobMeta:
        with self._translated("head", key):
            return _meta(key, obstore.head(self._store, key))

    def _describe(self, op: str, key: str) -> str:
        return f"{op} {key!r} at {self._uri}"

    @contextlib.contextmanager
    def _translated(self, op: str, key: str) -> Iterator[None]:
        try:
            yield
        except StateKeeperError:
            raise  # Already ours; StateNotFoundError is also an OSError.
        except (BaseError, OSError) as exc:
            raise self._translate(exc, op, key) from self._scrubbed(exc)

    def _translate(self, exc: Exception, op: str, key: str) -> StateKeeperError:
        """Map one obstore (or OS) error to ours: the one place this backend does so."""
        message = str(exc)
        where = self._describe(op, key)
        detail = self._detail(message)
        head = message.split(_DEBUG_MARKER, 1)[0]
        # obstore reports every 409 as AlreadyExists, but S3's 409 ConditionalRequestConflict
        # means "another conditional write to this key is in flight": retry, then decide.
        if _CONDITIONAL_CONFLICT in head:
            return TransientStorageError(f"{where}: {detail}")
        if isinstance(exc, AlreadyExistsError | PreconditionError):
            return CommitConflictError(f"{where}: the blob exists or its etag changed ({detail})")
        if isinstance(exc, FileNotFoundError | NotFoundError):
            # A read's 404 names a missing blob, unless the body says the bucket is missing
            # (a HEAD has no body: it cannot tell).
            if op in ("get", "get_range", "head") and not _NO_BUCKET.search(message):
                return StateNotFoundError(f"no blob {key!r} at {self._uri}")
            return StorageError(f"{where}: bucket or container not found ({detail})")
        if isinstance(exc, PermissionDeniedError | UnauthenticatedError | PermissionError):
            return StorageError(f"{where}: access denied ({detail})")
        if isinstance(exc, TimeoutError | ConnectionError) or _TRANSIENT.search(head):
            return TransientStorageError(f"{where}: {detail}")
        if _INVALID_PATH in head:
            return StorageError(
                f"{where}: {detail}. An object another tool put under the root has a name "
                "this client cannot list (an empty segment '//', a '.' or '..' segment, or a "
                "control character); statekeeper never writes such names and cannot skip "
                "one: delete or rename that object"
            )
        if _METADATA_ENDPOINT in head:
            return StorageError(
                f"{where}: no credentials were found, so the instance metadata endpoint was "
                "asked and failed: pass access_key_id and secret_access_key (or a role's) "
                "as storage options, or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for "
                f"every process that reads the root ({detail})"
            )
        return StorageError(f"{where}: {detail}")

    def _detail(self, message: str) -> str:
        """The first line of an obstore message, scrubbed and capped: its debug dump is long."""
        line = message.split(_DEBUG_MARKER, 1)[0].strip().split("\n", 1)[0]
        # An S3 error body starts with an XML declaration that says nothing.
        line = self._scrub(_XML_DECLARATION.sub("", line).strip().rstrip(":").strip())
        return line if len(line) <= _MAX_DETAIL else line[: _MAX_DETAIL - 3] + "..."

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _scrubbed(self, exc: BaseException) -> BaseException:
        # The original stays chained for debugging, so it must not carry secrets either.
        exc.args = tuple(self._scrub(arg) if isinstance(arg, str) else arg for arg in exc.args)
        return exc


def _display_uri(uri: str) -> str:
    if not isinstance(uri, str):
        raise ValueError(f"object store URI must be a str, got {type(uri).__name__}")
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in OBJECT_SCHEMES:
        raise ValueError(
            f"object store URI scheme must be one of {', '.join(OBJECT_SCHEMES)}; got {scheme!r}"
        )
    userinfo, _, host = parts.netloc.rpartition("@")
    if ":" in userinfo:
        raise ValueError(
            f"credentials inside the URI are not supported ({scheme}://{host}...); "
            "pass them in storage_options"
        )
    if not host:
        raise ValueError(f"object store URI must name a bucket: {scheme}://<bucket>[/<prefix>]")
    shown = f"{scheme}://{parts.netloc}{parts.path.rstrip('/')}"
    if parts.query or parts.fragment or "?" in uri or "#" in uri:
        # Never echoed: a query may be a token put there by mistake.
        raise ValueError(
            f"object store URI {shown}... must not have a query string or fragment ('?...', "
            "'#...'): they are not part of the prefix, so roots that differed only there would "
            "be one root; pass settings in storage_options"
        )
    if "//" in parts.path.rstrip("/"):
        raise ValueError(f"object store URI must not have empty path segments ('//'): {shown}")
    return shown


def _secret_values(uri: object, options: Mapping[str, str]) -> tuple[str, ...]:
    secrets = {value for key, value in options.items() if len(value) >= 4 and is_secret_option(key)}
    for value in list(secrets):
        secrets.update(_json_secrets(value))
    for value in options.values():  # a password in a URL option (an endpoint, a proxy)
        if password := url_password(value):
            secrets.add(password)
    if isinstance(uri, str):
        parts = urlsplit(uri)
        if parts.password:
            secrets.add(parts.password)
        if parts.query:
            secrets.add(parts.query)  # e.g. an Azure SAS token
            secrets.update(value for _, value in parse_qsl(parts.query) if len(value) >= 4)
    # Longest first, so a secret containing another is replaced whole.
    return tuple(sorted(secrets, key=len, reverse=True))


def _json_secrets(value: str) -> set[str]:
    """Secret fields inside a JSON credential (a GCS service account key), so that a message
    quoting one field alone is scrubbed too."""
    if not value.lstrip().startswith("{"):
        return set()
    try:
        document = json.loads(value)
    except ValueError:
        return set()
    if not isinstance(document, dict):
        return set()
    return {
        field
        for name, field in document.items()
        if isinstance(field, str) and len(field) >= 4 and is_secret_option(name)
    }


def _quoted(etag: str | None) -> str | None:
    # Azure and GCS quote the ETag header of a HEAD but not the ETag of a listing entry; the
    # quoted form (RFC 9110, and what If-Match carries) makes both name the same version.
    if etag is None or etag.startswith(('"', 'W/"')):
        return etag
    return f'"{etag}"'


def _meta(key: str, meta: ObjectMeta) -> BlobMeta:
    return BlobMeta(
        key=key,
        size=meta["size"],
        last_modified=meta["last_modified"].timestamp(),
        etag=_quoted(meta["e_tag"]),
    )
