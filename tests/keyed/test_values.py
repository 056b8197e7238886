"""The default value codec is safe and versioned; pickle only when asked for."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from zoneinfo import ZoneInfo

import numpy as np
import pandas as pd
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from statekeeper import CorruptStateError
from statekeeper.keyed import DefaultCodec, PickleCodec

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(),
    st.binary(),
    st.datetimes(),
    st.datetimes(timezones=st.timezones()),
    st.dates(),
    st.times(),
    st.timedeltas(),
    st.decimals(allow_nan=False),
)
hashables = st.one_of(st.none(), st.booleans(), st.integers(), st.text(), st.binary())
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(hashables, inner, max_size=4),
    ),
    max_leaves=20,
)


@given(values)
@example(dt.datetime(2000, 10, 29, 2, 0, tzinfo=ZoneInfo("Europe/Oslo")))  # a repeated hour
@example([dt.datetime(1939, 2, 28, 23, 0, tzinfo=ZoneInfo("America/Argentina/Buenos_Aires"))])
def test_round_trip_keeps_value_and_type(value: object) -> None:
    codec = DefaultCodec()
    data = codec.encode(value)
    assert data[0] == 0x01  # the format byte
    decoded = codec.decode(data)
    assert _comparable(decoded) == _comparable(value)
    assert type(decoded) is type(value) or isinstance(value, dt.datetime)


def _comparable(value: object) -> object:
    """Aware datetimes as (wall time, UTC offset): the codec keeps the instant and its offset,
    not the zone, and PEP 495 makes == across zones false for a wall time a DST change
    repeats or skips."""
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        return ("aware", value.replace(tzinfo=None), value.utcoffset())
    if isinstance(value, list | tuple):
        return type(value)(_comparable(v) for v in value)
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    return value


GOLDEN = [
    (7, "01030000000000000007"),
    (-1.5, "0105bff8000000000000"),
    ((12345, 987654321), "01090203000000000000303903000000003ade68b1"),
    ([1, 2.5, -3], "01080303000000000000000105400400000000000003fffffffffffffffd"),
    ((2**63, True, None, "é"), "010904040900800000000000000002000602c3a9"),
    ((), "010900"),
    ([], "010800"),
    ({"a": (1, 2.0)}, "010a010601610902030000000000000001054000000000000000"),
    ([[1, 2], (3,)], "01080208020300000000000000010300000000000000020901030000000000000003"),
]


@pytest.mark.parametrize(("value", "stored"), GOLDEN, ids=[repr(v) for v, _ in GOLDEN])
def test_stored_bytes_do_not_change(value: object, stored: str) -> None:
    """The bytes are the on-storage format: every encoding path (the fast ones for ints,
    floats and flat tuples or lists of them included) writes exactly these, and reads them
    back with their types."""
    codec = DefaultCodec()
    assert codec.encode(value).hex() == stored
    decoded = codec.decode(bytes.fromhex(stored))
    assert decoded == value
    assert type(decoded) is type(value)


numbers = st.one_of(
    st.integers(min_value=-(2**64), max_value=2**64),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
)


@given(st.one_of(st.lists(numbers, max_size=140), st.lists(numbers, max_size=9).map(tuple)))
def test_flat_tuples_and_lists_of_numbers_round_trip(
    value: list[object] | tuple[object, ...],
) -> None:
    """Flat tuples and lists of ints and floats take a fast path both ways; big ints, bools,
    ``None`` and 128 or more elements (a two-byte count) among them must still come back
    as they went in."""
    codec = DefaultCodec()
    decoded = codec.decode(codec.encode(value))
    assert decoded == value
    assert type(decoded) is type(value)
    assert [type(v) for v in decoded] == [type(v) for v in value]


def test_flat_numbers_keep_nan_and_signed_zero() -> None:
    codec = DefaultCodec()
    nan, zero = codec.decode(codec.encode((float("nan"), -0.0)))
    assert nan != nan
    assert str(zero) == "-0.0"


def test_numpy_and_pandas_values_are_stored_as_python_values() -> None:
    codec = DefaultCodec()
    assert codec.decode(codec.encode(np.int64(5))) == 5
    assert type(codec.decode(codec.encode(np.int64(5)))) is int
    assert type(codec.decode(codec.encode(np.float64(1.5)))) is float
    assert codec.decode(codec.encode(np.bool_(True))) is True
    stamp = pd.Timestamp("2024-05-01 12:00:00.123456789")
    assert codec.decode(codec.encode(stamp)) == dt.datetime(2024, 5, 1, 12, 0, 0, 123456)
    assert codec.decode(codec.encode([np.int32(1), Decimal("1.5")])) == [1, Decimal("1.5")]
    # A missing time is None (it read back as 0001-01-01 before), also inside a value.
    assert codec.decode(codec.encode(pd.NaT)) is None
    assert codec.decode(codec.encode((3, pd.NaT))) == (3, None)
    assert codec.decode(codec.encode(np.datetime64("NaT"))) is None
    # numpy times in nanoseconds (a pandas column's .values) are times, not ints
    at = pd.Series([pd.Timestamp("2024-05-01 12:00:00.000001")]).to_numpy()[0]
    assert codec.decode(codec.encode(at)) == dt.datetime(2024, 5, 1, 12, 0, 0, 1)
    took = np.timedelta64(1500, "ns")
    assert codec.decode(codec.encode(took)) == dt.timedelta(microseconds=1)


def test_a_numpy_array_is_refused_even_of_one_element_never_stored_as_its_value() -> None:
    """``rows["v"].values[-1:]`` is an array, not a scalar: storing it as ``5`` would read
    back as another type than was written."""
    codec = DefaultCodec()
    for array in (np.array([5]), np.array(7), np.array([1, 2, 3]), [np.array([1])]):
        with pytest.raises(TypeError, match=r"cannot store a numpy array .*array\.tolist\(\)"):
            codec.encode(array)


def test_the_default_codec_never_unpickles() -> None:
    pickled = PickleCodec().encode({1, 2})
    with pytest.raises(CorruptStateError, match=r"never unpickles .* codec=PickleCodec"):
        DefaultCodec().decode(pickled)
    assert PickleCodec().decode(pickled) == {1, 2}
    assert PickleCodec().decode(DefaultCodec().encode([1])) == [1]


def test_unknown_formats_and_malformed_bytes_are_refused() -> None:
    codec = DefaultCodec()
    with pytest.raises(CorruptStateError, match="format byte 0x02"):
        codec.decode(b"\x02abc")
    with pytest.raises(CorruptStateError, match="malformed"):
        codec.decode(codec.encode("hello")[:-2])
    with pytest.raises(CorruptStateError, match="trailing"):
        codec.decode(codec.encode(1) + b"\x00")
    with pytest.raises(CorruptStateError, match="malformed"):
        codec.decode(b"\x01\x7f")
    with pytest.raises(CorruptStateError, match="empty"):
        codec.decode(b"")


def test_unsupported_values_are_named() -> None:
    with pytest.raises(TypeError, match=r"cannot store a set.*PickleCodec"):
        DefaultCodec().encode({1})
    nested: list[object] = []
    nested.append(nested)
    with pytest.raises(ValueError, match="deeper than"):
        DefaultCodec().encode(nested)
