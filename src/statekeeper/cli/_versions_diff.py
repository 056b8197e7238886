"""``diff``: the puts and deletes that turn one version of an operator's stores into another.

Read from the changelogs the stores' manifests name (:class:`statekeeper.store.StoreChanges`);
where versions in between have none (GC collected them before a snapshot, or they were
committed in snapshot mode), the two versions around them are restored into a temporary
folder and compared key by key, and the output says so. Changes of a keyed processor's store
are decoded as ``read_state_changes`` decodes them (bookkeeping hidden) unless ``--raw``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import click
from rich.console import Console
from rich.text import Text

from statekeeper.cli._app import UsageFailure, cli, env_of, output_options
from statekeeper.cli._open import Root, open_root, root_arguments
from statekeeper.cli._progress import Bars
from statekeeper.cli._render import print_tables, show_bytes, shown, shown_key
from statekeeper.errors import StateNotFoundError
from statekeeper.keyed import ChangeDecoder, jsonable, read_operator_record
from statekeeper.store import StoreChange, StoreChanges

__all__ = ["diff"]


@cli.command()
@root_arguments
@click.argument("operator")
@click.option(
    "--from", "from_version", type=click.IntRange(min=0), required=True, metavar="V",
    help="The version the changes apply to (0: the empty store).",
)  # fmt: skip
@click.option(
    "--to", "to_version", type=click.IntRange(min=0), metavar="V",
    help="The version they lead to (default: the one inspect reads by default).",
)  # fmt: skip
@click.option(
    "--partition", "-p", type=click.IntRange(min=0), help="Only this partition (default: all)."
)
@click.option(
    "--limit", type=click.IntRange(min=0), default=100, show_default=True,
    help="Show at most this many changes (0: all).",
)  # fmt: skip
@click.option(
    "--raw", is_flag=True,
    help="Show every raw put and delete, undecoded (TTL and timer indexes, list counters, "
    "the operator record included).",
)  # fmt: skip
@click.option(
    "--allow-pickle", is_flag=True,
    help="Decode values of states declared with PickleCodec (runs code from the root).",
)  # fmt: skip
@output_options
@click.pass_context
def diff(
    ctx: click.Context,
    root: str,
    storage_options: dict[str, str],
    operator: str,
    from_version: int,
    to_version: int | None,
    partition: int | None,
    limit: int,
    raw: bool,
    allow_pickle: bool,
) -> None:
    """Show the puts and deletes that turn version --from of OPERATOR into --to.

    The changes of versions FROM+1..TO, in version order, partition by partition, read from
    the changelogs. Where versions in between have no changelog (collected by GC before a
    snapshot, or committed in snapshot mode), the two versions around them are restored and
    compared instead: those changes are their net difference, shown with the later version,
    and the output says so. A keyed processor's changes are decoded (value, map entry, list
    element by sequence number, timer); its bookkeeping (TTL and timer indexes, list
    counters) is left out unless --raw.
    """
    env = env_of(ctx)
    opened = open_root(ctx, root, storage_options)
    opened.require_operator(operator)
    if partition is not None:
        opened.require_partition(operator, partition)
    wanted = [partition] if partition is not None else opened.partitions(operator)
    feeds = [_feed(opened, operator, p, from_version, to_version) for p in wanted]
    decoder = None if raw else _decoder(opened, feeds, allow_pickle)
    left = limit or None
    truncated = False

    def changes(feed: StoreChanges, bars: Bars) -> Iterator[dict[str, Any]]:
        """Up to ``left`` changes of ``feed`` as documents, decoded as they are read: a
        diff of millions of keys is never held whole (``--limit 0``)."""
        nonlocal left, truncated
        if bars.enabled:
            opened.metered.on_read = bars.add(_describe(feed), _bytes(opened, feed)).advance
        try:
            for change in feed:
                item = _item(change, decoder)
                if item is None:
                    continue
                if left is not None and left <= 0:
                    truncated = True  # one change more than shown: something was left out
                    return
                if left is not None:
                    left -= 1
                yield item
        finally:
            opened.metered.on_read = None

    def partitions(bars: Bars) -> Iterator[dict[str, Any]]:
        nonlocal truncated
        for feed in feeds:
            if left is not None and left <= 0:
                truncated = True
                return
            yield _head(feed) | {"changes": changes(feed, bars)}

    with Bars(env, "bytes") as bars:
        head = {"root": opened.uri, "operator": operator, "from": from_version}
        if env.json:
            parts = partitions(bars)
            env.emit_json(
                head
                | {
                    "decoded": decoder is not None,
                    "partitions": parts,
                    "truncated": lambda: truncated,
                }
            )
        else:
            for part in partitions(bars):
                _print(env.console, operator, part)
    if truncated and not env.json:
        env.console.print("more changes follow: raise --limit (0 shows all)")


def _feed(root: Root, operator: str, partition: int, start: int, end: int | None) -> StoreChanges:
    """The feed of one partition, its versions checked (a usage error if one is missing)."""
    to = root.require_version(operator, partition, end)
    if start > to:
        raise UsageFailure(
            f"--from {start} is after --to {to} (partition {partition}): expected a version "
            f"at or before {to}"
        )
    history = root.listing.history(operator, partition)
    try:
        return StoreChanges(
            root.backend, history, root_id=root.meta.root_id, from_version=start, to_version=to
        )
    except StateNotFoundError as exc:
        raise UsageFailure(str(exc)) from exc


def _decoder(root: Root, feeds: list[StoreChanges], allow_pickle: bool) -> ChangeDecoder | None:
    """A decoder for the operator's keyed state, from the record of the first store at the
    version its changes lead to (one restore); ``None`` if it holds none (raw state)."""
    for feed in feeds:
        if feed.to_version > 0 and feed.to_version > feed.from_version:
            with root.backend.open(feed.operator, feed.partition, feed.to_version) as store:
                record = read_operator_record(store)
            return None if record is None else ChangeDecoder(record, allow_pickle=allow_pickle)
    return None


def _bytes(root: Root, feed: StoreChanges) -> int | None:
    """Roughly what reading the feed downloads: its changelogs and the restores of the
    versions around each stretch without changelogs."""
    sizes = root.listing.sizes(feed.operator, feed.partition)
    total = sum(sizes.get(key, 0) for key in feed.changelog_keys())
    for s in feed.stretches:
        if not s.from_changelogs:
            for version in (s.start, s.end):
                got = root.listing.restore_bytes(root.blobs, feed.operator, feed.partition, version)
                total += got or 0
    return total


def _describe(feed: StoreChanges) -> str:
    return f"reading {feed.operator}/{feed.partition}@{feed.from_version}..{feed.to_version}"


def _item(change: StoreChange, decoder: ChangeDecoder | None) -> dict[str, Any] | None:
    """A change as a document; ``None`` for bookkeeping a decoder hides."""
    operation = "delete" if change.value is None else "put"
    item: dict[str, Any] = {"version": change.version, "operation": operation}
    if decoder is not None:
        found = decoder.decode(change)
        if found is None:
            return None
        item["state"] = {
            "name": found.state,
            "kind": found.kind,
            "key": jsonable(found.key),
            "entry": jsonable(found.entry),
            "expires_at_ms": found.expires_at_ms,
        }
        item.update(value=jsonable(found.value), value_format="decoded")
    else:
        key_format, key_text = show_bytes(change.key)
        item.update(key=key_text, key_format=key_format)
        if change.value is None:
            item.update(value=None, value_format=None)
        else:
            value_format, value_text = show_bytes(change.value)
            item.update(value=value_text, value_format=value_format)
    item.update(
        key_hex=change.key.hex(), value_hex=None if change.value is None else change.value.hex()
    )
    return item


def _head(feed: StoreChanges) -> dict[str, Any]:
    """What a partition's document says before its changes."""
    stretches = [
        {
            "from": s.start,
            "to": s.end,
            "source": "changelogs" if s.from_changelogs else "restored versions",
        }
        for s in feed.stretches
    ]
    return {
        "partition": feed.partition,
        "from": feed.from_version,
        "to": feed.to_version,
        "restored": feed.restores,
        "stretches": stretches,
    }


def _print(console: Console, operator: str, part: dict[str, Any]) -> None:
    """Print one partition's changes as tables (:func:`print_tables`)."""
    console.print(
        Text(f"{operator}/{part['partition']} from version {part['from']} to {part['to']}:")
    )
    for s in part["stretches"]:
        if s["source"] != "changelogs":
            console.print(
                Text(
                    f"versions {s['from'] + 1}..{s['to']} have no changelog (collected by GC, "
                    "or committed as snapshots): shown as the difference of the restored "
                    f"versions {s['from']} and {s['to']}, labelled {s['to']}"
                )
            )
    rows = ((str(i["version"]), i["operation"], shown_key(i), _value(i)) for i in part["changes"])
    print_tables(console, ("version", "op", "key", "value"), rows, "changes")


def _value(item: dict[str, Any]) -> Text:
    if item["operation"] == "delete":
        return Text("-", style="dim")
    return shown(item["value"], item["value_format"])
