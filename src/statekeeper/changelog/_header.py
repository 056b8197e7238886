"""The envelope header of a changelog blob (layout in the package docstring).

A header is the fixed part (:data:`HEADER_SIZE` bytes, the same fields in every format
version) and, from format version 2, the identity section that follows it: the root,
store and attempt of the commit that wrote the blob (:class:`ChangelogIdentity`), covered by
the CRC32C like everything else but the CRC field itself.

Parsing is split in two so that each reader checks what it can trust:

* :func:`unpack_header` checks only what identifies the format (length, magic, format
  version) and returns the raw fields; :func:`decode_changelog` then verifies the CRC32C
  before it believes any other field, so a flipped bit is reported as a checksum mismatch.
* :func:`check_header` checks every field that can be judged without the body; it is all
  :func:`read_header` can do, since listing tools may hold only the header bytes.

:func:`check_identity` compares a header with what the reader expected to find under the
blob's name (a manifest entry, a listing), so a blob of another store, version or attempt
is refused naming both.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

from statekeeper.config import Compression
from statekeeper.errors import CorruptStateError

__all__ = [
    "CODEC_IDS",
    "CODEC_NAMES",
    "CRC",
    "FORMAT_VERSION",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_BODY_LENGTH",
    "MAX_HEADER_SIZE",
    "MAX_UINT64",
    "MIN_RECORD_SIZE",
    "MORE_PARTS",
    "SINGLE_PART_FORMAT",
    "ChangelogHeader",
    "ChangelogIdentity",
    "RawHeader",
    "check_header",
    "check_identity",
    "corrupt",
    "encode_identity",
    "header_length",
    "parse_identity",
    "read_header",
    "unpack_header",
]

MAGIC: Final = b"SKCL"
FORMAT_VERSION: Final = 3
"""The newest format read and written: 3 for a changelog of several parts, 2 for one part."""
SINGLE_PART_FORMAT: Final = 2
"""What a changelog of one part is written as (readable by every statekeeper since 0.2)."""
# Format 1 (statekeeper 0.1) has no identity section; it is still read.
_ANONYMOUS_FORMAT: Final = 1
MORE_PARTS: Final = 0x01
"""Flag (format 3): another part follows this one in the blob."""
# magic, format version, codec id, flags, base version, version, record count,
# uncompressed body length, stored body length; the CRC32C follows as its own field.
HEADER: Final = struct.Struct(">4sHBBQQQQQ")
CRC: Final = struct.Struct(">I")
HEADER_SIZE: Final = HEADER.size + CRC.size
# Identity section (format 2): its length, then root id, operator, partition, attempt.
_IDENTITY_LENGTH: Final = struct.Struct(">H")
_STRING_LENGTH: Final = struct.Struct(">B")
_PARTITION: Final = struct.Struct(">I")
_MAX_STRING: Final = 255
MAX_IDENTITY_LENGTH: Final = 3 * (_STRING_LENGTH.size + _MAX_STRING) + _PARTITION.size
MAX_HEADER_SIZE: Final = HEADER_SIZE + _IDENTITY_LENGTH.size + MAX_IDENTITY_LENGTH
"""A prefix of this many bytes holds the whole header of any changelog (or the whole blob)."""
# The largest uncompressed body a writer may produce and a reader will inflate: bounds the
# memory a (corrupt or hostile) header can make a reader allocate.
MAX_BODY_LENGTH: Final = 2**31
MAX_UINT64: Final = 2**64 - 1
# Smallest record: key length (4) + a 1-byte key + value length or -1 (4).
MIN_RECORD_SIZE: Final = 9
_END_MARKER_SIZE: Final = 4

CODEC_NAMES: Final[dict[int, Compression]] = {0: "none", 1: "zstd"}
CODEC_IDS: Final[dict[str, int]] = {name: i for i, name in CODEC_NAMES.items()}

RawHeader = tuple[bytes, int, int, int, int, int, int, int, int]


@dataclass(frozen=True, slots=True)
class ChangelogIdentity:
    """What a changelog belongs to, besides its versions: recorded in its header from
    format version 2, and what a reader expects to find under the blob's name.

    Attributes:
        root_id: the checkpoint root's id.
        operator: the operator.
        partition: the partition (``0 .. 2**32 - 1``).
        attempt: the attempt of the commit that wrote the blob.
    """

    root_id: str
    operator: str
    partition: int
    attempt: str

    def describe(self, version: int) -> str:
        """``root R, store op/0, version 3, attempt A``: for error messages."""
        return (
            f"root {self.root_id}, store {self.operator}/{self.partition}, version {version}, "
            f"attempt {self.attempt}"
        )


@dataclass(frozen=True, slots=True)
class ChangelogHeader:
    """The envelope header of one changelog blob.

    Attributes:
        format_version: envelope format version the blob was written with.
        compression: how the body is stored, ``"none"`` or ``"zstd"``.
        base_version: the store version the changes apply to.
        version: the store version the changes create (``> base_version``).
        record_count: number of put and delete records in the body.
        body_length: length in bytes of the uncompressed body, end marker included.
        stored_length: length in bytes of the body as stored after the header.
        identity: the root, store and attempt that wrote the blob (format 2); ``None`` for
            a format-1 blob, which records none.
        header_length: bytes before the stored body: :data:`HEADER_SIZE` plus, from format
            2, the identity section.
        more_parts: format 3 only: another part follows; record count and lengths are
            then this part's.
    """

    format_version: int
    compression: Compression
    base_version: int
    version: int
    record_count: int
    body_length: int
    stored_length: int
    identity: ChangelogIdentity | None = None
    header_length: int = HEADER_SIZE
    more_parts: bool = False
    """Format 3: another part follows this one (the header describes one part)."""

    @property
    def blob_length(self) -> int:
        """Total length in bytes of the blob (or, in format 3, of the part) this header
        describes."""
        return self.header_length + self.stored_length

    def describe(self) -> str:
        """What the header says the blob is, for error messages."""
        if self.identity is None:
            return f"a format-1 changelog without identity, version {self.version}"
        return self.identity.describe(self.version)


def corrupt(blob: str, what: str, expected: object, found: object) -> CorruptStateError:
    """Build the error for a failed check of ``blob``, saying what was expected and found."""
    return CorruptStateError(
        f"changelog blob {blob!r} is corrupt: {what}: expected {expected}, found {found}"
    )


def unpack_header(data: bytes, blob: str) -> RawHeader:
    """Unpack the header fields of ``data`` after checking length, magic and format version.

    Raises:
        CorruptStateError: ``data`` is shorter than a header, does not start with the
            magic, or carries a format version this reader does not know.
    """
    if len(data) < HEADER_SIZE:
        raise corrupt(blob, "too short for a header", f">= {HEADER_SIZE} bytes", len(data))
    fields: RawHeader = HEADER.unpack_from(data)
    magic, format_version = fields[0], fields[1]
    if magic != MAGIC:
        raise corrupt(blob, "not a changelog (bad magic)", repr(MAGIC), repr(magic))
    if format_version > FORMAT_VERSION:
        raise CorruptStateError(
            f"changelog blob {blob!r} was written by a newer statekeeper: format version "
            f"expected <= {FORMAT_VERSION}, found {format_version}; upgrade statekeeper"
        )
    if format_version < 1:
        raise corrupt(blob, "unknown format version", f"1..{FORMAT_VERSION}", format_version)
    return fields


def encode_identity(identity: ChangelogIdentity) -> bytes:
    """The identity section of a format-2 header: its length, then the identity.

    Raises:
        TypeError: a field of the wrong type.
        ValueError: a string longer than 255 bytes in UTF-8, or a partition outside
            ``[0, 2**32 - 1]``.
    """
    parts: list[bytes] = []
    for name, value in (("root_id", identity.root_id), ("operator", identity.operator)):
        parts.append(_string(name, value))
    partition = identity.partition
    if isinstance(partition, bool) or not isinstance(partition, int):
        raise TypeError(f"identity partition must be an int, found {type(partition).__name__}")
    if not 0 <= partition < 2**32:
        raise ValueError(f"identity partition must be in [0, 2**32 - 1], found {partition}")
    parts.append(_PARTITION.pack(partition))
    parts.append(_string("attempt", identity.attempt))
    body = b"".join(parts)
    return _IDENTITY_LENGTH.pack(len(body)) + body


def _string(name: str, value: object) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"identity {name} must be a str, found {type(value).__name__}")
    data = value.encode("utf-8")
    if len(data) > _MAX_STRING:
        raise ValueError(
            f"identity {name} must be at most {_MAX_STRING} bytes in UTF-8, found {len(data)}"
        )
    return _STRING_LENGTH.pack(len(data)) + data


def header_length(data: bytes, format_version: int, blob: str) -> int:
    """The length of the header of ``data``: the fixed part and, from format 2, the identity
    section (its declared length is read, its fields are not).

    Raises:
        CorruptStateError: ``data`` ends before the section's length field, or the length
            is larger than any identity.
    """
    if format_version == _ANONYMOUS_FORMAT:
        return HEADER_SIZE
    start = HEADER_SIZE + _IDENTITY_LENGTH.size
    if len(data) < start:
        raise corrupt(blob, "too short for the identity section", f">= {start} bytes", len(data))
    length: int = _IDENTITY_LENGTH.unpack_from(data, HEADER_SIZE)[0]
    if length > MAX_IDENTITY_LENGTH:
        raise corrupt(blob, "identity section length", f"<= {MAX_IDENTITY_LENGTH}", length)
    return start + length


def parse_identity(data: bytes, format_version: int, blob: str) -> ChangelogIdentity | None:
    """The identity section after the fixed header of ``data`` (``None`` for format 1).

    Raises:
        CorruptStateError: the section runs past ``data``, is malformed, or its fields do
            not fill exactly its declared length.
    """
    end = header_length(data, format_version, blob)
    if format_version == _ANONYMOUS_FORMAT:
        return None
    if len(data) < end:
        raise corrupt(blob, "too short for the identity section", f">= {end} bytes", len(data))
    section = data[HEADER_SIZE + _IDENTITY_LENGTH.size : end]
    try:
        root_id, pos = _read_string(section, 0)
        operator, pos = _read_string(section, pos)
        (partition,) = _PARTITION.unpack_from(section, pos)
        attempt, pos = _read_string(section, pos + _PARTITION.size)
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        what = "root id, operator, partition and attempt"
        raise corrupt(blob, "identity section", what, f"a malformed section ({exc})") from None
    if pos != len(section):
        raise corrupt(blob, "identity section length", f"{pos} bytes of fields", len(section))
    return ChangelogIdentity(root_id, operator, partition, attempt)


def _read_string(section: bytes, pos: int) -> tuple[str, int]:
    (length,) = _STRING_LENGTH.unpack_from(section, pos)
    end = pos + _STRING_LENGTH.size + length
    if end > len(section):
        raise ValueError(f"a {length}-byte string runs past the section")
    return section[pos + _STRING_LENGTH.size : end].decode("utf-8"), end


def check_header(
    fields: RawHeader,
    blob: str,
    identity: ChangelogIdentity | None = None,
    header_length: int = HEADER_SIZE,
) -> ChangelogHeader:
    """Check the header fields that need no body and return them as a header.

    Raises:
        CorruptStateError: unknown codec, reserved flags set, versions out of order, or
            lengths and counts that cannot describe a valid body.
    """
    _, fmt, codec_id, flags, base, version, count, body_length, stored_length = fields
    codec = CODEC_NAMES.get(codec_id)
    if codec is None:
        known = ", ".join(f"{i} ({n})" for i, n in CODEC_NAMES.items())
        raise corrupt(blob, "unknown compression codec id", f"one of {known}", codec_id)
    allowed = MORE_PARTS if fmt >= FORMAT_VERSION else 0
    if flags & ~allowed:
        raise corrupt(blob, "reserved flags set", 0, flags & ~allowed)
    if version <= base:
        raise corrupt(blob, "version not after base version", f"> {base}", version)
    if body_length > MAX_BODY_LENGTH:
        raise corrupt(blob, "uncompressed body too large", f"<= {MAX_BODY_LENGTH}", body_length)
    if body_length < _END_MARKER_SIZE + MIN_RECORD_SIZE * count:
        raise corrupt(
            blob,
            f"uncompressed body too short for {count} records",
            f">= {_END_MARKER_SIZE + MIN_RECORD_SIZE * count} bytes",
            body_length,
        )
    if codec == "none" and stored_length != body_length:
        raise corrupt(
            blob, "stored length of an uncompressed body", f"{body_length} bytes", stored_length
        )
    return ChangelogHeader(
        fmt, codec, base, version, count, body_length, stored_length, identity, header_length,
        more_parts=bool(flags & MORE_PARTS),
    )  # fmt: skip


def check_identity(
    header: ChangelogHeader,
    *,
    blob: str,
    version: int,
    expected: ChangelogIdentity,
    anonymous_ok: bool,
) -> None:
    """Check that the blob read under the name of ``version`` of ``expected`` is that.

    A format-1 blob records no identity: only its versions can be checked, and it is
    accepted only where the reader expects one (``anonymous_ok``: a version written by
    statekeeper 0.1).

    Raises:
        CorruptStateError: the header names another root, store, version or attempt (or
            none where one is required); the message names what was expected and what the
            blob says.
    """
    versions_ok = (header.base_version, header.version) == (version - 1, version)
    if header.identity is None:
        ok = versions_ok and anonymous_ok
    else:
        ok = versions_ok and header.identity == expected
    if not ok:
        raise CorruptStateError(
            f"changelog blob {blob!r} does not belong where it is stored: expected "
            f"{expected.describe(version)} (from version {version - 1}), found "
            f"{header.describe()} (from version {header.base_version})"
        )


def read_header(data: bytes | bytearray | memoryview, *, blob: str) -> ChangelogHeader:
    """Read the header of a changelog blob without reading or checking its body.

    Cheap enough for listing tools: only the header is looked at (the first
    :data:`HEADER_SIZE` bytes and, from format 2, the identity section after them; a prefix
    of :data:`MAX_HEADER_SIZE` bytes always holds it), so ``data`` may be just a prefix of
    the blob. The CRC32C is **not** verified (it covers the body); use
    :func:`decode_changelog` before trusting the records.

    Args:
        data: the blob, or a prefix of it that holds the whole header.
        blob: name of the blob, used in error messages.

    Returns:
        The header fields.

    Raises:
        CorruptStateError: ``data`` is too short, has the wrong magic, an unknown format
            version (written by a newer statekeeper) or compression codec, reserved flags
            set, a malformed identity section, or fields that contradict each other.
    """
    # cast("B") so that a memoryview of wider items is sliced in bytes, not in items.
    head = bytes(memoryview(data).cast("B")[:MAX_HEADER_SIZE])
    fields = unpack_header(head, blob)
    identity = parse_identity(head, fields[1], blob)
    return check_header(fields, blob, identity, header_length(head, fields[1], blob))


def part_headers(
    read_range: Callable[[int, int], bytes], *, blob: str
) -> Iterator[tuple[int, ChangelogHeader]]:
    """The offset and header of each part of a changelog blob, in order (one for a blob of
    one part), reading one header prefix at a time with ``read_range(offset, length)``. The
    last part ends at the last offset plus its :attr:`ChangelogHeader.blob_length`.

    Raises:
        CorruptStateError: a header is not valid (or is cut off: the blob ends before a part
            its predecessor announces).
    """
    offset = 0
    while True:
        header = read_header(read_range(offset, MAX_HEADER_SIZE), blob=blob)
        yield offset, header
        if not header.more_parts:
            return
        offset += header.blob_length
