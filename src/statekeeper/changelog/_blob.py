"""Encode and decode whole changelog blobs: envelope, compression, checksum, records.

The byte layout is specified in the :mod:`statekeeper.changelog` package docstring.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
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
    MAX_HEADER_SIZE,
    MAX_UINT64,
    MORE_PARTS,
    SINGLE_PART_FORMAT,
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
from statekeeper.changelog._records import Columns, Record, Records, decode_records
from statekeeper.config import Compression
from statekeeper.phases import phase

__all__ = [
    "MIN_PART_SIZE",
    "Changelog",
    "ChangelogPart",
    "ChangelogParts",
    "decode_changelog",
    "encode_changelog",
    "encode_changelog_parts",
    "read_changelog",
]

_FORMAT_1: Final = 1
MIN_PART_SIZE: Final = 64
"""The smallest ``part_size`` an encoder takes (tests use small parts; commits use MiBs)."""

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
        header: the envelope header (of the first part, for a blob of several).
        records: ``(key, value)`` pairs in commit order; a value of ``None`` is a delete,
            ``b""`` is a put of the empty value.
        parts: how many parts the blob holds (format 3); 1 for formats 1 and 2.
    """

    header: ChangelogHeader
    records: list[Record]
    parts: int = 1


@dataclass(frozen=True, slots=True)
class ChangelogPart:
    """One verified part of a changelog blob, as :func:`read_changelog` yields it.

    Attributes:
        header: the part's header (record count and lengths are the part's).
        records: the part's records, in commit order.
        index: 0 for the first part.
        offset: where the part starts in the blob.
        length: the part's length in bytes (header and stored body).
    """

    header: ChangelogHeader
    records: list[Record]
    index: int
    offset: int
    length: int

    @property
    def last(self) -> bool:
        """True for the blob's last part."""
        return not self.header.more_parts


def encode_changelog(
    records: Records | Columns,
    *,
    base_version: int,
    version: int,
    compression: Compression = "zstd",
    level: int = 3,
    identity: ChangelogIdentity | None = None,
    part_size: int = MAX_BODY_LENGTH,
) -> bytes:
    """Encode the puts and deletes of one commit as a changelog blob.

    Records are written in iteration order; a key may appear more than once (the last one
    wins on replay). With ``identity`` the blob is written in format version 2 and names the
    root, store and attempt it belongs to (what every commit of a store writes), or in format
    3, as several parts, if the records frame to more than ``part_size`` bytes; without, in
    format version 1, as statekeeper 0.1 wrote it (for tools and tests of old roots).
    :func:`encode_changelog_parts` yields the same bytes a part at a time.

    Args:
        records: ``(key, value)`` pairs or a mapping of key to value; a value of ``None`` is
            a delete. Keys and values may be bytes, bytearray or memoryview.
        base_version: the store version the changes apply to.
        version: the store version they create; greater than ``base_version``.
        compression: how to store the body, ``"zstd"`` (default) or ``"none"``.
        level: zstd compression level (ignored for ``"none"``, but still checked).
        identity: the root, store and attempt the blob belongs to.
        part_size: the largest uncompressed body of one part, in bytes (a record larger
            than that gets a part of its own).

    Returns:
        The complete blob: header, CRC32C and stored body of each part.

    Raises:
        TypeError: a version or level is not an int, ``compression`` is not a str, an item
            is not a (key, value) pair, a key or value is not bytes-like, or an identity
            field is of the wrong type.
        ValueError: a version is outside ``[0, 2**64 - 1]``, ``version <= base_version``,
            an unknown compression or a level outside zstd's range, an empty key, a key
            or value too long, a ``part_size`` outside ``[64, MAX_BODY_LENGTH]``, a single
            record longer than :data:`MAX_BODY_LENGTH`, a format-1 body longer than that,
            or an identity string longer than 255 bytes.
    """
    return b"".join(
        encode_changelog_parts(
            records, base_version=base_version, version=version, compression=compression,
            level=level, identity=identity, part_size=part_size,
        )
    )  # fmt: skip


def encode_changelog_parts(
    records: Records | Columns,
    *,
    base_version: int,
    version: int,
    compression: Compression = "zstd",
    level: int = 3,
    identity: ChangelogIdentity | None = None,
    part_size: int = MAX_BODY_LENGTH,
) -> ChangelogParts:
    """The changelog blob of :func:`encode_changelog`, one part at a time.

    Everything is checked before this returns; each part is framed, compressed and
    checksummed only when asked for, so a consumer that writes each part out before taking
    the next holds one part in memory, whatever the size of the commit. A changelog of one
    part (format 2 or 1) is one item. Encoding is deterministic: the same arguments give the
    same bytes, so a retried upload can encode again.

    Raises:
        TypeError, ValueError: as :func:`encode_changelog`.
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
    if isinstance(part_size, bool) or not isinstance(part_size, int):
        raise TypeError(f"part_size must be an int, found {type(part_size).__name__}")
    if not MIN_PART_SIZE <= part_size <= MAX_BODY_LENGTH:
        raise ValueError(
            f"part_size must be in [{MIN_PART_SIZE}, {MAX_BODY_LENGTH}], found {part_size}"
        )
    with phase("encode"):
        columns = records if isinstance(records, Columns) else Columns.of(records)
        runs = columns.split(part_size)
    for start, stop, length in runs:
        if length > MAX_BODY_LENGTH or (identity is None and len(runs) > 1):
            raise ValueError(
                f"changelog body too large: expected <= {MAX_BODY_LENGTH} bytes per part"
                + (" (format 1 has one part)" if identity is None else "")
                + f", found {length} ({stop - start} records); commit fewer changes per version"
            )
    fmt = (
        _FORMAT_1 if identity is None else SINGLE_PART_FORMAT if len(runs) == 1 else FORMAT_VERSION
    )
    part = _PartEncoder(fmt, codec_id, compression, level, base_version, version, section)
    return ChangelogParts(
        (
            part.encode(columns, start, stop, more=i + 1 < len(runs))
            for i, (start, stop, _) in enumerate(runs)
        ),
        [(start, stop) for start, stop, _ in runs],
    )


class ChangelogParts(Iterator[bytes]):
    """The parts of one changelog blob, encoded as they are taken (an iterator of bytes)."""

    def __init__(self, parts: Iterator[bytes], spans: list[tuple[int, int]]) -> None:
        self._parts = parts
        self.spans = spans
        """The records ``(start, stop)`` of each part, in order."""
        self.count = len(spans)
        """How many parts the blob has (1: a format 1 or 2 blob)."""

    def __next__(self) -> bytes:
        return next(self._parts)


class _PartEncoder:
    """Frames, compresses and checksums the parts of one blob in order (the CRC32C of a part
    continues from the previous part's)."""

    def __init__(
        self, fmt: int, codec_id: int, compression: Compression, level: int,
        base_version: int, version: int, section: bytes,
    ) -> None:  # fmt: skip
        self._head = (MAGIC, fmt, codec_id)
        self._compression, self._level = compression, level
        self._versions = (base_version, version)
        self._section = section
        self._crc: int | None = None

    def encode(self, columns: Columns, start: int, stop: int, *, more: bool) -> bytes:
        with phase("encode"):
            body = columns.frame(start, stop)
        with phase("compress"):
            stored = (
                body if self._compression == "none" else _compressor(self._level).compress(body)
            )
        flags = MORE_PARTS if more else 0
        head = HEADER.pack(
            *self._head, flags, *self._versions, stop - start, len(body), len(stored)
        )
        with phase("checksum"):
            # The CRC32C covers every byte of the part but its own field, continuing from the
            # previous part's CRC32C: a part dropped, repeated or moved fails its check.
            previous = self._crc
            crc = (
                google_crc32c.value(head)
                if previous is None
                else google_crc32c.extend(previous, head)
            )
            crc = google_crc32c.extend(google_crc32c.extend(crc, self._section), stored)
        self._crc = crc
        return b"".join((head, CRC.pack(crc), self._section, stored))


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
    framing of every part; with ``expected``, also that the blob is what its name says it
    is. :func:`read_changelog` does the same a part at a time.

    Args:
        data: the complete blob.
        blob: name of the blob, used in error messages.
        expected: the version and identity the reader expects under ``blob`` (from the
            manifest entry or the key it read); see :func:`check_identity`.
        anonymous_ok: whether a format-1 blob (no identity) is accepted as ``expected``.

    Returns:
        The header (of the first part) and the records in commit order.

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
    parts = list(
        read_changelog(
            _slicer(data), blob=blob, expected=expected, anonymous_ok=anonymous_ok,
            first=data, complete=True,
        )
    )  # fmt: skip
    if len(parts) == 1:
        return Changelog(parts[0].header, parts[0].records)
    records = [record for part in parts for record in part.records]
    return Changelog(parts[0].header, records, parts=len(parts))


def _slicer(data: bytes) -> Callable[[int, int], bytes]:
    return lambda start, length: data[start : start + length]


def read_changelog(
    read: Callable[[int, int], bytes],
    *,
    blob: str,
    expected: tuple[int, ChangelogIdentity] | None = None,
    anonymous_ok: bool = False,
    first: bytes = b"",
    complete: bool = False,
) -> Iterator[ChangelogPart]:
    """Verify and decode a changelog blob a part at a time, reading it with ``read``.

    Each part is read (one ranged read, or none where ``first`` holds it), checked as
    :func:`decode_changelog` checks a whole blob, and yielded before the next is read: the
    memory held is one part's, whatever the size of the blob. A part is yielded only once
    it is verified; a later part may still fail (the caller must not treat the records of
    a blob as complete before its last part).

    Args:
        read: ``read(start, length)`` returns the blob's bytes from ``start``, ``length`` of
            them or fewer if the blob ends first (``BlobStore.get_range`` of the blob).
        blob: name of the blob, used in error messages.
        expected: as :func:`decode_changelog`.
        anonymous_ok: as :func:`decode_changelog`.
        first: bytes of the blob already read from its start (saves the first read).
        complete: ``first`` is the whole blob.

    Raises:
        CorruptStateError: as :func:`decode_changelog`; a part is named by its index.
        StateNotFoundError, StorageError: as ``read``.
    """
    source = _Source(read, first, complete)
    previous: ChangelogPart | None = None
    crc: int | None = None
    offset = 0
    while True:
        index = 0 if previous is None else previous.index + 1
        part, crc = _read_part(source, offset, index, crc, blob, previous)
        if previous is None and expected is not None:
            check_identity(
                part.header, blob=blob, version=expected[0], expected=expected[1],
                anonymous_ok=anonymous_ok,
            )  # fmt: skip
        yield part
        if part.last:
            return
        previous, offset = part, offset + part.length


class _Source:
    """Ranged reads of one blob, answering from the last read where it covers the range."""

    def __init__(self, read: Callable[[int, int], bytes], first: bytes, complete: bool) -> None:
        self._read = read
        self._start, self._data = 0, first
        self.end: int | None = len(first) if complete else None
        """The blob's length, once a read came back short."""

    def get(self, start: int, length: int) -> bytes:
        """Bytes ``start .. start + length`` (fewer at the end of the blob)."""
        offset = start - self._start
        have = len(self._data) - offset
        if offset >= 0 and (have >= length or (self.end is not None and have >= 0)):
            return self._data[offset : offset + length]
        data = self._read(start, length)
        if len(data) < length:
            self.end = start + len(data)
        self._start, self._data = start, data
        return data

    def ends_at(self, position: int) -> bool:
        """True if the blob ends exactly at ``position`` (at most one read of one byte)."""
        if self.end is None and not self.get(position, 1):
            self.end = position
        return self.end == position


def _read_part(
    source: _Source, offset: int, index: int, crc: int | None, blob: str,
    previous: ChangelogPart | None,
) -> tuple[ChangelogPart, int]:  # fmt: skip
    """Read, check and decode the part at ``offset``; returns it and its CRC32C."""
    what = "" if index == 0 else f"part {index} at offset {offset}: "
    head = source.get(offset, MAX_HEADER_SIZE)
    if index and not head:
        raise corrupt(
            blob,
            f"{what}blob truncated",
            "another part (the last said more follow)",
            "the end of the blob",
        )
    fields = unpack_header(head, blob)
    fmt = fields[1]
    if previous is not None and fmt != FORMAT_VERSION:
        raise corrupt(blob, f"{what}format version of a later part", FORMAT_VERSION, fmt)
    head_length = header_length(head, fmt, blob)
    stored_length = fields[8]
    total = head_length + stored_length
    data = source.get(offset, total)
    last = not fields[3] & MORE_PARTS
    if len(data) < total or (last and source.end is not None and source.end > offset + total):
        found = offset + len(data) if source.end is None or len(data) < total else source.end
        problem = "blob truncated" if len(data) < total else "trailing bytes after the body"
        wanted = f"{offset + total} bytes ({head_length}-byte header + {stored_length}-byte body"
        wanted += ")" if not index else f" of part {index} at offset {offset})"
        raise corrupt(blob, problem, wanted, f"{found} bytes")
    (expected_crc,) = CRC.unpack_from(data, HEADER.size)
    start = (
        google_crc32c.value(data[: HEADER.size])
        if crc is None
        else google_crc32c.extend(crc, data[: HEADER.size])
    )
    actual_crc = google_crc32c.extend(start, data[HEADER_SIZE:])
    if actual_crc != expected_crc:
        raise corrupt(
            blob, f"{what}CRC32C mismatch", f"{expected_crc:#010x}", f"{actual_crc:#010x}"
        )
    header = check_header(fields, blob, parse_identity(data, fmt, blob), head_length)
    if previous is not None:
        _check_same_commit(previous.header, header, blob, what)
    body = data[head_length:]
    if header.compression == "zstd":
        body = _decompress(body, header.body_length, blob)
    records = decode_records(body, header.record_count, blob)
    if last and not source.ends_at(offset + total):
        raise corrupt(blob, "trailing bytes after the body", f"{offset + total} bytes", "more")
    return ChangelogPart(header, records, index, offset, total), actual_crc


def _check_same_commit(
    first: ChangelogHeader, header: ChangelogHeader, blob: str, what: str
) -> None:
    """Every part of a blob belongs to the same commit as its first."""
    mine = (header.base_version, header.version, header.identity)
    theirs = (first.base_version, first.version, first.identity)
    if mine != theirs:
        raise corrupt(
            blob,
            f"{what}not of the same commit as the part before",
            first.describe(),
            header.describe(),
        )


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
