"""``statekeeper demo``: the demo pipeline (see :mod:`statekeeper.cli.demo`).

The demo imports pyspark; it is imported when the command runs, never when the command
line loads.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import click

from statekeeper.cli._app import CliError, cli, env_of
from statekeeper.cli._open import parse_storage_options
from statekeeper.cli.demo import FORMATS, DemoError, DemoOptions, run_demo

__all__ = ["demo"]

_NEEDS = ("pyspark", "pandas", "pyarrow")


@cli.command()
@click.option(
    "--keys",
    type=click.IntRange(min=1),
    default=2000,
    show_default=True,
    help="Users in the synthetic clickstream.",
)
@click.option(
    "--batches",
    type=click.IntRange(min=4),
    default=8,
    show_default=True,
    help="Micro-batches (one input file each).",
)
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False),
    default="demo-state",
    show_default=True,
    help="The demo's folder: input, sink, Spark checkpoint, logs; wiped first.",
)
@click.option(
    "--root",
    default=None,
    metavar="URI",
    help="Checkpoint root (a path, s3://, gs://, az://); one outside DIR must be empty or "
    "a root the demo made (marked by a _demo/root blob)  [default: DIR/state]",
)
@click.option(
    "--local-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where local working copies go  [default: DIR/local]",
)
@click.option(
    "--storage-option",
    "-o",
    "storage_options",
    multiple=True,
    metavar="KEY=VALUE",
    callback=parse_storage_options,
    help="Object store option of --root (endpoint, region, ...); repeatable.",
)
@click.option(
    "--format",
    "file_format",
    type=click.Choice(FORMATS),
    default="json",
    show_default=True,
    help="Format of the input files.",
)
@click.option(
    "--partitions",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="State partitions.",
)
@click.option(
    "--gap",
    "gap_s",
    type=click.IntRange(min=1),
    default=120,
    show_default=True,
    help="Event-time seconds without a click that end a session.",
)
@click.option(
    "--seed", type=int, default=7, show_default=True, help="Seed of the clickstream generator."
)
@click.option(
    "--fresh/--no-fresh",
    default=True,
    show_default=True,
    help="Wipe what a previous demo run left in DIR, the local dir and the root "
    "(--no-fresh refuses to run over it).",
)
@click.pass_context
def demo(
    ctx: click.Context,
    keys: int,
    batches: int,
    directory: str,
    root: str | None,
    local_dir: str | None,
    storage_options: dict[str, str],
    file_format: str,
    partitions: int,
    gap_s: int,
    seed: int,
    fresh: bool,
) -> None:
    """Run the demo: a Spark streaming pipeline with statekeeper state, a hard crash of its
    driver, a restart on the local working copies, a cold restore from the root, and a
    check that output and state equal a batch recomputation.

    Needs Java 17 and the spark extra (pyspark, pandas, pyarrow). Exits 0 if the equality
    check passes, 1 if not. 'statekeeper --verbose demo' also logs what the library does.
    """
    missing = [m for m in _NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise CliError(f"the demo needs {', '.join(missing)}: pip install 'statekeeper[spark]'")
    # Spark's Python workers must run this interpreter, which has statekeeper installed.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    try:
        options = DemoOptions(
            keys=keys, batches=batches, directory=directory, root=root, local_dir=local_dir,
            storage_options=storage_options, file_format=file_format,  # type: ignore[arg-type]
            partitions=partitions, gap_s=gap_s, seed=seed, fresh=fresh,
        )  # fmt: skip
        code = run_demo(options, env_of(ctx).console)
    except (DemoError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    ctx.exit(code)
