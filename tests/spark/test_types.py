"""Non-string keys (with nulls) and an output schema of many types, through Spark."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from statekeeper import StoreConfig
from statekeeper.spark import read_state, transform_with_state
from tests.spark.processors import TypedEcho

pytestmark = pytest.mark.spark

OUTPUT = (
    "id int, day date, n long, ratio double, flag boolean, at timestamp, "
    "amount decimal(10,2), raw binary, note string"
)


def test_typed_keys_and_outputs_round_trip(spark: SparkSession, tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.json").write_text(
        '{"id": 1, "day": "2024-01-01", "v": 1}\n{"id": 1, "day": "2024-01-01", "v": 2}\n'
        '{"id": 2, "day": "2024-01-02", "v": 3}\n{"id": null, "day": null, "v": 3}\n'
    )
    df = spark.readStream.schema("id int, day date, v long").json(str(tmp_path / "in"))
    root = str(tmp_path / "state")
    out = transform_with_state(
        df, ["id", "day"], TypedEcho(), OUTPUT, root, "typed", 2,
        config=StoreConfig(local_dir=str(tmp_path / "local")),
    )  # fmt: skip
    query = (
        out.writeStream.format("memory")
        .queryName("typed_echo")
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(120)
    assert query.exception() is None

    rows = sorted(spark.sql("select * from typed_echo").collect(), key=lambda r: r["id"] or 0)
    common = {
        "at": dt.datetime(2024, 1, 2, 3, 4, 5),
        "raw": bytearray(b"\x00\x01"),
        "note": None,
    }
    assert [r.asDict() for r in rows] == [
        {"id": None, "day": None, "n": 1, "ratio": 0.5, "flag": False, "amount": Decimal("1.25")}
        | common,
        {"id": 1, "day": dt.date(2024, 1, 1), "n": 2, "ratio": 1.0, "flag": True,
         "amount": Decimal("2.50")} | common,
        {"id": 2, "day": dt.date(2024, 1, 2), "n": 1, "ratio": 0.5, "flag": False,
         "amount": Decimal("1.25")} | common,
    ]  # fmt: skip
    state = read_state(spark, root, "typed")
    assert state.columns == ["partition", "id", "day", "state", "entry", "value", "expires_at"]
    assert sorted((r["id"] or 0, r["day"], r["value"]) for r in state.collect()) == [
        (0, None, "1"),
        (1, dt.date(2024, 1, 1), "2"),
        (2, dt.date(2024, 1, 2), "1"),
    ]
