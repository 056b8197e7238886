"""Processors and functions run inside Spark by the tests (pickled by value, see conftest)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pandas as pd
import pyarrow as pa
from pyspark import TaskContext

from statekeeper.spark import (
    PartitionStore,
    StatefulProcessor,
    StatefulProcessorHandle,
)


class RunningCountSum(StatefulProcessor):
    """Running count and sum of ``v`` per key ``k``; emits the new totals of each key."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.count = handle.value_state("count")
        self.total = handle.value_state("sum")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        n = (self.count.get() or 0) + len(rows)
        s = (self.total.get() or 0) + int(rows["v"].sum())
        self.count.update(n)
        self.total.update(s)
        yield pd.DataFrame({"k": [key[0]], "count": [n], "sum": [s]})


class FailOnce(RunningCountSum):
    """Like RunningCountSum, but the first attempt of batch ``fail_batch`` raises after it
    has already updated the state of ``fail_after`` keys of its partition."""

    def __init__(self, marker_dir: str, fail_batch: int, fail_after: int = 1) -> None:
        self.marker_dir = marker_dir
        self.fail_batch = fail_batch
        self.fail_after = fail_after
        self.seen = 0

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        yield from super().handle_input_rows(key, rows)
        self.seen += 1
        tc = TaskContext.get()
        assert tc is not None
        if (
            self.handle.batch_id == self.fail_batch
            and tc.attemptNumber() == 0
            and self.seen > self.fail_after
        ):
            marker = os.path.join(self.marker_dir, f"failed-{tc.partitionId()}")
            with open(marker, "w") as fh:
                fh.write(str(key))
            raise RuntimeError(f"injected failure at key {key}")


class WrongOutputType(StatefulProcessor):
    """Emits ``count`` as a string although the schema declares a long."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.value_state("count")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        self.count.update(len(rows))
        yield pd.DataFrame({"k": [key[0]], "count": [str(len(rows))]})


def arrow_count_sum(store: PartitionStore, batches: Iterator[Any]) -> Iterator[Any]:
    """Vectorized running count and sum per ``k``: one multi_get per batch, one put_many.

    Keys come from ``store.state_keys`` (prefixed with the row's key group when the operator
    has key groups, as every key put must be)."""
    totals: dict[bytes, tuple[str, int, int]] = {}
    for batch in batches:
        keys = store.state_keys(batch, ["k"])
        new = [key for key in dict.fromkeys(keys) if key not in totals]
        for key, old in zip(new, store.multi_get(new), strict=True):
            n, s = (0, 0) if old is None else map(int, old.split(b","))
            totals[key] = ("", n, s)
        names, values = batch.column("k").to_pylist(), batch.column("v").to_pylist()
        for key, k, v in zip(keys, names, values, strict=True):
            _, n, s = totals[key]
            totals[key] = (k, n + 1, s + v)
    store.put_many((key, f"{n},{s}".encode()) for key, (_, n, s) in totals.items())
    if totals:
        rows = list(totals.values())
        yield pa.RecordBatch.from_pydict(
            {
                "k": [r[0] for r in rows],
                "count": pa.array([r[1] for r in rows], pa.int64()),
                "sum": pa.array([r[2] for r in rows], pa.int64()),
            }
        )


class TtlHistory(StatefulProcessor):
    """Keeps every value of a key in a list with a TTL, and the count in a value with one;
    the expiry times come from the micro-batch timestamp."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.count = handle.value_state("count", ttl=3600)
        self.values = handle.list_state("values", ttl=3600)
        self.last = handle.map_state("last", ttl=3600)

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        values = [int(v) for v in rows["v"]]
        self.values.extend(values)
        self.last.put("batch", self.handle.batch_id)
        n = (self.count.get() or 0) + len(values)
        self.count.update(n)
        yield pd.DataFrame({"k": [key[0]], "count": [n], "sum": [sum(self.values.get())]})


class TypedEcho(StatefulProcessor):
    """Keyed by (an int, a date); emits one row per key with many column types."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.seen = handle.value_state("seen")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        n = (self.seen.get() or 0) + len(rows)
        self.seen.update(n)
        yield pd.DataFrame(
            {
                "id": [key[0]],
                "day": [key[1]],
                "n": [n],
                "ratio": [n / 2],
                "flag": [n % 2 == 0],
                "at": [pd.Timestamp("2024-01-02 03:04:05")],
                "amount": [Decimal("1.25") * n],
                "raw": [b"\x00\x01"],
                "note": [None],
            }
        )


class RowCountSum(StatefulProcessor):
    """RunningCountSum in the Row form: rows are tuples with named access; yields tuples."""

    rows = "row"

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.value_state("count")
        self.total = handle.value_state("sum")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        n = (self.count.get() or 0) + len(rows)
        s = (self.total.get() or 0) + sum(row.v for row in rows)
        self.count.update(n)
        self.total.update(s)
        yield (key[0], n, s)


class AppendScaled(StatefulProcessor):
    """Order-sensitive: appends ``v * scale`` of every row to a list state in arrival order
    and keeps the last one in a value state; emits the list's count and sum."""

    def __init__(self, scale: int) -> None:
        self.scale = scale

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.values = handle.list_state("values")
        self.last = handle.value_state("last")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        scaled = [int(v) * self.scale for v in rows["v"]]
        self.values.extend(scaled)
        self.last.update(scaled[-1])
        every = self.values.get()
        yield pd.DataFrame({"k": [key[0]], "count": [len(every)], "sum": [sum(every)]})


class EventSessions(StatefulProcessor):
    """Counts a key's rows (Row form); one event-time timer 10 s after the key's latest
    row closes the session: it emits the count and clears it."""

    rows = "row"

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.count = handle.value_state("count")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        n = (self.count.get() or 0) + len(rows)
        self.count.update(n)
        for old in self.handle.list_timers():
            self.handle.delete_timer(old)
        latest = max(int(r.ts.timestamp() * 1000) for r in rows)
        self.handle.register_timer(latest + 10_000)
        yield (key[0], n, "open", self.handle.batch_id)

    def handle_expired_timer(self, key: Any, timer_values: Any, info: Any) -> Iterator[Any]:
        yield (key[0], self.count.get(), "closed", self.handle.batch_id)
        self.count.clear()
