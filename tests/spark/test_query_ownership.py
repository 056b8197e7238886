"""A query's state belongs to that query: another streaming query on the same operator (one
started with a fresh ``checkpointLocation``, as a blue/green deploy or a deleted checkpoint
does) is refused instead of taking it over.

A fresh checkpoint restarts Spark's batch ids at 0, so the new query's first batch loads
version 0 and commits version 1 again, with a newer run generation. Before owners, that was
a re-run by the protocol's rules: when the old query had committed exactly one version, the
new query silently replaced it, and the old query, restarted, would go on from the new
query's state. Each commit now names its streaming query (``sql.streaming.queryId``, the
same across restarts from one checkpoint); another query may neither replace, adopt nor
build on it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession

from statekeeper import StoreConfig
from statekeeper.spark import read_state, transform_with_state
from tests.spark.helpers import (
    OUTPUT_SCHEMA,
    batch_totals,
    make_input,
    read_stream,
    run_to_end,
    sink_latest,
    state_totals,
    version_owners,
    write_files,
)
from tests.spark.processors import RunningCountSum

pytestmark = pytest.mark.spark

NAME = "counts"


def _out(spark: SparkSession, tmp_path: Path, folder: str, host: str) -> DataFrame:
    return transform_with_state(
        read_stream(spark, tmp_path / folder), ["k"], RunningCountSum(), OUTPUT_SCHEMA,
        str(tmp_path / "state"), NAME, 2, config=StoreConfig(local_dir=str(tmp_path / host)),
    )  # fmt: skip


def test_a_second_query_is_refused_and_the_first_resumes_with_its_own_state(
    spark: SparkSession, tmp_path: Path
) -> None:
    a_input = make_input(seed=1, files=4, rows=50, keys=20)
    write_files(tmp_path / "inA", a_input[:1])
    a = run_to_end(_out(spark, tmp_path, "inA", "hostA"), tmp_path / "outA", tmp_path / "ckA")
    root = str(tmp_path / "state")
    assert version_owners(root, NAME, 2) == [[str(a.id)]] * 2  # version 1 of each partition

    # Query B: other input, a fresh checkpoint; then B2: A's own input, a fresh checkpoint
    # (identical changes, which a re-run of the same query would adopt).
    write_files(tmp_path / "inB", make_input(seed=2, files=3, rows=50, keys=20))
    for folder, ck in (("inB", "ckB"), ("inA", "ckB2")):
        out = _out(spark, tmp_path, folder, f"host-{ck}")
        refused = "OwnerConflictError.*belongs to another streaming query"
        with pytest.raises(StreamingQueryException, match=refused) as info:
            run_to_end(out, tmp_path / f"out-{ck}", tmp_path / ck)
        assert "Restart the other query from its own checkpointLocation" in str(info.value)
    # Nothing of B's was committed: version 1 is still A's (B's batch 0 would replace it).
    assert version_owners(root, NAME, 2) == [[str(a.id)]] * 2

    write_files(tmp_path / "inA", a_input[1:], start=1)
    query = run_to_end(_out(spark, tmp_path, "inA", "hostA"), tmp_path / "outA", tmp_path / "ckA")
    # Every version names A: its id is the same after a restart.
    assert str(query.id) == str(a.id)
    assert version_owners(root, NAME, 2) == [[str(a.id)] * 4] * 2
    expected = batch_totals(spark, tmp_path / "inA")
    assert state_totals(read_state(spark, root, NAME)) == expected
    assert sink_latest(spark, tmp_path / "outA") == expected
