"""StateStore and StateBackend: the public API of ARCHITECTURE §3 on a real RocksDB."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

import statekeeper as sk
from statekeeper import layout
from statekeeper.changelog import decode_changelog


@pytest.fixture
def backend(tmp_path: Path) -> sk.StateBackend:
    config = sk.StoreConfig(local_dir=str(tmp_path / "local"))
    return sk.StateBackend(str(tmp_path / "root"), config=config)


def test_fresh_store_is_version_zero_and_empty(backend: sk.StateBackend) -> None:
    with backend.open("sessions", partition=0) as store:
        assert store.version == 0
        assert store.get(b"a") is None
        assert list(store.scan()) == []
    assert backend.versions("sessions", 0) == [0]


def test_reads_see_own_writes_and_commit_advances(backend: sk.StateBackend) -> None:
    with backend.open("sessions", partition=0) as store:
        store.put(b"a", b"1")
        store.put(b"b", b"")
        store.put(b"c", b"3")
        store.delete(b"c")
        assert store.get(b"a") == b"1"
        assert store.get(b"b") == b""
        assert store.get(b"c") is None
        assert store.multi_get([b"a", b"zz", b"b"]) == [b"1", None, b""]
        info = store.commit()
        assert (info.version, info.puts, info.deletes) == (1, 2, 1)
        assert info.raw_bytes == len(b"a1") + len(b"b") + len(b"c")
        assert layout.parse_attempt_changelog_key(info.blob)[0] == 1  # type: ignore[index]
        assert store.version == 1
        store.put(b"a", b"2")
        store.commit()
    with backend.open("sessions", partition=0) as store:
        assert store.version == 2
        assert store.get(b"a") == b"2"
    with backend.open("sessions", partition=0, version=1) as store:
        assert store.get(b"a") == b"1"
    assert backend.versions("sessions", 0) == [0, 1, 2]


def test_scan_merges_uncommitted_writes_in_key_order(backend: sk.StateBackend) -> None:
    with backend.open("op", partition=1) as store:
        for i in range(3000):  # more than one internal scan chunk
            store.put(b"p/%05d" % i, b"x")
        store.put(b"q", b"other prefix")
        store.commit()
        store.put(b"p/00001", b"changed")
        store.delete(b"p/00002")
        store.put(b"p/99999", b"new")
        store.put(b"p/", b"prefix itself")
        items = list(store.scan(prefix=b"p/"))
        keys = [k for k, _ in items]
        assert keys == sorted(keys)
        assert len(items) == 3000 - 1 + 2
        assert dict(items)[b"p/00001"] == b"changed"
        assert b"p/00002" not in dict(items)
        assert items[0] == (b"p/", b"prefix itself")
        assert items[-1] == (b"p/99999", b"new")
        assert b"q" not in dict(items)
        everything = list(store.scan())
        assert len(everything) == 3000 - 1 + 3
        assert [k for k, _ in everything] == sorted(k for k, _ in everything)
        # From a start key: committed and uncommitted items at or above it, deletes hidden.
        for start in [b"p/00001", b"p/00002", b"p/02999", b"p/5", b"a", b"z"]:
            expected = [(k, v) for k, v in items if k >= start]
            assert list(store.scan(b"p/", start=start)) == expected, start
        with pytest.raises(TypeError, match="start must be bytes"):
            store.scan(b"p/", start="p/1")  # type: ignore[arg-type]


def test_abort_drops_uncommitted_writes(backend: sk.StateBackend) -> None:
    with backend.open("op", partition=0) as store:
        store.put(b"a", b"1")
        store.commit()
        store.put(b"a", b"2")
        store.put(b"b", b"2")
        store.abort()
        assert store.get(b"a") == b"1"
        assert store.get(b"b") is None
        assert store.version == 1


def test_close_without_commit_loses_writes(backend: sk.StateBackend) -> None:
    store = backend.open("op", partition=0)
    store.put(b"a", b"1")
    store.close()
    store.close()  # idempotent
    with backend.open("op", partition=0) as again:
        assert again.get(b"a") is None
        assert again.version == 0
    with pytest.raises(sk.StateKeeperError, match="closed"):
        store.get(b"a")


def test_uncommitted_writes_are_invisible_to_other_readers(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    writer = sk.StateBackend(root, config=sk.StoreConfig(local_dir=str(tmp_path / "w")))
    reader = sk.StateBackend(root, config=sk.StoreConfig(local_dir=str(tmp_path / "r")))
    with writer.open("op", partition=0) as store:
        store.put(b"a", b"1")
        store.commit()
        store.put(b"a", b"uncommitted")
        with reader.open("op", partition=0) as other:
            assert other.get(b"a") == b"1"


def test_second_open_of_same_working_copy_is_refused(backend: sk.StateBackend) -> None:
    with backend.open("op", partition=0), pytest.raises(sk.StateKeeperError, match="already open"):
        backend.open("op", partition=0)
    backend.open("op", partition=0).close()  # released on close


@pytest.mark.parametrize("bad", ["k", 1, None, ["a"]])
def test_non_bytes_keys_and_values_are_refused(backend: sk.StateBackend, bad: object) -> None:
    with backend.open("op", partition=0) as store:
        with pytest.raises(TypeError, match="key must be bytes"):
            store.put(bad, b"v")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="value must be bytes"):
            store.put(b"k", bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="key must be bytes"):  # the key is checked first
            store.put(bad, bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="must be bytes"):
            store.get(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="must be bytes"):
            store.delete(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="empty"):
            store.put(b"", b"v")


@pytest.mark.parametrize(
    ("version", "error"), [(-1, ValueError), (1.5, TypeError), ("3", TypeError), (True, TypeError)]
)
def test_malformed_versions_are_refused(
    backend: sk.StateBackend, version: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match="version"):
        backend.open("op", partition=0, version=version)  # type: ignore[arg-type]


def test_uncommitted_version_is_not_found_and_names_it(backend: sk.StateBackend) -> None:
    with backend.open("op", partition=0) as store:
        store.put(b"a", b"1")
        store.commit()
    with pytest.raises(sk.StateNotFoundError, match="version 5") as excinfo:
        backend.open("op", partition=0, version=5)
    assert isinstance(excinfo.value, FileNotFoundError)
    assert "0-1" in str(excinfo.value)
    with backend.open("op", partition=0) as store:  # nothing committed was touched
        assert store.version == 1
        assert store.get(b"a") == b"1"


@pytest.mark.parametrize("name", ["", "_hidden", "a/b", "..", 3])
def test_bad_operator_names_are_refused(backend: sk.StateBackend, name: object) -> None:
    with pytest.raises((TypeError, ValueError), match="operator name"):
        backend.open(name, partition=0)  # type: ignore[arg-type]


def test_partition_count_is_recorded_and_checked(backend: sk.StateBackend, tmp_path: Path) -> None:
    backend.open("op", partition=0, partitions=4).close()
    with pytest.raises(sk.ConfigMismatchError, match=r"4 partitions.*but 8"):
        backend.open("op", partition=0, partitions=8)
    with pytest.raises(sk.ConfigMismatchError, match="out of range"):
        backend.open("op", partition=4)
    backend.open("op", partition=3).close()  # no count given: the recorded one applies
    doc = json.loads((tmp_path / "root" / layout.ROOT_METADATA).read_text())
    assert doc["operators"] == {"op": {"partitions": 4, "generation": 0, "keyGroups": 4096}}
    assert doc["formatVersion"] == 2


def test_root_of_newer_format_is_refused_clearly(tmp_path: Path) -> None:
    root = tmp_path / "root"
    config = sk.StoreConfig(local_dir=str(tmp_path / "local"))
    sk.StateBackend(str(root), config=config).open("op", 0, partitions=1).close()
    path = root / layout.ROOT_METADATA
    doc = json.loads(path.read_text())
    doc["formatVersion"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(sk.ConfigMismatchError, match=r"format version 99.*upgrade"):
        sk.StateBackend(str(root))


def test_root_metadata_that_is_not_ours_is_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / layout.ROOT_METADATA).write_text("not json")
    with pytest.raises(sk.CorruptStateError, match=layout.ROOT_METADATA):
        sk.StateBackend(str(root))


def test_unreadable_root_uri_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="scheme"):
        sk.StateBackend("ftp://example.com/state")
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(sk.StorageError):
        sk.StateBackend(str(not_a_dir))


def test_identical_recommit_is_accepted_and_different_one_conflicts(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    a = sk.StateBackend(root, config=sk.StoreConfig(local_dir=str(tmp_path / "a")))
    b = sk.StateBackend(root, config=sk.StoreConfig(local_dir=str(tmp_path / "b")))
    first, second = a.open("op", 0), b.open("op", 0)
    first.put(b"k", b"1")
    second.put(b"k", b"1")
    first.commit()
    assert second.commit().version == 1  # a re-run with identical content
    second.put(b"k", b"2")
    first.put(b"k", b"different")
    second.commit()
    with pytest.raises(sk.CommitConflictError, match="version 2"):
        first.commit()
    with pytest.raises(sk.StateKeeperError, match="failed"):
        first.get(b"k")
    first.close()
    second.close()
    with a.open("op", 0) as store:
        assert (store.version, store.get(b"k")) == (2, b"2")


def test_store_config_validates_its_fields() -> None:
    with pytest.raises(ValueError, match="mode"):
        sk.StoreConfig(mode="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="retain_versions"):
        sk.StoreConfig(retain_versions=0)
    with pytest.raises(ValueError, match="orphan_ttl_s"):
        sk.StoreConfig(orphan_ttl_s=-1)
    with pytest.raises(TypeError):
        sk.StoreConfig("changelog")  # type: ignore[misc]


def test_public_names_are_sorted_and_exist() -> None:
    assert sk.__all__ == sorted(sk.__all__)
    for name in sk.__all__:
        assert hasattr(sk, name)
    assert issubclass(sk.StateNotFoundError, FileNotFoundError)
    for error in (sk.CorruptStateError, sk.CommitConflictError, sk.ConfigMismatchError):
        assert issubclass(error, sk.StateKeeperError)


def test_register_operators_and_local_path(backend: sk.StateBackend, tmp_path: Path) -> None:
    assert backend.operators() == {}
    backend.register("op", 3)
    backend.register("op", 3)  # idempotent
    with pytest.raises(sk.ConfigMismatchError, match="3 partitions"):
        backend.register("op", 4)
    with pytest.raises(ValueError, match="partitions"):
        backend.register("op", 0)
    assert backend.operators() == {"op": 3}
    path = backend.local_path("op", 2)
    assert path.startswith(str(tmp_path / "local"))
    with backend.open("op", 2) as store:
        store.put(b"k", b"v")
        store.commit()
    assert Path(path).is_dir()


def test_put_many_is_put_pair_by_pair_and_refuses_a_bad_pair_whole(
    backend: sk.StateBackend,
) -> None:
    """Bulk writes check every pair at once: the same state as ``put`` one by one (a later
    pair wins, views become bytes), and one bad pair anywhere puts nothing."""
    pairs = [(b"a", b"1"), (b"b", memoryview(b"22")), (b"c", bytearray(b"3")), (b"a", b"4")]
    with backend.open("op", partition=0) as store:
        assert store.multi_get([b"a", b"zz"]) == [None, None]  # nothing pending yet
        store.put_many(iter(pairs))
        assert store.multi_get([b"a", b"b", b"c", b"zz"]) == [b"4", b"22", b"3", None]
        assert all(type(v) is bytes for _, v in store.scan())
        for bad, error in [
            ((b"", b"v"), ValueError),
            (("k", b"v"), TypeError),
            ((b"k", "v"), TypeError),
            ((b"k",), ValueError),
        ]:
            with pytest.raises(error):
                store.put_many([(b"x", b"1"), bad, (b"y", b"2")])  # type: ignore[list-item]
        with pytest.raises(TypeError, match="must be bytes"):
            store.multi_get([b"a", "b"])  # type: ignore[list-item]
        assert store.multi_get([b"x", b"y"]) == [None, None]
        store.put_many([])
        store.commit()
    with backend.open("op", partition=0) as store:
        assert dict(store.scan()) == {b"a": b"4", b"b": b"22", b"c": b"3"}


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: s.multi_get(b"k"), "keys must be an iterable of bytes, got one bytes object"),
        (lambda s: s.multi_get(None), "keys must be an iterable of bytes, got NoneType"),
        (lambda s: s.put_many(None), "items must be an iterable of .key, value. pairs, got None"),
        (lambda s: s.put_many([1]), "pairs, or keys and values; got an item of type int"),
        (lambda s: s.put_many(b"kv"), "items must be an iterable of .key, value. pairs, got one"),
        (lambda s: s.put_many([b"k"], None), "got an item of type|pairs, or keys and values"),
        (lambda s: s.put_many(5, [b"v"]), "put_many's keys must be an iterable of bytes, got int"),
        (lambda s: s.put_many([b"k"], b"v"), "put_many's values must be an iterable of bytes"),
    ],
)
def test_bulk_calls_with_something_other_than_an_iterable_of_keys_say_what_they_expected(
    backend: sk.StateBackend, call: Any, message: str
) -> None:
    """``multi_get(b"k")`` once read the bytes as int keys ("key must be bytes, got int") and
    ``put_many(None)`` raised Python's own "'NoneType' object is not iterable"."""
    with backend.open("op", partition=0) as store:
        with pytest.raises((TypeError, ValueError), match=message):
            call(store)
        assert store.multi_get([b"k"]) == [None]


def test_put_many_of_keys_and_values_is_put_many_of_pairs(backend: sk.StateBackend) -> None:
    """The columnar form (keys, values) writes what the pairs would, and refuses columns of
    different lengths or a bad key or value anywhere without putting anything."""
    keys = [b"a", bytearray(b"b"), b"c", b"a"]
    values = [b"1", b"22", memoryview(b"3"), b"4"]
    with backend.open("op", partition=0) as store:
        store.put_many(iter(keys), iter(values))
        assert store.multi_get([b"a", b"b", b"c"]) == [b"4", b"22", b"3"]
        for bad_keys, bad_values, error in [
            ([b"x", b"y"], [b"1"], ValueError),
            ([b"x"], [b"1", b"2"], ValueError),
            ([b"x", b""], [b"1", b"2"], ValueError),
            ([b"x", "y"], [b"1", b"2"], TypeError),
            ([b"x", b"y"], [b"1", None], TypeError),
        ]:
            with pytest.raises(error):
                store.put_many(bad_keys, bad_values)  # type: ignore[arg-type]
        assert store.multi_get([b"x", b"y"]) == [None, None]
        store.put_many([], [])
        store.commit()
    with backend.open("op", partition=0) as store:
        assert dict(store.scan()) == {b"a": b"4", b"b": b"22", b"c": b"3"}


@pytest.mark.parametrize("order", ["ascending", "descending", "one out of place"])
def test_a_commit_writes_its_changelog_in_key_order_however_the_keys_were_put(
    backend: sk.StateBackend, order: str
) -> None:
    """Writes made in key order are committed as they are, others sorted: either way the
    changelog holds every change once, sorted by key, and replays to the same state."""
    keys = [b"k%04d" % i for i in range(500)]
    if order == "descending":
        keys.reverse()
    elif order == "one out of place":
        keys.insert(100, keys.pop(400))
    with backend.open("op", partition=0) as store:
        store.put_many(keys, [k[::-1] for k in keys])
        store.delete(b"k0007")
        info = store.commit()
    body = backend.blobs.get(info.blob)
    records = decode_changelog(body, blob=info.blob).records
    assert [k for k, _ in records] == sorted(keys)
    assert dict(records) == {k: None if k == b"k0007" else k[::-1] for k in keys}
    with backend.open("op", partition=0) as store:
        assert len(dict(store.scan())) == 499


def test_a_partition_beyond_every_possible_count_is_refused_before_anything_is_written(
    backend: sk.StateBackend,
) -> None:
    """With the partition count unset, a partition at or past the operator's key groups
    was opened and committed to: then no count could ever be recorded (it must exceed the
    partition, and may not exceed the key groups). One past 32 bits failed only at commit,
    deep in the changelog header."""
    with pytest.raises(sk.ConfigMismatchError, match=r"partition 4096 .* 4096 key groups"):
        backend.open("free", 4096)
    with pytest.raises(ValueError, match=r"must be in \[0, 2\*\*32 - 1\], got 4294967296"):
        backend.open("free", 2**32)
    with backend.open("free", 4095) as store:
        store.put(b"k", b"v")
        store.commit()
    backend.register("free", 4096)  # the count can still be recorded
    assert backend.operators()["free"] == 4096


def test_a_scan_left_over_from_a_closed_store_stops_and_leaves_the_next_copy_alone(
    backend: sk.StateBackend,
) -> None:
    """A scan generator kept past its store's close, then resumed while the store is open
    again: its read of the closed database failed, was taken for damage, and the copy at
    that path (the reopened store's) was set aside."""
    with backend.open("op", 0) as store:
        store.put_many((b"k%05d" % i, b"v") for i in range(5000))
        store.commit()
    store = backend.open("op", 0)
    scan = store.scan()
    next(scan)
    store.close()
    again = backend.open("op", 0)
    with pytest.raises(sk.StateKeeperError, match=r"is closed: this scan of it cannot go on"):
        list(scan)
    assert again.restore_info.base_kind == "local"
    again.put(b"new", b"1")
    again.commit()
    assert sum(1 for _ in again.scan()) == 5001  # its copy is where it was, and whole
    again.close()
    local = Path(backend.local_path("op", 0)).parent
    assert not [p.name for p in local.iterdir() if ".damaged-" in p.name]


def test_working_copies_or_an_export_inside_a_local_root_are_refused(tmp_path: Path) -> None:
    """GC takes files under the root that no version names for orphans: working copies
    kept inside the root lost files to it and were rebuilt, and an export there would be
    deleted once older than the orphan TTL."""
    root = tmp_path / "root"
    for inside in (root, root / "ops"):
        with pytest.raises(ValueError, match=r"StoreConfig.local_dir .* lies inside the checkp"):
            sk.StateBackend(str(root), config=sk.StoreConfig(local_dir=str(inside)))
    beside = sk.StoreConfig(local_dir=str(tmp_path / "root-local"))  # a name the root prefixes
    with sk.StateBackend(str(root), config=beside) as backend:
        with backend.open("ops", 0, partitions=1) as store:
            store.put(b"k", b"v")
            store.commit()
        with pytest.raises(ValueError, match=r"the export target .* lies inside the checkpoint"):
            backend.export("ops", 0, root / "ops" / "exported")
        assert not (root / "ops" / "exported").exists()
        backend.export("ops", 0, tmp_path / "exported")


@pytest.mark.parametrize("seed", range(40))
def test_scans_see_own_writes_in_key_order_through_any_mix_of_writes(
    tmp_path: Path, seed: int
) -> None:
    """Scans keep the uncommitted writes' keys sorted as they come (one at a time, or many
    at once from put_many), and drop them at commit and abort: every scan equals a model."""
    rng = random.Random(seed)

    def key(longest: int) -> bytes:
        return bytes(rng.randint(0, 3) for _ in range(rng.randint(1, longest)))

    config = sk.StoreConfig(local_dir=str(tmp_path / "local"))
    backend = sk.StateBackend(str(tmp_path / "root"), config=config)
    model: dict[bytes, bytes] = {}
    committed: dict[bytes, bytes] = {}
    with backend.open("op", 0) as store:
        for _ in range(250):
            r = rng.random()
            if r < 0.45:
                k, v = key(4), bytes([rng.randint(0, 255)])
                store.put(k, v)
                model[k] = v
            elif r < 0.6:
                k = key(4)
                store.delete(k)
                model.pop(k, None)
            elif r < 0.65:  # sometimes more keys than are sorted in one by one
                many = [key(3) for _ in range(rng.randint(0, 150))]
                store.put_many([(k, b"m") for k in many])
                model.update(dict.fromkeys(many, b"m"))
            elif r < 0.7:
                store.commit()
                committed = dict(model)
            elif r < 0.72:
                store.abort()
                model = dict(committed)
            else:
                prefix = key(2)[: rng.randint(0, 2)]
                start = None if rng.random() < 0.5 else key(3)
                expected = sorted(
                    (k, v)
                    for k, v in model.items()
                    if k.startswith(prefix) and (start is None or k >= start)
                )
                assert list(store.scan(prefix, start=start)) == expected
    backend.close()
