"""The ``statekeeper`` command line: see, check, restore and clean a checkpoint root.

Thin commands over the library (ARCHITECTURE §3)::

    statekeeper info ROOT
    statekeeper versions ROOT OPERATOR [--partition N]
    statekeeper inspect ROOT OPERATOR --partition N [--version V] [--prefix HEX|TEXT] [--limit K]
    statekeeper diff ROOT OPERATOR --from V [--to V] [--partition N] [--limit K] [--raw]
    statekeeper stats ROOT [OPERATOR] [--partition N] [--last N]
    statekeeper verify ROOT [--deep]
    statekeeper restore ROOT OPERATOR --partition N [--version V] --to DIR
    statekeeper gc ROOT [--dry-run] [--retain-versions N] [--orphan-ttl SECONDS] [--list]
    statekeeper repartition ROOT OPERATOR --partitions N [--to NEW_OPERATOR]
    statekeeper demo [--keys N] [--batches N] [--root URI] [--local-dir DIR] [--fresh]

Every command takes ``--storage-option KEY=VALUE`` (repeatable), ``--json`` and
``--verbose``. Only this package (and the demo, for its live tables) imports click and rich.
"""

from __future__ import annotations

from collections.abc import Sequence

from statekeeper.cli import (
    _data,
    _demo,
    _info,
    _maintain,
    _repartition,
    _stats,
    _versions_diff,
)
from statekeeper.cli._app import cli

__all__ = ["cli", "main"]

# The command modules register themselves on ``cli`` when imported.
_COMMANDS = (_data, _demo, _versions_diff, _info, _maintain, _repartition, _stats)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the command line (the ``statekeeper`` console script); exits the process."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="statekeeper")
