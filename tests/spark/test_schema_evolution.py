"""Schema evolution of state values through restarted streaming queries (issue 16 item 3):
an added field, a rename with a migration, and an incompatible change that fails the query
with a clear error and loses nothing once the processor is reverted. ``read_state`` decodes
each value with the recorded schema of the version it was written in, which also shows
which keys were rewritten (lazily, on their next update)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

from statekeeper import StateBackend, StoreConfig
from statekeeper.keyed import encode_key, stored_schema_version
from statekeeper.keyed._layout import state_prefix, unwrap
from statekeeper.spark import StatefulProcessor, read_state, transform_with_state
from tests.spark.helpers import pickled_by_value, run_to_end

pytestmark = pytest.mark.spark

NAME = "profiles"
OUT = "k string, visits long, label string"


@pytest.fixture(scope="module", autouse=True)
def _pickled_by_value() -> Iterator[None]:
    """Spark's workers cannot import this test module: its processors travel by value."""
    with pickled_by_value(sys.modules[__name__]):
        yield


@dataclass
class Profile:
    name: str
    visits: int


@dataclass
class ProfileWithTier:  # version 2: an added field with a default
    name: str
    visits: int
    tier: str = "basic"


@dataclass
class ProfileRetyped:  # version 2: visits as text, incompatible without a migration
    name: str
    visits: str


RENAMED = T.StructType(  # version 2 as a StructType: name renamed to display_name
    [
        T.StructField("display_name", T.StringType(), False),
        T.StructField("visits", T.LongType(), False),
    ]
)


class V1(StatefulProcessor):
    rows = "row"

    def init(self, handle: Any) -> None:
        self.state = handle.value_state("profile", schema=Profile, version=1)

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        old = self.state.get() or Profile(f"user {key[0]}", 0)
        new = Profile(old.name, old.visits + len(rows))
        self.state.update(new)
        yield (key[0], new.visits, new.name)


class WithTier(StatefulProcessor):
    rows = "row"

    def init(self, handle: Any) -> None:
        self.state = handle.value_state("profile", schema=ProfileWithTier, version=2)

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        old = self.state.get() or ProfileWithTier(f"user {key[0]}", 0)
        assert isinstance(old, ProfileWithTier)
        label = old.tier  # an old value reads the default
        visits = old.visits + len(rows)
        self.state.update(ProfileWithTier(old.name, visits, "gold" if visits >= 2 else "basic"))
        yield (key[0], visits, label)


def _rename(old: dict[str, Any], version: int) -> dict[str, Any]:
    return {"display_name": old["name"].upper(), "visits": old["visits"]}


class Renamed(StatefulProcessor):
    rows = "row"

    def init(self, handle: Any) -> None:
        self.state = handle.value_state("profile", schema=RENAMED, version=2, migrate=_rename)

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        old = self.state.get() or {"display_name": f"USER {key[0]}", "visits": 0}
        visits = old["visits"] + len(rows)
        self.state.update({"display_name": old["display_name"], "visits": visits})
        yield (key[0], visits, old["display_name"])


class Retyped(StatefulProcessor):
    rows = "row"

    def init(self, handle: Any) -> None:
        self.state = handle.value_state("profile", schema=ProfileRetyped, version=2)

    def handle_input_rows(self, key: tuple[Any, ...], rows: Any) -> Iterator[Any]:
        raise AssertionError("never reached: the declaration is refused in init")


def _write(folder: Path, index: int, keys: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{index}.tmp"
    tmp.write_text("".join(f'{{"k": "{k}"}}\n' for k in keys))
    tmp.rename(folder / f"part-{index:04d}.json")


def _run(spark: SparkSession, tmp: Path, processor: StatefulProcessor) -> None:
    """Run the query (a restart of the previous one) over every file not yet processed."""
    stream = spark.readStream.schema("k string").option("maxFilesPerTrigger", 1)
    out: DataFrame = transform_with_state(
        stream.json(str(tmp / "in")), keys="k", processor=processor, output_schema=OUT,
        checkpoint=str(tmp / "root"), name=NAME, partitions=2,
        config=StoreConfig(local_dir=str(tmp / "local")),
    )  # fmt: skip
    run_to_end(out, tmp / "sink", tmp / "cp")


def _out(spark: SparkSession, tmp: Path) -> set[tuple[str, int, str]]:
    rows = spark.read.parquet(str(tmp / "sink")).collect()
    return {(r["k"], r["visits"], r["label"]) for r in rows}


def _state(spark: SparkSession, tmp: Path) -> dict[str, dict[str, Any]]:
    rows = read_state(spark, str(tmp / "root"), NAME).collect()
    return {r["k"]: json.loads(r["value"]) for r in rows}


def _versions(tmp: Path, keys: list[str]) -> dict[str, int | None]:
    """The schema version each key's stored value carries, from the committed bytes."""
    found: dict[str, int | None] = {}
    config = StoreConfig(local_dir=str(tmp / "inspect"))
    with StateBackend(str(tmp / "root"), config=config) as backend:
        for partition in range(2):
            with backend.open(NAME, partition) as store:
                for key, raw in store.scan():
                    for k in keys:  # a data key: <key group:2 bytes> <state> <key>
                        if key[2:] == state_prefix("profile") + encode_key((k,)):
                            found[k] = stored_schema_version(unwrap(raw)[1])
    return found


def test_an_added_field_reads_its_default_and_is_written_lazily(
    spark: SparkSession, tmp_path: Path
) -> None:
    _write(tmp_path / "in", 0, ["a", "b", "c"])
    _run(spark, tmp_path, V1())
    _write(tmp_path / "in", 1, ["a", "c", "c"])
    _run(spark, tmp_path, WithTier())  # restarted with version 2

    assert _out(spark, tmp_path) == {
        ("a", 1, "user a"), ("b", 1, "user b"), ("c", 1, "user c"),  # version 1's runs
        ("a", 2, "basic"), ("c", 3, "basic"),  # old values read with the default tier
    }  # fmt: skip
    assert _state(spark, tmp_path) == {
        "a": {"name": "user a", "visits": 2, "tier": "gold"},
        "b": {"name": "user b", "visits": 1},  # not updated: still version 1
        "c": {"name": "user c", "visits": 3, "tier": "gold"},
    }
    assert _versions(tmp_path, ["a", "b", "c"]) == {"a": 2, "b": 1, "c": 2}


def test_a_rename_with_a_migration_is_applied_on_read(spark: SparkSession, tmp_path: Path) -> None:
    _write(tmp_path / "in", 0, ["a", "b"])
    _run(spark, tmp_path, V1())
    _write(tmp_path / "in", 1, ["a"])
    _run(spark, tmp_path, Renamed())  # restarted with version 2, a StructType

    assert ("a", 2, "USER A") in _out(spark, tmp_path)  # migrated when read
    assert _state(spark, tmp_path) == {
        "a": {"display_name": "USER A", "visits": 2},
        "b": {"name": "user b", "visits": 1},
    }
    assert _versions(tmp_path, ["a", "b"]) == {"a": 2, "b": 1}

    _write(tmp_path / "in", 2, ["b"])
    _run(spark, tmp_path, Renamed())
    assert ("b", 2, "USER B") in _out(spark, tmp_path)
    assert _versions(tmp_path, ["a", "b"]) == {"a": 2, "b": 2}


def test_an_incompatible_change_fails_and_the_reverted_query_goes_on(
    spark: SparkSession, tmp_path: Path
) -> None:
    _write(tmp_path / "in", 0, ["a", "b"])
    _run(spark, tmp_path, V1())
    _write(tmp_path / "in", 1, ["a"])
    with pytest.raises(StreamingQueryException) as caught:
        _run(spark, tmp_path, Retyped())
    message = str(caught.value)
    assert "ConfigMismatchError" in message
    assert "state 'profile'" in message
    assert "schema version 1 (name string not null, visits bigint not null)" in message
    assert "schema version 2 (name string not null, visits string not null)" in message
    assert "field 'visits' changes type from bigint to string" in message
    with StateBackend(str(tmp_path / "root")) as backend:
        assert [backend.versions(NAME, p)[-1] for p in range(2)] == [1, 1]  # nothing committed

    _run(spark, tmp_path, V1())  # reverted: batch 1 runs again, nothing was lost
    _write(tmp_path / "in", 2, ["a", "b"])
    _run(spark, tmp_path, V1())
    assert _out(spark, tmp_path) == {
        ("a", 1, "user a"), ("b", 1, "user b"), ("a", 2, "user a"),
        ("a", 3, "user a"), ("b", 2, "user b"),
    }  # fmt: skip
    assert _state(spark, tmp_path) == {
        "a": {"name": "user a", "visits": 3},
        "b": {"name": "user b", "visits": 2},
    }
