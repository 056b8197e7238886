"""statekeeper for PySpark: stateful processors on streaming DataFrames.

Modelled on Spark 4's ``transformWithStateInPandas``, with state kept in the Python worker
(a local RocksDB working copy per partition) and made durable in a checkpoint root::

    from statekeeper.spark import StatefulProcessor, transform_with_state, read_state

    class RunningCount(StatefulProcessor):
        def init(self, handle):
            self.count = handle.value_state("count")

        def handle_input_rows(self, key, rows):
            n = (self.count.get() or 0) + len(rows)
            self.count.update(n)
            yield pd.DataFrame({"user": [key[0]], "count": [n]})

    out = transform_with_state(df, keys=["user"], processor=RunningCount(),
                               output_schema="user string, count long",
                               checkpoint="s3://bucket/app/state", name="running_count",
                               partitions=8)

Micro-batch ``b`` loads state version ``b`` and commits ``b + 1``; re-running a batch is
idempotent. Every task writes a small report into the root; :func:`batch_metrics` turns a
micro-batch's reports into metrics (also on Spark Connect). On classic sessions
:func:`state_listener` also logs them (logger ``statekeeper.spark``), keeps them and writes
epoch manifests to ``_epochs/`` in the root; a Spark Connect client opts in to it by calling
it before building its queries.

The processor-facing names (processor, handles, codecs, key tuples) live in
:mod:`statekeeper.keyed`, which needs no pyspark, and are re-exported here.
"""

from __future__ import annotations

from statekeeper.epochs import (
    EpochManifest,
    StoreEntry,
    latest_epoch,
    latest_manifest,
    read_manifest,
)
from statekeeper.keyed import (
    Codec,
    DefaultCodec,
    ListState,
    MapState,
    PickleCodec,
    StatefulProcessor,
    StatefulProcessorHandle,
    ValueState,
    decode_key,
    encode_key,
)
from statekeeper.keyed.arrow_keys import encode_keys
from statekeeper.keyed.output import OutputSchemaError
from statekeeper.reports import TaskReport
from statekeeper.spark._change_feed import read_state_changes
from statekeeper.spark._filelock import StoreBusyError
from statekeeper.spark._listener import StateListener, remove_state_listener, state_listener
from statekeeper.spark._metrics import BatchMetrics, batch_metrics
from statekeeper.spark._partition import KEY_GROUP_COLUMN
from statekeeper.spark._read import read_state
from statekeeper.spark._runner import PartitionStore
from statekeeper.spark._transform import transform_with_state, transform_with_state_arrow

__all__ = [  # noqa: RUF022 - plain sorted(), as tests/spark/test_api.py holds it
    "BatchMetrics",
    "Codec",
    "DefaultCodec",
    "EpochManifest",
    "KEY_GROUP_COLUMN",
    "ListState",
    "MapState",
    "OutputSchemaError",
    "PartitionStore",
    "PickleCodec",
    "StateListener",
    "StatefulProcessor",
    "StatefulProcessorHandle",
    "StoreBusyError",
    "StoreEntry",
    "TaskReport",
    "ValueState",
    "batch_metrics",
    "decode_key",
    "encode_key",
    "encode_keys",
    "latest_epoch",
    "latest_manifest",
    "read_manifest",
    "read_state",
    "read_state_changes",
    "remove_state_listener",
    "state_listener",
    "transform_with_state",
    "transform_with_state_arrow",
]
