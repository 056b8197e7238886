"""The demo pipeline: clickstream sessions on Spark, a hard crash, restores, an equality check.

``statekeeper demo`` (and ``make demo``) runs :func:`run_demo`:

1. a synthetic clickstream generator writes one input file per micro-batch (JSON, CSV or
   Parquet) into ``<dir>/input``;
2. a real PySpark Structured Streaming query sessionizes the clicks per user in event time
   with :func:`statekeeper.spark.transform_with_state` (open sessions, clicks, page counts;
   clicks at or before the watermark are dropped as late; a session closes on an
   event-time timer when the watermark passes its last click + ``gap_s``, also for users
   who stopped clicking) and writes closed sessions to a Parquet sink, showing a live
   table per micro-batch;
3. the first phase runs in a child process (the driver) that is killed with ``SIGKILL``,
   together with its JVM and Python workers, in the middle of a micro-batch;
4. the query restarts in this process on the same local working copies (local reuse), then
   once more on an empty local directory (a cold restore from the checkpoint root), and the
   stores are restored once more with :meth:`statekeeper.StateBackend.open`;
5. the sink and the state (:func:`statekeeper.spark.read_state`) are compared with a batch
   recomputation of the same sessions in pandas over all generated events: the demo prints
   ``equality check: PASSED (...)`` and returns 0, or ``FAILED`` with the differences and 1.

Importing this package does not import pyspark; :func:`run_demo` needs the ``spark`` extra
(pyspark, pandas, pyarrow) and Java 17.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from statekeeper.cli.demo._options import FORMATS, DemoError, DemoOptions

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["FORMATS", "DemoError", "DemoOptions", "run_demo"]


def run_demo(options: DemoOptions, console: Console | None = None) -> int:
    """Run the whole demo; returns the exit code (0: the equality check passed, else 1).

    Raises:
        DemoError: the demo folder or root cannot be used, or a phase failed.
        StateKeeperError: the checkpoint root failed.
    """
    from statekeeper.cli.demo._run import run

    return run(options, console)
