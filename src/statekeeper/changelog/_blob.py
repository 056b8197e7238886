"""Encode and decode whole changelog blobs: envelope, compression, checksum, records.

The byte layout is specified in the :mod:`statekeeper.changelog` package docstring.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Final

import google_crc32c
import zstandard

from statekeeper.changelog._header import (
    CODEC_IDS,
    CRC,
    FORMAT_VERSION,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_BODY_LENGTH,
    MAX_UINT64,
    ChangelogHeader,
    ChangelogIdentity,
    check_header,
    check_identity,
    corrupt,
    encode_identity,
    header_length,
    parse_identity,
    unpack_header,
)
from statekeeper.changelog._records import Record, Records, decode_records, encode_records
from statekeeper.config import Compression

__all__ = ["Changelog", "decode_changelog", "encode_changelog"]

_FORMAT_1: Final = 1

# zstd's own bounds (ZSTD_minCLevel() is -ZSTD_TARGETLENGTH_MAX); it silently clamps others.
_MIN_LEVEL: Final = -zstandard.TARGETLENGTH_MAX
_MAX_LEVEL: Final = zstandard.MAX_COMPRESSION_LEVEL

# A ZstdCompressor must not be used by two threads at once, and building one per call costs
# ~0.7 ms (a tenth of compressing a 10k-record commit), so each thread keeps its own per level.
_local = threading.local()


@dataclass(frozen=True, slots=True)
class Changelog:
    """A decoded, verified changelog blob.

    Attributes:
        header: the envelope header.
        records: ``(key, value)`` pairs in commit order; a value of ``None`` is a delete,
            ``b""`` is a put of the empty value.
    """

    header: ChangelogHeader
    records: list[Record]


def encode_changelog(
    records: Records,
    *,
    base_version: int,
    version: int,
    compression: Compression = "zstd",
    level: int = 3,
    identity: ChangelogIdentity | None = None,
) -> bytes:
    """Encode the puts and deletes of one commit as a changelog blob.

    Records are written in iteration order; a key may appear more than once (the last one
    wins on replay). With ``identity`` the blob is written in format version 2 and names the
    root, store and attempt it belongs to (what every commit of a store writes); without,
    in format version 1, as statekeeper 0.1 wrote it (for tools and tests of old roots).

    Args:
        records: ``(key, value)`` pairs or a mapping of key to value; a value of ``None`` is
            a delete. Keys and values may be bytes, bytearray or memoryview.
        base_version: the store version the changes apply to.
        version: the store version they create; greater than ``base_version``.
        compression: how to store the body, ``"zstd"`` (default) or ``"none"``.
        level: zstd compression level (ignored for ``"none"``, but still checked).
        identity: the root, store and attempt the blob belongs to.

    Returns:
        The complete blob: header, CRC32C and stored body.

    Raises:
        TypeError: a version or level is not an int, ``compression`` is not a str, an item
            is not a (key, value) pair, a key or value is not bytes-like, or an identity
            field is of the wrong type.
        ValueError: a version is outside ``[0, 2**64 - 1]``, ``version <= base_version``,
            an unknown compression or a level outside zstd's range, an empty key, a key
            or value too long, a body longer than :data:`MAX_BODY_LENGTH`, or an identity
            string longer than 255 bytes.
    """
    section = b"" if identity is None else encode_identity(identity)
    base_version = _check_version("base_version", base_version)
    version = _check_version("version", version)
    if version <= base_version:
        raise ValueError(
            f"version must be greater than base_version {base_version}: "
            f"expected > {base_version}, found {version}"
        )
    codec_id = _check_codec(compression, level)
    body, count = encode_records(records)
    if len(body) > MAX_BODY_LENGTH:
        raise ValueError(
            f"changelog body too large: expected <= {MAX_BODY_LENGTH} bytes, found "
            f"{len(body)} ({count} records); commit fewer changes per version"
        )
    stored = bytes(body) if compression == "none" else _compressor(level).compress(body)
    fmt = _FORMAT_1 if identity is None else FORMAT_VERSION
    head = HEADER.pack(
        MAGIC, fmt, codec_id, 0, base_version, version, count, len(body), len(stored)
    )
    # The CRC32C covers every byte of the blob but its own field.
    crc = google_crc32c.extend(google_crc32c.extend(google_crc32c.value(head), section), stored)
    return b"".join((head, CRC.pack(crc), section, stored))


def decode_changelog(
    data: bytes | bytearray | memoryview,
    *,
    blob: str,
    expected: tuple[int, ChangelogIdentity] | None = None,
    anonymous_ok: bool = False,
) -> Changelog:
    """Verify and decode a changelog blob.

    Every byte is checked before any record is returned: the stored length, the CRC32C
    over header, identity and stored body, the decompressed length, and the record
    framing; with ``expected``, also that the blob is what its name says it is.

    Args:
        data: the complete blob.
        blob: name of the blob, used in error messages.
        expected: the version and identity the reader expects under ``blob`` (from the
            manifest entry or the key it read); see :func:`check_identity`.
        anonymous_ok: whether a format-1 blob (no identity) is accepted as ``expected``.

    Returns:
        The header and the records in commit order.

    Raises:
        CorruptStateError: naming ``blob`` and saying what was expected and what was
            found, if the blob is too short, has the wrong magic, an unknown format
            version (written by a newer statekeeper) or compression codec, is truncated or
            followed by extra bytes, fails its CRC32C, does not decompress to the declared
            length, or its records do not match their framing or the header's count; or
            it is not what ``expected`` says (another root, store, version or attempt).
    """
    if not isinstance(data, bytes):
        data = bytes(memoryview(data).cast("B"))
    fields = unpack_header(data, blob)
    head_length = header_length(data, fields[1], blob)
    stored_length = fields[8]
    if len(data) != head_length + stored_length:
        total = head_length + stored_length
        what = "blob truncated" if len(data) < total else "trailing bytes after the body"
        wanted = f"{total} bytes ({head_length}-byte header + {stored_length}-byte body)"
        raise corrupt(blob, what, wanted, f"{len(data)} bytes")
    (expected_crc,) = CRC.unpack_from(data, HEADER.size)
    actual_crc = google_crc32c.extend(google_crc32c.value(data[: HEADER.size]), data[HEADER_SIZE:])
    if actual_crc != expected_crc:
        raise corrupt(blob, "CRC32C mismatch", f"{expected_crc:#010x}", f"{actual_crc:#010x}")
    header = check_header(fields, blob, parse_identity(data, fields[1], blob), head_length)
    if expected is not None:
        check_identity(
            header, blob=blob, version=expected[0], expected=expected[1], anonymous_ok=anonymous_ok
        )
    stored = data[head_length:]
    body = stored
    if header.compression == "zstd":
        body = _decompress(stored, header.body_length, blob)
    return Changelog(header, decode_records(body, header.record_count, blob))


def _check_version(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, found {type(value).__name__}")
    if not 0 <= value <= MAX_UINT64:
        raise ValueError(f"{name} must be in [0, 2**64 - 1], found {value}")
    return value


def _check_codec(compression: object, level: object) -> int:
    if not isinstance(compression, str):
        raise TypeError(f"compression must be a str, found {type(compression).__name__}")
    codec_id = CODEC_IDS.get(compression)
    if codec_id is None:
        raise ValueError(f"compression must be one of {sorted(CODEC_IDS)}, found {compression!r}")
    if isinstance(level, bool) or not isinstance(level, int):
        raise TypeError(f"level must be an int, found {type(level).__name__}")
    if not _MIN_LEVEL <= level <= _MAX_LEVEL:
        raise ValueError(f"level must be in [{_MIN_LEVEL}, {_MAX_LEVEL}], found {level}")
    return codec_id


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    compressor = cache.get(level)
    if compressor is None:
        # write_content_size (the default) records the body length in the frame header,
        # which lets the reader check it before allocating anything.
        compressor = cache[level] = zstandard.ZstdCompressor(level=level)
    return compressor


def _decompress(stored: bytes, body_length: int, blob: str) -> bytes:
    # Memory stays bounded by body_length (<= MAX_BODY_LENGTH, checked by check_header, and
    # >= 4 so never 0, which zstandard would read as "no limit"): the frame's own content
    # size, which zstandard would otherwise allocate, must agree with it first.
    try:
        content_size = zstandard.frame_content_size(stored)
        # frame_content_size() returns -1 when the frame does not record its size.
        if content_size not in (-1, body_length):
            raise corrupt(blob, "zstd frame content size", body_length, content_size)
        body = zstandard.ZstdDecompressor().decompress(
            stored, max_output_size=body_length, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        raise corrupt(blob, "zstd body", "one complete zstd frame", f"error: {exc}") from exc
    if len(body) != body_length:
        raise corrupt(blob, "uncompressed body length", f"{body_length} bytes", len(body))
    return body
