"""``repartition``: move an operator's state to another partition count, offline.

Thin over :func:`statekeeper.repartition.repartition`; shows one bar per phase (old stores
restored, new stores built and uploaded) at a terminal.
"""

from __future__ import annotations

from typing import Any

import click
from rich.console import Console
from rich.text import Text

from statekeeper.cli._app import UsageFailure, cli, env_of, output_options
from statekeeper.cli._open import open_root, root_arguments
from statekeeper.cli._progress import Bar, Bars
from statekeeper.cli._render import human_bytes
from statekeeper.errors import ConfigMismatchError
from statekeeper.repartition import RepartitionReport, check_request, repartition

__all__ = ["repartition_command"]


@cli.command("repartition")
@root_arguments
@click.argument("operator")
@click.option(
    "--partitions",
    "-n",
    type=click.IntRange(min=1),
    required=True,
    help="The new partition count (at most the operator's key groups).",
)
@click.option(
    "--to",
    "to",
    default=None,
    metavar="NEW_OPERATOR",
    help="Write the result as this new operator; OPERATOR stays as it is.",
)
@click.option(
    "--version", "version", type=click.IntRange(min=1), default=None, metavar="V",
    help="Read the old stores at this version, where the new ones start (default: the "
    "consistent cut; asked for when the cut cannot tell).",
)  # fmt: skip
@click.option(
    "--io-threads",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Parallel transfers per store.",
)
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where the old stores are restored (needs room for the operator's state) "
    "[default: the system's temporary folder].",
)
@output_options
@click.pass_context
def repartition_command(
    ctx: click.Context,
    root: str,
    storage_options: dict[str, str],
    operator: str,
    partitions: int,
    to: str | None,
    version: int | None,
    io_threads: int,
    work_dir: str | None,
) -> None:
    """Move OPERATOR's state in ROOT to --partitions N partitions by key-group ranges.

    Stop the query first; restart it with partitions=N (and the name --to, if given): it
    continues from the version the state was at. The old stores stay until gc; a run that
    is interrupted leaves the root as it was.
    """
    env = env_of(ctx)
    opened = open_root(ctx, root, storage_options, io_threads=io_threads)
    try:  # what the request asks for is checked before any work: bad input, exit 2
        check_request(opened.backend, operator, partitions, to)
    except (ValueError, ConfigMismatchError) as exc:
        raise UsageFailure(str(exc)) from exc
    with Bars(env, "items") as bars:
        phases: dict[str, Bar] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in phases:
                label = "restoring old stores" if phase == "restore" else "building new stores"
                phases[phase] = bars.add(label, total)
            phases[phase].set(done, total)

        report = repartition(
            opened.backend, operator, partitions=partitions, to=to, version=version,
            work_dir=work_dir, progress=progress,
        )  # fmt: skip
    doc = _document(opened.uri, report)
    if env.json:
        env.emit_json(doc)
    else:
        _print(env.console, doc)


def _document(uri: str, report: RepartitionReport) -> dict[str, Any]:
    return {"root": uri, **report.to_json()}


def _print(console: Console, doc: dict[str, Any]) -> None:
    share = doc["bytes_uploaded"] / doc["state_bytes"] if doc["state_bytes"] else 0.0
    moved = (
        f"{doc['source']} ({doc['from_partitions']} partitions) -> {doc['operator']} "
        f"({doc['partitions']} partitions) at version {doc['version']}"
    )
    console.print(Text(f"{doc['root']}: repartitioned {moved}"))
    console.print(
        Text(
            f"uploaded {human_bytes(doc['bytes_uploaded'])} ({share:.1%} of the state's "
            f"{human_bytes(doc['state_bytes'])}), reused {human_bytes(doc['bytes_reused'])} of "
            f"the old stores' blobs, {doc['keys_ingested']} keys written again, in "
            f"{doc['duration_s']:.2f} s"
        )
    )
    console.print(
        Text(
            f"restart the query with partitions={doc['partitions']}"
            + (f" and name={doc['operator']!r}" if doc["operator"] != doc["source"] else "")
        )
    )
