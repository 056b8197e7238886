"""Differential test of state operations: seeded random sequences of value, list and map
operations, run by the same processor on Spark's own Row-based ``transformWithState`` and on
statekeeper's ``transform_with_state``, over the same files, compared batch by batch (see
:mod:`tests.spark.differential`).

Each input row is one operation on its key's states: ``t = sequence * 100 + op``. A key's
rows are applied in order of ``t`` (the order in which they were generated), so the outcome
does not depend on the order in which either engine hands rows over. After every operation
the processor yields what the key's states hold, as one comparable string: every
intermediate state is compared, not only the last. What is left out on purpose: a list
``put`` or ``append_list`` of no elements and ``update(None)``, which Spark refuses and
statekeeper accepts (more permissive; code written for Spark never does them), and the
iteration order of a map (Spark's is the order of its encoded keys, not documented; the
view sorts it).
"""

from __future__ import annotations

import json
import random
import sys
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

OUT = "k string, seq long, op long, view string"
KEYS = "abcdef"
MAP_KEYS = 4
"""Map entries are ``m0 .. m3``: puts overwrite and removes hit entries that exist."""
OPS = 11
SEED = 20261128


def _batches(seed: int, batches: int, rows: int) -> list[list[tuple[str, int]]]:
    """``batches`` files of ``rows`` operations on random keys; ``t`` is unique and grows."""
    rng = random.Random(seed)
    seq = 0
    out = []
    for _ in range(batches):
        batch = []
        for _ in range(rows):
            seq += 1
            batch.append((rng.choice(KEYS), seq * 100 + rng.randrange(OPS)))
        out.append(batch)
    return out


BATCHES = _batches(SEED, 5, 40)


@pytest.fixture(scope="module", autouse=True)
def _pickled_by_value() -> Iterator[None]:
    """Spark's workers cannot import the test modules: the processors travel by value."""
    with pickled_by_value(sys.modules[__name__]), pickled_by_value(differential):
        yield


def _view(
    value: Any, value_exists: bool, items: list[int], list_exists: bool,
    entries: dict[str, int], map_exists: bool, has_m0: bool, m1: Any,
) -> str:  # fmt: skip
    """What a key's states hold, as one comparable string."""
    return json.dumps(
        {"value": [value, value_exists], "list": [items, list_exists],
         "map": [sorted(entries.items()), map_exists, has_m0, m1]}
    )  # fmt: skip


class SparkOps(SparkProcessor):
    """Spark's Row-based API: states of one-field rows."""

    def init(self, handle: Any) -> None:
        self.value = handle.getValueState("value", "n long")
        self.items = handle.getListState("items", "n long")
        self.entries = handle.getMapState("entries", "name string", "n long")

    def _look(self) -> str:
        value, m1 = self.value.get(), self.entries.getValue(("m1",))
        return _view(
            None if value is None else value[0],
            self.value.exists(),
            [r[0] for r in self.items.get()],
            self.items.exists(),
            {k[0]: v[0] for k, v in self.entries.iterator()},
            self.entries.exists(),
            self.entries.containsKey(("m0",)),
            None if m1 is None else m1[0],
        )

    def _apply(self, seq: int, op: int) -> None:
        entry = (f"m{seq % MAP_KEYS}",)
        if op == 0:
            self.value.update((seq,))
        elif op == 1:
            self.value.clear()
        elif op == 2:
            old = self.value.get()
            self.value.update(((0 if old is None else old[0]) + 1,))
        elif op == 3:
            self.items.appendValue((seq,))
        elif op == 4:
            self.items.appendList([(seq,), (-seq,)])
        elif op == 5:
            self.items.put([(seq,), (seq + 1,)])
        elif op == 6:
            self.items.clear()
        elif op == 7:
            self.entries.updateValue(entry, (seq,))
        elif op == 8:
            self.entries.removeKey(entry)
        elif op == 9:
            self.entries.clear()
        else:
            old = self.entries.getValue(entry)
            self.entries.updateValue(entry, ((0 if old is None else old[0]) + seq,))

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        yield Row(k=key[0], seq=0, op=-1, view=self._look())
        for t in sorted(r.t for r in rows):
            seq, op = divmod(t, 100)
            self._apply(seq, op)
            yield Row(k=key[0], seq=seq, op=op, view=self._look())

    def close(self) -> None:
        pass


class SkOps(StatefulProcessor):
    """The same on statekeeper's Row form."""

    rows = "row"

    def init(self, handle: Any) -> None:
        self.value = handle.value_state("value")
        self.items = handle.list_state("items")
        self.entries = handle.map_state("entries")

    def _look(self) -> str:
        return _view(
            self.value.get(), self.value.exists(), self.items.get(), self.items.exists(),
            dict(self.entries.items()), self.entries.exists(), self.entries.contains("m0"),
            self.entries.get("m1"),
        )  # fmt: skip

    def _apply(self, seq: int, op: int) -> None:
        entry = f"m{seq % MAP_KEYS}"
        if op == 0:
            self.value.update(seq)
        elif op == 1:
            self.value.clear()
        elif op == 2:
            self.value.update((self.value.get() or 0) + 1)
        elif op == 3:
            self.items.append(seq)
        elif op == 4:
            self.items.extend([seq, -seq])
        elif op == 5:
            self.items.put([seq, seq + 1])
        elif op == 6:
            self.items.clear()
        elif op == 7:
            self.entries.put(entry, seq)
        elif op == 8:
            self.entries.remove(entry)
        elif op == 9:
            self.entries.clear()
        else:
            self.entries.put(entry, self.entries.get(entry, 0) + seq)

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        yield (key[0], 0, -1, self._look())
        for t in sorted(r.t for r in rows):
            seq, op = divmod(t, 100)
            self._apply(seq, op)
            yield (key[0], seq, op, self._look())


def test_random_state_operations_agree_with_spark(spark: SparkSession, tmp_path: Path) -> None:
    write_batches(tmp_path / "in", BATCHES)

    def spark_plan() -> DataFrame:
        return (
            stream(spark, tmp_path / "in")
            .groupBy("k")
            .transformWithState(SparkOps(), OUT, "Append", "None")
        )

    theirs = spark_tws(spark, tmp_path, "spark", spark_plan, no_data=False)
    ours_df = transform_with_state(
        stream(spark, tmp_path / "in"), keys="k", processor=SkOps(), output_schema=OUT,
        checkpoint=str(tmp_path / "root"), name="ops", partitions=3,
        config=StoreConfig(local_dir=str(tmp_path / "local")),
    )  # fmt: skip
    ours = run(ours_df, tmp_path, "sk")

    assert_agree(theirs, ours, len(BATCHES))
    # Every operation ran, on Spark too, and states were seen both empty and full, so the
    # comparison covers what it says.
    ran = {op for batch in theirs.values() for (_, _, op, _) in batch}
    assert ran == set(range(-1, OPS))
    views = [(op, json.loads(v)) for batch in theirs.values() for (_, _, op, v) in batch]
    assert max(len(v["map"][0]) for _, v in views) >= MAP_KEYS - 1
    assert max(len(v["list"][0]) for _, v in views) >= 4
    # A remove emptied a map, a clear emptied a list and a value.
    assert any(op == 8 and not v["map"][1] for op, v in views)
    assert any(op == 6 and not v["list"][1] for op, v in views)
    assert any(op == 1 and v["value"] == [None, False] for op, v in views)
