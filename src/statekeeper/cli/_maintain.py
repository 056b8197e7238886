"""``verify`` and ``gc``: is the root intact, and what can be deleted.

Both are thin over :meth:`StateBackend.verify` and :meth:`StateBackend.gc` and render their
reports (:class:`~statekeeper.VerifyReport`, :class:`~statekeeper.GcReport`).
"""

from __future__ import annotations

import math
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from statekeeper.cli._app import EXIT_PROBLEMS, cli, env_of, output_options
from statekeeper.cli._open import open_root, root_arguments
from statekeeper.cli._progress import Bars
from statekeeper.cli._render import human_bytes
from statekeeper.config import StoreConfig
from statekeeper.gc import MIN_ORPHAN_TTL_S, GcReport
from statekeeper.store import Retention
from statekeeper.verify import VerifyReport

__all__ = ["gc", "verify"]

_DEFAULTS = StoreConfig()


@cli.command()
@root_arguments
@click.option(
    "--deep",
    is_flag=True,
    help="Also download every blob and check every checksum (and read every snapshot SST "
    "file whole with RocksDB).",
)
@output_options
@click.pass_context
def verify(ctx: click.Context, root: str, storage_options: dict[str, str], deep: bool) -> None:
    """Check every reference in ROOT and, with --deep, every checksum.

    Exits 0 when the root is intact, 1 with the list of problems otherwise.
    """
    env = env_of(ctx)
    opened = open_root(ctx, root, storage_options)
    with Bars(env, "items") as bars:
        bar = bars.add("verifying blobs" + (" (deep)" if deep else ""), None)
        report: VerifyReport = opened.backend.verify(deep=deep, progress=bar.set)
    doc = _verify_document(opened.uri, deep, report)
    if env.json:
        env.emit_json(doc)
    else:
        _print_verify(env.console, doc)
    if not report.ok:
        click.echo(
            f"statekeeper: verify found {len(report.problems)} problem(s) in {opened.uri}",
            err=True,
        )
        ctx.exit(EXIT_PROBLEMS)


def _verify_document(uri: str, deep: bool, report: VerifyReport) -> dict[str, Any]:
    return {
        "root": uri,
        "deep": deep,
        "ok": report.ok,
        "blobs_checked": report.blobs_checked,
        "bytes_checked": report.bytes_checked,
        "problems": [
            {"store": p.store, "blob": p.blob, "kind": p.kind, "message": p.message}
            for p in report.problems
        ],
    }


def _print_verify(console: Console, doc: dict[str, Any]) -> None:
    checked = f"{doc['blobs_checked']} blobs ({human_bytes(doc['bytes_checked'])} read)"
    how = "every reference and checksum" if doc["deep"] else "every reference"
    if doc["ok"]:
        console.print(Text(f"{doc['root']}: intact; checked {how} of {checked}"))
        return
    table = Table("store", "kind", "blob", "problem")
    table.columns[3].overflow = "fold"
    for p in doc["problems"]:
        table.add_row(Text(p["store"]), Text(p["kind"]), Text(p["blob"]), Text(p["message"]))
    console.print(table)
    console.print(
        Text(f"{doc['root']}: {len(doc['problems'])} problem(s); checked {how} of {checked}")
    )


def _finite(seconds: float | None) -> float | None:
    """FloatRange lets nan (which compares false with the bound) and inf through."""
    if seconds is not None and not math.isfinite(seconds):
        raise click.BadParameter(f"{seconds} is not a finite number of seconds")
    return seconds


@cli.command()
@root_arguments
@click.option("--dry-run", is_flag=True, help="Show what would be deleted; delete nothing.")
@click.option(
    "--retain-versions",
    type=click.IntRange(min=1),
    default=None,
    help="Keep this many of the newest versions of every store restorable "
    "[default: what the root records of the pipeline's StoreConfig, else "
    f"{_DEFAULTS.retain_versions}].",
)
@click.option(
    "--orphan-ttl",
    type=click.FloatRange(min=0),
    callback=lambda _ctx, _param, value: _finite(value),
    default=None,
    metavar="SECONDS",
    help="Delete blobs no version references only once older than this "
    "[default: what the root records of the pipeline's StoreConfig, else "
    f"{_DEFAULTS.orphan_ttl_s:.0f}].",
)
@click.option("--list", "list_keys", is_flag=True, help="Also list every deleted key.")
@output_options
@click.pass_context
def gc(
    ctx: click.Context,
    root: str,
    storage_options: dict[str, str],
    dry_run: bool,
    retain_versions: int | None,
    orphan_ttl: float | None,
    list_keys: bool,
) -> None:
    """Delete what no retained version of any store in ROOT needs (see --dry-run).

    Every version among the newest --retain-versions of each store stays restorable; blobs
    that no committed version references are deleted once older than --orphan-ttl. Both
    default, per operator, to the retention the root records of that operator's last run
    (else of the root's last run).
    """
    env = env_of(ctx)
    recorded = open_root(ctx, root, storage_options).backend.recorded_retention()
    default = Retention(_DEFAULTS.retain_versions, _DEFAULTS.orphan_ttl_s)
    retention = {
        name: Retention(
            kept.retain_versions if retain_versions is None else retain_versions,
            kept.orphan_ttl_s if orphan_ttl is None else orphan_ttl,
        )
        for name, kept in recorded.items()
    }
    # Operators the root records no retention for, and what belongs to the whole root,
    # get the options, else the most patient of the recorded ones, else the defaults.
    fallback = Retention(
        max([r.retain_versions for r in retention.values()], default=default.retain_versions)
        if retain_versions is None
        else retain_versions,
        max([r.orphan_ttl_s for r in retention.values()], default=default.orphan_ttl_s)
        if orphan_ttl is None
        else orphan_ttl,
    )
    opened = open_root(
        ctx, root, storage_options,
        retain_versions=fallback.retain_versions, orphan_ttl_s=fallback.orphan_ttl_s,
    )  # fmt: skip
    report: GcReport = opened.backend.gc(dry_run=dry_run, retention=retention)
    applied = {name: retention.get(name, fallback) for name in opened.meta.operators}
    doc = _gc_document(opened.uri, applied or {"": fallback}, report)
    if env.json:
        env.emit_json(doc)
    else:
        _print_gc(env.console, doc, list_keys)


def _gc_document(uri: str, applied: dict[str, Retention], report: GcReport) -> dict[str, Any]:
    # GC raises a grace below its floor (a WARNING says so): report the one it used.
    used = {
        name: {
            "retain_versions": kept.retain_versions,
            "orphan_ttl_s": max(kept.orphan_ttl_s, MIN_ORPHAN_TTL_S),
        }
        for name, kept in sorted(applied.items())
    }
    uniform = {(u["retain_versions"], u["orphan_ttl_s"]) for u in used.values()}
    retain, grace = uniform.pop() if len(uniform) == 1 else (None, None)
    used.pop("", None)  # a root without operators: what GC would have applied
    stores = [
        {
            "store": name,
            "deleted_blobs": s.deleted_blobs,
            "deleted_bytes": s.deleted_bytes,
            "kept_blobs": s.kept_blobs,
            "kept_bytes": s.kept_bytes,
            "skipped": getattr(s, "skipped", None),
        }
        for name, s in sorted(report.stores.items())
    ]
    return {
        "root": uri,
        "dry_run": report.dry_run,
        # The one retention every operator got, else null (see "operators").
        "retain_versions": retain,
        "orphan_ttl_s": grace,
        "operators": used,
        "deleted_blobs": len(report.deleted_keys),
        "deleted_bytes": report.deleted_bytes,
        "deleted_root_blobs": report.deleted_root_blobs,
        "stores": stores,
        "deleted_keys": list(report.deleted_keys),
    }


def _kept_versions(doc: dict[str, Any]) -> str:
    if doc["retain_versions"] is not None:
        return f"{doc['retain_versions']} versions of every store"
    each = ", ".join(f"{n}: {u['retain_versions']}" for n, u in doc["operators"].items())
    return f"versions each operator's last run asked for ({each})"


def _print_gc(console: Console, doc: dict[str, Any], list_keys: bool) -> None:
    verb = "would delete" if doc["dry_run"] else "deleted"
    table = Table("store", f"{verb} blobs", f"{verb} size", "kept blobs", "kept size", "note")
    for column in table.columns[1:5]:
        column.justify = "right"
    for s in doc["stores"]:
        table.add_row(
            Text(s["store"]),
            str(s["deleted_blobs"]),
            human_bytes(s["deleted_bytes"]),
            str(s["kept_blobs"]),
            human_bytes(s["kept_bytes"]),
            Text(s["skipped"] or ""),
        )
    console.print(table)
    if list_keys:
        for key in doc["deleted_keys"]:
            console.print(Text(f"{verb}: {key}"))
    dry = " (dry run: nothing was deleted)" if doc["dry_run"] else ""
    root_blobs = doc["deleted_root_blobs"]
    others = f"; {root_blobs} epoch manifests, task reports and probes" if root_blobs else ""
    console.print(
        Text(
            f"{doc['root']}: {verb} {doc['deleted_blobs']} blobs "
            f"({human_bytes(doc['deleted_bytes'])} of stores{others}), keeping the newest "
            f"{_kept_versions(doc)}{dry}"
        )
    )
