"""Commit cost against state size: does a commit cost what changed, not what is stored?

For each state size (default 100k and 1M keys of 100-byte values) the benchmark loads the
state, then measures commits that each update ``--changed`` (10,000) existing keys with new
``--value-bytes`` (100) values (random bytes: the worst case for compression). It prints one
JSON document comparing the sizes side by side:

* ``commit_p50_ms`` / ``commit_p99_ms``: latency of ``StateStore.commit()`` alone, i.e.
  ``CommitInfo.duration_s``: from the call to its return (sorting and encoding the
  changes, compressing, checksumming, uploading the changelog and the manifest with their
  fsyncs; 0.1.0 also applies the changes to RocksDB before returning). The ``put`` calls
  between commits are not timed (they only fill the in-memory overlay). The current
  protocol writes the commit to the RocksDB working copy on a helper thread after
  ``commit()`` returns (every later use of the copy waits for it): that write overlaps
  the next commit's puts here, and a Spark task's end in a pipeline, so it is in neither
  figure, but it is in ``cycle_p50_ms``;
* ``cycle_p50_ms``: wall time of one whole round, the ``--changed`` puts and the commit:
  what the commit protocol costs end to end, the write behind it included;
* ``commit_cpu_p50_ms``: CPU time of the committing thread during ``commit()`` (excludes
  waiting for fsyncs and for other processes: the steadier figure on a shared machine);
* ``phases_p50_ms``: where that time went, per phase (``CommitInfo.phases_ms``: encode,
  compress, checksum, upload, fsync, apply, metrics, other), the median of each phase
  over the commits (so they need not add up to ``commit_p50_ms`` exactly);
* ``bytes_uploaded_per_commit`` against ``raw_bytes_per_commit`` (keys + values changed);
* ``requests_per_commit``: blob-store calls made inside ``commit()``, by kind (a ``put_many``
  of n blobs counts n PUTs);
* ``slowest_commits``: the three slowest commits with their phases (what the p99 is made of);
* ``peak_rss_mb``: the process's peak resident memory so far (``VmHWM``: loading included,
  and every size run before in this process), ``commit_rss_max_mb``: the largest resident
  memory seen after a timed commit; ``local_copy_mb`` / ``root_mb``: the working copy and
  the checkpoint root on disk after the run; ``load_average_1m``: the machine's load when
  the size finished (figures from a loaded machine are not comparable with a quiet one's).

The state is loaded through the store API, ``--load-batch`` keys per commit (200,000 by
default; a 50M-key store loads in 1M-key commits, each written and applied a changelog part
at a time), values cut from one random buffer per commit. Loading leaves compactions
behind; the timed commits run while RocksDB catches up, as a store that was just restored
or bulk-written would.

It runs twice, side by side: the working tree's commit protocol and statekeeper 0.1.0's (its
sources taken from git history by ``release.py``, run in a subprocess), so what the format-2
protocol adds to a commit is measured, not guessed. Background snapshots are off for the
request counts. Local filesystem root, warm page cache.

Targets (issue 2): p50 at 1M within 1.3x of p50 at 100k; bytes uploaded <= 1.2x raw bytes.

    .venv/bin/python benchmarks/commit.py [--sizes 100000 1000000] [--commits 40]
        [--changed 10000] [--value-bytes 100] [--load-batch 200000]
        [--protocols current 0.1.0] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from _output import emit
from release import RELEASE_0_1, extract

import statekeeper as sk
from statekeeper.storage import open_blob_store

KEY_FMT = b"user:%012d"
COUNTED = {"put", "get", "get_range", "head", "list", "delete_many"}
"""Blob-store calls counted one request each; ``put_many``/``get_many`` count per blob."""


class CountingBlobStore:
    """Delegates to a blob store and counts the requests made through it."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name in COUNTED:
            kind = name.upper()

            def counted(*args: Any, **kwargs: Any) -> Any:
                self.calls[kind] += 1
                return attr(*args, **kwargs)

            return counted
        if name in ("put_many", "get_many"):
            kind = "PUT" if name == "put_many" else "GET"

            def counted_many(items: Any, *args: Any, **kwargs: Any) -> Any:
                self.calls[kind] += len(items)
                return attr(items, *args, **kwargs)

            return counted_many
        return attr


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def _load(store: sk.StateStore, size: int, value_bytes: int, batch: int) -> None:
    put = store.put
    for start in range(0, size, batch):
        stop = min(size, start + batch)
        data = os.urandom(value_bytes * (stop - start))
        for offset, i in enumerate(range(start, stop)):
            at = offset * value_bytes
            put(KEY_FMT % i, data[at : at + value_bytes])
        store.commit()


def _memory_mb() -> tuple[float, float]:
    """Resident memory of this process now and at its peak (``VmRSS``, ``VmHWM``), MB."""
    fields = {}
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) / 1024
    return round(fields["VmRSS"], 1), round(fields["VmHWM"], 1)


def _disk_mb(folder: Path) -> float:
    total = 0
    for parent, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except FileNotFoundError:
                continue  # a temporary file of RocksDB's, gone meanwhile
    return round(total / 2**20, 1)


def _slowest(latencies: list[float], infos: list[Any], n: int = 3) -> list[dict[str, Any]]:
    """The ``n`` slowest commits and where their time went."""
    order = sorted(range(len(latencies)), key=latencies.__getitem__, reverse=True)[:n]
    return [
        {
            "ms": round(latencies[i], 2),
            "phases_ms": {
                k: round(v, 2) for k, v in (getattr(infos[i], "phases_ms", None) or {}).items()
            },
        }
        for i in order
    ]


def _phases_p50(infos: list[Any]) -> dict[str, float]:
    """Median of each phase over the commits (0.1.0 records none: empty)."""
    phases = [getattr(info, "phases_ms", None) or {} for info in infos]
    names = sorted({name for p in phases for name in p})
    return {name: round(statistics.median(p.get(name, 0.0) for p in phases), 2) for name in names}


def run_size(
    size: int,
    commits: int,
    workdir: Path,
    seed: int,
    *,
    changed: int,
    value_bytes: int,
    load_batch: int = 200_000,
) -> dict[str, Any]:
    """Load ``size`` keys, then time ``commits`` commits of ``changed`` updated keys each."""
    config = sk.StoreConfig(local_dir=str(workdir / "local"), snapshot_every=1_000_000)
    rng = random.Random(seed)
    (workdir / "root").mkdir()
    # open_blob_store and LocalBlobStore are public in 0.1.0 too, so both protocols run this.
    blobs = CountingBlobStore(open_blob_store(str(workdir / "root")))
    backend = sk.StateBackend(blobs, config=config)  # type: ignore[arg-type]
    with backend, backend.open("bench", partition=0, partitions=1) as store:
        started = time.perf_counter()
        _load(store, size, value_bytes, load_batch)
        load_s = time.perf_counter() - started
        latencies, uploaded, raw, infos, cpu, cycles = [], [], [], [], [], []
        rss_max = 0.0
        requests: Counter[str] = Counter()
        for _ in range(commits):
            keys = rng.sample(range(size), changed)
            cycle_started = time.perf_counter()
            for i in keys:
                store.put(KEY_FMT % i, os.urandom(value_bytes))
            before = Counter(blobs.calls)
            cpu_started = time.thread_time()
            info = store.commit()
            cpu.append((time.thread_time() - cpu_started) * 1000)
            cycles.append((time.perf_counter() - cycle_started) * 1000)
            requests += blobs.calls - before
            latencies.append(info.duration_s * 1000)
            uploaded.append(info.bytes_uploaded)
            raw.append(info.raw_bytes)
            infos.append(info)
            rss_max = max(rss_max, _memory_mb()[0])
    return {
        "state_keys": size,
        "load_s": round(load_s, 2),
        "commits": commits,
        "updated_keys_per_commit": changed,
        "value_bytes": value_bytes,
        "commit_p50_ms": round(_percentile(latencies, 0.50), 2),
        "commit_p99_ms": round(_percentile(latencies, 0.99), 2),
        "commit_mean_ms": round(statistics.fmean(latencies), 2),
        "commit_cpu_p50_ms": round(_percentile(cpu, 0.50), 2),
        "cycle_p50_ms": round(_percentile(cycles, 0.50), 2),
        "bytes_uploaded_per_commit": round(statistics.fmean(uploaded)),
        "raw_bytes_per_commit": round(statistics.fmean(raw)),
        "upload_to_raw_ratio": round(sum(uploaded) / sum(raw), 3),
        "requests_per_commit": {k: round(n / commits, 2) for k, n in sorted(requests.items())},
        "phases_p50_ms": _phases_p50(infos),
        "slowest_commits": _slowest(latencies, infos),
        "commit_rss_max_mb": rss_max,
        "peak_rss_mb": _memory_mb()[1],
        "local_copy_mb": _disk_mb(workdir / "local"),
        "root_mb": _disk_mb(workdir / "root"),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def _run_protocol(protocol: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Results of every size with the working tree's library, or with a release's sources in
    a subprocess."""
    sizes, commits = args.sizes, args.commits
    shape = {
        "changed": args.changed,
        "value_bytes": args.value_bytes,
        "load_batch": args.load_batch,
    }
    if protocol == "current":
        results = []
        for size in sizes:
            with tempfile.TemporaryDirectory(prefix="sk-bench-commit-") as tmp:
                results.append(run_size(size, commits, Path(tmp), seed=size, **shape))
            print(f"done ({protocol}): {results[-1]}", file=sys.stderr)
        return results
    with tempfile.TemporaryDirectory(prefix="sk-bench-release-") as tmp:
        src = extract(Path(tmp), {"0.1.0": RELEASE_0_1}[protocol])
        here = str(Path(__file__).resolve().parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), here])}
        argv = ["--sizes", *map(str, sizes), "--commits", str(commits), "--protocols", "current"]
        argv += ["--changed", str(args.changed), "--value-bytes", str(args.value_bytes)]
        argv += ["--load-batch", str(args.load_batch)]
        out = subprocess.run(
            [sys.executable, __file__, *argv, "--results-only"],
            env=env, check=True, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
    results: list[dict[str, Any]] = json.loads(out.stdout)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--commits", type=int, default=40)
    parser.add_argument("--changed", type=int, default=10_000, help="keys updated per commit")
    parser.add_argument("--value-bytes", type=int, default=100, help="bytes of each value")
    parser.add_argument(
        "--load-batch", type=int, default=200_000, help="keys per commit while loading"
    )
    parser.add_argument(
        "--protocols", nargs="+", default=["current", "0.1.0"], choices=["current", "0.1.0"]
    )
    parser.add_argument("--results-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    by_protocol = {p: _run_protocol(p, args) for p in args.protocols}
    if args.results_only:
        print(json.dumps(by_protocol["current"]))
        return 0
    results = by_protocol[args.protocols[0]]
    small, large = results[0], results[-1]
    summary = {
        "benchmark": "commit",
        "date": time.strftime("%Y-%m-%d"),
        "conditions": "local filesystem root, warm page cache, background snapshots off",
        "timed": (
            "StateStore.commit() wall time (CommitInfo.duration_s); puts not timed; the "
            "RocksDB write runs behind the commit (cycle_p50_ms: puts + commit)"
        ),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "protocol": args.protocols[0],
        "results": results,
        "p50_ratio_largest_to_smallest": round(large["commit_p50_ms"] / small["commit_p50_ms"], 3),
        "protocols": {
            p: [
                {
                    k: r[k]
                    for k in (
                        "state_keys",
                        "commit_p50_ms",
                        "commit_p99_ms",
                        "commit_cpu_p50_ms",
                        "cycle_p50_ms",
                        "requests_per_commit",
                    )
                    if k in r
                }
                for r in rs
            ]
            for p, rs in by_protocol.items()
        },
        "targets": {"p50_ratio_max": 1.3, "upload_to_raw_ratio_max": 1.2},
    }
    emit(summary, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
