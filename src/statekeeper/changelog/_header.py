"""The fixed-size envelope header of a changelog blob (layout in the package docstring).

Parsing is split in two so that each reader checks what it can trust:

* :func:`unpack_header` checks only what identifies the format (length, magic, format
  version) and returns the raw fields; :func:`decode_changelog` then verifies the CRC32C
  before it believes any other field, so a flipped bit is reported as a checksum mismatch.
* :func:`check_header` checks every field that can be judged without the body; it is all
  :func:`read_header` can do, since listing tools may hold only the header bytes.
"""

from __future__ import annotations

import struct
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
    "MAX_UINT64",
    "MIN_RECORD_SIZE",
    "ChangelogHeader",
    "RawHeader",
    "check_header",
    "corrupt",
    "read_header",
    "unpack_header",
]

MAGIC: Final = b"SKCL"
FORMAT_VERSION: Final = 1
# magic, format version, codec id, flags, base version, version, record count,
# uncompressed body length, stored body length; the CRC32C follows as its own field.
HEADER: Final = struct.Struct(">4sHBBQQQQQ")
CRC: Final = struct.Struct(">I")
HEADER_SIZE: Final = HEADER.size + CRC.size
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
    """

    format_version: int
    compression: Compression
    base_version: int
    version: int
    record_count: int
    body_length: int
    stored_length: int

    @property
    def blob_length(self) -> int:
        """Total length in bytes of the blob this header describes."""
        return HEADER_SIZE + self.stored_length


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


def check_header(fields: RawHeader, blob: str) -> ChangelogHeader:
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
    if flags != 0:
        raise corrupt(blob, "reserved flags set", 0, flags)
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
    return ChangelogHeader(fmt, codec, base, version, count, body_length, stored_length)


def read_header(data: bytes | bytearray | memoryview, *, blob: str) -> ChangelogHeader:
    """Read the header of a changelog blob without reading or checking its body.

    Cheap enough for listing tools: only the first :data:`HEADER_SIZE` bytes are looked at,
    so ``data`` may be just that prefix of the blob. The CRC32C is **not** verified (it
    covers the body); use :func:`decode_changelog` before trusting the records.

    Args:
        data: the blob, or at least its first :data:`HEADER_SIZE` bytes.
        blob: name of the blob, used in error messages.

    Returns:
        The header fields.

    Raises:
        CorruptStateError: ``data`` is too short, has the wrong magic, an unknown format
            version (written by a newer statekeeper) or compression codec, reserved flags
            set, or fields that contradict each other.
    """
    # cast("B") so that a memoryview of wider items is sliced in bytes, not in items.
    head = bytes(memoryview(data).cast("B")[:HEADER_SIZE])
    return check_header(unpack_header(head, blob), blob)
