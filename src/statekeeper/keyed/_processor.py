"""The user-facing base class of stateful processors (after Spark 4's ``StatefulProcessor``)."""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any

from statekeeper.keyed._handles import StatefulProcessorHandle

__all__ = ["StatefulProcessor"]


class StatefulProcessor(abc.ABC):
    """Per-key logic with durable state, run by :func:`transform_with_state`.

    For each partition and micro-batch Spark runs a fresh copy of the processor:
    :meth:`init` once (declare states there), :meth:`handle_input_rows` once per grouping key
    of the batch with all of that key's rows, then :meth:`close`. State writes become durable
    when the micro-batch commits; if any call raises, none of the partition's writes are kept
    and Spark retries the task from the last committed state.

    A micro-batch may be re-run (task retry, query restart); its state changes must then be
    the same, so a processor must be deterministic for a given input: measure time with
    ``handle.batch_timestamp_ms``, not the wall clock.
    """

    @abc.abstractmethod
    def init(self, handle: StatefulProcessorHandle) -> None:
        """Declare states with ``handle.value_state/map_state/list_state``."""

    @abc.abstractmethod
    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        """Handle all rows of one grouping key; yield pandas DataFrames of output rows.

        Args:
            key: the key column values, in the order of ``keys``.
            rows: a pandas DataFrame with every input column of this key's rows.
        """

    def close(self) -> None:  # noqa: B027 - optional hook, empty on purpose
        """Called after the last key of a partition that succeeded."""
