"""Keyed state without Spark: processors, state handles, codecs, key tuples, decoded state.

What a per-key stateful processor is made of, independent of the engine that runs it::

    from statekeeper.keyed import StatefulProcessor

    class RunningCount(StatefulProcessor):
        def init(self, handle):
            self.count = handle.value_state("count")

        def handle_input_rows(self, key, rows):
            ...

The handles read and write a :class:`~statekeeper.StateStore` directly; the layout of
processor state inside a store (operator record, value/map/list entries, TTL index) and the
value codecs are defined here, so tools read a processor's state without pyspark:
:func:`iter_state` yields it decoded, :func:`iter_timers` the registered timers.
:mod:`statekeeper.keyed.testing` runs a processor without Spark (needs pyarrow, pandas).
:mod:`statekeeper.spark` runs processors on streaming DataFrames and re-exports the
processor-facing names.
"""

from __future__ import annotations

from statekeeper.keyed._change_decoder import TIMER_STATE, ChangeDecoder, StateChange
from statekeeper.keyed._entries import (
    DataKey,
    StateDecoder,
    StateEntry,
    Undecoded,
    iter_state,
    jsonable,
    read_operator_record,
)
from statekeeper.keyed._handles import ListState, MapState, StatefulProcessorHandle, ValueState
from statekeeper.keyed._layout import (
    EVENT_TIME,
    GROUPED_TIMER_INDEX,
    GROUPED_TTL_INDEX,
    INDEX_FLOOR,
    KEY_GROUP,
    MAX_KEY_GROUPS,
    META_KEY,
    U64,
    OperatorRecord,
    StateDecl,
    group_prefix,
    key_group_range,
    partition_of_group,
    ttl_prefix,
)
from statekeeper.keyed._processor import (
    StatefulProcessor,
    declared_ttls,
    handles_initial_state,
    input_form,
)
from statekeeper.keyed._row_type import build_rows, row_class
from statekeeper.keyed._schema import stored_schema_version
from statekeeper.keyed._timers import (
    TIME_MODES,
    ExpiredTimerInfo,
    TimerEntry,
    TimerValues,
    iter_timers,
    validate_delay,
    validate_time_mode,
)
from statekeeper.keyed._tuples import decode_key, encode_element, encode_key
from statekeeper.keyed._values import Codec, DefaultCodec, PickleCodec

__all__ = [
    "EVENT_TIME",
    "GROUPED_TIMER_INDEX",
    "GROUPED_TTL_INDEX",
    "INDEX_FLOOR",
    "KEY_GROUP",
    "MAX_KEY_GROUPS",
    "META_KEY",
    "TIMER_STATE",
    "TIME_MODES",
    "U64",
    "ChangeDecoder",
    "Codec",
    "DataKey",
    "DefaultCodec",
    "ExpiredTimerInfo",
    "ListState",
    "MapState",
    "OperatorRecord",
    "PickleCodec",
    "StateChange",
    "StateDecl",
    "StateDecoder",
    "StateEntry",
    "StatefulProcessor",
    "StatefulProcessorHandle",
    "TimerEntry",
    "TimerValues",
    "Undecoded",
    "ValueState",
    "build_rows",
    "declared_ttls",
    "decode_key",
    "encode_element",
    "encode_key",
    "group_prefix",
    "handles_initial_state",
    "input_form",
    "iter_state",
    "iter_timers",
    "jsonable",
    "key_group_range",
    "partition_of_group",
    "read_operator_record",
    "row_class",
    "stored_schema_version",
    "ttl_prefix",
    "validate_delay",
    "validate_time_mode",
]
