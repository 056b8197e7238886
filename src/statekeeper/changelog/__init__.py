"""Changelog blobs: the puts and deletes of one commit, framed, compressed and checksummed.

A changelog blob is written once per commit attempt (``<operator>/<partition>/changelog/
<version:020d>-<attempt>.changelog``) and replayed on restore. Its byte layout is part of the
on-storage contract; a change to it needs a new :data:`FORMAT_VERSION`.

Envelope
--------
All integers are big-endian. The header is the fixed part, :data:`HEADER_SIZE` (52) bytes,
followed from format version 2 by the identity section:

======  ====  ========  ===========================================================
offset  size  type      field
======  ====  ========  ===========================================================
0       4     bytes     magic ``b"SKCL"``
4       2     uint16    format version: ``2`` (one part), ``3`` (:data:`FORMAT_VERSION`:
                        several parts); ``1`` is read
6       1     uint8     compression codec id: ``0`` none, ``1`` zstd
7       1     uint8     flags: bit 0 (format 3 only): another part follows; other bits
                        ``0`` (readers reject anything else)
8       8     uint64    base version: the store version the changes apply to
16      8     uint64    version: the store version they create (> base version)
24      8     uint64    record count
32      8     uint64    uncompressed body length, end marker included
                        (4 .. :data:`MAX_BODY_LENGTH`)
40      8     uint64    stored body length (equals the previous field for codec 0)
48      4     uint32    CRC32C (Castagnoli) of every byte of the blob except these 4
52      2     uint16    format 2 only: identity length ``m`` (<= 772)
54      m     bytes     format 2 only: identity (below)
52+i    n     bytes     stored body, n = stored body length; nothing follows it
======  ====  ========  ===========================================================

``i`` is 0 in format 1 and ``2 + m`` in formats 2 and 3. The identity names the commit that wrote
the blob (:class:`ChangelogIdentity`): ``| u8 length | root id | u8 length | operator |
uint32 partition | u8 length | attempt |``, strings in UTF-8. A reader compares it, and
the versions, with what it expected under the blob's name (:func:`check_identity`): a blob
of another root, store, version or attempt is refused naming both. Format-1 blobs (written
by statekeeper 0.1) record no identity; only their versions are checked, where the reader
expects a format-1 blob. A prefix of :data:`MAX_HEADER_SIZE` bytes holds any header.

Parts (format 3)
----------------
A commit whose records frame to more than one part (``StoreConfig.changelog_part_bytes`` of
uncompressed body) is written as several **parts** back to back in the one blob, so that a
writer streams it and a reader replays it holding one part at a time. Each part is a whole
envelope as above (format version 3): its own header, the same identity, versions and
codec, its own record count, lengths, stored body and end marker. Every part but the last
sets flag bit 0; nothing follows the last. The CRC32C of part ``i > 0`` continues from part
``i - 1``'s (as if that CRC's value seeded it), so a part dropped, repeated or moved fails
its check. Records are replayed part by part, in order. A changelog that fits one part is
written in format 2, byte for byte as before parts existed.

With codec 1 the stored body is exactly one zstd frame (no trailing bytes); if the frame
header records a content size it must equal the uncompressed body length.

Body (records, the Spark changelog design)
------------------------------------------
Every length is a signed big-endian int32::

    put    = | key length (>= 1) | key | value length (>= 0) | value |
    delete = | key length (>= 1) | key | -1 |
    body   = | record | record | ... | -1 |

Keys are non-empty; values may be empty (``b""`` is a put, distinct from a delete). The
body holds exactly "record count" records, then the end marker ``-1`` where the next key
length would be, then nothing. Records are replayed in order; a key may repeat.

Reading
-------
:func:`decode_changelog` (a whole blob) and :func:`read_changelog` (a part at a time, by
ranged reads) check, part by part, in this order: length >= header, magic, format version
(a newer one is reported as written by a newer statekeeper), total length = header +
stored body length, CRC32C, then the remaining header fields and the identity (against
what the caller expected, if it says), decompression to exactly the declared length, and
the record framing. Any failure is a
:class:`~statekeeper.errors.CorruptStateError` naming the blob. :func:`read_header` reads
only the header (no CRC check) for listing tools.
"""

from __future__ import annotations

from statekeeper.changelog._blob import (
    MIN_PART_SIZE,
    Changelog,
    ChangelogPart,
    ChangelogParts,
    decode_changelog,
    encode_changelog,
    encode_changelog_parts,
    read_changelog,
)
from statekeeper.changelog._header import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    MAX_BODY_LENGTH,
    MAX_HEADER_SIZE,
    SINGLE_PART_FORMAT,
    ChangelogHeader,
    ChangelogIdentity,
    check_identity,
    part_headers,
    read_header,
)
from statekeeper.changelog._records import MAX_ITEM_LENGTH, Columns

__all__ = [
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
