"""``info`` and ``versions``: what a root holds, and how each version would be restored."""

from __future__ import annotations

import datetime
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from statekeeper.cli._app import cli, env_of, output_options
from statekeeper.cli._open import Root, open_root, root_arguments
from statekeeper.cli._render import human_bytes, version_ranges
from statekeeper.history import StoreHistory

__all__ = ["info", "versions"]


@cli.command()
@root_arguments
@output_options
@click.pass_context
def info(ctx: click.Context, root: str, storage_options: dict[str, str]) -> None:
    """Show what ROOT holds: operators, partitions, versions, snapshots, size, mode.

    The mode of a store is that of its newest version: "changelog" (a changelog commits it)
    or "snapshot" (a snapshot index does); "empty" when nothing was committed.
    """
    env = env_of(ctx)
    opened = open_root(ctx, root, storage_options)
    doc = _info_document(opened)
    if env.json:
        env.emit_json(doc)
    else:
        _print_info(env.console, doc)


def _info_document(root: Root) -> dict[str, Any]:
    listing = root.listing
    operators: list[dict[str, Any]] = [
        {
            "name": name,
            "partitions": count,
            "stores": [_store_summary(root, name, p) for p in root.partitions(name)],
        }
        for name, count in sorted(root.meta.operators.items())
    ]
    modes = {s["mode"] for op in operators for s in op["stores"]} - {"empty", "unrestorable"}
    return {
        "root": root.uri,
        "format_version": root.meta.format_version,
        "root_id": root.meta.root_id,
        "created_time_ms": root.meta.created_time_ms,
        "mode": modes.pop() if len(modes) == 1 else ("mixed" if modes else "empty"),
        "blobs": len(listing.blobs),
        "bytes": sum(m.size for m in listing.blobs),
        "epochs": {
            "count": len(listing.epochs),
            "latest": max((e for _, e in listing.epochs), default=None),
            "queries": {
                query or "": max(e for q, e in listing.epochs if q == query)
                for query in sorted({q for q, _ in listing.epochs}, key=lambda q: q or "")
            },
        },
        "operators": operators,
    }


def _store_summary(root: Root, operator: str, partition: int) -> dict[str, Any]:
    history = root.listing.history(operator, partition)
    metas = root.listing.metas(operator, partition)
    restorable = history.restorable_versions()
    latest = restorable[-1] if restorable else None
    return {
        "partition": partition,
        "latest_version": latest,
        "oldest_version": restorable[0] if restorable else None,
        "newest_snapshot": history.newest_snapshot,
        "changelogs": len(history.changelogs),
        "snapshots": len(history.snapshots),
        "mode": _mode(history, latest),
        "blobs": len(metas),
        "bytes": sum(m.size for m in metas),
    }


def _mode(history: StoreHistory, latest: int | None) -> str:
    if latest is None:
        return "unrestorable"
    if latest in history.changelogs:
        return "changelog"
    if latest in history.snapshots:
        return "snapshot"
    return "empty"


def _print_info(console: Console, doc: dict[str, Any]) -> None:
    created = datetime.datetime.fromtimestamp(doc["created_time_ms"] / 1000, datetime.UTC)
    epochs = doc["epochs"]
    console.print(Text(f"root           {doc['root']}"))
    console.print(f"format version {doc['format_version']}   mode {doc['mode']}")
    console.print(f"created        {created:%Y-%m-%d %H:%M:%S} UTC")
    console.print(f"root id        {doc['root_id']}")
    console.print(f"blobs          {doc['blobs']} ({human_bytes(doc['bytes'])})")
    if epochs["count"]:
        console.print(f"epochs         {epochs['count']} manifests, latest {epochs['latest']}")
    table = Table("operator", "part.", "latest", "oldest", "snap.", "mode", "blobs", "size")
    for col in table.columns[1:]:
        col.justify = "right"
        col.no_wrap = True
    for op in doc["operators"]:
        count = "?" if op["partitions"] is None else str(op["partitions"])
        if not op["stores"]:
            table.add_row(op["name"], f"-/{count}", "-", "-", "-", "empty", "0", "0 B")
        for s in op["stores"]:
            table.add_row(
                op["name"],
                f"{s['partition']}/{count}",
                _opt(s["latest_version"]),
                _opt(s["oldest_version"]),
                _opt(s["newest_snapshot"]),
                s["mode"],
                str(s["blobs"]),
                human_bytes(s["bytes"]),
            )
    console.print(table)


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


@cli.command()
@root_arguments
@click.argument("operator")
@click.option(
    "--partition",
    "-p",
    type=click.IntRange(min=0),
    help="Only this partition (default: every partition of OPERATOR).",
)
@output_options
@click.pass_context
def versions(
    ctx: click.Context,
    root: str,
    storage_options: dict[str, str],
    operator: str,
    partition: int | None,
) -> None:
    """List the restorable versions of OPERATOR and what restoring each one needs.

    A version is restored from the newest snapshot at or below it (or from the empty
    store), then the changelogs after that snapshot are replayed up to the version.
    """
    env = env_of(ctx)
    opened = open_root(ctx, root, storage_options)
    if partition is None:
        opened.require_operator(operator)
        partitions = opened.partitions(operator)
    else:
        opened.require_partition(operator, partition)
        partitions = [partition]
    doc = {
        "root": opened.uri,
        "operator": operator,
        "partitions": [
            {"partition": p, "versions": _plans(opened.listing.history(operator, p))}
            for p in partitions
        ],
    }
    if env.json:
        env.emit_json(doc)
    else:
        _print_versions(env.console, doc)


def _plans(history: StoreHistory) -> list[dict[str, Any]]:
    out = []
    manifest = history.manifest
    for v in history.restorable_versions():
        plan = history.plan(v, None)
        entry = None if manifest is None else manifest.entry(v)
        out.append(
            {
                "version": v,
                "base_kind": plan.base_kind,
                "snapshot": plan.base if plan.base_kind == "snapshot" else None,
                "changelogs": list(plan.replay),
                # Who committed it: the streaming query's id in the Spark layer.
                "owner": (entry.owner or None) if entry is not None else None,
            }
        )
    return out


def _print_versions(console: Console, doc: dict[str, Any]) -> None:
    columns = ["partition", "versions (V)", "restored from", "then replays changelogs"]
    owned = any(v["owner"] for part in doc["partitions"] for v in part["versions"])
    table = Table(*columns, *(["owner (streaming query)"] if owned else []))
    for part in doc["partitions"]:
        rows = _group(part["versions"])
        if not rows:
            table.add_row(str(part["partition"]), "none", "-", "-", *(["-"] if owned else []))
        for versions_, entry in rows:
            first = entry["changelogs"][0] if entry["changelogs"] else None
            source = (
                f"snapshot {entry['snapshot']}" if entry["snapshot"] is not None else "empty store"
            )
            replay = "none" if first is None else f"{first}..V"
            if len(versions_) == 1 and first is not None:
                replay = version_ranges(entry["changelogs"])
            owner = [entry["owner"] or "-"] if owned else []
            table.add_row(str(part["partition"]), version_ranges(versions_), source, replay, *owner)
    console.print(Text(f"{doc['operator']} in {doc['root']}"))
    console.print(table)


def _group(entries: list[dict[str, Any]]) -> list[tuple[list[int], dict[str, Any]]]:
    """Consecutive versions restored from the same base (and of one owner), as one row each.

    A snapshot version itself (nothing to replay) gets a row of its own.
    """
    rows: list[tuple[list[int], dict[str, Any]]] = []
    for entry in entries:
        key = (entry["base_kind"], entry["snapshot"], bool(entry["changelogs"]), entry["owner"])
        if rows:
            last_versions, last = rows[-1]
            last_key = (
                last["base_kind"], last["snapshot"], bool(last["changelogs"]), last["owner"]
            )  # fmt: skip
            if last_key == key and last_versions[-1] + 1 == entry["version"]:
                last_versions.append(entry["version"])
                continue
        rows.append(([entry["version"]], entry))
    return rows
