"""``stats`` (local and S3), the commit-metrics blobs it reads latency from, and the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import statekeeper as sk
from statekeeper import layout, metrics
from statekeeper.cli._render import block_plot, bucket, human_bytes, percentile, version_ranges
from statekeeper.errors import CorruptStateError
from tests.cli.conftest import Built, one_error_line, run


def _stats(root: Built, *args: str) -> dict[str, object]:
    result = run("stats", root.uri, *root.opts, "--json", *args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert isinstance(doc, dict)
    return doc


def _store(doc: dict[str, object], operator: str, partition: int) -> dict[str, object]:
    stores = doc["stores"]
    assert isinstance(stores, list)
    return next(s for s in stores if (s["operator"], s["partition"]) == (operator, partition))


def test_stats_bytes_and_records_come_from_the_commits(root: Built) -> None:
    doc = _stats(root)
    assert doc["latency_source"] is None
    commits = _store(doc, "counts", 0)["commits"]
    assert isinstance(commits, list)
    infos = root.commits[("counts", 0)]
    assert [c["version"] for c in commits] == sorted(infos)
    for c in commits:
        info = infos[c["version"]]
        assert c["kind"] == "changelog"
        assert c["bytes"] == info.bytes_uploaded
        assert c["records"] == info.puts + info.deletes
        assert c["latency_ms"] is None
    summary = _store(doc, "counts", 0)["summary"]
    sizes = sorted(i.bytes_uploaded for i in infos.values())
    assert summary == {
        "commits": 7,
        "bytes": {"p50": sizes[3], "p99": sizes[-1], "max": sizes[-1]},
        "records": {"p50": 11, "p99": 11, "max": 11},
        "latency_ms": None,
    }
    snap = _store(doc, "snap", 0)["commits"]
    assert isinstance(snap, list)
    assert [(c["version"], c["kind"], c["records"]) for c in snap] == [
        (1, "snapshot", None),
        (2, "snapshot", None),
        (3, "snapshot", None),
    ]
    for c in snap:  # the index and the files it added, as the commit reported
        assert c["bytes"] >= root.commits[("snap", 0)][c["version"]].bytes_uploaded > 0


def test_stats_of_one_operator_partition_and_last(root: Built) -> None:
    doc = _stats(root, "counts", "--partition", "0", "--last", "3")
    stores = doc["stores"]
    assert isinstance(stores, list)
    assert [(s["operator"], s["partition"]) for s in stores] == [("counts", 0)]
    assert [c["version"] for c in stores[0]["commits"]] == [5, 6, 7]
    doc = _stats(root, "counts")
    assert [(s["operator"], s["partition"]) for s in doc["stores"]] == [  # type: ignore[union-attr]
        ("counts", 0),
        ("counts", 1),
    ]
    assert doc["operators"][0]["summary"]["commits"] == 8  # type: ignore[index]


def test_stats_table_and_plot_without_latency(root: Built) -> None:
    result = run("stats", root.uri, *root.opts)
    assert result.exit_code == 0
    out = result.stdout
    assert "counts/0" in out
    assert "counts/*" in out
    assert "snap/0" in out
    assert "counts: bytes per commit, versions 1-7" in out
    assert "commit latency: not recorded" in out
    assert "█" in out


def test_stats_shows_latency_from_commit_metrics_blobs(root: Built) -> None:
    recorded = [
        metrics.CommitMetrics(
            version=v, duration_ms=float(v * 10), bytes=1, records=11, committed_time_ms=v
        )
        for v in range(1, 8)
    ]
    blobs = root.blobs()
    try:
        metrics.write_commit_metrics(blobs, "counts", 0, recorded[:3])
        metrics.write_commit_metrics(blobs, "counts", 0, recorded[3:])
        metrics.write_commit_metrics(
            blobs,
            "snap",
            0,
            [
                metrics.CommitMetrics(
                    version=2, duration_ms=5.0, bytes=9, records=4, committed_time_ms=0
                )
            ],
        )
    finally:
        blobs.close()
    doc = _stats(root)
    assert doc["latency_source"] == "commit-metrics blobs"
    c0 = _store(doc, "counts", 0)
    assert [c["latency_ms"] for c in c0["commits"]] == [10.0 * v for v in range(1, 8)]  # type: ignore[union-attr]
    assert c0["summary"]["latency_ms"] == {"p50": 40.0, "p99": 70.0, "max": 70.0}  # type: ignore[index]
    snap = {c["version"]: c for c in _store(doc, "snap", 0)["commits"]}  # type: ignore[union-attr]
    assert (snap[2]["latency_ms"], snap[2]["records"]) == (5.0, 4)  # records filled in too
    assert snap[1]["latency_ms"] is None
    out = run("stats", root.uri, *root.opts).stdout
    assert "counts: commit latency, versions 1-7 (max 70.0 ms)" in out
    assert "not recorded" not in out


def test_commits_record_their_latency_and_stats_shows_it(tmp_path: Path) -> None:
    backend = sk.StateBackend(
        str(tmp_path / "root"), config=sk.StoreConfig(local_dir=str(tmp_path / "wc"))
    )
    with backend.open("op", 0, partitions=1) as store:
        infos = []
        for v in range(4):
            store.put(b"k%d" % v, b"v" * 50)
            infos.append(store.commit())
    result = run("--json", "stats", str(tmp_path / "root"))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["latency_source"] == "commit-metrics blobs"
    commits = doc["stores"][0]["commits"]
    assert [c["version"] for c in commits] == [1, 2, 3, 4]
    for c, info in zip(commits, infos, strict=True):
        assert c["latency_ms"] == pytest.approx(info.duration_s * 1000, rel=1e-6, abs=1e-3)


def test_stats_bad_input(root: Built) -> None:
    result = run("stats", root.uri, *root.opts, "nope")
    assert result.exit_code == 2
    assert "'nope'" in one_error_line(result)
    result = run("stats", root.uri, *root.opts, "--partition", "0")
    assert result.exit_code == 2
    assert "OPERATOR" in one_error_line(result)


def test_commit_metrics_round_trip_and_keys() -> None:
    entries = [
        metrics.CommitMetrics(version=3, duration_ms=1.5, bytes=10, records=2, committed_time_ms=7),
        metrics.from_commit(2, 0.25, 5, 1),
    ]
    data = metrics.encode_commit_metrics("op", 1, entries)
    decoded = metrics.decode_commit_metrics(data, blob="b")
    assert [d.version for d in decoded] == [2, 3]
    assert decoded[1] == entries[0]
    assert decoded[0].duration_ms == 250.0
    key = layout.metrics_key("op", 1, 3)
    assert key == "op/1/metrics/00000000000000000003.json"
    assert key.startswith(layout.store_prefix("op", 1))
    assert layout.parse_metrics_key(key) == 3
    assert layout.parse_metrics_key(layout.changelog_key("op", 1, 3)) is None
    assert layout.parse_metrics_key("op/1/metrics/3.json") is None
    with pytest.raises(ValueError, match="at least one"):
        metrics.encode_commit_metrics("op", 1, [])


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"not json", "not valid"),
        (b'{"format": "other"}', "format"),
        (b'{"format": "statekeeper-commit-metrics", "formatVersion": 3, "commits": []}', "newer"),
        (
            b'{"format": "statekeeper-commit-metrics", "formatVersion": 1, "commits": '
            b'[{"version": 0, "durationMs": 1, "bytes": 1, "records": 1, "committedTimeMs": 1}]}',
            "out of range",
        ),
    ],
)
def test_commit_metrics_rejects_what_it_cannot_read(data: bytes, match: str) -> None:
    with pytest.raises(CorruptStateError, match=match) as exc:
        metrics.decode_commit_metrics(data, blob="op/0/metrics/x")
    assert "op/0/metrics/x" in str(exc.value)


def test_render_helpers() -> None:
    assert percentile([5, 1, 3, 2, 4], 50) == 3
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([7], 99) == 7
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    assert bucket([1, 9, 2, 2, 3, 1], 3) == [9, 2, 3]
    assert bucket([1, 2], 5) == [1, 2]
    assert block_plot([0, 4, 8], height=2) == ["  █", " ██"]  # top row first
    assert block_plot([0, 5, 8], height=2) == [" ▂█", " ██"]
    assert block_plot([0, 0.01, 100], height=1) == [" ▁█"]  # tiny but not zero shows
    assert block_plot([], height=3) == ["", "", ""]
    assert human_bytes(0) == "0 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 1024**3) == "3.0 GiB"
    assert version_ranges([7, 1, 2, 3, 5]) == "1-3, 5, 7"


def test_stats_on_a_terminal_draws_a_bar_and_the_plot(local: Built) -> None:
    result = run("stats", local.uri, "counts", env={"TTY_COMPATIBLE": "1"})
    assert result.exit_code == 0
    assert "reading changelog headers" in result.stdout
    assert "counts: bytes per commit" in result.stdout
