"""open_blob_store: URI dispatch, option checks, and credentials kept out of sight."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import traceback
from pathlib import Path

import pytest

import statekeeper.storage
from statekeeper.errors import StateNotFoundError, StorageError, TransientStorageError
from statekeeper.storage import (
    LocalBlobStore,
    ObjectBlobStore,
    RetryPolicy,
    open_blob_store,
)

SECRET = "SUPERSECRET123"
NO_RETRY = RetryPolicy(max_attempts=1)


@pytest.fixture(autouse=True)
def _no_aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # obstore reads AWS_* variables; the developer's must not change what these tests see.
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def full_text(error: BaseException) -> str:
    """Everything a traceback of ``error`` shows, chained causes included."""
    return "".join(traceback.format_exception(error))


# -- local roots ---------------------------------------------------------------------------------


def test_absolute_path_opens_a_local_store(tmp_path: Path) -> None:
    store = open_blob_store(str(tmp_path / "state"))
    assert isinstance(store, LocalBlobStore)
    assert store.root == str(tmp_path / "state")
    assert (tmp_path / "state").is_dir()


def test_relative_path_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    store = open_blob_store("rel/state")
    assert isinstance(store, LocalBlobStore)
    assert store.root == str(tmp_path / "rel" / "state")


@pytest.mark.parametrize("form", ["as_uri", "localhost"])
def test_file_uri_opens_a_local_store(tmp_path: Path, form: str) -> None:
    root = tmp_path / "with space"
    uri = root.as_uri() if form == "as_uri" else f"file://localhost{root}"
    store = open_blob_store(uri)
    assert isinstance(store, LocalBlobStore)
    assert store.root == str(root)
    store.put("k", b"v")
    reopened = open_blob_store(store.uri)  # the uri property round-trips
    assert reopened.get("k") == b"v"


@pytest.mark.parametrize("uri", ["file://otherhost/x", "file://", "file:///x?q=1"])
def test_bad_file_uris_are_refused(uri: str) -> None:
    with pytest.raises(ValueError, match="file://"):
        open_blob_store(uri)


def test_local_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "afile").write_bytes(b"")
    with pytest.raises(StorageError, match="not a folder"):
        open_blob_store(str(tmp_path / "afile"))


def test_storage_options_are_refused_for_a_local_root(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"storage_options.*local.*'endpoint'"):
        open_blob_store(str(tmp_path), {"endpoint": "http://x"})
    assert isinstance(open_blob_store(str(tmp_path), {}), LocalBlobStore)


# -- object store roots --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uri", "options", "shown"),
    [
        ("s3://bucket/prefix", None, "s3://bucket/prefix"),
        ("S3://bucket/prefix/", None, "s3://bucket/prefix"),
        ("s3a://bucket/a/b", None, "s3a://bucket/a/b"),
        ("s3://bucket", None, "s3://bucket"),
        ("gs://bucket/prefix", None, "gs://bucket/prefix"),
        ("az://container/prefix", {"account_name": "acct"}, "az://container/prefix"),
        (
            "abfss://cont@acct.dfs.core.windows.net/p",
            None,
            "abfss://cont@acct.dfs.core.windows.net/p",
        ),
        (
            "abfs://cont@acct.dfs.core.windows.net/p",
            None,
            "abfs://cont@acct.dfs.core.windows.net/p",
        ),
    ],
)
def test_object_uris_open_an_object_store(
    uri: str, options: dict[str, str] | None, shown: str
) -> None:
    store = open_blob_store(uri, options)
    assert isinstance(store, ObjectBlobStore)
    assert store.uri == shown
    assert repr(store) == f"ObjectBlobStore({shown!r})"


@pytest.mark.parametrize(
    "uri",
    ["", "   ", "http://host/x", "https://host/x", "ftp://host/x", "memory:///", "hdfs://nn/x"],
)
def test_unsupported_uris_name_the_supported_schemes(uri: str) -> None:
    with pytest.raises(ValueError, match=r"s3://.*gs://") as info:
        open_blob_store(uri)
    assert "file://" in str(info.value)


@pytest.mark.parametrize("uri", [None, 42, b"/tmp/x", Path("/tmp/x")])
def test_non_str_uris_are_refused(uri: object) -> None:
    with pytest.raises(ValueError, match="non-empty str"):
        open_blob_store(uri)  # type: ignore[arg-type]


@pytest.mark.parametrize("uri", ["s3://", "gs:///prefix"])
def test_object_uri_without_bucket_is_refused(uri: str) -> None:
    with pytest.raises(ValueError, match="must name a bucket"):
        open_blob_store(uri)


def test_unknown_storage_option_is_named() -> None:
    with pytest.raises(ValueError, match="'not_an_option'"):
        open_blob_store("s3://bucket/p", {"region": "us-east-1", "not_an_option": "1"})


def test_an_option_obstore_cannot_parse_is_named() -> None:
    with pytest.raises(
        ValueError,
        match="storage option 'virtual_hosted_style_request' must be a boolean "
        r"\('true' or 'false'\); got str 'maybe'",
    ):
        open_blob_store("s3://bucket/p", {"virtual_hosted_style_request": "maybe"})


@pytest.mark.parametrize("value", ["true", "FALSE", " True "])
def test_boolean_client_options_accept_strings(value: str) -> None:
    assert isinstance(open_blob_store("s3://bucket/p", {"allow_http": value}), ObjectBlobStore)


def test_boolean_client_options_refuse_other_strings() -> None:
    with pytest.raises(ValueError, match="'allow_http' must be 'true' or 'false'"):
        open_blob_store("s3://bucket/p", {"allow_http": "maybe"})


# -- credentials stay hidden ---------------------------------------------------------------------


def test_credentials_never_in_repr_str_or_uri() -> None:
    options = {"access_key_id": "AKIDEXAMPLE", "secret_access_key": SECRET, "session_token": SECRET}
    store = open_blob_store("s3://bucket/prefix", options)
    for text in (repr(store), str(store), store.uri):
        assert SECRET not in text
        assert "AKIDEXAMPLE" not in text
    # A query string (a token put there by mistake) is refused, and never echoed.
    with pytest.raises(ValueError, match="query string") as info:
        open_blob_store("s3://bucket/prefix?versionId=" + SECRET, options)
    assert SECRET not in full_text(info.value)


def test_credentials_inside_the_uri_are_refused_without_echo() -> None:
    with pytest.raises(ValueError, match="storage_options") as info:
        open_blob_store(f"s3://AKIDEXAMPLE:{SECRET}@bucket/prefix")
    assert SECRET not in full_text(info.value)


def test_unknown_option_error_does_not_echo_values() -> None:
    with pytest.raises(ValueError, match="'secret_acess_key'") as info:
        open_blob_store("s3://bucket/p", {"secret_acess_key": SECRET})  # a typo'd name
    assert SECRET not in full_text(info.value)


def test_secrets_echoed_by_obstore_are_scrubbed() -> None:
    # obstore echoes an unparsable value; here it equals the session token, so it must go.
    options = {"session_token": SECRET, "request_payer": SECRET}
    with pytest.raises(ValueError, match="'request_payer' or 'session_token'") as info:
        open_blob_store("s3://bucket/p", options)
    assert "value hidden" in str(info.value)
    assert info.value.__cause__ is not None  # the original stays attached, scrubbed too
    assert "***" in str(info.value.__cause__)
    assert SECRET not in full_text(info.value)


def test_failed_requests_do_not_leak_credentials(caplog: pytest.LogCaptureFixture) -> None:
    options = {
        "endpoint": f"http://127.0.0.1:{closed_port()}",
        "access_key_id": "AKIDEXAMPLE",
        "secret_access_key": SECRET,
        "region": "us-east-1",
        "allow_http": "true",
    }
    store = open_blob_store(
        "s3://bucket/root", options, retry=RetryPolicy(max_attempts=2, base_delay_s=0.001)
    )
    with caplog.at_level(logging.DEBUG), pytest.raises(TransientStorageError) as info:
        store.put("a/b", b"data")
    message = str(info.value)
    assert message.startswith("put 'a/b' at s3://bucket/root")
    assert "\n" not in message
    assert len(message) < 500
    assert SECRET not in full_text(info.value)
    assert SECRET not in caplog.text
    assert "'a/b'" in caplog.text  # the retry was logged, without the secret


@pytest.mark.s3
def test_missing_bucket_is_a_storage_error(
    s3_root: tuple[str, dict[str, str]], caplog: pytest.LogCaptureFixture
) -> None:
    _, options = s3_root
    store = open_blob_store(
        "s3://no-such-bucket-here/root", {**options, "secret_access_key": SECRET}, retry=NO_RETRY
    )
    with caplog.at_level(logging.DEBUG), pytest.raises(StorageError, match="bucket") as info:
        store.put("a/b", b"x")
    assert "'a/b'" in str(info.value)
    assert "s3://no-such-bucket-here/root" in str(info.value)
    assert SECRET not in full_text(info.value) + caplog.text
    with pytest.raises(StorageError, match="bucket"):
        store.list()
    # A read said "no blob" (and so the CLI: "not a statekeeper checkpoint root").
    with pytest.raises(StorageError, match="bucket or container not found") as read:
        store.get("_statekeeper.json")
    assert not isinstance(read.value, StateNotFoundError)


@pytest.mark.parametrize(
    "uri", ["s3://bucket/app#1", "s3://bucket/app?x=1", "gs://bucket/p#", "s3://bucket/a?"]
)
def test_a_query_or_fragment_in_an_object_uri_is_refused_not_dropped(uri: str) -> None:
    """s3://b/app#1 and s3://b/app#2 were one root (the prefix 'app')."""
    with pytest.raises(ValueError, match="must not have a query string or fragment") as info:
        open_blob_store(uri)
    assert "x=1" not in str(info.value)  # a query may be a token: never echoed


@pytest.mark.parametrize("uri", ["s3://bucket/a//b", "s3://bucket//a"])
def test_an_empty_segment_in_an_object_uri_is_named_as_the_uri_s_fault(uri: str) -> None:
    with pytest.raises(ValueError, match=r"must not have empty path segments \('//'\)"):
        open_blob_store(uri)


def test_trailing_slashes_of_an_object_uri_name_the_same_root() -> None:
    assert open_blob_store("s3://bucket/root//").uri == "s3://bucket/root"


def test_local_root_is_the_folder_of_a_path_or_file_uri_and_none_for_object_stores() -> None:
    assert statekeeper.storage.local_root("state/root") == "state/root"
    assert statekeeper.storage.local_root("file:///tmp/a%20b") == "/tmp/a b"
    assert statekeeper.storage.local_root("FILE://localhost/tmp/x") == "/tmp/x"
    assert statekeeper.storage.local_root("s3://bucket/prefix") is None
    with pytest.raises(ValueError, match="got host 'remote'"):
        statekeeper.storage.local_root("file://remote/tmp/x")


def test_package_exports_are_sorted_and_complete() -> None:
    exported = statekeeper.storage.__all__
    assert exported == sorted(exported)
    assert set(exported) == {
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
    }
    for name in exported:
        assert getattr(statekeeper.storage, name) is not None


# After the main thread returned, a plain pool refuses work and ours runs it in the caller.
EXITING_CHILD = r"""
import threading
from concurrent.futures import ThreadPoolExecutor
from statekeeper.storage import thread_pool
pool = thread_pool(2, "test")
print(pool.submit(threading.get_ident).result() != threading.get_ident())
def after():
    threading.main_thread().join()
    try:
        ThreadPoolExecutor(1).submit(int)
    except RuntimeError:
        print("refused", flush=True)
    print(pool.submit(threading.get_ident).result() == threading.get_ident(), flush=True)
    print(type(pool.submit(divmod, 1, 0).exception()).__name__, flush=True)
threading.Thread(target=after).start()
"""


def test_a_thread_pool_runs_calls_in_the_callers_thread_once_python_is_exiting() -> None:
    """Once the main thread has returned, pools refuse work: ours runs it in the caller's
    thread, its failure still in the future."""
    proc = subprocess.run(
        [sys.executable, "-c", EXITING_CHILD], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n") == ["True", "refused", "True", "ZeroDivisionError", ""], (
        proc.stderr
    )


def test_a_thread_pool_shut_down_runs_calls_in_the_callers_thread() -> None:
    pool = statekeeper.storage.thread_pool(1, "test")
    pool.shutdown()
    assert pool.submit(threading.get_ident).result() == threading.get_ident()
