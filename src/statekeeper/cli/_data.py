"""``inspect`` and ``restore``: the keys and values of a store at a version.

Both open the store through :meth:`StateBackend.open` (snapshot restore plus changelog
replay, every byte checked) into a temporary working copy, never the pipeline's own.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.text import Text

from statekeeper.cli._app import Env, UsageFailure, cli, env_of, output_options
from statekeeper.cli._open import Root, open_root, root_arguments
from statekeeper.cli._progress import Bars
from statekeeper.cli._render import human_bytes, print_tables, show_bytes, shown, shown_key
from statekeeper.errors import StateKeeperError
from statekeeper.keyed import StateDecoder, iter_timers, jsonable, read_operator_record
from statekeeper.store import ExportInfo, StateStore

__all__ = ["inspect", "restore"]


def _parse_prefix(_ctx: click.Context, _param: click.Parameter, value: str | None) -> bytes:
    if value is None:
        return b""
    if value[:2].lower() == "0x":
        try:
            return bytes.fromhex(value[2:])
        except ValueError as exc:
            raise click.BadParameter(f"{value!r} is not hex after '0x': {exc}") from exc
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:  # bytes the shell passed that are not UTF-8
        raise click.BadParameter(
            f"{value!r} is not UTF-8 text: give other bytes as '0x' then hex digits"
        ) from exc


def _store_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option(
        "--version",
        "version",
        type=click.IntRange(min=0),
        help=(
            "The version to read (default: the one the newest epoch manifest names, as "
            "read_state reads it; the newest without one)."
        ),
    )(f)
    f = click.option(
        "--partition", "-p", type=click.IntRange(min=0), required=True, help="The partition."
    )(f)
    return click.argument("operator")(f)


@contextmanager
def _download_bar(
    env: Env, root: Root, operator: str, partition: int, version: int
) -> Iterator[Bars]:
    """Bars with one "downloading" bar fed by every byte the store reads."""
    with Bars(env, "bytes") as bars:
        if bars.enabled:
            total = root.listing.restore_bytes(root.blobs, operator, partition, version)
            bar = bars.add(f"downloading {operator}/{partition}@{version}", total)
            root.metered.on_read = bar.advance
        try:
            yield bars
        finally:
            root.metered.on_read = None


def _open_store(
    ctx: click.Context,
    root: str,
    storage_options: dict[str, str],
    names: tuple[str, int],
    version: int | None,
) -> tuple[Root, int]:
    """Open the root and check the store and version exist; returns the version to open."""
    opened = open_root(ctx, root, storage_options)
    opened.require_partition(*names)
    return opened, opened.require_version(*names, version)


def _item(key: bytes, value: bytes, decoder: StateDecoder | None) -> dict[str, Any]:
    key_format, key_text = show_bytes(key)
    item: dict[str, Any] = {"key": key_text, "key_format": key_format}
    entry = None if decoder is None else decoder.decode(key, value)
    if entry is not None:
        item.update(
            value=jsonable(entry.value),
            value_format="decoded",
            state={
                "name": entry.state,
                "kind": entry.kind,
                "key": jsonable(entry.key),
                "entry": jsonable(entry.entry),
                "expires_at_ms": entry.expires_at_ms,
            },
        )
    else:
        value_format, value_text = show_bytes(value)
        item.update(value=value_text, value_format=value_format)
    item.update(key_hex=key.hex(), value_hex=value.hex())
    return item


@cli.command()
@root_arguments
@_store_options
@click.option(
    "--prefix",
    callback=_parse_prefix,
    metavar="HEX|TEXT",
    help="Only keys starting with this: '0x' then hex digits, else UTF-8 text.",
)
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=100,
    show_default=True,
    help="Show at most this many items (0: all).",
)
@click.option(
    "--allow-pickle",
    is_flag=True,
    help="Decode values of states declared with PickleCodec (runs code from the root).",
)
@click.option(
    "--timers",
    "show_timers",
    is_flag=True,
    help="Show the registered timers of a keyed store (key, when each fires) instead.",
)
@output_options
@click.pass_context
def inspect(
    ctx: click.Context,
    root: str,
    storage_options: dict[str, str],
    operator: str,
    partition: int,
    version: int | None,
    prefix: bytes,
    limit: int,
    allow_pickle: bool,
    show_timers: bool,
) -> None:
    """Show the keys and values of OPERATOR's store at a version, sorted by key.

    In a store written by a keyed processor (statekeeper.spark's transform_with_state),
    each value, map entry and list element is decoded with the codec its state recorded,
    and shown with its state, grouping key and entry. Other items (and the raw keys) are
    shown as text when printable UTF-8, else as hex. With --timers, the registered timers
    instead, in the order they fire.
    """
    env = env_of(ctx)
    opened, wanted = _open_store(ctx, root, storage_options, (operator, partition), version)
    with _download_bar(env, opened, operator, partition, wanted):
        store = opened.backend.open(operator, partition, wanted)
    if show_timers:
        _inspect_timers(env, store, opened.uri, limit)
        return
    head = {
        "root": opened.uri,
        "operator": operator,
        "partition": partition,
        "version": wanted,
        "prefix_hex": prefix.hex(),
    }
    truncated = False

    def items() -> Iterator[dict[str, Any]]:
        """The items, decoded as they are scanned: a store of millions of keys is never
        held whole (``--limit 0``)."""
        nonlocal truncated
        for count, (key, value) in enumerate(store.scan(prefix)):
            if limit and count == limit:
                truncated = True  # one item more than shown: something was left out
                return
            yield _item(key, value, decoder)

    with store:
        record = read_operator_record(store)
        decoder = None if record is None else StateDecoder(record, allow_pickle=allow_pickle)
        if env.json:
            env.emit_json({**head, "items": items(), "truncated": lambda: truncated})
            return
        _print_items(env.console, head, items())
    if truncated:
        env.console.print("more items follow: raise --limit (0 shows all)")


def _inspect_timers(env: Env, store: StateStore, uri: str, limit: int) -> None:
    """Print or emit the store's timers, soonest first, as they are scanned (``--limit 0``
    of millions of timers is never held whole).

    Raises:
        UsageFailure: the store was not written by a keyed processor.
    """
    head = {
        "root": uri,
        "operator": store.operator,
        "partition": store.partition,
        "version": store.version,
    }
    truncated = False

    def timers() -> Iterator[dict[str, Any]]:
        nonlocal truncated
        try:
            for count, t in enumerate(iter_timers(store)):
                if limit and count == limit:
                    truncated = True
                    return
                yield {"key": jsonable(t.key), "expiry_ms": t.expiry_ms, "key_group": t.key_group}
        except StateKeeperError as exc:
            raise UsageFailure(str(exc)) from exc

    with store:
        found = timers()
        first = list(itertools.islice(found, 1))  # a store without timers fails before output
        found = itertools.chain(first, found)
        if env.json:
            env.emit_json(head | {"timers": found, "truncated": lambda: truncated})
            return
        where = f"{head['operator']}/{head['partition']} at version {head['version']}"
        env.console.print(Text(f"{where}:"))
        columns = ("key", "fires at (ms)", "fires at (UTC)")
        print_tables(env.console, columns, map(_timer_row, found), "timers")
    if truncated:
        env.console.print("more timers follow: raise --limit (0 shows all)")


def _timer_row(timer: dict[str, Any]) -> tuple[Text, str, str]:
    when = dt.datetime.fromtimestamp(timer["expiry_ms"] / 1000, dt.UTC).isoformat()
    return Text(json.dumps(timer["key"], ensure_ascii=False)), str(timer["expiry_ms"]), when


def _print_items(console: Console, head: dict[str, Any], items: Iterator[dict[str, Any]]) -> None:
    """Print ``items`` as tables (:func:`print_tables`)."""
    where = f"{head['operator']}/{head['partition']} at version {head['version']}"
    console.print(Text(f"{where}:"))
    rows = ((shown_key(i), shown(i["value"], i["value_format"])) for i in items)
    print_tables(console, ("key", "value"), rows, "items")


@cli.command()
@root_arguments
@_store_options
@click.option(
    "--to",
    "to",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory to create (it must not exist, or be empty).",
)
@output_options
@click.pass_context
def restore(
    ctx: click.Context,
    root: str,
    storage_options: dict[str, str],
    operator: str,
    partition: int,
    version: int | None,
    to: Path,
) -> None:
    """Materialize OPERATOR's store at a version as a RocksDB directory at --to.

    The directory holds exactly the store's keys and values at that version (the working
    copy's internal version label is not copied) and opens with rocksdict.Rdict(path).
    It is written beside its final place and renamed there only when complete.
    """
    env = env_of(ctx)
    target = to.absolute()
    if target.exists() and any(target.iterdir()):
        raise UsageFailure(f"restore target {target} exists and is not empty")
    opened, wanted = _open_store(ctx, root, storage_options, (operator, partition), version)
    try:
        exported = _materialize(env, opened, (operator, partition), wanted, target)
    except ValueError as exc:  # a target inside the root, checked before any work
        raise UsageFailure(str(exc)) from exc
    info = exported.restore
    doc = {
        "root": opened.uri,
        "operator": operator,
        "partition": partition,
        "version": wanted,
        "path": exported.path,
        "keys": exported.keys,
        "bytes": exported.bytes,
        "base_kind": info.base_kind,
        "base": info.base,
        "changelogs_replayed": info.changelogs_replayed,
        "bytes_downloaded": info.bytes_downloaded,
    }
    if env.json:
        env.emit_json(doc)
    else:
        _print_restored(env.console, doc)


def _materialize(
    env: Env, root: Root, names: tuple[str, int], version: int, target: Path
) -> ExportInfo:
    """Export the store at ``version`` to ``target``, with progress bars on a terminal."""
    with _download_bar(env, root, *names, version) as bars:
        return root.backend.export(
            *names, target, version=version, progress=bars.add("writing", None).advance
        )


def _print_restored(console: Console, doc: dict[str, Any]) -> None:
    source = "the empty store" if doc["base_kind"] == "empty" else f"snapshot {doc['base']}"
    console.print(
        Text(
            f"restored {doc['operator']}/{doc['partition']} version {doc['version']} into "
            f"{doc['path']}: {doc['keys']} keys ({human_bytes(doc['bytes'])}), from {source} "
            f"and {doc['changelogs_replayed']} changelogs, "
            f"{human_bytes(doc['bytes_downloaded'])} downloaded"
        )
    )
