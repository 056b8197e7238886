"""Smoke tests of the benchmark scripts: tiny sizes, valid JSON, the fields the report reads.

Each script runs as a subprocess, as ``make bench`` runs it; timings are never asserted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
VARIANTS = [
    "sk_row",
    "sk_pandas",
    "sk_arrow",
    "sk_arrow_no_state",
    "spark_tws_row",
    "spark_tws_pandas",
    "spark_apply",
    "ceiling",
]
PEERS = ("spark_tws_row", "spark_tws_pandas", "spark_apply")
PIPELINE_FIELDS = {
    "wall_s",
    "rows_per_s",
    "steady_rows_per_s",
    "batch_ms",
    "batch_p50_ms",
    "batch_p99_ms",
    "first_batch_ms",
    "state_commit_p50_ms",
    "durable_state_bytes",
    "query_checkpoint_bytes",
    "restart_cold",
    "final_keys",
    "mismatched_keys",
}


def _run(script: str, out: Path, *args: str, timeout: float = 120) -> dict[str, Any]:
    """Run ``benchmarks/<script>.py``; its stdout and ``--out`` file hold the same JSON."""
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    done = subprocess.run(
        [sys.executable, str(BENCH / f"{script}.py"), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    printed = json.loads(done.stdout)
    assert json.loads(out.read_text()) == printed
    assert printed["benchmark"] == script
    return printed  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A results folder with tiny commit and restore runs."""
    folder = tmp_path_factory.mktemp("results")
    _run("commit", folder / "commit.json", "--sizes", "10000", "20000", "--commits", "3")
    _run("restore", folder / "restore.json", "--keys", "2000", "--versions", "4", "--tail", "2")
    return folder


@pytest.fixture(scope="module")
def pipeline(results: Path) -> dict[str, Any]:
    """A tiny pipeline run of every variant (each warmed up on one batch first, and with one
    cold restart) into ``results``; Spark's own operators read one of the two batches."""
    args = ["--rows", "300", "--keys", "50", "--batches", "2", "--peer-batches", "1", "--anatomy"]
    args += ["--warm-batches", "1"]
    return _run("pipeline", results / "pipeline.json", *args, "--restarts", "cold", timeout=600)


@pytest.fixture(scope="module")
def per_key(results: Path) -> dict[str, Any]:
    """A tiny in-process per-key run into ``results``."""
    args = ["--keys", "300", "--repeat", "2", "--arrow-rows", "500"]
    return _run("per_key", results / "per_key.json", *args)


def test_per_key_reports_every_form(per_key: dict[str, Any]) -> None:
    found = per_key
    assert set(found["results"]) == {"row", "pandas", "pandas_frame"}
    for form, r in found["results"].items():
        assert 0 < r["us_per_key_best"] <= r["us_per_key_median"], form
        assert r["keys_per_s"] > 0
    assert found["results"]["row"]["target_us"] == 15.0
    assert isinstance(found["results"]["pandas"]["met"], bool)
    arrow = found["arrow"]["500"]
    assert 0 < arrow["keys"] <= 500
    assert arrow["function_ms"] >= 0
    assert arrow["commit_ms"] >= 0
    # The split adds up to the function's time (each part rounded on its own).
    parts = arrow["multi_get_ms"] + arrow["put_many_ms"] + arrow["other_ms"]
    assert abs(parts - arrow["function_ms"]) <= 2
    assert {"encode", "compress", "upload"} <= set(arrow["commit_phases_ms"])
    assert isinstance(per_key["load_average_1m"], float)


def test_commit_and_restore_print_the_fields_the_report_reads(results: Path) -> None:
    commit = json.loads((results / "commit.json").read_text())
    assert [r["state_keys"] for r in commit["results"]] == [10000, 20000]
    for r in commit["results"]:
        assert r["commits"] == 3
        assert r["commit_p50_ms"] <= r["commit_p99_ms"]
        assert r["bytes_uploaded_per_commit"] > 0
        assert r["upload_to_raw_ratio"] > 0
        phases = r["phases_p50_ms"]  # the breakdown of the current protocol's commits
        assert {"encode", "compress", "checksum", "upload", "fsync", "apply", "other"} <= set(
            phases
        )
        assert all(ms >= 0 for ms in phases.values())
        assert phases["apply"] > 0
    # Both protocols ran side by side: 0.1.0 commits with one PUT (its changelog), format 2
    # with two (the attempt's changelog, then the manifest naming it), and nothing else.
    puts = {
        protocol: [r["requests_per_commit"] for r in rows]
        for protocol, rows in commit["protocols"].items()
    }
    assert puts == {"current": [{"PUT": 2.0}] * 2, "0.1.0": [{"PUT": 1.0}] * 2}
    restore = json.loads((results / "restore.json").read_text())
    assert set(restore["results"]) == {
        "local_current",
        "local_behind",
        "cold_snapshot",
        "cold_snapshot_uncached",
        "cold_snapshot_s3",
        "cold_changelogs",
    }
    for way in ("cold_snapshot", "cold_snapshot_uncached", "cold_snapshot_s3"):
        assert restore["results"][way]["base_kind"] == "snapshot"
        assert restore["results"][way]["bytes_downloaded"] > 0
    assert restore["results"]["cold_snapshot_uncached"]["files_evicted"] > 0
    assert restore["results"]["cold_changelogs"]["changelogs_replayed"] == 6


def test_report_without_a_pipeline_says_so(results: Path, tmp_path: Path) -> None:
    for name in ("commit", "restore"):
        (tmp_path / f"{name}.json").write_text((results / f"{name}.json").read_text())
    out = tmp_path / "RESULTS.md"
    _report(tmp_path, out)
    text = out.read_text()
    assert "| 10,000 | 3 | 10,000 |" in text
    assert "| `cold_snapshot` |" in text
    assert "No `pipeline.json`." in text


def test_report_shows_commits_into_large_stores_with_their_slowest_commit_and_memory(
    results: Path, tmp_path: Path
) -> None:
    """A ``commit_scale_*.json`` run (here the tiny commit run, both protocols) gets a row
    per size and protocol: p50, p99, the slowest commit's largest phase, peak RSS."""
    commit = json.loads((results / "commit.json").read_text())
    for name in ("commit", "restore"):
        (tmp_path / f"{name}.json").write_text((results / f"{name}.json").read_text())
    (tmp_path / "commit_scale_tiny.json").write_text(json.dumps(commit))
    out = tmp_path / "RESULTS.md"
    _report(tmp_path, out)
    text = out.read_text()
    assert "## Commits into large stores" in text
    current = commit["results"][-1]
    slowest = current["slowest_commits"][0]
    phase, ms = max(slowest["phases_ms"].items(), key=lambda item: item[1])
    assert (
        f"| 20,000 | current | {current['commit_p50_ms']} | {current['commit_p99_ms']} | "
        f"{current['commit_cpu_p50_ms']} | {slowest['ms']} ({phase} {ms}) | "
        f"{current['peak_rss_mb']} | {current['local_copy_mb']} |"
    ) in text
    assert "| 20,000 | 0.1.0 |" in text
    assert current["peak_rss_mb"] >= current["commit_rss_max_mb"] > 0


@pytest.mark.slow
@pytest.mark.spark
def test_pipeline_anatomy_shows_each_batch_s_jobs_and_driver_time(
    pipeline: dict[str, Any],
) -> None:
    """``--anatomy``: Spark's UI is on for every variant, and each variant's steady batches
    are split into their Spark jobs and the driver's time; statekeeper's plan has one job
    more than the ceiling's (the stage boundary after the operator)."""
    assert pipeline["workload"]["spark_conf"]["spark.ui.enabled"] == "true"
    jobs = {}
    for name, r in pipeline["variants"].items():
        anatomy = r["anatomy"]
        if name in PEERS:  # one batch: no steady batch to take apart
            assert anatomy["batches"] == [], name
            continue
        (batch,) = anatomy["batches"]  # batch 1 of 2
        assert len(batch["jobs_ms"]) == anatomy["jobs_per_batch"] >= 2, name
        assert anatomy["job_ms_median"] == batch["jobs_ms"], name
        assert min(batch["jobs_ms"]) >= 0, name
        assert batch["between_jobs_ms"] >= 0, name
        assert batch["after_last_job_ms"] is None  # no batch after it
        assert anatomy["batch_ms_median"] == r["batch_ms"][1]
        jobs[name] = anatomy["jobs_per_batch"]
        if name.startswith("sk_"):
            assert anatomy["stores_opened_per_batch"] == r["stores_opened"][1:], name
            assert 0 <= anatomy["stores_opened_per_batch"][0] <= 4, name
    assert jobs["sk_arrow"] == jobs["sk_arrow_no_state"] == jobs["ceiling"] + 1


@pytest.mark.slow
@pytest.mark.spark
def test_pipeline_variants_agree_with_a_batch_group_by(pipeline: dict[str, Any]) -> None:
    assert pipeline["all_agree"] is True
    assert list(pipeline["variants"]) == VARIANTS
    assert pipeline["workload"]["restarts"] == ["cold"]
    assert pipeline["workload"]["peer_batches"] == 1
    # Every variant ran once, unmeasured, before the first was measured.
    assert pipeline["workload"]["warm_batches"] == 1
    assert pipeline["warm_up_batches"] == dict.fromkeys(VARIANTS, 1)
    for name, r in pipeline["variants"].items():
        peer = name in PEERS
        assert set(r) >= PIPELINE_FIELDS, name
        assert r["mismatched_keys"] == 0, name
        assert r["rows"] == (300 if peer else 600), name
        assert r["batches"] == len(r["batch_ms"]) == (1 if peer else 2)
        assert "restart_warm" not in r
        if name == "ceiling":
            assert r["final_keys"] is None
            assert r["durable_state_bytes"] is None
            continue
        expected = pipeline["expected_keys_peers" if peer else "expected_keys"]
        # Per-batch totals: its counts were checked against the rows read, not the keys.
        if name == "sk_arrow_no_state":
            assert r["final_keys"] is None
        else:
            assert r["final_keys"] == expected <= 50
        assert r["durable_state_bytes"] > 0  # its stores committed empty versions
        restore = r["restart_cold"]["restore"]
        if name.startswith("sk_"):
            assert restore["stores_restored"] == 4  # a fresh local dir: all from the root
            assert r["local_state_bytes"] > 0
        else:
            assert restore["stores_loaded_from_checkpoint"] == 4
            assert r["state_rows"] == expected
    ratios = pipeline["ratios"]
    assert ratios["best_peer"] in PEERS
    assert ratios["to_best_peer"][ratios["best_peer"]] == 1.0
    assert set(ratios["to_best_peer"]) == set(VARIANTS)
    assert ratios["sk_arrow_to_ceiling"] > 0
    assert ratios["sk_arrow_no_state_to_ceiling"] > 0


@pytest.mark.slow
@pytest.mark.spark
def test_report_renders_every_table(
    results: Path, per_key: dict[str, Any], pipeline: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "RESULTS.md"
    _report(results, out)
    text = out.read_text()
    assert "Generated " in text
    assert "- CPU: " in text
    assert "| `per_key.json` | " in text  # where each file was measured
    assert "Spark " in text
    assert "| 20,000 | 3 | 10,000 |" in text
    assert "| `local_behind` |" in text
    assert "|  | " + " | ".join(f"`{v}`" for v in VARIANTS) + " |" in text
    assert "| equals a batch groupBy |" + " yes |" * len(VARIANTS) in text
    assert "Steady rows/s against the best Spark peer" in text
    assert "ran the first 1 of the 2 batches" in text
    assert "| `row` |" in text
    assert "| 500 |" in text
    assert "| multi_get ms | put_many ms | rest ms |" in text
    assert f"(load average {per_key['load_average_1m']} at the end" in text
    assert "keys): yes." in text
    assert "## Streaming pipeline at " not in text

    # A pipeline run at another batch size (pipeline_peer_*.json) gets a section of its
    # own, headed by the command that makes it.
    more = tmp_path / "more"
    shutil.copytree(results, more)
    shutil.copy(results / "pipeline.json", more / "pipeline_peer_tiny.json")
    _report(more, out)
    text = out.read_text()
    w = pipeline["workload"]
    command = (
        f"--rows {w['rows_per_batch']} --keys {w['keys']} --batches {w['batches']} "
        f"--peer-batches {w['peer_batches']} --variants {' '.join(pipeline['variants'])} "
        f"--restarts {' '.join(w['restarts'])} --warm-batches 1"
    )
    assert (
        f"## Streaming pipeline at {w['rows_per_batch']:,}-row batches "
        f"(`benchmarks/pipeline.py {command}`)"
    ) in text
    assert text.count("| equals a batch groupBy |" + " yes |" * len(VARIANTS)) == 2
    assert text.count("each ran 1 unmeasured micro-batch (") == 2


def test_timers_fires_exactly_the_due_timers_and_the_report_shows_them(tmp_path: Path) -> None:
    """A tiny timers run: every batch finds and fires exactly the due timers in a fresh
    process on the built local copy, the full scan finds the next batch's; the report
    renders its table."""
    args = ["--timers", "6000", "12000", "--due", "1000", "--batches", "3"]
    found = _run("timers", tmp_path / "timers.json", *args, "--build-batch", "5000")
    assert [r["timers"] for r in found["results"]] == [6000, 12000]
    for r in found["results"]:
        assert r["opened_from"] == "local"
        assert r["build_versions"] == -(-r["timers"] // 5000)
        assert r["timers_fired"] == 3000
        assert r["full_scan_due_found"] == 1000
        assert len(r["find_ms"]) == len(r["find_cpu_ms"]) == 3
        assert 0 < r["find_ms_p50"] <= r["find_ms_max"]
        assert r["peak_rss_mb"] > 0
    out = tmp_path / "RESULTS.md"
    _report(tmp_path, out)
    assert "## Finding due timers (`benchmarks/timers.py`)" in out.read_text()
    assert "| 12,000 | 1,000 | 3 |" in out.read_text()


def test_longrun_reports_each_window_and_the_steady_state(tmp_path: Path) -> None:
    """A tiny long run: one row per window, the retained versions bounded by the retention,
    no failed snapshot, and after the manifests' grace a single manifest; the report renders
    its table."""
    found = _run("longrun", tmp_path / "longrun.json", "--commits", "250", "--window", "100")
    assert [w["after_commits"] for w in found["windows"]] == [100, 200, 250]
    for w in found["windows"]:
        assert w["manifests"] >= w["after_commits"]  # none past the 15-minute grace yet
        # retain_versions, plus the versions between GC's base snapshot and the oldest
        # retained one (a snapshot is skipped while the previous one still uploads)
        assert 0 < w["versions_named"] <= 150
        assert w["retired_named"] <= 16
        assert w["failed_snapshots"] == 0
        assert 0 < w["commit_p50_ms"] <= w["commit_p99_ms"]
    assert found["after_grace"]["manifests"] == 1
    assert found["after_grace"]["blobs_deleted_by_gc"] >= found["windows"][-1]["manifests"] - 1
    assert found["flat"]["failed_snapshots"] == 0
    out = tmp_path / "RESULTS.md"
    _report(tmp_path, out)
    text = out.read_text()
    assert "## Long run (`benchmarks/longrun.py`)" in text
    assert "| 250 | " in text
    assert "left 1 manifest(s)" in text


def test_make_bench_runs_every_benchmark_and_the_report() -> None:
    """The recipe the report quotes is the Makefile's, and writes where the report reads."""
    report = _load_report()
    recipe = report.bench_recipe(ROOT / "Makefile")
    for name in ("commit", "restore", "longrun", "per_key", "pipeline", "timers"):
        assert any(
            f"benchmarks/{name}.py" in line and f"--out benchmarks/results/{name}.json" in line
            for line in recipe
        ), recipe
    assert recipe[-1].startswith(".venv/bin/python benchmarks/report.py")
    assert "--out benchmarks/RESULTS.md" in recipe[-1]


def _report(results: Path, out: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "report.py"), "--results", str(results), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "make bench" in out.read_text()


def _load_report() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_report", BENCH / "report.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_repartition_reports_each_way_of_rescaling(tmp_path: Path) -> None:
    doc = _run("repartition", tmp_path / "repartition.json", "--keys", "4000", "--partitions", "2")
    r = doc["results"]
    assert set(r) >= {"plain_restore", "split", "split_misaligned", "merge", "full_rewrite"}
    assert r["split"]["partitions"] == "2 -> 4"
    assert r["split"]["keys_ingested"] == 0  # new boundaries on old ones: one parent each
    assert 0 < r["split"]["bytes_uploaded"] < r["split"]["state_bytes"] < r["split"]["bytes_reused"]
    assert r["merge"]["keys_ingested"] > 0
    assert r["full_rewrite"]["bytes_uploaded"] > r["split"]["bytes_uploaded"]
    assert set(r["targets"]) == {
        "split_uploaded_share", "split_uploaded_share_target",
        "split_time_over_plain_restore", "split_time_over_plain_restore_target",
    }  # fmt: skip


def test_report_shows_each_vectorized_against_ceiling_run(tmp_path: Path) -> None:
    """``pipeline_ceiling_*.json`` (runs of ``--variants sk_arrow ceiling``) each become a
    row, smallest batches first, with the rows/s and ratio of every round and their median;
    a run of one round shows its single ratio."""

    def run(rows: int, arrow: list[int], ceiling: list[int]) -> dict[str, Any]:
        variant = {"batch_p50_ms": 1000, "state_commit_p50_ms": 50.0}
        doc: dict[str, Any] = {
            "workload": {"rows_per_batch": rows, "batches": 6},
            "machine": {"load_average_1m_before": 1.5, "load_average_1m": 2.5},
            "variants": {
                "sk_arrow": {**variant, "steady_rows_per_s": arrow[0]},
                "ceiling": {**variant, "steady_rows_per_s": ceiling[0], "state_commit_p50_ms": 0},
            },
            "ratios": {"sk_arrow_to_ceiling": round(arrow[0] / ceiling[0], 2)},
        }
        if rows == 1_000_000:  # a run with the vectorized form's state taken out
            doc["variants"]["sk_arrow_no_state"] = {**variant, "steady_rows_per_s": 80_000}
            doc["ratios"]["sk_arrow_no_state_to_ceiling"] = 0.8
        if len(arrow) > 1:
            paired = [round(a / c, 2) for a, c in zip(arrow, ceiling, strict=True)]
            doc["rounds"] = {
                "steady_rows_per_s": {"sk_arrow": arrow, "ceiling": ceiling},
                "load_average_1m_after": [[3.0, 4.0]] * len(arrow),
                "sk_arrow_to_ceiling_per_round": paired,
                "sk_arrow_to_ceiling_median": sorted(paired)[len(paired) // 2],
            }
        return doc

    results = tmp_path / "results"
    results.mkdir()
    docs = {"1m": run(1_000_000, [70_000], [100_000]), "100k": run(100_000, [60, 90], [100, 100])}
    for name, doc in docs.items():
        (results / f"pipeline_ceiling_{name}.json").write_text(json.dumps(doc))
    out = tmp_path / "RESULTS.md"
    _report(results, out)
    text = out.read_text()
    assert "## The vectorized form against the ceiling" in text
    small = "| 100,000 | 6 | 2 | 60 / 90 | 100 / 100 | 0.6 / 0.9 | **0.9x** | - | 1,000 / 1,000 |"
    large = "| 1,000,000 | 6 | 1 | 70,000 | 100,000 | 0.7 | **0.7x** | 0.8x | 1,000 / 1,000 |"
    assert small in text
    assert large in text
    assert text.index(small) < text.index(large)
    assert "| 1.5 / 4.0 |" in text  # load before the run / the highest after a variant


def test_report_shows_where_each_batch_goes(tmp_path: Path) -> None:
    """``pipeline_anatomy_*.json`` (runs of ``--anatomy``) give a row per batch size and
    variant, smallest batches first: the jobs, the driver's time, and the stores opened."""

    def run(rows: int, arrow_jobs: list[int]) -> dict[str, Any]:
        def variant(jobs: list[int], **more: Any) -> dict[str, Any]:
            return {
                "anatomy": {
                    "batches": [{"jobs_ms": jobs}],
                    "job_ms_median": jobs,
                    "between_jobs_ms_median": 40,
                    "after_last_job_ms_median": 300,
                    "batch_ms_median": 1200,
                    **more,
                }
            }

        arrow = variant(
            arrow_jobs, stores_opened_per_batch=[2, 0, 4], state_commit_p50_ms_median=21
        )
        return {
            "workload": {"rows_per_batch": rows},
            "variants": {"sk_arrow": arrow, "ceiling": variant([60, 400]), "spark_apply": {}},
        }

    results = tmp_path / "results"
    results.mkdir()
    for name, doc in {
        "1m": run(1_000_000, [300, 2500, 400]),
        "100k": run(100_000, [70, 480, 190]),
    }.items():
        (results / f"pipeline_anatomy_{name}.json").write_text(json.dumps(doc))
    out = tmp_path / "RESULTS.md"
    _report(results, out)
    text = out.read_text()
    assert "## Where a micro-batch goes" in text
    small = "| 100,000 | `sk_arrow` | 70 + 480 + 190 | 40 | 300 | 1,200 | 2 0 4 | 21 |"
    large = "| 1,000,000 | `sk_arrow` | 300 + 2,500 + 400 |"
    assert small in text
    assert large in text
    assert text.index(small) < text.index(large)
    assert "| 100,000 | `ceiling` | 60 + 400 | 40 | 300 | 1,200 |  |  |" in text
    assert "`spark_apply`" not in text.split("## Where a micro-batch goes")[1]
