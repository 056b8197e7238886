"""Credentials never appear in repr, logs, errors or anything written to the root."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

import statekeeper as sk
from statekeeper.storage import open_blob_store

SECRET = "SUPERSECRET-d41d8cd98f00b204"
ENV_SECRET = "ENVSECRET-9e107d9d372bb682"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.s3
def test_credentials_never_leak(
    s3_root: tuple[str, dict[str, str]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    uri, options = s3_root
    options = {**options, "secret_access_key": SECRET}  # moto accepts any secret
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ENV_SECRET)
    texts: list[str] = []
    config = sk.StoreConfig(local_dir=str(tmp_path / "l"), snapshot_every=2, orphan_ttl_s=0)
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
        for error_call in (
            lambda: backend.open("op", 0, version=99),
            lambda: sk.StateBackend(uri, storage_options={**options, "no_such_key": "x"}),
            lambda: sk.StateBackend(
                uri,
                storage_options={**options, "endpoint": f"http://127.0.0.1:{_closed_port()}"},
            ),
            # Found by review: a password in a URL option was in the error and every retry
            # warning (an endpoint or proxy with user:password@)
            lambda: sk.StateBackend(
                uri,
                storage_options={
                    **options,
                    "endpoint": f"http://user:{SECRET}@127.0.0.1:{_closed_port()}",
                },
            ),
            lambda: sk.StateBackend(
                uri, storage_options={**options, "endpoint": f"ftp://user:{SECRET}@host"}
            ),
        ):
            with pytest.raises((sk.StateKeeperError, ValueError)) as excinfo:
                error_call()
            texts += [str(excinfo.value), repr(excinfo.value)]
            cause = excinfo.value.__cause__
            texts.append(str(cause) if cause else "")
    texts += [record.getMessage() for record in caplog.records]
    texts += [str(record.args) for record in caplog.records]
    blobs = open_blob_store(uri, options)
    written = [blobs.get(meta.key) for meta in blobs.list("")]
    assert len(written) > 5
    for secret in (SECRET, ENV_SECRET):
        assert not [t for t in texts if secret in t]
        assert not [w for w in written if secret.encode() in w]
