"""Checksummed JSON documents: the root metadata, store manifests and epoch manifests.

A document is stored as JSON whose ``crc32c`` field is the CRC32C of the document's canonical
form without that field (keys sorted, no spaces, ASCII): any edit or flipped byte that still
parses as JSON is caught, whatever indentation the blob was written with.
"""

from __future__ import annotations

import json
from typing import Any

import google_crc32c

from statekeeper.errors import CorruptStateError

__all__ = ["canonical_json", "check_sealed", "seal"]

_FIELD = "crc32c"


def canonical_json(doc: dict[str, Any]) -> bytes:
    """The canonical bytes of ``doc`` the checksum is taken over."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def seal(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with its ``crc32c`` field set (in place; returned for convenience)."""
    doc.pop(_FIELD, None)
    doc[_FIELD] = google_crc32c.value(canonical_json(doc))
    return doc


def check_sealed(doc: dict[str, Any], *, what: str) -> None:
    """Remove ``doc``'s ``crc32c`` field and check it.

    Raises:
        CorruptStateError: the field is missing or does not match; the message starts with
            ``what`` (say, ``"root metadata s3://b/_statekeeper.json"``).
    """
    stored = doc.pop(_FIELD, None)
    if stored != google_crc32c.value(canonical_json(doc)):
        raise CorruptStateError(
            f"{what} is not valid: checksum mismatch (stored {stored!r}): it was edited or damaged"
        )
