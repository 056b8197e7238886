"""Repartition: time and bytes uploaded to move an operator's state to another partition count.

One operator of ``--keys`` keys (100-byte random values, so incompressible: the worst case for
bytes) over ``--partitions`` stores (4096 key groups, keys spread over every key group), each
ending in a snapshot, on a root on the local filesystem (just written: its files are in the
page cache). Then, side by side in one run, each on its own hard-linked copy of the root:

* ``plain_restore``: every store opened at the cut in a fresh local folder, the stores in
  parallel as the repartition restores them (the floor of any rescale that reads the state);
* ``split``: ``statekeeper.repartition`` to twice the partitions (new boundaries fall on old
  ones: each new store has one parent and reuses its SST blobs);
* ``split_misaligned``: to ``2P - 1`` partitions (most new stores have two parents: the
  smaller range is written again and ingested);
* ``merge``: to half the partitions (each new store ingests its second parent's range);
* ``full_rewrite``: the same split done the way a state rewriter does it: every key read
  from the old stores and written into new stores through the store API, then snapshotted.

Targets (issue 16): a split uploads at most 5% of the state's bytes and takes at most twice a
plain restore.

    .venv/bin/python benchmarks/repartition.py [--keys 10000000] [--partitions 4]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _output import emit

import statekeeper as sk
from statekeeper.keyed._layout import (
    META_KEY,
    OperatorRecord,
    StateDecl,
    group_prefix,
    key_group_range,
    state_prefix,
)
from statekeeper.repartition import plan_parents, repartition
from statekeeper.store import DEFAULT_KEY_GROUPS

VALUE_SIZE = 100
OPERATOR = "bench"
COMMITS = 8
RECORD = OperatorRecord(("user",), None, {"total": StateDecl("value", None, "json")}, 4096)


def _write(root: Path, local: Path, keys: int, partitions: int) -> int:
    """Write the operator (snapshot mode: every commit is a snapshot); returns its version."""
    config = sk.StoreConfig(local_dir=str(local), mode="snapshot", io_threads=4)
    per_store = keys // partitions
    with sk.StateBackend(str(root), config=config) as backend:
        for p in range(partitions):
            groups = key_group_range(p, partitions, DEFAULT_KEY_GROUPS)
            with backend.open(OPERATOR, p, partitions=partitions) as store:
                store.put(META_KEY, RECORD.to_bytes())
                step = -(-per_store // COMMITS)
                for start in range(0, per_store, step):
                    for i in range(start, min(per_store, start + step)):
                        kg = groups.start + i % len(groups)
                        key = group_prefix(kg) + state_prefix("total") + b"user:%012d" % i
                        store.put(key, b"\x00" + os.urandom(VALUE_SIZE))
                    version = store.commit().version
    return version


def _link_copy(root: Path, to: Path) -> Path:
    """A copy of the root whose blobs are hard links (blobs are immutable; the root metadata
    is replaced by rename, never written in place)."""
    for folder, _, files in os.walk(root):
        target = to / Path(folder).relative_to(root)
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            os.link(Path(folder) / name, target / name)
    return to


def _state_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and "/files/" in str(p))


def _plain_restore(root: Path, local: Path, partitions: int, workers: int) -> dict[str, Any]:
    config = sk.StoreConfig(local_dir=str(local), io_threads=8)
    started = time.perf_counter()
    with sk.StateBackend(str(root), config=config) as backend:

        def restore(p: int) -> int:
            with backend.open(OPERATOR, p) as store:
                return store.restore_info.bytes_downloaded

        with ThreadPoolExecutor(workers) as pool:
            downloaded = sum(pool.map(restore, range(partitions)))
    return {"seconds": round(time.perf_counter() - started, 3), "bytes_downloaded": downloaded}


def _repartition(root: Path, work: Path, partitions: int, workers: int) -> dict[str, Any]:
    before = _state_bytes(root)
    config = sk.StoreConfig(local_dir=str(work / "local"), io_threads=8)
    report = repartition(
        str(root), OPERATOR, partitions=partitions, config=config, work_dir=str(work),
        workers=workers,
    )  # fmt: skip
    return {
        "seconds": round(report.duration_s, 3),
        "restore_s": round(report.restore_s, 3),
        "build_s": round(report.build_s, 3),
        "partitions": f"{report.from_partitions} -> {report.partitions}",
        "state_bytes": report.state_bytes,
        "new_store_bytes": report.new_store_bytes,
        "bytes_uploaded": report.bytes_uploaded,
        "uploaded_share": round(report.bytes_uploaded / report.state_bytes, 4),
        "bytes_reused": report.bytes_reused,
        "bytes_downloaded": report.bytes_downloaded,
        "keys_ingested": report.keys_ingested,
        "root_bytes_added": _state_bytes(root) - before,
    }


def _full_rewrite(root: Path, work: Path, old: int, new: int, workers: int) -> dict[str, Any]:
    """Read every key of the old stores and write it into the new layout's stores (a new
    operator), then snapshot them: what rewriting the state costs."""
    config = sk.StoreConfig(local_dir=str(work / "local"), io_threads=8, snapshot_every=10**9)
    before = _state_bytes(root)
    started = time.perf_counter()
    with sk.StateBackend(str(root), config=config) as backend:
        backend.register("rewritten", new)

        def write(q: int) -> None:
            groups = key_group_range(q, new, DEFAULT_KEY_GROUPS)
            sources = sorted(p for p, _ in plan_parents(q, new, old, DEFAULT_KEY_GROUPS))
            with backend.open("rewritten", q, partitions=new) as target:
                for p in sources:
                    with (
                        sk.StateBackend(str(root), config=_reader(work, q, p)) as reader,
                        reader.open(OPERATOR, p) as source,
                    ):
                        for g in groups:
                            for key, value in source.scan(prefix=group_prefix(g)):
                                target.put(key, value)
                target.put(META_KEY, RECORD.to_bytes())
                target.commit()
                target.snapshot_now()

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(write, range(new)))
    return {
        "seconds": round(time.perf_counter() - started, 3),
        "partitions": f"{old} -> {new}",
        "bytes_uploaded": _state_bytes(root) - before,
    }


def _reader(work: Path, q: int, p: int) -> sk.StoreConfig:
    return sk.StoreConfig(local_dir=str(work / f"read-{q}-{p}"), io_threads=8)


def run(keys: int, partitions: int, workdir: Path, workers: int) -> dict[str, Any]:
    """Build the root, then time each way of rescaling it."""
    root = workdir / "root"
    started = time.perf_counter()
    version = _write(root, workdir / "writer", keys, partitions)
    results: dict[str, Any] = {
        "build": {"seconds": round(time.perf_counter() - started, 3), "version": version},
        "root_bytes": _state_bytes(root),
    }
    results["plain_restore"] = _plain_restore(
        _link_copy(root, workdir / "r0"), workdir / "plain", partitions, workers
    )
    for name, count in (
        ("split", 2 * partitions),
        ("split_misaligned", 2 * partitions - 1),
        ("merge", max(1, partitions // 2)),
    ):
        copy = _link_copy(root, workdir / f"r-{name}")
        results[name] = _repartition(copy, workdir / f"w-{name}", count, workers)
    results["full_rewrite"] = _full_rewrite(
        _link_copy(root, workdir / "r-rewrite"), workdir / "w-rewrite", partitions,
        2 * partitions, workers,
    )  # fmt: skip
    split, restore = results["split"], results["plain_restore"]
    results["targets"] = {
        "split_uploaded_share": split["uploaded_share"],
        "split_uploaded_share_target": 0.05,
        "split_time_over_plain_restore": round(split["seconds"] / restore["seconds"], 2),
        "split_time_over_plain_restore_target": 2.0,
    }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=10_000_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--workers", type=int, default=4, help="stores handled at once")
    parser.add_argument("--dir", type=Path, help="work folder (default: a temporary one)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sk-bench-repartition-", dir=args.dir) as tmp:
        results = run(args.keys, args.partitions, Path(tmp), args.workers)
    summary = {
        "benchmark": "repartition",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "state": {"keys": args.keys, "value_bytes": VALUE_SIZE, "partitions": args.partitions},
        "conditions": {
            "root": "local filesystem, just written (warm page cache)",
            "work": "old stores restored into a local temporary folder",
            "load": os.getloadavg()[0],
        },
        "results": results,
    }
    emit(summary, args.out)
    print("done", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
