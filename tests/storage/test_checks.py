"""Options are checked where they enter: each refusal names the option, the form, the value."""

from __future__ import annotations

import math
import os
import socket
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest

import statekeeper as sk
from statekeeper.errors import TransientStorageError
from statekeeper.storage import ObjectBlobStore, RetryPolicy, open_blob_store
from statekeeper.storage._checks import STORE_KEYS

SECRET = "SUPERSECRET-0cc175b9c0f1b6a8"
DURATION_FORM = "'30s', '500ms'"


@pytest.fixture(autouse=True)
def _no_cloud_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # obstore reads AWS_*, GOOGLE_* and AZURE_* variables; a developer's must not count.
    for name in list(os.environ):
        if name.startswith(("AWS_", "GOOGLE_", "AZURE_")):
            monkeypatch.delenv(name)


def full_text(error: BaseException) -> str:
    return "".join(traceback.format_exception(error))


# -- StoreConfig -------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["orphan_ttl_s", "local_checkpoint_interval_s"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_store_config_refuses_non_finite_seconds(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"StoreConfig\.{field} must be a finite number") as info:
        sk.StoreConfig(**{field: value})  # type: ignore[arg-type]
    assert repr(value) in str(info.value)


def test_store_config_refuses_a_bool_compression_level() -> None:
    with pytest.raises(
        ValueError, match=r"compression_level must be an int in \[1, 22\], got True"
    ):
        sk.StoreConfig(compression_level=True)


def test_store_config_refuses_an_empty_local_dir() -> None:
    # "" would put every working copy in whatever folder the process happens to run in.
    with pytest.raises(ValueError, match="local_dir must be a non-empty path"):
        sk.StoreConfig(local_dir="")


# -- storage_options as a whole ---------------------------------------------------------------


@pytest.mark.parametrize("root", ["s3://bucket/p", "gs://bucket/p", "LOCAL"])
def test_storage_options_given_as_a_string_are_refused(root: str, tmp_path: Path) -> None:
    uri = str(tmp_path / "root") if root == "LOCAL" else root
    line = f"endpoint=http://127.0.0.1:9000,secret_access_key={SECRET}"
    with pytest.raises(ValueError, match="storage_options must be a mapping") as info:
        open_blob_store(uri, line)  # type: ignore[arg-type]
    assert "got a str" in str(info.value)
    assert SECRET not in full_text(info.value)


def test_state_backend_refuses_string_storage_options(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="storage_options must be a mapping"):
        sk.StateBackend(
            "s3://bucket/p",
            config=sk.StoreConfig(local_dir=str(tmp_path)),
            storage_options="region=us-east-1",  # type: ignore[arg-type]
        )


# -- values --------------------------------------------------------------------------------------


def test_int_and_bool_values_are_taken_in_their_string_form(
    s3_root: tuple[str, dict[str, str]],
) -> None:
    uri, options = s3_root
    given: dict[str, object] = {
        **options,
        "allow_http": True,
        "timeout": 30,
        "pool_max_idle_per_host": 4,
        "virtual_hosted_style_request": False,
    }
    store = open_blob_store(uri, given)  # type: ignore[arg-type]
    store.put("k", b"v")
    assert store.get("k") == b"v"


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A loopback port that accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)  # The kernel completes the handshake; nobody ever reads or replies.
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("timeout", [1, 0.5, "1"])
def test_a_timeout_in_seconds_reaches_the_client(silent_endpoint: str, timeout: object) -> None:
    options = {
        "endpoint": silent_endpoint,
        "access_key_id": "AKIDEXAMPLE",
        "secret_access_key": SECRET,
        "region": "us-east-1",
        "allow_http": "true",
        "timeout": timeout,
    }
    store = open_blob_store(
        "s3://bucket/root",
        options,  # type: ignore[arg-type]
        retry=RetryPolicy(max_attempts=1),
    )
    started = time.monotonic()
    with pytest.raises(TransientStorageError) as info:
        store.get("a/b")
    assert "TimedOut" in str(info.value.__cause__)  # the client gave up waiting
    # Not a speed check: obstore's default timeout is 30 s, so ending well before it shows
    # that this option, not the default, ended the request.
    assert time.monotonic() - started < 20


@pytest.mark.parametrize(
    ("value", "found"),
    [
        ("soon", "got str 'soon'"),
        ("five seconds", "got str 'five seconds'"),
        ("0s", "got str '0s'"),
        (-3, "got int -3"),
        (math.nan, "got float nan"),
        (True, "got bool True"),
    ],
)
def test_a_bad_timeout_names_the_option_and_the_form(value: object, found: str) -> None:
    with pytest.raises(ValueError, match="storage option 'timeout' must be a duration") as info:
        open_blob_store("s3://bucket/p", {"timeout": value})  # type: ignore[dict-item]
    assert DURATION_FORM in str(info.value)
    assert found in str(info.value)


@pytest.mark.parametrize("value", [30, 2.5, "2.5", "30"])
def test_timeouts_take_a_number_of_seconds(value: object) -> None:
    # obstore alone refuses all four: it wants a unit ("30s").
    store = open_blob_store("s3://bucket/p", {"timeout": value, "connect_timeout": value})  # type: ignore[dict-item]
    assert isinstance(store, ObjectBlobStore)


@pytest.mark.parametrize("value", ["30s", "500ms", "1h 30min", "2min", "1500us"])
def test_timeouts_still_take_the_units_obstore_knows(value: object) -> None:
    store = open_blob_store("s3://bucket/p", {"timeout": value, "connect_timeout": value})  # type: ignore[dict-item]
    assert isinstance(store, ObjectBlobStore)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"region": None}, "storage option 'region' must be a str .* got NoneType None"),
        ({"region": 1.5}, "storage option 'region' must be a str .* got float 1.5"),
        ({"endpoint": b"http://x"}, "storage option 'endpoint' must be a str .* got bytes"),
        ({"allow_http": 1}, "'allow_http' must be 'true' or 'false' .* got int 1"),
        ({"allow_http": "yes"}, "'allow_http' must be 'true' or 'false' .* got str 'yes'"),
        ({"pool_max_idle_per_host": "many"}, "must be an int >= 0; got str 'many'"),
        ({"": "x"}, "storage option names must be non-empty str"),
        # found by review: the client's own words were "builder error", at the first request
        ({"endpoint": "http://127.0.0.1:9000"}, "'endpoint' is a plain http:// URL.*allow_http"),
        ({"aws_endpoint": "HTTP://x", "allow_http": "false"}, "'aws_endpoint' is a plain http"),
    ],
)
def test_a_bad_value_names_the_option_and_what_was_found(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        open_blob_store("s3://bucket/p", options)  # type: ignore[arg-type]


def test_a_bad_secret_value_is_not_shown() -> None:
    with pytest.raises(ValueError, match="'secret_access_key' must be a str") as info:
        open_blob_store("s3://bucket/p", {"secret_access_key": [SECRET]})  # type: ignore[dict-item]
    assert "got list (value hidden" in str(info.value)
    assert SECRET not in full_text(info.value)


# -- names -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uri", "name", "listed", "hint"),
    [
        ("s3://bucket/p", "secret_acess_key", "secret_access_key", "secret_access_key"),
        ("gs://bucket/p", "service_acount_key", "service_account_key", "service_account_key"),
        ("az://container/p", "acount_name", "account_name", "account_name"),
        ("s3://bucket/p", "timout", "endpoint", "timeout"),
    ],
)
def test_an_unknown_option_lists_what_the_store_takes(
    uri: str, name: str, listed: str, hint: str
) -> None:
    with pytest.raises(ValueError, match=f"unknown storage option '{name}'") as info:
        open_blob_store(uri, {name: SECRET})
    message = str(info.value)
    assert f"did you mean '{hint}'?" in message
    assert listed in message
    assert "allow_http" in message  # the HTTP client options are listed too
    assert SECRET not in full_text(info.value)


@pytest.mark.parametrize("scheme", sorted(STORE_KEYS))
def test_every_listed_option_is_one_obstore_knows(scheme: str) -> None:
    """The names an unknown-option message lists are still names obstore takes."""
    _, names = STORE_KEYS[scheme]
    for name in sorted(names):
        try:
            open_blob_store(f"{scheme}://bucket/p", {name: "x"})
        except ValueError as exc:
            assert "unknown storage option" not in str(exc), name  # noqa: PT017


# -- values obstore parses, and URLs -------------------------------------------------------------

S3_CREDENTIALS = {"access_key_id": "a", "secret_access_key": "b", "region": "us-east-1"}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("conditional_put", "maybe"),  # obstore: 'Failed to parse "maybe" as S3PutConditional'
        ("copy_if_not_exists", "x"),
        ("checksum_algorithm", "md7"),  # obstore: '"md7" is not a valid checksum algorithm'
        ("server_side_encryption", "rot13"),  # obstore: 'Invalid encryption type: rot13. ...'
    ],
)
def test_a_value_obstore_cannot_parse_names_the_option(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"storage option '{name}' must be") as info:
        open_blob_store("s3://bucket/p", {**S3_CREDENTIALS, name: value})
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    ("uri", "name", "value"),
    [
        ("s3://bucket/p", "endpoint", "not a url"),
        ("s3://bucket/p", "endpoint", "127.0.0.1:9000"),  # no scheme: obstore takes it, then fails
        ("s3://bucket/p", "AWS_ENDPOINT_URL", "ftp://host"),
        ("s3://bucket/p", "endpoint", "http://[::1"),
        ("s3://bucket/p", "proxy_url", "not a url"),
        ("gs://bucket/p", "base_url", "http://"),
        ("az://container/p", "authority_host", "login"),
    ],
)
def test_a_url_option_must_be_an_http_url(uri: str, name: str, value: str) -> None:
    # Checked before any request: obstore would accept most of these and fail later, on the
    # first request, with an error naming neither the option nor the value.
    with pytest.raises(ValueError, match=f"storage option '{name}' must be an http") as info:
        open_blob_store(uri, {name: value})
    assert repr(value) in str(info.value)


def test_a_url_option_takes_http_and_https_urls() -> None:
    for endpoint in ("http://127.0.0.1:9000", "https://s3.example.com/", "HTTP://[::1]:9000"):
        options = {**S3_CREDENTIALS, "endpoint": endpoint, "allow_http": "true"}
        store = open_blob_store("s3://bucket/p", options)
        assert isinstance(store, ObjectBlobStore)
        store.close()
