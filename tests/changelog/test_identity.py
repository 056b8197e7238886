"""Format 2 changelog headers: the identity section, its checksum, and the identity check."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import google_crc32c
import pytest

from statekeeper.changelog import (
    HEADER_SIZE,
    MAX_HEADER_SIZE,
    SINGLE_PART_FORMAT,
    ChangelogHeader,
    ChangelogIdentity,
    check_identity,
    decode_changelog,
    encode_changelog,
    read_header,
)
from statekeeper.errors import CorruptStateError

BLOB = "sessions/3/changelog/00000000000000000006-a1.changelog"
RECORDS: list[tuple[bytes, bytes | None]] = [(b"a", b"xy"), (b"bc", None), (b"d", b"")]
IDENTITY = ChangelogIdentity(root_id="r00t", operator="sessions", partition=3, attempt="a1")
# The body of RECORDS, framed by hand: put a=xy, delete bc, put d="", end marker.
BODY = bytes.fromhex(
    "00000001 61 00000002 7879 00000002 6263 ffffffff 00000001 64 00000000 ffffffff"
)


def golden_v2() -> bytes:
    """base 5 -> version 6 of IDENTITY, uncompressed: every byte by hand, per docs/format.md."""
    identity = (
        b"\x04r00t" + b"\x08sessions" + struct.pack(">I", 3) + b"\x02a1"
    )  # u8-prefixed strings, uint32 partition
    section = struct.pack(">H", len(identity)) + identity
    head = struct.pack(">4sHBBQQQQQ", b"SKCL", 2, 0, 0, 5, 6, 3, len(BODY), len(BODY))
    crc = google_crc32c.value(head + section + BODY)  # every byte but the CRC field
    return head + struct.pack(">I", crc) + section + BODY


def encode(**overrides: object) -> bytes:
    args: dict[str, object] = {
        "base_version": 5, "version": 6, "compression": "none", "identity": IDENTITY,
    }  # fmt: skip
    args.update(overrides)
    return encode_changelog(RECORDS, **args)  # type: ignore[arg-type]


def test_encoder_writes_the_documented_format_2_bytes() -> None:
    assert encode() == golden_v2()
    decoded = decode_changelog(golden_v2(), blob=BLOB)
    assert decoded.records == RECORDS
    header = decoded.header
    assert (header.format_version, header.identity) == (SINGLE_PART_FORMAT, IDENTITY)
    assert header.header_length == HEADER_SIZE + 2 + 21
    assert header.blob_length == len(golden_v2())


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_read_header_reads_the_identity_from_a_prefix(compression: str) -> None:
    blob = encode(compression=compression) + b""
    header = read_header(blob[:MAX_HEADER_SIZE], blob=BLOB)
    assert header == decode_changelog(blob, blob=BLOB).header
    assert header.identity == IDENTITY
    assert header.blob_length == len(blob)
    with pytest.raises(CorruptStateError, match="too short for the identity section"):
        read_header(blob[: header.header_length - 1], blob=BLOB)


def test_every_bit_of_the_identity_is_covered_by_the_crc() -> None:
    blob = golden_v2()
    for offset in range(HEADER_SIZE, HEADER_SIZE + 2 + 21):
        damaged = bytearray(blob)
        damaged[offset] ^= 0x01
        with pytest.raises(CorruptStateError, match=re.escape(BLOB)):
            decode_changelog(bytes(damaged), blob=BLOB)


def test_malformed_identity_sections_are_refused_even_with_a_good_crc() -> None:
    def rebuilt(identity: bytes, declared: int | None = None) -> bytes:
        section = struct.pack(">H", len(identity) if declared is None else declared) + identity
        head = struct.pack(">4sHBBQQQQQ", b"SKCL", 2, 0, 0, 5, 6, 3, len(BODY), len(BODY))
        crc = google_crc32c.value(head + section + BODY)
        return head + struct.pack(">I", crc) + section + BODY

    good = b"\x04r00t\x08sessions" + struct.pack(">I", 3) + b"\x02a1"
    with pytest.raises(CorruptStateError, match="identity section"):
        decode_changelog(rebuilt(good + b"\x00"), blob=BLOB)  # a byte no field claims
    with pytest.raises(CorruptStateError, match="identity section"):
        decode_changelog(rebuilt(b"\x09r00t"), blob=BLOB)  # a string past the section
    with pytest.raises(CorruptStateError, match="identity section"):
        decode_changelog(rebuilt(b"\x02\xff\xfe" + good[5:]), blob=BLOB)  # not UTF-8
    with pytest.raises(CorruptStateError, match="identity section length"):
        decode_changelog(rebuilt(good, declared=60000), blob=BLOB)


def test_format_1_blobs_still_decode() -> None:
    blob = encode(identity=None)
    decoded = decode_changelog(blob, blob=BLOB)
    assert decoded.header.format_version == 1
    assert decoded.header.identity is None
    assert decoded.header == ChangelogHeader(1, "none", 5, 6, 3, len(BODY), len(BODY))
    assert decoded.records == RECORDS


OTHERS = {
    "root": ChangelogIdentity("other", "sessions", 3, "a1"),
    "operator": ChangelogIdentity("r00t", "clicks", 3, "a1"),
    "partition": ChangelogIdentity("r00t", "sessions", 1, "a1"),
    "attempt": ChangelogIdentity("r00t", "sessions", 3, "b2"),
}


@pytest.mark.parametrize("field", OTHERS)
def test_a_blob_of_another_identity_is_refused_naming_both(field: str) -> None:
    expected = OTHERS[field]
    with pytest.raises(CorruptStateError) as info:
        decode_changelog(encode(), blob=BLOB, expected=(6, expected))
    message = str(info.value)
    assert BLOB in message
    assert f"expected {expected.describe(6)}" in message, message
    assert f"found {IDENTITY.describe(6)}" in message, message
    decode_changelog(encode(), blob=BLOB, expected=(6, IDENTITY))  # its own passes


def test_a_blob_of_another_version_is_refused_naming_both() -> None:
    with pytest.raises(CorruptStateError) as info:
        decode_changelog(encode(base_version=6, version=7), blob=BLOB, expected=(6, IDENTITY))
    assert "expected root r00t, store sessions/3, version 6" in str(info.value)
    assert "found root r00t, store sessions/3, version 7" in str(info.value)
    with pytest.raises(CorruptStateError, match="from version 4"):
        decode_changelog(encode(base_version=4), blob=BLOB, expected=(6, IDENTITY))


def test_a_format_1_blob_is_accepted_only_where_one_is_expected() -> None:
    old = encode(identity=None)
    assert decode_changelog(old, blob=BLOB, expected=(6, IDENTITY), anonymous_ok=True).records
    with pytest.raises(CorruptStateError, match="format-1 changelog without identity"):
        decode_changelog(old, blob=BLOB, expected=(6, IDENTITY))
    with pytest.raises(CorruptStateError, match="version 6"):  # its versions still count
        decode_changelog(old, blob=BLOB, expected=(7, IDENTITY), anonymous_ok=True)
    # A format-2 blob never stands in for a format-1 one: its attempt is not the expected.
    legacy = ChangelogIdentity("r00t", "sessions", 3, "format1")
    with pytest.raises(CorruptStateError, match="attempt a1"):
        decode_changelog(encode(), blob=BLOB, expected=(6, legacy), anonymous_ok=True)


def test_check_identity_works_on_a_header_read_alone() -> None:
    header = read_header(encode()[:MAX_HEADER_SIZE], blob=BLOB)
    check_identity(header, blob=BLOB, version=6, expected=IDENTITY, anonymous_ok=False)
    with pytest.raises(CorruptStateError, match="store sessions/1"):
        check_identity(
            header, blob=BLOB, version=6, expected=OTHERS["partition"], anonymous_ok=False
        )


@pytest.mark.parametrize(
    ("identity", "error"),
    [
        (ChangelogIdentity("r" * 256, "op", 0, "a"), ValueError),
        (ChangelogIdentity("r", "op", 2**32, "a"), ValueError),
        (ChangelogIdentity("r", "op", -1, "a"), ValueError),
        (ChangelogIdentity("r", "op", True, "a"), TypeError),
        (ChangelogIdentity("r", 7, 0, "a"), TypeError),  # type: ignore[arg-type]
    ],
)
def test_encode_refuses_a_bad_identity(identity: ChangelogIdentity, error: type) -> None:
    with pytest.raises(error, match="identity"):
        encode(identity=identity)


def test_format_doc_states_the_identity_bounds() -> None:
    text = (Path(__file__).parents[2] / "docs" / "format.md").read_text()
    section = text.split("## Changelog blob", 1)[1].split("\n## ", 1)[0]
    assert f"at most {MAX_HEADER_SIZE - HEADER_SIZE - 2})" in section
    assert f"at most {MAX_HEADER_SIZE} bytes" in section
    assert "| 52 | 2 | formats 2 and 3: identity length" in section
