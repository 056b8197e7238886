"""Store manifests (format 2): one authority per version, fenced zombies, re-runs, lineage."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import google_crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statekeeper import layout
from statekeeper.errors import (
    CommitConflictError,
    CorruptStateError,
    OwnerConflictError,
    StateNotFoundError,
)
from statekeeper.manifest import (
    PLAIN_ORDER,
    RETIRED_KEPT,
    Order,
    SnapshotEntry,
    StoreManifest,
    apply,
    chain,
    decide,
    decode_manifest,
    encode_manifest,
    names_snapshot,
    read_newest_manifest,
    retire,
    with_base,
    with_snapshot,
    write_manifest,
)
from statekeeper.storage import LocalBlobStore
from tests.blobstores import RecordingBlobStore

ROOT = "r" * 32


def empty() -> StoreManifest:
    return StoreManifest(seq=0, root_id=ROOT, operator="ops", partition=3)


def commit(
    m: StoreManifest, parent: int, attempt: str, order: Order = PLAIN_ORDER, owner: str = ""
) -> StoreManifest:
    decision = decide(m, parent=parent, attempt=attempt, order=order, owner=owner)
    blob = layout.attempt_changelog_key("ops", 3, decision.version, attempt)
    return apply(
        m, decision, attempt=attempt, order=order, kind="changelog", blob=blob, now_ms=1,
        owner=owner,
    )  # fmt: skip


def attempts(m: StoreManifest) -> list[tuple[int, str, str]]:
    return [(e.version, e.attempt, e.parent_attempt) for e in m.versions]


def test_commits_append_a_linear_chain_with_lineage() -> None:
    m = commit(commit(commit(empty(), 0, "a"), 1, "b"), 2, "c")
    assert (m.seq, m.latest) == (3, 3)
    assert attempts(m) == [(1, "a", ""), (2, "b", "a"), (3, "c", "b")]


def test_a_newer_attempt_replaces_the_newest_version_until_something_is_built_on_it() -> None:
    m = commit(commit(empty(), 0, "a", (1, 0, 0, 0)), 1, "b", (1, 0, 0, 0))
    rerun = commit(m, 1, "b2", (1, 0, 0, 1))  # a task retry of batch 1
    assert attempts(rerun) == [(1, "a", ""), (2, "b2", "a")]
    fixed = commit(rerun, 1, "b3", (2, 0, 0, 0))  # a fixed processor, restarted query
    assert attempts(fixed) == [(1, "a", ""), (2, "b3", "a")]
    built = commit(fixed, 2, "c", (2, 0, 0, 0))
    with pytest.raises(CommitConflictError, match="version 2 is final"):
        commit(built, 1, "b4", (3, 0, 0, 0))


def test_a_zombie_never_displaces_a_newer_attempt() -> None:
    m = commit(commit(empty(), 0, "a", (1, 0, 0, 0)), 1, "new", (1, 0, 0, 1))
    with pytest.raises(CommitConflictError, match="zombie"):
        decide(m, parent=1, attempt="old", order=(1, 0, 0, 0))
    with pytest.raises(CommitConflictError, match="zombie"):  # not even a new version
        decide(m, parent=2, attempt="old", order=(1, 0, 0, 0))
    assert m.fence == (1, 0, 0, 1)


def test_an_attempt_built_on_a_replaced_version_is_refused() -> None:
    """A store that loaded version 1 of attempt ``a``, which a re-run (``b``) then
    replaced: its changes were made on ``a``'s content, so it may neither append version 2
    nor replace it; built on ``b`` it may. Version 0 (no entry) has nothing to compare."""
    m = commit(commit(empty(), 0, "a", (1, 0, 0, 0)), 0, "b", (2, 0, 0, 0))
    assert attempts(m) == [(1, "b", "")]
    with pytest.raises(CommitConflictError, match="was built on version 1 of attempt a"):
        decide(m, parent=1, attempt="c", order=(2, 1, 0, 0), parent_attempt="a")
    assert decide(m, parent=1, attempt="c", order=(2, 1, 0, 0), parent_attempt="b").action == (
        "append"
    )
    m = commit(m, 1, "c", (2, 1, 0, 0))
    with pytest.raises(CommitConflictError, match="now attempt b"):  # a replace, on a
        decide(m, parent=1, attempt="d", order=(3, 0, 0, 0), parent_attempt="a")
    assert decide(m, parent=1, attempt="d", order=(3, 0, 0, 0), parent_attempt="b").action == (
        "replace"
    )
    fresh = empty()  # version 0, the empty store, has no entry and no attempt to compare
    assert decide(fresh, parent=0, attempt="e", order=PLAIN_ORDER, parent_attempt="x").action == (
        "append"
    )


def test_equal_orders_do_not_replace_each_other_but_a_retry_is_idempotent() -> None:
    m = commit(empty(), 0, "a")
    with pytest.raises(CommitConflictError, match="is not newer"):
        decide(m, parent=0, attempt="b", order=PLAIN_ORDER)
    assert decide(m, parent=0, attempt="a", order=PLAIN_ORDER).action == "done"
    with pytest.raises(StateNotFoundError, match="newest committed version is 1"):
        decide(m, parent=5, attempt="c", order=PLAIN_ORDER)


def test_an_owner_never_replaces_or_builds_on_another_owners_version() -> None:
    """Query ``B`` (a fresh checkpointLocation, so its batch 0 loads version 0 again) on an
    operator where query ``A`` committed one version: B's newer order would replace A's
    version 1 as a re-run; it is refused, and A goes on. An owner builds on its own
    versions and on ownerless ones (the plain API, entries written before owners)."""
    m = commit(empty(), 0, "a1", (1, 0, 0, 0), owner="A")
    assert m.versions[0].owner == "A"
    refused = r"belongs to owner 'A'.*of owner 'B' may not replace"
    with pytest.raises(OwnerConflictError, match=refused):
        decide(m, parent=0, attempt="b1", order=(2, 0, 0, 0), owner="B")
    assert decide(m, parent=0, attempt="a2", order=(2, 0, 0, 0), owner="A").action == "replace"
    with pytest.raises(OwnerConflictError, match="may not build on"):
        decide(m, parent=1, attempt="b2", order=(2, 0, 0, 0), owner="B")
    m = commit(m, 1, "a2", (2, 0, 0, 0), owner="A")
    m = commit(m, 2, "p", (2, 1, 0, 0))  # no owner: anyone's, and it builds on A's
    assert [e.owner for e in m.versions] == ["A", "A", ""]
    assert decide(m, parent=3, attempt="b3", order=(3, 0, 0, 0), owner="B").action == "append"
    with pytest.raises(OwnerConflictError, match="version 2 belongs to owner 'A'"):
        decide(m, parent=2, attempt="b4", order=(3, 0, 0, 0), owner="B")
    with pytest.raises(CommitConflictError, match="zombie"):  # the fence comes first
        decide(m, parent=2, attempt="b5", order=(1, 0, 0, 0), owner="B")


def test_an_owner_round_trips_and_an_ownerless_entry_is_written_as_before() -> None:
    m = commit(commit(empty(), 0, "a", (1, 0, 0, 0), owner="query-1"), 1, "b", (1, 0, 0, 0))
    data = encode_manifest(m)
    key = layout.manifest_key("ops", 3, m.seq)
    assert decode_manifest(data, blob=key, root_id=ROOT, operator="ops", partition=3) == m
    doc = json.loads(data)
    assert [e.get("owner") for e in doc["versions"]] == ["query-1", None]


def test_a_replaced_versions_snapshot_is_dropped() -> None:
    m = commit(empty(), 0, "a", (1, 0, 0, 0))
    d = decide(m, parent=1, attempt="s", order=(1, 0, 0, 0))
    key = layout.attempt_snapshot_key("ops", 3, 2, "s")
    m = apply(m, d, attempt="s", order=(1, 0, 0, 0), kind="snapshot", blob=key, now_ms=1)
    assert [s.version for s in m.snapshots] == [2]
    m = commit(m, 1, "t", (1, 0, 0, 1))
    assert m.snapshots == ()
    assert [e.version for e in chain(m, 2)] == [1, 2]


def _snapshot_every_version(count: int) -> StoreManifest:
    """Versions 1..count, each registered as a snapshot."""
    m = empty()
    for v in range(1, count + 1):
        m = commit(m, v - 1, f"a{v}")
        key = layout.attempt_snapshot_key("ops", 3, v, f"a{v}")
        registered = with_snapshot(m, SnapshotEntry(v, f"a{v}", key))
        assert registered is not None
        m = registered
    return m


def test_a_manifest_names_at_most_the_most_recently_retired_snapshots() -> None:
    """However many snapshots a base advance retires, a manifest names the newest
    RETIRED_KEPT of them (and forgets those past their grace): its size does not grow with
    the age of the store."""
    m = _snapshot_every_version(3 * RETIRED_KEPT)
    m = with_base(m, 2 * RETIRED_KEPT, now_ms=100, forget_before_ms=0)
    retired = [layout.commit_blob_version(r.index_blob) for r in m.retired]
    assert retired == list(range(RETIRED_KEPT, 2 * RETIRED_KEPT))
    m = with_base(m, 2 * RETIRED_KEPT + 3, now_ms=200, forget_before_ms=150)
    assert [layout.commit_blob_version(r.index_blob) for r in m.retired] == [32, 33, 34]
    assert retire(m.retired, (), forget_before_ms=201) == ()
    size = len(encode_manifest(with_base(m, 3 * RETIRED_KEPT, now_ms=300, forget_before_ms=0)))
    many = _snapshot_every_version(10 * RETIRED_KEPT)
    for base in range(RETIRED_KEPT, 10 * RETIRED_KEPT + 1, RETIRED_KEPT):
        many = with_base(many, base, now_ms=300, forget_before_ms=0)
    assert len(many.retired) == RETIRED_KEPT
    assert len(encode_manifest(many)) <= size + 100


def test_a_snapshot_that_reused_files_of_one_no_longer_named_is_not_registered() -> None:
    """GC keeps the files of every snapshot a manifest names, registered or retired, and no
    others: a snapshot built on the files of one the manifest no longer names may lack
    them, so it is not registered."""
    m = _snapshot_every_version(RETIRED_KEPT + 3)
    first = layout.attempt_snapshot_key("ops", 3, 1, "a1")
    m = commit(m, m.latest, "next")
    entry = SnapshotEntry(m.latest, "next", layout.attempt_snapshot_key("ops", 3, m.latest, "x"))
    assert with_snapshot(m, entry, reused=first) is not None  # registered
    m = with_base(m, 2, now_ms=1, forget_before_ms=0)
    assert names_snapshot(m, first)  # retired
    assert with_snapshot(m, entry, reused=first) is not None
    m = with_base(m, RETIRED_KEPT + 2, now_ms=2, forget_before_ms=0)
    assert not names_snapshot(m, first)  # forgotten: beyond the RETIRED_KEPT newest
    assert with_snapshot(m, entry, reused=first) is None
    assert with_snapshot(m, entry) is not None  # a full upload reused nothing


def test_chain_starts_at_the_newest_snapshot_at_or_below_the_version() -> None:
    m = commit(empty(), 0, "a")
    d = decide(m, parent=1, attempt="s", order=PLAIN_ORDER)
    key = layout.attempt_snapshot_key("ops", 3, 2, "s")
    m = apply(m, d, attempt="s", order=PLAIN_ORDER, kind="snapshot", blob=key, now_ms=1)
    m = commit(commit(m, 2, "c"), 3, "d")
    assert [e.version for e in chain(m, 4)] == [3, 4]
    assert [e.version for e in chain(m, 1)] == [1]
    with pytest.raises(StateNotFoundError, match="version 9"):
        chain(m, 9)


def test_encoding_round_trips_and_every_byte_is_checked() -> None:
    m = commit(commit(empty(), 0, "a", (3, 5, 1, 2)), 1, "b", (3, 5, 1, 2))
    data = encode_manifest(m)
    key = layout.manifest_key("ops", 3, m.seq)
    assert decode_manifest(data, blob=key, root_id=ROOT, operator="ops", partition=3) == m
    tampered = data.replace(b'"attempt":"b"', b'"attempt":"x"')
    with pytest.raises(CorruptStateError, match="checksum mismatch"):
        decode_manifest(tampered, blob=key, root_id=ROOT, operator="ops", partition=3)


def test_a_manifest_of_another_store_or_root_is_refused_naming_both() -> None:
    m = commit(empty(), 0, "a")
    data = encode_manifest(m)
    key = layout.manifest_key("ops", 4, m.seq)
    with pytest.raises(CorruptStateError, match=r"store ops/3.*expected root .* store ops/4"):
        decode_manifest(data, blob=key, root_id=ROOT, operator="ops", partition=4)
    with pytest.raises(CorruptStateError, match=r"belongs to root r+"):
        decode_manifest(data, blob=key, root_id="other", operator="ops", partition=3)
    wrong_seq = layout.manifest_key("ops", 3, 7)
    with pytest.raises(CorruptStateError, match="seq 7"):
        decode_manifest(data, blob=wrong_seq, root_id=ROOT, operator="ops", partition=3)


def test_a_broken_chain_is_refused_even_with_a_valid_checksum() -> None:
    m = commit(commit(empty(), 0, "a"), 1, "b")
    doc = json.loads(encode_manifest(m))
    doc["versions"][1]["parentAttempt"] = "zz"
    del doc["crc32c"]
    doc["crc32c"] = google_crc32c.value(
        json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    )
    data = json.dumps(doc).encode()
    with pytest.raises(CorruptStateError, match="names parent 'zz'"):
        decode_manifest(data, blob="x", root_id=ROOT, operator="ops", partition=3)


def test_newest_manifest_falls_back_past_a_damaged_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blobs = LocalBlobStore(str(tmp_path / "root"))
    assert read_newest_manifest(blobs, root_id=ROOT, operator="ops", partition=3) is None
    m1 = commit(empty(), 0, "a")
    m2 = commit(m1, 1, "b")
    write_manifest(blobs, m1)
    write_manifest(blobs, m2)
    assert read_newest_manifest(blobs, root_id=ROOT, operator="ops", partition=3) == m2
    path = tmp_path / "root" / layout.manifest_key("ops", 3, 2)
    path.chmod(0o644)
    path.write_bytes(path.read_bytes()[:-5])
    assert read_newest_manifest(blobs, root_id=ROOT, operator="ops", partition=3) == m1
    assert layout.manifest_key("ops", 3, 2) in caplog.text
    (tmp_path / "root" / layout.manifest_key("ops", 3, 1)).write_bytes(b"{}")
    with pytest.raises(CorruptStateError, match="no manifest of store ops/3 is readable"):
        read_newest_manifest(blobs, root_id=ROOT, operator="ops", partition=3)


class _CutShort(RecordingBlobStore):
    """Returns the first ``times`` reads of ``key`` cut in half, as a proxy that rewrote
    the length would."""

    def __init__(self, inner: LocalBlobStore, key: str, times: int) -> None:
        super().__init__(inner)
        self.key, self.times = key, times

    def get(self, key: str) -> bytes:
        data = super().get(key)
        if key == self.key and self.times > 0:
            self.times -= 1
            return data[: len(data) // 2]
        return data


@pytest.mark.parametrize(("cut", "newest"), [(1, 2), (2, 2), (3, 1)])
def test_a_manifest_read_short_is_read_again_before_it_is_skipped(
    tmp_path: Path, cut: int, newest: int
) -> None:
    """Found by review: one short read of the newest manifest skipped it, so its version
    looked never committed; a Spark task then committed it empty over the real one, and a
    GC wrote a manifest past it (the version lost). Only what fails three reads is damage."""
    inner = LocalBlobStore(str(tmp_path / "root"))
    m1 = commit(empty(), 0, "a")
    write_manifest(inner, m1)
    write_manifest(inner, commit(m1, 1, "b"))
    blobs = _CutShort(inner, layout.manifest_key("ops", 3, 2), cut)
    skipped: list[str] = []
    found = read_newest_manifest(blobs, root_id=ROOT, operator="ops", partition=3, skipped=skipped)
    assert found is not None
    assert found.seq == newest
    assert len(skipped) == 2 - newest
    assert blobs.counts()["get"] == min(cut + 1, 3) + (newest == 1)


def test_two_writers_racing_for_one_manifest_cannot_both_win(tmp_path: Path) -> None:
    blobs = LocalBlobStore(str(tmp_path / "root"))
    base = commit(empty(), 0, "a")
    write_manifest(blobs, base)
    results: list[str] = []
    barrier = threading.Barrier(2)

    def writer(name: str) -> None:
        m = commit(base, 1, name)
        barrier.wait()
        try:
            write_manifest(blobs, m)
            results.append(name)
        except CommitConflictError:
            results.append("lost")

    threads = [threading.Thread(target=writer, args=(n,)) for n in ("x", "y")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results)[0] == "lost"
    assert len(results) == 2
    newest = read_newest_manifest(blobs, root_id=ROOT, operator="ops", partition=3)
    assert newest is not None
    assert newest.entry(2) is not None
    assert newest.entry(2).attempt in results  # type: ignore[union-attr]


Step = tuple[int, int]  # (how far back the attempt loaded, its generation)


@settings(max_examples=300)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3)), max_size=30))
def test_any_history_keeps_one_linear_chain_and_never_lets_an_older_order_win(
    steps: list[Step],
) -> None:
    m = empty()
    for i, (back, generation) in enumerate(steps):
        parent = max(0, m.latest - back)
        order: Order = (generation, 0, 0, i)
        before, encoded = m, encode_manifest(m)
        try:
            m = commit(m, parent, f"t{i}", order)
        except (CommitConflictError, StateNotFoundError):
            assert encode_manifest(before) == encoded  # a refused commit changed nothing
            continue
        assert order >= before.fence  # an older attempt never wrote
        entry = m.entry(parent + 1)
        assert entry is not None
        assert entry.attempt == f"t{i}"
        # Nothing below the committed version changed: final versions stay final.
        assert m.versions[:parent] == before.versions[:parent]
        for older, newer in zip(m.versions, m.versions[1:], strict=False):
            assert newer.parent_attempt == older.attempt
        again = decode_manifest(
            encode_manifest(m),
            blob=layout.manifest_key("ops", 3, m.seq),
            root_id=ROOT,
            operator="ops",
            partition=3,
        )
        assert again == m


def test_docs_format_names_every_field_of_a_manifest() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "format.md").read_text()
    section = text[text.index("## Store manifests, format 2") :]
    m = commit(empty(), 0, "a")
    doc = json.loads(encode_manifest(m))
    fields = set(doc) | set(doc["versions"][0]) | {"indexBlob"}
    assert {f for f in fields if f"`{f}`" not in section} == set()
