"""The user-facing base class of stateful processors (after Spark 4's ``StatefulProcessor``)."""

from __future__ import annotations

import abc
import copy
import logging
from collections.abc import Iterator
from typing import Any, ClassVar, cast

from statekeeper.errors import StateKeeperError
from statekeeper.keyed._handles import StatefulProcessorHandle, check_declaration
from statekeeper.keyed._schema import declare_schema
from statekeeper.keyed._timers import ExpiredTimerInfo, TimerValues

__all__ = [
    "ROW_FORMS",
    "StatefulProcessor",
    "declared_ttls",
    "handles_initial_state",
    "input_form",
]

_log = logging.getLogger("statekeeper.keyed")

ROW_FORMS = ("pandas", "row")


class StatefulProcessor(abc.ABC):
    """Per-key logic with durable state, run by :func:`transform_with_state`.

    For each partition and micro-batch Spark runs a fresh copy of the processor:
    :meth:`init` once (declare states there), :meth:`handle_input_rows` once per grouping key
    of the batch with all of that key's rows, then :meth:`close`. State writes become durable
    when the micro-batch commits; if any call raises, none of the partition's writes are kept
    and Spark retries the task from the last committed state.

    **Two forms**, chosen per processor class by the class attribute :attr:`rows`:

    * ``rows = "pandas"`` (the default, after ``transformWithStateInPandas``): ``rows`` is a
      pandas DataFrame of the key's rows, with the values Spark's pandas API gives: a
      timestamp is naive wall-clock time of the session time zone, a map or a struct is a
      ``dict``; a timestamp in a DataFrame the processor yields is read the same way.
    * ``rows = "row"`` (after Spark 4.1's Row-based ``transformWithState``): ``rows`` is a
      list of lightweight rows, tuples with named access (``row.v``, ``row["v"]``,
      ``row[1]``, ``row.asDict()``). Several times cheaper per key than a DataFrame.

    In both forms ``handle_input_rows`` yields output rows as tuples (by position, in the
    order of ``output_schema``), ``pyspark.sql.Row``\\ s or namedtuples (by field name), or
    dicts (by key); the pandas form may also yield DataFrames. Rows are collected column by
    column into Arrow batches, without a DataFrame per key. A naive ``datetime`` in a row is
    local time of the worker process, as in Spark's Row-based API.

    A micro-batch may be re-run (task retry, query restart); its state changes must then be
    the same, so a processor must be deterministic for a given input: measure time with
    ``handle.batch_timestamp_ms``, not the wall clock.

    **Timers** (an operator with ``time_mode``): ``handle.register_timer(ms)``,
    ``delete_timer(ms)`` and ``list_timers()`` act on the current key's timers;
    :meth:`handle_expired_timer` is called for each timer that fires.

    **Initial state** (``initial_state=`` of the operator): :meth:`handle_initial_state` is
    called once per key of the initial rows, in the operator's first micro-batch only.
    """

    rows: ClassVar[str] = "pandas"
    """How ``handle_input_rows`` receives a key's rows: ``"pandas"`` or ``"row"``."""

    @abc.abstractmethod
    def init(self, handle: StatefulProcessorHandle) -> None:
        """Declare states with ``handle.value_state/map_state/list_state``.

        ``transform_with_state`` also calls it once on the driver, on a copy of the
        processor, with a handle that only takes declarations (then ``close``), as Spark's
        ``transformWithState`` does (:func:`declared_ttls`): keep side effects that need a
        task out of ``init``. A declaration with a malformed argument fails there, before
        the query starts.
        """

    @abc.abstractmethod
    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        """Handle all rows of one grouping key; yield output rows (or DataFrames).

        Args:
            key: the key column values, in the order of ``keys``.
            rows: the key's rows in arrival order: a pandas DataFrame with every input
                column, or (``rows = "row"``) a list of rows with named access.
        """

    def handle_expired_timer(
        self, key: tuple[Any, ...], timer_values: TimerValues, expired_timer_info: ExpiredTimerInfo
    ) -> Iterator[Any]:
        """Handle a timer of ``key`` that fired; yield output rows as ``handle_input_rows``.

        Called once per expired timer, after every key's input of the micro-batch, in order
        of expiry then key, in every partition and micro-batch whether or not the key or
        the partition received input (an operator with ``time_mode`` set). State and timers
        of ``key`` may be used as in ``handle_input_rows``. The default emits nothing.

        As in Spark's ``transformWithState``: the timer is deleted after the call (the
        handler still sees it in ``list_timers``; registering it again does not keep it),
        and the timers that fire are those due when the first handler is called. A due timer
        that a handler deletes still fires (and is no longer listed); a timer a handler
        registers that is already due fires in the next micro-batch.

        Args:
            key: the key the timer was registered for.
            timer_values: the micro-batch's processing time and watermark.
            expired_timer_info: the timer's expiry.
        """
        return iter(())

    def handle_initial_state(  # noqa: B027 - optional hook, empty on purpose
        self, key: tuple[Any, ...], rows: Any, timer_values: TimerValues
    ) -> None:
        """Seed the state of ``key`` from its rows of the operator's ``initial_state``.

        After Spark's ``handleInitialState``: called only in the operator's first
        micro-batch (batch 0, which loads the empty version 0; a restart of the query at a
        later batch does not call it again, and a re-run of batch 0 starts again from the
        empty state, so the committed state holds its effect once). When Spark ran no task
        of the operator in batch 0 (its input was empty there), the operator's first task
        that runs applies it, as batch 0, before its own batch. It is called for every
        key of the initial rows, in key order, before any ``handle_input_rows`` of that
        batch, whether or not the key has input. It emits no rows (return ``None``); state
        and timers of ``key`` may be used as in ``handle_input_rows``.

        One difference from Spark: Spark's Row form calls ``handleInitialState`` once per
        initial row; here it is called once per key with all of the key's initial rows, in
        the same two forms as :meth:`handle_input_rows` (loop over ``rows`` to do what Spark
        does per row). The default does nothing.

        Args:
            key: the key column values, in the order of ``keys``.
            rows: the key's initial rows in their order: a pandas DataFrame, or
                (``rows = "row"``) a list of rows with named access.
            timer_values: the first micro-batch's processing time and watermark.
        """

    def close(self) -> None:  # noqa: B027 - optional hook, empty on purpose
        """Called after the last key of a partition that succeeded."""


def input_form(processor: StatefulProcessor) -> str:
    """The form ``processor`` takes its rows in: ``"pandas"`` or ``"row"``.

    Raises:
        ValueError: the processor's ``rows`` attribute is neither.
    """
    form = getattr(processor, "rows", "pandas")
    if form not in ROW_FORMS:
        raise ValueError(f"{type(processor).__name__}.rows must be 'pandas' or 'row', got {form!r}")
    return str(form)


def handles_initial_state(processor: StatefulProcessor) -> bool:
    """Whether ``processor``'s class overrides :meth:`StatefulProcessor.handle_initial_state`."""
    return type(processor).handle_initial_state is not StatefulProcessor.handle_initial_state


class _NotADeclaration(Exception):
    """``init`` asked the driver's handle for something else than declaring a state."""


class _BadDeclaration(Exception):
    """``init`` declared a state with a malformed argument, or one name as two kinds of
    state (the handle's error inside)."""

    def __init__(self, error: TypeError | ValueError | StateKeeperError) -> None:
        super().__init__(str(error))
        self.error = error


class _Opaque:
    """What the driver's handle returns for a declared state: any use of it ends the run."""

    def __getattr__(self, name: str) -> Any:
        raise _NotADeclaration(name)


class _Declarations:
    """A stand-in for :class:`StatefulProcessorHandle` on the driver: it checks each state
    ``init`` declares as the handle does (all but the schemas the store records, which tasks
    check) and keeps its TTL; anything else (the batch, timers, a state's values) ends the
    run."""

    def __init__(self, time_mode: str | None) -> None:
        self.mode = time_mode
        self.ttls: dict[str, int | None] = {}
        self.kinds: dict[str, str] = {}

    def _declare(
        self,
        kind: str,
        name: str,
        *,
        ttl: Any = None,
        codec: Any = None,
        ttl_on: str = "processing_time",
        schema: Any = None,
        version: int | None = None,
        migrate: Any = None,
    ) -> Any:
        try:
            earlier = self.kinds.get(name) if isinstance(name, str) else None
            checked, ttl_ms = check_declaration(
                name, ttl=ttl, codec=codec, ttl_on=ttl_on, time_mode=self.mode, kind=kind,
                earlier=earlier,
            )  # fmt: skip
            declare_schema(name, checked, schema, version=version, migrate=migrate, stored=None)
        except (TypeError, ValueError, StateKeeperError) as exc:
            raise _BadDeclaration(exc) from exc
        self.kinds[name] = kind
        self.ttls[name] = ttl_ms
        return _Opaque()

    def value_state(self, name: str, **args: Any) -> Any:
        return self._declare("value", name, **args)

    def map_state(self, name: str, **args: Any) -> Any:
        return self._declare("map", name, **args)

    def list_state(self, name: str, **args: Any) -> Any:
        return self._declare("list", name, **args)

    def __getattr__(self, name: str) -> Any:
        raise _NotADeclaration(name)


def declared_ttls(
    processor: StatefulProcessor, time_mode: str | None
) -> dict[str, int | None] | None:
    """The TTL (ms; ``None``: no expiry) of each state ``processor.init`` declares, learnt
    on the driver: ``init`` then ``close`` run on a copy of the processor with a handle that
    only takes declarations, as Spark's ``transformWithState`` runs them on the driver to
    learn its state schemas. ``None`` if that cannot tell: ``init`` asked the handle for
    anything else, or the copy, ``init`` or ``close`` failed.

    Raises:
        TypeError, ValueError: ``init`` declares a state with a malformed argument (the
            error the handle raises in a task), so a query fails before it starts.
        StateKeeperError: ``init`` declares one name as two kinds of state (likewise).
    """
    probe = _Declarations(time_mode)
    try:
        clone = copy.deepcopy(processor)
        clone.init(cast(StatefulProcessorHandle, probe))
        clone.close()
    except _BadDeclaration as bad:
        raise bad.error from None
    except Exception as exc:  # noqa: BLE001 - user code: any failure only means "unknown"
        _log.debug("%s.init could not run on the driver: %r", type(processor).__name__, exc)
        return None
    return probe.ttls
