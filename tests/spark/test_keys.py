"""Bulk key encoding from Arrow columns writes exactly what encode_key writes."""

from __future__ import annotations

import pyarrow as pa  # type: ignore[import-untyped]
import pytest
from hypothesis import given
from hypothesis import strategies as st

from statekeeper.keyed import encode_key
from statekeeper.spark import encode_keys

_TEXT = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x2FF), max_size=6)


@given(st.lists(st.tuples(_TEXT, st.binary(max_size=6)), min_size=1, max_size=20))
def test_string_and_binary_columns_encode_like_encode_key(rows: list[tuple[str, bytes]]) -> None:
    texts, blobs = pa.array([r[0] for r in rows]), pa.array([r[1] for r in rows], pa.binary())
    assert encode_keys([texts, blobs]) == [encode_key(r) for r in rows]
    large = pa.array([r[0] for r in rows], pa.large_string())
    assert encode_keys([large]) == [encode_key((r[0],)) for r in rows]


def test_nulls_and_other_types_take_the_per_row_path() -> None:
    names, counts = pa.array(["a", None, "b\x00"]), pa.array([1, 2, -3])
    rows = [("a", 1), (None, 2), ("b\x00", -3)]
    assert encode_keys([names, counts]) == [encode_key(r) for r in rows]
    assert encode_keys([]) == []


def test_key_groups_prefix_each_key_with_two_bytes() -> None:
    names, groups = pa.array(["a", "b"]), pa.array([1, 4095], pa.int32())
    assert encode_keys([names], groups) == [
        b"\x00\x01" + encode_key(("a",)),
        b"\x0f\xff" + encode_key(("b",)),
    ]
    with pytest.raises(ValueError, match="expected 2 key groups, one per key; got 1"):
        encode_keys([names], [3])
    with pytest.raises(ValueError, match="key groups must be ints from 0 to 65535"):
        encode_keys([names], [1, None])
