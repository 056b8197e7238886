"""Long run: does a store stay the same size and speed after thousands of commits?

One store takes ``--commits`` commits of ``--keys-per-commit`` changed keys each (100-byte
values) with the default retention (a background snapshot every 10 versions, 100 versions
retained, GC after every snapshot), on the local filesystem. Every ``--window`` commits it
reports what a long-running query accumulates: the manifests in the root (count, total and
newest size), the versions and retired snapshots the newest manifest names, the background
snapshots that failed, and the commit latency of the window (p50 / p99). At the end, GC
runs twice as if ``MANIFEST_GRACE_S`` had passed (the benchmark is shorter than the 15
minutes a superseded manifest is kept), to show what a store in its steady state holds.

A bounded store has a flat newest-manifest size, version count and commit latency from the
first window to the last. Before manifests were bounded (commit 61bdfae), the same loop
reached 1 MB manifests, 2,000 retained versions, 36 failed snapshots and 35 ms commits
after 5,000 commits.

    .venv/bin/python benchmarks/longrun.py [--commits 5000] [--window 1000] [--keys-per-commit 1]
"""

from __future__ import annotations

import argparse
import json
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
from statekeeper import layout
from statekeeper.cli._render import percentile
from statekeeper.gc import collect_garbage
from statekeeper.manifest import MANIFEST_GRACE_S

VALUE_SIZE = 100
OPERATOR = "longrun"


class _FailedSnapshots(logging.Handler):
    """Counts the background snapshots that failed (logged, never raised to the commit)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "background snapshot" in record.getMessage():
            self.count += 1


def _manifests(backend: sk.StateBackend) -> dict[str, Any]:
    metas = backend.blobs.list(layout.manifest_prefix(OPERATOR, 0))
    newest = max(metas, key=lambda m: layout.parse_manifest_key(m.key) or 0)
    doc = json.loads(backend.blobs.get(newest.key))
    return {
        "manifests": len(metas),
        "manifests_mb": round(sum(m.size for m in metas) / 1e6, 2),
        "newest_manifest_kb": round(newest.size / 1e3, 1),
        "versions_named": len(doc["versions"]),
        "retired_named": len(doc.get("retired", [])),
    }


def run(commits: int, window: int, keys_per_commit: int, workdir: Path) -> dict[str, Any]:
    failed = _FailedSnapshots()
    logging.getLogger("statekeeper").addHandler(failed)
    config = sk.StoreConfig(local_dir=str(workdir / "local"))
    backend = sk.StateBackend(str(workdir / "root"), config=config)
    windows: list[dict[str, Any]] = []
    started = time.perf_counter()
    with backend, backend.open(OPERATOR, 0, partitions=1) as store:
        latencies: list[float] = []
        for v in range(1, commits + 1):
            for i in range(keys_per_commit):
                store.put(
                    b"key:%08d" % ((v * keys_per_commit + i) % 100_000), os.urandom(VALUE_SIZE)
                )
            t = time.perf_counter()
            store.commit()
            latencies.append((time.perf_counter() - t) * 1000)
            if v % window == 0 or v == commits:
                backend.wait_for_snapshots()
                row = {"after_commits": v, **_manifests(backend)}
                row["failed_snapshots"] = failed.count
                row["commit_p50_ms"] = round(percentile(latencies, 50), 2)
                row["commit_p99_ms"] = round(percentile(latencies, 99), 2)
                windows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                latencies = []
        elapsed = time.perf_counter() - started
        meta = backend.root_metadata()
    with sk.StateBackend(str(workdir / "root"), config=config) as backend:
        deleted = 0
        for _ in range(2):  # the second run deletes the manifest the first one's base move
            report = collect_garbage(  # superseded (a manifest GC writes is new, like any)
                backend.blobs, config, [OPERATOR], now=time.time() + MANIFEST_GRACE_S + 1,
                root_id="" if meta is None else meta.root_id,
            )  # fmt: skip
            deleted += len(report.deleted_keys)
        steady = _manifests(backend)
    logging.getLogger("statekeeper").removeHandler(failed)
    first, last = windows[0], windows[-1]

    def first_last(field: str) -> list[Any]:
        return [first[field], last[field]]

    return {
        "windows": windows,
        "after_grace": {**steady, "blobs_deleted_by_gc": deleted},
        "seconds": round(elapsed, 1),
        "flat": {
            "newest_manifest_kb_first_last": [
                first["newest_manifest_kb"],
                last["newest_manifest_kb"],
            ],
            "versions_named_first_last": [first["versions_named"], last["versions_named"]],
            "commit_p50_ms_first_last": [first["commit_p50_ms"], last["commit_p50_ms"]],
            "failed_snapshots": last["failed_snapshots"],
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commits", type=int, default=5000)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--keys-per-commit", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    for name in ("commits", "window", "keys_per_commit"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be 1 or more, got {getattr(args, name)}")
    with tempfile.TemporaryDirectory(prefix="sk-longrun-") as tmp:
        results = run(args.commits, args.window, args.keys_per_commit, Path(tmp))
    summary = {
        "benchmark": "longrun",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "workload": {
            "commits": args.commits,
            "window": args.window,
            "keys_per_commit": args.keys_per_commit,
            "value_bytes": VALUE_SIZE,
            "config": "defaults: snapshot_every=10, retain_versions=100, orphan_ttl_s=7 days",
        },
        "conditions": "local filesystem root, one store, one process; commit latency per window",
        **results,
    }
    emit(summary, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
