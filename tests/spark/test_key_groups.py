"""Keys -> key group -> partition in a streaming query; operators of statekeeper 0.1 (no key
groups in the root) keep their unprefixed keys and Spark's hash partitioning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from statekeeper import StateBackend, StoreConfig, layout
from statekeeper.keyed import decode_key, key_group_range
from statekeeper.keyed._layout import META_KEY
from statekeeper.keyed._tuples import decode_element
from statekeeper.spark import read_state, transform_with_state
from tests.spark.helpers import (
    OUTPUT_SCHEMA,
    batch_totals,
    make_input,
    read_stream,
    run_to_end,
    sink_latest,
    state_totals,
    write_files,
)
from tests.spark.processors import RunningCountSum

pytestmark = pytest.mark.spark

PARTITIONS = 3
GROUPS = 4096


def _store_keys(root: str, name: str, local: Path) -> dict[int, list[bytes]]:
    """Every partition's raw keys (the operator record left out)."""
    with StateBackend(root, config=StoreConfig(local_dir=str(local))) as backend:
        found = {}
        for p in range(PARTITIONS):
            with backend.open(name, p) as store:
                found[p] = [k for k, _ in store.scan() if k != META_KEY]
        return found


def _spark_column(spark: SparkSession, keys: list[str], expr: str) -> dict[str, int]:
    frame = spark.createDataFrame([(k,) for k in keys], "k string")
    return {r["k"]: r["x"] for r in frame.select("k", F.expr(expr).alias("x")).collect()}


def _run(spark: SparkSession, tmp_path: Path, root: str, name: str) -> dict[str, tuple[int, int]]:
    inp = tmp_path / "in"
    write_files(inp, make_input(seed=31, files=2, rows=20, keys=12))
    out = transform_with_state(
        read_stream(spark, inp), ["k"], RunningCountSum(), OUTPUT_SCHEMA, root, name,
        PARTITIONS, config=StoreConfig(local_dir=str(tmp_path / "local")),
    )  # fmt: skip
    run_to_end(out, tmp_path / "out", tmp_path / "ck")
    expected = batch_totals(spark, inp)
    assert sink_latest(spark, tmp_path / "out") == expected
    assert state_totals(read_state(spark, root, name)) == expected
    return expected


def test_state_keys_start_with_the_key_group_spark_computes(
    spark: SparkSession, tmp_path: Path
) -> None:
    root = str(tmp_path / "state")
    expected = _run(spark, tmp_path, root, "grouped")
    groups = _spark_column(spark, list(expected), f"pmod(hash(k), {GROUPS})")
    keys = _store_keys(root, "grouped", tmp_path / "l2")
    seen: dict[str, int] = {}
    for p, stored in keys.items():
        owned = key_group_range(p, PARTITIONS, GROUPS)
        data = [k for k in stored if k[:1] != b"\xff"]  # the TTL index lives above all groups
        assert data, f"partition {p} holds no state"
        for key in data:
            group = int.from_bytes(key[:2], "big")
            assert group in owned, f"partition {p} holds key group {group}, owns {owned}"
            assert key[2:3] == b"\x01"
            _, pos = decode_element(key, 3)  # the state's name
            (name,), _ = decode_key(key[pos:], 1)
            seen[name] = group
    assert seen == groups  # every key carries the key group Spark's hash gives it


def test_an_operator_without_key_groups_keeps_the_0_1_layout(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The root records the operator as statekeeper 0.1 did (format 1, no keyGroups): its
    keys stay unprefixed and each key's state sits in ``pmod(hash(k), P)``, as before."""
    root = str(tmp_path / "state")
    with StateBackend(root, config=StoreConfig(local_dir=str(tmp_path / "l0"))) as backend:
        backend.register("legacy", PARTITIONS)
    path = Path(root) / layout.ROOT_METADATA
    doc = json.loads(path.read_text())
    del doc["crc32c"], doc["operators"]["legacy"]["keyGroups"]
    doc["formatVersion"] = 1
    path.write_text(json.dumps(doc))

    expected = _run(spark, tmp_path, root, "legacy")
    keys = _store_keys(root, "legacy", tmp_path / "l2")
    assert {k[:1] for stored in keys.values() for k in stored} == {b"\x01"}
    partition = _spark_column(spark, list(expected), f"pmod(hash(k), {PARTITIONS})")
    state = read_state(spark, root, "legacy").collect()
    assert {r["k"]: r["partition"] for r in state} == partition
    with StateBackend(root, config=StoreConfig(local_dir=str(tmp_path / "l3"))) as backend:
        meta = backend.root_metadata()
        assert meta is not None
        assert "legacy" not in meta.key_groups
        with backend.open("legacy", 0) as store:
            assert b"keyGroups" not in (store.get(META_KEY) or b"")
