"""Key groups in the in-store layout: every data key starts with its key group; 0.1 stores
(no key groups) keep the old layout; tools decode both without the root."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from statekeeper import ConfigMismatchError, StateBackend, StateStore, StoreConfig
from statekeeper.keyed import (
    MAX_KEY_GROUPS,
    StatefulProcessor,
    StatefulProcessorHandle,
    encode_key,
    group_prefix,
    iter_state,
    key_group_range,
    partition_of_group,
    read_operator_record,
    ttl_prefix,
)
from statekeeper.keyed._layout import META_KEY
from statekeeper.keyed.testing import ProcessorTester

G = 4096


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    config = StoreConfig(local_dir=str(tmp_path / "local"))
    with (
        StateBackend(str(tmp_path / "root"), config=config) as backend,
        backend.open("op", 0) as store,
    ):
        yield store


def _write(store: StateStore, key_groups: int | None, keys: dict[str, int]) -> None:
    """Value, map, list (with TTL) state for each key, then commit."""
    handle = StatefulProcessorHandle(
        store, now_ms=1_000, batch_id=store.version, partition=0, key_groups=key_groups
    )
    count = handle.value_state("count")
    seen = handle.map_state("seen")
    recent = handle.list_state("recent", ttl=60)
    handle.record_operator(["k"], key_schema=None, operator="op")
    names = sorted(keys)
    handle.visit_keys(
        [encode_key((k,)) for k in names],
        None if key_groups is None else [keys[k] for k in names],
    )
    for position, name in enumerate(names):
        handle.select(position, (name,))
        count.update((count.get() or 0) + 1)
        seen.put("x", name)
        recent.append(position)
    handle.set_key(None)
    store.commit()


def test_every_data_key_starts_with_its_key_group(store: StateStore) -> None:
    groups = {"a": 7, "b": 300, "c": 4095}
    _write(store, G, groups)
    items = dict(store.scan())
    record = json.loads(items.pop(META_KEY))
    assert (record["keyGroups"], record["formatVersion"]) == (G, 2)
    ttl_index = {k: v for k, v in items.items() if k.startswith(b"\xff\x02")}
    data = {k: v for k, v in items.items() if k not in ttl_index}
    assert len(ttl_index) == 3  # one list element per key, under 0xFF: no key group's range
    # value + map entry + list counter + list element per key
    for name, group in groups.items():
        mine = [k for k in data if k[:2] == group_prefix(group)]
        assert len(mine) == 4, name
        assert all(k[2:3] == b"\x01" and encode_key((name,)) in k for k in mine)
    assert len(data) == 4 * len(groups)
    assert all(k[len(b"\xff\x02") :].find(b"\x01") >= 0 for k in ttl_index)


def test_grouped_state_reads_back_through_the_prefetch_and_decodes(store: StateStore) -> None:
    groups = {"a": 1, "b": 2, "c": 2}
    _write(store, G, groups)
    _write(store, G, groups)  # reads the first batch's values through the prefetch
    entries = list(iter_state(store))
    counts = {e.key[0]: e.value for e in entries if e.state == "count"}
    assert counts == {"a": 2, "b": 2, "c": 2}
    assert {e.key[0]: e.key_group for e in entries} == groups
    recent = [(e.key[0], e.entry, e.value) for e in iter_state(store, state="recent")]
    assert recent == [("a", 0, 0), ("a", 1, 0), ("b", 0, 1), ("b", 1, 1), ("c", 0, 2), ("c", 1, 2)]
    record = read_operator_record(store)
    assert record is not None
    assert record.key_groups == G


def test_grouped_ttl_expiry_deletes_the_value_and_its_index_entry(store: StateStore) -> None:
    handle = StatefulProcessorHandle(store, now_ms=0, batch_id=0, partition=0, key_groups=G)
    handle.set_key(("a",), 9)
    handle.value_state("v", ttl=10).update(1)
    store.commit()
    keys = [k for k, _ in store.scan() if k != META_KEY]
    assert [k[:3] for k in keys] == [b"\x00\x09\x01", b"\xff\x02\x02"]  # str-tagged name
    assert keys[1].endswith(keys[0])  # the index entry ends with the data key it covers
    late = StatefulProcessorHandle(store, now_ms=20_000, batch_id=1, partition=0, key_groups=G)
    late.value_state("v", ttl=10)
    assert late.expire() == 1
    store.commit()
    # Only the index's floor is left, after 0xFF like the index
    assert [k for k, _ in store.scan()] == [b"\xff\x06" + ttl_prefix("v", grouped=True)[1:]]


def test_a_0_1_store_keeps_the_unprefixed_layout(store: StateStore) -> None:
    _write(store, None, {"a": 0, "b": 0})
    items = dict(store.scan())
    record = json.loads(items.pop(META_KEY))
    assert record["formatVersion"] == 1
    assert "keyGroups" not in record
    assert {k[:1] for k in items} == {b"\x01", b"\x02"}  # data and TTL index, as 0.1 wrote
    assert {e.key[0]: e.key_group for e in iter_state(store)} == {"a": None, "b": None}
    _write(store, None, {"a": 0})
    assert {e.key[0]: e.value for e in iter_state(store, state="count")} == {"a": 2, "b": 1}


def test_a_store_in_one_layout_refuses_the_other(store: StateStore) -> None:
    _write(store, None, {"a": 0})
    with pytest.raises(ConfigMismatchError, match=r"no key groups .* records 4096 key groups"):
        _write(store, G, {"a": 0})
    store.abort()
    with pytest.raises(ValueError, match=r"key group in \[0, 4096\)"):
        StatefulProcessorHandle(store, now_ms=0, batch_id=0, partition=0, key_groups=G).set_key(
            ("a",)
        )
    handle = StatefulProcessorHandle(store, now_ms=0, batch_id=0, partition=0, key_groups=G)
    with pytest.raises(ValueError, match="key groups of 1 keys, got none"):
        handle.visit_keys([encode_key(("a",))])
    with pytest.raises(ValueError, match="key groups must be an int from 1 to 65280"):
        StatefulProcessorHandle(
            store, now_ms=0, batch_id=0, partition=0, key_groups=MAX_KEY_GROUPS + 1
        )


@pytest.mark.parametrize(("partitions", "groups"), [(1, 4096), (3, 4096), (7, 100), (5, 5)])
def test_partitions_own_contiguous_disjoint_key_group_ranges(partitions: int, groups: int) -> None:
    ranges = [key_group_range(p, partitions, groups) for p in range(partitions)]
    assert ranges[0].start == 0
    assert ranges[-1].stop == groups
    assert all(a.stop == b.start for a, b in itertools.pairwise(ranges))
    for p, owned in enumerate(ranges):
        assert len(owned) > 0
        assert all(partition_of_group(g, partitions, groups) == p for g in owned)


class _Count(StatefulProcessor):
    def init(self, handle: StatefulProcessorHandle) -> None:
        self.n = handle.value_state("n")

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        self.n.update((self.n.get() or 0) + len(rows))
        yield (key[0], self.n.get())


def test_a_tester_directory_is_laid_out_as_its_root_records(tmp_path: Path) -> None:
    """ProcessorTester once wrote 256 key groups under a root that records 4096: a task
    given that root refused it ("the store and the root do not belong together")."""
    schema = pa.schema([("k", pa.string()), ("n", pa.int64())])
    with ProcessorTester(_Count(), keys="k", output_schema=schema, directory=tmp_path) as t:
        assert t.run([{"k": "a"}, {"k": "b"}, {"k": "a"}]) == [
            {"k": "a", "n": 2},
            {"k": "b", "n": 1},
        ]
    config = StoreConfig(local_dir=str(tmp_path / "again"))
    with StateBackend(str(tmp_path / "root"), config=config) as backend:
        meta = backend.root_metadata()
        assert meta is not None
        with backend.open("tester", 0) as store:
            record = read_operator_record(store)
            assert record is not None
            assert record.key_groups == meta.key_groups["tester"] == 4096
