"""Differential test of state TTL: the same processor on Spark's own Row-based
``transformWithState`` and on statekeeper's ``transform_with_state``, over the same files, one
file per micro-batch, compared batch by batch (see :mod:`tests.spark.differential`).

Spark measures TTL in processing time only: an entry written in micro-batch ``b`` expires at
``b``'s timestamp plus the TTL, and is invisible from the first batch whose timestamp reaches
that. Batch timestamps come from the wall clock (public APIs cannot fix them), so the test uses
only TTLs whose outcome does not depend on them: **1 ms** (alive for the rest of the batch that
wrote it, expired in every later batch: batches are further apart than that) and **one hour**
(never expires during the test). It covers each kind of state with a TTL: value, list (the TTL
is per element, from its own append) and map (per entry); reads before and after the batch's
writes, ``exists``, ``clear``, a list ``put`` over older elements, a map ``remove``, keys
that come back after their entries expired.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql.streaming.stateful_processor import StatefulProcessor as SparkProcessor

from statekeeper import StoreConfig
from statekeeper.spark import StatefulProcessor, transform_with_state
from tests.spark import differential
from tests.spark.differential import assert_agree, run, spark_tws, stream, write_batches
from tests.spark.helpers import pickled_by_value

pytestmark = pytest.mark.spark

OUT = "k string, before string, after string"
HOUR_MS = 3_600_000
SHORT_MS = 1
RESET = 100
"""An input value that clears the key's count, replaces its history and removes ``t1``."""

# (key, value): a value >= 0 is appended and counted; RESET resets (see above)
BATCHES = [
    [("a", 1), ("a", 2), ("b", 3)],
    [("a", 4), ("c", 5)],
    [("b", 6), ("a", RESET), ("a", 1)],
    [("a", 7), ("b", 8), ("c", 9)],
]


@pytest.fixture(scope="module", autouse=True)
def _pickled_by_value() -> Iterator[None]:
    """Spark's workers cannot import the test modules: the processors travel by value."""
    with pickled_by_value(sys.modules[__name__]), pickled_by_value(differential):
        yield


def _view(
    count: Any, last: Any, last_exists: bool, recent: list[int], recent_exists: bool,
    history: list[int], seen: dict[str, int], seen_exists: bool, has_t1: bool,
) -> str:  # fmt: skip
    """What a key's states hold, as one comparable string."""
    return json.dumps(
        {"count": count, "last": [last, last_exists], "recent": [recent, recent_exists],
         "history": history, "seen": [sorted(seen.items()), seen_exists, has_t1]}
    )  # fmt: skip


class SparkTtl(SparkProcessor):
    """Spark's Row-based API: TTLs in milliseconds per state."""

    def init(self, handle: Any) -> None:
        self.count = handle.getValueState("count", "n long", HOUR_MS)
        self.last = handle.getValueState("last", "t long", SHORT_MS)
        self.recent = handle.getListState("recent", "t long", SHORT_MS)
        self.history = handle.getListState("history", "t long", HOUR_MS)
        self.seen = handle.getMapState("seen", "name string", "t long", SHORT_MS)

    def _look(self) -> str:
        count, last = self.count.get(), self.last.get()
        return _view(
            None if count is None else count[0],
            None if last is None else last[0],
            self.last.exists(),
            [r[0] for r in self.recent.get()],
            self.recent.exists(),
            [r[0] for r in self.history.get()],
            {k[0]: v[0] for k, v in self.seen.iterator()},
            self.seen.exists(),
            self.seen.containsKey(("t1",)),
        )

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        values = [r.t for r in rows]
        before = self._look()
        kept = [v for v in values if v != RESET]
        if RESET in values:
            self.count.clear()
            self.history.put([(RESET,)])
            self.seen.removeKey(("t1",))
        old = self.count.get()
        self.count.update(((0 if old is None else old[0]) + len(kept),))
        self.last.update((max(values),))
        for v in kept:
            self.recent.appendValue((v,))
            self.history.appendValue((v,))
            self.seen.updateValue((f"t{v}",), (v,))
        yield Row(k=key[0], before=before, after=self._look())

    def close(self) -> None:
        pass


class SkTtl(StatefulProcessor):
    """The same on statekeeper's Row form: TTLs in seconds."""

    rows = "row"

    def init(self, handle: Any) -> None:
        self.count = handle.value_state("count", ttl=HOUR_MS / 1000)
        self.last = handle.value_state("last", ttl=SHORT_MS / 1000)
        self.recent = handle.list_state("recent", ttl=SHORT_MS / 1000)
        self.history = handle.list_state("history", ttl=HOUR_MS / 1000)
        self.seen = handle.map_state("seen", ttl=SHORT_MS / 1000)

    def _look(self) -> str:
        return _view(
            self.count.get(), self.last.get(), self.last.exists(), self.recent.get(),
            self.recent.exists(), self.history.get(), dict(self.seen.items()),
            self.seen.exists(), self.seen.contains("t1"),
        )  # fmt: skip

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        values = [r.t for r in rows]
        before = self._look()
        kept = [v for v in values if v != RESET]
        if RESET in values:
            self.count.clear()
            self.history.put([RESET])
            self.seen.remove("t1")
        self.count.update((self.count.get() or 0) + len(kept))
        self.last.update(max(values))
        for v in kept:
            self.recent.append(v)
            self.history.append(v)
            self.seen.put(f"t{v}", v)
        yield (key[0], before, self._look())


def test_ttl_agrees_with_spark_batch_by_batch(spark: SparkSession, tmp_path: Path) -> None:
    write_batches(tmp_path / "in", BATCHES)

    def spark_plan() -> DataFrame:
        return (
            stream(spark, tmp_path / "in")
            .groupBy("k")
            .transformWithState(SparkTtl(), OUT, "Append", "ProcessingTime")
        )

    # No timers: without no-data batches, the batches are the files on both.
    theirs = spark_tws(spark, tmp_path, "spark", spark_plan, no_data=False)
    ours_df = transform_with_state(
        stream(spark, tmp_path / "in"), keys="k", processor=SkTtl(), output_schema=OUT,
        checkpoint=str(tmp_path / "root"), name="ops", partitions=3,
        time_mode="processing_time", config=StoreConfig(local_dir=str(tmp_path / "local")),
    )  # fmt: skip
    ours = run(ours_df, tmp_path, "sk")

    assert_agree(theirs, ours, len(BATCHES))
    # The edge cases happened as the comments say (on Spark, so the test keeps its point).
    empty = _view(None, None, False, [], False, [], {}, False, False)
    a0_after = _view(2, 2, True, [1, 2], True, [1, 2], {"t1": 1, "t2": 2}, True, True)
    a1_before = _view(2, None, False, [], False, [1, 2], {}, False, False)
    a1_after = _view(3, 4, True, [4], True, [1, 2, 4], {"t4": 4}, True, False)
    a2_after = _view(1, RESET, True, [1], True, [RESET, 1], {"t1": 1}, True, True)
    assert theirs[0][("a", empty, a0_after)] == 1
    assert theirs[1][("a", a1_before, a1_after)] == 1
    a2_before = _view(3, None, False, [], False, [1, 2, 4], {}, False, False)
    assert theirs[2][("a", a2_before, a2_after)] == 1
    assert theirs[3] == Counter(
        {
            ("a", _view(1, None, False, [], False, [RESET, 1], {}, False, False),
             _view(2, 7, True, [7], True, [RESET, 1, 7], {"t7": 7}, True, False)): 1,
            ("b", _view(2, None, False, [], False, [3, 6], {}, False, False),
             _view(3, 8, True, [8], True, [3, 6, 8], {"t8": 8}, True, False)): 1,
            ("c", _view(1, None, False, [], False, [5], {}, False, False),
             _view(2, 9, True, [9], True, [5, 9], {"t9": 9}, True, False)): 1,
        }
    )  # fmt: skip
