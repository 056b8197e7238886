"""Tests of the changelog blob codec: round trips, the golden layout, every corruption."""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import google_crc32c
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

import statekeeper.changelog as cl
from statekeeper.changelog import (
    FORMAT_VERSION,
    HEADER_SIZE,
    Changelog,
    ChangelogHeader,
    decode_changelog,
    encode_changelog,
    read_header,
)
from statekeeper.config import Compression
from statekeeper.errors import CorruptStateError

BLOB = "sessions/3/changelog/00000000000000000006.changelog"
# The header layout, written out independently of the codec so that it cannot drift.
HEADER_FMT = ">4sHBBQQQQQ"
RECORDS: list[tuple[bytes, bytes | None]] = [(b"a", b"xy"), (b"bc", None), (b"d", b"")]

# base 5 -> version 6, three records, uncompressed: every field by hand.
GOLDEN = bytes.fromhex(
    "534b434c"  # magic "SKCL"
    "0001"  # format version 1
    "00"  # codec 0: none
    "00"  # reserved flags
    "0000000000000005"  # base version
    "0000000000000006"  # version
    "0000000000000003"  # record count
    "0000000000000022"  # uncompressed body length (34)
    "0000000000000022"  # stored body length (34)
    "bfd08ed9"  # CRC32C of the 48 bytes above and the body below
    "00000001"
    "61"
    "00000002"
    "7879"  # put b"a" = b"xy"
    "00000002"
    "6263"
    "ffffffff"  # delete b"bc"
    "00000001"
    "64"
    "00000000"  # put b"d" = b""
    "ffffffff"  # end marker
)
# The same changelog with codec 1; the body is one zstd frame (content size 34).
GOLDEN_ZSTD = bytes.fromhex(
    "534b434c000101000000000000000005000000000000000600000000000000030000000000000022"
    "000000000000002b8e23fc9328b52ffd20221101000000000161000000027879000000026263ffff"
    "ffff000000016400000000ffffffff"
)

# No example database (it would be written into the repository; no deadline for any
# property test: tests/conftest.py).
quiet = settings(database=None)
keys = st.binary(min_size=1, max_size=40)
values = st.one_of(st.none(), st.binary(max_size=200))
record_lists = st.lists(st.tuples(keys, values), max_size=60)
compressions = st.sampled_from(["none", "zstd"])


def int32(n: int) -> bytes:
    return struct.pack(">i", n)


def envelope(
    stored: bytes,
    *,
    count: int,
    body_length: int | None = None,
    codec: int = 0,
    fmt: int = 1,
    flags: int = 0,
    base: int = 0,
    version: int = 1,
) -> bytes:
    """A blob with a correct CRC32C around ``stored``, built without the codec."""
    length = len(stored) if body_length is None else body_length
    head = struct.pack(
        HEADER_FMT, b"SKCL", fmt, codec, flags, base, version, count, length, len(stored)
    )
    crc = google_crc32c.value(head + stored)
    return head + struct.pack(">I", crc) + stored


def put(key: bytes, value: bytes) -> bytes:
    return int32(len(key)) + key + int32(len(value)) + value


def expect_corrupt(data: bytes, *fragments: str) -> CorruptStateError:
    with pytest.raises(CorruptStateError, match=re.escape(BLOB)) as info:
        decode_changelog(data, blob=BLOB)
    for fragment in fragments:
        assert fragment in str(info.value)
    return info.value


# --- round trips -------------------------------------------------------------------------


@quiet
@given(
    records=record_lists,
    compression=compressions,
    base=st.integers(0, 2**64 - 2),
    step=st.integers(1, 1000),
)
def test_round_trip(
    records: list[tuple[bytes, bytes | None]], compression: Compression, base: int, step: int
) -> None:
    version = min(base + step, 2**64 - 1)
    blob = encode_changelog(
        records,
        base_version=base,
        version=version,
        compression=compression,
    )
    decoded = decode_changelog(blob, blob=BLOB)
    assert decoded.records == records
    body_length = 4 + sum(8 + len(k) + (len(v) if v is not None else 0) for k, v in records)
    expected = ChangelogHeader(
        format_version=1,  # no identity: written as statekeeper 0.1 did
        compression=compression,
        base_version=base,
        version=version,
        record_count=len(records),
        body_length=body_length,
        stored_length=len(blob) - HEADER_SIZE,
    )
    assert decoded.header == expected
    assert read_header(blob, blob=BLOB) == expected
    assert expected.blob_length == len(blob)


def test_golden_bytes_encode_and_decode() -> None:
    assert google_crc32c.value(GOLDEN[:48] + GOLDEN[HEADER_SIZE:]) == 0xBFD08ED9
    assert encode_changelog(RECORDS, base_version=5, version=6, compression="none") == GOLDEN
    decoded = decode_changelog(GOLDEN, blob=BLOB)
    assert decoded == Changelog(
        ChangelogHeader(1, "none", 5, 6, 3, 34, 34), [(b"a", b"xy"), (b"bc", None), (b"d", b"")]
    )


def test_golden_zstd_decodes() -> None:
    decoded = decode_changelog(GOLDEN_ZSTD, blob=BLOB)
    assert decoded.records == RECORDS
    assert decoded.header == ChangelogHeader(1, "zstd", 5, 6, 3, 34, 43)
    assert decode_changelog(encode_changelog(RECORDS, base_version=5, version=6), blob=BLOB) == (
        decoded
    )


def test_checksum_is_crc32c_castagnoli() -> None:
    assert google_crc32c.value(b"123456789") == 0xE3069283


def test_public_names() -> None:
    assert cl.__all__ == [
        "FORMAT_VERSION",
        "HEADER_SIZE",
        "MAGIC",
        "MAX_BODY_LENGTH",
        "MAX_HEADER_SIZE",
        "MAX_ITEM_LENGTH",
        "MIN_PART_SIZE",
        "SINGLE_PART_FORMAT",
        "Changelog",
        "ChangelogHeader",
        "ChangelogIdentity",
        "ChangelogPart",
        "ChangelogParts",
        "Columns",
        "check_identity",
        "decode_changelog",
        "encode_changelog",
        "encode_changelog_parts",
        "part_headers",
        "read_changelog",
        "read_header",
    ]
    assert (FORMAT_VERSION, cl.SINGLE_PART_FORMAT, HEADER_SIZE, cl.MAGIC) == (3, 2, 52, b"SKCL")
    assert cl.MAX_HEADER_SIZE == 52 + 2 + 3 * 256 + 4


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_mapping_and_empty_changelog(compression: Compression) -> None:
    mapping = {b"k1": b"v1", b"k2": None, b"k3": b""}
    blob = encode_changelog(mapping, base_version=0, version=1, compression=compression)
    assert decode_changelog(blob, blob=BLOB).records == list(mapping.items())
    empty = encode_changelog([], base_version=7, version=8, compression=compression)
    decoded = decode_changelog(empty, blob=BLOB)
    assert decoded.records == []
    assert (decoded.header.record_count, decoded.header.body_length) == (0, 4)


def test_duplicates_kept_in_order_and_empty_value_is_not_delete() -> None:
    records = [(b"k", b"1"), (b"k", None), (b"k", b""), (b"k", b"2")]
    decoded = decode_changelog(encode_changelog(records, base_version=0, version=1), blob=BLOB)
    assert decoded.records == records
    assert decoded.records[2][1] == b""
    assert decoded.records[1][1] is None


def test_bytes_like_inputs_are_converted() -> None:
    records: list[tuple[bytes | bytearray | memoryview, bytes | bytearray | memoryview]] = [
        (bytearray(b"k1"), memoryview(b"v1")),
        (memoryview(b"k2"), bytearray(b"")),
    ]
    blob = encode_changelog(records, base_version=0, version=1)
    decoded = decode_changelog(bytearray(blob), blob=BLOB)
    assert decoded.records == [(b"k1", b"v1"), (b"k2", b"")]
    assert all(type(k) is bytes and type(v) is bytes for k, v in decoded.records)
    assert decode_changelog(memoryview(blob), blob=BLOB) == decoded
    wide = memoryview(bytearray(blob)).cast("H") if len(blob) % 2 == 0 else memoryview(blob)
    assert decode_changelog(wide, blob=BLOB) == decoded


def test_encode_from_many_threads_matches_single_thread() -> None:
    batches = [[(b"key-%d-%d" % (t, i), b"v" * (i % 50)) for i in range(500)] for t in range(16)]
    expected = [encode_changelog(b, base_version=t, version=t + 1) for t, b in enumerate(batches)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        for _ in range(5):
            blobs = list(
                pool.map(
                    lambda tb: encode_changelog(tb[1], base_version=tb[0], version=tb[0] + 1),
                    enumerate(batches),
                )
            )
            assert blobs == expected
    assert [decode_changelog(b, blob=BLOB).records for b in expected] == batches


def test_read_header_needs_only_the_header_and_skips_the_crc() -> None:
    assert read_header(GOLDEN[:HEADER_SIZE], blob=BLOB) == ChangelogHeader(
        1, "none", 5, 6, 3, 34, 34
    )
    damaged = GOLDEN[:-1] + b"\x00"
    assert read_header(damaged, blob=BLOB).record_count == 3
    expect_corrupt(damaged, "CRC32C mismatch")
    with pytest.raises(CorruptStateError, match="too short"):
        read_header(GOLDEN[: HEADER_SIZE - 1], blob=BLOB)


# --- corruption --------------------------------------------------------------------------


@settings(quiet, max_examples=300)
@given(records=record_lists, compression=compressions, data=st.data())
def test_any_flipped_bit_is_detected(
    records: list[tuple[bytes, bytes | None]], compression: Compression, data: st.DataObject
) -> None:
    blob = bytearray(encode_changelog(records, base_version=3, version=4, compression=compression))
    bit = data.draw(st.integers(0, len(blob) * 8 - 1), label="bit")
    blob[bit // 8] ^= 1 << (bit % 8)
    expect_corrupt(bytes(blob))


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_every_truncation_and_extension_is_detected(compression: Compression) -> None:
    records = [(b"key-%d" % i, None if i % 3 == 0 else b"value-%d" % i) for i in range(20)]
    blob = encode_changelog(records, base_version=1, version=2, compression=compression)
    for length in range(len(blob)):
        expect_corrupt(blob[:length])
    for extra in (b"\x00", b"SKCL", blob):
        expect_corrupt(blob + extra, "trailing bytes", f"expected {len(blob)} bytes")
    expect_corrupt(blob[:-1], "truncated", f"found {len(blob) - 1} bytes")


def test_header_identity_checks() -> None:
    expect_corrupt(b"", "too short", f">= {HEADER_SIZE} bytes", "found 0")
    expect_corrupt(b"PK\x03\x04" + GOLDEN[4:], "bad magic", "b'SKCL'", "b'PK\\x03\\x04'")
    bad_crc = GOLDEN[:48] + b"\x00\x00\x00\x00" + GOLDEN[HEADER_SIZE:]
    expect_corrupt(bad_crc, "CRC32C mismatch", "expected 0x00000000", "found 0xbfd08ed9")


@pytest.mark.parametrize("read", [decode_changelog, read_header])
def test_newer_format_version_is_refused(read: Callable[..., object]) -> None:
    blob = envelope(int32(-1), count=0, fmt=4)
    with pytest.raises(CorruptStateError, match=re.escape(BLOB)) as info:
        read(blob, blob=BLOB)
    assert "written by a newer statekeeper" in str(info.value)
    assert "expected <= 3, found 4" in str(info.value)
    with pytest.raises(CorruptStateError, match="unknown format version"):
        read(envelope(int32(-1), count=0, fmt=0), blob=BLOB)


HEADER_CASES = {
    "unknown codec": (dict(codec=7), "unknown compression codec id", "found 7"),
    "flags set": (dict(flags=0x80), "reserved flags set", "expected 0, found 128"),
    "version == base": (dict(base=4, version=4), "version not after base", "> 4, found 4"),
    "version < base": (dict(base=9, version=2), "version not after base", "> 9, found 2"),
    "count too big for body": (dict(count=2**63), "too short for 9223372036854775808 records"),
    "declared body above limit": (
        dict(codec=1, body_length=2**31 + 1),
        "uncompressed body too large",
        f"expected <= {2**31}, found {2**31 + 1}",
    ),
    "body shorter than end marker": (dict(body_length=3, codec=1), "too short for 0 records"),
    "raw body length differs": (dict(body_length=5), "stored length of an uncompressed body"),
}


@pytest.mark.parametrize("case", HEADER_CASES.values(), ids=HEADER_CASES.keys())
def test_header_field_checks(case: tuple[dict[str, int], str, str]) -> None:
    fields, *fragments = case
    fields = {"count": 0, **fields}
    blob = envelope(int32(-1), **fields)
    expect_corrupt(blob, *fragments)
    with pytest.raises(CorruptStateError, match=re.escape(fragments[0])):
        read_header(blob, blob=BLOB)


def test_zstd_failures() -> None:
    body = put(b"key", b"value") + int32(-1)
    frame = zstandard.ZstdCompressor().compress(body)
    assert decode_changelog(envelope(frame, count=1, codec=1, body_length=len(body)), blob=BLOB)
    expect_corrupt(envelope(b"not zstd at all", count=1, codec=1, body_length=20), "zstd body")
    expect_corrupt(envelope(frame[:-2], count=1, codec=1, body_length=len(body)), "zstd body")
    expect_corrupt(envelope(frame + b"!", count=1, codec=1, body_length=len(body)), "zstd body")
    lying = envelope(frame, count=1, codec=1, body_length=len(body) + 4)
    expect_corrupt(lying, "zstd frame content size", f"expected {len(body) + 4}")


def test_zstd_frame_without_content_size_is_bounded_by_the_header() -> None:
    body = put(b"key", b"value") + int32(-1)
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(body)
    assert zstandard.frame_content_size(frame) == -1
    ok = envelope(frame, count=1, codec=1, body_length=len(body))
    assert decode_changelog(ok, blob=BLOB).records == [(b"key", b"value")]
    longer = envelope(frame, count=1, codec=1, body_length=len(body) + 10)
    expect_corrupt(longer, "uncompressed body length", f"expected {len(body) + 10} bytes")
    expect_corrupt(envelope(frame, count=1, codec=1, body_length=len(body) - 1), "zstd body")


FRAMING_CASES = {
    "value length below -1": (
        int32(1) + b"k" + int32(-2) + int32(-1),
        1,
        "value length of record 0",
        "found -2",
    ),
    "end marker before count": (put(b"k", b"v") + int32(-1) + b"\x00" * 9, 2, "end marker after 1"),
    "empty key": (int32(0) + int32(1) + b"v" + int32(-1) + b"\x00" * 3, 1, "found 0"),
    "negative key length": (int32(-5) + b"\x00" * 9, 1, "key length of record 0", "found -5"),
    "missing end marker": (put(b"key", b"value"), 1, "runs past the end", "offset 16"),
    "key past the body": (int32(100) + b"k" * 20, 1, "runs past the end"),
    "value past the body": (int32(1) + b"k" + int32(100) + b"v" * 20, 1, "runs past the end"),
    "more records than count": (
        put(b"k1", b"v") + put(b"k2", b"v") + int32(-1),
        1,
        "end marker after 1 records",
        "found 2",
    ),
    "bytes after end marker": (
        put(b"k", b"v") + int32(-1) + b"\x00\x01",
        1,
        "bytes after the end marker",
        "found 2 at offset 14",
    ),
}


@pytest.mark.parametrize("compression", [0, 1])
@pytest.mark.parametrize("case", FRAMING_CASES.values(), ids=FRAMING_CASES.keys())
def test_record_framing_checks(case: tuple[bytes, int, str], compression: int) -> None:
    body, count, *fragments = case
    stored = body if compression == 0 else zstandard.ZstdCompressor().compress(body)
    blob = envelope(stored, count=count, codec=compression, body_length=len(body))
    read_header(blob, blob=BLOB)  # the header alone is fine: only the records are wrong
    expect_corrupt(blob, *fragments)


# --- bad input to encode -----------------------------------------------------------------

ENCODE_ERRORS: list[tuple[object, dict[str, object], type[Exception], str]] = [
    ([("k", b"v")], {}, TypeError, "record 0: key must be bytes, bytearray, memoryview, found str"),
    ([(b"k", b"v"), (b"k", 1)], {}, TypeError, "record 1: value must be bytes"),
    ([(b"k", b"v", b"x")], {}, TypeError, "expected a (key, value) pair, found tuple"),
    ([None], {}, TypeError, "expected a (key, value) pair, found NoneType"),
    ([(b"", b"v")], {}, ValueError, "record 0: key length must be in [1, 2147483646], found 0"),
    ([], {"version": 1.0}, TypeError, "version must be an int, found float"),
    ([], {"base_version": True}, TypeError, "base_version must be an int, found bool"),
    ([], {"base_version": -1}, ValueError, "base_version must be in [0, 2**64 - 1], found -1"),
    ([], {"version": 2**64}, ValueError, "found 18446744073709551616"),
    ([], {"version": 0}, ValueError, "expected > 0, found 0"),
    ([], {"base_version": 5, "version": 3}, ValueError, "expected > 5, found 3"),
    ([], {"compression": "gzip"}, ValueError, "one of ['none', 'zstd'], found 'gzip'"),
    ([], {"compression": None}, TypeError, "compression must be a str, found NoneType"),
    ([], {"level": 23}, ValueError, "level must be in [-131072, 22], found 23"),
    ([], {"level": "3"}, TypeError, "level must be an int, found str"),
]


@pytest.mark.parametrize(("records", "kwargs", "error", "message"), ENCODE_ERRORS)
def test_encode_refuses_bad_input(
    records: object, kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    arguments: dict[str, object] = {"base_version": 0, "version": 1, **kwargs}
    with pytest.raises(error, match=re.escape(message)):
        encode_changelog(records, **arguments)  # type: ignore[arg-type]
