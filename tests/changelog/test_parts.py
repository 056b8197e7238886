"""Changelogs of several parts (format 3): layout, checks, and reading a part at a time."""

from __future__ import annotations

import os
import struct

import google_crc32c
import pytest

from statekeeper.changelog import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAX_HEADER_SIZE,
    SINGLE_PART_FORMAT,
    ChangelogIdentity,
    decode_changelog,
    encode_changelog,
    encode_changelog_parts,
    read_changelog,
    read_header,
)
from statekeeper.config import Compression
from statekeeper.errors import CorruptStateError

BLOB = "op/0/changelog/00000000000000000008-a1.changelog"
IDENTITY = ChangelogIdentity("root", "op", 0, "a1")
# 300 records of ~130 framed bytes: ~39 KB of body, several 4 KiB parts.
RECORDS = [(b"key:%06d" % i, None if i % 11 == 0 else os.urandom(120)) for i in range(300)]


def _parts(compression: Compression = "zstd", part_size: int = 4096) -> list[bytes]:
    return list(
        encode_changelog_parts(
            RECORDS, base_version=7, version=8, compression=compression, identity=IDENTITY,
            part_size=part_size,
        )
    )  # fmt: skip


def _spans(blob: bytes) -> list[tuple[int, int]]:
    """(offset, length) of each part, from the headers."""
    spans, offset = [], 0
    while offset < len(blob):
        header = read_header(blob[offset : offset + MAX_HEADER_SIZE], blob=BLOB)
        spans.append((offset, header.blob_length))
        offset += header.blob_length
    return spans


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_large_commit_is_several_parts_that_decode_to_its_records(
    compression: Compression,
) -> None:
    parts = _parts(compression)
    assert len(parts) > 5
    blob = b"".join(parts)
    assert encode_changelog(
        RECORDS, base_version=7, version=8, compression=compression, identity=IDENTITY,
        part_size=4096,
    ) == blob  # fmt: skip
    decoded = decode_changelog(blob, blob=BLOB, expected=(8, IDENTITY))
    assert (decoded.records, decoded.parts) == (RECORDS, len(parts))
    headers = [read_header(p, blob=BLOB) for p in parts]
    # The spans a commit applies locally are the records of each part, in order.
    spans = encode_changelog_parts(
        RECORDS, base_version=7, version=8, compression=compression, identity=IDENTITY,
        part_size=4096,
    ).spans  # fmt: skip
    assert [stop - start for start, stop in spans] == [h.record_count for h in headers]
    assert [s[0] for s in spans] == [0] + [s[1] for s in spans[:-1]]
    assert spans[-1][1] == len(RECORDS)
    assert {h.format_version for h in headers} == {FORMAT_VERSION}
    assert [h.more_parts for h in headers] == [True] * (len(parts) - 1) + [False]
    assert all(h.body_length <= 4096 for h in headers)
    assert sum(h.record_count for h in headers) == len(RECORDS)
    assert {(h.base_version, h.version, h.identity) for h in headers} == {(7, 8, IDENTITY)}


def test_a_commit_that_fits_one_part_is_the_format_2_blob_as_before() -> None:
    small = RECORDS[:10]
    one = encode_changelog(small, base_version=7, version=8, identity=IDENTITY, part_size=4096)
    assert one == encode_changelog(small, base_version=7, version=8, identity=IDENTITY)
    assert read_header(one, blob=BLOB).format_version == SINGLE_PART_FORMAT == 2
    assert one[7] == 0  # no flags


def test_a_record_larger_than_a_part_gets_a_part_of_its_own() -> None:
    records = [(b"a", b"x" * 10), (b"big", b"y" * 500), (b"c", b"z" * 10)]
    parts = list(
        encode_changelog_parts(records, base_version=0, version=1, identity=IDENTITY, part_size=64)
    )
    assert [read_header(p, blob=BLOB).record_count for p in parts] == [1, 1, 1]
    assert decode_changelog(b"".join(parts), blob=BLOB).records == records


def test_format_1_has_one_part_only() -> None:
    with pytest.raises(ValueError, match="format 1 has one part"):
        encode_changelog(RECORDS, base_version=7, version=8, part_size=4096)


@pytest.mark.parametrize("part_size", [63, 2**31 + 1, True])
def test_part_size_is_checked(part_size: int) -> None:
    with pytest.raises((ValueError, TypeError), match="part_size"):
        encode_changelog(RECORDS, base_version=7, version=8, part_size=part_size)


def test_reading_part_by_part_holds_one_part_and_reads_each_once() -> None:
    blob = b"".join(_parts())
    spans = _spans(blob)
    reads: list[tuple[int, int]] = []

    def read(start: int, length: int) -> bytes:
        reads.append((start, length))
        return blob[start : start + length]

    first = blob[:5000]  # what a replay fetched first: the first part and a bit more
    seen = []
    for part in read_changelog(read, blob=BLOB, expected=(8, IDENTITY), first=first):
        seen.extend(part.records)
        assert (part.offset, part.length) == spans[part.index]
    assert seen == RECORDS
    # Every read is at most a part (plus a header), and no byte is read twice but headers.
    largest = max(length for _, length in spans)
    assert all(length <= max(largest, MAX_HEADER_SIZE) for _, length in reads)
    assert sum(length for _, length in reads) <= len(blob) + MAX_HEADER_SIZE * len(spans)


def _chain_crc(parts: list[bytes]) -> list[bytes]:
    """Recompute the chained CRC32Cs of ``parts`` in their new order, as a forger would."""
    out, crc = [], None
    for part in parts:
        head, section_and_body = part[:48], part[HEADER_SIZE:]
        crc = google_crc32c.value(head) if crc is None else google_crc32c.extend(crc, head)
        crc = google_crc32c.extend(crc, section_and_body)
        out.append(head + struct.pack(">I", crc) + section_and_body)
    return out


def test_a_dropped_repeated_or_moved_part_fails_its_checksum() -> None:
    parts = _parts()
    for name, damaged in {
        "dropped": parts[:1] + parts[2:],
        "repeated": parts[:2] + parts[1:],
        "moved": [parts[1], parts[0], *parts[2:]],
    }.items():
        with pytest.raises(CorruptStateError, match="CRC32C mismatch") as info:
            decode_changelog(b"".join(damaged), blob=BLOB)
        assert BLOB in str(info.value), name
    # Each part is still whole: only the chain tells the order.
    assert _chain_crc(parts) == parts


def test_a_blob_cut_at_a_part_boundary_is_truncated() -> None:
    parts = _parts()
    with pytest.raises(CorruptStateError, match="truncated") as info:
        decode_changelog(b"".join(parts[:3]), blob=BLOB)
    assert "part 3" in str(info.value)


def test_bytes_after_the_last_part_are_refused() -> None:
    blob = b"".join(_parts()) + b"\x00"
    with pytest.raises(CorruptStateError, match="trailing bytes"):
        decode_changelog(blob, blob=BLOB)
    # Also when reading by ranges, where the end is found by one more read.
    with pytest.raises(CorruptStateError, match="trailing bytes"):
        list(read_changelog(lambda s, n: blob[s : s + n], blob=BLOB))


def test_a_part_of_another_commit_is_refused() -> None:
    ours = _parts()
    other = list(
        encode_changelog_parts(
            RECORDS, base_version=7, version=8, identity=ChangelogIdentity("root", "op", 0, "b2"),
            part_size=4096,
        )
    )  # fmt: skip
    spliced = _chain_crc([ours[0], other[1], *ours[2:]])
    with pytest.raises(CorruptStateError, match="not of the same commit") as info:
        decode_changelog(b"".join(spliced), blob=BLOB)
    assert "attempt b2" in str(info.value)
    assert "attempt a1" in str(info.value)


def test_a_single_part_format_cannot_claim_more_parts() -> None:
    one = bytearray(encode_changelog(RECORDS[:3], base_version=7, version=8, identity=IDENTITY))
    one[7] = 1
    with pytest.raises(CorruptStateError, match="reserved flags set"):
        read_header(bytes(one), blob=BLOB)


def test_a_later_part_must_be_format_3() -> None:
    parts = _parts()
    second = bytearray(parts[1])
    second[4:6] = (2).to_bytes(2, "big")
    with pytest.raises(CorruptStateError, match="format version of a later part"):
        decode_changelog(b"".join(_chain_crc([parts[0], bytes(second), *parts[2:]])), blob=BLOB)
