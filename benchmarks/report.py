"""Render the benchmark JSON outputs as ``benchmarks/RESULTS.md``.

Reads ``commit.json``, ``restore.json``, ``longrun.json``, ``per_key.json``,
``pipeline.json`` and ``timers.json`` from ``--results`` (any of them may be missing: its
section says so) and writes one Markdown page: the date, a description of the machine it
runs on, one table per benchmark and the command that reproduces them (the recipe of the
Makefile's ``bench`` target, read from ``--makefile``).

    .venv/bin/python benchmarks/report.py [--results benchmarks/results]
        [--out benchmarks/RESULTS.md] [--makefile Makefile]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESTORE_WAYS = {
    "local_current": "local copy current (clean restart)",
    "local_behind": "local copy behind by the tail (hard crash)",
    "cold_snapshot": "fresh local dir: snapshot + changelog tail (root in the page cache)",
    "cold_snapshot_uncached": "the same, root evicted from the page cache (read from disk)",
    "cold_snapshot_s3": "the same from S3 (moto on loopback, objects in its memory)",
    "cold_changelogs": "fresh local dir, no snapshot: replay every changelog",
}


def _first_line(path: str, prefix: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.startswith(prefix):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _java_version() -> str:
    try:
        done = subprocess.run(
            ["java", "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "not found"
    lines = (done.stderr or done.stdout).strip().splitlines()
    return lines[0].strip() if lines else "unknown"


def _spark_version(pipeline: dict[str, Any] | None) -> str:
    if pipeline is not None and "spark" in pipeline.get("machine", {}):
        return str(pipeline["machine"]["spark"])
    try:
        return metadata.version("pyspark")
    except metadata.PackageNotFoundError:
        return "not installed"


def machine(pipeline: dict[str, Any] | None = None) -> list[str]:
    """Markdown bullet lines describing this machine and its software."""
    memory = _first_line("/proc/meminfo", "MemTotal")
    ram = f"{int(memory.split()[0]) / 2**20:.1f} GiB" if memory else "unknown"
    model = _first_line("/proc/cpuinfo", "model name") or platform.processor() or "unknown"
    return [
        f"- CPU: {os.cpu_count()} x {model}",
        f"- RAM: {ram}",
        f"- OS: {platform.platform()}",
        f"- Python {platform.python_version()}, {_java_version()}, "
        f"Spark {_spark_version(pipeline)} (PySpark from PyPI)",
    ]


def provenance_section(results: Path) -> list[str]:
    """Where and when each result file was measured, as the file itself records it."""
    rows = []
    for path in sorted(results.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        host = data.get("machine") if isinstance(data.get("machine"), dict) else {}
        load = host.get("load_average_1m", data.get("load_average_1m", "-"))
        rows.append([f"`{path.name}`", data.get("date", "-"), host.get("platform", "-"), load])
    if not rows:
        return []
    return [
        "Where each file was measured:",
        "",
        *_table(["file", "date", "platform", "load average (1 min)"], rows),
    ]


def _mb(n: int | None) -> str:
    """Bytes in the largest unit that keeps a number >= 1 (decimal units)."""
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def commit_section(data: dict[str, Any]) -> list[str]:
    """The commit benchmark: latency and bytes uploaded per commit at each state size."""
    rows = [
        [
            f"{r['state_keys']:,}",
            r["commits"],
            f"{r['updated_keys_per_commit']:,}",
            r["commit_p50_ms"],
            r["commit_p99_ms"],
            _mb(r["bytes_uploaded_per_commit"]),
            _mb(r["raw_bytes_per_commit"]),
            r["upload_to_raw_ratio"],
        ]
        for r in data["results"]
    ]
    targets = data.get("targets", {})
    return [
        "## Commit cost against state size (`benchmarks/commit.py`)",
        "",
        "Each commit updates existing keys with new random 100-byte values; a commit should "
        "cost what changed, not what is stored.",
        "",
        *_table(
            [
                "state keys",
                "commits",
                "keys changed / commit",
                "p50 ms",
                "p99 ms",
                "uploaded / commit",
                "raw / commit",
                "upload / raw",
            ],
            rows,
        ),
        "",
        f"p50 at the largest size / p50 at the smallest: "
        f"**{data['p50_ratio_largest_to_smallest']}** (target ≤ "
        f"{targets.get('p50_ratio_max', '-')}); upload / raw target ≤ "
        f"{targets.get('upload_to_raw_ratio_max', '-')}. Run {data['date']}.",
        *_phases(data),
        *_protocols(data.get("protocols", {})),
    ]


def _phases(data: dict[str, Any]) -> list[str]:
    """Where a commit's time goes: the median of each phase (``CommitInfo.phases_ms``)."""
    results = [r for r in data["results"] if r.get("phases_p50_ms")]
    if not results:
        return []
    names = sorted({name for r in results for name in r["phases_p50_ms"]})
    rows = [
        [f"{r['state_keys']:,}", r["commit_p50_ms"], *(r["phases_p50_ms"].get(n, 0) for n in names)]
        for r in results
    ]
    load = data.get("load_average_1m")
    return [
        "",
        f"Where the time of a commit goes ({data.get('timed', 'StateStore.commit()')}): the "
        "median of each phase of `CommitInfo.phases_ms`, in ms (medians, so they need not add "
        "up to the p50). `upload` is the blob-store writes of the changelog and the manifest, "
        "`fsync` their four fsyncs (file and folder of each)"
        + (f"; {data['conditions']}" if data.get("conditions") else "")
        + (f"; 1-minute load average of the machine at the end: {load}" if load else "")
        + ".",
        "",
        *_table(["state keys", "p50 ms", *names], rows),
    ]


def _protocols(protocols: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The same commits under each commit protocol, side by side (one run)."""
    if len(protocols) < 2:
        return []
    rows = [
        [
            name,
            f"{r['state_keys']:,}",
            r["commit_p50_ms"],
            r.get("commit_cpu_p50_ms", "-"),
            r.get("cycle_p50_ms", "-"),
            ", ".join(f"{n:g} {kind}" for kind, n in r["requests_per_commit"].items()),
        ]
        for name, results in protocols.items()
        for r in results
    ]
    return [
        "",
        "Before and after the format-2 commit protocol (0.1.0 run from its sources in git, "
        "same machine, same run; background snapshots off). CPU ms: CPU time of the "
        "committing thread, steadier than wall time on a shared machine. Cycle: the puts and "
        "the commit of one round, wall time: the current protocol writes RocksDB after the "
        "commit returns, during the next round's puts, so only this figure holds all of it:",
        "",
        *_table(
            [
                "protocol",
                "state keys",
                "p50 ms",
                "CPU p50 ms",
                "cycle p50 ms",
                "blob requests / commit",
            ],
            rows,
        ),
    ]


def commit_scale_section(runs: list[dict[str, Any]]) -> list[str]:
    """Commits into large stores (``commit_scale_*.json``: runs of ``commit.py`` at 10M keys
    and more, each with its own load average): p50, p99 and what the slowest commits were."""
    rows = []
    for run in runs:
        for name, results in run.get("protocols", {}).items():
            full = {r["state_keys"]: r for r in run["results"]} if name == run["protocol"] else {}
            for r in results:
                detail = full.get(r["state_keys"], {})
                slowest = detail.get("slowest_commits") or [{}]
                top = max((slowest[0].get("phases_ms") or {"-": 0}).items(), key=lambda i: i[1])
                rows.append([
                    f"{r['state_keys']:,}", name, r["commit_p50_ms"], r.get("commit_p99_ms", "-"),
                    r.get("commit_cpu_p50_ms", "-"),
                    f"{slowest[0].get('ms', '-')} ({top[0]} {top[1]})" if detail else "-",
                    detail.get("peak_rss_mb", "-"), detail.get("local_copy_mb", "-"),
                    detail.get("load_s", "-"),
                    detail.get("load_average_1m", run["load_average_1m"]),
                ])  # fmt: skip
    return [
        "## Commits into large stores (`benchmarks/commit.py --sizes ...`)",
        "",
        "The same commits (10,000 changed keys of 100-byte values) into a store loaded through "
        "the store API first; the timed commits run while RocksDB compacts what loading left. "
        "Peak RSS: the whole process, loading included. One run per size, load average at "
        "its end (the machine is shared: compare rows of one run only). Not part of `make "
        "bench` (the 50M-key run loads for 12-17 minutes and takes 11 GB of disk): "
        "`benchmarks/commit.py --sizes 10000000 --commits 100 --out "
        "benchmarks/results/commit_scale_10m.json` and `--sizes 50000000 --commits 100 "
        "--load-batch 1000000 --protocols current --out "
        "benchmarks/results/commit_scale_50m.json`.",
        "",
        *_table(
            [
                "state keys",
                "protocol",
                "p50 ms",
                "p99 ms",
                "CPU p50 ms",
                "slowest ms (largest phase)",
                "peak RSS MB",
                "local copy MB",
                "load s",
                "load avg",
            ],
            rows,
        ),
    ]


def ceiling_section(runs: list[dict[str, Any]]) -> list[str]:
    """The vectorized form against the ceiling alone (``pipeline_ceiling_*.json``: runs of
    ``pipeline.py --variants sk_arrow sk_arrow_no_state ceiling --rounds N``, one per batch
    size): they run in turn, round by round, so that each ratio compares neighbours in time."""
    rows = []
    for run in sorted(runs, key=lambda r: r["workload"]["rows_per_batch"]):
        w, v, rounds = run["workload"], run["variants"], run.get("rounds") or {}
        speeds = rounds.get("steady_rows_per_s") or {
            name: [r["steady_rows_per_s"]] for name, r in v.items()
        }
        per_round = rounds.get("sk_arrow_to_ceiling_per_round") or [
            run["ratios"]["sk_arrow_to_ceiling"]
        ]
        loads = [x for pair in rounds.get("load_average_1m_after", []) for x in pair]
        no_state = rounds.get("sk_arrow_no_state_to_ceiling_median") or run["ratios"].get(
            "sk_arrow_no_state_to_ceiling"
        )
        rows.append([
            f"{w['rows_per_batch']:,}", w["batches"], len(per_round),
            " / ".join(f"{x:,}" for x in speeds["sk_arrow"]),
            " / ".join(f"{x:,}" for x in speeds["ceiling"]),
            " / ".join(str(x) for x in per_round),
            f"**{rounds.get('sk_arrow_to_ceiling_median', per_round[0])}x**",
            "-" if no_state is None else f"{no_state}x",
            f"{v['sk_arrow']['batch_p50_ms']:,} / {v['ceiling']['batch_p50_ms']:,}",
            v["sk_arrow"]["state_commit_p50_ms"],
            f"{run['machine']['load_average_1m_before']} / "
            f"{max(loads, default=run['machine']['load_average_1m'])}",
        ])  # fmt: skip
    return [
        "## The vectorized form against the ceiling (`benchmarks/pipeline.py --variants "
        "sk_arrow sk_arrow_no_state ceiling`)",
        "",
        "The pipeline benchmark's vectorized form and its ceiling alone, run in turn each "
        "round (same input, each from a new checkpoint), at each batch size: steady rows/s per "
        "round, the ratio per round and its median. *Without state* is the median ratio of "
        "`sk_arrow_no_state` (the same operator and aggregation reading and writing no state, "
        "where the run has it): the part of the gap that is not the state. The machine is "
        "shared (load average: before the run / highest after a variant): compare within a "
        "row.",
        "",
        *_table(
            [
                "rows / batch",
                "batches",
                "rounds",
                "`sk_arrow` rows/s",
                "`ceiling` rows/s",
                "ratio per round",
                "median ratio",
                "without state (median)",
                "batch p50 ms (round 1)",
                "commit p50 ms",
                "load avg",
            ],
            rows,
        ),
    ]


def restore_section(data: dict[str, Any]) -> list[str]:
    """The restore benchmark: the ways of opening a store."""
    state = data["state"]
    order = [w for w in RESTORE_WAYS if w in data["results"]]
    rows = [
        [
            f"`{way}`",
            RESTORE_WAYS[way],
            data["results"][way]["seconds"],
            data["results"][way]["base_kind"],
            data["results"][way]["changelogs_replayed"],
            _mb(data["results"][way]["bytes_downloaded"]),
            data["results"][way]["files_downloaded"],
            data["results"][way]["files_reused"],
        ]
        for way in order
    ]
    return [
        "## Restore time (`benchmarks/restore.py`)",
        "",
        f"One store of {state['keys']:,} keys ({state['value_bytes']}-byte values, "
        f"{state['versions']} versions) opened {len(order)} ways. Run {data['date']}; root on "
        "the local filesystem, warm page cache, unless the way says otherwise.",
        "",
        *_table(
            [
                "way",
                "situation",
                "seconds",
                "base",
                "changelogs replayed",
                "downloaded",
                "files downloaded",
                "files reused",
            ],
            rows,
        ),
    ]


def longrun_section(data: dict[str, Any]) -> list[str]:
    """The long run: what one store accumulates over thousands of commits."""
    work = data["workload"]
    rows = [
        [
            f"{w['after_commits']:,}",
            f"{w['manifests']:,}",
            w["manifests_mb"],
            w["newest_manifest_kb"],
            w["versions_named"],
            w["retired_named"],
            w["failed_snapshots"],
            f"{w['commit_p50_ms']} / {w['commit_p99_ms']}",
        ]
        for w in data["windows"]
    ]
    steady = data["after_grace"]
    return [
        "## Long run (`benchmarks/longrun.py`)",
        "",
        f"One store, {work['commits']:,} commits of {work['keys_per_commit']} changed key(s) "
        f"({work['value_bytes']}-byte values), {work['config']}; {data['conditions']}. "
        f"Run {data['date']}, {data['seconds']} s in all.",
        "",
        *_table(
            [
                "after commits",
                "manifests",
                "manifests MB",
                "newest manifest KB",
                "versions named",
                "retired named",
                "failed snapshots",
                "commit p50 / p99 ms",
            ],
            rows,
        ),
        "",
        f"GC run as if the 15-minute manifest grace had passed left {steady['manifests']} "
        f"manifest(s), {steady['manifests_mb']} MB (the run is shorter than the grace, so "
        "every superseded manifest was still kept above).",
    ]


def _target(r: dict[str, Any]) -> str:
    if "target_us" not in r:
        return "-"
    return f"≤ {r['target_us']}: " + ("met" if r["met"] else "**missed**")


def per_key_section(data: dict[str, Any]) -> list[str]:
    """The in-process per-key benchmark: µs per key of each processor form."""
    w = data["workload"]
    rows = [
        [
            f"`{form}`",
            r["us_per_key_best"],
            r["us_per_key_median"],
            f"{r['keys_per_s']:,}",
            _target(r),
        ]
        for form, r in data["results"].items()
        if isinstance(r, dict)
    ]  # fmt: skip
    return [
        "## Per-key cost in-process (`benchmarks/per_key.py`)",
        "",
        f"One partition's run without Spark over {w['keys_per_batch']:,} keys of one row each, "
        f"against a RocksDB store holding every key; per key: {w['per_key']}. `row`: the Row "
        "form; `pandas`: the pandas form yielding a tuple; `pandas_frame`: the pandas form "
        f"yielding a one-row DataFrame per key. Best and median of {w['repeat']} runs, "
        f"{data['date']}"
        + (
            f" (load average {data['load_average_1m']} at the end: the machine is shared)."
            if "load_average_1m" in data
            else "."
        ),
        "",
        *_table(["form", "µs/key (best)", "µs/key (median)", "keys/s", "target"], rows),
        *_arrow_lines(data.get("arrow")),
    ]


def _arrow_lines(arrow: dict[str, Any] | None) -> list[str]:
    """The vectorized form in-process, per batch size, with where its time goes."""
    if not arrow:
        return []
    header = ["rows / batch", "keys", "function ms", "multi_get ms", "put_many ms", "rest ms"]
    header += ["µs / row", "commit ms", "encode ms", "compress ms"]
    rows = []
    for size, r in arrow.items():
        phases = r.get("commit_phases_ms", {})
        rows.append(
            [f"{int(size):,}", f"{r['keys']:,}", r["function_ms"], r.get("multi_get_ms", "-"),
             r.get("put_many_ms", "-"), r.get("other_ms", "-"), r["function_us_per_row"],
             r["commit_ms"], phases.get("encode", "-"), phases.get("compress", "-")]
        )  # fmt: skip
    return [
        "",
        "The vectorized form in-process (`pipeline.sk_arrow_totals` through `run_arrow`, one "
        "partition, keys drawn from 1M, a store holding an earlier batch's keys). The "
        "function's time is the store's `multi_get`, its `put_many` and the rest (group-by, "
        "sort, key encoding, numpy, output); the commit's largest phases beside it:",
        "",
        *_table(header, rows),
    ]


def _restart(r: dict[str, Any], phase: str) -> str:
    found = r.get(f"restart_{phase}")
    if found is None:
        return "-"
    text = f"{found['first_batch_s']} s"
    restore = found.get("restore") or {}
    if restore.get("stores_restored") == 0:
        text += " (local copies current: nothing restored)"
    elif restore.get("stores_restored"):
        text += (
            f" (restored {restore['stores_restored']} stores, {_mb(restore['restore_bytes'])}, "
            f"slowest {restore['restore_time_max_s']} s)"
        )
    elif restore.get("stores_loaded_from_checkpoint"):
        text += (
            f" (loaded {restore['stores_loaded_from_checkpoint']} stores, "
            f"{restore['changelogs_replayed']} changelogs, "
            f"{restore['load_time_per_store_s']} s each)"
        )
    return text


PIPELINE_ROWS: list[tuple[str, Any]] = [
    ("wall time, all batches (s)", lambda r: r["wall_s"]),
    ("rows/s (wall)", lambda r: f"{r['rows_per_s']:,}"),
    ("rows/s (steady batches)", lambda r: f"{r['steady_rows_per_s']:,}"),
    ("batch p50 (ms)", lambda r: f"{r['batch_p50_ms']:,}"),
    ("batch p99 (ms)", lambda r: f"{r['batch_p99_ms']:,}"),
    ("first batch (ms)", lambda r: f"{r['first_batch_ms']:,}"),
    ("addBatch p50 (ms)", lambda r: f"{r['add_batch_p50_ms']:,}"),
    ("state commit per partition, p50 (ms)", lambda r: r["state_commit_p50_ms"]),
    ("durable state on disk", lambda r: _mb(r["durable_state_bytes"])),
    ("query checkpoint (offsets, commits)", lambda r: _mb(r["query_checkpoint_bytes"])),
    ("local working copies", lambda r: _mb(r.get("local_state_bytes"))),
    ("restart in a new session: to 1st batch done", lambda r: _restart(r, "warm")),
    ("restart, statekeeper local dir wiped: same", lambda r: _restart(r, "cold")),
    ("load average (1 min) right after", lambda r: r.get("load_average_1m_after", "-")),
    ("keys in final state", lambda r: "-" if r["final_keys"] is None else f"{r['final_keys']:,}"),
    ("equals a batch groupBy", lambda r: "yes" if r["mismatched_keys"] == 0 else "**no**"),
]


def _ratio_lines(data: dict[str, Any]) -> list[str]:
    """The headline: each variant against the best Spark peer, vectorized against the
    ceiling (steady rows/s)."""
    found = data.get("ratios") or {}
    lines: list[str] = []
    if "to_best_peer" in found:
        best = found["best_peer"]
        parts = ", ".join(
            f"`{name}` **{value}x**" for name, value in found["to_best_peer"].items()
            if name != best
        )  # fmt: skip
        lines.append(f"Steady rows/s against the best Spark peer (`{best}`): {parts}.")
    if "sk_arrow_to_ceiling" in found:
        lines.append(
            f"The vectorized form reaches **{found['sk_arrow_to_ceiling']}x** the ceiling "
            "(the same source, shuffle and sink without state)"
            + (
                f"; with its state taken out, **{found['sk_arrow_no_state_to_ceiling']}x**."
                if "sk_arrow_no_state_to_ceiling" in found
                else "."
            )
        )
    return lines


def pipeline_section(data: dict[str, Any], *, command: bool = False) -> list[str]:
    """The pipeline benchmark: every variant side by side, one column each; with
    ``command`` (a run other than ``make bench``'s, ``pipeline_peer_*.json``) headed by its
    batch size and the command that makes it."""
    w, variants = data["workload"], data["variants"]
    header = ["", *(f"`{name}`" for name in variants)]
    rows = [[label, *(fn(r) for r in variants.values())] for label, fn in PIPELINE_ROWS]
    rows = [row for row in rows if any(cell != "-" for cell in row[1:])]  # not measured: left out
    legend = [f"- `{name}`: {r['label']}" for name, r in variants.items()]
    load = data.get("machine", {})
    if "load_average_1m_before" in load:
        legend.append(
            f"- load average (1 min) of the machine before / after the run: "
            f"{load['load_average_1m_before']} / {load['load_average_1m']}"
        )
    agree = "yes" if data["all_agree"] else "**NO**"
    peers = w.get("peer_batches", w["batches"])
    fewer = (
        f" Spark's own operators ran the first {peers} of the {w['batches']} batches (they are "
        "slow per key); rows/s are per row each variant read."
        if peers != w["batches"]
        else ""
    )
    warm = w.get("warm_batches")  # absent from runs made before the warm-up existed
    fewer += (
        f" Before any variant was measured, each ran {warm} unmeasured "
        f"micro-batch{'' if warm == 1 else 'es'} (the JVM, "
        "shared by the sessions, compiles the code paths they reuse)."
        if warm
        else ""
    )
    heading = "## Streaming pipeline, side by side (`benchmarks/pipeline.py`)"
    if command:
        args = [
            f"--rows {w['rows_per_batch']}", f"--keys {w['keys']}", f"--batches {w['batches']}",
            f"--peer-batches {peers}", "--variants", *variants, "--restarts", *w["restarts"],
            *([f"--warm-batches {warm}"] if warm is not None else []),
        ]  # fmt: skip
        heading = (
            f"## Streaming pipeline at {w['rows_per_batch']:,}-row batches "
            f"(`benchmarks/pipeline.py {' '.join(args)}`)"
        )
    return [
        heading,
        "",
        f"Running count and sum per key over a Parquet file source: {w['batches']} "
        f"micro-batches of {w['rows_per_batch']:,} rows over {w['keys']:,} possible keys "
        f"(random), {w['partitions']} state partitions, `{w['master']}`, each variant in its "
        "own SparkSession, output to a Parquet sink. Batch latency is the query progress's "
        "`triggerExecution`; percentiles are over the batches after the first. Restarts run "
        "in a new SparkSession on the same checkpoint and process one more file; the time is "
        f"from `start()` to that batch's end. State commit: statekeeper's commit (changelog "
        "upload) per partition; for Spark the RocksDB provider's commit latencies (flush, "
        "compact, checkpoint, file sync) summed over partitions / partitions. "
        "Restores read the root from the local filesystem with a warm page cache."
        f"{fewer} Run {data['date']} in {data['total_s']} s.",
        "",
        *legend,
        "",
        *_table(header, rows),
        "",
        *[part for line in _ratio_lines(data) for part in (line, "")],
        f"All stateful variants agree with a batch `groupBy` over the input they read "
        f"({_keys(data)} keys): {agree}.",
    ]


def timers_section(data: dict[str, Any]) -> list[str]:
    """The timers benchmark: finding and firing the due timers per batch, by timers held."""
    rows = [
        [
            f"{r['timers']:,}",
            f"{r['due_per_batch']:,}",
            r["batches"],
            r["find_ms_p50"],
            f"{r['find_cpu_ms'][0]} → {r['find_cpu_ms'][-1]}",
            r["fire_ms_p50"],
            r["commit_ms_p50"],
            r["full_scan_s"],
            f"{r['full_scan_to_find_ratio']:,}x",
            r["peak_rss_mb"],
            r["build_s"],
        ]
        for r in data["results"]
    ]
    return [
        "## Finding due timers (`benchmarks/timers.py`)",
        "",
        "One keyed store holding one event-time timer per key; each micro-batch's watermark "
        "makes a fixed number of them due. Find: the scan of the timer index for the due "
        "timers; fire: the runner's timer step (find, a no-op `handle_expired_timer` per "
        "timer, delete both entries of each); commit: of those deletes. The full scan reads "
        "every timer and keeps the due ones (the naive ceiling). Peak RSS of the process "
        f"that fires. Built by: {data['build']}. Conditions: {data['conditions']}; run "
        f"{data['date']} "
        f"(load average {data['machine'].get('load_average_1m', '-')}).",
        "",
        *_table(
            [
                "timers held",
                "due / batch",
                "batches",
                "find p50 ms (wall)",
                "find CPU ms, 1st → last batch",
                "fire p50 ms",
                "commit p50 ms",
                "full scan s",
                "full scan / find",
                "peak RSS MB",
                "build s",
            ],
            rows,
        ),
        "",
        f"Find p50 at the largest size / at the smallest: "
        f"**{data['find_p50_ratio_largest_to_smallest']}**. The timers fired before leave "
        "RocksDB tombstones at the head of the index until compaction drops them; the scan "
        "starts at the index's floor, past them, so the find's CPU time, first to last "
        "batch, should stay flat.",
    ]


def _keys(data: dict[str, Any]) -> str:
    main, peers = data.get("expected_keys"), data.get("expected_keys_peers")
    text = "-" if main is None else f"{main:,}"
    if peers is not None and peers != main:
        text += f"; the peers' input: {peers:,}"
    return text


def bench_recipe(makefile: Path) -> list[str]:
    """The recipe lines of the Makefile's ``bench`` target (empty if there is none)."""
    try:
        lines = makefile.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    recipe: list[str] = []
    inside = False
    for line in lines:
        if line.startswith("bench:"):
            inside = True
        elif inside and line.startswith("\t"):
            recipe.append(line.strip().replace("$(BIN)", ".venv/bin"))
        elif inside:
            break
    return recipe


def anatomy_section(runs: list[dict[str, Any]]) -> list[str]:
    """Where a steady micro-batch goes (``pipeline_anatomy_*.json``: runs of ``pipeline.py
    --anatomy``, one per batch size): per variant, the median of each Spark job of a batch,
    of the driver's time between the jobs and after the last one, and the batch itself."""
    rows = []
    for run in sorted(runs, key=lambda r: r["workload"]["rows_per_batch"]):
        for name, variant in run["variants"].items():
            anatomy = variant.get("anatomy") or {}
            if not anatomy.get("batches"):
                continue
            opened = anatomy.get("stores_opened_per_batch")
            rows.append([
                f"{run['workload']['rows_per_batch']:,}", f"`{name}`",
                " + ".join(f"{ms:,}" for ms in anatomy["job_ms_median"]),
                anatomy["between_jobs_ms_median"], anatomy["after_last_job_ms_median"],
                f"{anatomy['batch_ms_median']:,}",
                "" if opened is None else " ".join(str(n) for n in opened),
                anatomy.get("state_commit_p50_ms_median", ""),
            ])  # fmt: skip
    return [
        "## Where a micro-batch goes (`benchmarks/pipeline.py --anatomy`)",
        "",
        "Medians over the steady batches of one run, from Spark's monitoring REST API (the "
        "UI is on for every variant alike). A batch runs its Spark jobs in turn: reading "
        "the input file and shuffling it, then the stateful (or pass-through) stage and the "
        "sink; statekeeper's plan has one more job, the stage boundary after the operator "
        "(see `statekeeper.spark._transform`). Between and after the jobs the driver plans, "
        "commits the sink and writes its offset and commit logs. A store is opened when its "
        "partition's task ran in the other Python worker than last time.",
        "",
        *_table(
            [
                "rows / batch",
                "variant",
                "jobs ms",
                "between jobs ms",
                "after last job ms",
                "batch ms",
                "stores opened per batch",
                "commit p50 ms",
            ],
            rows,
        ),
    ]


def render(results: Path, makefile: Path | None = None) -> str:
    """The RESULTS.md text for the JSON files in ``results``."""
    loaded: dict[str, dict[str, Any] | None] = {}
    for name in ("commit", "restore", "longrun", "per_key", "pipeline", "timers"):
        path = results / f"{name}.json"
        loaded[name] = json.loads(path.read_text()) if path.exists() else None
    sections = {
        "commit": commit_section,
        "restore": restore_section,
        "longrun": longrun_section,
        "per_key": per_key_section,
        "pipeline": pipeline_section,
        "timers": timers_section,
    }
    out = [
        "# statekeeper benchmark results",
        "",
        f"Generated {time.strftime('%Y-%m-%d')} by `benchmarks/report.py` from "
        "`benchmarks/results/*.json`. Each file is one run on a shared machine of the kind "
        "below (2 cores), not always the same host nor on the same day (see *Where each "
        "file was measured*); compare the figures within a table, not across files.",
        "",
        "The machine this report was generated on:",
        "",
        *machine(loaded["pipeline"]),
        "",
        *provenance_section(results),
    ]
    for name, section in sections.items():
        data = loaded[name]
        out += ["", *(section(data) if data else [f"## {name}", "", f"No `{name}.json`."])]
        scale = sorted(results.glob("commit_scale_*.json"))
        if name == "commit" and scale:
            out += ["", *commit_scale_section([json.loads(p.read_text()) for p in scale])]
    ceiling = sorted(results.glob("pipeline_ceiling_*.json"))
    if ceiling:
        out += ["", *ceiling_section([json.loads(p.read_text()) for p in ceiling])]
    for path in sorted(results.glob("pipeline_peer_*.json")):
        out += ["", *pipeline_section(json.loads(path.read_text()), command=True)]
    anatomy = sorted(results.glob("pipeline_anatomy_*.json"))
    if anatomy:
        out += ["", *anatomy_section([json.loads(p.read_text()) for p in anatomy])]
    recipe = bench_recipe(makefile) if makefile else []
    out += ["", "## Reproduce", "", "```", "make bench", "```"]
    if recipe:
        out += ["", "which runs:", "", "```", *recipe, "```"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--makefile", type=Path, default=HERE.parent / "Makefile")
    args = parser.parse_args(argv)
    text = render(args.results, args.makefile)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
