"""``stats``: per-commit history of bytes, records and latency, with percentiles and a plot.

The history itself is :func:`statekeeper.metrics.commit_history`; this module summarizes
and draws it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from statekeeper.cli._app import UsageFailure, cli, env_of, output_options
from statekeeper.cli._open import Root, open_root, root_arguments
from statekeeper.cli._progress import Bars
from statekeeper.cli._render import block_plot, bucket, human_bytes, percentile
from statekeeper.metrics import CommitRecord, commit_history

__all__ = ["stats"]

_PLOT_HEIGHT = 4
_LATENCY_NOTE = (
    "commit latency: not recorded in this root (it needs commit-metrics blobs, see "
    "statekeeper.metrics); bytes and records come from the committed blobs"
)


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
    headers = sum(_headers(opened, *s, last) for s in stores)
    with Bars(env, "items") as bars:
        bar = bars.add("reading changelog headers", headers)
        threads = opened.backend.config.io_threads

        def one(store: tuple[str, int]) -> list[CommitRecord]:
            return commit_history(
                opened.blobs, opened.listing, *store, last=last, io_threads=threads,
                on_header=lambda: bar.advance(1),
            )  # fmt: skip

        history = {s: one(s) for s in stores}
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


def _headers(root: Root, operator: str, partition: int, last: int | None) -> int:
    """How many changelog headers :func:`commit_history` reads for a store."""
    history = root.listing.history(operator, partition)
    versions = sorted(v for v in history.changelogs | history.snapshots if v > 0)
    if last is not None:
        versions = versions[-last:]
    return sum(1 for v in versions if v in history.changelogs)


def _summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": max(values),
    }


def _summaries(commits: list[CommitRecord]) -> dict[str, Any]:
    return {
        "commits": len(commits),
        "bytes": _summary([c.bytes for c in commits]),
        "records": _summary([c.records for c in commits if c.records is not None]),
        "latency_ms": _summary([c.latency_ms for c in commits if c.latency_ms is not None]),
    }


def _document(root: Root, history: dict[tuple[str, int], list[CommitRecord]]) -> dict[str, Any]:
    recorded = any(c.latency_ms is not None for cs in history.values() for c in cs)
    operators: dict[str, list[CommitRecord]] = {}
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
