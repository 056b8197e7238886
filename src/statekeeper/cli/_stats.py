"""``stats``: per-commit history of bytes, records and latency, with percentiles and a plot.

Bytes and records come from the commits themselves: a changelog commit's size is its blob's
size and its record count is in its header (one ranged read of
:data:`~statekeeper.changelog.HEADER_SIZE` bytes); a snapshot-mode commit's bytes are its
index plus the file blobs it added over the previous snapshot. Latency is not derivable
from blobs (their modification times measure the gaps between batches, not commits): it is
shown only where commit-metrics blobs (:mod:`statekeeper.metrics`) record it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from statekeeper import layout
from statekeeper.changelog import HEADER_SIZE, read_header
from statekeeper.cli._app import UsageFailure, cli, env_of, output_options
from statekeeper.cli._progress import Bar, Bars
from statekeeper.cli._render import block_plot, bucket, human_bytes, percentile
from statekeeper.cli._root import Root, open_root, root_arguments
from statekeeper.errors import StateNotFoundError
from statekeeper.metrics import read_commit_metrics
from statekeeper.snapshot import SnapshotIndex, load_index, referenced_blob_ids

__all__ = ["stats"]

_PLOT_HEIGHT = 4
_LATENCY_NOTE = (
    "commit latency: not recorded in this root (it needs commit-metrics blobs, see "
    "statekeeper.metrics); bytes and records come from the committed blobs"
)


@dataclass(frozen=True)
class Commit:
    """What one commit wrote, and how long it took when that is known."""

    version: int
    kind: str
    bytes: int
    records: int | None
    latency_ms: float | None


@cli.command()
@root_arguments
@click.argument("operator", required=False)
@click.option(
    "--partition", "-p", type=click.IntRange(min=0), help="Only this partition (needs OPERATOR)."
)
@click.option(
    "--last", type=click.IntRange(min=1), help="Only the newest N versions of each store."
)
@output_options
@click.pass_context
def stats(
    ctx: click.Context,
    root: str,
    storage_options: dict[str, str],
    operator: str | None,
    partition: int | None,
    last: int | None,
) -> None:
    """Per-commit bytes, records and latency of every store (or of OPERATOR).

    Shows p50, p99 and max per store (and per operator over its partitions), then a plot
    per operator of bytes per commit (summed over partitions) and, where recorded, commit
    latency (the slowest partition) over versions.
    """
    env = env_of(ctx)
    opened = open_root(ctx, root, storage_options)
    stores = _selected(opened, operator, partition)
    versions = {s: _versions(opened, *s, last) for s in stores}
    headers = sum(len(v[1]) for v in versions.values())
    with Bars(env, "items") as bars:
        bar = bars.add("reading changelog headers", headers)
        history = {s: _commits(opened, *s, *versions[s], bar) for s in stores}
    doc = _document(opened, history)
    if env.json:
        env.emit_json(doc)
    else:
        _print_stats(env.console, doc)


def _selected(root: Root, operator: str | None, partition: int | None) -> list[tuple[str, int]]:
    if operator is None:
        if partition is not None:
            raise UsageFailure("--partition needs an OPERATOR")
        return [(op, p) for op in sorted(root.meta.operators) for p in root.partitions(op)]
    if partition is not None:
        root.require_partition(operator, partition)
        return [(operator, partition)]
    root.require_operator(operator)
    return [(operator, p) for p in root.partitions(operator)]


def _versions(
    root: Root, operator: str, partition: int, last: int | None
) -> tuple[list[int], list[int]]:
    """The committed versions of a store (the newest ``last``), and which have changelogs."""
    history = root.listing.history(operator, partition)
    versions = sorted(v for v in history.changelogs | history.snapshots if v > 0)
    if last is not None:
        versions = versions[-last:]
    return versions, [v for v in versions if v in history.changelogs]


def _commits(
    root: Root, operator: str, partition: int, versions: list[int], logged: list[int], bar: Bar
) -> list[Commit]:
    """Every commit among ``versions``; ``logged`` are those a changelog commits."""
    if not versions:
        return []
    sizes = {m.key: m.size for m in root.listing.metas(operator, partition)}
    records = _record_counts(root, operator, partition, logged, bar)
    metrics = read_commit_metrics(root.blobs, operator, partition, since=versions[0])
    snapshots = _SnapshotBytes(root, operator, partition, sizes)
    out = []
    for v in versions:
        if v in records:
            size = sizes[layout.changelog_key(operator, partition, v)]
            commit = Commit(v, "changelog", size, records[v], None)
        else:
            commit = Commit(v, "snapshot", snapshots.bytes_of(v), None, None)
        recorded = metrics.get(v)
        if recorded is not None:  # latency, and the record count a snapshot cannot tell
            commit = dataclasses.replace(
                commit,
                records=recorded.records if commit.records is None else commit.records,
                latency_ms=recorded.duration_ms,
            )
        out.append(commit)
    return out


def _record_counts(
    root: Root, operator: str, partition: int, versions: list[int], bar: Bar
) -> dict[int, int]:
    """Record count of each changelog, from its header alone, read in parallel."""

    def count(v: int) -> int:
        key = layout.changelog_key(operator, partition, v)
        header = read_header(root.blobs.get_range(key, 0, HEADER_SIZE), blob=key)
        bar.advance(1)
        return header.record_count

    with ThreadPoolExecutor(root.backend.config.io_threads) as pool:
        return dict(zip(versions, pool.map(count, versions), strict=True))


class _SnapshotBytes:
    """Bytes a snapshot-mode commit uploaded: its index plus the file blobs new in it."""

    def __init__(self, root: Root, operator: str, partition: int, sizes: dict[str, int]) -> None:
        self._root, self._operator, self._partition = root, operator, partition
        self._sizes = sizes
        self._snapshots = sorted(root.listing.history(operator, partition).snapshots)
        self._indexes: dict[int, SnapshotIndex | None] = {}

    def _index(self, version: int) -> SnapshotIndex | None:
        if version not in self._indexes:
            try:
                self._indexes[version] = load_index(
                    self._root.blobs, self._operator, self._partition, version
                )
            except StateNotFoundError:
                self._indexes[version] = None
        return self._indexes[version]

    def bytes_of(self, version: int) -> int:
        index = self._index(version)
        own = self._sizes.get(
            layout.snapshot_index_key(self._operator, self._partition, version), 0
        )
        if index is None:
            return own
        older = [v for v in self._snapshots if v < version]
        previous = self._index(older[-1]) if older else None
        known = referenced_blob_ids(previous) if previous is not None else set()
        new = referenced_blob_ids(index) - known
        return own + sum(
            self._sizes.get(layout.file_blob_key(self._operator, self._partition, b), 0)
            for b in new
        )


def _summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": max(values),
    }


def _summaries(commits: list[Commit]) -> dict[str, Any]:
    return {
        "commits": len(commits),
        "bytes": _summary([c.bytes for c in commits]),
        "records": _summary([c.records for c in commits if c.records is not None]),
        "latency_ms": _summary([c.latency_ms for c in commits if c.latency_ms is not None]),
    }


def _document(root: Root, history: dict[tuple[str, int], list[Commit]]) -> dict[str, Any]:
    recorded = any(c.latency_ms is not None for cs in history.values() for c in cs)
    operators: dict[str, list[Commit]] = {}
    for (op, _), commits in history.items():
        operators.setdefault(op, []).extend(commits)
    return {
        "root": root.uri,
        "latency_source": "commit-metrics blobs" if recorded else None,
        "stores": [
            {
                "operator": op,
                "partition": p,
                "summary": _summaries(commits),
                "commits": [asdict(c) for c in commits],
            }
            for (op, p), commits in history.items()
        ],
        "operators": [
            {"operator": op, "summary": _summaries(commits)} for op, commits in operators.items()
        ],
    }


def _triple(summary: dict[str, float] | None, show: Callable[[float], str]) -> str:
    if summary is None:
        return "-"
    return " / ".join(show(summary[q]) for q in ("p50", "p99", "max"))


def _print_stats(console: Console, doc: dict[str, Any]) -> None:
    table = Table("store", "commits", "bytes", "records", "latency ms")
    table.caption = "each cell: p50 / p99 / max"
    for column in table.columns[1:]:
        column.justify = "right"
    partitions: dict[str, int] = {}
    for s in doc["stores"]:
        partitions[s["operator"]] = partitions.get(s["operator"], 0) + 1
    rows = [(f"{s['operator']}/{s['partition']}", s["summary"]) for s in doc["stores"]]
    rows += [
        (f"{o['operator']}/*", o["summary"])
        for o in doc["operators"]
        if partitions[o["operator"]] > 1
    ]
    for name, summary in rows:
        table.add_row(
            Text(name),
            str(summary["commits"]),
            _triple(summary["bytes"], human_bytes),
            _triple(summary["records"], lambda x: f"{x:.0f}"),
            _triple(summary["latency_ms"], lambda x: f"{x:.1f}"),
        )
    console.print(table)
    width = max(10, min(console.width - 2, 120))
    for op in partitions:
        _plot_operator(console, op, [s for s in doc["stores"] if s["operator"] == op], width)
    if doc["latency_source"] is None:
        console.print(_LATENCY_NOTE)


def _plot_operator(
    console: Console, operator: str, stores: list[dict[str, Any]], width: int
) -> None:
    per_version: dict[int, list[dict[str, Any]]] = {}
    for s in stores:
        for c in s["commits"]:
            per_version.setdefault(c["version"], []).append(c)
    if not per_version:
        return
    versions = sorted(per_version)
    total_bytes = [float(sum(c["bytes"] for c in per_version[v])) for v in versions]
    _plot(console, f"{operator}: bytes per commit", versions, total_bytes, human_bytes, width)
    latencies = [
        [c["latency_ms"] for c in per_version[v] if c["latency_ms"] is not None] for v in versions
    ]
    if any(latencies):
        slowest = [max(ls, default=0.0) for ls in latencies]
        _plot(
            console,
            f"{operator}: commit latency",
            versions,
            slowest,
            lambda x: f"{x:.1f} ms",
            width,
        )


def _plot(
    console: Console, title: str, versions: list[int], values: list[float], show: Any, width: int
) -> None:
    columns = bucket(values, width)
    console.print(Text(f"{title}, versions {versions[0]}-{versions[-1]} (max {show(max(values))})"))
    for row in block_plot(columns, _PLOT_HEIGHT):
        console.print(Text(row, style="cyan"))
    left, right = f"v{versions[0]}", f"v{versions[-1]}"
    console.print(Text(left + right.rjust(max(len(columns) - len(left), len(right) + 1))))
