"""A real checkpoint root with known contents, on the local filesystem or on S3 (moto).

``counts`` (changelog mode, 2 partitions, a snapshot every 3 versions): partition 0 has
versions 1-7 with snapshots 3 and 6, partition 1 one version holding binary keys;
``snap`` (snapshot mode, 1 partition) has versions 1-3.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import statekeeper as sk
from statekeeper import layout
from statekeeper.cli import cli
from statekeeper.history import RootListing, StoreHistory
from statekeeper.storage import BlobStore, open_blob_store

Store = tuple[str, int]


@dataclass
class Built:
    """A built root, what it holds at every version, and what each commit wrote."""

    uri: str
    options: dict[str, str]
    states: dict[Store, list[dict[bytes, bytes]]] = field(default_factory=dict)
    commits: dict[Store, dict[int, sk.CommitInfo]] = field(default_factory=dict)

    @property
    def opts(self) -> list[str]:
        """``--storage-option`` arguments for this root."""
        return [arg for k, v in self.options.items() for arg in ("-o", f"{k}={v}")]

    def blobs(self) -> BlobStore:
        """A fresh blob store over the root (close it)."""
        return open_blob_store(self.uri, self.options or None)

    def backend(self, local_dir: Path) -> sk.StateBackend:
        """A backend over the root with its own working copies (close it)."""
        return sk.StateBackend(
            self.uri,
            config=sk.StoreConfig(local_dir=str(local_dir)),
            storage_options=self.options or None,
        )


def _commit(built: Built, store: sk.StateStore, model: dict[bytes, bytes | None]) -> None:
    for key, value in model.items():
        if value is None:
            store.delete(key)
        else:
            store.put(key, value)
    info = store.commit()
    name = (store.operator, store.partition)
    state = dict(built.states[name][-1])
    for key, value in model.items():
        if value is None:
            state.pop(key, None)
        else:
            state[key] = value
    built.states[name].append(state)
    built.commits.setdefault(name, {})[info.version] = info


def build_root(uri: str, options: dict[str, str], work: Path) -> Built:
    """Write the root described in the module docstring and return what it holds."""
    built = Built(uri, options)
    for name in (("counts", 0), ("counts", 1), ("snap", 0)):
        built.states[name] = [{}]
    config = sk.StoreConfig(local_dir=str(work / "wc-build"), snapshot_every=3)
    with sk.StateBackend(uri, config=config, storage_options=options or None) as backend:
        with backend.open("counts", 0, partitions=2) as store:
            for v in range(1, 8):
                changes: dict[bytes, bytes | None] = {
                    b"k%03d" % i: b"v%d" % v for i in range(v, v + 10)
                }
                if v > 1:
                    changes[b"k%03d" % (v - 1)] = None
                _commit(built, store, changes)
                backend.wait_for_snapshots()
        with backend.open("counts", 1, partitions=2) as store:
            _commit(built, store, {b"\x00\x01": b"\xff\xfe", b"text": b"hello world"})
    snap_config = sk.StoreConfig(local_dir=str(work / "wc-snap"), mode="snapshot")
    with (
        sk.StateBackend(uri, config=snap_config, storage_options=options or None) as backend,
        backend.open("snap", 0, partitions=1) as store,
    ):
        for v in range(1, 4):
            _commit(built, store, {b"x%d" % v: b"y" * 100 * v})
    # Commits record their latency in commit-metrics blobs; most tests here want a root
    # without them (as written by a crash before any was flushed), so they are removed.
    blobs = built.blobs()
    try:
        blobs.delete_many([m.key for m in blobs.list("") if layout.parse_metrics_key(m.key)])
    finally:
        blobs.close()
    return built


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Built:
    """The built root, once on the local filesystem and once on S3."""
    if request.param == "s3":
        uri, options = request.getfixturevalue("s3_root")
    else:
        uri, options = str(tmp_path / "root"), {}
    return build_root(uri, options, tmp_path)


@pytest.fixture
def local(tmp_path: Path) -> Built:
    """The built root on the local filesystem only."""
    return build_root(str(tmp_path / "root"), {}, tmp_path)


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    """Invoke the command line as a user would (unexpected exceptions propagate)."""
    runner = CliRunner()
    return runner.invoke(
        cli, list(args), env={"COLUMNS": "200", **(env or {})}, catch_exceptions=False
    )


def one_error_line(result: Result) -> str:
    """The single stderr line of a failed command (asserts there is exactly one)."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("statekeeper: error: "), lines[0]
    assert "Traceback" not in result.output
    return lines[0]


def flip(blobs: BlobStore, key: str, offset: int) -> None:
    """Flip every bit of one byte of a blob, in place."""
    data = bytearray(blobs.get(key))
    data[offset] ^= 0xFF
    blobs.put(key, bytes(data), overwrite=True)


def history_of(blobs: BlobStore, operator: str, partition: int) -> StoreHistory:
    """The store's history as its newest manifest states it (the blob key of each version)."""
    root_id = str(json.loads(blobs.get(layout.ROOT_METADATA))["rootId"])
    return RootListing.of(blobs, root_id=root_id).history(operator, partition)


def keys_of(blobs: BlobStore, prefix: str) -> list[str]:
    """Keys under ``prefix``."""
    return [m.key for m in blobs.list(prefix)]
