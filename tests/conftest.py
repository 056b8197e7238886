"""Shared fixtures: blob store roots on the local filesystem and on loopback S3, GCS and Azure
emulators (moto, fake-gcs-server, Azurite), each started once per session on a free port."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import settings

if TYPE_CHECKING:
    from tests.storage.emulators import Azurite, FakeGcs

# Property tests share one process with Spark and pandas: an example slowed by the machine
# (a garbage-collection pause, a loaded CI runner) must not fail on time, which is the
# benchmarks' business. Examples that failed are kept in .hypothesis/ (ignored by git).
settings.register_profile("statekeeper", deadline=None)
settings.load_profile("statekeeper")

# Fake credentials of the moto server; moto accepts any.
S3_ACCESS_KEY = "testing"
S3_SECRET_KEY = "testing"
S3_REGION = "us-east-1"


@dataclass(frozen=True)
class S3Server:
    """A running moto S3 server on loopback."""

    endpoint: str

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (explicit endpoint and credentials: nothing from the env)."""
        self._client().create_bucket(Bucket=name)

    def put_object(self, bucket: str, key: str, data: bytes) -> None:
        """Put an object as another tool would (statekeeper's key rules do not apply)."""
        self._client().put_object(Bucket=bucket, Key=key, Body=data)

    def _client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=S3_ACCESS_KEY,
            aws_secret_access_key=S3_SECRET_KEY,
            region_name=S3_REGION,
        )


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A moto S3 server on 127.0.0.1 and a free port, for the whole test session."""
    # Imported here so that runs without S3 tests do not pay for importing moto.
    from moto.server import ThreadedMotoServer

    # werkzeug logs one line per request to stderr; keep test output readable.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield S3Server(endpoint=f"http://{host}:{port}")
    finally:
        server.stop()


@pytest.fixture
def s3_root(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, str]]:
    """A fresh bucket: ``("s3://<bucket>/root", storage_options)`` for ``open_blob_store``.

    Every ``AWS_*`` environment variable is removed for the test, since obstore reads them
    (a developer's session token or endpoint must not leak into the tests).
    """
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    bucket = f"sk-test-{uuid.uuid4().hex[:16]}"
    s3_server.create_bucket(bucket)
    options = {
        "endpoint": s3_server.endpoint,
        "access_key_id": S3_ACCESS_KEY,
        "secret_access_key": S3_SECRET_KEY,
        "region": S3_REGION,
        "allow_http": "true",
    }
    return f"s3://{bucket}/root", options


@pytest.fixture
def local_root(tmp_path: Path) -> tuple[str, dict[str, str]]:
    """A not yet existing folder under ``tmp_path``: ``(path, {})`` for ``open_blob_store``."""
    return str(tmp_path / "root"), {}


def _clear_cloud_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove every variable obstore would read for GCS or Azure (a developer's must not count)."""
    from tests.storage.emulators import emulator_env_names

    for name in emulator_env_names():
        monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[FakeGcs]:
    """fake-gcs-server (in memory) on 127.0.0.1, behind its XML PUT bridge, for the session."""
    from tests.storage.emulators import FakeGcs

    server = FakeGcs()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def gcs_root(gcs_server: FakeGcs, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, str]]:
    """A fresh bucket: ``("gs://<bucket>/root", storage_options)`` for ``open_blob_store``."""
    from tests.storage.emulators import gcs_service_account_key, new_name

    _clear_cloud_env(monkeypatch)
    bucket = new_name("sk-test")
    gcs_server.create_bucket(bucket)
    options = {
        "service_account_key": gcs_service_account_key(gcs_server.endpoint),
        "allow_http": "true",
    }
    return f"gs://{bucket}/root", options


@pytest.fixture(scope="session")
def azurite_server() -> Iterator[Azurite]:
    """Azurite's blob service (in memory) on 127.0.0.1 and a port it picks, for the session."""
    from tests.storage.emulators import Azurite

    server = Azurite()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def azure_root(
    azurite_server: Azurite, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, dict[str, str]]:
    """A fresh container: ``("az://<container>/root", storage_options)``."""
    from tests.storage.emulators import AZURITE_ACCOUNT, AZURITE_KEY, new_name

    _clear_cloud_env(monkeypatch)
    container = new_name("sk-test")
    azurite_server.create_container(container)
    options = {
        "endpoint": azurite_server.endpoint,
        "account_name": AZURITE_ACCOUNT,
        "account_key": AZURITE_KEY,
        "allow_http": "true",
    }
    return f"az://{container}/root", options
