"""Bad inputs get a clear error before any state is touched."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from statekeeper import ConfigMismatchError, StateBackend, StoreConfig, layout
from statekeeper.spark import transform_with_state, transform_with_state_arrow
from tests.spark.helpers import OUTPUT_SCHEMA, make_input, read_stream, run_to_end, write_files
from tests.spark.processors import RunningCountSum, WrongOutputType, arrow_count_sum

pytestmark = pytest.mark.spark


def _blob_keys(root: str) -> list[str]:
    with StateBackend(root) as backend:
        return [m.key for m in backend.blobs.list()]


def test_a_batch_dataframe_is_refused(spark: SparkSession, tmp_path: Path) -> None:
    root = str(tmp_path / "state")
    df = spark.createDataFrame([("a", 1)], "k string, v long")
    with pytest.raises(ValueError, match="needs a streaming DataFrame"):
        transform_with_state(df, ["k"], RunningCountSum(), OUTPUT_SCHEMA, root, "op", 2)
    with pytest.raises(ValueError, match="needs a streaming DataFrame"):
        transform_with_state_arrow(df, ["k"], arrow_count_sum, OUTPUT_SCHEMA, root, "op", 2)
    assert not Path(root).exists()


def test_missing_and_unsupported_key_columns_are_named(spark: SparkSession, tmp_path: Path) -> None:
    root = str(tmp_path / "state")
    df = read_stream(spark, tmp_path / "in")
    with pytest.raises(ValueError, match=r"key columns \['user'\] are not in the DataFrame"):
        transform_with_state(df, ["k", "user"], RunningCountSum(), OUTPUT_SCHEMA, root, "op", 2)
    nested = df.withColumn("arr", F.array("v"))
    with pytest.raises(ValueError, match="key column 'arr' has type array<bigint>"):
        transform_with_state(nested, "arr", RunningCountSum(), OUTPUT_SCHEMA, root, "op", 2)
    assert not Path(root).exists()


def test_bad_arguments_are_refused(spark: SparkSession, tmp_path: Path) -> None:
    root = str(tmp_path / "state")
    df = read_stream(spark, tmp_path / "in")
    with pytest.raises(TypeError, match="StatefulProcessor instance"):
        transform_with_state(df, "k", RunningCountSum, OUTPUT_SCHEMA, root, "op", 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="partitions must be an int >= 1"):
        transform_with_state(df, "k", RunningCountSum(), OUTPUT_SCHEMA, root, "op", 0)
    with pytest.raises(TypeError, match="output_schema must be a DDL string or a StructType"):
        transform_with_state(df, "k", RunningCountSum(), 42, root, "op", 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="operator name"):
        transform_with_state(df, "k", RunningCountSum(), OUTPUT_SCHEMA, root, "_bad", 2)


def test_a_different_partition_count_is_refused(spark: SparkSession, tmp_path: Path) -> None:
    root = str(tmp_path / "state")
    df = read_stream(spark, tmp_path / "in")
    transform_with_state(df, "k", RunningCountSum(), OUTPUT_SCHEMA, root, "op", 2)
    before = _blob_keys(root)
    assert before == [layout.ROOT_METADATA]  # the operator is registered; no state yet
    with pytest.raises(ConfigMismatchError, match=r"has 2 partitions .* but 3 were asked for"):
        transform_with_state(df, "k", RunningCountSum(), OUTPUT_SCHEMA, root, "op", 3)
    with pytest.raises(ConfigMismatchError, match="has 2 partitions"):
        transform_with_state_arrow(df, "k", arrow_count_sum, OUTPUT_SCHEMA, root, "op", 3)
    assert _blob_keys(root) == before


def test_output_not_matching_the_schema_names_the_column(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The task fails (every attempt) naming the column; the partition commits nothing."""
    root = str(tmp_path / "state")
    write_files(tmp_path / "in", make_input(seed=3, files=1, rows=5, keys=2))
    out = transform_with_state(
        read_stream(spark, tmp_path / "in"), "k", WrongOutputType(), "k string, count long",
        root, "wrong", 1, config=StoreConfig(local_dir=str(tmp_path / "local")),
    )  # fmt: skip
    with pytest.raises(StreamingQueryException) as caught:
        run_to_end(out, tmp_path / "out", tmp_path / "ck")
    message = str(caught.value)
    assert "OutputSchemaError" in message
    assert "column 'count' has type string, but output_schema declares int64" in message
    with StateBackend(root) as backend:
        assert backend.versions("wrong", 0) == [0]


def test_speculation_is_refused_before_any_state_is_touched(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A speculative copy of a task would run a partition's processor twice at once: a
    session with ``spark.speculation=true`` is refused with the reason and the remedy."""
    root = str(tmp_path / "state")
    session = spark.newSession()  # its own SQL conf: the suite's session stays as it is
    # spark.speculation is a core conf, fixed when a SparkContext starts; a session of a
    # context started with it reads "true" from its conf, as this one does once allowed.
    session.conf.set("spark.sql.legacy.setCommandRejectsSparkCoreConfs", "false")
    session.conf.set("spark.speculation", "true")
    df = read_stream(session, tmp_path / "in")
    message = r"does not run with spark\.speculation=true.*Turn speculation off"
    with pytest.raises(ValueError, match=message):
        transform_with_state(df, "k", RunningCountSum(), OUTPUT_SCHEMA, root, "op", 2)
    with pytest.raises(ValueError, match=message):
        transform_with_state_arrow(df, "k", arrow_count_sum, OUTPUT_SCHEMA, root, "op", 2)
    assert not Path(root).exists()
    session.conf.set("spark.speculation", "false")
    transform_with_state(df, "k", RunningCountSum(), OUTPUT_SCHEMA, root, "op", 2)
    assert Path(root).exists()  # the same call goes through once speculation is off
    assert spark.conf.get("spark.speculation", "false") == "false"
