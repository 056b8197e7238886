"""Suite ``s3``: a writer commits through a failing proxy in front of a moto S3 server.

Each trial draws a mode and a fault rate; :class:`tests.faults.proxy.FailingProxy` fails that
fraction of requests (5xx replies, dropped connections, lost replies, delays, stalls past the
client's timeout). The writer makes ``COMMITS`` commit attempts with the library's retries;
a commit that fails must raise StorageError (TransientStorageError included) or
CommitConflictError, after which the writer closes the store and opens it again (a failed
open counts the same way). Any other exception fails the trial. Then a fresh host, through a
clean endpoint, checks: the newest version is at least the last acknowledged one and at
most the last attempted; it and every retained version open with exactly their content;
the newest ``RETAIN`` versions are all there (an acknowledged version older than those may
have been collected: a commit that raised may have landed); ``verify(deep=True)`` finds no
problem.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import uuid
from collections import Counter
from pathlib import Path

import statekeeper as sk
from statekeeper.storage import RetryPolicy, open_blob_store
from tests.faults.common import Trial, apply, expected, read_all
from tests.faults.proxy import FailingProxy

NAME = "s3"
EXPECTED = "commit ok or storage error; acked exact"
OPERATOR = "s3"
COMMITS = 12
RETAIN = 5
ALLOWED = (sk.StorageError, sk.CommitConflictError)
_CREDENTIALS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}
_SERVER: dict[str, str] = {}


def moto_endpoint() -> str:
    """A moto S3 server on a free loopback port, started once per process."""
    if "endpoint" not in _SERVER:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        for name in [n for n in os.environ if n.startswith("AWS_")]:
            del os.environ[name]  # a developer's credentials or endpoint must not count
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        atexit.register(server.stop)
        host, port = server.get_host_and_port()
        _SERVER["endpoint"] = f"http://{host}:{port}"
    return _SERVER["endpoint"]


def _bucket(endpoint: str) -> str:
    import boto3

    name = f"sk-faults-{uuid.uuid4().hex[:16]}"
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")  # fmt: skip
    client.create_bucket(Bucket=name)
    return name


def _options(endpoint: str) -> dict[str, str]:
    return {**_CREDENTIALS, "endpoint": endpoint, "allow_http": "true", "timeout": "1s"}


def config(local: Path, mode: str) -> sk.StoreConfig:
    return sk.StoreConfig(
        local_dir=str(local), mode=mode,  # type: ignore[arg-type]
        snapshot_every=4, retain_versions=RETAIN, write_buffer_mb=1, io_threads=2,
    )  # fmt: skip


class _Writer:
    """Commits through the proxy; counts the errors each step raised."""

    def __init__(self, uri: str, endpoint: str, local: Path, mode: str) -> None:
        self.uri, self.endpoint, self.local, self.mode = uri, endpoint, local, mode
        self.errors: Counter[str] = Counter()
        self.acks: list[int] = []
        self.attempted = 0
        self.backend: sk.StateBackend | None = None
        self.store: sk.StateStore | None = None

    def _connect(self) -> sk.StateStore:
        if self.backend is None:
            retry = RetryPolicy(max_attempts=4, base_delay_s=0.01, max_delay_s=0.2)
            blobs = open_blob_store(self.uri, _options(self.endpoint), io_threads=2, retry=retry)
            try:
                self.backend = sk.StateBackend(blobs, config=config(self.local, self.mode))
            except BaseException:
                blobs.close()
                raise
        if self.store is None:
            self.store = self.backend.open(OPERATOR, 0, partitions=1)
        return self.store

    def step(self) -> None:
        """One commit attempt (opening first if needed); every 4th ack also runs a gc."""
        try:
            store = self._connect()
            version = store.version + 1
            apply(store, version)
            self.attempted = max(self.attempted, version)
            self.acks.append(store.commit().version)
            if len(self.acks) % 4 == 0 and self.backend is not None:
                self.backend.gc()
        except ALLOWED as exc:
            self.errors[type(exc).__name__] += 1
            self._close_store()

    def _close_store(self) -> None:
        if self.store is not None:
            try:
                self.store.close()
            except ALLOWED as exc:
                self.errors[f"close {type(exc).__name__}"] += 1
            self.store = None

    def finish(self) -> None:
        self._close_store()
        if self.backend is not None:
            try:
                self.backend.wait_for_snapshots()
                self.backend.close()
            except ALLOWED as exc:
                self.errors[f"close {type(exc).__name__}"] += 1


def _check(trial: Trial, uri: str, endpoint: str, local: Path, writer: _Writer) -> None:
    last_ack = writer.acks[-1] if writer.acks else 0
    with sk.StateBackend(uri, config=config(local, writer.mode),
                         storage_options=_options(endpoint)) as backend:  # fmt: skip
        with backend.open(OPERATOR, 0) as store:
            latest = store.version
            newest = max(writer.attempted, last_ack)
            trial.check(last_ack <= latest <= newest, f"latest {latest}, acked {writer.acks}")
            trial.check(read_all(store) == expected(OPERATOR, 0, latest), f"latest {latest} wrong")
        for version in backend.versions(OPERATOR, 0)[-RETAIN:]:
            with backend.open(OPERATOR, 0, version=version) as store:
                if read_all(store) != expected(OPERATOR, 0, version):
                    trial.fail(f"version {version} opens with wrong content")
        # The newest RETAIN versions stay restorable, acknowledged or not (a commit that
        # raised may have landed): older acknowledged ones may be collected.
        held = set(backend.versions(OPERATOR, 0))
        missing = sorted(set(range(max(1, latest - RETAIN + 1), latest + 1)) - held)
        trial.check(not missing, f"retained versions missing: {missing}, acked {writer.acks}")
        report = backend.verify(deep=True)
        trial.check(report.ok, f"verify: {[p.message for p in report.problems][:3]}")


def run_trial(seed: int, work: Path) -> Trial:
    rng = random.Random(f"{NAME}-{seed}")
    mode, rate = rng.choice(["changelog", "snapshot"]), rng.choice([0.05, 0.15, 0.3])
    trial = Trial(NAME, seed, attack=f"{mode}, {rate:.0%} of requests fail")
    moto = moto_endpoint()
    uri = f"s3://{_bucket(moto)}/root"
    proxy = FailingProxy(moto, seed=rng.randrange(2**32), rate=rate, stall_s=1.2)
    writer = _Writer(uri, proxy.endpoint, work / "writer", mode)
    try:
        for _ in range(COMMITS):
            writer.step()
        writer.finish()
    finally:
        proxy.stop()
    _check(trial, uri, moto, work / "fresh", writer)
    errors = ", ".join(f"{name} {n}" for name, n in sorted(writer.errors.items()))
    raised = sorted({name.removeprefix("close ") for name in writer.errors})
    trial.observed = "all committed" if not raised else "raised " + "+".join(raised)
    trial.notes.append(f"proxy faults {dict(proxy.faults)}; errors {errors or 'none'}")
    return trial
