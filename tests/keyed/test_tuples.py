"""Grouping key encoding: order-preserving, unambiguous, prefix-free, reversible."""

from __future__ import annotations

import datetime as dt
import itertools
import math
from decimal import Decimal

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from statekeeper.keyed import decode_key, encode_key
from statekeeper.keyed._tuples import encode_element

ints = st.integers(min_value=-(2**80), max_value=2**80)
floats = st.floats(allow_nan=False)
texts = st.text()
blobs = st.binary()
dates = st.dates()
stamps = st.datetimes(timezones=st.just(dt.UTC))


@pytest.mark.parametrize("strategy", [ints, floats, texts, blobs, dates, stamps])
@given(data=st.data())
def test_byte_order_is_value_order(
    strategy: st.SearchStrategy[object], data: st.DataObject
) -> None:
    a, b = data.draw(strategy), data.draw(strategy)
    ea, eb = encode_key((a,)), encode_key((b,))
    if a == b:
        assert ea == eb
    else:
        expected = a < b  # type: ignore[operator]
        if isinstance(a, str):
            expected = a.encode() < b.encode()  # type: ignore[union-attr]
        assert (ea < eb) == expected


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    return a == b and [type(x) for x in a] == [type(x) for x in b]


@given(st.lists(st.tuples(st.one_of(st.none(), ints, texts, blobs, st.booleans()), texts)))
def test_distinct_tuples_never_collide_nor_prefix_each_other(
    keys: list[tuple[object, str]],
) -> None:
    encoded = [(k, encode_key(k)) for k in keys]
    for (k1, e1), (k2, e2) in itertools.permutations(encoded, 2):
        if not _same(k1, k2):
            assert e1 != e2
            assert not e2.startswith(e1)


@given(st.tuples(st.none(), ints, floats, texts, blobs, st.booleans(), dates, stamps))
def test_decode_returns_the_tuple_and_its_length(key: tuple[object, ...]) -> None:
    data = encode_key(key) + b"tail"
    decoded, end = decode_key(data, len(key))
    assert decoded == key
    assert data[end:] == b"tail"


def test_tuple_order_is_lexicographic() -> None:
    keys = [("a", 2), ("a", 10), ("ab", 1), ("b", -5), ("b", 0)]
    assert sorted(keys, key=encode_key) == keys
    assert encode_key(("a", 1)) != encode_key(("a\x00", 1))
    assert encode_key((b"x\x00",)) != encode_key((b"x",))


def test_normalizations_and_other_types() -> None:
    assert encode_key((-0.0,)) == encode_key((0.0,))
    assert encode_key((math.nan,)) == encode_key((float("nan"),))
    assert encode_key((np.int64(7),)) == encode_key((7,))
    naive, aware = dt.datetime(2024, 1, 1), dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    assert encode_key((naive,)) != encode_key((aware,))
    assert decode_key(encode_key((Decimal("-12.50"), naive)), 2)[0] == (Decimal("-12.50"), naive)
    assert encode_key((Decimal("1.05"),)) < encode_key((Decimal("2.10"),))
    assert encode_element(True) > encode_element(False)


def test_unsupported_types_are_named() -> None:
    with pytest.raises(TypeError, match="cannot be of type list"):
        encode_key(([1],))
    with pytest.raises(ValueError, match="unknown key element tag"):
        decode_key(b"\x7f", 1)
    with pytest.raises(ValueError, match="truncated"):
        decode_key(encode_key((1, 2))[:-1], 2)


@pytest.mark.parametrize(
    ("small", "large"),
    [((None, ""), (None, "\x00")), (("",), ("\x00",)), ((b"",), (b"\x00",)), (("a",), ("a\x00",))],
)
def test_an_empty_or_shorter_string_is_never_a_prefix_of_a_longer_one(
    small: tuple[object, ...], large: tuple[object, ...]
) -> None:
    # With FoundationDB's lone 0x00 terminator "" (02 00) prefixes "\x00" (02 00 FF 00), and
    # a prefix scan of one key's state would see the other's.
    a, b = encode_key(small), encode_key(large)
    assert not b.startswith(a)
    assert a < b
    assert decode_key(a, len(small)) == (small, len(a))
    assert decode_key(b, len(large)) == (large, len(b))
