"""One partition's run without Spark: grouping, the operator record, output checks, re-runs."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest

from statekeeper import ConfigMismatchError, StateBackend, StateKeeperError, StoreConfig
from statekeeper.keyed._layout import META_KEY, OperatorRecord
from statekeeper.spark import (
    OutputSchemaError,
    PartitionStore,
    StatefulProcessor,
    StatefulProcessorHandle,
    encode_key,
    encode_keys,
)
from statekeeper.spark._partition import KEY_GROUP_COLUMN
from statekeeper.spark._runner import iter_groups, run_processor

SCHEMA = pa.schema([("k", pa.string()), ("count", pa.int64())])


class Counter(StatefulProcessor):
    """Counts rows per key in a value state with a TTL; emits the new count."""

    def __init__(self, kind: str = "value") -> None:
        self.kind = kind
        self.calls = 0

    def init(self, handle: StatefulProcessorHandle) -> None:
        declare = getattr(handle, f"{self.kind}_state")
        self.count = declare("count", ttl=60)

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        self.calls += 1
        n = (self.count.get() or 0) + len(rows)
        self.count.update(n)
        yield pd.DataFrame({"k": [key[0]], "count": [n]})


def _run(store: Any, processor: StatefulProcessor, table: Any, **kw: Any) -> list[Any]:
    args = {"keys": ["k"], "output_schema": SCHEMA, "operator": "op", "batch_id": store.version,
            "partition": 0, "now_ms": 1_000} | kw  # fmt: skip
    return list(run_processor(store, processor, table, **args))


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[StateBackend]:
    config = StoreConfig(local_dir=str(tmp_path / "local"))
    with StateBackend(str(tmp_path / "root"), config=config) as backend:
        yield backend


def test_groups_hold_all_rows_of_a_key_in_arrival_order() -> None:
    table = pa.table(
        {
            "a": ["x", None, "x", "y", None, "x"],
            "b": [1.0, 2.0, math.nan, 1.0, 2.0, math.nan],
            "i": [0, 1, 2, 3, 4, 5],
        }
    )
    groups = [
        (
            tuple("NaN" if isinstance(v, float) and math.isnan(v) else v for v in key),
            rows["i"].tolist(),
        )
        for key, rows in iter_groups(table, ["a", "b"])
    ]
    # Sorted by key, nulls last; the two NaN rows of "x" form one key, as in Spark.
    assert groups == [
        (("x", 1.0), [0]),
        (("x", "NaN"), [2, 5]),
        (("y", 1.0), [3]),
        ((None, 2.0), [1, 4]),
    ]
    assert list(iter_groups(pa.table({"a": pa.array([], pa.string())}), ["a"])) == []


def test_a_run_emits_checked_output_and_records_the_operator(backend: StateBackend) -> None:
    table = pa.table({"k": ["a", "b", "a"], "v": [1, 2, 3]})
    with backend.open("op", 0) as store:
        batches = _run(store, Counter(), table, key_schema='{"fields":[]}')
        assert pa.Table.from_batches(batches).to_pylist() == [
            {"k": "a", "count": 2},
            {"k": "b", "count": 1},
        ]
        record = OperatorRecord.from_bytes(store.get(META_KEY) or b"")
        assert record.keys == ("k",)
        assert record.states["count"].kind == "value"
        assert record.states["count"].ttl_ms == 60_000
        first = store.commit()
    # A re-run of the batch (same input, same batch timestamp) recommits identical state.
    with backend.open("op", 0, version=0) as store:
        _run(store, Counter(), table, key_schema='{"fields":[]}')
        again = store.commit()
    assert (again.version, again.puts) == (first.version, first.puts)


def test_a_state_changing_kind_or_other_keys_are_refused_before_any_row(
    backend: StateBackend,
) -> None:
    table = pa.table({"k": ["a"], "v": [1]})
    with backend.open("op", 0) as store:
        _run(store, Counter(), table)
        store.commit()
        processor = Counter(kind="map")
        with pytest.raises(
            ConfigMismatchError, match=r"holds a value state .* now declares it a map"
        ):
            _run(store, processor, table)
        with pytest.raises(
            ConfigMismatchError, match=r"keyed by \['k'\] in this checkpoint root, but keys=\['v'\]"
        ):
            _run(store, Counter(), table, keys=["v"])
        assert processor.calls == 0


def test_output_errors_name_the_column(backend: StateBackend) -> None:
    class Wrong(Counter):
        def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
            yield pd.DataFrame({"k": [key[0]], "count": [1.5]})

    with (
        backend.open("op", 0) as store,
        pytest.raises(
            OutputSchemaError,
            match="operator 'op' partition 0 micro-batch 0: column 'count' has type double",
        ),
    ):
        _run(store, Wrong(), pa.table({"k": ["a"]}))


def test_a_grouped_run_prefixes_state_keys_and_hides_the_key_group_column(
    backend: StateBackend,
) -> None:
    """The processor never sees the key-group column; every state key starts with it."""
    seen: list[list[str]] = []

    class Columns(Counter):
        def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
            seen.append(list(rows.columns))
            yield from super().handle_input_rows(key, rows)

    table = pa.table({"k": ["a", "b", "a"], "v": [1, 2, 3], KEY_GROUP_COLUMN: [5, 9, 5]})
    with backend.open("op", 0) as store:
        out = _run(store, Columns(), table, key_groups=4096)
        assert pa.Table.from_batches(out).to_pylist() == [
            {"k": "a", "count": 2},
            {"k": "b", "count": 1},
        ]
        keys = [k for k, _ in store.scan() if k != META_KEY]
    assert seen == [["k", "v"], ["k", "v"]]
    data = [k for k in keys if k[:1] != b"\xff"]
    assert sorted(k[:2] for k in data) == [b"\x00\x05", b"\x00\x09"]


def test_the_vectorized_store_refuses_keys_outside_its_key_groups(
    backend: StateBackend,
) -> None:
    """Partition 1 of 2 owns key groups 2048..4095: its keys must start with one of them."""
    batch = pa.record_batch({"k": ["a", "b"], KEY_GROUP_COLUMN: pa.array([2048, 4095])})
    with backend.open("op", 1) as store:
        view = PartitionStore(store, batch_id=0, partition=1, key_groups=4096, partitions=2)
        keys = view.state_keys(batch, ["k"])
        assert keys == encode_keys([batch.column("k")], [2048, 4095])
        view.put_many((k, b"1") for k in keys)
        with pytest.raises(StateKeeperError, match="owns key groups 2048 to 4095"):
            view.put(encode_key(("a",)), b"1")  # no key group
        with pytest.raises(StateKeeperError, match="owns key groups 2048 to 4095"):
            view.put(b"\x00\x01" + encode_key(("a",)), b"1")  # partition 0's
        legacy = PartitionStore(store, batch_id=0, partition=1)
        assert legacy.state_keys(batch, ["k"]) == encode_keys([batch.column("k")])
        legacy.put(encode_key(("c",)), b"1")  # a 0.1 operator's keys are free


def test_put_many_refuses_a_foreign_key_among_many_and_puts_none(
    backend: StateBackend,
) -> None:
    """``put_many`` checks the smallest and largest key for all: one key of another
    partition's key group, anywhere in the batch, refuses the whole batch."""
    with backend.open("op", 1) as store:
        view = PartitionStore(store, batch_id=0, partition=1, key_groups=4096, partitions=2)
        good = [(b"\x08\x00" + encode_key((f"k{i}",)), b"1") for i in range(100)]
        foreign = (b"\x10\x00" + encode_key(("x",)), b"1")  # key group 4096: out of range
        with pytest.raises(StateKeeperError, match="got key 0x1000"):
            view.put_many([*good[:50], foreign, *good[50:]])
        assert list(store.scan(b"\x08")) == []
        view.put_many(iter(good))
        assert len(list(store.scan(b"\x08"))) == 100


def test_bulk_writes_of_a_partition_store_name_a_malformed_argument(
    backend: StateBackend,
) -> None:
    with backend.open("op", 1) as store:
        view = PartitionStore(store, batch_id=0, partition=1, key_groups=4096, partitions=2)
        with pytest.raises(TypeError, match=r"items must be an iterable of \(key, value\) pairs"):
            view.put_many(None)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="put_many's keys must be an iterable of bytes"):
            view.put_many(7, [b"1"])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="keys must be an iterable of bytes, got one bytes"):
            view.delete_many(b"\x08\x00k")
        assert list(store.scan()) == []


def test_put_many_of_keys_and_values_checks_key_groups_too(backend: StateBackend) -> None:
    """The columnar form is checked as the pairs are: a foreign key anywhere refuses all."""
    with backend.open("op", 1) as store:
        view = PartitionStore(store, batch_id=0, partition=1, key_groups=4096, partitions=2)
        keys = [b"\x08\x00" + encode_key((f"k{i}",)) for i in range(100)]
        foreign = b"\x07\xff" + encode_key(("x",))  # key group 2047: partition 0's
        with pytest.raises(StateKeeperError, match="got key 0x07ff"):
            view.put_many([*keys[:50], foreign, *keys[50:]], [b"1"] * 101)
        with pytest.raises(StateKeeperError, match="got key 0x07ff"):
            view.put_many([*keys, memoryview(foreign)], [b"1"] * 101)  # checked one by one
        assert list(store.scan(b"\x08")) == []
        view.put_many(iter(keys), iter([b"2"] * 100))
        assert dict(store.scan(b"\x08")) == dict.fromkeys(keys, b"2")
