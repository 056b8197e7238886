"""Commit cost against state size: does a commit cost what changed, not what is stored?

For each state size (default 100k and 1M keys of 100-byte values) the benchmark loads the
state, then measures commits that each update 10,000 existing keys with new 100-byte values
(random bytes: the worst case for compression). It prints one JSON document comparing the
sizes side by side:

* ``commit_p50_ms`` / ``commit_p99_ms``: latency of ``StateStore.commit()``;
* ``bytes_uploaded_per_commit`` against ``raw_bytes_per_commit`` (keys + values changed).

Targets (issue 2): p50 at 1M within 1.3x of p50 at 100k; bytes uploaded <= 1.2x raw bytes.

    .venv/bin/python benchmarks/commit.py [--sizes 100000 1000000] [--commits 40] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import statekeeper as sk

KEY_FMT = b"user:%012d"
VALUE_SIZE = 100
UPDATED_KEYS = 10_000
LOAD_BATCH = 200_000


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def _load(store: sk.StateStore, size: int) -> None:
    for start in range(0, size, LOAD_BATCH):
        for i in range(start, min(size, start + LOAD_BATCH)):
            store.put(KEY_FMT % i, os.urandom(VALUE_SIZE))
        store.commit()


def run_size(size: int, commits: int, workdir: Path, seed: int) -> dict[str, Any]:
    """Load ``size`` keys, then time ``commits`` commits of 10k updated keys each."""
    config = sk.StoreConfig(local_dir=str(workdir / "local"))
    rng = random.Random(seed)
    backend = sk.StateBackend(str(workdir / "root"), config=config)
    with backend, backend.open("bench", partition=0, partitions=1) as store:
        started = time.perf_counter()
        _load(store, size)
        load_s = time.perf_counter() - started
        latencies, uploaded, raw = [], [], []
        for _ in range(commits):
            for i in rng.sample(range(size), UPDATED_KEYS):
                store.put(KEY_FMT % i, os.urandom(VALUE_SIZE))
            info = store.commit()
            latencies.append(info.duration_s * 1000)
            uploaded.append(info.bytes_uploaded)
            raw.append(info.raw_bytes)
    return {
        "state_keys": size,
        "load_s": round(load_s, 2),
        "commits": commits,
        "updated_keys_per_commit": UPDATED_KEYS,
        "commit_p50_ms": round(_percentile(latencies, 0.50), 2),
        "commit_p99_ms": round(_percentile(latencies, 0.99), 2),
        "commit_mean_ms": round(statistics.fmean(latencies), 2),
        "bytes_uploaded_per_commit": round(statistics.fmean(uploaded)),
        "raw_bytes_per_commit": round(statistics.fmean(raw)),
        "upload_to_raw_ratio": round(sum(uploaded) / sum(raw), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--commits", type=int, default=40)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    results = []
    for size in args.sizes:
        with tempfile.TemporaryDirectory(prefix="sk-bench-commit-") as tmp:
            results.append(run_size(size, args.commits, Path(tmp), seed=size))
        print(f"done: {results[-1]}", file=sys.stderr)
    small, large = results[0], results[-1]
    summary = {
        "benchmark": "commit",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "results": results,
        "p50_ratio_largest_to_smallest": round(large["commit_p50_ms"] / small["commit_p50_ms"], 3),
        "targets": {"p50_ratio_max": 1.3, "upload_to_raw_ratio_max": 1.2},
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
