"""The change feed: the changes of versions a..b applied to the state at a give the state at b.

Random histories are written to a real root (real RocksDB, local blob store): raw puts and
deletes, and a keyed processor's value, map and list states with TTL expiry and timers, some
versions committed in snapshot mode (no changelog: the feed falls back to the difference of
two restored versions there). For every pair of versions the raw feed and the decoded feed
are applied to the state read at ``a`` and compared with the state read at ``b``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import statekeeper as sk
from statekeeper.history import ChangeStretch
from statekeeper.keyed import (
    TIMER_STATE,
    ChangeDecoder,
    StatefulProcessorHandle,
    iter_state,
    iter_timers,
    read_operator_record,
)
from statekeeper.store import StoreChange, StoreChanges
from statekeeper.store._store_changes import diff_items

OP = "op"
GROUPS = 16
KEYS = [("a",), ("b",), ("c",), ("d",)]


def _backend(tmp: Path, mode: str, n: int) -> sk.StateBackend:
    config = sk.StoreConfig(local_dir=str(tmp / f"local-{n}"), mode=mode)
    return sk.StateBackend(str(tmp / "root"), config=config)


def _items(backend: sk.StateBackend, version: int) -> dict[bytes, bytes]:
    with backend.open(OP, 0, version) as store:
        return dict(store.scan())


def _apply(items: dict[bytes, bytes], changes: list[StoreChange]) -> dict[bytes, bytes]:
    out = dict(items)
    for change in changes:
        if change.value is None:
            out.pop(change.key, None)
        else:
            out[change.key] = change.value
    return out


def _feed(backend: sk.StateBackend, a: int, b: int) -> StoreChanges:
    return StoreChanges.open(backend, OP, 0, from_version=a, to_version=b)


# -- raw stores ---------------------------------------------------------------------------

_raw_commit = st.tuples(
    st.sampled_from(["changelog", "snapshot"]),
    st.lists(
        st.tuples(st.binary(min_size=1, max_size=3), st.one_of(st.none(), st.binary(max_size=4))),
        max_size=8,
    ),
)


@settings(
    max_examples=25,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(commits=st.lists(_raw_commit, min_size=1, max_size=7), data=st.data())
def test_raw_feed_of_a_to_b_applied_to_a_is_b(
    tmp_path_factory: pytest.TempPathFactory,
    commits: list[tuple[str, list[Any]]],
    data: st.DataObject,
) -> None:
    tmp = tmp_path_factory.mktemp("raw")
    model: list[dict[bytes, bytes]] = [{}]
    backends = {mode: _backend(tmp, mode, i) for i, mode in enumerate(("changelog", "snapshot"))}
    for mode, writes in commits:
        with backends[mode].open(OP, 0, partitions=1) as store:
            state = dict(model[-1])
            for key, value in writes:
                if value is None:
                    store.delete(key)
                    state.pop(key, None)
                else:
                    store.put(key, value)
                    state[key] = value
            store.commit()
            model.append(state)
    a = data.draw(st.integers(0, len(commits)), label="a")
    b = data.draw(st.integers(a, len(commits)), label="b")
    snapshot_mode = {v for v, (m, _) in enumerate(commits, 1) if m == "snapshot"}
    backends["snapshot"].close()
    with backends["changelog"] as backend:
        assert _items(backend, a) == model[a]
        assert _items(backend, b) == model[b]
        feed = _feed(backend, a, b)
        changes = list(feed)
        assert _apply(model[a], changes) == model[b], feed.stretches
        assert all(a < c.version <= b for c in changes)
        assert [c.version for c in changes] == sorted(c.version for c in changes)
        logged = {
            v for s in feed.stretches if s.from_changelogs for v in range(s.start + 1, s.end + 1)
        }
        assert logged == set(range(a + 1, b + 1)) - snapshot_mode


def test_stretches_follow_the_changelogs_and_bridge_snapshot_commits(tmp_path: Path) -> None:
    for n, mode in enumerate(["changelog", "changelog", "snapshot", "snapshot", "changelog"]):
        with _backend(tmp_path, mode, n) as backend, backend.open(OP, 0, partitions=1) as store:
            store.put(b"k", b"%d" % n)
            store.commit()
    with _backend(tmp_path, "changelog", 9) as backend:
        feed = _feed(backend, 1, 5)
        assert feed.stretches == (
            ChangeStretch(1, 2, True),
            ChangeStretch(2, 4, False),
            ChangeStretch(4, 5, True),
        )
        assert feed.restores
        assert [(c.version, c.value) for c in feed] == [(2, b"1"), (4, b"3"), (5, b"4")]
        assert len(feed.changelog_keys()) == 2
        assert not _feed(backend, 0, 2).restores
        assert list(_feed(backend, 3, 3)) == []


def test_a_version_gc_collected_or_never_committed_is_named(tmp_path: Path) -> None:
    config = sk.StoreConfig(local_dir=str(tmp_path / "l"), snapshot_every=2, retain_versions=2)
    with sk.StateBackend(str(tmp_path / "root"), config=config) as backend:
        with backend.open(OP, 0, partitions=1) as store:
            for v in range(1, 8):
                store.put(b"k", b"%d" % v)
                store.commit()
                backend.wait_for_snapshots()
        backend.gc()
        restorable = backend.versions(OP, 0)
        assert restorable[0] > 1  # GC moved the base past version 1
        with pytest.raises(sk.StateNotFoundError, match="restorable versions are"):
            _feed(backend, 1, 7)
        with pytest.raises(sk.StateNotFoundError, match=r"version 9 .* does not exist"):
            _feed(backend, restorable[0], 9)
        with pytest.raises(ValueError, match="from_version <= to_version, got 7 > 6"):
            _feed(backend, 7, 6)
        assert [c.value for c in _feed(backend, restorable[0], 7)][-1] == b"7"


def test_a_changelog_of_another_attempt_is_refused(tmp_path: Path) -> None:
    with _backend(tmp_path, "changelog", 0) as backend:
        with backend.open(OP, 0, partitions=1) as store:
            for v in range(1, 4):
                store.put(b"k", b"%d" % v)
                store.commit()
        feed = _feed(backend, 0, 3)
        first, second = feed.changelog_keys()[:2]
        backend.blobs.put(first, backend.blobs.get(second), overwrite=True)
        with pytest.raises(sk.CorruptStateError, match=first):
            list(_feed(backend, 0, 3))


def test_diff_items_is_the_merge_of_two_sorted_scans() -> None:
    before = [(b"a", b"1"), (b"b", b"2"), (b"d", b"4")]
    after = [(b"b", b"2"), (b"c", b"3"), (b"d", b"5"), (b"e", b"")]
    assert list(diff_items(before, after)) == [
        (b"a", None), (b"c", b"3"), (b"d", b"5"), (b"e", b""),
    ]  # fmt: skip
    assert list(diff_items([], after)) == after
    assert list(diff_items(before, [])) == [(k, None) for k, _ in before]


# -- keyed stores: value, map and list states with TTL, and timers ------------------------

_op = st.one_of(
    st.tuples(st.just("value"), st.sampled_from(KEYS), st.integers(-5, 5)),
    st.tuples(st.just("clear"), st.sampled_from(KEYS), st.none()),
    st.tuples(
        st.just("map_put"),
        st.sampled_from(KEYS),
        st.tuples(st.sampled_from("xyz"), st.integers(0, 9)),
    ),
    st.tuples(st.just("map_remove"), st.sampled_from(KEYS), st.sampled_from("xyz")),
    st.tuples(
        st.just("append"),
        st.sampled_from(KEYS),
        st.lists(st.integers(0, 9), min_size=1, max_size=3),
    ),
    st.tuples(st.just("list_put"), st.sampled_from(KEYS), st.lists(st.integers(0, 9), max_size=3)),
    st.tuples(st.just("timer"), st.sampled_from(KEYS), st.integers(0, 3)),
    st.tuples(st.just("untimer"), st.sampled_from(KEYS), st.integers(0, 3)),
)
_batch = st.tuples(
    st.sampled_from(["changelog", "changelog", "snapshot"]),
    st.integers(0, 2500),  # ms the clock moves before the batch: TTLs are 1-2 s
    st.lists(_op, max_size=10),
)


def _run_batch(store: sk.StateStore, now_ms: int, ops: list[Any]) -> None:
    handle = StatefulProcessorHandle(
        store, now_ms=now_ms, batch_id=store.version, partition=0, key_groups=GROUPS,
        time_mode="processing_time",
    )  # fmt: skip
    value = handle.value_state("v", ttl=2)
    mapped = handle.map_state("m", ttl=1)
    listed = handle.list_state("l", ttl=1.5)
    plain = handle.list_state("p")
    handle.record_operator(["k"], key_schema=None, operator=OP)
    for kind, key, arg in ops:
        handle.set_key(key, ord(key[0][0]) % GROUPS)
        if kind == "value":
            value.update(arg)
        elif kind == "clear":
            value.clear()
            plain.clear()
        elif kind == "map_put":
            mapped.put(*arg)
        elif kind == "map_remove":
            mapped.remove(arg)
        elif kind == "append":
            listed.extend(arg)
            plain.extend(arg)
        elif kind == "list_put":
            listed.put(arg)
        elif kind == "timer":
            handle.register_timer(now_ms + arg * 1000)
        else:
            handle.delete_timer(now_ms + arg * 1000)
    handle.set_key(None)
    handle.expire()


Decoded = dict[tuple[Any, ...], tuple[Any, Any]]


def _decoded(decoder: ChangeDecoder, changes: Iterator[StoreChange], into: Decoded) -> Decoded:
    out = dict(into)
    for change in changes:
        found = decoder.decode(change)
        if found is None:
            continue
        where = (found.state, found.key, found.kind, found.entry)
        if found.operation == "delete":
            out.pop(where, None)
        else:
            out[where] = (found.value, found.expires_at_ms)
    return out


def _as_read(decoded: Decoded) -> tuple[list[Any], list[Any]]:
    """The decoded state as iter_state and iter_timers show it: list elements by position."""
    entries = []
    lists: dict[tuple[Any, ...], list[Any]] = {}
    for (state, key, kind, entry), (value, expiry) in sorted(decoded.items(), key=repr):
        if kind == "timer":
            continue
        if kind == "list":
            lists.setdefault((state, key), []).append((entry, value, expiry))
        else:
            entries.append((state, key, entry, value, expiry))
    for (state, key), items in lists.items():
        for position, (_, value, expiry) in enumerate(sorted(items, key=lambda i: i[0])):
            entries.append((state, key, position, value, expiry))
    timers = sorted((key, entry) for (state, key, kind, entry) in decoded if kind == "timer")
    assert all(s == TIMER_STATE for (s, _, kind, _) in decoded if kind == "timer")
    return sorted(entries, key=repr), timers


@settings(
    max_examples=25,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batches=st.lists(_batch, min_size=1, max_size=6), data=st.data())
def test_keyed_feed_with_ttl_expiry_applied_to_a_is_b(
    tmp_path_factory: pytest.TempPathFactory,
    batches: list[tuple[str, int, list[Any]]],
    data: st.DataObject,
) -> None:
    tmp = tmp_path_factory.mktemp("keyed")
    now = 1_000_000
    backends = {mode: _backend(tmp, mode, i) for i, mode in enumerate(("changelog", "snapshot"))}
    for mode, step, ops in batches:
        now += step
        with backends[mode].open(OP, 0, partitions=1) as store:
            _run_batch(store, now, ops)
            store.commit()
    last = len(batches)
    a = data.draw(st.integers(0, last - 1), label="a")
    b = data.draw(st.integers(a + 1, last), label="b")
    backends["snapshot"].close()
    with backends["changelog"] as backend:
        items_a = _items(backend, a)
        with backend.open(OP, 0, b) as store:
            record = read_operator_record(store)
            entries = (
                (e.state, e.key, e.entry, e.value, e.expires_at_ms) for e in iter_state(store)
            )
            read_b = (
                sorted(entries, key=repr),
                sorted((t.key, t.expiry_ms) for t in iter_timers(store)),
            )
            items_b = dict(store.scan())
        assert record is not None

        def decoded(version: int, items: dict[bytes, bytes]) -> Decoded:
            changes = (StoreChange(version, k, x) for k, x in items.items())
            return _decoded(ChangeDecoder(record), changes, {})

        # The decoded items of a version are what the readers of state show.
        assert _as_read(decoded(b, items_b)) == read_b
        changes = list(_feed(backend, a, b))
        assert _apply(items_a, changes) == items_b
        after = _decoded(ChangeDecoder(record), iter(changes), decoded(a, items_a))
        assert after == decoded(b, items_b)


def test_ttl_expiry_and_timers_show_as_deletes_and_bookkeeping_is_hidden(tmp_path: Path) -> None:
    with _backend(tmp_path, "changelog", 0) as backend:
        with backend.open(OP, 0, partitions=1) as store:
            _run_batch(store, 1000, [("map_put", ("a",), ("x", 1)), ("timer", ("a",), 2)])
            store.commit()
            _run_batch(store, 2500, [("append", ("b",), [7, 8])])  # the map entry expires
            store.commit()
            record = read_operator_record(store)
        assert record is not None
        decoder = ChangeDecoder(record)
        raw = list(_feed(backend, 0, 2))
        shown = [decoder.decode(c) for c in raw]
        found = [(c.version, c.operation, c.state, c.key, c.entry, c.value) for c in shown if c]
        assert sorted(found, key=repr) == sorted(
            [
                (1, "put", "m", ("a",), "x", 1),
                (1, "put", TIMER_STATE, ("a",), 3000, None),
                (2, "delete", "m", ("a",), "x", None),
                (2, "put", "l", ("b",), 0, 7),
                (2, "put", "l", ("b",), 1, 8),
                (2, "put", "p", ("b",), 0, 7),
                (2, "put", "p", ("b",), 1, 8),
            ],
            key=repr,
        )
        # TTL index, timer index, list counters and the operator record are raw changes too.
        assert len(raw) > len(found) + 4
        expiry = next(c.expires_at_ms for c in shown if c and c.state == "m" and c.version == 1)
        assert expiry == 2000
