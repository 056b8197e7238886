"""The snapshot index schema: JSON round trip and strict validation of every field."""

from __future__ import annotations

import json
import os
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

import google_crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import statekeeper.snapshot as snap
from statekeeper import layout
from statekeeper.errors import CorruptStateError
from statekeeper.snapshot import (
    DirIndex,
    FileBlob,
    FileIndex,
    SnapshotIndex,
    SnapshotMetadata,
    check_metadata,
    iter_files,
    referenced_blob_ids,
)

BLOB = "op/0/snapshot/00000000000000000005.index.json"

UNSAFE_NAMES = [
    "",
    ".",
    "..",
    "a/b",
    "/abs",
    "/",
    "../escape",
    "a\\b",
    "\\abs",
    "..\\escape",
    "a\x00b",
    "C:evil",
    "x" * 256,
    "\ud800",  # not encodable by the filesystem encoding
]
UNSAFE_BLOB_IDS = ["", ".hidden", "../x", "a/b", "/abs", "x\x00", "a\\b", "x" * 300]


def file_index(name: str = "000001.sst", size: int = 10, **kw: Any) -> FileIndex:
    if "blobs" in kw:
        blobs = kw.pop("blobs")
    else:
        blobs = (FileBlob(blob_id=f"id-{name}", offset=0),) if size else ()
    fields: dict[str, Any] = {
        "file_name": name,
        "blobs": blobs,
        "size_in_bytes": size,
        "mtime_ms": 1_700_000_000_000,
        "ctime_ms": 1_700_000_000_001,
        "crc": 0xDEADBEEF,
        "attribs": 0o644,
    }
    fields.update(kw)
    return FileIndex(**fields)


def sample_index(**kw: Any) -> SnapshotIndex:
    sub = DirIndex(
        dir_name="sub",
        files_present=(file_index("000002.sst", 20),),
        sub_directories_present=(DirIndex(dir_name="empty"),),
    )
    root = DirIndex(
        dir_name="",
        files_present=(file_index("000001.sst"), file_index("CURRENT", 0)),
        files_removed=(file_index("000000.sst", 5),),
        sub_directories_present=(sub,),
        sub_directories_removed=(DirIndex(dir_name="old", files_present=(file_index("x"),)),),
    )
    fields: dict[str, Any] = {
        "checkpoint_id": "0123456789abcdef0123456789abcdef",
        "created_time_ms": 1_700_000_000_123,
        "metadata": SnapshotMetadata(operator="op", partition=0, version=5),
        "dir_index": root,
        "prev_snapshot_index_blob_id": layout.snapshot_index_key("op", 0, 3),
    }
    fields.update(kw)
    return SnapshotIndex(**fields)


def sample_doc() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(sample_index().to_json())
    return doc


def seal(doc: Any) -> bytes:
    """Encode an edited index document with its checksum recomputed."""
    if isinstance(doc, dict):
        body = {k: v for k, v in doc.items() if k != "crc32c"}
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        doc = {**body, "crc32c": google_crc32c.value(canonical.encode())}
    return json.dumps(doc).encode()


def parse(doc: object) -> SnapshotIndex:
    return SnapshotIndex.from_json(seal(doc), blob=BLOB)


def rejected(doc: object, *fragments: str) -> str:
    with pytest.raises(CorruptStateError) as info:
        parse(doc)
    message = str(info.value)
    assert BLOB in message
    for fragment in fragments:
        assert fragment in message
    return message


# -- round trip ------------------------------------------------------------------------------


def test_round_trip_and_seed_field_names() -> None:
    index = sample_index()
    data = index.to_json()
    assert SnapshotIndex.from_json(data, blob=BLOB) == index
    doc = json.loads(data)
    assert set(doc) == {
        "schemaVersion",
        "checkpointId",
        "createdTimeMs",
        "metadata",
        "dirIndex",
        "prevSnapshotIndexBlobId",
        "crc32c",
    }
    assert doc["schemaVersion"] == 1
    assert doc["metadata"] == {"operator": "op", "partition": 0, "version": 5}
    assert set(doc["dirIndex"]) == {
        "dirName",
        "filesPresent",
        "filesRemoved",
        "subDirectoriesPresent",
        "subDirectoriesRemoved",
    }
    first = doc["dirIndex"]["filesPresent"][0]
    assert first == {
        "fileName": "000001.sst",
        "blobs": [{"blobId": "id-000001.sst", "offset": 0}],
        "sizeInBytes": 10,
        "mtime": 1_700_000_000_000,
        "ctime": 1_700_000_000_001,
        "crc": 0xDEADBEEF,
        "attribs": 0o644,
    }


def test_to_json_is_deterministic_with_sorted_keys() -> None:
    data = sample_index().to_json()
    assert data == sample_index().to_json()
    assert data == json.dumps(json.loads(data), sort_keys=True, separators=(",", ":")).encode()


def test_first_snapshot_has_null_previous() -> None:
    index = sample_index(prev_snapshot_index_blob_id=None)
    assert json.loads(index.to_json())["prevSnapshotIndexBlobId"] is None
    assert SnapshotIndex.from_json(index.to_json(), blob=BLOB) == index


safe_names = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="/\\\x00:"),
    min_size=1,
    max_size=20,
).filter(lambda n: n not in (".", ".."))
blob_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,30}", fullmatch=True)


@st.composite
def file_indexes(draw: st.DrawFn, name: str) -> FileIndex:
    chunk_sizes = draw(st.lists(st.integers(1, 10**9), max_size=4))
    offsets = [sum(chunk_sizes[:i]) for i in range(len(chunk_sizes))]
    return FileIndex(
        file_name=name,
        blobs=tuple(FileBlob(blob_id=draw(blob_ids), offset=o) for o in offsets),
        size_in_bytes=sum(chunk_sizes),
        mtime_ms=draw(st.integers(0, 2**40)),
        ctime_ms=draw(st.integers(0, 2**40)),
        crc=draw(st.integers(0, 2**32 - 1)),
        attribs=draw(st.integers(0, 0o777)),
    )


@st.composite
def dir_indexes(draw: st.DrawFn, name: str = "", depth: int = 0) -> DirIndex:
    present = draw(st.lists(safe_names, unique=True, max_size=5))
    removed = draw(st.lists(safe_names, unique=True, max_size=3))
    n_dirs = draw(st.integers(0, len(present) if depth < 3 else 0))
    n_removed_dirs = draw(st.integers(0, len(removed) if depth < 3 else 0))
    return DirIndex(
        dir_name=name,
        files_present=tuple(draw(file_indexes(n)) for n in present[n_dirs:]),
        files_removed=tuple(draw(file_indexes(n)) for n in removed[n_removed_dirs:]),
        sub_directories_present=tuple(draw(dir_indexes(n, depth + 1)) for n in present[:n_dirs]),
        sub_directories_removed=tuple(
            draw(dir_indexes(n, depth + 1)) for n in removed[:n_removed_dirs]
        ),
    )


@settings(max_examples=150)
@given(
    root=dir_indexes(),
    version=st.integers(1, 10**19),
    partition=st.integers(0, 10**6),
    has_prev=st.booleans(),
)
def test_generated_indexes_round_trip(
    root: DirIndex, version: int, partition: int, has_prev: bool
) -> None:
    index = SnapshotIndex(
        checkpoint_id="abc123",
        created_time_ms=1,
        metadata=SnapshotMetadata(operator="op.x-1", partition=partition, version=version),
        dir_index=root,
        prev_snapshot_index_blob_id=(
            layout.snapshot_index_key("op.x-1", partition, version - 1) if has_prev else None
        ),
    )
    data = index.to_json()
    assert SnapshotIndex.from_json(data, blob=BLOB) == index
    assert data.isascii()


def test_iter_files_and_referenced_blob_ids_cover_present_files_only() -> None:
    index = sample_index()
    assert [path for path, _ in iter_files(index.dir_index)] == [
        "000001.sst",
        "CURRENT",
        "sub/000002.sst",
    ]
    # Removed files and removed directories are not referenced any more.
    assert referenced_blob_ids(index) == {"id-000001.sst", "id-000002.sst"}


def test_chunk_sizes_follow_from_offsets() -> None:
    blobs = tuple(FileBlob(blob_id=f"b{i}", offset=o) for i, o in enumerate([0, 7, 14]))
    assert file_index(size=20, blobs=blobs).chunk_sizes() == (7, 7, 6)
    assert file_index(size=0).chunk_sizes() == ()


# -- schema version and structure -------------------------------------------------------------


def test_newer_schema_version_is_rejected_with_a_clear_message() -> None:
    doc = sample_doc()
    doc["schemaVersion"] = 7
    doc["someFieldOfTheFuture"] = {}
    del doc["dirIndex"]  # a newer writer may change anything else: the version comes first
    rejected(doc, "written by a newer statekeeper", "expected schemaVersion 1, 2 or 3, found 7")


@pytest.mark.parametrize("version", [0, -1, "1", 1.0, True, None])
def test_other_schema_versions_are_rejected(version: object) -> None:
    doc = sample_doc()
    doc["schemaVersion"] = version
    rejected(doc, "schemaVersion")


def test_constructor_refuses_another_schema_version() -> None:
    with pytest.raises(ValueError, match="schemaVersion"):
        sample_index(schema_version=2)


@pytest.mark.parametrize(
    "data",
    [b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"schemaVersion": NaN}', b'"x"'],
)
def test_invalid_json_is_rejected(data: bytes) -> None:
    with pytest.raises(CorruptStateError, match="index") as info:
        SnapshotIndex.from_json(data, blob=BLOB)
    assert BLOB in str(info.value)


def test_duplicate_json_keys_are_rejected() -> None:
    data = sample_index().to_json().replace(b'{"checkpointId"', b'{"crc":1,"checkpointId"')
    data = data.replace(b'"crc":3735928559', b'"crc":3735928559,"crc":1', 1)
    with pytest.raises(CorruptStateError, match="duplicate"):
        SnapshotIndex.from_json(data, blob=BLOB)


def test_deep_nesting_is_rejected_not_a_recursion_error() -> None:
    with pytest.raises(CorruptStateError, match="nested"):
        SnapshotIndex.from_json(_deep_json(100), blob=BLOB)
    # Deeper than the json module's own recursion limit.
    with pytest.raises(CorruptStateError, match="invalid JSON"):
        SnapshotIndex.from_json(_deep_json(5000), blob=BLOB)


def _deep_json(depth: int) -> bytes:
    # Built as text: json.dumps itself would hit the recursion limit.
    empty = '"filesPresent":[],"filesRemoved":[],"subDirectoriesRemoved":[]'
    inner = f'{{"dirName":"d",{empty},"subDirectoriesPresent":[]}}'
    for _ in range(depth):
        inner = f'{{"dirName":"d",{empty},"subDirectoriesPresent":[{inner}]}}'
    inner = inner.replace('"dirName":"d"', '"dirName":""', 1)
    head = sample_index().to_json().decode()
    start = head.index('"dirIndex":') + len('"dirIndex":')
    end = head.index(',"metadata"')
    return (head[:start] + inner + head[end:]).encode()


TOP_FIELDS = ["checkpointId", "createdTimeMs", "metadata", "dirIndex", "prevSnapshotIndexBlobId"]
FILE_FIELDS = ["fileName", "blobs", "sizeInBytes", "mtime", "ctime", "crc", "attribs"]
DIR_FIELDS = ["dirName", "filesPresent", "filesRemoved", "subDirectoriesPresent"]


@pytest.mark.parametrize("field", [*TOP_FIELDS, "schemaVersion"])
def test_missing_top_level_field_is_rejected(field: str) -> None:
    doc = sample_doc()
    del doc[field]
    rejected(doc, field)


@pytest.mark.parametrize("field", FILE_FIELDS)
def test_missing_file_field_is_rejected(field: str) -> None:
    doc = sample_doc()
    del doc["dirIndex"]["filesPresent"][0][field]
    rejected(doc, field, "$.dirIndex.filesPresent[0]")


@pytest.mark.parametrize("field", DIR_FIELDS)
def test_missing_dir_field_is_rejected(field: str) -> None:
    doc = sample_doc()
    del doc["dirIndex"]["subDirectoriesPresent"][0][field]
    rejected(doc, field)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("checkpointId",), 5),
        (("checkpointId",), "not a uuid!"),
        (("createdTimeMs",), "1"),
        (("createdTimeMs",), -1),
        (("metadata", "operator"), 1),
        (("metadata", "operator"), "_bad"),
        (("metadata", "partition"), -1),
        (("metadata", "version"), 1.5),
        (("dirIndex", "filesPresent"), {}),
        (("dirIndex", "filesPresent", 0, "sizeInBytes"), -1),
        (("dirIndex", "filesPresent", 0, "sizeInBytes"), True),
        (("dirIndex", "filesPresent", 0, "crc"), 2**32),
        (("dirIndex", "filesPresent", 0, "crc"), -1),
        (("dirIndex", "filesPresent", 0, "attribs"), 0o4755),
        (("dirIndex", "filesPresent", 0, "mtime"), 2**63),
        (("dirIndex", "filesPresent", 0, "ctime"), None),
        (("dirIndex", "filesPresent", 0, "blobs"), "b"),
        (("dirIndex", "filesPresent", 0, "blobs", 0), ["b", 0]),
        (("dirIndex", "filesPresent", 0, "blobs", 0, "offset"), "0"),
        (("dirIndex", "subDirectoriesPresent", 0), []),
        (("prevSnapshotIndexBlobId",), 3),
    ],
)
def test_mistyped_or_out_of_range_field_is_rejected(path: tuple[Any, ...], value: object) -> None:
    doc = sample_doc()
    node = doc
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    message = rejected(doc)
    assert "expected" in message or "must be" in message  # layout's operator/partition checks


@pytest.mark.parametrize(
    "where", [(), ("metadata",), ("dirIndex",), ("dirIndex", "filesPresent", 0)]
)
def test_unknown_field_is_rejected(where: tuple[Any, ...]) -> None:
    doc = sample_doc()
    node = doc
    for step in where:
        node = node[step]
    node["surprise"] = 1
    rejected(doc, "unknown", "surprise")


@pytest.mark.parametrize(
    "prev",
    [
        layout.snapshot_index_key("op", 1, 3),  # another partition
        layout.snapshot_index_key("other", 0, 3),  # another operator
        layout.snapshot_index_key("op", 0, 5),  # not older
        layout.snapshot_index_key("op", 0, 9),
        layout.changelog_key("op", 0, 3),
        "../../etc/passwd",
        "",
    ],
)
def test_previous_index_must_be_an_older_snapshot_of_the_same_store(prev: str) -> None:
    doc = sample_doc()
    doc["prevSnapshotIndexBlobId"] = prev
    rejected(doc, "prevSnapshotIndexBlobId")


# -- offsets ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("offsets", "size"),
    [
        ([1], 10),  # does not start at 0
        ([0, 0], 10),  # empty chunk
        ([0, 5, 3], 10),  # not increasing
        ([0, 10], 10),  # last chunk empty: offsets do not add up to the size
        ([0, 12], 10),  # beyond the end
        ([0], 0),  # an empty file has no chunks
        ([], 10),  # bytes with no blobs
        ([-1, 3], 10),
    ],
)
def test_offsets_must_tile_the_file(offsets: list[int], size: int) -> None:
    doc = sample_doc()
    entry = doc["dirIndex"]["filesPresent"][0]
    entry["blobs"] = [{"blobId": f"b{i}", "offset": o} for i, o in enumerate(offsets)]
    entry["sizeInBytes"] = size
    rejected(doc, "$.dirIndex.filesPresent[0]", "expected")
    blobs = tuple(FileBlob(blob_id=f"b{i}", offset=max(o, 0)) for i, o in enumerate(offsets))
    if min(offsets, default=0) >= 0:
        with pytest.raises(ValueError, match="expected"):
            file_index(size=size, blobs=blobs)


def test_multi_chunk_offsets_are_accepted() -> None:
    doc = sample_doc()
    entry = doc["dirIndex"]["filesPresent"][0]
    entry["blobs"] = [{"blobId": "a", "offset": 0}, {"blobId": "b", "offset": 7}]
    entry["sizeInBytes"] = 8
    assert parse(doc).dir_index.files_present[0].chunk_sizes() == (7, 1)


# -- unsafe names ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", UNSAFE_NAMES)
@pytest.mark.parametrize(
    "where",
    [
        ("filesPresent", 0, "fileName"),
        ("filesRemoved", 0, "fileName"),
        ("subDirectoriesPresent", 0, "dirName"),
        ("subDirectoriesRemoved", 0, "dirName"),
        ("subDirectoriesPresent", 0, "filesPresent", 0, "fileName"),
        ("subDirectoriesPresent", 0, "subDirectoriesPresent", 0, "dirName"),
    ],
)
def test_unsafe_names_are_rejected(name: str, where: tuple[Any, ...]) -> None:
    doc = sample_doc()
    node = doc["dirIndex"]
    for step in where[:-1]:
        node = node[step]
    node[where[-1]] = name
    rejected(doc, "expected")


@pytest.mark.parametrize("name", UNSAFE_NAMES)
def test_constructors_refuse_unsafe_names(name: str) -> None:
    with pytest.raises(ValueError, match="expected"):
        file_index(name, blobs=(FileBlob(blob_id="b", offset=0),))
    if name:  # "" is the root directory's name
        with pytest.raises(ValueError, match="expected"):
            DirIndex(dir_name=name)
    with pytest.raises(ValueError, match="expected"):
        DirIndex(dir_name="", sub_directories_present=(DirIndex(dir_name=""),))


@pytest.mark.parametrize("blob_id", UNSAFE_BLOB_IDS)
def test_unsafe_blob_ids_are_rejected(blob_id: str) -> None:
    doc = sample_doc()
    doc["dirIndex"]["filesPresent"][0]["blobs"][0]["blobId"] = blob_id
    rejected(doc, "blob id")
    with pytest.raises(ValueError, match="blob id"):
        FileBlob(blob_id=blob_id, offset=0)


def test_root_directory_must_be_named_empty() -> None:
    doc = sample_doc()
    doc["dirIndex"]["dirName"] = "root"
    rejected(doc, "dirIndex")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["filesPresent"].append(dict(d["filesPresent"][0])),
        lambda d: d["subDirectoriesPresent"][0].update(dirName="CURRENT"),
        lambda d: d["filesRemoved"].append(dict(d["filesRemoved"][0])),
    ],
)
def test_duplicate_names_in_a_directory_are_rejected(mutate: Any) -> None:
    doc = sample_doc()
    mutate(doc["dirIndex"])
    rejected(doc, "duplicate")


def test_package_all_is_sorted() -> None:
    assert snap.__all__ == sorted(snap.__all__, key=lambda n: (not n.isupper(), n))
    for name in snap.__all__:
        assert hasattr(snap, name)


@settings(max_examples=300)
@given(name=st.text(st.characters(codec=None), max_size=12) | st.sampled_from(UNSAFE_NAMES))
def test_any_accepted_name_is_one_component_below_its_parent(name: str) -> None:
    doc = sample_doc()
    doc["dirIndex"]["subDirectoriesPresent"][0]["filesPresent"][0]["fileName"] = name
    try:
        index = parse(doc)
    except CorruptStateError:
        return
    (rel, _), *_ = [(r, f) for r, f in iter_files(index.dir_index) if r.startswith("sub/")]
    parent = PurePosixPath("/target/sub")
    joined = PurePosixPath(os.path.normpath(parent / rel.removeprefix("sub/")))
    assert joined.parent == parent
    assert PureWindowsPath(name).name == name  # no drive or separator on Windows either


def test_a_changed_digit_anywhere_fails_the_index_checksum() -> None:
    data = sample_index().to_json()
    doc = json.loads(data)
    doc["createdTimeMs"] += 1  # still a valid document, but not the one written
    with pytest.raises(CorruptStateError, match="checksum mismatch"):
        SnapshotIndex.from_json(json.dumps(doc).encode(), blob=BLOB)
    assert SnapshotIndex.from_json(seal(doc), blob=BLOB).created_time_ms == doc["createdTimeMs"]


# -- identity (schema 2): rootId and attempt in the metadata --------------------------------


def identified_index() -> SnapshotIndex:
    meta = SnapshotMetadata(operator="op", partition=0, version=5, root_id="r00t", attempt="a1")
    return sample_index(metadata=meta)


def test_schema_2_round_trip_names_root_and_attempt() -> None:
    index = identified_index()
    assert index.schema_version == 2
    doc = json.loads(index.to_json())
    assert doc["schemaVersion"] == 2
    assert doc["metadata"] == {
        "operator": "op", "partition": 0, "version": 5, "rootId": "r00t", "attempt": "a1",
    }  # fmt: skip
    assert SnapshotIndex.from_json(index.to_json(), blob=BLOB) == index
    assert sample_index().schema_version == 1  # no identity: what statekeeper 0.1 wrote


@pytest.mark.parametrize("field", ["rootId", "attempt"])
def test_schema_2_requires_both_identity_fields(field: str) -> None:
    doc = json.loads(identified_index().to_json())
    del doc["metadata"][field]
    rejected(doc, "$.metadata", "missing", field)


def test_schema_1_refuses_identity_fields() -> None:
    doc = sample_doc()
    doc["metadata"]["rootId"] = "r00t"
    rejected(doc, "$.metadata", "unknown", "rootId")


@pytest.mark.parametrize(
    ("root_id", "attempt"), [("", "a1"), ("r" * 256, "a1"), ("r00t", "bad/attempt"), ("r", None)]
)
def test_bad_identity_is_refused(root_id: str, attempt: str | None) -> None:
    with pytest.raises((TypeError, ValueError)):
        SnapshotMetadata(operator="op", partition=0, version=5, root_id=root_id, attempt=attempt)


def test_check_metadata_names_expected_and_found() -> None:
    index = identified_index()
    same = SnapshotMetadata(operator="op", partition=0, version=5, root_id="r00t", attempt="a1")
    check_metadata(index, blob=BLOB, expected=same, anonymous_ok=False)
    other = SnapshotMetadata(operator="op", partition=1, version=5, root_id="r00t", attempt="a1")
    with pytest.raises(CorruptStateError) as info:
        check_metadata(index, blob=BLOB, expected=other, anonymous_ok=False)
    assert f"expected {other.describe()}, found {index.metadata.describe()}" in str(info.value)
    with pytest.raises(CorruptStateError, match="schema 1: no root id or attempt"):
        check_metadata(sample_index(), blob=BLOB, expected=same, anonymous_ok=False)
    check_metadata(sample_index(), blob=BLOB, expected=same, anonymous_ok=True)
