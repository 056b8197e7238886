"""The one owner of blob key names under a checkpoint root (ARCHITECTURE §4).

Nobody else formats or parses a blob path. Keys are relative to the root and always use
``/``; versions are zero-padded to 20 digits so that lexicographic listing order is version
order.
"""

from __future__ import annotations

import re

__all__ = [
    "ROOT_METADATA",
    "changelog_key",
    "changelog_prefix",
    "clock_prefix",
    "clock_probe_key",
    "epoch_key",
    "epochs_prefix",
    "file_blob_key",
    "files_prefix",
    "initial_state_key",
    "initial_state_prefix",
    "metrics_key",
    "metrics_prefix",
    "operator_prefix",
    "parse_changelog_key",
    "parse_epoch_key",
    "parse_metrics_key",
    "parse_report_key",
    "parse_snapshot_key",
    "parse_store_key",
    "report_key",
    "reports_prefix",
    "snapshot_index_key",
    "snapshot_prefix",
    "store_prefix",
    "validate_operator",
    "validate_partition",
    "validate_query_id",
    "validate_version",
]

ROOT_METADATA = "_statekeeper.json"

_OPERATOR_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_BLOB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,200}")
_ATTEMPT_RE = re.compile(r"[A-Za-z0-9_]{1,64}")
_CHANGELOG_SUFFIX = ".changelog"
_INDEX_SUFFIX = ".index.json"
_EPOCHS = "_epochs/"
_REPORTS = "_reports/"
_INITIAL = "_initial/"
_CLOCK = "_clock/"
_DIGITS = 20


def validate_operator(name: object) -> str:
    """Return ``name`` if it is a valid operator name.

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: ``name`` is empty, too long, starts with ``_`` or ``.``, or holds
            characters other than letters, digits, ``_``, ``.`` and ``-``.
    """
    if not isinstance(name, str):
        raise TypeError(f"operator name must be a str, got {type(name).__name__}")
    if not _OPERATOR_RE.fullmatch(name):
        raise ValueError(
            "operator name must be 1-128 characters of letters, digits, '_', '.' or '-', "
            f"starting with a letter or digit; got {name!r}"
        )
    return name


def validate_partition(partition: object) -> int:
    """Return ``partition`` if it is an int in ``[0, 2**32)`` (a changelog's header holds
    it in 32 bits).

    Raises:
        TypeError: not an int (bools are refused too).
        ValueError: negative, or 2**32 or more.
    """
    if isinstance(partition, bool) or not isinstance(partition, int):
        raise TypeError(f"partition must be an int, got {type(partition).__name__}")
    if not 0 <= partition < 2**32:
        raise ValueError(f"partition must be in [0, 2**32 - 1], got {partition}")
    return partition


def validate_version(version: object) -> int:
    """Return ``version`` if it is an int >= 0.

    Raises:
        TypeError: not an int (bools are refused too).
        ValueError: negative or too large for the key format.
    """
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"version must be an int >= 0, got {type(version).__name__}")
    if version < 0 or version >= 10**_DIGITS:
        raise ValueError(f"version must be an int in [0, 10**{_DIGITS}), got {version}")
    return version


def store_prefix(operator: str, partition: int) -> str:
    """Prefix of every blob of one store (operator, partition)."""
    return f"{validate_operator(operator)}/{validate_partition(partition)}/"


def changelog_prefix(operator: str, partition: int) -> str:
    """Prefix under which a store's changelog blobs are listed."""
    return store_prefix(operator, partition) + "changelog/"


def changelog_key(operator: str, partition: int, version: int) -> str:
    """Key of the changelog that creates ``version``."""
    return f"{changelog_prefix(operator, partition)}{validate_version(version):0{_DIGITS}d}" + (
        _CHANGELOG_SUFFIX
    )


def parse_changelog_key(key: str) -> int | None:
    """Version of a changelog key, or ``None`` if ``key`` is not a changelog blob."""
    return _parse_versioned(key, "/changelog/", _CHANGELOG_SUFFIX)


def snapshot_prefix(operator: str, partition: int) -> str:
    """Prefix under which a store's snapshot index blobs are listed."""
    return store_prefix(operator, partition) + "snapshot/"


def snapshot_index_key(operator: str, partition: int, version: int) -> str:
    """Key of the snapshot index blob of ``version``."""
    return f"{snapshot_prefix(operator, partition)}{validate_version(version):0{_DIGITS}d}" + (
        _INDEX_SUFFIX
    )


def parse_snapshot_key(key: str) -> int | None:
    """Version of a snapshot index key, or ``None`` if ``key`` is not one."""
    return _parse_versioned(key, "/snapshot/", _INDEX_SUFFIX)


def files_prefix(operator: str, partition: int) -> str:
    """Prefix of a store's immutable file blobs (snapshot file chunks)."""
    return store_prefix(operator, partition) + "files/"


def file_blob_key(operator: str, partition: int, blob_id: str) -> str:
    """Key of one file blob.

    Raises:
        ValueError: ``blob_id`` is not a plain name (no ``/``, no leading dot).
    """
    if not _BLOB_ID_RE.fullmatch(blob_id):
        raise ValueError(f"blob id must be a plain name, got {blob_id!r}")
    return files_prefix(operator, partition) + blob_id


def manifest_prefix(operator: str, partition: int) -> str:
    """Prefix of a store's manifests (format 2: the one authority of its versions)."""
    return store_prefix(operator, partition) + "manifest/"


def manifest_key(operator: str, partition: int, seq: int) -> str:
    """Key of manifest number ``seq`` of a store (written create-only, never replaced)."""
    return f"{manifest_prefix(operator, partition)}{validate_version(seq):0{_DIGITS}d}.json"


def parse_manifest_key(key: str) -> int | None:
    """Sequence number of a manifest key, or ``None`` if ``key`` is not one."""
    return _parse_versioned(key, "/manifest/", ".json")


def attempt_changelog_key(operator: str, partition: int, version: int, attempt: str) -> str:
    """Key of the changelog that attempt ``attempt`` wrote for ``version`` (format 2: one
    name per attempt, so no attempt ever overwrites or adopts another's blob).

    Raises:
        ValueError: ``attempt`` is not a plain name.
    """
    return f"{changelog_prefix(operator, partition)}{validate_version(version):0{_DIGITS}d}-" + (
        f"{validate_attempt(attempt)}{_CHANGELOG_SUFFIX}"
    )


def attempt_snapshot_key(operator: str, partition: int, version: int, attempt: str) -> str:
    """Key of the snapshot index that attempt ``attempt`` wrote for ``version`` (format 2).

    Raises:
        ValueError: ``attempt`` is not a plain name.
    """
    return f"{snapshot_prefix(operator, partition)}{validate_version(version):0{_DIGITS}d}-" + (
        f"{validate_attempt(attempt)}{_INDEX_SUFFIX}"
    )


def parse_attempt_snapshot_key(key: str) -> tuple[int, str] | None:
    """(version, attempt) of a format-2 snapshot index key, or ``None`` if it is not one."""
    return _parse_attempt(key, "/snapshot/", _INDEX_SUFFIX)


def parse_attempt_changelog_key(key: str) -> tuple[int, str] | None:
    """(version, attempt) of a format-2 changelog key, or ``None`` if it is not one."""
    return _parse_attempt(key, "/changelog/", _CHANGELOG_SUFFIX)


def commit_blob_version(key: str) -> int | None:
    """The version of a changelog or snapshot index key of either format, or ``None`` if
    ``key`` is neither."""
    parsed = parse_attempt_changelog_key(key) or parse_attempt_snapshot_key(key)
    if parsed is not None:
        return parsed[0]
    version = parse_changelog_key(key)
    return version if version is not None else parse_snapshot_key(key)


def _parse_attempt(key: str, infix: str, suffix: str) -> tuple[int, str] | None:
    head, sep, tail = key.rpartition(infix)
    if not sep or head.count("/") != 1 or not tail.endswith(suffix):
        return None
    digits, dash, attempt = tail[: -len(suffix)].partition("-")
    if not dash or len(digits) != _DIGITS or not digits.isdigit():
        return None
    if not _ATTEMPT_RE.fullmatch(attempt):
        return None
    return int(digits), attempt


def validate_attempt(attempt: object) -> str:
    """Return ``attempt`` if it is a valid attempt id (1-64 letters, digits, ``_``).

    Raises:
        TypeError: not a str.
        ValueError: malformed.
    """
    if not isinstance(attempt, str):
        raise TypeError(f"attempt id must be a str, got {type(attempt).__name__}")
    if not _ATTEMPT_RE.fullmatch(attempt):
        raise ValueError(f"attempt id must be 1-64 letters, digits or '_', got {attempt!r}")
    return attempt


def metrics_prefix(operator: str, partition: int) -> str:
    """Prefix of a store's commit-metrics blobs (see ``statekeeper.metrics``)."""
    return store_prefix(operator, partition) + "metrics/"


def metrics_key(operator: str, partition: int, last_version: int) -> str:
    """Key of the commit-metrics blob whose newest entry is ``last_version``."""
    return f"{metrics_prefix(operator, partition)}{validate_version(last_version):0{_DIGITS}d}.json"


def parse_metrics_key(key: str) -> int | None:
    """The last version of a commit-metrics key, or ``None`` if ``key`` is not one."""
    return _parse_versioned(key, "/metrics/", ".json")


def operator_prefix(operator: str) -> str:
    """Prefix of every blob of every store of ``operator``."""
    return f"{validate_operator(operator)}/"


def parse_store_key(key: str) -> tuple[str, int] | None:
    """The (operator, partition) a blob key belongs to, or ``None`` for root-level keys."""
    parts = key.split("/", 2)
    if len(parts) < 3 or not parts[1].isdigit() or not _OPERATOR_RE.fullmatch(parts[0]):
        return None
    return parts[0], int(parts[1])


def epochs_prefix(query_id: str | None = None) -> str:
    """Prefix of the epoch manifests (of one query if ``query_id`` is given)."""
    return _EPOCHS if query_id is None else f"{_EPOCHS}{validate_query_id(query_id)}/"


def validate_query_id(query_id: object) -> str:
    """Check a streaming query id (Spark's are UUIDs) names a folder safely.

    Raises:
        TypeError, ValueError: not a short name of letters, digits, ``_ . -``.
    """
    if not isinstance(query_id, str):
        raise TypeError(f"a query id must be a str, got {type(query_id).__name__}")
    if not _OPERATOR_RE.fullmatch(query_id):
        raise ValueError(
            f"a query id must be 1-128 letters, digits, '_', '.' or '-' starting with a "
            f"letter or digit, got {query_id!r}"
        )
    return query_id


def epoch_key(epoch: int, query_id: str | None = None) -> str:
    """Key of the manifest of ``epoch`` of query ``query_id`` (``None``: the format-1 key,
    shared by every query of the root, read but no longer written)."""
    return f"{epochs_prefix(query_id)}{validate_version(epoch):0{_DIGITS}d}.json"


def parse_epoch_key(key: str) -> tuple[str | None, int] | None:
    """(query id, epoch) of a manifest key (query ``None`` for a format-1 key), or ``None``."""
    if not key.startswith(_EPOCHS):
        return None
    rest = key[len(_EPOCHS) :]
    query, _, name = rest.rpartition("/")
    if query and not _OPERATOR_RE.fullmatch(query):
        return None
    epoch = _parse_digits(name, ".json")
    return None if epoch is None else (query or None, epoch)


def reports_prefix(operator: str | None = None, batch_id: int | None = None) -> str:
    """Prefix of the task reports of ``operator`` (of one micro-batch if ``batch_id`` is
    given; of every operator if ``operator`` is ``None``)."""
    if operator is None:
        return _REPORTS
    head = f"{_REPORTS}{validate_operator(operator)}/"
    return head if batch_id is None else f"{head}{validate_version(batch_id):0{_DIGITS}d}/"


def report_key(operator: str, batch_id: int, partition: int) -> str:
    """Key of the task report of one partition in one micro-batch (a re-run replaces it)."""
    return f"{reports_prefix(operator, batch_id)}{validate_partition(partition):06d}.json"


def parse_report_key(key: str) -> tuple[str, int, int] | None:
    """(operator, batch id, partition) of a task report key, or ``None`` if it is not one."""
    if not key.startswith(_REPORTS):
        return None
    parts = key[len(_REPORTS) :].split("/")
    if len(parts) != 3 or not _OPERATOR_RE.fullmatch(parts[0]):
        return None
    batch = _parse_digits(parts[1] + ".json", ".json")
    name = parts[2]
    if batch is None or len(name) != 11 or not name.endswith(".json") or not name[:6].isdigit():
        return None
    return parts[0], batch, int(name[:6])


def _parse_versioned(key: str, infix: str, suffix: str) -> int | None:
    head, sep, tail = key.rpartition(infix)
    if not sep or head.count("/") != 1:
        return None
    return _parse_digits(tail, suffix)


def _parse_digits(name: str, suffix: str) -> int | None:
    if not name.endswith(suffix):
        return None
    digits = name[: -len(suffix)]
    if len(digits) != _DIGITS or not digits.isdigit():
        return None
    return int(digits)


def initial_state_prefix(operator: str) -> str:
    """Prefix of the staged initial-state blobs of ``operator`` (read by its batch 0 only)."""
    return f"{_INITIAL}{validate_operator(operator)}/"


def initial_state_key(operator: str, generation: int, partition: int, attempt: str) -> str:
    """Key of one partition's staged initial rows (Arrow IPC), staged by run ``generation``."""
    head = f"{initial_state_prefix(operator)}{validate_version(generation):0{_DIGITS}d}/"
    return f"{head}{validate_partition(partition):06d}-{validate_attempt(attempt)}.arrow"


def initial_state_generation(operator: str, key: str) -> int | None:
    """The run that staged ``key`` (:func:`initial_state_key`); ``None`` if not such a key."""
    head, _, rest = key.removeprefix(initial_state_prefix(operator)).partition("/")
    if not rest or len(head) != _DIGITS or not head.isdigit():
        return None
    return int(head)


def clock_prefix() -> str:
    """Prefix of the probe blobs GC writes to read the blob store's clock."""
    return _CLOCK


def clock_probe_key(probe_id: str) -> str:
    """Key of one clock probe (written, read back and deleted at once by GC)."""
    return f"{_CLOCK}{validate_attempt(probe_id)}"
