"""State handles on a real store: semantics, TTL with an explicit clock, append-only lists."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from statekeeper import StateBackend, StateKeeperError, StateStore, StoreConfig
from statekeeper.keyed import StatefulProcessorHandle, encode_key, ttl_prefix
from statekeeper.keyed._layout import floor_key, state_prefix

S = 1000  # ms per second


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[StateBackend]:
    with StateBackend(
        str(tmp_path / "root"), config=StoreConfig(local_dir=str(tmp_path / "local"))
    ) as backend:
        yield backend


@pytest.fixture
def store(backend: StateBackend) -> Iterator[StateStore]:
    with backend.open("op", 0) as store:
        yield store


def at(store: StateStore, now_ms: int, key: tuple[object, ...] = ("a",)) -> StatefulProcessorHandle:
    """A handle whose TTL clock reads ``now_ms``, bound to ``key``."""
    handle = StatefulProcessorHandle(store, now_ms=now_ms, batch_id=store.version, partition=0)
    handle.set_key(key)
    return handle


def test_value_state_ttl_hides_then_deletes(store: StateStore) -> None:
    at(store, 0).value_state("v", ttl=10).update(5)
    store.commit()
    assert at(store, 9 * S).value_state("v", ttl=10).get() == 5
    late = at(store, 10 * S)
    state = late.value_state("v", ttl=10)
    assert state.get() is None
    assert not state.exists()
    assert len(list(store.scan())) == 2  # still there: the value and its TTL index entry
    assert late.expire() == 1
    info = store.commit()
    assert (info.puts, info.deletes) == (1, 2)  # the put: the index's floor
    assert _keys(store) == [floor_key(ttl_prefix("v"))]


def _keys(store: StateStore) -> list[bytes]:
    return [k for k, _ in store.scan()]


def test_an_entry_written_below_the_ttl_index_floor_still_expires(store: StateStore) -> None:
    """Expiry raises the TTL index's floor past what it deleted; a later write below it (a
    batch clock that went back, as after a restart on another driver) lowers it again."""
    at(store, 0).value_state("v", ttl=10).update(1)
    store.commit()
    h = at(store, 100 * S)
    h.value_state("v", ttl=10)  # expire() cleans the states the processor declared
    assert h.expire() == 1  # the floor is now 100 s + 1 ms
    store.commit()
    back = at(store, 50 * S, ("b",))
    back.value_state("v", ttl=10).update(2)  # expires at 60 s
    assert back.expire() == 0  # as every batch does: the floor is kept
    store.commit()
    late = at(store, 70 * S, ("b",))
    state = late.value_state("v", ttl=10)
    assert late.expire() == 1
    assert state.get() is None
    store.commit()
    assert _keys(store) == [floor_key(ttl_prefix("v"))]


@pytest.mark.parametrize("seed", range(4))
def test_ttl_expiry_matches_a_model_through_index_floors(backend: StateBackend, seed: int) -> None:
    """Random writes, clears and a clock that mostly advances and sometimes goes back; after
    each batch's ``expire`` the store holds exactly the values whose expiry is after the
    clock, whatever the index's floor skipped (reopened now and then: it is read back)."""
    import random

    rnd = random.Random(seed)
    model: dict[str, int] = {}  # key -> expiry ms
    clock = 0
    store = backend.open("op", 0)
    try:
        for _ in range(60):
            clock = max(0, clock + rnd.choice([-30, 2, 5, 5, 8, 15]) * S)
            for k in rnd.sample([f"k{i}" for i in range(10)], rnd.randint(0, 5)):
                state = at(store, clock, (k,)).value_state("v", ttl=10)
                if k in model and rnd.random() < 0.25:
                    state.clear()
                    del model[k]
                else:
                    state.update(clock)
                    model[k] = clock + 10 * S
            batch = at(store, clock)
            batch.value_state("v", ttl=10)
            expired = batch.expire()
            gone = {k for k, expiry in model.items() if expiry <= clock}
            assert expired == len(gone), (seed, clock)
            model = {k: e for k, e in model.items() if k not in gone}
            store.commit()
            held = sorted(k for k, _ in store.scan(state_prefix("v")))
            assert held == sorted(state_prefix("v") + encode_key((k,)) for k in model), clock
            if rnd.random() < 0.1:
                store.close()
                store = backend.open("op", 0)
    finally:
        store.close()


def test_an_update_restarts_the_ttl(store: StateStore) -> None:
    at(store, 0).value_state("v", ttl=10).update(1)
    at(store, 8 * S).value_state("v", ttl=10).update(2)
    later = at(store, 12 * S)
    assert later.expire() == 0  # the old index entry is gone with the old value
    assert later.value_state("v", ttl=10).get() == 2
    assert len(list(store.scan())) == 2


def test_map_state_ttl_is_per_entry(store: StateStore) -> None:
    at(store, 0).map_state("m", ttl=10).put("x", 1)
    at(store, 5 * S).map_state("m", ttl=10).put("y", 2)
    h = at(store, 12 * S)
    m = h.map_state("m", ttl=10)
    assert dict(m.items()) == {"y": 2}
    assert not m.contains("x")
    assert m.get("x", "gone") == "gone"
    assert h.expire() == 1
    h = at(store, 16 * S)
    assert not h.map_state("m", ttl=10).exists()
    assert h.expire() == 1  # y expired too
    assert _keys(store) == [floor_key(ttl_prefix("m"))]


def test_list_state_ttl_is_per_element_and_drops_the_counter(store: StateStore) -> None:
    at(store, 0).list_state("l", ttl=10).append("x")
    at(store, 5 * S).list_state("l", ttl=10).append("y")
    h = at(store, 12 * S)
    assert h.list_state("l", ttl=10).get() == ["y"]
    assert h.expire() == 1
    h = at(store, 16 * S)
    lst = h.list_state("l", ttl=10)  # expire() cleans the states the processor declared
    assert h.expire() == 1
    assert not lst.exists()
    # elements, index entries and the counter: only the index's floor is left
    assert _keys(store) == [floor_key(ttl_prefix("l"))]


def test_list_append_writes_only_the_new_elements(backend: StateBackend) -> None:
    with backend.open("op", 0) as store:
        at(store, 0).list_state("events").extend(range(500))
        assert store.commit().puts == 501  # 500 elements and the counter
    with backend.open("op", 0, version=1) as store:
        events = at(store, 0).list_state("events")
        events.append(500)
        events.extend([501, 502])
        info = store.commit()
        assert (info.puts, info.deletes) == (4, 0)  # 3 elements and the counter
        assert info.raw_bytes < 200
        assert events.get() == list(range(503))


def test_list_put_and_clear(store: StateStore) -> None:
    lst = at(store, 0).list_state("l")
    lst.extend([1, 2, 3])
    lst.put(["a"])
    assert lst.get() == ["a"]
    lst.clear()
    assert lst.get() == []
    assert not lst.exists()
    assert list(store.scan()) == []


def test_states_are_isolated_by_key_and_name(store: StateStore) -> None:
    at(store, 0, ("a",)).value_state("v").update("a")
    at(store, 0, ("ab",)).value_state("v").update("ab")
    at(store, 0, ("a",)).value_state("w").update("w")
    m = at(store, 0, ("a",)).map_state("m")
    m.put(2, "two")
    m.put(-1, "minus one")
    m.put(10, "ten")
    at(store, 0, ("ab",)).map_state("m").put(0, "other key")
    assert at(store, 0, ("a",)).value_state("v").get() == "a"
    assert at(store, 0, ("ab",)).value_state("v").get() == "ab"
    assert list(m.keys()) == [-1, 2, 10]  # in key order, only key ("a",)
    m.remove(2)
    assert list(m.values()) == ["minus one", "ten"]
    m.clear()
    assert not m.exists()
    assert at(store, 0, ("ab",)).map_state("m").get(0) == "other key"


def test_misuse_is_refused(store: StateStore) -> None:
    handle = StatefulProcessorHandle(store, now_ms=0, batch_id=0, partition=0)
    state = handle.value_state("v")
    with pytest.raises(StateKeeperError, match="only be read or written inside handle_input_rows"):
        state.get()
    with pytest.raises(StateKeeperError, match="already declared as a value state"):
        handle.map_state("v")
    with pytest.raises(ValueError, match="positive duration"):
        handle.value_state("t", ttl=0)
    with pytest.raises(ValueError, match="state name"):
        handle.value_state("bad name")
    no_clock = StatefulProcessorHandle(store, now_ms=None, batch_id=0, partition=0)
    no_clock.set_key(("a",))
    with pytest.raises(StateKeeperError, match="timestamp is unknown"):
        no_clock.value_state("t", ttl=5).update(1)


class CountingStore:
    """A real store behind a wrapper that counts its single and multi reads."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.gets = 0
        self.multi_gets: list[int] = []

    def get(self, key: bytes) -> bytes | None:
        self.gets += 1
        return self.store.get(key)

    def multi_get(self, keys: list[bytes]) -> list[bytes | None]:
        self.multi_gets.append(len(keys))
        return self.store.multi_get(keys)

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)


def test_visited_keys_read_each_touched_state_with_one_multi_get_per_window(
    store: StateStore,
) -> None:
    keys = [(f"user-{i:05d}",) for i in range(3000)]
    setup = StatefulProcessorHandle(store, now_ms=0, batch_id=0, partition=0)
    for key in keys[::2]:
        setup.set_key(key)
        setup.value_state("count").update(1)
    store.commit()

    counting = CountingStore(store)
    handle = StatefulProcessorHandle(counting, now_ms=0, batch_id=1, partition=0)  # type: ignore[arg-type]
    count, unused = handle.value_state("count"), handle.value_state("unused")
    handle.visit_keys([encode_key(key) for key in keys])
    for position, key in enumerate(keys):
        handle.select(position, key)
        n = (count.get() or 0) + 1
        count.update(n)
        assert count.get() == n
    # Two windows of 2048 keys, one multi_get each; "unused" never read; one single read:
    # the operator record, when the states were declared (for their schemas).
    assert counting.multi_gets == [2048, 3000 - 2048]
    assert counting.gets == 1
    assert unused.ttl_ms is None
    handle.set_key(keys[0])
    assert count.get() == 2
    handle.set_key(keys[1])
    assert count.get() == 1
