"""Columns, the form a commit's changes are framed from: delete counts, ranges, slices, and
framing that matches the record layout byte for byte whatever the lengths."""

from __future__ import annotations

import itertools
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statekeeper.changelog import Columns, _records

_records_strategy = st.lists(
    st.tuples(
        st.binary(min_size=1, max_size=40),
        st.one_of(st.none(), st.binary(max_size=300)),
    ),
    max_size=60,
)


def _framed(records: list[tuple[bytes, bytes | None]]) -> bytes:
    """The body layout of the package docstring, written record by record."""
    out = []
    for key, value in records:
        out.append(struct.pack(">i", len(key)) + key)
        out.append(
            struct.pack(">i", -1) if value is None else struct.pack(">i", len(value)) + value
        )
    return b"".join(out) + struct.pack(">i", -1)


@settings(max_examples=200)
@given(records=_records_strategy, data=st.data())
def test_every_range_frames_counts_and_slices_as_its_records(
    records: list[tuple[bytes, bytes | None]], data: st.DataObject
) -> None:
    columns = Columns.of(records)
    assert columns.deletes == sum(value is None for _, value in records)
    start = data.draw(st.integers(0, len(records)))
    stop = data.draw(st.integers(start, len(records)))
    part = records[start:stop]
    assert columns.frame(start, stop) == _framed(part)
    assert columns.records(start, stop) == part
    assert columns.raw_length(start, stop) == sum(len(k) + len(v or b"") for k, v in part)
    piece = columns.slice(start, stop)
    assert (piece.keys, piece.values, piece.deletes) == (
        [k for k, _ in part],
        [v for _, v in part],
        sum(v is None for _, v in part),
    )
    assert piece.frame(0, len(piece)) == _framed(part)
    trusted = Columns.trusted([k for k, _ in records], [v for _, v in records])
    assert trusted.frame(0, len(trusted)) == columns.frame(0, len(columns))
    assert trusted.deletes == columns.deletes


def test_framing_stays_exact_when_the_packed_lengths_are_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dict of packed length fields is bounded: past its bound it starts again, and
    every field is still the length it stands for."""
    monkeypatch.setattr(_records, "_MAX_PACKED", 3)
    monkeypatch.setattr(_records, "_packed", _records._PackedLengths())
    records: list[tuple[bytes, bytes | None]] = [
        (b"k" * (1 + i % 7), None if i % 5 == 0 else bytes([i % 251]) * (i % 13))
        for i in range(200)
    ]
    columns = Columns.of(records)
    assert columns.frame(0, len(records)) == _framed(records)
    assert len(_records._packed) <= 3
    assert columns.frame(10, 50) == _framed(records[10:50])


@settings(max_examples=200)
@given(records=_records_strategy, part_size=st.integers(min_value=4, max_value=2000))
def test_split_runs_are_the_bodies_of_consecutive_records_up_to_the_part_size(
    records: list[tuple[bytes, bytes | None]], part_size: int
) -> None:
    columns = Columns.of(records)
    runs = columns.split(part_size)
    # Consecutive, covering every record once, at least one run.
    assert runs[0][0] == 0
    assert runs[-1][1] == len(records)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(runs))
    for start, stop, length in runs:
        body = _framed(records[start:stop])
        assert length == len(body) == len(columns.frame(start, stop))
        # Within the part size unless one record alone is larger; and as full as it can be.
        assert length <= part_size or stop - start == 1
        if stop < len(records):
            assert len(_framed(records[start : stop + 1])) > part_size


@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_framing_by_chunks_is_the_record_layout_across_chunk_edges(
    monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Records are framed a chunk at a time: deletes at, before and after chunk edges, a
    chunk without deletes next to one with, and ranges that start and stop inside chunks
    all give the layout written record by record."""
    monkeypatch.setattr(_records, "_FRAME_RECORDS", chunk)
    records: list[tuple[bytes, bytes | None]] = [
        (b"k%05d" % i, None if i % 1024 in (0, 1, 1023) or i % 3 == 2 else b"v" * (i % 17))
        for i in range(3 * 1024 + 5)
    ]
    records[2048:3072] = [(k, v or b"x") for k, v in records[2048:3072]]  # a chunk of puts
    columns = Columns.of(records)
    assert columns.frame(0, len(records)) == _framed(records)
    for start, stop in [(0, 0), (1, 2), (1023, 1025), (5, 2050), (2048, 3072), (3000, 3077)]:
        assert columns.frame(start, stop) == _framed(records[start:stop])
    puts = Columns.of(records[2048:3072])
    assert puts.deletes == 0
    assert puts.frame(0, len(puts)) == _framed(records[2048:3072])
