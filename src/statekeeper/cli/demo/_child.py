"""The crash phase's driver: ``python -m statekeeper.cli.demo._child OPTIONS_JSON``.

It runs the query over the input files present and reports every micro-batch to the parent
as a protocol line on stdout (see :mod:`statekeeper.cli.demo._rows`). It never stops on its
own accord: when the input is processed it waits, because the parent is going to kill it
(``SIGKILL`` to its process group: this process, its JVM and Spark's Python workers).
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from statekeeper.cli.demo._options import DemoOptions
from statekeeper.cli.demo._rows import BatchRow, encode_message, encode_row

__all__ = ["main"]

PHASE = "crash"
_WAIT_FOR_KILL_S = 600.0


def _say(line: str) -> None:
    print(line, flush=True)


def main(argv: list[str]) -> int:
    """Run the crash phase with the options in ``argv[0]``; returns only on failure."""
    try:
        options = DemoOptions.from_json(argv[0])
        from statekeeper.cli.demo._pipeline import build_session, run_phase

        paths = options.paths()
        _say(encode_message("started", pid=os.getpid()))
        spark = build_session(paths, options)
        _say(encode_message("session"))

        def emit(row: BatchRow) -> None:
            _say(encode_row(row))

        run_phase(spark, options, PHASE, paths.local_copies("working"), emit)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the demo
        traceback.print_exc()
        _say(encode_message("error", message=f"{type(exc).__name__}: {exc}"))
        return 1
    _say(encode_message("idle"))
    time.sleep(_WAIT_FOR_KILL_S)  # the parent kills this process; it never stops cleanly
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
