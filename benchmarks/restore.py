"""Restore time: how long does a restart take, and what does reuse of a local copy save?

One store of ``--keys`` keys (100-byte values) is written as ``--versions`` commits with a
snapshot at the end plus ``--tail`` further commits, then opened these ways, side by side in
one run:

* ``local_current``: the local working copy is at the latest version (a clean restart);
* ``local_behind``: the local copy missed the last ``--tail`` commits (a hard crash);
* ``cold_snapshot``: a fresh local directory: snapshot download + changelog replay, from a
  root on the local filesystem whose files are in the page cache (they were just written);
* ``cold_snapshot_uncached``: the same, after every file of the root was evicted from the
  page cache (``posix_fadvise(DONTNEED)``, no root privileges needed): the root is read from
  the disk (on a virtual machine the host may still serve it from its own cache);
* ``cold_snapshot_s3``: the same root copied into an S3 bucket served by moto on loopback
  (started by the benchmark; objects in moto's memory, so this measures the S3 protocol path:
  HTTP requests, ranged GETs, moto's own cost; not a remote network);
* ``cold_changelogs``: a fresh local directory on a root with no snapshot: replay of every
  changelog (what restore costs without snapshots).

    .venv/bin/python benchmarks/restore.py [--keys 1000000] [--versions 20] [--tail 5] [--no-s3]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _output import emit

import statekeeper as sk
from statekeeper.storage import open_blob_store

VALUE_SIZE = 100


def _write(root: Path, local: Path, keys: int, versions: int, tail: int, snapshot: bool) -> None:
    config = sk.StoreConfig(local_dir=str(local), snapshot_every=10**9)
    per_version = max(1, keys // versions)
    backend = sk.StateBackend(str(root), config=config)
    with backend, backend.open("bench", 0, partitions=1) as store:
        for v in range(versions):
            for i in range(v * per_version, min(keys, (v + 1) * per_version)):
                store.put(b"user:%012d" % i, os.urandom(VALUE_SIZE))
            store.commit()
        if snapshot:
            store.snapshot_now()
        for t in range(tail):
            for i in range(t * 1000, (t + 1) * 1000):
                store.put(b"user:%012d" % i, os.urandom(VALUE_SIZE))
            store.commit()


def _open(
    root: Path | str, local: Path, storage_options: dict[str, str] | None = None
) -> dict[str, Any]:
    config = sk.StoreConfig(local_dir=str(local))
    started = time.perf_counter()
    backend = sk.StateBackend(str(root), config=config, storage_options=storage_options)
    with backend, backend.open("bench", 0) as store:
        elapsed = time.perf_counter() - started
        info = store.restore_info
        return {
            "seconds": round(elapsed, 3),
            "base_kind": info.base_kind,
            "changelogs_replayed": info.changelogs_replayed,
            "bytes_downloaded": info.bytes_downloaded,
            "files_downloaded": info.files_downloaded,
            "files_reused": info.files_reused,
        }


def run(keys: int, versions: int, tail: int, workdir: Path, *, s3: bool) -> dict[str, Any]:
    """Build both roots, then time the ways of opening."""
    results: dict[str, Any] = {}
    snap_root, plain_root = workdir / "snap-root", workdir / "plain-root"
    writer_local = workdir / "writer"
    _write(snap_root, writer_local, keys, versions, tail, snapshot=True)
    results["local_current"] = _open(snap_root, writer_local)
    results["cold_snapshot"] = _open(snap_root, workdir / "cold1")
    evicted = _evict_page_cache(snap_root)
    results["cold_snapshot_uncached"] = {
        **_open(snap_root, workdir / "cold1u"),
        "files_evicted": evicted,
    }
    if s3:
        uri, options, stop = _s3_copy(snap_root)
        try:
            results["cold_snapshot_s3"] = _open(uri, workdir / "cold1s3", options)
        finally:
            stop()
    _write(plain_root, workdir / "writer2", keys, versions, tail, snapshot=False)
    results["cold_changelogs"] = _open(plain_root, workdir / "cold2")
    results["local_behind"] = _open_behind(snap_root, workdir, tail)
    return results


def _open_behind(root: Path, workdir: Path, tail: int) -> dict[str, Any]:
    """A copy that missed the tail (built at the snapshot version), then caught up."""
    local = workdir / "behind-copy"
    latest = sk.StateBackend(str(root)).versions("bench", 0)[-1]
    with sk.StateBackend(str(root), config=sk.StoreConfig(local_dir=str(local))) as backend:
        backend.open("bench", 0, version=latest - tail).close()
    return _open(root, local)


def _evict_page_cache(root: Path) -> int:
    """Drop the root's files from the page cache; the count of files. They are clean (the
    blob store fsyncs every blob), so ``POSIX_FADV_DONTNEED`` evicts them."""
    count = 0
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            count += 1
    return count


def _s3_copy(root: Path) -> tuple[str, dict[str, str], Any]:
    """Start moto's S3 server on a free loopback port and copy ``root`` into a bucket there:
    ``(uri, storage_options, stop)``."""
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError as exc:  # pragma: no cover - make installs the test extra
        raise SystemExit(
            f"the S3 restore needs moto[server] and boto3 ({exc}); install the test extra "
            "(make does) or pass --no-s3"
        ) from exc
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    credentials = {"access_key_id": "bench", "secret_access_key": "bench", "region": "us-east-1"}
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=credentials["access_key_id"],
        aws_secret_access_key=credentials["secret_access_key"],
        region_name=credentials["region"],
    ).create_bucket(Bucket="bench")
    options = {**credentials, "endpoint": endpoint, "allow_http": "true"}
    uri = "s3://bench/root"
    source = open_blob_store(str(root))
    target = open_blob_store(uri, options)
    for meta in source.list():
        target.put(meta.key, source.get(meta.key))
    source.close()
    target.close()
    return uri, options, server.stop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--versions", type=int, default=20)
    parser.add_argument("--tail", type=int, default=5)
    parser.add_argument(
        "--no-s3", action="store_true", help="skip the restore from S3 (moto on loopback)"
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sk-bench-restore-") as tmp:
        results = run(args.keys, args.versions, args.tail, Path(tmp), s3=not args.no_s3)
    summary = {
        "benchmark": "restore",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "state": {
            "keys": args.keys,
            "value_bytes": VALUE_SIZE,
            "versions": args.versions + args.tail,
        },
        "conditions": {
            "root": "local filesystem (cold_snapshot_s3: moto S3 on loopback)",
            "page_cache": "warm except cold_snapshot_uncached: the root evicted from this "
            "machine's page cache before the open (a virtual disk may still be cached by its host)",
        },
        "results": results,
    }
    emit(summary, args.out)
    print("done", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
