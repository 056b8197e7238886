"""GCS and Azure credentials never appear in repr, logs, errors or anything written to the root.

The S3 twin of these tests is ``tests/test_security.py``.
"""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

import statekeeper as sk
from statekeeper.storage import RetryPolicy, open_blob_store
from tests.storage.emulators import free_port

SECRET = "SUPERSECRET-d41d8cd98f00b204"
ENV_SECRET = "ENVSECRET-9e107d9d372bb682"


def with_gcs_secret(options: dict[str, str]) -> dict[str, str]:
    """The emulator's service account key, carrying SECRET in its key id (OAuth is off)."""
    key = json.loads(options["service_account_key"])
    return {**options, "service_account_key": json.dumps({**key, "private_key_id": SECRET})}


def gcs_pointing_at(options: dict[str, str], endpoint: str) -> dict[str, str]:
    key = json.loads(options["service_account_key"])
    return {**options, "service_account_key": json.dumps({**key, "gcs_base_url": endpoint})}


def azure_pointing_at(options: dict[str, str], endpoint: str) -> dict[str, str]:
    return {**options, "endpoint": f"{endpoint}/devstoreaccount1"}


CASES = {
    # root fixture, the option holding the credential, the env variable for the same
    # credential (the option must win, and neither may leak), how to repoint the store
    "gcs": ("gcs_root", "service_account_key", "GOOGLE_SERVICE_ACCOUNT_KEY", gcs_pointing_at),
    "azure": ("azure_root", "account_key", "AZURE_STORAGE_ACCOUNT_KEY", azure_pointing_at),
}


def full_text(error: BaseException) -> str:
    return "".join(traceback.format_exception(error))


@pytest.mark.parametrize(
    "cloud",
    [pytest.param("gcs", marks=pytest.mark.gcs), pytest.param("azure", marks=pytest.mark.azure)],
)
def test_credentials_never_leak(
    cloud: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fixture, secret_option, env_name, repoint = CASES[cloud]
    uri, options = request.getfixturevalue(fixture)
    # The secret to look for: in GCS a field inside the key; Azurite needs its real key.
    if cloud == "gcs":
        options = with_gcs_secret(options)
        secrets = [SECRET, ENV_SECRET, options[secret_option]]
    else:
        secrets = [options[secret_option], ENV_SECRET]
    monkeypatch.setenv(env_name, ENV_SECRET)  # given options win; the env must not leak either
    texts: list[str] = []
    config = sk.StoreConfig(local_dir=str(tmp_path / "l"), snapshot_every=2, orphan_ttl_s=0)
    closed = f"http://127.0.0.1:{free_port()}"
    error_calls: list[Callable[[], object]] = []
    with caplog.at_level(logging.DEBUG):
        backend = sk.StateBackend(uri, config=config, storage_options=options)
        texts += [repr(backend), str(backend.blobs.uri), repr(backend.blobs)]
        with backend.open("op", 0, partitions=1) as store:
            texts.append(repr(store))
            for v in range(5):
                store.put(b"k%d" % v, b"v")
                texts.append(repr(store.commit()))
        backend.wait_for_snapshots()
        texts += [repr(backend.gc()), repr(backend.verify(deep=True))]
        error_calls = [
            lambda: backend.open("op", 0, version=99),
            lambda: sk.StateBackend(uri, storage_options={**options, "no_such_key": "x"}),
            lambda: open_blob_store(
                uri, repoint(options, closed), retry=RetryPolicy(max_attempts=2, base_delay_s=0)
            ).get("a/b"),
        ]
        for error_call in error_calls:
            with pytest.raises((sk.StateKeeperError, ValueError)) as excinfo:
                error_call()
            texts += [full_text(excinfo.value), repr(excinfo.value)]
    texts += [record.getMessage() for record in caplog.records]
    texts += [str(record.args) for record in caplog.records]
    blobs = open_blob_store(uri, options)
    written = [blobs.get(meta.key) for meta in blobs.list("")]
    assert len(written) > 5
    assert any("retrying get 'a/b'" in record.getMessage() for record in caplog.records)
    for secret in secrets:
        assert not [t for t in texts if secret in t]
        assert not [w for w in written if secret.encode() in w]


@pytest.mark.gcs
def test_a_secret_field_of_a_service_account_key_is_scrubbed_when_echoed() -> None:
    """obstore echoes a value it cannot parse; here that value is also the key's private_key."""
    key = json.dumps(
        {
            "private_key": SECRET,
            "private_key_id": "id",
            "client_email": "a@b",
            "disable_oauth": True,
        }
    )
    # skip_signature holds the same text as the private key: obstore's "failed to parse"
    # message quotes it, and only the field (not the whole key) is in the message.
    with pytest.raises(ValueError, match="skip_signature") as info:
        open_blob_store("gs://bucket/p", {"service_account_key": key, "skip_signature": SECRET})
    assert SECRET not in full_text(info.value)
