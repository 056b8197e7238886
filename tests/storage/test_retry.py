"""Retries: only transient failures, bounded backoff, and no retries hidden below ours."""

from __future__ import annotations

import http.client
import http.server
import logging
import os
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import obstore
import pytest
from obstore.exceptions import AlreadyExistsError
from obstore.store import S3Store

from statekeeper.errors import (
    CommitConflictError,
    StateNotFoundError,
    StorageError,
    TransientStorageError,
)
from statekeeper.storage import BlobStore, LocalBlobStore, ObjectBlobStore, RetryPolicy
from statekeeper.storage._parallel import ParallelTransfers
from statekeeper.storage._retry import call_with_retry, put_with_retry

TINY = RetryPolicy(max_attempts=6, base_delay_s=0.001, max_delay_s=0.004)


class FlakyStore(ParallelTransfers):
    """Wraps a real store; the first ``failures`` calls fail transiently, later ones pass.

    With ``land_first`` the failing calls still write through first: the reply is "lost".
    """

    def __init__(self, inner: BlobStore, failures: int, *, land_first: bool = False) -> None:
        super().__init__(io_threads=2)
        self.inner = inner
        self.failures = failures
        self.land_first = land_first
        self.calls = 0

    def _fail_maybe(self, what: str) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise TransientStorageError(f"{what}: injected failure {self.calls}")

    def put(
        self, key: str, data: bytes, *, overwrite: bool = False, if_match: str | None = None
    ) -> None:
        if self.land_first and self.calls < self.failures:
            self.inner.put(key, data, overwrite=overwrite, if_match=if_match)
        self._fail_maybe(f"put {key!r}")
        self.inner.put(key, data, overwrite=overwrite, if_match=if_match)

    def get(self, key: str) -> bytes:
        self._fail_maybe(f"get {key!r}")
        return self.inner.get(key)


@pytest.fixture
def local(tmp_path: Path) -> LocalBlobStore:
    return LocalBlobStore(tmp_path / "root")


@pytest.mark.parametrize("failures", [0, 1, 5])
def test_fewer_failures_than_attempts_succeed(local: LocalBlobStore, failures: int) -> None:
    flaky = FlakyStore(local, failures)
    sleeps: list[float] = []
    call_with_retry(TINY, lambda: flaky.put("a/b", b"data"), "put 'a/b'", sleep=sleeps.append)
    assert local.get("a/b") == b"data"
    assert flaky.calls == failures + 1
    assert len(sleeps) == failures
    assert all(0.0 <= delay <= TINY.max_delay_s for delay in sleeps)


@pytest.mark.parametrize("failures", [6, 10])
def test_as_many_failures_as_attempts_raise(local: LocalBlobStore, failures: int) -> None:
    flaky = FlakyStore(local, failures)
    sleeps: list[float] = []
    with pytest.raises(TransientStorageError, match="injected failure 6") as info:
        call_with_retry(TINY, lambda: flaky.put("a/b", b"data"), "put 'a/b'", sleep=sleeps.append)
    assert flaky.calls == TINY.max_attempts
    assert len(sleeps) == TINY.max_attempts - 1
    assert any("gave up after 6 attempt(s)" in note for note in info.value.__notes__)
    with pytest.raises(StateNotFoundError):
        local.get("a/b")


def test_real_sleeps_are_used_by_default(local: LocalBlobStore) -> None:
    local.put("k", b"v")
    flaky = FlakyStore(local, 2)
    assert call_with_retry(TINY, lambda: flaky.get("k"), "get 'k'") == b"v"  # returns the value
    assert flaky.calls == 3


def test_other_errors_are_not_retried(local: LocalBlobStore) -> None:
    local.put("k", b"first")
    flaky = FlakyStore(local, 0)
    sleeps: list[float] = []
    with pytest.raises(CommitConflictError):
        call_with_retry(TINY, lambda: flaky.put("k", b"second"), "put 'k'", sleep=sleeps.append)
    assert (flaky.calls, sleeps) == (1, [])
    with pytest.raises(StateNotFoundError):
        call_with_retry(TINY, lambda: flaky.get("missing"), "get 'missing'", sleep=sleeps.append)
    assert (flaky.calls, sleeps) == (2, [])


def test_each_retry_logs_a_warning(local: LocalBlobStore, caplog: pytest.LogCaptureFixture) -> None:
    flaky = FlakyStore(local, 2)
    with caplog.at_level(logging.WARNING, logger="statekeeper.storage"):
        call_with_retry(
            TINY, lambda: flaky.put("x/y", b"1"), "put 'x/y' in here", sleep=lambda _: None
        )
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert all("put 'x/y' in here" in r.getMessage() for r in warnings)
    assert "attempt 2 of 6" in warnings[1].getMessage()


def test_backoff_is_bounded_and_grows() -> None:
    policy = RetryPolicy(max_attempts=50, base_delay_s=0.01, max_delay_s=0.05)
    caps = [policy.delay_cap_s(retry) for retry in range(1, 50)]
    assert caps[:3] == [0.01, 0.02, 0.04]
    assert caps == sorted(caps)
    assert max(caps) == 0.05
    assert policy.delay_cap_s(100_000) == 0.05  # no overflow for absurd retry counts
    for retry in (1, 2, 3, 10):
        delays = [policy.delay_s(retry) for _ in range(200)]
        assert all(0.0 <= delay <= policy.delay_cap_s(retry) for delay in delays)
        assert len(set(delays)) > 1  # jittered, not fixed


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"max_attempts": 1.5},
        {"max_attempts": True},
        {"base_delay_s": -0.1},
        {"max_delay_s": -1},
        {"base_delay_s": 2.0, "max_delay_s": 1.0},
        {"base_delay_s": float("nan")},
        {"max_delay_s": float("inf")},
    ],
)
def test_retry_policy_validates(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="RetryPolicy"):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


# -- lost replies of conditional writes ---------------------------------------------------------


def test_own_landed_write_is_not_a_conflict(local: LocalBlobStore) -> None:
    flaky = FlakyStore(local, 1, land_first=True)  # stored, then "timed out"
    put_with_retry(
        TINY, lambda: flaky.put("c/k", b"mine"), lambda: local.get("c/k"), b"mine", "put 'c/k'"
    )
    assert local.get("c/k") == b"mine"
    assert flaky.calls == 2


def test_foreign_write_after_a_failure_is_a_conflict(local: LocalBlobStore) -> None:
    local.put("c/k", b"theirs")
    flaky = FlakyStore(local, 1)
    with pytest.raises(CommitConflictError):
        put_with_retry(
            TINY, lambda: flaky.put("c/k", b"mine"), lambda: local.get("c/k"), b"mine", "put"
        )
    assert local.get("c/k") == b"theirs"


def test_own_landed_write_deleted_before_the_read_back_is_an_unknown_outcome(
    local: LocalBlobStore,
) -> None:
    """The first attempt lands and "times out", the retry is refused, and garbage collection
    deletes the blob before it is read back (found by the simulation, gc_vs_snapshots seed
    88200300: a snapshot index of a version no longer retained). Whose blob it was cannot be
    known: a StorageError (the outcome is unknown), not a conflict, and no new attempt
    (it would bring back the blob that was deleted)."""
    flaky = FlakyStore(local, 1, land_first=True)

    def read_back_after_gc() -> bytes:
        local.delete_many(["c/k"])
        return local.get("c/k")

    with pytest.raises(StorageError, match="outcome unknown") as raised:
        put_with_retry(TINY, lambda: flaky.put("c/k", b"mine"), read_back_after_gc, b"mine", "put")
    assert not isinstance(raised.value, CommitConflictError | TransientStorageError)
    assert flaky.calls == 2  # no third attempt
    assert local.list("c/") == []


def test_first_attempt_conflict_is_never_masked(local: LocalBlobStore) -> None:
    local.put("c/k", b"same bytes")  # another writer got there first, with equal bytes
    with pytest.raises(CommitConflictError):
        put_with_retry(
            TINY,
            lambda: local.put("c/k", b"same bytes"),
            lambda: local.get("c/k"),
            b"same bytes",
            "put",
        )


# -- the object store backend: our retries only, classified by status ---------------------------


class StatusServer(http.server.ThreadingHTTPServer):
    """A loopback HTTP server that answers every request with one status; counts requests."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body
        self.requests = 0
        super().__init__(("127.0.0.1", 0), _StatusHandler)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _StatusHandler(http.server.BaseHTTPRequestHandler):
    server: StatusServer

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.requests += 1
        self.send_response(self.server.status)
        self.send_header("Content-Length", str(len(self.server.body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(self.server.body)

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _answer

    def log_message(self, format: str, *args: object) -> None:
        pass  # keep test output clean


@pytest.fixture
def status_server(request: pytest.FixtureRequest) -> Iterator[StatusServer]:
    status, code = request.param
    body = f"<Error><Code>{code}</Code><Message>m</Message></Error>".encode()
    server = StatusServer(status, body)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def object_store(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> ObjectBlobStore:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    options = {
        "endpoint": endpoint,
        "access_key_id": "AKIDEXAMPLE",
        "secret_access_key": "SUPERSECRET123",
        "region": "us-east-1",
        "allow_http": "true",
    }
    policy = RetryPolicy(max_attempts=3, base_delay_s=0.001, max_delay_s=0.002)
    return ObjectBlobStore("s3://bucket/root", options, retry=policy)


@pytest.mark.parametrize(
    ("status_server", "error", "requests"),
    [
        ((503, "SlowDown"), TransientStorageError, 3),
        ((500, "InternalError"), TransientStorageError, 3),
        ((429, "TooManyRequests"), TransientStorageError, 3),
        ((409, "ConditionalRequestConflict"), TransientStorageError, 3),
        ((403, "AccessDenied"), StorageError, 1),
        ((400, "InvalidRequest"), StorageError, 1),
        # found by review: a server without conditional writes was retried, then "gave up"
        ((501, "NotImplemented"), StorageError, 1),
    ],
    indirect=["status_server"],
)
def test_object_store_retries_only_transient_statuses(
    status_server: StatusServer,
    error: type[StorageError],
    requests: int,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = object_store(status_server.endpoint, monkeypatch)
    with (
        caplog.at_level(logging.WARNING, logger="statekeeper.storage"),
        pytest.raises(StorageError) as info,
    ):
        store.get("a/b")
    assert type(info.value) is error
    # Exactly our attempts reach the server: obstore's own retries are off.
    assert status_server.requests == requests
    assert len(caplog.records) == requests - 1
    assert "'a/b'" in str(info.value)
    assert "s3://bucket/root" in str(info.value)
    assert "\n" not in str(info.value)
    assert "SUPERSECRET123" not in str(info.value) + caplog.text


def test_a_listing_cut_short_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review behind a proxy that cut bodies short: an unparsable listing was a
    permanent error, and a task with one attempt (local[N]) stopped the query."""
    server = StatusServer(200, b"<?xml version='1.0'?><ListBucketResult><Contents><Key>a/b")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(TransientStorageError, match="invalid list response"):
            object_store(server.endpoint, monkeypatch).list("a/")
        assert server.requests == 3
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


# -- why these retries and not obstore's RetryConfig ---------------------------------------------


class LostReplyProxy(http.server.ThreadingHTTPServer):
    """Forwards requests to an S3 server; the first PUT is carried out, its reply replaced by a 500.

    That is a write that landed while its client saw a failure (a reply lost on the way back).
    """

    daemon_threads = True

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.upstream = (host, int(port))
        self.lost = 0
        super().__init__(("127.0.0.1", 0), _LostReplyHandler)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _LostReplyHandler(http.server.BaseHTTPRequestHandler):
    server: LostReplyProxy
    protocol_version = "HTTP/1.1"

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        connection = http.client.HTTPConnection(*self.server.upstream, timeout=30)
        try:
            connection.request(self.command, self.path, body=body or None, headers=self.headers)
            reply = connection.getresponse()
            status, headers, data = reply.status, reply.getheaders(), reply.read()
        finally:
            connection.close()
        if self.command == "PUT" and self.server.lost == 0:
            self.server.lost += 1
            status, headers = 500, [("Content-Type", "application/xml")]
            data = b"<Error><Code>InternalError</Code><Message>lost</Message></Error>"
        self.send_response(status)
        for key, value in headers:
            if key.lower() not in ("content-length", "connection", "transfer-encoding"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _forward

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def lost_reply(s3_root: tuple[str, dict[str, str]]) -> Iterator[tuple[str, dict[str, str]]]:
    """``s3_root`` seen through a :class:`LostReplyProxy`."""
    uri, options = s3_root
    proxy = LostReplyProxy(options["endpoint"])
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    yield uri, {**options, "endpoint": proxy.endpoint}
    proxy.shutdown()
    proxy.server_close()
    thread.join()


@pytest.mark.s3
def test_obstore_retries_turn_a_landed_create_into_a_false_conflict(
    lost_reply: tuple[str, dict[str, str]],
) -> None:
    """obstore's RetryConfig retries the PUT and reports our own write as someone else's."""
    uri, options = lost_reply
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    client = {"allow_http": True}
    config = {k: v for k, v in options.items() if k != "allow_http"}
    fast = {"init_backoff": timedelta(milliseconds=1), "max_backoff": timedelta(milliseconds=2)}
    store = S3Store(
        bucket, prefix=prefix, config=config, client_options=client,  # type: ignore[arg-type]
        retry_config={"max_retries": 3, "backoff": fast},
    )  # fmt: skip
    with pytest.raises(AlreadyExistsError):
        obstore.put(store, "k", b"mine", mode="create")
    assert bytes(obstore.get(store, "k").bytes()) == b"mine"  # it was ours all along


@pytest.mark.s3
def test_our_retry_recognises_its_own_landed_create(
    lost_reply: tuple[str, dict[str, str]], caplog: pytest.LogCaptureFixture
) -> None:
    uri, options = lost_reply
    store = ObjectBlobStore(uri, options, retry=TINY)
    with caplog.at_level(logging.INFO, logger="statekeeper.storage"):
        store.put("k", b"mine")
    assert store.get("k") == b"mine"
    messages = [record.getMessage() for record in caplog.records]
    assert any("retrying put 'k'" in message for message in messages)  # logged, in Python
    assert any("an earlier attempt had landed" in message for message in messages)
    with pytest.raises(CommitConflictError):
        store.put("k", b"theirs")  # a real second writer is still refused


def test_no_credentials_is_said_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: without credentials obstore asks the instance metadata endpoint,
    and its failure was the whole message ("Error performing PUT http://169.254.169.254/
    latest/api/token ... 403"), naming neither credentials nor how to give them."""
    store = object_store("http://127.0.0.1:9", monkeypatch)
    seen = RuntimeError(
        "Generic S3 error: Error performing PUT http://169.254.169.254/latest/api/token in "
        "1ms, after 0 retries - Server returned non-2xx status code: 403 Forbidden"
    )
    error = store._translate(seen, "get", "a/b")
    assert type(error) is StorageError
    assert "no credentials were found" in str(error)
    assert "access_key_id" in str(error)
