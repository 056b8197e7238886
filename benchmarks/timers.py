"""Finding due timers: does a micro-batch pay for the timers due, not for those registered?

For each size (default 1M and 10M registered timers) the benchmark builds one keyed store
with one event-time timer per key: expiries are a random permutation of consecutive
milliseconds, so key order and expiry order differ, and a watermark that advances by
``--due`` ms makes exactly ``--due`` timers due (default 10,000). Then it runs ``--batches``
micro-batches in a fresh process (so that its peak RSS is the firing's, not the build's),
each through :func:`statekeeper.keyed.runner.run_processor`, the function a Spark task runs,
with no input rows and a processor whose ``handle_expired_timer`` does nothing, and commits
it. Per micro-batch (median and max over the batches):

* ``find_ms``: finding the due timers (``Timers.due``, the scan of the timer index that the
  runner makes), on its own; also as CPU time of the process (``find_cpu_ms``), steadier
  than wall time on a shared machine. Per batch too: the timers fired in earlier batches
  leave RocksDB tombstones at the head of the index until compaction drops them, and the
  scan starts at the index's floor, past them (``keyed._floor``): its cost must not grow
  with the batches run (``--batches 90`` at 1M timers shows it over 900k timers fired);
* ``fire_ms``: the runner's whole timer step: find, call ``handle_expired_timer`` for each
  due timer, delete both entries of each timer;
* ``commit_ms``: ``StateStore.commit()`` of those deletes.

Against the naive ceiling, ``full_scan_s``: reading every timer in the index and keeping the
due ones (what finding them costs when nothing is ordered by expiry). ``peak_rss_mb`` is the
firing process's peak RSS (RocksDB included). Local filesystem root, warm page cache,
background snapshots off.

The store is built through ``StateStore.put``: for each timer, the two entries that
``handle.register_timer`` writes (the key's, and the index's), written by the timers module
that owns that layout, committed every ``--build-batch`` timers; the build's time is
reported (``build_s``), not the subject.

    .venv/bin/python benchmarks/timers.py [--timers 1000000 10000000] [--due 10000]
        [--batches 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]
from _output import emit

import statekeeper as sk
from statekeeper.keyed import StatefulProcessor, encode_key, group_prefix
from statekeeper.keyed._layout import GROUPED_TIMER_INDEX, U64
from statekeeper.keyed._timers import Timers
from statekeeper.keyed.runner import BatchTime, RunStats, TimeSpec, run_processor

OPERATOR = "timers"
KEY_GROUPS = 256
BASE_MS = 1_700_000_000_000
"""The earliest expiry: the timers expire at ``BASE_MS .. BASE_MS + timers - 1``."""
EVENT_TIME = "event_time"
INPUT = pa.schema([("user", pa.string()), (EVENT_TIME, pa.timestamp("ms"))])
OUTPUT = pa.schema([("user", pa.string())])


class Closer(StatefulProcessor):
    """No input of interest; every timer that fires is simply let go (the runner deletes it)."""

    rows = "row"

    def init(self, handle: Any) -> None:
        """No state."""

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> None:
        """Nothing arrives."""

    def handle_expired_timer(self, key: Any, timer_values: Any, expired_timer_info: Any) -> None:
        """Output nothing."""


def _config(workdir: Path) -> sk.StoreConfig:
    return sk.StoreConfig(local_dir=str(workdir / "local"), snapshot_every=1_000_000_000)


def build(workdir: Path, timers: int, build_batch: int, seed: int) -> dict[str, Any]:
    """Register ``timers`` timers, one per key, in a new root under ``workdir``."""
    expiries = np.random.default_rng(seed).permutation(timers) + BASE_MS
    started = time.perf_counter()
    with (
        sk.StateBackend(str(workdir / "root"), config=_config(workdir)) as backend,
        backend.open(OPERATOR, 0, partitions=1) as store,
    ):
        index = Timers(store, grouped=True)
        for start in range(0, timers, build_batch):
            for i in range(start, min(timers, start + build_batch)):
                key = encode_key((f"user-{i:09d}",))
                group = group_prefix(zlib.crc32(key) % KEY_GROUPS)
                index.register(group, key, int(expiries[i]))
            store.commit()
            print(f"  built {min(timers, start + build_batch):,} timers", file=sys.stderr)
        version = store.version
    return {"build_s": round(time.perf_counter() - started, 1), "build_versions": version}


def fire(workdir: Path, timers: int, due: int, batches: int) -> dict[str, Any]:
    """Run ``batches`` micro-batches that each make ``due`` timers due; time them."""
    empty = INPUT.empty_table()
    spec = TimeSpec("event_time", EVENT_TIME, 0)
    find, find_cpu, fire_, commit, fired = [], [], [], [], []
    with (
        sk.StateBackend(str(workdir / "root"), config=_config(workdir)) as backend,
        backend.open(OPERATOR, 0) as store,
    ):
        opened = store.restore_info.base_kind
        index = Timers(store, grouped=True)
        for b in range(batches):
            watermark = BASE_MS + (b + 1) * due - 1
            started, cpu = time.perf_counter(), time.process_time()
            found = index.due(watermark)
            find.append(time.perf_counter() - started)
            find_cpu.append(time.process_time() - cpu)
            stats = RunStats()
            started = time.perf_counter()
            out = run_processor(
                store, Closer(), empty, keys=["user"], output_schema=OUTPUT, operator=OPERATOR,
                batch_id=store.version, partition=0, now_ms=None, stats=stats,
                key_groups=KEY_GROUPS, time=spec, batch=BatchTime(watermark_ms=watermark),
            )  # fmt: skip
            for _ in out:
                pass
            fire_.append(time.perf_counter() - started)
            if not len(found) == stats.timers_fired == due:
                raise AssertionError(f"batch {b}: {len(found)} found, {stats.timers_fired} fired")
            fired.append(stats.timers_fired)
            commit.append(store.commit().duration_s)
        peak_fire = _peak_rss_mb()
        full_scan, full_due = _full_scan(store, BASE_MS + (batches + 1) * due - 1)
    return {
        "timers": timers,
        "due_per_batch": due,
        "batches": batches,
        "opened_from": opened,
        "find_ms_p50": _ms(statistics.median(find)),
        "find_ms_max": _ms(max(find)),
        "find_ms": [_ms(s) for s in find],
        "find_cpu_ms_p50": _ms(statistics.median(find_cpu)),
        "find_cpu_ms": [_ms(s) for s in find_cpu],
        "fire_ms_p50": _ms(statistics.median(fire_)),
        "fire_ms_max": _ms(max(fire_)),
        "commit_ms_p50": _ms(statistics.median(commit)),
        "us_per_due_timer_find": round(statistics.median(find) / due * 1e6, 2),
        "us_per_due_timer_fire": round(statistics.median(fire_) / due * 1e6, 2),
        "timers_fired": sum(fired),
        "full_scan_s": round(full_scan, 2),
        "full_scan_due_found": full_due,
        "full_scan_to_find_ratio": round(full_scan / statistics.median(find)),
        "peak_rss_mb": peak_fire,
    }


def _full_scan(store: sk.StateStore, watermark: int) -> tuple[float, int]:
    """The naive ceiling: read every timer of the index, keep those due."""
    started = time.perf_counter()
    at = len(GROUPED_TIMER_INDEX)
    due = sum(
        1 for key, _ in store.scan(GROUPED_TIMER_INDEX) if U64.unpack_from(key, at)[0] <= watermark
    )
    return time.perf_counter() - started, due


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def _peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def run_size(timers: int, due: int, batches: int, build_batch: int) -> dict[str, Any]:
    """Build a store of ``timers`` timers, then fire in a child process."""
    if due * (batches + 1) > timers:
        raise SystemExit(f"--timers {timers} is too few for {batches + 1} batches of {due} due")
    with tempfile.TemporaryDirectory(prefix="sk-bench-timers-") as tmp:
        built = build(Path(tmp), timers, build_batch, seed=timers)
        argv = ["--fire-only", tmp, "--timers", str(timers), "--due", str(due)]
        done = subprocess.run(
            [sys.executable, __file__, *argv, "--batches", str(batches)],
            check=True, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
    result: dict[str, Any] = json.loads(done.stdout)
    return {**result, **built}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timers", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--due", type=int, default=10_000)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--build-batch", type=int, default=1_000_000)
    parser.add_argument("--fire-only", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.fire_only:
        print(json.dumps(fire(args.fire_only, args.timers[0], args.due, args.batches)))
        return 0
    results = []
    for timers in args.timers:
        results.append(run_size(timers, args.due, args.batches, args.build_batch))
        print(f"done: {results[-1]}", file=sys.stderr)
    summary = {
        "benchmark": "timers",
        "date": time.strftime("%Y-%m-%d"),
        "conditions": "local filesystem root, warm page cache, background snapshots off; "
        "firing in a fresh process on the built local working copy",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average_1m": round(os.getloadavg()[0], 1),
        },
        "build": "Timers.register through StateStore.put (the two entries register_timer "
        f"writes), committed every {args.build_batch:,} timers",
        "results": results,
        "find_p50_ratio_largest_to_smallest": round(
            results[-1]["find_ms_p50"] / results[0]["find_ms_p50"], 2
        ),
    }
    emit(summary, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
