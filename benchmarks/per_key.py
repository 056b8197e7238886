"""In-process per-key cost of the processor forms, without Spark.

One partition's run (:func:`statekeeper.spark._runner.run_processor`, what a Spark task runs
after collecting its input) over ``--keys`` distinct keys, one row each, against a real
RocksDB store that already holds every key: per key one value-state ``get``, one ``update``
and one output row. Reported: microseconds per key for

* ``row``: the Row form (``rows = "row"``), yielding a tuple;
* ``pandas``: the pandas form, yielding a tuple (rows collected without a DataFrame);
* ``pandas_frame``: the pandas form yielding a one-row DataFrame per key (the old idiom).

Each form runs ``--repeat`` times on a fresh batch (a new store version each time, as
micro-batches do); the best run is reported with the median, and a cProfile of one ``row``
run is summarized with ``--profile``.

``--arrow-rows`` also times the vectorized form in-process: the pipeline benchmark's
function (``pipeline.sk_arrow_totals``: group-by, ``multi_get``, ``put_many``) through
``run_arrow`` over one partition's batch of that many rows (keys drawn from 1M), then the
commit, each on a store that already holds the keys of an earlier batch. The function's time
is split into the store's ``multi_get``, its ``put_many`` and the rest (group-by, sort, key
encoding, numpy, output), and the commit's into its phases (``CommitInfo.phases_ms``).

    .venv/bin/python benchmarks/per_key.py [--keys 100000] [--repeat 3] [--profile]
        [--arrow-rows 100000 1000000] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd  # type: ignore[import-untyped]
import pyarrow as pa  # type: ignore[import-untyped]
from _output import emit

import statekeeper as sk
from statekeeper.spark import StatefulProcessor
from statekeeper.spark._runner import run_processor

OUTPUT = pa.schema([("k", pa.string()), ("count", pa.int64())])
TARGETS_US = {"row": 15.0, "pandas": 60.0}


class RowCount(StatefulProcessor):
    """Row form: one get, one update, one output tuple per key."""

    rows = "row"

    def init(self, handle: Any) -> None:
        self.count = handle.value_state("count")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        n = (self.count.get() or 0) + len(rows)
        self.count.update(n)
        yield (key[0], n)


class PandasCount(StatefulProcessor):
    """Pandas form: the same, rows as a DataFrame, output as a tuple."""

    def init(self, handle: Any) -> None:
        self.count = handle.value_state("count")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        n = (self.count.get() or 0) + len(rows)
        self.count.update(n)
        yield (key[0], n)


class PandasFrameCount(PandasCount):
    """Pandas form yielding a one-row DataFrame per key, as the README's first example."""

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        n = (self.count.get() or 0) + len(rows)
        self.count.update(n)
        yield pd.DataFrame({"k": [key[0]], "count": [n]})


FORMS = {"row": RowCount, "pandas": PandasCount, "pandas_frame": PandasFrameCount}


def _input(keys: int, seed: int) -> Any:
    """One row per key, keys in random order (as a shuffle delivers them)."""
    ids = np.random.default_rng(seed).permutation(keys)
    return pa.table(
        {
            "k": pa.array([f"user-{i:09d}" for i in ids.tolist()], pa.string()),
            "v": pa.array(np.ones(keys, dtype=np.int64)),
        }
    )


def _one_run(backend: sk.StateBackend, form: str, table: Any) -> float:
    """Seconds of one partition's run of ``form`` over ``table``, committed afterwards."""
    with backend.open(form, 0) as store:
        started = time.perf_counter()
        out = list(
            run_processor(
                store,
                FORMS[form](),
                table,
                keys=["k"],
                output_schema=OUTPUT,
                operator=form,
                batch_id=store.version,
                partition=0,
                now_ms=0,
            )
        )
        elapsed = time.perf_counter() - started
        assert sum(b.num_rows for b in out) == table.num_rows
        store.commit()
    return elapsed


def measure(keys: int, repeat: int, work: Path, profile: bool) -> dict[str, Any]:
    """µs per key of every form (best and median of ``repeat`` runs after a warm-up run
    that writes every key, so that each measured get finds a value)."""
    config = sk.StoreConfig(local_dir=str(work / "local"), snapshot_every=1_000_000)
    results: dict[str, Any] = {}
    with sk.StateBackend(str(work / "root"), config=config) as backend:
        for form in FORMS:
            backend.register(form, 1)
            _one_run(backend, form, _input(keys, 0))  # every key now holds a value
            runs = [_one_run(backend, form, _input(keys, 1 + i)) for i in range(repeat)]
            per_key = [s / keys * 1e6 for s in runs]
            results[form] = {
                "us_per_key_best": round(min(per_key), 2),
                "us_per_key_median": round(statistics.median(per_key), 2),
                "keys_per_s": round(keys / min(runs)),
            }
            if form in TARGETS_US:
                results[form]["target_us"] = TARGETS_US[form]
                results[form]["met"] = min(per_key) <= TARGETS_US[form]
        if profile:
            results["profile_row"] = _profile(backend, keys)
    return results


def _profile(backend: sk.StateBackend, keys: int) -> list[str]:
    """The top functions (by own time) of one Row-form run."""
    profiler = cProfile.Profile()
    profiler.enable()
    _one_run(backend, "row", _input(keys, 99))
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
    return [line for line in text.getvalue().splitlines() if line.strip()][-16:]


class _TimedStore:
    """A store as ``run_arrow`` sees it, adding up the time of its bulk reads and writes."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.read_s = 0.0
        self.write_s = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def multi_get(self, keys: Any) -> list[bytes | None]:
        started = time.perf_counter()
        try:
            return self._store.multi_get(keys)  # type: ignore[no-any-return]
        finally:
            self.read_s += time.perf_counter() - started

    def put_many(self, items: Any, values: Any = None) -> None:
        started = time.perf_counter()
        try:
            self._store.put_many(items, values)
        finally:
            self.write_s += time.perf_counter() - started


def measure_arrow(sizes: list[int], work: Path) -> dict[str, Any]:
    """Milliseconds of the vectorized function and of the commit per batch size."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from pipeline import sk_arrow_totals

    from statekeeper.spark import KEY_GROUP_COLUMN
    from statekeeper.spark._runner import run_arrow
    from statekeeper.store import DEFAULT_KEY_GROUPS as KEY_GROUPS

    schema = pa.schema([("k", pa.string()), ("count", pa.int64()), ("sum", pa.int64())])
    config = sk.StoreConfig(local_dir=str(work / "arrow-local"), snapshot_every=1_000_000)
    found: dict[str, Any] = {}
    with sk.StateBackend(str(work / "arrow-root"), config=config) as backend:
        for rows in sizes:
            name = f"arrow{rows}"
            backend.register(name, 1)
            for attempt in range(2):  # the second finds the first one's keys in the store
                rng = np.random.default_rng([rows, attempt])
                ids = rng.integers(0, 1_000_000, rows).tolist()
                # The key group Spark would carry (any value in range: one partition owns all).
                table = pa.table(
                    {
                        "k": [f"k{i}" for i in ids],
                        "v": rng.integers(0, 1000, rows),
                        KEY_GROUP_COLUMN: pa.array(np.asarray(ids) % KEY_GROUPS, pa.int32()),
                    }
                )
                with backend.open(name, 0) as store:
                    timed = _TimedStore(store)
                    started = time.perf_counter()
                    out = run_arrow(
                        timed, sk_arrow_totals, iter(table.to_batches(max_chunksize=10_000)),
                        output_schema=schema, operator=name, batch_id=store.version, partition=0,
                        key_groups=KEY_GROUPS, partitions=1,
                    )  # fmt: skip
                    keys = sum(batch.num_rows for batch in out)
                    ran = time.perf_counter() - started
                    info = store.commit()
                    committed = time.perf_counter() - started - ran
            found[str(rows)] = {
                "keys": keys,
                "function_ms": round(ran * 1000),
                "function_us_per_row": round(ran / rows * 1e6, 2),
                "multi_get_ms": round(timed.read_s * 1000),
                "put_many_ms": round(timed.write_s * 1000),
                "other_ms": round((ran - timed.read_s - timed.write_s) * 1000),
                "commit_ms": round(committed * 1000),
                "commit_phases_ms": {k: round(v, 1) for k, v in sorted(info.phases_ms.items())},
            }
    return found


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, measure, print (and optionally write) the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100_000, help="keys per batch")
    parser.add_argument("--repeat", type=int, default=3, help="measured runs per form")
    parser.add_argument("--profile", action="store_true", help="add a profile of the Row form")
    parser.add_argument(
        "--arrow-rows", type=int, nargs="*", default=[], help="vectorized form: rows per batch"
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sk-bench-per-key-") as tmp:
        results = measure(args.keys, args.repeat, Path(tmp), args.profile)
        arrow = measure_arrow(args.arrow_rows, Path(tmp)) if args.arrow_rows else None
    summary = {
        "benchmark": "per_key",
        "date": time.strftime("%Y-%m-%d"),
        "workload": {
            "keys_per_batch": args.keys,
            "rows_per_key": 1,
            "repeat": args.repeat,
            "per_key": "one value-state get, one update, one output row",
        },
        "results": results,
        **({"arrow": arrow} if arrow is not None else {}),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    emit(summary, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
